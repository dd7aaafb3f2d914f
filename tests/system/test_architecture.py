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
    "sage_jax.engine": 2, "sage_jax.analysis": 3,
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


def _private_uses(path: Path) -> list[str]:
    """A module's uses of another package module's private names: `from sage_jax.x import _y`
    and `x._y` where `x` is a package module it imported."""
    tree = ast.parse(path.read_text())
    aliases, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sage_jax"):
            for a in node.names:
                if a.name.startswith("_"):
                    out.append(f"{path.name}:{node.lineno} imports {node.module}.{a.name}")
                aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname or a.name for a in node.names
                           if a.name.startswith("sage_jax"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            out.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    return out


def test_no_module_uses_a_private_name_of_another():
    bad = [u for m in MODULES for u in _private_uses(MODULES[m])]
    assert not bad, "\n".join(bad)


def test_the_private_name_reader_sees_both_forms(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from sage_jax.engine.sampler import sampling\nfrom sage_jax.core.grpo import _x\n"
                    "sampling._continuous(1)\nsampling.sample()\n")
    assert _private_uses(path) == ["probe.py:2 imports sage_jax.core.grpo._x",
                                   "probe.py:3 uses sampling._continuous"]


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


STOP = {"a", "an", "the", "of", "per", "each", "in", "one"}


def _top_level_split(text: str) -> list[str]:
    """`text` split at the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()]


def _meanings(legend: str) -> dict[str, str]:
    """{letter: its meaning} of a legend "B prompts, N = B*G rows, ..." (lower-case entries and
    anything else skipped)."""
    out = {}
    for entry in _top_level_split(legend):
        m = re.match(r"([A-Z][A-Za-z]*)( = \S+)?\s+(.*)", entry)
        if m:
            out[m[1]] = m[3] if m[3] else (m[2] or "")
    return out


def _words(text: str) -> set[str]:
    words = {w.rstrip("s") for w in re.findall(r"[a-z]+", text.lower())}
    return {w for w in words if len(w) > 2 and w not in STOP}


def _same_sense(a: str, b: str) -> bool:
    """Whether two meanings share a word (a prefix counts: vocab, vocabulary)."""
    return any(x.startswith(y) or y.startswith(x) for x in _words(a) for y in _words(b))


def _readme_meanings() -> dict[str, str]:
    text = " ".join((PACKAGE.parent / "README.md").read_text().split())
    para = text.split("one alphabet, `x_BxTxD`:", 1)[1].split(". The Python API", 1)[0]
    return _meanings(para)


def _legends() -> dict[str, str]:
    """{module path: its docstring's "Shapes" legend, up to the first sentence end}."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "Shapes" in doc:
            legend = " ".join(doc[doc.index("Shapes"):].split("\n\n")[0].split())
            legend = re.split(r"\.(?: [A-Z\"`]|$)", legend.split(":", 1)[1], maxsplit=1)[0]
            out[str(path.relative_to(PACKAGE.parent))] = legend
    return out


def test_module_shape_legends_give_each_letter_the_readme_meaning():
    """A module's own "Shapes: ..." legend uses the README's letters in the README's sense
    (a shared word), so N never counts heads nor M the dataset's prompts."""
    readme = _readme_meanings()
    assert len(readme) >= 20, readme
    legends = _legends()
    assert len(legends) >= 5, legends
    wrong = [f"{path}: {letter} = {meaning!r} (README: {readme.get(letter)!r})"
             for path, legend in legends.items()
             for letter, meaning in _meanings(legend).items()
             if letter not in readme or not _same_sense(meaning, readme[letter])]
    assert not wrong, "\n".join(wrong)


def _rank(name: str | None) -> int | None:
    """The number of axes a shape-suffixed name declares (`x_BxT`: 2); None without a suffix."""
    m = re.search(r"_([A-Z](?:x[A-Z0-9])*)$", name or "")
    return len(m[1].split("x")) if m else None


def _arg_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    return None


def _rank_mismatches(trees: dict[str, ast.Module]) -> list[str]:
    """Calls that pass a shape-suffixed value to a shape-suffixed parameter of another rank
    (functions of the package with a unique name; keyword and positional arguments)."""
    params: dict[str, list[str] | None] = {}
    for tree in trees.values():  # module-level functions and methods (not nested helpers)
        nodes = tree.body + [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
        for fn in nodes:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
                names = names[1:] if names[:1] in (["self"], ["cls"]) else names
                names += [a.arg for a in fn.args.kwonlyargs]
                params[fn.name] = None if fn.name in params else names
    bad = []
    for path, tree in trees.items():
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            callee = _arg_name(call.func)
            names = params.get(callee or "")
            if not names:
                continue
            pairs = [(names[i], a) for i, a in enumerate(call.args)
                     if i < len(names) and not isinstance(a, ast.Starred)]
            pairs += [(k.arg, k.value) for k in call.keywords if k.arg in names]
            for param, value in pairs:
                got, want = _rank(_arg_name(value)), _rank(param)
                if got is not None and want is not None and got != want:
                    bad.append(f"{path}:{call.lineno}: {callee}({param}=...{_arg_name(value)})")
    return bad


def test_shape_names_agree_in_rank_across_calls():
    """A value named `x_NxL` never lands in a parameter named `y_N` (the names would lie)."""
    trees = {str(p.relative_to(PACKAGE.parent)): ast.parse(p.read_text())
             for p in PACKAGE.rglob("*.py")}
    assert not _rank_mismatches(trees)
    probe = ast.parse("def f(adv_N):\n    pass\nf(batch['advantages_ZxL'])\nf(adv_N=x_BxT)\n")
    assert len(_rank_mismatches({"probe": probe})) == 2  # the check can fail


def _letters(name: str | None) -> str | None:
    m = re.search(r"_([A-Z](?:x[A-Z0-9])*)$", name or "")
    return m[1] if m else None


def _letter_mismatches(trees: dict[str, ast.Module]) -> list[str]:
    """Keyword arguments whose keyword and value both carry shape letters, and other ones
    (`segments_BxT=segments_ZxL`): a keyword names what it hands over, so its letters match."""
    bad = []
    for path, tree in trees.items():
        for call in ast.walk(tree):
            if isinstance(call, ast.Call):
                for kw in call.keywords:
                    want, got = _letters(kw.arg), _letters(_arg_name(kw.value))
                    if want and got and want != got:
                        bad.append(f"{path}:{call.lineno}: {kw.arg}={_arg_name(kw.value)}")
    return bad


def test_keyword_arguments_hand_over_values_of_the_same_shape_letters():
    trees = {str(p.relative_to(PACKAGE.parent)): ast.parse(p.read_text())
             for p in PACKAGE.rglob("*.py")}
    assert not _letter_mismatches(trees)
    probe = ast.parse("f(seg_BxT=mb['segments_ZxL'], a_N=adv_N, m_NxL=x_NxT)\n")
    assert _letter_mismatches({"probe": probe}) == [  # the check can fail
        "probe:1: seg_BxT=segments_ZxL", "probe:1: m_NxL=x_NxT"]


def test_update_batch_split_unpacks_as_its_letters():
    """`batch_split()` returns (M, U, R): every unpacking names them m, u, r (or _)."""
    seen = 0
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and _arg_name(node.value.func) == "batch_split"
                    and isinstance(node.targets[0], ast.Tuple)):
                names = [t.id for t in node.targets[0].elts if isinstance(t, ast.Name)]
                assert all(n in (want, "_") for n, want in zip(names, "mur")), (path, names)
                seen += 1
    assert seen >= 3


def test_the_training_loop_names_no_rollout_engine():
    """The loop samples through `types.RolloutEngine` only (built by `run.build`): it names no
    engine, imports no sampler, and has no branch on which engine runs."""
    src = (PACKAGE / "run" / "loop.py").read_text()
    named = [w for w in ("vllm", "Vllm", "NativeEngine", "PolicySampler", "engine is None",
                         "engine is not None", "cfg.rollout.engine", "sampling.")
             if w in src]
    assert not named, named
    imported = {t for t in GRAPH["sage_jax.run.loop"][0]}
    assert not imported & {"sage_jax.run.vllm_engine", "sage_jax.engine.sampler.sampling"}, imported


# A layer's parts: where a block's wiring would be written again.
LAYER_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "rope",
               "rotary", "RMSNorm", "Linear")


def layer_parts_named(source: str) -> list[str]:
    """The layer parts (`LAYER_PARTS`) that `source` names as an attribute, name or call."""
    names = [n.attr if isinstance(n, ast.Attribute) else n.id
             for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Attribute, ast.Name))]
    return sorted({n for n in names if n in LAYER_PARTS or n.startswith("apply_rope")})


def test_the_decode_step_names_no_projection_or_norm():
    """engine/sampler/decode.py runs the model's own blocks (`Block.wire`, `Attention.qkv`):
    it owns the cache and the attention core only, and names no part of a layer."""
    assert layer_parts_named((PACKAGE / "engine" / "sampler" / "decode.py").read_text()) == []
    probe = "def step(blk, x):\n    return blk.self_attn.q_proj(blk.input_layernorm(x))\n"
    assert layer_parts_named(probe) == ["input_layernorm", "q_proj"]


def test_the_engine_is_two_rooms_that_do_not_import_each_other():
    """engine/ holds the sampler and the trainer, each a sub-package, and no module besides;
    neither imports the other (what they share is below them: models, infra)."""
    engine = PACKAGE / "engine"
    assert not list(engine.glob("*.py"))
    rooms = {p.name for p in engine.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == {"sampler", "trainer"}
    crossing = [f"{m} imports {t}" for m, (targets, _) in GRAPH.items()
                for a, b in (("sampler", "trainer"), ("trainer", "sampler"))
                if m.startswith(f"sage_jax.engine.{a}.")
                for t in targets if t.startswith(f"sage_jax.engine.{b}")]
    assert not crossing, crossing
    assert sum(m.startswith("sage_jax.engine.") for m in GRAPH) >= 12


def test_every_module_is_in_the_architecture_tree_and_every_folder_in_the_readme_table():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    tree = doc.split("## The tree", 1)[1].split("```")[1]
    missing = sorted(p.name for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" and "configs" not in p.parts
                     and p.name not in tree)
    assert not missing, f"docs/architecture.md's tree lacks {missing}"
    readme = (PACKAGE.parent / "README.md").read_text()
    table = "\n".join(line for line in readme.split("## Library", 1)[1].splitlines()
                      if line.startswith("|"))
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.rglob("*.py")))
    assert len(folders) >= 10, folders
    assert not [f for f in folders if f"`{f}/`" not in table], table


def test_the_readme_stays_short_and_keeps_what_it_shows_apart():
    """Under 160 lines; the findings have their own section, with a place for the SmolLM2
    study's primary row."""
    readme = (PACKAGE.parent / "README.md").read_text()
    assert len(readme.splitlines()) < 160
    shows = readme.split("## What it shows", 1)[1].split("\n## ", 1)[0]
    assert "<!-- claims: docs/toy_tail/claims.md -->" in shows
    assert "<!-- smollm2 study:" in shows
    assert "## What it shows" not in readme.split("## Run it, test it", 1)[0]
