"""The padding-free update (`engine.trainer.packing`): rows packed end to end give the padded batch's
per-row log-probs, loss, gradients and training step, in every loss aggregation, with one batch
shape per run and the micro-batches of padding skipped."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from grad_fixtures import minibatch_grads
from sage_jax import models
from sage_jax.infra import parallel
from sage_jax.config import Config, DataConfig, MeshConfig, OptimConfig, RLConfig, TrainConfig
from sage_jax.core import grpo
from sage_jax.engine.trainer import packing, update

settings_of = update.UpdateSettings.of  # the update's settings of a run's Config

MODEL = models.DecoderConfig(family="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
PROMPT, ANSWER = 6, 14


def make_batch(n=16, seed=0):
    """Left-padded prompts of 2..6 tokens; answers of very different lengths: one row in each
    mini-batch runs to the cap, the others end early (as real rollouts do)."""
    rng = np.random.default_rng(seed)
    col = np.arange(PROMPT + ANSWER)
    plen = rng.integers(2, PROMPT + 1, n)
    alen = np.where(np.isin(np.arange(n), (3, 12)), ANSWER, rng.integers(1, 5, n))
    mask = (col[None] >= PROMPT - plen[:, None]) & (col[None] < PROMPT + alen[:, None])
    tokens = np.where(mask, rng.integers(1, MODEL.vocab_size, mask.shape), 0).astype(np.int32)
    rewards = rng.integers(0, 2, (n // 4, 4)).astype(np.float32)
    return dict(tokens_NxL=tokens, mask_NxL=mask, loss_mask_NxL=mask & (col[None] >= PROMPT),
                advantages_N=np.asarray(grpo.group_advantages(rewards)).reshape(-1),
                level_N=np.repeat(rng.integers(0, 2, n // 4), 4).astype(np.int8))


def make_cfg(**rl):
    rl = dict(dict(method="grpo", prompts_per_step=4, group_size=4, max_new_tokens=ANSWER,
                   minibatches=2, micro_batch_size=2), **rl)
    return Config(rl=RLConfig(**rl), optim=OptimConfig(lr=1e-2), train=TrainConfig(steps=10),
                  data=DataConfig(max_prompt_tokens=PROMPT))  # rows of at most 20: width 32


def one_device_mesh():
    return parallel.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])


def holding_rows(packed, cfg) -> tuple[int, int]:
    """(sequences that hold rows, micro-batches that hold answer tokens) of a packed batch."""
    m, u, r = update.batch_split(len(packed["advantages_N"]), settings_of(cfg))
    seqs = packed["segments_ZxL"].max(axis=1) > 0
    micro = packed["loss_mask_ZxL"].reshape(r, m * u, -1).any(axis=(0, 2))
    return int(seqs.sum()), int(micro.sum())


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_packing_keeps_every_row_whole_in_its_minibatch_and_saves_padding():
    batch, cfg = make_batch(), make_cfg()
    packed = update.pack_batch(batch, settings_of(cfg))
    s = len(packed["tokens_ZxL"])
    m, u, r = update.batch_split(16, settings_of(cfg))
    assert packed["tokens_ZxL"].shape == (16, update.row_len(cfg)) == (16, 32)
    used, micro = holding_rows(packed, cfg)
    assert used < 16 and micro < m * u  # fewer sequences than rows: micro-batches left empty
    seg = packed["segments_ZxL"][packed["segments_ZxL"].max(axis=1) > 0]
    assert (seg == 0).mean() < 1 - batch["mask_NxL"].mean() - 0.2  # of the sequences used
    # Within each mini-batch the sequences that hold rows fill micro-batches in order.
    for j in range(m):
        full = [packed["segments_ZxL"][slot * m * u + j * u + i].max() > 0
                for i in range(u) for slot in range(r)]
        assert full == sorted(full, reverse=True), (j, full)
    # Every row's tokens appear once, contiguous, in a sequence of its own mini-batch.
    for q in range(16):
        row = batch["tokens_NxL"][q][batch["mask_NxL"][q]]
        hits = []
        for t in range(s):
            seg = packed["segments_ZxL"][t]
            for g in range(1, seg.max() + 1):
                if np.array_equal(packed["tokens_ZxL"][t][seg == g], row) and (
                        packed["advantages_ZxL"][t][seg == g] == batch["advantages_N"][q]).all():
                    hits.append(t)
        assert hits, q
        assert {(t // u) % m for t in hits} == {(q // u) % m}  # its padded mini-batch


@pytest.mark.parametrize("block_min", [32, 3])  # one attention block per row, or several
@pytest.mark.slow
def test_packed_rows_get_the_log_probs_each_row_gets_alone(block_min, monkeypatch):
    monkeypatch.setattr(models.decoder, "ATTN_BLOCK_MIN", block_min)
    if block_min < 32:
        assert len(models.decoder.causal_blocks(PROMPT + ANSWER)) > 4
    model = models.Decoder(MODEL, rngs=nnx.Rngs(0))
    graphdef, params = models.split(model)
    batch = make_batch()
    packed = update.pack_batch(batch, settings_of(make_cfg()))
    alone = np.asarray(grpo.token_logprobs(graphdef, params, batch["tokens_NxL"],
                                           batch["mask_NxL"], need_NxL=batch["loss_mask_NxL"]))
    together = np.asarray(grpo.packed_token_logprobs(graphdef, params, packed["tokens_ZxL"],
                                                     packed["segments_ZxL"],
                                                     packed["loss_mask_ZxL"]))
    want = np.sort(alone[batch["loss_mask_NxL"]])
    got = np.sort(together[packed["loss_mask_ZxL"]])
    assert want.shape == got.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).min() > 1e-3  # real log-probs, not zeros


@pytest.mark.parametrize("agg", grpo.AGG_MODES)
@pytest.mark.slow
def test_packed_update_equals_padded_update(agg):
    """Loss, gradients and one whole two-update step, old log-probs recomputed or given."""
    cfg, mesh = make_cfg(loss_agg=agg), one_device_mesh()
    # eps=1: an update is about lr * g, so the params compare the gradients (Adam's first
    # step, g / |g|, would magnify the float noise of near-zero gradients).
    cfg = dataclasses.replace(cfg, optim=OptimConfig(lr=1.0, eps=1.0))
    batch = make_batch(seed=1)
    packed = update.pack_batch(batch, settings_of(cfg))
    assert holding_rows(packed, cfg)[1] < 8  # some micro-batches are skipped
    graphdef, state = update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(1)),
                                              settings_of(cfg), mesh)

    grads = jax.jit(lambda p, b: minibatch_grads(p, b, graphdef=graphdef, cfg=cfg, mesh=mesh))
    (g_pad, m_pad), (g_pack, m_pack) = grads(state.params, batch), grads(state.params, packed)
    assert max_diff(g_pad, jax.tree.map(np.zeros_like, g_pad)) > 1e-4  # a real gradient
    assert max_diff(g_pad, g_pack) < 1e-6, agg
    for key in ("loss", "pg_loss", "entropy", "kl/old_new"):
        np.testing.assert_allclose(m_pack[key], m_pad[key], rtol=1e-5, atol=1e-7)

    step = update.TrainStep(graphdef, settings_of(cfg), mesh)
    params = jax.device_get(state.params)
    out_pad, met_pad = step(jax.tree.map(np.copy, state), packing.as_packed(batch))
    _, state2 = update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(1)),
                                        settings_of(cfg), mesh)
    out_pack, met_pack = step(state2, packed)
    assert max_diff(out_pad.params, params) > 1e-4  # the step moved the params
    assert max_diff(out_pad.params, out_pack.params) < 1e-5, agg
    for key in ("loss", "grad_norm", "tokens", "batch/hinted_token_frac", "batch/hinted_abs_adv"):
        np.testing.assert_allclose(met_pack[key], met_pad[key], rtol=1e-5, atol=1e-7)


def test_every_packed_batch_of_a_run_has_one_shape():
    """Rows of any lengths (up to the run's longest) pack to the same shape: one program."""
    cfg = make_cfg()
    shapes = {update.pack_batch(make_batch(seed=seed), settings_of(cfg))["tokens_ZxL"].shape
              for seed in range(4)}
    short = make_batch(seed=5)
    short["mask_NxL"][:, PROMPT + 2:] = False  # every answer ends after 2 tokens
    short["loss_mask_NxL"] &= short["mask_NxL"]
    shapes.add(update.pack_batch(short, settings_of(cfg))["tokens_ZxL"].shape)
    assert shapes == {(16, update.row_len(cfg))}


@pytest.mark.parametrize("rows,seed,minibatches,micro,shape", [
    (32, 3, 1, 8, (1, 1, 1)),  # 7 sequences of 8 in micro-batch 0, 3 skipped
    (32, 4, 2, 8, (1, 1, 1)),  # 5 and 4 of 8
    (32, 3, 2, 8, (8, 1, 1)),  # sequences split over 8 devices
    (32, 3, 2, 8, (2, 2, 2)),
])
@pytest.mark.slow
def test_packed_step_with_skipped_micro_batches_equals_padded(
        rows, seed, minibatches, micro, shape):
    """Packed batches whose last micro-batches hold no rows (skipped) or only some (padding
    sequences), on 1 device and on 8-device meshes, give the padded update's step on 1
    device."""
    cfg = make_cfg(prompts_per_step=rows // 4, minibatches=minibatches, micro_batch_size=micro)
    # eps=1: an update is about lr * g, so the params compare the gradients (Adam's first
    # step, g / |g|, would magnify the float noise of near-zero gradients).
    cfg = dataclasses.replace(cfg, optim=OptimConfig(lr=1.0, eps=1.0))
    batch = make_batch(rows, seed)
    base = one_device_mesh()
    mesh = base if shape == (1, 1, 1) else parallel.make_mesh(MeshConfig(*shape))
    packed = update.pack_batch(batch, settings_of(cfg))
    used, computed = holding_rows(packed, cfg)
    m, u, r = update.batch_split(rows, settings_of(cfg))
    assert used < rows and computed < m * u  # the cases this test is for
    seqs = (packed["segments_ZxL"].max(axis=1) > 0).reshape(r, m * u).sum(axis=0)
    assert ((seqs > 0) & (seqs < r)).any()  # and a micro-batch that is partly padding
    update.check_batch(packed, settings_of(cfg), mesh)

    def step(batch, mesh):
        graphdef, state = update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(1)),
                                                  settings_of(cfg),
                                                  mesh)
        return update.TrainStep(graphdef, settings_of(cfg), mesh)(state,
                                                           parallel.shard_batch(batch, mesh))

    (pad, met_pad), (pack, met_pack) = step(packing.as_packed(batch), base), step(packed, mesh)
    start = update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(1)),
                                    settings_of(cfg), base)[1]
    assert max_diff(pad.params, start.params) > 1e-4  # the step moved the params
    assert max_diff(pad.params, pack.params) < 1e-5
    for key in ("loss", "grad_norm", "tokens", "entropy"):
        np.testing.assert_allclose(met_pack[key], met_pad[key], rtol=1e-5, atol=1e-7)
    # Of the slots computed (skipped micro-batches excluded; a partly used one counts whole).
    assert float(met_pack["batch/padding_share"]) < float(met_pad["batch/padding_share"])


def test_a_bad_packed_batch_is_named():
    cfg, mesh = make_cfg(), one_device_mesh()
    packed = update.pack_batch(make_batch(), settings_of(cfg))
    with pytest.raises(ValueError, match="segments_ZxL"):
        update.check_batch({k: v for k, v in packed.items() if k != "segments_ZxL"},
                           settings_of(cfg), mesh)
    with pytest.raises(ValueError, match="as many sequences as rows"):
        update.check_batch({k: (v[:-1] if k.endswith("_ZxL") else v)
                            for k, v in packed.items()}, settings_of(cfg), mesh)
