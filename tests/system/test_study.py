"""The toy reproduction study (`scripts/reproduce_toy.py`) end to end on a shrunken config: it
trains every arm, resumes a killed run from its checkpoint, skips finished runs, and reports."""

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import reproduce_toy  # noqa: E402
from sage_jax.run import loop  # noqa: E402
from sage_jax.infra.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow


def shrunk(cache):
    return ["task.toy.min_steps=2", "task.toy.max_steps=3", "task.toy.sft_steps=12",
            "task.toy.sft_target_step_acc=0", "task.toy.eval_samples=2",
            "rl.prompts_per_step=4", "rl.group_size=2", "rl.minibatches=1",
            "rl.max_new_tokens=36", "hint.max_new_tokens=72", f"task.toy.cache_dir={cache}"]


def test_study_runs_resumes_a_killed_run_and_skips_finished_ones(tmp_path, monkeypatch):
    out = tmp_path / "study"
    args = ["--seeds", "1", "--arms", "grpo,sage-ref", "--steps", "2", "--problems", "4",
            "--eval-per-length", "2", "--eval-every", "2", "--checkpoint-every", "1",
            "--out", str(out), *shrunk(tmp_path / "cache")]
    overrides = ["task.toy.eval_per_length=2", "task.toy.problems=4", *shrunk(tmp_path / "cache")]
    killed = out / "runs" / "sage-ref-s0"
    # a run killed after its first step: a checkpoint at step 1, one logged step
    loop.train(reproduce_toy.run_config("sage-ref", 0, 2, overrides, 1), killed, stop_after=1)
    assert [r["step"] for r in read_metrics(killed)] == [1]
    text = reproduce_toy.main(args)
    for arm in ("grpo", "sage-ref"):
        wd = out / "runs" / f"{arm}-s0"
        assert [r["step"] for r in read_metrics(wd)] == [1, 2]  # each step exactly once
        groups = [json.loads(x) for x in (wd / "groups.jsonl").read_text().splitlines()]
        assert [g["step"] for g in groups] == [1, 2] and len(groups[0]["id"]) == 4
        res = json.loads((wd / "study.json").read_text())
        assert res["provenance"]["seed"] == 0 and res["provenance"]["commit"]
        assert res["provenance"]["config"]["train"]["seed"] == 0
        assert res["provenance"]["config"]["rl"]["method"] == arm.split("-")[0]
        assert [c["step"] for c in res["curve"]] == [2]
        assert sorted(res["accuracy"]) == ["2", "3"]
        assert sorted(p.name for p in (wd / "checkpoints").iterdir()) == ["2"]
    assert "| grpo | 1 |" in text and "| sage-ref | 1 |" in text
    assert "## Hint transfer" in text and "## What the paper claims" in text
    assert "| sage-ref − grpo |" in (out / "claims.md").read_text()
    report = (out / "README.md").read_text()
    assert report == text
    for png in ("accuracy.png", "efficiency.png", "curves.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    results = json.loads((out / "results.json").read_text())
    assert {r["arm"] for r in results["runs"]} == {"grpo", "sage-ref"}
    assert set(results["write_accuracy"]["acc"]) == {"1", "2", "3"}

    # re-running trains nothing: every run is finished
    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")
    monkeypatch.setattr(loop, "train", no_training)
    assert reproduce_toy.main(args) == text
    # a later session: the run folders are gone, the committed results are enough
    import shutil
    shutil.rmtree(out / "runs")
    assert sorted(p.name for p in (out / "results").iterdir()) == ["grpo-s0.json",
                                                                   "sage-ref-s0.json"]
    assert reproduce_toy.main(args) == text
