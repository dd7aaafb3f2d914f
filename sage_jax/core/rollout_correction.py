"""Rollout correction: importance weights of the trainer's policy over the engine that sampled.

The sampling engine (the jit sampler, or vLLM) and the trainer score the same tokens with
different numerics, so the answers are slightly off-policy for the trainer. Per answer token,
r_t = pi_trainer(token) / pi_engine(token) = exp(old_logp - sampler_logp), both in the context the
answer was sampled in. Two corrections weight the clipped surrogate's per-token losses:
  token     truncated importance sampling: w_t = min(r_t, cap);
  sequence  masked sequence-level importance sampling: the answer's ratio r = prod_t r_t; every
            token of an answer with r outside [1/cap, cap] gets w = 0, the others w = 1.
The weights carry no gradient. At a temperature other than 1, or with top-p / top-k, an engine's
log-probs are not those of its sampling distribution, so r_t is not the sampling ratio.

Shapes: N rows (or Z packed sequences), T columns; `segments_ZxL` numbers each row's tokens within
a packed sequence (1, 2, ...; 0 on padding), or is None for one row per sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sage_jax.core.grpo import LOG_RATIO_CLAMP

MODES = ("none", "token", "sequence")


def answer_sums(x_NxT, mask_NxT, segments_ZxL=None):
    """Per token, the sum of `x` over the mask tokens of its row (its segment, when packed)."""
    x = jnp.where(mask_NxT, x_NxT, 0.0)
    if segments_ZxL is None:
        return jnp.broadcast_to(jnp.sum(x, axis=1, keepdims=True), x.shape)
    n, t = x.shape
    ids = jnp.arange(n)[:, None] * (t + 1) + segments_ZxL
    sums = jax.ops.segment_sum(x.ravel(), ids.ravel(), num_segments=n * (t + 1))
    return sums[ids]


def weights(old_logp_NxT, sampler_logp_NxT, mask_NxT, *, mode: str, cap: float,
            segments_ZxL=None):
    """(w_NxT, ratio_NxT, changed_NxT): the per-token weights of `mode` (1 off the mask and for
    "none"), the ratio that mode compares with the cap on each token (r_t for "token", the
    answer's r for "sequence", clamped to exp(+-20)), and the mask tokens whose weight is not
    their ratio ("token": truncated at the cap; "sequence": masked)."""
    if mode not in MODES:
        raise ValueError(f"rollout correction mode must be one of {MODES}, got {mode!r}")
    log_r = jnp.where(mask_NxT, old_logp_NxT - sampler_logp_NxT, 0.0)
    if mode == "sequence":
        log_r = answer_sums(log_r, mask_NxT, segments_ZxL)
    log_r = jax.lax.stop_gradient(jnp.clip(log_r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ratio = jnp.exp(log_r)
    if mode == "token":
        w = jnp.minimum(ratio, cap)
        changed = mask_NxT & (ratio > cap)
    elif mode == "sequence":
        keep = jnp.abs(log_r) <= jnp.log(cap)
        w = keep.astype(jnp.float32)
        changed = mask_NxT & ~keep
    else:
        w, changed = jnp.ones_like(ratio), jnp.zeros_like(mask_NxT)
    return jnp.where(mask_NxT, w, 1.0), ratio, changed


def metrics(ratio_NxT, changed_NxT, mask_NxT, token_denom) -> dict:
    """rollout_correction/ratio_mean (over answer tokens, each with its mode's ratio),
    rollout_correction/ratio_max and rollout_correction/masked_share (the share of answer tokens
    whose weight is not their ratio: truncated, or in a masked answer); the sums are divided by
    `token_denom`, so micro-batches' means add up (the max is a max)."""
    return {"rollout_correction/ratio_mean": jnp.sum(jnp.where(mask_NxT, ratio_NxT, 0.0))
            / token_denom,
            "rollout_correction/ratio_max": jnp.max(jnp.where(mask_NxT, ratio_NxT, 0.0)),
            "rollout_correction/masked_share": jnp.sum(changed_NxT.astype(jnp.float32))
            / token_denom}
