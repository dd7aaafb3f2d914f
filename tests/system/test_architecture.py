"""The package's import graph points one way: no cycle, no import up the layers, no import hidden
in a function body (except of a genuinely optional dependency), and no library module imports an
entry command. Read from the source with `ast`, so a new module is checked without a list."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sage_jax"

# Low to high; a module may import only from its own layer or below. Matched by longest prefix.
LAYERS = {
    "sage_jax": 0, "sage_jax.config": 0, "sage_jax.infra": 0, "sage_jax.models": 0,
    "sage_jax.core": 1,
    "sage_jax.engine": 2,
    "sage_jax.tasks": 3,
    "sage_jax.rl": 4, "sage_jax.eval": 4,
    "sage_jax.run": 5,
    "sage_jax.jobs": 6,
    "sage_jax.train": 7, "sage_jax.evaluate": 7, "sage_jax.export": 7, "sage_jax.sft": 7,
    "sage_jax.bench": 7, "sage_jax.aot": 7,
}
ENTRY = 7
# Imports that may sit in a function body: optional or platform-specific, with the reason.
OPTIONAL = {
    "matplotlib": "loaded only when a summary plot is drawn (the Agg backend chosen first)",
    "matplotlib.pyplot": "loaded only when a summary plot is drawn (after matplotlib.use)",
    "tensorboardX": "TensorBoard logging when installed",
    "wandb": "W&B logging with logging.wandb (an optional dependency)",
    "resource": "POSIX only",
    "jax._src": "a private JAX helper that may move (guarded by try)",
    "vllm": "rollout.engine=vllm (the optional extra sage_jax[vllm]); importing it loads torch",
    "torch": "vLLM's weight loading, only with rollout.engine=vllm",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len,
               default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return LAYERS[best]


def _targets(module: str, node: ast.stmt) -> list[str]:
    """The modules an import statement names (package modules resolved to the file)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = module.split(".")
        if MODULES[module].name != "__init__.py":
            pkg = pkg[:-1]
        base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _imports(module: str) -> tuple[set[str], list[tuple[int, str]]]:
    """(package modules imported at module level, [(line, module) imported in a body])."""
    tree = ast.parse(MODULES[module].read_text())
    top: set[str] = set()
    hidden: list[tuple[int, str]] = []

    def visit(node, in_body: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: never executed
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in _targets(module, child):
                    if in_body:
                        hidden.append((child.lineno, t))
                    elif t.startswith("sage_jax"):
                        top.add(t)
            deeper = in_body or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            visit(child, deeper)

    visit(tree, False)
    return top, hidden


GRAPH = {m: _imports(m) for m in MODULES}


def test_no_import_cycle():
    graph = {m: {t for t in GRAPH[m][0] if t in MODULES and t != m} for m in MODULES}
    state: dict[str, int] = {}
    cycles = []

    def walk(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                walk(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_point_down_the_layers():
    up = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
          for m in MODULES for t in sorted(GRAPH[m][0]) if _layer(t) > _layer(m)]
    assert not up, "upward imports:\n" + "\n".join(up)


def test_no_library_module_imports_an_entry_command():
    bad = [f"{m} imports {t}" for m in MODULES if _layer(m) < ENTRY
           for t in GRAPH[m][0] if _layer(t) == ENTRY]
    assert not bad, "\n".join(bad)


def test_no_import_hides_in_a_function_body():
    hidden = [f"{MODULES[m].relative_to(PACKAGE.parent)}:{line} imports {t}"
              for m in MODULES for line, t in GRAPH[m][1] if t not in OPTIONAL]
    assert not hidden, "imports inside functions:\n" + "\n".join(hidden)


@pytest.mark.parametrize("source, want", [
    ("from sage_jax import train\n", {"sage_jax.train"}),
    ("from sage_jax.run import loop\n", {"sage_jax.run.loop"}),
    ("import sage_jax.core.grpo\n", {"sage_jax.core.grpo"}),
])
def test_the_graph_reader_sees_imports(tmp_path, monkeypatch, source, want):
    """The checks above can fail: the reader finds each form of import."""
    path = tmp_path / "probe.py"
    path.write_text(source + "def f():\n    from sage_jax import config\n")
    monkeypatch.setitem(MODULES, "sage_jax.probe", path)
    top, hidden = _imports("sage_jax.probe")
    assert top == want and hidden == [(len(source.splitlines()) + 2, "sage_jax.config")]


def _readme_alphabet() -> list[str]:
    """The letters the README's shape alphabet defines, in order (with repeats, if any)."""
    text = " ".join((PACKAGE.parent / "README.md").read_text().split())
    para = text.split("one alphabet, `x_BxTxD`:", 1)[1].split(". The Python API", 1)[0]
    return re.findall(r"(?:^ ?|, )([A-Z])(?: = \S+)? ", para)


def test_shape_suffixes_use_the_readme_alphabet_one_meaning_per_letter():
    letters = _readme_alphabet()
    assert len(letters) == len(set(letters)) >= 15, letters
    used = {}
    for path in PACKAGE.rglob("*.py"):
        for name in re.findall(r"\b[a-z][a-z0-9_]*?_([A-Z](?:x[A-Z0-9])*)\b", path.read_text()):
            for letter in name.split("x"):
                if not letter.isdigit():
                    used.setdefault(letter, str(path.relative_to(PACKAGE.parent)))
    unknown = {k: v for k, v in used.items() if k not in letters}
    assert not unknown, f"shape letters not in the README's alphabet: {unknown}"
