"""What a result file records about where it came from: the source commit, the resolved config and
the seed.

    record(config_dict, seed) -> {"commit": "<sha>[+dirty]", "seed": seed, "config": config_dict}

The commit is the git HEAD of the checkout this package runs from, `+dirty` when tracked files
differ from it; an installed package without a checkout records `unknown (no git checkout)`.
`source_digest(module)` hashes the code a computation runs through (a cache key's code part).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import subprocess
from pathlib import Path
from typing import Any, Mapping

SOURCE = Path(__file__).resolve().parents[2]  # the checkout holding the sage_jax package
NO_CHECKOUT = "unknown (no git checkout)"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(SOURCE), *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()


@functools.cache
def commit() -> str:
    """The source commit (`+dirty` when tracked files differ), or `NO_CHECKOUT`."""
    try:
        if Path(_git("rev-parse", "--show-toplevel")).resolve() != SOURCE:
            return NO_CHECKOUT  # a wheel installed inside some other repository
        sha = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return NO_CHECKOUT
    return sha + ("+dirty" if dirty else "")


def record(config: Mapping[str, Any], seed: Any) -> dict[str, Any]:
    """The provenance block of a result file: commit, seed and the resolved config."""
    return {"commit": commit(), "seed": seed, "config": dict(config)}


def _spec(name: str):
    """The module spec of `name`, or None when it names no module (an attribute, say)."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, AttributeError, ValueError):
        return None


def _imported(module: str) -> set[str]:
    """The sage_jax modules that `module`'s source imports at its top level or anywhere else."""
    spec = _spec(module)
    if spec is None or spec.origin is None:
        return set()
    found = set()
    for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        for name in names:
            if name.split(".")[0] == "sage_jax" and _spec(name) is not None:
                found.add(name)
    return found


def source_files(*modules: str) -> dict[str, Path]:
    """{module name: source file} of `modules` and of every sage_jax module they import, directly
    or through others (a package with its `__init__`, where it has one)."""
    seen, todo = set(), list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages
        todo += sorted(_imported(name) - seen)
    origins = {name: _spec(name).origin for name in sorted(seen)}
    return {name: Path(o) for name, o in origins.items() if o}  # a namespace package has none


def source_digest(*modules: str) -> str:
    """sha256 of `source_files(*modules)` (names and bytes): it changes when any code that runs
    through those modules changes."""
    h = hashlib.sha256()
    for name, path in source_files(*modules).items():
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
