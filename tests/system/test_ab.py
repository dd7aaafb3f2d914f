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
    assert "config: each side its own toy_tail.yaml" in run.stdout
    if rec["contended_pairs"]:  # a busy machine: no ratio, said so
        assert "every pair was contended" in run.stdout
    else:
        assert rec["result"]["ratio"] > 0 and set(rec["phases"]) == {"a", "b"}
