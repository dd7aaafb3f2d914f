"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

`select(logits_RxV, keys_R, t, st)` applies, in the order `transformers` does, the temperature,
then the top-k filter (`top_k=0`: off), then the top-p filter (`top_p=1`: off, and then free);
`temperature=0` is greedy (argmax). The nucleus is the smallest set of most likely tokens whose
mass reaches top_p (ties at its edge kept). A token is drawn by inverse CDF with two uniform
draws per row and step (block, then token within block), from `fold_in(keys_R[r], t)`.

The returned log-prob is the log-softmax of the *raw* logits (temperature 1, no filters) at the
chosen token: what the GRPO update recomputes as the "old" log-prob.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _top_p_threshold(w_RxV: jax.Array, top_p: float) -> jax.Array:
    """Per row, the largest weight tau with sum(w[w >= tau]) >= top_p * sum(w); [R, 1].

    Bisection on the bit pattern of tau (order-preserving for floats >= 0; weights are in
    [0, 1]): 30 passes over V, exact, and far cheaper than sorting V on CPU.
    """
    target = top_p * jnp.sum(w_RxV, axis=-1)
    r = w_RxV.shape[0]
    lo = jnp.zeros((r,), jnp.int32)  # tau = 0 keeps everything: satisfies
    hi = jnp.full((r,), np.float32(1.0).view(np.int32) + 1, jnp.int32)  # tau > 1 keeps nothing

    def body(_, c):
        lo, hi = c
        mid = lo + (hi - lo) // 2
        tau = jax.lax.bitcast_convert_type(mid, jnp.float32)[:, None]
        ok = jnp.sum(jnp.where(w_RxV >= tau, w_RxV, 0.0), axis=-1) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 30, body, (lo, hi))  # hi - lo: 0x3F800001 < 2**30 -> 1
    return jax.lax.bitcast_convert_type(lo, jnp.float32)[:, None]


def _draw(w_RxV: jax.Array, u_Rx2: jax.Array) -> jax.Array:
    """A token per row with probability proportional to the weights w >= 0 (inverse CDF).

    Two levels -- a block of ~sqrt(V) tokens, then a token inside it, each with its own uniform
    -- so that no cumulative sum over all of V is needed.
    """
    r, v = w_RxV.shape
    bs = 1 << max(3, math.ceil(math.log2(math.sqrt(v))))
    nb = -(-v // bs)
    w = jnp.pad(w_RxV, ((0, 0), (0, nb * bs - v))).reshape(r, nb, bs)

    def pick(weights, u_R):  # weights [R, n] of n candidates (blocks, or tokens of a block)
        # First index whose cumulative weight reaches (1 - u) * total > 0: never a zero weight,
        # unless rounding in the cumulative sum says otherwise (then: the largest weight).
        cdf = jnp.cumsum(weights, axis=-1)
        target = (1.0 - u_R)[:, None] * cdf[:, -1:]
        i = jnp.minimum(jnp.sum(cdf < target, axis=-1), weights.shape[-1] - 1)
        ok = jnp.take_along_axis(weights, i[:, None], axis=-1)[:, 0] > 0
        return jnp.where(ok, i, jnp.argmax(weights, axis=-1))

    blk = pick(jnp.sum(w, axis=-1), u_Rx2[:, 0])
    inner = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]
    return (blk * bs + pick(inner, u_Rx2[:, 1])).astype(jnp.int32)


def select(logits_RxV: jax.Array, keys_R, t, st):
    """One token per row; returns (tokens_R int32, logprob_R float32 at temperature 1).
    `t`: the step each row draws for (a scalar, or one per row [R]); `st` carries the static
    knobs temperature, top_p and top_k."""
    logits = logits_RxV.astype(jnp.float32)
    v = logits.shape[-1]
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = None  # exp(logits - m), when it is computed anyway
    if st.temperature == 0:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        x, mx = logits, m
        if st.temperature != 1.0:
            x, mx = logits / st.temperature, m / st.temperature
        if st.top_k and st.top_k < v:
            kth = jax.lax.top_k(x, st.top_k)[0][:, -1:]
            x = jnp.where(x >= kth, x, -jnp.inf)
        w = jnp.exp(x - mx)  # unnormalised sampling weights in [0, 1], max 1
        if st.temperature == 1.0 and not st.top_k:
            e = w
        if st.top_p < 1.0:
            w = jnp.where(w >= _top_p_threshold(w, st.top_p), w, 0.0)
        t_R = jnp.broadcast_to(jnp.asarray(t, jnp.int32), keys_R.shape[:1])
        u = jax.vmap(lambda k, i: jax.random.uniform(jax.random.fold_in(k, i), (2,)))(keys_R, t_R)
        tok = _draw(w, u)
    if e is None:
        e = jnp.exp(logits - m)
    chosen = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0]
    logp = chosen - m[:, 0] - jnp.log(jnp.sum(e, axis=-1))
    return tok, logp


def is_eos(tok_R, eos_ids):
    """True where the token is one of `eos_ids` (a static tuple)."""
    done = jnp.zeros(tok_R.shape, bool)
    for e in eos_ids:
        done = done | (tok_R == e)
    return done
