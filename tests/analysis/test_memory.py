"""The memory estimator against what JAX really allocates (8 fake CPU devices): the train
state's per-device shard bytes, the sampler's KV cache, and XLA's buffer assignment for the
update step; and layer remat, which must not change the gradients."""

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grad_fixtures import minibatch_grads
from sage_jax.run import build
from sage_jax.core import grpo
from sage_jax.engine.sampler import programs, sampling, sampling_plan
from sage_jax.engine.trainer import packing, update
from sage_jax.analysis import memory
from sage_jax import models
from sage_jax.infra import parallel
from sage_jax.config import Config, LoraConfig, MeshConfig, ModelConfig, OptimConfig, RLConfig
from sage_jax.config import TrainConfig
from sage_jax.engine.trainer.state import trainable_split
from sage_jax.tasks.toy import chains as toy

settings_of = update.UpdateSettings.of  # the update's settings of a run's Config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import estimate_memory  # noqa: E402

MODEL = models.DecoderConfig(family="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
PROMPT, ANSWER, ROWS, MICRO, CHUNK = 16, 112, 16, 8, 64


def make_cfg(dtype="float32", master_fp32=False, remat=False):
    return Config(model=ModelConfig(dtype=dtype, compute_dtype=dtype, remat=remat,
                                    master_fp32=master_fp32),
                  rl=RLConfig(method="grpo", prompts_per_step=ROWS // 4, group_size=4,
                              max_new_tokens=ANSWER, minibatches=1, micro_batch_size=MICRO),
                  optim=OptimConfig(lr=1e-3), train=TrainConfig(steps=10))


def make_model(cfg, model_cfg=MODEL):
    """A fresh decoder for `cfg.model`, its weights copied from a cached one (random init
    compiles one small program per weight shape: slow on a busy CPU)."""
    model = _abstract(model_cfg, cfg.model.dtype, cfg.model.remat)
    nnx.update(model, _weights(model_cfg, cfg.model.dtype))
    return model


def _abstract(model_cfg, dtype, remat):
    dt = jnp.dtype(dtype)
    return nnx.eval_shape(lambda: models.Decoder(model_cfg, dtype=dt, compute_dtype=dt,
                                                 rngs=nnx.Rngs(0), remat=remat))


@functools.cache
def _weights(model_cfg, dtype):
    """Deterministic weights (normal * 0.05, norms 1) without the per-shape random programs."""
    _, params = nnx.split(_abstract(model_cfg, dtype, False))
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: jnp.asarray(
        np.ones(a.shape) if len(a.shape) == 1 and a.shape[0] in (model_cfg.hidden_size,
                                                                  model_cfg.head_dim)
        else rng.normal(0, 0.05, a.shape), a.dtype), params)


def make_mesh(sizes):
    return parallel.make_mesh(MeshConfig(*sizes), jax.devices()[:int(np.prod(sizes))])


def make_batch(n=ROWS, seed=0):
    """Left-padded prompts of 2..PROMPT tokens, answers of 1..ANSWER tokens."""
    rng = np.random.default_rng(seed)
    col = np.arange(PROMPT + ANSWER)
    plen, alen = rng.integers(2, PROMPT + 1, n), rng.integers(1, ANSWER + 1, n)
    mask = (col[None] >= PROMPT - plen[:, None]) & (col[None] < PROMPT + alen[:, None])
    tokens = np.where(mask, rng.integers(1, MODEL.vocab_size, mask.shape), 0).astype(np.int32)
    rewards = rng.integers(0, 2, (n // 4, 4)).astype(np.float32)
    return dict(tokens_NxL=tokens, mask_NxL=mask, loss_mask_NxL=mask & (col[None] >= PROMPT),
                advantages_N=np.asarray(grpo.group_advantages(rewards)).reshape(-1),
                old_logp_NxL=rng.normal(-3.0, 0.5, mask.shape).astype(np.float32))


def estimate(cfg, sizes, model_cfg=MODEL):
    m = cfg.model
    return memory.estimate(
        model_cfg, mesh_shape=dict(zip(parallel.AXES, sizes)), rows_per_step=ROWS,
        micro_batch_rows=MICRO, prompt_len=PROMPT, max_new_tokens=ANSWER, group_size=4,
        minibatches=1, param_dtype=m.dtype, compute_dtype=m.compute_dtype,
        master_fp32=m.master_fp32, remat=m.remat, logprob_chunk=CHUNK, lora=m.lora)


def device_bytes(tree) -> int:
    """The most bytes of `tree`'s arrays that any one device holds."""
    per = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values())


# ------------------------------------------------------------------------------ state (exact)

@pytest.mark.parametrize("sizes,dtype,master,toy_model", [
    ((1, 1, 1), "float32", False, False), ((1, 4, 1), "bfloat16", True, False),
    ((2, 2, 2), "bfloat16", True, True), ((1, 2, 4), "bfloat16", False, False)])
@pytest.mark.slow
def test_state_bytes_match_device_shards(sizes, dtype, master, toy_model):
    """params + master and the AdamW state per device are exactly the shard bytes of the state
    that `init_train_state` places on the mesh."""
    cfg = make_cfg(dtype, master)
    model_cfg = toy.toy_model_config() if toy_model else MODEL
    _, state = update.init_train_state(make_model(cfg, model_cfg),
                                       settings_of(cfg), make_mesh(sizes))
    est = estimate(cfg, sizes, model_cfg)
    assert est.params + est.master == device_bytes(state.params)
    assert est.optimizer == device_bytes(state.opt_state)
    assert est.grads == device_bytes(state.params)
    itemsize = jnp.dtype(dtype).itemsize
    assert est.master == (est.params * (4 - itemsize) // itemsize if master else 0)
    if sizes != (1, 1, 1):  # the weights really are split: less than the model per device
        assert est.params < model_cfg.num_params() * itemsize


def test_state_bytes_match_live_arrays():
    """On one device, params + master + optimiser = the growth of jax.live_arrays() when the
    train state is created."""
    cfg = make_cfg("bfloat16", True)
    model = make_model(cfg)
    before = sum(x.nbytes for x in jax.live_arrays())
    _, state = update.init_train_state(model, settings_of(cfg), make_mesh((1, 1, 1)))
    grown = sum(x.nbytes for x in jax.live_arrays()) - before
    est = estimate(cfg, (1, 1, 1))
    other = sum(x.nbytes for x in (state.step, state.rng, state.data_position))
    assert est.state + other == grown


def test_a_lora_estimate_trains_the_adapters_alone():
    """model.lora (rank 4, bf16 base, float32 masters): the estimate's params are the base and
    the adapters in bf16, and only the adapters have masters, gradients, AdamW moments and (on
    one device) a compute-dtype copy for the sampler -- counted from the adapters the abstract
    LoRA decoder really has, each r * (in + out) of the kernel it adapts. Full fine-tuning of
    the same model has moments for every weight, the same step counters. On one device and on
    a (2, 2, 2) mesh the state bytes equal what `init_train_state` places there."""
    lora = LoraConfig(rank=4, alpha=8.0)
    full = make_cfg("bfloat16", True)
    cfg = dataclasses.replace(full, model=dataclasses.replace(full.model, lora=lora))
    bf16 = jnp.dtype("bfloat16")
    model = nnx.eval_shape(lambda: models.Decoder(MODEL, dtype=bf16, compute_dtype=bf16,
                                                  rngs=nnx.Rngs(0),
                                                  lora=models.LoraSpec.of(lora)))
    linears = [m for _, m in nnx.iter_graph(model) if isinstance(m, models.decoder.Linear)
               and m.lora_a is not None]
    adapters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert len(linears) == 7 * MODEL.num_layers
    assert adapters == sum(4 * sum(m.kernel.shape) for m in linears)
    base = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) - adapters
    est, ft = estimate(cfg, (1, 1, 1)), estimate(full, (1, 1, 1))
    assert est.params == 2 * (base + adapters) and ft.params == 2 * base
    assert est.master == (4 - 2) * adapters
    assert est.grads == 4 * adapters
    counters = ft.optimizer - 8 * base  # AdamW's and the schedule's step counts
    assert 0 <= counters < 64
    assert est.optimizer == 8 * adapters + counters  # mu and nu, float32
    assert est.sampler_weights == 2 * adapters  # the base is read in place
    assert est.optimizer < ft.optimizer / 8
    for sizes in [(1, 1, 1), (2, 2, 2)]:
        _, state = update.init_train_state(
            models.with_lora(make_model(full), models.LoraSpec.of(lora)), settings_of(cfg),
            make_mesh(sizes))
        est = estimate(cfg, sizes)
        assert est.params + est.master == device_bytes(state.params), sizes
        assert est.optimizer == device_bytes(state.opt_state), sizes
        assert est.grads == device_bytes(trainable_split(state.params)[0]), sizes


# ---------------------------------------------------------------------------- KV cache (exact)

@pytest.mark.parametrize("sizes", [None, (2, 2, 2)])
@pytest.mark.slow
def test_kv_cache_matches_what_the_sampler_allocates(monkeypatch, sizes):
    """The estimate equals, per device, the prompt and generated-token caches that
    `sampling.sample` hands its programs, buckets included (5 prompts -> 8 prompt rows of 3
    answers, 20 tokens -> 24 columns, 13 new tokens -> 16 slots, allocated at once); on a mesh
    rows split over data*fsdp, KV heads over tensor (None: no mesh, one device). The layer of
    fewer rows that a regroup builds (15 live rows -> 16) fits the estimated transient."""
    seen = {"regroup": []}
    real = programs.get

    def spy(kind, *args):
        fn = real(kind, *args)

        def call(*a):
            out = fn(*a)
            if kind == "start":
                st = out[0]
                seen["prompt"] = device_bytes((st.prompt_k, st.prompt_v, st.prompt_mask_BxP))
                seen["gen"] = device_bytes((st.gen_k, st.gen_v))
            elif kind == "regroup":  # one layer's prompt and generated keys/values
                seen["regroup"].append(device_bytes(out))
            return out

        return call

    monkeypatch.setattr(programs, "get", spy)
    monkeypatch.setattr(sampling_plan, "COARSE_ROW_BUCKET_MIN", sampling_plan.ROW_BUCKET_MIN)  # regroups
    cfg = make_cfg("bfloat16", True)
    mesh = make_mesh(sizes or (1, 1, 1))
    graphdef, state = update.init_train_state(make_model(cfg), settings_of(cfg), mesh)
    lengths = (20, 3, 9, 20, 2)
    tok = np.ones((5, 20), np.int32)
    mask = np.arange(20)[None] >= 20 - np.asarray(lengths)[:, None]
    sampling.sample(graphdef, state.params, tok, mask, key=jax.random.PRNGKey(0), num_samples=3,
                    max_new_tokens=13, mesh=None if sizes is None else mesh)
    mesh_shape = dict(zip(parallel.AXES, sizes or (1, 1, 1)))
    cache, work = memory.kv_cache_bytes(MODEL, memory.fake_mesh(mesh_shape), prompts=5,
                                        group_size=3, prompt_len=20, max_new_tokens=13,
                                        dtype=jnp.bfloat16)
    assert cache == seen["prompt"] + seen["gen"]
    assert seen["regroup"] and max(seen["regroup"]) <= work
    if sizes is None:  # 2 layers x (k, v) x 2 kv heads x 16 dims x 2 bytes x slots, + mask
        # (a small model: prompts of 20 tokens fill a 32-slot power-of-two prompt bucket)
        assert cache == 2 * 2 * 2 * 16 * 2 * (8 * 32 + 8 * 3 * 16) + 8 * 32
        assert max(seen["regroup"]) == 2 * 2 * 16 * 2 * 16 * (32 + 16)


def test_kv_cache_splits_rows_and_heads():
    kw = dict(prompts=128, group_size=8, prompt_len=2048, max_new_tokens=8192, dtype="bfloat16")
    one, _ = memory.kv_cache_bytes(MODEL, memory.fake_mesh({}), **kw)
    rows, _ = memory.kv_cache_bytes(MODEL, memory.fake_mesh({"data": 2, "fsdp": 4}), **kw)
    heads, _ = memory.kv_cache_bytes(MODEL, memory.fake_mesh({"tensor": 2}), **kw)
    odd, _ = memory.kv_cache_bytes(MODEL, memory.fake_mesh({"tensor": 4}), **kw)  # 2 kv heads
    mask = 128 * 2048
    assert rows - mask // 8 == (one - mask) // 8
    assert heads - mask == (one - mask) // 2
    assert odd == one


# ------------------------------------------------------------------ update step (XLA's numbers)

@pytest.mark.parametrize("sizes", [(1, 1, 1), (2, 2, 2)])
@pytest.mark.slow
def test_activations_match_xla_buffer_assignment(sizes):
    """grads + activations of the estimate are within 20% of the temporary bytes per device
    that XLA assigns to the compiled train step (float32, no remat)."""
    cfg = make_cfg()
    mesh = make_mesh(sizes)
    graphdef, state = update.init_train_state(make_model(cfg), settings_of(cfg), mesh)
    step = update.TrainStep(graphdef, settings_of(cfg), mesh, chunk=CHUNK)
    batch = parallel.shard_batch(packing.as_packed(make_batch()), mesh)
    temp = step.jitted(state).lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    est = estimate(cfg, sizes)
    assert abs(est.grads + est.activations - temp) <= 0.2 * temp, (temp, est)


@pytest.mark.slow
def test_activations_of_long_rows_in_attention_blocks_match_xla(monkeypatch):
    """Rows long enough for several causal query blocks (`decoder.causal_blocks`, each with its
    own copy of the keys and values): the estimate stays within 20% of XLA's bytes."""
    monkeypatch.setattr(sys.modules[__name__], "ANSWER", 368)  # rows of 384 tokens
    assert len(models.decoder.causal_blocks(PROMPT + ANSWER)) == 3
    cfg = make_cfg()
    mesh = make_mesh((1, 1, 1))
    graphdef, state = update.init_train_state(make_model(cfg), settings_of(cfg), mesh)
    step = update.TrainStep(graphdef, settings_of(cfg), mesh, chunk=CHUNK)
    batch = parallel.shard_batch(packing.as_packed(make_batch()), mesh)
    temp = step.jitted(state).lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    est = estimate(cfg, (1, 1, 1))
    assert abs(est.grads + est.activations - temp) <= 0.2 * temp, (temp, est)


# ---------------------------------------------------------------------------------- remat

def residual_bytes(cfg) -> int:
    """Bytes the forward pass of one micro-batch's loss keeps for its backward pass (the vjp's
    residuals), each buffer once, the parameters themselves excluded."""
    graphdef, params = models.split(make_model(cfg))
    mb = {k: jnp.asarray(v[:MICRO]) for k, v in packing.as_packed(make_batch()).items()
          if k.endswith("_ZxL")}  # the loss's per-token layout (one row per sequence)
    loss = functools.partial(update._micro_loss, graphdef=graphdef,
                             settings=settings_of(cfg), chunk=CHUNK,
                             remat_logits=True, rows=parallel.rows_sharding(make_mesh((1, 1, 1))))
    _, vjp_fn = jax.vjp(lambda p: loss(p, mb, (jnp.float32(400), jnp.float32(8)))[0], params)
    seen = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)}
    total = 0
    for x in jax.tree.leaves(vjp_fn):
        if isinstance(x, jax.Array) and x.unsafe_buffer_pointer() not in seen:
            seen.add(x.unsafe_buffer_pointer())
            total += x.nbytes
    return total


@pytest.mark.slow
def test_remat_keeps_only_layer_inputs():
    """With model.remat the forward pass keeps each layer's input (plus the shared attention
    mask and the log-prob head's inputs): within 20% of the estimate's saved + attn_mask + head,
    and a small fraction of what it keeps without remat (JAX's residuals; XLA's bytes: see
    `test_remat_shrinks_the_compiled_train_step_on_cpu`)."""
    kept = residual_bytes(make_cfg(remat=True))
    t = estimate(make_cfg(remat=True), (1, 1, 1)).terms
    assert abs(t["saved"] + t["attn_mask"] + t["head"] - kept) <= 0.2 * kept, (kept, t)
    assert kept < residual_bytes(make_cfg(remat=False)) / 5


@pytest.mark.slow
def test_remat_shrinks_the_compiled_train_step_on_cpu():
    """XLA's own buffer assignment for the train step (XLA:CPU, 6 layers): with model.remat
    each layer's intermediates live only while that layer's backward pass runs, so the step
    needs well under half the temporary bytes. (Plain `jax.checkpoint` gave the same bytes
    with and without remat here: XLA:CPU drops optimization barriers and merged the
    recomputation back into the forward pass.)"""
    deep = dataclasses.replace(MODEL, num_layers=6)
    mesh = make_mesh((1, 1, 1))
    batch = parallel.shard_batch(packing.as_packed(make_batch()), mesh)
    temp = {}
    for remat in (False, True):
        cfg = make_cfg(remat=remat)
        graphdef, state = update.init_train_state(make_model(cfg, deep), settings_of(cfg), mesh)
        step = update.TrainStep(graphdef, settings_of(cfg), mesh, chunk=CHUNK)
        compiled = step.jitted(state).lower(state, batch).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[True] < 0.5 * temp[False], temp


@pytest.mark.slow
def test_remat_gives_the_same_gradients():
    """model.remat recomputes each layer in the backward pass: the gradients do not change."""
    mesh = make_mesh((1, 1, 1))
    batch = parallel.shard_batch(make_batch(), mesh)
    grads = []
    for remat in (False, True):
        cfg = make_cfg(remat=remat)
        graphdef, state = update.init_train_state(make_model(cfg), settings_of(cfg), mesh)
        assert nnx.merge(graphdef, state.params).remat is remat
        grads.append(jax.device_get(jax.jit(lambda p, b, g=graphdef, c=cfg: minibatch_grads(
            p, b, graphdef=g, cfg=c, mesh=mesh))(state.params, batch)[0]))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("remat", [True, False])
def test_config_remat_reaches_the_model(shared_data, remat):
    cfg = Config(model=ModelConfig(path=str(shared_data / "models" / "verl-arith-tiny-llama"),
                                   dtype="float32", compute_dtype="float32", remat=remat))
    model = build.load_model(cfg)
    assert model.remat is remat
    graphdef, _ = nnx.split(model)  # the flag is static: it travels with the graphdef
    assert nnx.merge(graphdef, nnx.state(model)).remat is remat


# ---------------------------------------------------------------------------------- the CLI

@pytest.mark.slow
def test_cli_paper_config_json():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "estimate_memory.py"), "--config",
         str(ROOT / "configs" / "paper_qwen2.5-7b.yaml"), "--preset", "qwen2.5-7b", "--mesh",
         "1,8,1", "--hbm-gib", "80", "--micro-batch", "8", "--json"],
        capture_output=True, text=True, check=True, cwd=ROOT).stdout
    got = json.loads(out.splitlines()[-1])
    assert 7.6e9 < got["num_params"] < 7.7e9
    # bf16 weights + f32 masters + AdamW mu, nu (f32) = 2 + 2 + 8 bytes a parameter, over 8.
    assert abs(got["state"] - 12 * got["num_params"] / 8) < 0.02 * got["state"]
    assert got["micro_batch_rows"] == 8 and got["total"] == max(got["sampling_peak"],
                                                                got["update_peak"])
    assert got["headroom"] == int(80 * memory.GIB - got["total"])


def test_cli_takes_the_configs_logprob_chunk():
    """--chunk defaults to the config's rl.logprob_chunk (smollm2_gsm8k: 64); 0 means none."""
    config = str(ROOT / "configs" / "smollm2_gsm8k.yaml")

    def chunk(*flags):
        args = estimate_memory.parse_args(["--config", config, "--preset", "qwen3-4b",
                                           "--mesh", "1,1,1", *flags])
        return estimate_memory.run_estimate(args)[1]["logprob_chunk"]
    assert chunk() == 64
    assert chunk("--chunk", "0") is None and chunk("--chunk", "128") == 128
