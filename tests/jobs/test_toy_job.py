"""The default job (`python -m sage_jax.train`, no arguments) end to end, shrunken: warm start
(SFT, cached), calibration gate, RL, no-hint evaluation by difficulty, summary table and plot."""

import json

import numpy as np
import pytest

from sage_jax import train
from sage_jax import config
from sage_jax.infra.metrics import read_metrics
from sage_jax.jobs import toy_job
from sage_jax.tasks.toy import chains as toy, warm_start
from sage_jax.tasks.toy.toy_config import ToyConfig
from sage_jax.tasks import registry

pytestmark = pytest.mark.slow

SHRUNK = ["task.toy.min_steps=2", "task.toy.max_steps=3", "task.toy.sft_steps=12",
          "task.toy.sft_target_step_acc=0", "task.toy.calibrate_per_length=2",
          "task.toy.eval_per_length=2", "task.toy.eval_samples=2", "task.toy.problems=16",
          "train.steps=2", "rl.prompts_per_step=4", "rl.group_size=2", "rl.minibatches=1",
          "rl.max_new_tokens=36", "hint.max_new_tokens=72", "checkpoint.every=0"]


def test_every_toy_run_resolves_auto_before_the_loop(tmp_path, monkeypatch):
    """A toy run outside the default job (here: a model path, so no gate) still reaches
    `loop.train` with `hint.source: auto` resolved: to reference, without a gate."""
    seen = []
    monkeypatch.setattr(toy_job.loop, "train", lambda cfg, workdir: seen.append(cfg) or {})
    cfg = registry.load_config(config.DEFAULT_CONFIG, ["model.path=some/model"])
    assert cfg.hint.source == "auto" and cfg.rl.hinted
    toy_job.run(cfg, tmp_path)
    assert [c.hint.source for c in seen] == ["reference"]


def test_default_job_runs_end_to_end_and_caches_the_warm_start(tmp_path, capsys):
    cache = tmp_path / "cache"
    cfg = registry.load_config(config.DEFAULT_CONFIG, SHRUNK + [f"task.toy.cache_dir={cache}"])
    run = tmp_path / "run"
    train.run(cfg, run)
    out = capsys.readouterr().out
    # warm start trained once and cached as a Hugging Face folder
    (cached,) = cache.iterdir()
    assert (cached / "model.safetensors").is_file() and (cached / "sft.json").is_file()
    assert json.loads((cached / "sft.json").read_text())["steps"] == 12
    assert "warm start: SFT of the toy model" in out
    assert "per device: params 3.3 MiB, optimiser 6.6 MiB" in out  # 0.87M float32 params
    # the gate was measured and printed before RL
    cal = json.loads((run / "calibration.json").read_text())
    assert set(cal["gate"]) == {"all_zero", "l3_above_no_hint", "self_hints", "passed"}
    # hint.source: auto -> the gate picked the source (a 12-step SFT writes no right hint) and
    # RL used it; a resumed run reads the same choice from the run folder
    assert cal["hint_write_acc"]["1"] < 0.5 and cal["hint_source"] == "reference"
    assert "hint source: reference (auto:" in out
    assert registry.load_config(run / "config.yaml").hint.source == "reference"
    assert toy_job.with_hint_source(cfg, run).hint.source == "reference"
    assert cal["lengths"] == [2, 3] and "calibration" in out and "all-zero groups" in out
    # RL ran and logged every step; the summary has both tables and the plot
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    acc = json.loads((run / "eval_by_length.json").read_text())
    assert list(acc) == ["SFT start", "after sage (2 steps)"]
    for by_k in acc.values():
        assert sorted(by_k) == ["2", "3"] and all(0 <= v <= 1 for v in by_k.values())
    summary = (run / "summary.md").read_text()
    assert "| steps (k) | SFT start | after sage (2 steps) |" in summary
    assert "| 1-1 |" in summary and "reward" in summary and "all-zero groups" in summary
    assert "all-zero groups over the run" in summary or "No group was all-zero" in summary
    assert "## What the multi-seed studies found" in summary and "docs/toy_tail" in summary
    assert "## Time by phase" in summary and "| hint writing |" in summary
    assert "| whole step |" in summary
    png = (run / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # a second start reads the cache (same parameters), it does not train again
    model = warm_start.warm_started_model(cfg, progress=print)
    assert "cached SFT model" in capsys.readouterr().out
    first = warm_start.warm_started_model(cfg, progress=lambda s: None)
    from flax import nnx
    import jax
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(first))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a shipped checkpoint made with the same settings is used first; other settings skip it
    shipped = tmp_path / "shipped"
    import shutil
    shutil.copytree(cached, shipped)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(warm_start, "PACKAGED", shipped)
    try:
        warm_start.warm_started_model(cfg, progress=print)
        assert f"the shipped SFT model {shipped}" in capsys.readouterr().out
        other = registry.load_config(config.DEFAULT_CONFIG, SHRUNK + ["task.toy.sft_seed=5"])
        assert warm_start.packaged_settings() == warm_start.warm_start_settings(cfg)
        assert warm_start.packaged_settings() != warm_start.warm_start_settings(other)
    finally:
        monkey.undo()


@pytest.mark.parametrize("name,folder", [("toy_uniform", "PACKAGED"), ("toy_tail", "PACKAGED_TAIL"),
                                         ("toy", "PACKAGED_TAIL")])
def test_shipped_warm_start_matches_its_config(name, folder):
    """The checkpoints under sage_jax/tasks/toy/ are what the toy jobs load: each must have been
    made with its config's warm-start settings (else every fresh run retrains)."""
    cfg = registry.load_config(name, [])
    folder = getattr(warm_start, folder)
    shipped = warm_start.packaged_settings(folder)
    assert shipped is not None, f"no shipped warm start in {folder}"
    assert warm_start._same(shipped, warm_start.warm_start_settings(cfg))
    assert (folder / "model.safetensors").is_file()
    other = registry.load_config(name, ["task.toy.sft_seed=7"])
    assert not warm_start._same(shipped, warm_start.warm_start_settings(other))


def test_the_default_jobs_gate_picks_self_written_hints(tmp_path, capsys):
    """The default config is the hard split's: its shipped warm start writes its own hints right
    often enough that the gate (hint.source: auto) picks them, as the docs/toy_tail study's."""
    cfg = registry.load_config(config.DEFAULT_CONFIG, ["task.toy.calibrate_per_length=3"])
    assert cfg.task.section(ToyConfig).rare_operands == (7,)
    cal = toy_job.before_rl(cfg, tmp_path, warm_start.warm_started_model(cfg))
    assert cal is not None and cal["hint_source"] == "online", cal["hint_source_reason"]
    assert cal["hint_write_acc"][1] >= 0.5 and cal["gate"]["self_hints"]
    assert "hint source: online (auto:" in capsys.readouterr().out


def test_accuracy_by_split_separates_the_hard_split():
    problems = [toy.ToyProblem(1, (("+", 7), ("-", 2)), 9),
                toy.ToyProblem(1, (("+", 3), ("-", 2)), 9),
                toy.ToyProblem(4, (("-", 7), ("+", 4)), 12)]
    rewards = np.asarray([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    got = toy_job.accuracy_by_split(problems, rewards, (7,))
    assert got["hard"] == 0.25 and got["rest"] == 1.0 and got["all"] == 0.5
    assert (got["hard_problems"], got["rest_problems"]) == (2, 1)
    none = toy_job.accuracy_by_split(problems, rewards, ())
    assert np.isnan(none["hard"]) and none["rest"] == 0.5


def test_the_summary_says_whether_the_run_moved_the_hard_split():
    problems = [toy.ToyProblem(d, (("+", 7), ("-", 2)), 9) for d in range(4)]
    problems.append(toy.ToyProblem(1, (("+", 3), ("-", 2)), 9))  # not hard: not counted
    before = np.asarray([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    flat = toy_job.hard_split_change((problems, before), (problems, before.copy()), (7,))
    assert flat == {"diff": 0.0, "se": 0.0, "problems": 4}
    assert toy_job.hard_split_line(flat, 20).startswith("**20 RL steps did not move it**")
    noisy = np.asarray([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    change = toy_job.hard_split_change((problems, before), (problems, noisy), (7,))
    d = np.asarray([0.5, 0.0, 0.0, 0.0])
    assert change["diff"] == 0.125 and change["se"] == d.std(ddof=1) / 2
    assert "did not move it" in toy_job.hard_split_line(change, 20)  # 0.125 ± 0.245
    up = np.asarray([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    raised = toy_job.hard_split_change((problems, before), (problems, up), (7,))
    line = toy_job.hard_split_line(raised, 60)
    assert line.startswith("**60 RL steps raised it**: hard-split pass rate after − before "
                           "+0.875 ± ") and "its 4 problems" in line
    assert "docs/toy_tail/" in line


def test_hard_split_job_writes_one_level_per_request_and_reports_the_split(tmp_path, capsys):
    """configs/toy_tail.yaml's options, shrunk: its own warm start, one-level hint requests
    written by the policy during RL, and the summary's hard-split table."""
    tail = ["task.toy.rare_operands=[7]", "task.toy.rare_share=0.5", "task.toy.hint_format=level",
            "task.toy.sft_write_share=0.3", "hint.source=online", "task.toy.eval_per_length=4"]
    cfg = registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml",
                             SHRUNK + tail + [f"task.toy.cache_dir={tmp_path / 'cache'}"])
    run = tmp_path / "run"
    train.run(cfg, run)
    cal = json.loads((run / "calibration.json").read_text())
    assert "hint_leaked" in cal and 0 <= cal["hint_parse_rate"] <= 1
    rows = read_metrics(run)
    assert sum(r["hint/requests"] for r in rows) > 0  # one request per level and row
    split = json.loads((run / "eval_by_split.json").read_text())
    for acc in split.values():
        assert acc["hard_problems"] > 0 and acc["rest_problems"] > 0
    summary = (run / "summary.md").read_text()
    assert "## Hard split (operands [7])" in summary
    assert "hard-split pass rate after − before" in summary and "docs/toy_tail/" in summary
