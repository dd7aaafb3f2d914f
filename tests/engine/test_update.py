"""The update step: optimiser, mesh and partition rules, batch checks, micro-batch and sharding
invariance, the reference KL, and learning on a tiny random model (8 fake CPU devices)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from grad_fixtures import minibatch_grads
from sage_jax.core import grpo
from sage_jax import models
from sage_jax.infra import parallel
from sage_jax.engine.trainer import packing, update
from sage_jax.config import Config, LoraConfig, MeshConfig, OptimConfig, RLConfig, TrainConfig
from sage_jax.engine.trainer.state import TrainState, trainable_split
from sage_jax.models.decoder import Linear

settings_of = update.UpdateSettings.of  # the update's settings of a run's Config


def packed_step(graphdef, settings, mesh, **kw):
    """`update.TrainStep` fed this file's padded batches packed one row per sequence
    (`packing.as_packed`, no packing: the form the trainer gives it with rl.padding_free=false)."""
    step = update.TrainStep(graphdef, settings, mesh, **kw)
    return lambda state, batch: step(state, packing.as_packed(jax.device_get(batch)))


MODEL = models.DecoderConfig(family="qwen2", vocab_size=48, hidden_size=32, intermediate_size=64,
                           num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
PROMPT, ANSWER = 5, 6


def make_cfg(prompts=4, group=4, lr=1e-3, optim=None, **rl):
    rl = dict(dict(method="grpo", prompts_per_step=prompts, group_size=group,
                   max_new_tokens=ANSWER, minibatches=1), **rl)
    return Config(rl=RLConfig(**rl), optim=optim or OptimConfig(lr=lr),
                  train=TrainConfig(steps=10))


def make_batch(n=16, seed=0):
    """Left-padded prompts of 2..5 tokens, answers of 1..6 tokens, group advantages."""
    rng = np.random.default_rng(seed)
    col = np.arange(PROMPT + ANSWER)
    plen = rng.integers(2, PROMPT + 1, n)
    alen = rng.integers(1, ANSWER + 1, n)
    mask = (col[None] >= PROMPT - plen[:, None]) & (col[None] < PROMPT + alen[:, None])
    tokens = np.where(mask, rng.integers(1, MODEL.vocab_size, mask.shape), 0).astype(np.int32)
    rewards = rng.integers(0, 2, (n // 4, 4)).astype(np.float32)
    return dict(tokens_NxL=tokens, mask_NxL=mask, loss_mask_NxL=mask & (col[None] >= PROMPT),
                advantages_N=np.asarray(grpo.group_advantages(rewards)).reshape(-1))


def one_device_mesh():
    return parallel.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])


def init(cfg, mesh, seed=0):
    return update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(seed)),
                                   settings_of(cfg), mesh)


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ---------------------------------------------------------------------------------- optimiser

def test_schedules():
    total, lr = 10, 1.0
    s = update.make_schedule(OptimConfig(lr=lr, warmup_steps=2), total)
    np.testing.assert_allclose([s(i) for i in (0, 1, 2, 9)], [0, 0.5, 1, 1], atol=1e-6)
    s = update.make_schedule(OptimConfig(lr=lr, warmup_steps=2, schedule="cosine"), total)
    np.testing.assert_allclose([s(2), s(6), s(10)], [1, 0.5, 0], atol=1e-6)
    s = update.make_schedule(OptimConfig(lr=lr, schedule="linear"), total)
    np.testing.assert_allclose([s(0), s(5), s(10)], [1, 0.5, 0], atol=1e-6)


def test_adamw_first_step_and_clip():
    p, g = {"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, -4.0])}  # |g| = 5
    tx = update.make_optimizer(OptimConfig(lr=0.1, weight_decay=0.5), 10)
    # First Adam step is lr * sign(g); decoupled weight decay adds lr * wd * p.
    np.testing.assert_allclose(tx.update(g, tx.init(p), p)[0]["w"], [-0.1 - 0.05, 0.1 - 0.1],
                               atol=1e-6)
    # With a huge Adam eps the step is ~ lr * g / eps, so clipping to norm 1 shows.
    for clip, want in ((1.0, [0.6, -0.8]), (0.0, [3.0, -4.0])):
        tx = update.make_optimizer(OptimConfig(lr=0.1, weight_decay=0, eps=1e4, grad_clip=clip), 10)
        np.testing.assert_allclose(tx.update(g, tx.init(p), p)[0]["w"],
                                   -0.1 * np.array(want) / 1e4, rtol=1e-3)


# ---------------------------------------------------------------------------------- mesh, rules

def test_make_mesh_fills_and_checks():
    assert dict(parallel.make_mesh(MeshConfig(-1, 2, 1)).shape) == dict(data=4, fsdp=2, tensor=1)
    assert dict(parallel.make_mesh(MeshConfig(1, -1, 2)).shape) == dict(data=1, fsdp=4, tensor=2)
    assert dict(parallel.make_mesh(MeshConfig(-1, -1, 2)).shape) == dict(data=1, fsdp=4, tensor=2)
    with pytest.raises(ValueError, match="product is 8"):
        parallel.make_mesh(MeshConfig(3, 1, 1))
    with pytest.raises(ValueError, match="do not divide the 8 devices"):
        parallel.make_mesh(MeshConfig(-1, 3, 1))


@pytest.mark.slow
def test_partition_rules():
    mesh = parallel.make_mesh(MeshConfig(1, 4, 2))
    graphdef, state = init(make_cfg(), mesh)
    specs = {parallel.path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(
        parallel.tree_shardings(state, mesh))[0]}
    layer = "params/layers/0/"
    assert specs["params/embed_tokens"] == P("tensor", "fsdp")
    assert specs["params/lm_head/kernel"] == P("fsdp", "tensor")
    assert specs[layer + "self_attn/q_proj/kernel"] == P("fsdp", "tensor")
    assert specs[layer + "self_attn/k_proj/bias"] == P("tensor")
    assert specs[layer + "self_attn/o_proj/kernel"] == P("tensor", "fsdp")
    assert specs[layer + "mlp/down_proj/kernel"] == P("tensor", "fsdp")
    assert specs[layer + "input_layernorm/weight"] == P()
    assert specs["step"] == P()
    # Adam moments follow their parameters.
    mu = [s for k, s in specs.items() if k.startswith("opt_state") and
          k.endswith("mu/layers/0/mlp/gate_proj/kernel")]
    assert mu == [P("fsdp", "tensor")]
    # The live arrays are placed that way, and a dimension an axis can't split stays whole.
    q = state.params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
    assert q.sharding.spec == P("fsdp", "tensor")
    assert parallel.spec_for("lm_head/kernel", (32, 51), mesh) == P("fsdp", None)


# ---------------------------------------------------------------------------------- batch checks

def test_bad_batches_fail_before_compiling():
    mesh = parallel.make_mesh(MeshConfig(-1, 1, 1))
    cfg = make_cfg()
    step = update.TrainStep(None,
                            settings_of(cfg), mesh)  # never compiled: every call must fail first
    assert step.chunk == cfg.rl.logprob_chunk == update.DEFAULT_CHUNK  # rl.logprob_chunk
    assert update.TrainStep(None, settings_of(make_cfg(logprob_chunk=64)), mesh).chunk == 64
    assert update.TrainStep(None, settings_of(cfg), mesh, chunk=None).chunk is None
    good = packing.as_packed(make_batch(16))
    with pytest.raises(ValueError, match="pack it"):  # the update takes the packed form only
        step(None, make_batch(16))
    with pytest.raises(ValueError, match="12 rows.*data=8 x fsdp=1"):
        step(None, packing.as_packed(make_batch(12)))
    with pytest.raises(ValueError, match="missing 'advantages_N'"):
        step(None, {k: v for k, v in good.items() if k != "advantages_N"})
    with pytest.raises(ValueError, match="unknown batch keys.*'rewards'"):
        step(None, dict(good, rewards=good["advantages_N"]))
    with pytest.raises(ValueError, match="loss_mask_ZxL.*shape"):
        step(None, dict(good, loss_mask_ZxL=good["loss_mask_ZxL"][:, 1:]))
    with pytest.raises(ValueError, match="level_N.*expected \\[16\\]"):
        step(None, dict(good, level_N=np.zeros(8, np.int8)))
    with pytest.raises(ValueError, match="ref_logp_ZxL"):
        update.TrainStep(None, settings_of(make_cfg(kl_beta=0.1)), mesh)(None, good)
    with pytest.raises(ValueError, match="micro-batch.*4 rows.*divisible by 8"):
        update.TrainStep(None, settings_of(make_cfg(micro_batch_size=4)), mesh)(None, good)
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        update.check_batch(good,
                           settings_of(make_cfg(prompts=3, micro_batch_size=3)), one_device_mesh())


# ---------------------------------------------------------------------------------- invariances

@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.slow
def test_micro_batching_gives_the_same_gradient_and_params(agg, capsys):
    mesh = one_device_mesh()
    batch = make_batch(16, seed=1)
    counts = batch["loss_mask_NxL"].reshape(4, 4, -1).sum(axis=(0, 2))
    assert len(set(counts.tolist())) > 1  # micro-batches differ in answer tokens
    grads, params, metrics = {}, {}, {}
    ks = (1, 2, 4) if agg == "token-mean" else (1, 4)
    for k in ks:
        cfg = make_cfg(micro_batch_size=16 // k, loss_agg=agg)
        graphdef, state = init(cfg, mesh)
        fn = jax.jit(lambda p, b: minibatch_grads(p, b, graphdef=graphdef, cfg=cfg, mesh=mesh))
        grads[k] = fn(state.params, batch)[0]
        if agg == "token-mean" and k != 2:  # (a whole step compiles slowly: 1 vs 4 only)
            state, m = packed_step(graphdef, settings_of(cfg), mesh)(state, batch)
            params[k], metrics[k] = state.params, m
    for k in ks[1:]:
        with capsys.disabled():
            print(f"\n{agg}, {k} micro-batches: max |grad diff| {max_diff(grads[k], grads[1]):.1e}"
                  + (f", |param diff| {max_diff(params[k], params[1]):.1e}" if k in params
                     else ""), end="")
        assert max_diff(grads[k], grads[1]) < 1e-6, k
        if k in params:  # Adam's first step amplifies float noise of gradients near 0
            assert max_diff(params[k], params[1]) < 1e-5, k
            for key in ("loss", "grad_norm", "entropy", "kl/old_new"):
                np.testing.assert_allclose(metrics[k][key], metrics[1][key], rtol=1e-5)


@pytest.mark.slow
def test_sharded_update_equals_one_device(capsys):
    """Two updates (2 mini-batches x 2 micro-batches) on 5 meshes: same params to 1e-5."""
    cfg = make_cfg(prompts=8, minibatches=2, micro_batch_size=8, lr=1e-3)
    meshes_equal_one_device(cfg, init, [(8, 1, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2)], "", capsys)


def meshes_equal_one_device(cfg, init_fn, shapes, label, capsys):
    """One step on 1 device and on each mesh of `shapes`: the same params to 1e-5 and the same
    loss; and the step moved the params."""
    batch = make_batch(32, seed=2)
    out = {}
    for shape in [(1, 1, 1), *shapes]:
        devices = jax.devices()[:1] if shape == (1, 1, 1) else None
        mesh = parallel.make_mesh(MeshConfig(*shape), devices)
        graphdef, state = init_fn(cfg, mesh)
        state, metrics = packed_step(graphdef, settings_of(cfg), mesh)(
            state, parallel.shard_batch(batch, mesh))
        out[shape] = (jax.tree.map(np.asarray, state.params), metrics)
    base_params, base_metrics = out[(1, 1, 1)]
    for shape, (params, metrics) in out.items():
        diff = max_diff(params, base_params)
        with capsys.disabled():
            print(f"\n{label}mesh {shape}: max |param diff| vs 1 device = {diff:.2e}", end="")
        assert diff < 1e-5, shape
        np.testing.assert_allclose(metrics["loss"], base_metrics["loss"], rtol=1e-5, atol=1e-7)
    assert max_diff(base_params, init_fn(cfg, one_device_mesh())[1].params) > 1e-4  # it moved


# ---------------------------------------------------------------------------------- behaviour

@pytest.mark.slow
def test_learning_moves_logprobs_by_advantage_sign():
    """Repeated steps on one group: the +A answer gains log-prob, the -A answer loses it."""
    mesh = one_device_mesh()
    cfg = make_cfg(prompts=1, group=2, lr=3e-3)
    batch = {k: v[:2] for k, v in make_batch(16, seed=3).items()}
    batch["advantages_N"] = np.asarray(grpo.group_advantages(np.array([[1.0, 0.0]])))[0]
    graphdef, state = init(cfg, mesh)
    logprobs = update.make_logprob_fn(graphdef, mesh)

    def answer_logp(params):
        lp = logprobs(params, batch["tokens_NxL"], batch["mask_NxL"], batch["loss_mask_NxL"])
        return np.asarray(lp).sum(axis=1)

    before = answer_logp(state.params)
    step = packed_step(graphdef, settings_of(cfg), mesh)
    for _ in range(5):
        state, metrics = step(state, batch)
    after = answer_logp(state.params)
    assert after[0] > before[0] + 0.1 and after[1] < before[1] - 0.1, (before, after)
    assert int(state.step) == 5 and int(state.data_position) == 0 and state.sage == {}
    assert isinstance(state, TrainState) and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("minibatches", [1, 2])
@pytest.mark.slow
def test_given_old_logprobs_equal_recomputed(minibatches):
    """Absent old log-probs are recomputed for mini-batches 1.. and taken fresh by update 0."""
    mesh = one_device_mesh()
    cfg = make_cfg(micro_batch_size=4, minibatches=minibatches)
    batch = make_batch(16, seed=4)
    graphdef, state = init(cfg, mesh)
    old = update.make_logprob_fn(graphdef, mesh, micro_batch_size=4)(
        state.params, batch["tokens_NxL"], batch["mask_NxL"], batch["loss_mask_NxL"])
    step = packed_step(graphdef, settings_of(cfg), mesh)
    s1, m1 = step(init(cfg, mesh)[1], batch)
    s2, m2 = step(state, dict(batch, old_logp_NxL=old))
    assert max_diff(s1.params, s2.params) < 1e-6
    assert float(m1["kl/old_new"]) == pytest.approx(float(m2["kl/old_new"]), abs=1e-7)
    # The per-row SAGE arrays ride along: same update, plus their token shares.
    level = np.repeat([0, 2, 0, 1], 4).astype(np.int8)
    collapse = np.repeat([0, 1, 2, 1], 4).astype(np.int8)
    s3, m3 = step(init(cfg, mesh)[1], dict(batch, level_N=level, collapse_N=collapse))
    assert max_diff(s1.params, s3.params) < 1e-6
    tok = (batch["loss_mask_NxL"] & batch["mask_NxL"]).sum(1)
    adv = batch["advantages_N"]
    assert float(m3["batch/hinted_token_frac"]) == pytest.approx(tok[level > 0].sum() / tok.sum())
    assert float(m3["batch/hinted_abs_adv"]) == pytest.approx(np.abs(adv[level > 0]).mean())
    rescued = (collapse == 1) & (adv != 0)
    assert float(m3["batch/rescued_token_frac"]) == pytest.approx(tok[rescued].sum() / tok.sum())
    assert "batch/hinted_token_frac" not in m1


@pytest.mark.slow
def test_the_update_with_the_correction():
    """With the engine's log-probs equal to the trainer's the weights are 1 and the step is the
    uncorrected one; an answer whose engine log-probs are off trains as one of advantage 0 under
    "sequence"; without the engine's log-probs in the batch the step says what is missing."""
    mesh = one_device_mesh()
    batch = make_batch(16, seed=5)
    base = make_cfg(micro_batch_size=4, minibatches=2)
    graphdef, state = init(base, mesh)
    trainer = update.make_logprob_fn(graphdef, mesh, micro_batch_size=4)(
        state.params, batch["tokens_NxL"], batch["mask_NxL"], batch["loss_mask_NxL"])
    trainer = np.asarray(trainer)

    steps = {}

    def run(cfg, b):  # one compiled step per mode
        mode = cfg.rl.rollout_correction
        steps.setdefault(mode, update.TrainStep(graphdef, update.UpdateSettings.of(cfg), mesh))
        return steps[mode](init(cfg, mesh)[1], packing.as_packed(b))

    s_none, _ = run(base, batch)
    for mode in ("token", "sequence"):
        cfg = make_cfg(micro_batch_size=4, minibatches=2, rollout_correction=mode)
        s, m = run(cfg, dict(batch, sampler_logp_NxL=trainer))
        assert max_diff(s.params, s_none.params) < 1e-6, mode
        assert float(m["rollout_correction/ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
        assert float(m["rollout_correction/masked_share"]) == 0.0
    off = trainer.copy()
    off[3] -= 1.0 * batch["loss_mask_NxL"][3]  # row 3: r = e^(answer length) > cap
    cfg = make_cfg(micro_batch_size=4, minibatches=2, rollout_correction="sequence")
    s_masked, m = run(cfg, dict(batch, sampler_logp_NxL=off))
    adv = batch["advantages_N"].copy()
    adv[3] = 0.0
    s_zero, _ = run(base, dict(batch, advantages_N=adv))
    assert batch["advantages_N"][3] != 0 and max_diff(s_masked.params, s_zero.params) < 1e-6
    tokens = (batch["loss_mask_NxL"] & batch["mask_NxL"]).sum(1)
    second = [2, 3, 6, 7, 10, 11, 14, 15]  # mini-batch 1's rows (stripes of 2 of every 4)
    assert float(m["rollout_correction/masked_share"]) == pytest.approx(  # a mean of 2 updates
        tokens[3] / tokens[second].sum() / 2, rel=1e-6)
    with pytest.raises(ValueError, match="sampler_logp_ZxL"):
        run(cfg, batch)


@pytest.mark.slow
def test_reference_kl_and_epochs():
    """kl_beta > 0: loss = pg_loss + beta * kl/ref; 2 epochs = 2 updates (lr from warm-up)."""
    mesh = one_device_mesh()
    cfg = make_cfg(kl_beta=0.5, epochs_per_batch=2, optim=OptimConfig(lr=1e-3, warmup_steps=4))
    batch = make_batch(16, seed=5)
    graphdef, state = init(cfg, mesh)
    logp = update.make_logprob_fn(graphdef, mesh)(
        state.params, batch["tokens_NxL"], batch["mask_NxL"], batch["loss_mask_NxL"])
    ref = np.where(batch["loss_mask_NxL"], np.asarray(logp) - 0.3, 0.0).astype(np.float32)
    state, m = packed_step(graphdef,
                                settings_of(cfg), mesh)(state, dict(batch, ref_logp_NxL=ref))
    kl = math.exp(-0.3) + 0.3 - 1  # k3 at the first update, where logp = old logp
    assert float(m["kl/ref"]) == pytest.approx(kl, rel=0.05)
    assert float(m["loss"]) == pytest.approx(float(m["pg_loss"]) + 0.5 * float(m["kl/ref"]),
                                              rel=1e-5, abs=1e-7)
    assert float(m["lr"]) == pytest.approx(1e-3 * 1 / 4)  # the 2nd update of a 4-step warm-up
    assert int(m["tokens"]) == int(batch["loss_mask_NxL"].sum())


# ---------------------------------------------------------------------------------- remat

def _step_result(cfg, batch, mesh, remat):
    model = models.Decoder(MODEL, rngs=nnx.Rngs(0), remat=remat)
    graphdef, state = update.init_train_state(model, settings_of(cfg), mesh)
    state, metrics = packed_step(graphdef, settings_of(cfg), mesh)(
        state, parallel.shard_batch(batch, mesh))
    return jax.device_get((state.params, metrics))


@pytest.mark.parametrize("minibatches", [1, 2])
@pytest.mark.parametrize("old_source", ["recompute", "sampler"])
@pytest.mark.slow
def test_remat_train_step_in_every_combination(old_source, minibatches):
    """model.remat=true traces and changes nothing, whether the old log-probs are recomputed
    inside the step (`rl.old_logprobs=recompute`: a `lax.map` over micro-batches that merges
    the model, which broke NNX's own remat) or come with the batch (`sampler`), over 1 or 2
    mini-batches and 1 or 2 epochs."""
    mesh = one_device_mesh()
    batch = make_batch()
    for epochs in (1, 2):
        cfg = make_cfg(minibatches=minibatches, micro_batch_size=4, epochs_per_batch=epochs,
                       old_logprobs=old_source)
        if old_source == "sampler":  # the sampling params' own log-probs, as the sampler gives
            graphdef, state = init(cfg, mesh)
            batch = dict(batch, old_logp_NxL=np.asarray(update.make_logprob_fn(graphdef, mesh)(
                state.params, batch["tokens_NxL"], batch["mask_NxL"], batch["loss_mask_NxL"])))
        (p0, m0), (p1, m1) = (_step_result(cfg, batch, mesh, remat) for remat in (False, True))
        assert max_diff(p0, p1) < 1e-6, (epochs, max_diff(p0, p1))
        np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-5, atol=1e-7)
        assert m0["grad_norm"] > 0


# ---------------------------------------------------------------------------------- LoRA

LORA = models.LoraSpec(rank=4, alpha=8.0)
ADAPTERS = 2 * len(models.LORA_TARGETS) * MODEL.num_layers  # A and B of every projection


def lora_cfg(**kw):
    """`make_cfg(**kw)` with model.lora.rank=4, alpha 8 (the adapters of `LORA`)."""
    cfg = make_cfg(**kw)
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, lora=LoraConfig(rank=LORA.rank, alpha=LORA.alpha)))


def init_lora(cfg, mesh, seed=0, remat=False):
    """A LoRA TrainState whose adapters' B is random (fresh ones are 0: A would get no
    gradient)."""
    model = models.Decoder(MODEL, rngs=nnx.Rngs(seed), lora=LORA, remat=remat)
    rng = np.random.default_rng(seed)
    for _, m in nnx.iter_graph(model):
        if isinstance(m, Linear) and m.lora_b is not None:
            m.lora_b[...] = jnp.asarray(0.1 * rng.standard_normal(m.lora_b.shape), jnp.float32)
    return update.init_train_state(model, settings_of(cfg), mesh)


def _flat(params):
    return {parallel.path_str(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.slow
def test_lora_state_keeps_masters_and_adam_moments_of_the_adapters_only():
    """bf16 model, master_fp32: the adapters become float32, the frozen base stays bf16 (no
    copy); AdamW's mu and nu exist for the adapters alone (without LoRA: for every leaf)."""
    cfg = lora_cfg()
    assert cfg.model.master_fp32 and settings_of(cfg).lora and not settings_of(make_cfg()).lora

    def state_of(lora, settings):
        model = nnx.eval_shape(lambda: models.Decoder(MODEL, dtype=jnp.bfloat16,
                                                      rngs=nnx.Rngs(0), lora=lora))
        return jax.eval_shape(lambda p: update.new_state(p, settings), models.split(model)[1])

    state = state_of(LORA, settings_of(cfg))
    adapters, base = trainable_split(state.params)
    assert len(jax.tree.leaves(adapters)) == ADAPTERS
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    moments = [x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert sorted(moments) == sorted(2 * [x.shape for x in jax.tree.leaves(adapters)])
    plain = state_of(None, settings_of(make_cfg()))
    assert len([x for x in jax.tree.leaves(plain.opt_state) if x.ndim]) == 2 * len(
        jax.tree.leaves(plain.params))
    mesh = one_device_mesh()
    with pytest.raises(ValueError, match="no LoRA adapters"):
        update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(0)), settings_of(cfg), mesh)
    with pytest.raises(ValueError, match="model.lora.rank is 0"):
        update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(0), lora=LORA),
                                settings_of(make_cfg()), mesh)


@pytest.mark.slow
def test_a_lora_step_trains_the_adapters_and_leaves_the_base_bit_identical():
    """One step (with and without remat): every adapter moves, every base leaf is bit-identical;
    grad_norm is the norm of the adapters' part of the full model's gradient."""
    mesh = one_device_mesh()
    cfg = lora_cfg(lr=1e-2, optim=OptimConfig(lr=1e-2, weight_decay=0.0))
    batch = make_batch(16, seed=6)
    graphdef, state = init_lora(cfg, mesh)
    full = minibatch_grads(state.params, batch, graphdef=graphdef, cfg=make_cfg(), mesh=mesh)[0]
    want_norm = float(optax.tree.norm(trainable_split(full)[0]))
    before = _flat(state.params)
    after = {}
    for remat in (False, True):
        graphdef, state = init_lora(cfg, mesh, remat=remat)
        state, metrics = packed_step(graphdef, settings_of(cfg), mesh)(state, batch)
        after[remat] = _flat(state.params)
        assert float(metrics["grad_norm"]) == pytest.approx(want_norm, rel=1e-5)
    assert max_diff(list(after[True].values()), list(after[False].values())) < 1e-6
    adapters = [k for k in before if k.endswith(("lora_a", "lora_b"))]
    assert len(adapters) == ADAPTERS and len(before) > ADAPTERS
    for key, value in before.items():
        if key in adapters:
            assert np.abs(after[False][key] - value).max() > 1e-4, key
        else:
            np.testing.assert_array_equal(after[False][key], value, err_msg=key)


@pytest.mark.slow
def test_sharded_lora_update_equals_one_device(capsys):
    """Two LoRA updates on meshes that split the adapters over fsdp and tensor: the same
    params as on 1 device."""
    cfg = lora_cfg(prompts=8, minibatches=2, micro_batch_size=8, lr=1e-3)
    meshes_equal_one_device(cfg, init_lora, [(2, 2, 2), (1, 4, 2)], "LoRA, ", capsys)
