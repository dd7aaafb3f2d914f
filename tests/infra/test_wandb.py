"""W&B logging, offline: the history W&B recorded (read back with wandb's own reader, `wandb leet
inspect --json`) equals metrics.jsonl step for step, across a resume into the same W&B run; the
config and the toy job's summary are logged; a missing wandb package fails at start."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sage_jax import config
from sage_jax import train
from sage_jax.infra.metrics import read_metrics
from sage_jax.run import build, loop
from sage_jax.tasks import registry

ARGS = ["rl.method=sage", "rl.prompts_per_step=4", "rl.group_size=2", "rl.minibatches=1",
        "rl.max_new_tokens=24", "hint.max_new_tokens=24", "task.toy.warm_start=false",
        "task.toy.calibrate=false", "task.toy.eval_per_length=1", "task.toy.eval_samples=1",
        "task.toy.min_steps=2", "task.toy.max_steps=3", "train.samples_every=0",
        "checkpoint.every=1", "logging.wandb=true", "logging.mode=offline",
        "logging.tags=[test]"]


def _records(wandb_file: Path) -> list[dict]:
    cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(cli), "leet", "inspect", "--json", str(wandb_file)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture
def wandb_service():
    """W&B's service (a wandb-core process) lives as long as the Python process that started
    it: stopped after the test instead of running beside the worker's later tests."""
    yield
    import wandb  # only where the test ran, which needs it
    wandb.teardown()


@pytest.mark.slow
def test_offline_history_equals_metrics_jsonl_across_a_resume(tmp_path, monkeypatch,
                                                              wandb_service):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train.run(registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml", ARGS + ["train.steps=2"]), run)
    train.run(registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml", ARGS + ["train.steps=3"]), run)
    run_id = (run / "wandb_id.txt").read_text().strip()
    files = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) >= 2  # the first run, its resume (and the summary of each job)
    records = [r for f in files for r in _records(f)]
    history = {}
    for r in records:
        if r.get("type") == "history":
            item = r["history"]["item"]
            history.setdefault(item["_step"], item)  # a re-logged step keeps its first row
    rows = read_metrics(run / "metrics.jsonl")
    assert sorted(history) == [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        logged = {k: v for k, v in history[row["step"]].items() if not k.startswith("_")}
        want = {k: v for k, v in row.items()  # NaN is null in metrics.jsonl, not logged
                if k != "step" and not (isinstance(v, float) and math.isnan(v))}
        assert logged == want, row["step"]
    configs = [r["run"]["config"] for r in records if r.get("type") == "run" and "config" in
               r["run"]]
    assert configs and any("rl" in json.dumps(c) and "group_size" in json.dumps(c)
                           for c in configs)
    summaries = [json.dumps(r) for r in records if r.get("type") == "summary"]
    assert any("summary/table" in s and "summary/plot" in s for s in summaries)


def test_a_missing_wandb_package_fails_at_start(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))

    def no_model(cfg):
        raise AssertionError("the model was loaded before the missing package was noticed")

    monkeypatch.setattr(build, "load_model", no_model)
    with pytest.raises(config.ConfigError, match="logging.wandb=true needs the wandb package"):
        loop.train(registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml",
                                        ARGS + ["train.steps=1", "hint.source=online"]), tmp_path)
