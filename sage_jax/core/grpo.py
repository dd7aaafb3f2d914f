"""GRPO maths as pure functions: group advantages, the clipped surrogate, the k3 KL penalty and
token log-probs / entropies computed in sequence chunks from the decoder's final hidden states.

Shapes: B prompts, G answers per prompt, N = B*G rows, L tokens per row (prompt + answer), Z
packed sequences (rows end to end, `trainer.packing`), D hidden size, V vocabulary, C chunk
length. Token arrays follow the batch layout of `update.py`:
column t of `logp_NxL` is log p(tokens[t] | tokens[<t]), so the loss can use `loss_mask_NxL`
(the answer tokens, end-of-sequence included) directly.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LOG_RATIO_CLAMP = 20.0  # |log pi_new - log pi_old| is clamped to this before exp (as verl does).
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ADV_SCALES = ("group", "batch", "none")


def group_advantages(rewards_BxG: jax.Array | np.ndarray, *, scale: str = "group",
                     eps: float = 1e-6) -> jax.Array:
    """One advantage per answer: (r - group mean) / (std + eps), float32 [B, G].

    scale: "group" = std of each group, "batch" = one std over all B*G rewards, "none" = no
    division (Dr.GRPO). Stds use Bessel's correction (ddof=1). A collapsed group (all rewards
    equal) gets exactly 0, never NaN.
    """
    if scale not in ADV_SCALES:
        raise ValueError(f"advantage scale {scale!r} is not one of {ADV_SCALES}")
    chex.assert_rank(rewards_BxG, 2)
    r = rewards_BxG.astype(jnp.float32)
    centered = r - jnp.mean(r, axis=1, keepdims=True)
    collapsed_Bx1 = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
    if scale == "group":
        centered = centered / (jnp.std(r, axis=1, ddof=1, keepdims=True) + eps)
    elif scale == "batch":
        centered = centered / (jnp.std(r, ddof=1) + eps)
    return jnp.where(collapsed_Bx1, 0.0, centered)


def aggregate(loss_NxT, mask_NxT, *, agg: str = "token-mean", denom=None, norm_len=None,
              row_len_ZxL=None):
    """Masked per-token losses -> one scalar.

    token-mean: sum / denom (default: the number of mask tokens).
    seq-mean-token-mean: mean over each row's tokens, summed over rows / denom.
    seq-mean-token-sum-norm: each row's token sum / norm_len (a constant, default T), summed
      over rows / denom.
    For the seq modes denom defaults to the number of rows with at least one mask token. Pass
    the whole mini-batch's count as `denom` so that micro-batch losses add up to its loss.
    `row_len_ZxL`: packed sequences (`trainer.packing`: several rows per line, Z lines of L
    columns), each token carrying its row's mask count; the seq modes then weigh tokens (1 /
    row count, or 1 / norm_len) and need `denom`.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"loss aggregation {agg!r} is not one of {AGG_MODES}")
    m = mask_NxT.astype(jnp.float32)
    masked = jnp.where(mask_NxT, loss_NxT, 0.0)
    if agg == "token-mean":
        d = jnp.maximum(jnp.sum(m), 1.0) if denom is None else denom
        return jnp.sum(masked) / d
    if row_len_ZxL is not None:
        packed_needs = "aggregate over packed rows (row_len_ZxL) needs denom and norm_len"
        if denom is None:
            raise ValueError(packed_needs)
        if agg == "seq-mean-token-mean":
            return jnp.sum(masked / jnp.maximum(row_len_ZxL, 1.0)) / denom
        if norm_len is None:  # seq-mean-token-sum-norm
            raise ValueError(packed_needs)
        return jnp.sum(masked) / norm_len / denom
    count_N = jnp.sum(m, axis=1)
    if agg == "seq-mean-token-mean":
        seq_N = jnp.sum(masked, axis=1) / jnp.maximum(count_N, 1.0)
    else:
        seq_N = jnp.sum(masked, axis=1) / (loss_NxT.shape[1] if norm_len is None else norm_len)
    d = jnp.maximum(jnp.sum(count_N > 0), 1) if denom is None else denom
    return jnp.sum(seq_N) / d


def policy_loss(logp_NxT, old_logp_NxT, advantages, mask_NxT, *, clip_low: float = 0.2,
                clip_high: float = 0.28, dual_clip: float = 3.0, agg: str = "token-mean",
                denom=None, norm_len=None, token_denom=None, row_len_ZxL=None, weights_NxT=None):
    """PPO clipped surrogate with clip-higher and dual clip, as verl's `compute_policy_loss`.

    ratio = exp(clamp(logp - old_logp, -20, 20));
    pg = max(-A*ratio, -A*clip(ratio, 1-clip_low, 1+clip_high)); for A < 0 and dual_clip > 0,
    pg = min(pg, -A*dual_clip). Returns (loss, metrics) with the loss aggregated by `aggregate`
    (`row_len_ZxL`: packed rows, see there). `advantages`: one per row [N], or one per
    token [N, T] (packed rows: each token carries its row's). `weights_NxT`: per-token weights
    of the losses before aggregation (`rollout_correction.weights`; None: 1).
    Metrics are token fractions over `mask_NxT` (divided by `token_denom`, default the mask
    count, so micro-batch metrics add up too):
      clip/frac_low   A < 0 and the ratio was clipped at 1 - clip_low,
      clip/frac_high  A > 0 and the ratio was clipped at 1 + clip_high,
      clip/frac_dual  A < 0 and the dual-clip bound was active,
      kl/old_new      k3 estimate of KL(pi_old || pi_new): mean of (ratio - 1) - log(ratio).
    """
    chex.assert_equal_shape([logp_NxT, old_logp_NxT, mask_NxT])
    chex.assert_rank(advantages, {1, 2})
    log_ratio = jnp.clip(logp_NxT - old_logp_NxT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    a = advantages.astype(jnp.float32)
    a = a if a.ndim == 2 else a[:, None]
    pg_unclipped = -a * ratio
    pg_clipped = -a * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = jnp.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    dual = jnp.zeros_like(clipped)
    if dual_clip:
        bound = -a * dual_clip
        dual = (a < 0) & (pg > bound)
        pg = jnp.where(a < 0, jnp.minimum(pg, bound), pg)
    if weights_NxT is not None:
        pg = pg * jax.lax.stop_gradient(weights_NxT)
    loss = aggregate(pg, mask_NxT, agg=agg, denom=denom, norm_len=norm_len,
                     row_len_ZxL=row_len_ZxL)
    m = mask_NxT.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(m), 1.0) if token_denom is None else token_denom

    def frac(x):
        return jax.lax.stop_gradient(jnp.sum(jnp.where(mask_NxT, x, 0).astype(jnp.float32))
                                     / tokens)

    metrics = {
        "clip/frac_low": frac(clipped & (a < 0)),
        "clip/frac_high": frac(clipped & (a > 0)),
        "clip/frac_dual": frac(dual),
        "kl/old_new": frac((ratio - 1.0) - log_ratio),
    }
    return loss, metrics


def kl_k3(logp_NxT, ref_logp_NxT):
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1.

    The log-ratio is clamped to +-20 and the estimate to <= 10, as verl's `low_var_kl`."""
    d = jnp.clip(ref_logp_NxT - logp_NxT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.minimum(jnp.exp(d) - d - 1.0, 10.0)


def _chunk_stats(logits_fn, h_NxCxD, tokens_NxC, need_NxC):
    """log p(token) and entropy [N, C] from hidden states that predict `tokens_NxC`."""
    logits = logits_fn(h_NxCxD).astype(jnp.float32)  # [N, C, V]
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tokens_NxC[..., None], axis=-1)[..., 0]
    probs = jax.lax.stop_gradient(jax.nn.softmax(logits, axis=-1))
    ent = jax.lax.stop_gradient(lse - jnp.sum(probs * logits, axis=-1))
    return jnp.where(need_NxC, picked - lse, 0.0), jnp.where(need_NxC, ent, 0.0)


def logprobs_from_hidden(logits_fn, h_NxLxD, tokens_NxL, need_NxL, *, chunk: int | None = 256,
                         remat_logits: bool = True):
    """(logp_NxL, entropy_NxL): column t is log p(tokens[t] | <t) and the entropy of that
    next-token distribution, from the final hidden states h (position t-1 predicts token t).

    Column 0 and columns where `need_NxL` is False are 0. With `chunk`, the logits are made
    C columns at a time inside a `lax.scan` whose body is `jax.checkpoint`ed (`remat_logits`), so
    neither the forward nor the backward pass ever holds more than [N, C, V] float32 logits;
    chunks without a needed column (e.g. the prompt) are skipped. `remat_logits=False` keeps each
    chunk's logits for the backward pass instead of recomputing them (faster, more memory).
    `chunk=None` computes all columns at once. Entropies carry no gradient.
    """
    n, length, d = h_NxLxD.shape
    h_prev = jnp.concatenate([jnp.zeros((n, 1, d), h_NxLxD.dtype), h_NxLxD[:, :-1]], axis=1)
    need = need_NxL.astype(bool) & (jnp.arange(length) >= 1)[None]
    if chunk is None or chunk >= length:
        return _chunk_stats(logits_fn, h_prev, tokens_NxL, need)
    pad = -length % chunk
    nc = (length + pad) // chunk

    def chunks(x):  # [N, L, ...] -> [nc, N, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(n, nc, chunk, *x.shape[2:]), 1, 0)

    def body(carry, xs):
        h_c, tok_c, need_c = xs
        out = jax.lax.cond(
            jnp.any(need_c), lambda: _chunk_stats(logits_fn, h_c, tok_c, need_c),
            lambda: (jnp.zeros(need_c.shape, jnp.float32),) * 2)
        return carry, out

    _, (logp, ent) = jax.lax.scan(jax.checkpoint(body) if remat_logits else body, None,
                                  (chunks(h_prev), chunks(tokens_NxL), chunks(need)))

    def unchunk(x):  # [nc, N, C] -> [N, L]
        return jnp.moveaxis(x, 0, 1).reshape(n, nc * chunk)[:, :length]

    return unchunk(logp), unchunk(ent)


def token_logprobs_and_entropy(graphdef, params, tokens_NxL, mask_NxL, *, need_NxL=None,
                               chunk: int | None = 256):
    """(logp_NxL, entropy_NxL) of the decoder (graphdef, params) on left-padded rows.

    `mask_NxL` marks valid tokens (attention and positions); `need_NxL` (default: valid tokens
    with a valid predecessor) marks the columns whose values are wanted, e.g. the loss mask.
    """
    model = nnx.merge(graphdef, params)
    mask = mask_NxL.astype(bool)
    h = model.hidden(tokens_NxL, mask_BxT=mask)
    if need_NxL is None:  # a valid predecessor
        need_NxL = mask & jnp.pad(mask[:, :-1], [(0, 0), (1, 0)])
    return logprobs_from_hidden(model.logits, h, tokens_NxL, need_NxL, chunk=chunk)


def token_logprobs(graphdef, params, tokens_NxL, mask_NxL, *, need_NxL=None,
                   chunk: int | None = 256):
    """logp_NxL: log p(tokens[t] | tokens[<t]) for t >= 1, 0 at t = 0 and where not needed."""
    return token_logprobs_and_entropy(graphdef, params, tokens_NxL, mask_NxL,
                                      need_NxL=need_NxL, chunk=chunk)[0]


def packed_token_logprobs(graphdef, params, tokens_ZxL, segments_ZxL, need_ZxL, *,
                          chunk: int | None = 256):
    """logp_ZxL of packed sequences (`trainer.packing`, `Decoder.packed_hidden`): each row's
    tokens get the log-probs the row gets alone; 0 where `need_ZxL` is False."""
    model = nnx.merge(graphdef, params)
    h = model.packed_hidden(tokens_ZxL, segments_ZxL)
    return logprobs_from_hidden(model.logits, h, tokens_ZxL, need_ZxL, chunk=chunk)[0]
