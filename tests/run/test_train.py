"""The trainer end to end on the toy task: every method, metrics, exact resume, crash safety."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from sage_jax.run import loop
from sage_jax.run import build, hf_export, restore
from sage_jax.infra import checkpoint, provenance, rewards
from sage_jax import config, evaluate, export, models, train
from sage_jax.infra.metrics import read_metrics
from sage_jax.infra.phases import PHASES, phase_sum
from sage_jax.rl import engines
from sage_jax.tasks import registry

TINY = ["rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=16",
        "hint.max_new_tokens=24", "rl.minibatches=2", "checkpoint.every=1", "checkpoint.keep=3",
        "train.samples_every=1", "task.toy.warm_start=false",
        "hint.source=online"]  # toy.yaml's auto is the toy job's to resolve, not loop.train's

REQUIRED = ["step", "reward/mean", "response/mean_length", "response/clipped_frac", "loss",
            "grad_norm", "clip/frac_low", "clip/frac_high", "entropy", "time/step_s",
            "time/sample_s", "time/reward_s", "time/update_s", "throughput/tokens_per_s",
            "programs/held", "programs/dropped"]
SAGE = ["collapse/frac_all_zero", "collapse/frac_all_one", "collapse/frac_all_zero_after",
        "hint/prompts_needing_hint", "hint/write_failed", "hint/used_level_1",
        "hint/used_level_2", "hint/used_level_3", "hint/rescued", "hint/acc_level_0",
        "hint/acc_level_1", "hint/acc_level_2", "hint/acc_level_3", "hint/frac_never_solved",
        "time/hint_s", "time/resample_s"] + [k for k, _ in PHASES]


def cfg(*overrides):
    return registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml", TINY + list(overrides))


@pytest.mark.parametrize("method", ["grpo", "sage", "sage_light", "resample"])
@pytest.mark.slow
def test_each_method_runs_and_writes_metrics(tmp_path, method):
    evals = (["eval.every=2", "eval.k=2", "eval.limit=4", "eval.max_new_tokens=16"]
             if method == "grpo" else [])
    # rollout.programs_kept=0: the sampler's programs are dropped after every step (the toy's
    # default keeps 360)
    kept = ["rollout.programs_kept=0"] if method == "resample" else []
    loop.train(cfg(f"rl.method={method}", "train.steps=2", *evals, *kept), tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["programs/held"] > 0 for r in rows)
    assert [r["programs/dropped"] for r in rows] == [1 if kept else 0] * 2
    if evals:  # in-training validation, no hints
        assert "eval/toy/avg@2" in rows[1] and "eval/toy/avg@2" not in rows[0]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["params/trainable"] == rows[0]["params/total"] > 0  # full fine-tuning
    for key in REQUIRED + SAGE:
        assert key in rows[-1], key
    for r in rows:  # the phases are disjoint and cover the step
        assert all(r[k] >= 0 for k, _ in PHASES), {k: r[k] for k, _ in PHASES}
        assert abs(phase_sum(r) - r["time/step_s"]) <= 0.01 * r["time/step_s"] + 0.005, (
            phase_sum(r), r["time/step_s"])
        assert r["time/resample_s"] == pytest.approx(sum(
            r[f"time/resample_level_{lvl}_s"] for lvl in (1, 2, 3)))
    for r in rows:
        assert r["hint/used_level_1"] <= r["hint/prompts_needing_hint"] or method == "resample"
        assert 0 <= r["collapse/frac_all_zero_after"] <= r["collapse/frac_all_zero"] + 1e-9
        assert np.isfinite(r["loss"]) and r["time/step_s"] > 0
    assert (tmp_path / "config.yaml").is_file()
    saved = registry.load_config(tmp_path / "config.yaml", [])
    assert saved.rl.method == method
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["seed"] == saved.train.seed and prov["config"] == config.to_dict(saved)
    assert prov["commit"] == provenance.commit() != ""
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and {"problem", "responses", "rewards", "hint", "level", "hint_written"} <= set(
        samples[0])


@pytest.mark.slow
def test_the_rollout_correction_weighs_hinted_answers_in_the_context_they_were_sampled_in(
        tmp_path):
    """rl.loss_context=plain trains a hinted answer on its bare prompt; the correction's ratio
    is still the trainer's over the engine's in the hinted context, so with the native engine
    (the same weights) it stays near 1 and drops nothing."""
    loop.train(cfg("rl.method=sage", "train.steps=1", "rl.loss_context=plain",
                   "hint.source=reference", "rl.rollout_correction=sequence",
                   "rl.rollout_correction_cap=1.5"), tmp_path)
    (r,) = read_metrics(tmp_path / "metrics.jsonl")
    assert r["batch/hinted_token_frac"] > 0  # hinted answers were trained
    assert r["rollout_correction/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert 1.0 <= r["rollout_correction/ratio_max"] < 1.5
    assert r["rollout_correction/masked_share"] == 0.0


@pytest.mark.slow
def test_the_kl_penalty_is_to_the_initial_policy_also_after_a_resume(tmp_path):
    """rl.kl_beta > 0: the update's reference is the initial policy, kept from before a resume
    restores the state (a resumed run logs the uninterrupted run's kl/ref); with LoRA it is the
    base, the adapters zeroed."""
    # one update a step: a step's kl/ref is that of the policy it starts from
    kl = ["rl.method=grpo", "train.steps=2", "rl.kl_beta=0.1", "rl.minibatches=1"]
    loop.train(cfg(*kl), tmp_path / "whole")
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    loop.train(cfg(*kl), tmp_path / "resumed", stop_after=1)
    loop.train(cfg(*kl), tmp_path / "resumed")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["kl/ref"] for r in resumed] == [r["kl/ref"] for r in whole]
    # step 1 starts at the reference, step 2 one update away from it
    steps = [r["kl/ref"] for r in whole]
    assert 0 <= steps[0] < 1e-9 and steps[1] > 1e-8, steps  # 0.0 and 7.4e-07 (weight decay)
    for r in whole:  # loss = pg_loss + beta * kl/ref, each a mean over the updates
        assert r["loss"] == pytest.approx(r["pg_loss"] + 0.1 * r["kl/ref"], rel=1e-5, abs=1e-7)
    loop.train(cfg(*kl, "model.lora.rank=4"), tmp_path / "lora")
    lora = read_metrics(tmp_path / "lora" / "metrics.jsonl")
    # B starts at zero: the policy is the base (a random toy policy earns no reward here, so
    # only weight decay moves it: the full run's 7.4e-07 at step 2, none for B = 0)
    assert [r["kl/ref"] for r in lora] == [0.0, 0.0]


def _params(workdir):
    _, model, step = restore.restore_policy(workdir)
    return step, _flat(model)


def _flat(model):
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def char_parity(response, ground_truth):
    """A registered reward that splits a random policy's groups (module level: the reward
    workers import it): the parity of the answer's character codes."""
    return float(sum(map(ord, response)) % 2)


@pytest.mark.slow
def test_a_lora_run_trains_samples_and_checkpoints_its_adapters_on_its_own_base_only(tmp_path,
                                                                                    capsys):
    """model.lora.rank=4 on a base at model.path: params/trainable counts the adapters (r * (in
    + out) per projection, by hand); the native engine samples with them (the trainer's
    log-probs over the engine's stay 1 at step 2, after step 1 moved them: the rollout
    correction's ratio); the checkpoint holds the adapters and their optimiser state, not the
    base (its size printed); a stopped run resumes bit for bit; the export folds them in and
    writes them alone for peft; resume, evaluate and export refuse another base of the same
    shapes in one line. (The update leaves the base bit-identical: tests/engine/test_update.py.)"""
    rewards.register_reward("test_char_parity", char_parity, overwrite=True)
    base = tmp_path / "base"
    models.to_hf(build.load_model(cfg()), base)  # the toy's random init as model.path
    c = cfg("rl.method=grpo", "train.steps=2", "model.lora.rank=4", "optim.lr=1e-2",
            "rl.rollout_correction=token", "rl.reward=test_char_parity", f"model.path={base}")
    loop.train(c, tmp_path / "straight")
    rows = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    dims = restore.model_config(c)
    d, f, q, kv = (dims.hidden_size, dims.intermediate_size, dims.num_heads * dims.head_dim,
                   dims.num_kv_heads * dims.head_dim)
    per_layer = 4 * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d))
    for r in rows:
        assert r["params/trainable"] == dims.num_layers * per_layer
        assert r["params/total"] == dims.num_params() + r["params/trainable"]
    assert rows[1]["rollout_correction/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    start = _flat(build.load_model(c))
    step, end = _params(tmp_path / "straight")
    assert step == 2 and set(start) == set(end)
    adapters = [k for k in start if k.endswith(("lora_a", "lora_b"))]
    assert len(adapters) == 2 * 7 * dims.num_layers
    for key in adapters:
        assert np.abs(end[key] - start[key]).max() > 1e-4, key

    # The checkpoint: the adapters, exactly params/trainable elements; a stop and a resume
    loop.train(c, tmp_path / "split", stop_after=1)
    out = capsys.readouterr().out
    ckpt = checkpoint.Checkpointer(tmp_path / "split", keep=3)
    saved = ckpt.restore_subtree(1, "params")
    names = ["/".join(map(str, k)) for k in _paths(saved)]
    assert names and all(n.split("/")[-2] in ("lora_a", "lora_b") for n in names), names
    assert sum(np.size(x) for x in jax.tree.leaves(saved)) == rows[0]["params/trainable"] < (
        0.1 * rows[0]["params/total"])
    size = ckpt.size_bytes(1)
    assert (f"checkpoint: step 1 is {size / 2**20:.1f} MiB on disk (the adapters and their "
            f"optimiser state (not the frozen base))") in out
    loop.train(c, tmp_path / "split")
    resumed_rows = read_metrics(tmp_path / "split" / "metrics.jsonl")
    drop = lambda r: {k: v for k, v in r.items()  # noqa: E731
                      if not k.startswith(("time/", "throughput/", "programs/"))}
    assert [r["step"] for r in resumed_rows] == [1, 2]
    np.testing.assert_equal(drop(resumed_rows[1]), drop(rows[1]))
    r_step, resumed = _params(tmp_path / "split")
    assert r_step == 2 and resumed.keys() == end.keys()
    for key in end:
        np.testing.assert_array_equal(resumed[key], end[key], err_msg=key)

    # The export folds the adapters into the kernels (models.merge_lora) and writes them alone
    # as a PEFT adapter folder (its parity with peft: tests/run/test_peft_export.py).
    info = hf_export.export_checkpoint(tmp_path / "straight", tmp_path / "export",
                                       log=lambda line: None)
    assert info["lora"] == (f"rank 4, alpha 16.0: merged into the kernels; the adapters alone "
                            f"in adapter/ (PEFT) for the base model {base}")
    tensors = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert not any("lora" in name for name in tensors)
    q = "layers/0/self_attn/q_proj/"
    want = end[q + "kernel"] + end[q + "lora_a"] @ end[q + "lora_b"] * 16.0 / 4
    np.testing.assert_allclose(tensors["model.layers.0.self_attn.q_proj.weight"].T, want,
                               rtol=1e-5, atol=1e-6)
    adapter = load_file(str(tmp_path / "export" / info["adapter"] / "adapter_model.safetensors"))
    assert len(adapter) == len(adapters)
    peft_q = "base_model.model.model.layers.0.self_attn.q_proj."
    np.testing.assert_array_equal(adapter[peft_q + "lora_A.weight"], end[q + "lora_a"].T)
    np.testing.assert_array_equal(adapter[peft_q + "lora_B.weight"], end[q + "lora_b"].T)

    # Another base: the same shapes, other weights
    models.to_hf(build.load_model(cfg("train.seed=1")), base)
    with pytest.raises(checkpoint.CheckpointMismatchError, match="another base model"):
        loop.train(cfg("rl.method=grpo", "train.steps=3", "model.lora.rank=4",
                       f"model.path={base}"), tmp_path / "split")
    for command, args in ((export.main, ["--checkpoint", str(tmp_path / "straight"),
                                         "--out", str(tmp_path / "export2")]),
                          (evaluate.main, ["--checkpoint", str(tmp_path / "straight"),
                                           "--limit", "2"])):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            command(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert "holds LoRA adapters of another base model" in err, err
    assert not (tmp_path / "export2" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_lora_run_with_rollout_lora_merged_samples_with_the_adapters_merged_each_step(
        tmp_path, monkeypatch):
    """rollout.lora_merged=true: the run's native engine samples the plain model with the
    adapters folded into its kernels (it holds no adapter) and folds them again at each sync:
    at step 2, after step 1 moved them (groups split by the parity reward), the trainer's
    log-probs over the engine's stay 1 on every token (the rollout correction's ratio, its mean
    and its max)."""
    built, real = [], build.rollout_engine

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(build, "rollout_engine", spy)
    rewards.register_reward("test_char_parity", char_parity, overwrite=True)
    loop.train(cfg("rl.method=grpo", "train.steps=2", "model.lora.rank=4", "optim.lr=1e-2",
                   "rl.rollout_correction=token", "rl.reward=test_char_parity",
                   "rollout.lora_merged=true", "checkpoint.every=0"), tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    (engine,) = built
    assert isinstance(engine, engines.NativeEngine) and engine.folder is not None
    assert not engines.has_adapters(engine.params)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["params/trainable"] < rows[0][
        "params/total"]
    for r in rows:  # the stale step-0 kernels at step 2: mean 1.03, max 1.8
        assert r["rollout_correction/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert r["rollout_correction/ratio_max"] == pytest.approx(1.0, abs=1e-4)


def _paths(tree):
    return [tuple(getattr(k, "key", k) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.slow
def test_resume_is_bit_identical_and_survives_a_crash_during_save(tmp_path, monkeypatch):
    c = cfg("rl.method=sage", "train.steps=4")
    straight, split = tmp_path / "straight", tmp_path / "split"
    loop.train(c, straight)
    loop.train(c, split, stop_after=2)
    assert checkpoint.Checkpointer(split, keep=3).latest_step() == 2

    # Crash while step 3's checkpoint is being written.
    real_save = checkpoint.Checkpointer.save

    def crashing_save(self, step, state, **kw):
        if step == 3:
            raise KeyboardInterrupt("killed during save")
        return real_save(self, step, state, **kw)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        loop.train(c, split)
    monkeypatch.undo()
    assert checkpoint.Checkpointer(split, keep=3).latest_step() == 2
    loop.train(c, split)  # resumes from step 2

    s_step, s_params = _params(straight)
    r_step, r_params = _params(split)
    assert s_step == r_step == 4
    for k in s_params:
        np.testing.assert_array_equal(s_params[k], r_params[k], err_msg=k)
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
    for ra, rb in zip(a[2:], b[2:]):
        np.testing.assert_equal(drop(ra), drop(rb))  # NaN == NaN here


def _data_files(step_dir):
    """The array data files of a saved step (orbax OCDBT), largest first."""
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and "/d/" in str(f)]
    return sorted(files, key=lambda f: -f.stat().st_size)


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """(config, a finished 3-step run with a checkpoint per step) of grpo on the toy task."""
    c = cfg("rl.method=grpo", "train.steps=3")
    run = tmp_path_factory.mktemp("three_steps") / "run"
    loop.train(c, run)
    return c, run


@pytest.mark.parametrize("damage", ["truncate", "truncate_no_checksums", "flip_byte"])
@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_costs_one_interval(three_steps, tmp_path, capsys, damage):
    """The newest checkpoint is cut short (as a partial copy leaves it) or has one flipped byte
    (caught by the checksums written at commit); without checksums the truncation is caught by
    the failing read. The re-run says so in one line, moves it to 3.corrupt, resumes from step 2
    and ends bit-identical to the uninterrupted run."""
    c, straight = three_steps
    broken = tmp_path / "broken"
    shutil.copytree(straight, broken)
    victim = _data_files(broken / "checkpoints" / "3")[0]
    data = bytearray(victim.read_bytes())
    if damage == "truncate_no_checksums":
        (broken / "checkpoints" / "3" / checkpoint.CHECKSUM_FILE).unlink()
    if damage.startswith("truncate"):
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    capsys.readouterr()
    loop.train(c, broken)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("checkpoint step 3 is corrupt"))
    assert "moved it to 3.corrupt" in line and "resumed from" in out
    if damage == "flip_byte":
        assert victim.name in line and "checksum" in line
    assert (broken / "checkpoints" / "3.corrupt").is_dir()  # set aside, never deleted
    assert [r["step"] for r in read_metrics(broken / "metrics.jsonl")] == [1, 2, 3]
    s_step, s_params = _params(straight)
    r_step, r_params = _params(broken)
    assert s_step == r_step == 3
    for k in s_params:
        np.testing.assert_array_equal(s_params[k], r_params[k], err_msg=k)


@pytest.mark.slow
def test_resume_step_rolls_back_once_and_no_good_checkpoint_is_one_error(three_steps, tmp_path,
                                                                          capsys):
    c, done = three_steps
    tmp_path = tmp_path / "run"
    shutil.copytree(done, tmp_path)
    back = cfg("rl.method=grpo", "train.steps=3", "train.resume_step=1")
    loop.train(back, tmp_path)  # steps 2 and 3 set aside, then trained again from step 1
    out = capsys.readouterr().out
    assert "set checkpoint 3.superseded aside" in out and "set checkpoint 2.superseded aside" in out
    assert checkpoint.Checkpointer(tmp_path, keep=3).all_steps() == [1, 2, 3]
    loop.train(back, tmp_path)  # the same command again: nothing is rolled back
    assert "superseded" not in capsys.readouterr().out
    for step in (1, 2, 3):
        _data_files(tmp_path / "checkpoints" / str(step))[0].write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in .* restores"):
        loop.train(c, tmp_path)


@pytest.mark.slow
def test_a_full_disk_during_save_stops_cleanly_and_keeps_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    worker = Path(__file__).resolve().parents[1] / "diskfull_worker.py"
    got = subprocess.run([sys.executable, str(worker), str(run)], capture_output=True, text=True,
                         timeout=600)
    assert got.returncode == 2, got.stderr[-3000:]
    errors = [x for x in got.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, got.stderr[-3000:]  # one error line, after orbax's threads are done
    assert got.stderr.rstrip().endswith(errors[0])  # the last word, not lost among tracebacks
    last = errors[0]
    assert last.startswith("error: saving checkpoint step 2 ") and (
        "the last good checkpoint (step 1) is intact" in last and "The disk is full" in last), last
    assert checkpoint.Checkpointer(run, keep=3).all_steps() == [1]
    step, params = _params(run)  # the previous checkpoint still restores
    assert step == 1 and all(np.isfinite(v).all() for v in params.values())
    loop.train(cfg("rl.method=grpo", "train.steps=2", "train.samples_every=0"), run)
    assert checkpoint.Checkpointer(run, keep=3).all_steps() == [1, 2]  # and the run goes on


def always_right(response, ground_truth):
    """A registered reward for the test below (module level: the reward workers import it)."""
    return 1.0


@pytest.mark.slow
def test_rl_reward_picks_a_registered_reward_and_an_unknown_one_fails_early(tmp_path):
    rewards.register_reward("test_always_right", always_right, overwrite=True)
    metrics = loop.train(cfg("rl.method=grpo", "train.steps=1", "rl.reward=test_always_right"),
                         tmp_path / "run")
    assert metrics["reward/mean"] == 1.0  # the toy task's own reward would score a random policy 0
    with pytest.raises(config.ConfigError, match="rl.reward='nope': unknown reward 'nope'"):
        loop.train(cfg("rl.method=grpo", "train.steps=1", "rl.reward=nope"), tmp_path / "bad")


def test_bad_config_fails_before_compile(tmp_path):
    with pytest.raises(ValueError, match="rl.prompts_per_step"):
        loop.train(cfg("rl.prompts_per_step=3", "rl.minibatches=1", "rl.group_size=3",
                        "mesh.data=8", "train.steps=1"), tmp_path)


def test_console_names_the_overrides_and_the_config_file_not_the_whole_config(tmp_path, capsys):
    c, workdir = train.parse(["--workdir", str(tmp_path), "rl.method=grpo", "train.steps=3"])
    assert capsys.readouterr().out == (f"config: {config.DEFAULT_CONFIG}; overrides: "
                                       "rl.method=grpo train.steps=3\n")
    train.parse(["--config", "grpo_tiny", "--workdir", str(tmp_path)])
    assert capsys.readouterr().out.endswith("configs/grpo_tiny.yaml; overrides: none\n")
    with pytest.raises(ValueError):  # stops after the run folder's files, before compiling
        loop.train(cfg("rl.prompts_per_step=3", "rl.minibatches=1", "rl.group_size=3",
                        "mesh.data=8", "train.steps=1"), tmp_path)
    out = capsys.readouterr().out
    assert out.startswith(f"resolved config: {tmp_path / 'config.yaml'} (commit and seed: "
                          f"{tmp_path / 'provenance.json'})")
    assert "optim:" not in out and len(out.splitlines()) < 5
    saved = registry.load_config(tmp_path / "config.yaml")
    assert json.loads((tmp_path / "provenance.json").read_text())["config"] == config.to_dict(saved)


@pytest.mark.parametrize("method", ["sage", "sage_light"])
def test_an_unresolved_auto_hint_source_fails_before_the_rollout(tmp_path, monkeypatch, method):
    """Only the toy job resolves hint.source=auto: a math run with it fails before loading."""
    def no_model(cfg):
        raise AssertionError("the model was loaded with hint.source=auto unresolved")

    monkeypatch.setattr(loop.build, "load_model", no_model)
    math = registry.load_config(config.DEFAULT_CONFIG, [
        "task.name=math", "model.path=org/tiny-qwen", "data.train_files=[x.jsonl]",
        f"rl.method={method}", "hint.source=auto", "data.solution_key=solution"])
    with pytest.raises(config.ConfigError, match="hint.source='auto' is resolved only by the "
                                                 "toy job") as e:
        loop.train(math, tmp_path)
    assert e.value.key == "hint.source"
    for method in ("grpo", "resample"):  # these take no hints: auto is never read
        loop.check_hint_source(registry.load_config(config.DEFAULT_CONFIG, [
            f"rl.method={method}", "hint.source=auto"]))


def test_cli_unknown_key_names_the_closest(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["rl.grup_size=4"])
    assert e.value.code == 2
    assert "rl.group_size" in capsys.readouterr().err


@pytest.mark.slow
def test_sage_resamples_hinted_groups_with_the_real_sampler(tmp_path):
    """Dataset-column hints (hint.source=column): the escalation runs on the real model."""
    from sage_jax.tasks.toy import chains as toy
    rows = [{"problem": p.text, "answer": p.answer, "solution": p.solution,
             "hint": toy.hint_payload(toy.reference_hints(p))}
            for p in toy.make_problems(16, toy.ToySpec(4, 6), seed=3)]
    data = tmp_path / "toy_hints.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    loop.train(cfg("rl.method=sage", "train.steps=1", "hint.source=column",
                    f"data.train_files=[{data}]", "data.hint_key=hint"), run)
    (m,) = read_metrics(run / "metrics.jsonl")
    unresolved = round(m["collapse/frac_all_zero"] * 4)  # 4 prompts per step
    assert m["hint/prompts_needing_hint"] == unresolved
    assert m["hint/used_level_1"] == unresolved  # every unresolved prompt got a hinted group
    assert m["hint/used_level_3"] <= m["hint/used_level_2"] <= m["hint/used_level_1"]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    hinted = [s for s in samples if s["level"] > 0]
    assert len(hinted) == unresolved  # all 4 prompts are logged
    for s in hinted:  # a hinted group trains on the hinted context
        assert s["hint"] and s["hint"] in s["prompt"]


def test_a_stop_signal_also_reaches_a_handler_the_caller_installed():
    """A caller that runs several trainings (the study runner) learns of a SIGTERM that the
    loop turned into a checkpoint and a clean return; Ctrl-C's default handler is not called."""
    seen = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with loop._Stop() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        assert stop.requested and seen == [signal.SIGTERM]
        with loop._Stop() as stop:  # the default SIGINT handler would raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        assert stop.requested
    finally:
        signal.signal(signal.SIGTERM, old)


class _CountingEngine:
    """A `RolloutEngine` that passes everything to the run's own and counts it."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log
        self.name, self.trainer_logprobs = inner.name, inner.trainer_logprobs

    def sync(self, params):
        self.log.append("sync")
        return self.inner.sync(params)

    def sample(self, prompts, **kw):
        self.log.append("sample")
        _inside.append(True)
        try:
            return self.inner.sample(prompts, **kw)
        finally:
            _inside.pop()

    def logprob_gap(self, ro):
        return self.inner.logprob_gap(ro)

    def close(self):
        self.log.append("close")


_inside: list = []


@pytest.mark.slow
def test_every_pass_and_the_validation_sample_through_the_one_engine_of_the_run(tmp_path,
                                                                               monkeypatch):
    """`build.rollout_engine` is called once; the first pass, hint writing, the re-samples and
    the validation all sample through it (no sampler call outside it), and it is synced after
    every update and closed at the end."""
    from sage_jax.engine.sampler import sampling
    from sage_jax.run import build
    log, outside = [], []
    real_engine, real_sample = build.rollout_engine, sampling.sample

    def engine(*args, **kwargs):
        log.append("build")
        return _CountingEngine(real_engine(*args, **kwargs), log)

    def sample(*args, **kwargs):
        if not _inside:
            outside.append(1)
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(build, "rollout_engine", engine)
    monkeypatch.setattr(sampling, "sample", sample)
    loop.train(cfg("rl.method=sage", "train.steps=2", "eval.every=2", "eval.k=2", "eval.limit=4",
                   "eval.max_new_tokens=16"), tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert "eval/toy/avg@2" in rows[1] and rows[0]["hint/prompts_needing_hint"] > 0
    assert log[0] == "build" and log.count("build") == 1 and log[-1] == "close"
    assert log.count("sync") == 2 and log.count("sample") >= 4  # passes, hints, validation
    assert not outside


@pytest.mark.slow
def test_a_run_saved_before_the_sampler_keys_moved_resumes_and_evaluates(three_steps, tmp_path,
                                                                        capsys):
    """A run folder whose config.yaml still has rl.programs_kept (before the sampler keys moved
    to rollout.*): evaluate restores it and the train command resumes it from that file, each
    saying so; the migrated config is the run's."""
    import yaml
    c, run = three_steps
    old = tmp_path / "run"
    shutil.copytree(run, old)
    data = yaml.safe_load((old / "config.yaml").read_text())
    data["rl"]["programs_kept"] = data["rollout"].pop("programs_kept")
    data["rl"]["continuous_batching"] = data["rollout"].pop("continuous_batching")
    (old / "config.yaml").write_text(yaml.safe_dump(data))
    restored, _, step = restore.restore_policy(old)
    assert restored == c and step == 3
    assert "rl.programs_kept -> rollout.programs_kept" in capsys.readouterr().err
    got = train.parse(["--config", str(old / "config.yaml"), "--workdir", str(old),
                       "train.steps=4"])
    assert (got[0].train.steps, got[0].rollout, got[0].rl) == (4, c.rollout, c.rl)
    assert "rl.continuous_batching -> rollout.continuous_batching" in capsys.readouterr().err
    train.run(*got)
    assert [r["step"] for r in read_metrics(old / "metrics.jsonl")] == [1, 2, 3, 4]
