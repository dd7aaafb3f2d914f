"""scripts/ab.py: two commits side by side, each child importing its own tree, and the ratio
of medians with a bootstrap interval."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import ab  # noqa: E402


def test_the_ratio_and_its_interval_come_from_the_samples():
    rng = np.random.default_rng(1)
    a = [list(1.0 + 0.1 * rng.random(12)) for _ in range(3)]
    same = ab.ratio_interval(a, a)
    assert same["ratio"] == 1.0 and same["ci95"][0] < 1.0 < same["ci95"][1]
    slower = ab.ratio_interval(a, [[1.2 * x for x in run] for run in a])
    assert slower["ratio"] == pytest.approx(1.2)
    assert 1.0 < slower["ci95"][0] <= 1.2 <= slower["ci95"][1] < 1.4
    assert slower["b_median"] == pytest.approx(1.2 * slower["a_median"])


def test_the_interval_counts_the_spread_between_runs():
    """Three runs a side whose levels overlap, each run tight: resampling only within runs
    would call B slower; the spread between runs says it cannot tell."""
    rng = np.random.default_rng(2)
    tight = lambda level: list(level + 0.001 * rng.random(8))  # noqa: E731
    a = [tight(x) for x in (1.00, 1.05, 1.20)]
    b = [tight(x) for x in (1.02, 1.12, 1.25)]
    got = ab.ratio_interval(a, b)
    assert got["ratio"] > 1.05 and got["ci95"][0] < 1.0 < got["ci95"][1]


def _fake_tree(root: Path) -> tuple[Path, str]:
    """A git checkout whose `python -m sage_jax.bench` prints a bench record naming its commit,
    read from git in its own folder."""
    tree = root / "fake"
    (tree / "sage_jax" / "bench").mkdir(parents=True)
    (tree / "sage_jax" / "__init__.py").write_text("")
    (tree / "sage_jax" / "bench" / "__init__.py").write_text("")
    (tree / "sage_jax" / "bench" / "__main__.py").write_text(
        "import json, pathlib, subprocess\n"
        "here = pathlib.Path(__file__).parent\n"
        "sha = subprocess.run(['git', '-C', str(here), 'rev-parse', 'HEAD'], capture_output=True,"
        " text=True).stdout.strip()\n"
        "print(json.dumps({'times_s': [1.0, 2.0], 'commit': sha, 'file': __file__}))\n")
    git = lambda *a: subprocess.run(["git", "-C", str(tree), *a], check=True,  # noqa: E731
                                    capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "fake")
    return tree.resolve(), git("rev-parse", "HEAD")


def test_each_run_executes_the_code_of_its_own_tree(tmp_path):
    """Run from this repository's root, a child would import this checkout's sage_jax (python
    -m puts the working directory first on sys.path); the run must import its side's tree, and
    a child that reports another commit than its side's is refused."""
    tree, sha = _fake_tree(tmp_path)
    w = ab.Workload(bench=("fake",))
    cmd = ab.command(w, sys.executable, None, tmp_path, None)
    (tmp_path / "r0").mkdir()
    run = ab.run_side(w, cmd, tree, sha, tmp_path / "r0", ab.side_env(tree, tmp_path))
    assert run["samples_s"] == [1.0, 2.0] and run["reported_commit"] == sha
    record = json.loads((tmp_path / "r0" / "log.txt").read_text().splitlines()[-1])
    assert Path(record["file"]).resolve().is_relative_to(tree)
    (tmp_path / "r1").mkdir()
    with pytest.raises(SystemExit, match="reports commit"):
        ab.run_side(w, cmd, tree, "0" * 40, tmp_path / "r1", ab.side_env(tree, tmp_path))


def test_a_side_that_imports_another_tree_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()  # no sage_jax here: the child would import the installed one
    with pytest.raises(SystemExit, match="imports sage_jax from"):
        ab.check_side(sys.executable, tmp_path / "empty", "0" * 40, tmp_path)
    assert ab.check_side(sys.executable, REPO, ab.checkout(str(REPO), tmp_path)[1], tmp_path)


@pytest.mark.slow
def test_two_commits_side_by_side_on_the_toy(tmp_path):
    """HEAD checked out into a worktree against this checkout, 3 toy GRPO steps each."""
    work = tmp_path / "work"
    out = tmp_path / "ab.json"
    try:
        run = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "ab.py"), "--a", "HEAD", "--b", str(REPO),
             "--workload", "toy_grpo", "--repeats", "1", "--steps", "3", "--work", str(work),
             "--json", str(out)], capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        for wt in work.glob("wt-*"):
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)])
    rec = json.loads(out.read_text())
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert rec["a"]["commit"] == rec["a"]["reported"] == head
    assert rec["b"]["commit"].startswith(head) and rec["config_from"] == "own"
    assert [(r["side"], len(r["samples_s"])) for r in rec["runs"]] == [("a", 1), ("b", 1)]
    assert [r["reported_commit"] for r in rec["runs"]] == [head, rec["b"]["commit"]]
    assert "config: each side its own toy_tail.yaml" in run.stdout
    if rec["contended_pairs"]:  # a busy machine: no ratio, said so
        assert "every pair was contended" in run.stdout
    else:
        assert rec["result"]["ratio"] > 0 and set(rec["phases"]) == {"a", "b"}
