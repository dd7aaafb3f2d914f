"""GRPO maths against hand-computed values: advantages, the clipped loss and its gradients,
aggregations, KL, and chunked log-probs / entropies against a direct computation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax.core import grpo
from sage_jax import models


# ---------------------------------------------------------------------------------- advantages

def test_group_advantages_by_hand():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    # Group 0: mean 0.5, Bessel std sqrt(4 * 0.25 / 3) = sqrt(1/3).
    s0 = math.sqrt(1 / 3)
    # Group 1: mean 0.25, deviations (0.75, -0.25 x3), std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5.
    want = np.array([[0.5 / (s0 + 1e-6), -0.5 / (s0 + 1e-6), -0.5 / (s0 + 1e-6), 0.5 / (s0 + 1e-6)],
                     [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001]])
    np.testing.assert_allclose(grpo.group_advantages(r), want, rtol=1e-6)
    # Dr.GRPO: no scaling.
    np.testing.assert_allclose(grpo.group_advantages(r, scale="none"),
                               [[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25]], rtol=1e-6)
    # Batch: one std over all 8 rewards (3 ones): mean 3/8, var = (3*(5/8)^2 + 5*(3/8)^2) / 7.
    sb = math.sqrt((3 * 25 / 64 + 5 * 9 / 64) / 7)
    np.testing.assert_allclose(grpo.group_advantages(r, scale="batch"),
                               np.array([[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25]])
                               / (sb + 1e-6), rtol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_collapsed_group_is_exactly_zero(scale):
    # 0.1 * 3 / 3 != 0.1 in floating point: the mean alone would not give exactly 0.
    r = np.array([[0.1, 0.1, 0.1], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]], np.float32)
    a = np.asarray(grpo.group_advantages(r, scale=scale))
    assert np.all(np.isfinite(a))
    assert np.all(a[:3] == 0.0)
    assert np.all(a[3] != 0.0)
    # A whole batch of collapsed groups: std 0 everywhere, still exactly 0 and finite.
    z = np.asarray(grpo.group_advantages(np.zeros((2, 4)), scale=scale))
    assert np.all(z == 0.0)


def test_unknown_scale_is_an_error():
    with pytest.raises(ValueError, match="group"):
        grpo.group_advantages(np.zeros((1, 2)), scale="std")


# ---------------------------------------------------------------------------------- the loss

# Two answers, four tokens each; the last token of row 0 is masked out.
# Row 0 (A = +1): ratios 1.5 (clipped at 1.28), 0.5 (not clipped: -0.5 > -0.8), 1.1, [masked].
# Row 1 (A = -1): ratios 1.5 (unclipped, 1.5 < 3), 0.5 (clipped at 0.8), 4.0 (dual clip: 3), 1.0.
RATIOS = np.array([[1.5, 0.5, 1.1, 9.0], [1.5, 0.5, 4.0, 1.0]])
ADV = np.array([1.0, -1.0])
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
PG = np.array([[-1.28, -0.5, -1.1, 0.0], [1.5, 0.8, 3.0, 1.0]])  # per-token loss by hand
# d pg / d logp = -A * ratio where unclipped, 0 where a clip is active.
DPG = np.array([[0.0, -0.5, -1.1, 0.0], [1.5, 0.0, 0.0, 1.0]])


def _loss(agg, dual_clip=3.0, denom=None):
    old = np.log(np.full(RATIOS.shape, 0.25))
    logp = jnp.asarray(old + np.log(RATIOS), jnp.float32)
    fn = lambda lp: grpo.policy_loss(lp, old, ADV, MASK, agg=agg, dual_clip=dual_clip,  # noqa
                                     denom=denom)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp)
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def test_token_mean_loss_and_gradient_by_hand():
    loss, metrics, grad = _loss("token-mean")
    np.testing.assert_allclose(loss, PG.sum() / 7, rtol=1e-6)
    np.testing.assert_allclose(grad, DPG / 7, rtol=1e-5, atol=1e-7)
    assert metrics["clip/frac_high"] == pytest.approx(1 / 7)
    assert metrics["clip/frac_low"] == pytest.approx(1 / 7)
    assert metrics["clip/frac_dual"] == pytest.approx(1 / 7)
    # k3 of KL(old || new) per token: (ratio - 1) - log(ratio), masked mean.
    k3 = (RATIOS - 1) - np.log(RATIOS)
    assert metrics["kl/old_new"] == pytest.approx((k3 * MASK).sum() / 7, rel=1e-5)


def test_seq_aggregations_by_hand():
    loss, _, grad = _loss("seq-mean-token-mean")
    rows = PG.sum(1) / MASK.sum(1)
    np.testing.assert_allclose(loss, rows.mean(), rtol=1e-6)
    np.testing.assert_allclose(grad, DPG / MASK.sum(1, keepdims=True) / 2, rtol=1e-5, atol=1e-7)
    loss, _, grad = _loss("seq-mean-token-sum-norm")
    np.testing.assert_allclose(loss, (PG.sum(1) / 4).mean(), rtol=1e-6)  # T = 4 columns
    np.testing.assert_allclose(grad, DPG / 4 / 2, rtol=1e-5, atol=1e-7)


def test_dual_clip_off():
    loss, metrics, grad = _loss("token-mean", dual_clip=0.0)
    pg = PG.copy()
    pg[1, 2] = 4.0  # -A * ratio, no bound
    np.testing.assert_allclose(loss, pg.sum() / 7, rtol=1e-6)
    assert metrics["clip/frac_dual"] == 0.0
    assert grad[1, 2] == pytest.approx(4.0 / 7, rel=1e-5)


def test_clip_higher_is_asymmetric():
    # Ratio 1.25 with A > 0 is inside [0.8, 1.28]: not clipped (it would be with eps_high 0.2).
    old = np.zeros((1, 1))
    logp = np.log(np.full((1, 1), 1.25))
    _, m = grpo.policy_loss(logp, old, np.ones(1), np.ones((1, 1), bool))
    assert float(m["clip/frac_high"]) == 0.0
    _, m = grpo.policy_loss(logp, old, np.ones(1), np.ones((1, 1), bool), clip_high=0.2)
    assert float(m["clip/frac_high"]) == 1.0


def test_log_ratio_is_clamped():
    loss, _ = grpo.policy_loss(np.array([[100.0]]), np.zeros((1, 1)), -np.ones(1),
                               np.ones((1, 1), bool), dual_clip=0.0)
    assert float(loss) == pytest.approx(math.exp(20.0), rel=1e-5)


def test_reinforce_gradient_at_ratio_one():
    """At ratio 1 the token-mean gradient wrt logp is -A / num_tokens on every answer token."""
    rng = np.random.default_rng(0)
    adv = np.asarray(grpo.group_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]))).reshape(-1)
    mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], bool)
    logp = jnp.asarray(rng.normal(size=mask.shape) - 3.0, jnp.float32)
    grad = jax.grad(lambda lp: grpo.policy_loss(lp, logp, adv, mask)[0])(logp)
    np.testing.assert_allclose(grad, np.where(mask, -adv[:, None] / mask.sum(), 0.0),
                               rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("agg", grpo.AGG_MODES)
def test_global_denominator_makes_micro_batches_add_up(agg):
    rng = np.random.default_rng(1)
    shape = (6, 5)
    old = rng.normal(size=shape) - 2
    logp = old + 0.3 * rng.normal(size=shape)
    adv = rng.normal(size=6)
    mask = np.arange(5)[None] < np.array([1, 5, 2, 4, 3, 5])[:, None]  # unequal lengths
    whole, mw = grpo.policy_loss(logp, old, adv, mask, agg=agg)
    denom = mask.sum() if agg == "token-mean" else 6
    parts = [grpo.policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], agg=agg,
                              denom=denom, token_denom=mask.sum()) for i in (0, 2, 4)]
    np.testing.assert_allclose(sum(float(p[0]) for p in parts), float(whole), rtol=1e-6)
    for key in mw:
        np.testing.assert_allclose(sum(float(p[1][key]) for p in parts), float(mw[key]),
                                   rtol=1e-5, atol=1e-7)


def test_kl_k3_by_hand():
    logp = np.log(np.array([[0.5, 0.25, 0.1]]))
    ref = np.log(np.array([[0.5, 0.5, 0.4]]))
    r = np.array([1.0, 2.0, 4.0])  # ref / pi
    np.testing.assert_allclose(grpo.kl_k3(logp, ref)[0], r - np.log(r) - 1, rtol=1e-6)
    # Gradient wrt logp: d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - ref/pi.
    g = jax.grad(lambda lp: grpo.kl_k3(lp, ref).sum())(jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(g[0], 1 - r, rtol=1e-5)


# ---------------------------------------------------------------------------------- log-probs

@pytest.fixture(scope="module")
def tiny():
    cfg = models.DecoderConfig(family="qwen2", vocab_size=50, hidden_size=16, intermediate_size=32,
                             num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, qkv_bias=True)
    graphdef, params = models.split(models.Decoder(cfg, rngs=nnx.Rngs(3)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, (3, 11)).astype(np.int32)
    mask = np.ones((3, 11), bool)
    mask[0, :3] = False  # left padding
    mask[1, 9:] = False  # right padding
    tokens = np.where(mask, tokens, 0)
    return graphdef, params, tokens, mask


@pytest.mark.slow
def test_logprobs_and_entropy_match_direct_computation(tiny):
    graphdef, params, tokens, mask = tiny
    logits = np.asarray(models.apply(graphdef, params, tokens, mask_BxT=mask), np.float64)
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = np.zeros(tokens.shape)
    want_ent = np.zeros(tokens.shape)
    for i in range(3):
        for t in range(1, 11):
            if mask[i, t] and mask[i, t - 1]:
                want[i, t] = logsm[i, t - 1, tokens[i, t]]
                want_ent[i, t] = -(np.exp(logsm[i, t - 1]) * logsm[i, t - 1]).sum()
    logp, ent = grpo.token_logprobs_and_entropy(graphdef, params, tokens, mask, chunk=None)
    np.testing.assert_allclose(logp, want, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.slow
def test_chunked_equals_unchunked_with_gradients(tiny, chunk):
    graphdef, params, tokens, mask = tiny
    need = mask.copy()
    need[:, :6] = False  # only "answer" columns: the first chunks are skipped

    def f(p, chunk):
        logp, ent = grpo.token_logprobs_and_entropy(graphdef, p, tokens, mask, need_NxL=need,
                                                    chunk=chunk)
        return jnp.sum(logp * jnp.arange(11)), (logp, ent)

    vg = jax.jit(jax.value_and_grad(f, has_aux=True), static_argnums=1)
    (v1, (lp1, e1)), g1 = vg(params, None)
    (v2, (lp2, e2)), g2 = vg(params, chunk)
    assert np.all(np.asarray(lp2)[~need] == 0.0)
    np.testing.assert_allclose(lp2, lp1, atol=1e-6)
    np.testing.assert_allclose(e2, e1, atol=1e-6)
    np.testing.assert_allclose(v2, v1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
