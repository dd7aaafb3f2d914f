"""What a result file records about where it came from: the source commit, the resolved config and
the seed.

    record(config_dict, seed) -> {"commit": "<sha>[+dirty]", "seed": seed, "config": config_dict}

The commit is the git HEAD of the checkout this package runs from, `+dirty` when tracked files
differ from it; an installed package without a checkout records `unknown (no git checkout)`.
"""

from __future__ import annotations

import functools
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
