"""Jit-compiled sampling: prefill + `lax.while_loop` decode with explicit KV caches.

Shapes: B prompts, G samples per prompt, R = B*G rows (prompt-major: row b*G + g), P prompt
length, T = max_new_tokens, V vocab, L layers, K kv heads, H head dim.

Two entry points:

* `sample(graphdef, params, prompt_BxP, prompt_mask_BxP, *, key, num_samples=G, ...)` -- the
  array-level API the trainer uses. Works on the `(graphdef, params)` pytree (no host round trip
  of the weights) and returns a `SampleOutput` of device arrays shaped [B, G, T] / [B, G].
* `generate(model, prompts, ...)` -- convenience for users and tests: a `Decoder` and a list of
  token-id lists of varying lengths; returns numpy arrays with one row per sample, [N*G, T],
  prompt-major (row n*G + g is sample g of prompt n).

How a call runs:

1. Bucketing. Prompts are left-padded (mask True on the valid suffix). The prompt length is
   rounded up to a power of two >= 16 (16, 32, 64, 128, ...) and the number of prompts to a power
   of two >= 8 (8, 16, 32, 64, ...); padding rows are marked finished from the start and dropped
   from the output. A training run therefore compiles one program per (prompt bucket, batch
   bucket) pair that it meets -- a handful -- instead of one per step. `num_samples`,
   `max_new_tokens` and the sampling knobs (below) are static as well.
2. Prefill (jitted; its [B, P] `KVCache` is donated and filled in place): the B prompts run once
   through the model -- a prompt is never prefilled G times -- and only the last position's logits
   are computed (no [B, P, V] logits).
3. Decode (jitted; the generated-token cache -- per layer k [B, K, G, H, T'] and v
   [B, K, G, T', H], T' = T - 1 rounded up to 8 -- is donated and carried through a
   `lax.while_loop`, so it is updated in place; no host synchronisation inside). Each step feeds
   one token per row through the model's own layers (its norms, projections, RoPE and MLP; only
   the attention core is specialised here): a row attends to its prompt's keys/values, read once
   for the G rows that share them, and to its own generated ones. The loop ends as soon as every
   row has emitted an EOS id or T tokens.

Sampling knobs: `temperature`, `top_p`, `top_k` and `eos_ids` are *static* (part of the compiled
program's key; a run uses two or three settings -- training 1.0/1.0/0, evaluation 0.6/0.95/0,
greedy hints 0). `temperature=0` is greedy (argmax). Otherwise the logits are divided by the
temperature, then the top-k filter (`top_k=0`: off), then the top-p (nucleus) filter (`top_p=1`:
off, and then costs nothing) are applied, in that order as in `transformers`; the nucleus is the
smallest set of most likely tokens whose mass reaches top_p (ties at its edge kept). A token is
drawn by inverse CDF with two uniform draws per row and step (block, then token within block).

Log-probs: `logprobs` is the log-softmax of the model's *raw* logits (temperature 1, no top-k /
top-p) at the chosen token -- exactly what the GRPO update recomputes as "old" log-probs. With
temperature != 1 or top-k/top-p active it is therefore not the log-probability under the
distribution the token was actually drawn from.

Randomness: row (prompt b, sample g) uses `row_key = fold_in(fold_in(key, prompt_ids_B[b]), g)`
and step t draws from `fold_in(row_key, t)`. `prompt_ids_B` defaults to `arange(B)`; pass stable
ids (e.g. dataset indices) so that a row's tokens do not depend on which other prompts share the
batch or on the bucket sizes. Fold the training step / hint level into `key` before calling.

Padding: tokens after a row's end are `pad_id`; log-probs after the end are 0; `lengths` counts
the generated tokens including the EOS token.

Meshes (`sample(..., mesh=mesh)`, what the trainer passes): the sampler runs on the trainer's
("data", "fsdp", "tensor") mesh with the weights as the trainer holds them (no host round
trip). The prompts' rows -- and with them the prompt and generated-token KV caches, the logits
and the per-step token / log-prob buffers -- are split over ("data", "fsdp") when that divides
the bucketed prompt count (else they are replicated), and the caches' KV-head axis over "tensor"
when that divides the KV heads (the attention heads' split in the partition rules). Inside each
program the weights are resharded on device to the partition rules without "fsdp" (gathered
over "fsdp", still split over "tensor"): once per call, not once per decoded token. Results do
not depend on the mesh (the per-row keys above; logits only up to float summation order).
Without a mesh (the default) nothing is placed or constrained.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sage_jax import parallel
from sage_jax.models.decoder import _NEG, KVCache, apply_rope, init_cache, rope_inv_freq

PROMPT_BUCKET_MIN = 16  # prompt lengths are rounded up to 16, 32, 64, 128, ...
BATCH_BUCKET_MIN = 8  # numbers of prompts are rounded up to 8, 16, 32, 64, ...
PREFILL_SCORES_BYTES = 1 << 30  # prefill in chunks of prompts above ~1 GiB of attention scores


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int):
    """(tokens_BxP int32, mask_BxP bool) with each prompt right-aligned in `length` columns (the
    layout `sample` takes)."""
    tok = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        if not 0 < len(p) <= length:
            raise ValueError(f"prompt {i} has {len(p)} tokens; must be 1..{length}")
        tok[i, length - len(p):] = p
        mask[i, length - len(p):] = True
    return tok, mask


def prompt_bucket(n: int) -> int:
    """Padded prompt length for a prompt of n tokens: the next power of two, at least 16."""
    return max(PROMPT_BUCKET_MIN, 1 << max(n - 1, 0).bit_length())


def length_bucket(n: int) -> int:
    """Padded length of a training row of n tokens: the next multiple of 1/8 of n's power of
    two (at least 16): eight sizes per octave, so padding is under 1/8 and recompiles are few."""
    n = max(int(n), 1)
    step = max(PROMPT_BUCKET_MIN, 1 << max((n - 1).bit_length() - 4, 0))
    return -(-n // step) * step


def batch_bucket(n: int) -> int:
    """Padded number of prompts for n prompts: the next power of two, at least 8."""
    return max(BATCH_BUCKET_MIN, 1 << max(n - 1, 0).bit_length())


@flax.struct.dataclass
class SampleOutput:
    """What a sampling call returns (see the module docstring for shapes and padding).

    tokens: int32 generated tokens, `pad_id` after each row's end.
    lengths: int32 number of generated tokens per row, the EOS token included.
    logprobs: float32 log-softmax of the raw (temperature 1) logits at each generated token, 0
      after the end.
    """

    tokens: jax.Array
    lengths: jax.Array
    logprobs: jax.Array


@flax.struct.dataclass
class _Static:
    """The compile-time configuration of one sampling program (hashable)."""

    num_samples: int = flax.struct.field(pytree_node=False)
    max_new_tokens: int = flax.struct.field(pytree_node=False)
    temperature: float = flax.struct.field(pytree_node=False)
    top_p: float = flax.struct.field(pytree_node=False)
    top_k: int = flax.struct.field(pytree_node=False)
    eos_ids: tuple = flax.struct.field(pytree_node=False)
    pad_id: int = flax.struct.field(pytree_node=False)


# Incremented each time a sampling program is traced (i.e. about to be compiled); tests use it to
# check that a second batch in the same bucket does not recompile.
TRACE_COUNTS = {"prefill": 0, "decode": 0}


# ---- placement on a mesh ----------------------------------------------------------------------

# The sampler's weight layout: the trainer's partition rules with "fsdp" dropped (decode feeds
# one token per row per step, so fsdp-split weights would be gathered at every step).
SAMPLER_RULES = tuple((pattern, tuple(None if a == "fsdp" else a for a in axes))
                      for pattern, axes in parallel.PARTITION_RULES)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where one sampling program's arrays live (hashable: part of the jit cache key).

    rows: the mesh axes of the prompt / row dimension (None: replicated); kv: the mesh axis of
    the KV-head dimension of the caches (None: whole)."""

    mesh: Mesh
    rows: tuple | None
    kv: str | None


def _layout(mesh: Mesh | None, cfg, num_prompts: int) -> _Layout | None:
    """Rows over ("data", "fsdp") when that divides the (bucketed) prompt count, KV heads over
    "tensor" when that divides them; None without a mesh."""
    if mesh is None:
        return None
    rows = parallel.ROWS if num_prompts % parallel.row_shards(mesh) == 0 else None
    t = mesh.shape["tensor"]
    kv = "tensor" if t > 1 and cfg.num_kv_heads % t == 0 else None
    return _Layout(mesh, rows, kv)


def _spec(lay: _Layout, kv_dim: int | None = None) -> NamedSharding:
    """Rows on dimension 0 and, with `kv_dim`, KV heads on that dimension; the rest whole."""
    spec = [lay.rows] + ([None] * (kv_dim - 1) + [lay.kv] if kv_dim else [])
    return NamedSharding(lay.mesh, P(*spec))


def _on(lay: _Layout | None, tree, kv_dim: int | None = None):
    """Every array of `tree` (rows first) constrained inside jit to `_spec(lay, kv_dim)`;
    unchanged without a mesh."""
    if lay is None:
        return tree
    sh = _spec(lay, kv_dim)
    return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: sh, tree))


def _cache_shardings(lay: _Layout, num_layers: int) -> KVCache:
    """Shardings of a prompt cache: k, v [B, P, K, H] per layer, mask [B, P], index scalar."""
    kv = (_spec(lay, 2),) * num_layers
    return KVCache(k=kv, v=kv, mask_BxS=_spec(lay), index=NamedSharding(lay.mesh, P()))


def _on_cache(lay: _Layout | None, cache: KVCache) -> KVCache:
    """A prompt cache constrained to `_cache_shardings` (inside jit)."""
    if lay is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, _cache_shardings(lay, len(cache.k)))


def _sampler_params(params, lay: _Layout | None):
    """The weights resharded on device to `SAMPLER_RULES` (a no-op without "fsdp")."""
    if lay is None or lay.mesh.shape["fsdp"] == 1:
        return params
    return jax.lax.with_sharding_constraint(
        params, parallel.tree_shardings(params, lay.mesh, SAMPLER_RULES))


# ---- token selection --------------------------------------------------------------------------

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

    def pick(w_RxW, u_R):
        # First index whose cumulative weight reaches (1 - u) * total > 0: never a zero weight,
        # unless rounding in the cumulative sum says otherwise (then: the largest weight).
        cdf = jnp.cumsum(w_RxW, axis=-1)
        target = (1.0 - u_R)[:, None] * cdf[:, -1:]
        i = jnp.minimum(jnp.sum(cdf < target, axis=-1), w_RxW.shape[-1] - 1)
        ok = jnp.take_along_axis(w_RxW, i[:, None], axis=-1)[:, 0] > 0
        return jnp.where(ok, i, jnp.argmax(w_RxW, axis=-1))

    blk = pick(jnp.sum(w, axis=-1), u_Rx2[:, 0])
    inner = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]
    return (blk * bs + pick(inner, u_Rx2[:, 1])).astype(jnp.int32)


def _select(logits_RxV: jax.Array, keys_R, t, st: _Static):
    """Chooses one token per row; returns (tokens_R int32, logprob_R float32 at temperature 1)."""
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
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, t), (2,)))(keys_R)
        tok = _draw(w, u)
    if e is None:
        e = jnp.exp(logits - m)
    chosen = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0]
    logp = chosen - m[:, 0] - jnp.log(jnp.sum(e, axis=-1))
    return tok, logp


def _is_eos(tok_R, eos_ids):
    done = jnp.zeros(tok_R.shape, bool)
    for e in eos_ids:
        done = done | (tok_R == e)
    return done


# ---- one decode step through the model's layers -----------------------------------------------

def _attend(attn, q_RxN, prompt_kv, prompt_mask_BxP, gen_kv, gen_valid_S, g):
    """Attention of one new token per row over its prompt and its own generated tokens.

    The prompt's keys/values are read once for the G rows that share it: k [B, K, H, P], v
    [B, K, P, H]. Generated ones are per row: k [B, K, G, H, S], v [B, K, G, S, H] (`gen_valid_S`
    marks the written slots). Keys are stored transposed so that both products are plain
    matrix products (no per-step transpose of the cache). Mirrors `decoder.Attention`: scaling,
    masking with its finite minus infinity, float32 softmax.
    """
    r = q_RxN.shape[0]
    b, kh, h = r // g, attn.k, attn.h
    gq = attn.n // kh
    cd = q_RxN.dtype
    (pk, pv), (gk, gv) = prompt_kv, gen_kv
    q = q_RxN.reshape(b, g, kh, gq, h).transpose(0, 2, 1, 3, 4)  # [B, K, G, Gq, H]
    scale = 1.0 / math.sqrt(h)
    s_p = jnp.einsum("bkgqh,bkhs->bkgqs", q, pk.astype(cd),
                     preferred_element_type=jnp.float32) * scale
    s_p = jnp.where(prompt_mask_BxP[:, None, None, None, :], s_p, _NEG)
    s_g = jnp.einsum("bkgqh,bkghs->bkgqs", q, gk.astype(cd),
                     preferred_element_type=jnp.float32) * scale
    s_g = jnp.where(gen_valid_S, s_g, _NEG)
    # softmax over [prompt slots, generated slots] without concatenating them
    m = jnp.maximum(jnp.max(s_p, axis=-1, keepdims=True), jnp.max(s_g, axis=-1, keepdims=True))
    e_p, e_g = jnp.exp(s_p - m), jnp.exp(s_g - m)
    inv = 1.0 / (jnp.sum(e_p, axis=-1, keepdims=True) + jnp.sum(e_g, axis=-1, keepdims=True))
    o = (jnp.einsum("bkgqs,bksh->bkgqh", (e_p * inv).astype(cd), pv.astype(cd))
         + jnp.einsum("bkgqs,bkgsh->bkgqh", (e_g * inv).astype(cd), gv.astype(cd)))
    return o.transpose(0, 2, 1, 3, 4).reshape(r, attn.n * h)


def _step(model, tok_R, pos_R, slot, prompt_kv, prompt_mask_BxP, gen_kv, g, lay=None):
    """Feeds one token per row at positions pos_R; writes its K/V at generated slot `slot`.

    Returns (float32 logits [R, V], updated generated-token cache)."""
    inv_freq = rope_inv_freq(model.cfg)
    s = gen_kv[0][1].shape[3]
    gen_valid_S = jnp.arange(s) <= slot
    x = _on(lay, model.embed_tokens[...][tok_R].astype(model.compute_dtype))
    r = x.shape[0]
    b = r // g
    new_gen = []
    for layer, pkv, (gk, gv) in zip(model.layers, prompt_kv, gen_kv):
        attn = layer.self_attn
        hid = layer.input_layernorm(x)
        q = attn.q_proj(hid).reshape(r, 1, attn.n, attn.h)
        k = attn.k_proj(hid).reshape(r, 1, attn.k, attn.h)
        v = attn.v_proj(hid).reshape(b, g, attn.k, attn.h).transpose(0, 2, 1, 3)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = apply_rope(q, pos_R[:, None], inv_freq).reshape(r, attn.n * attn.h)
        k = apply_rope(k, pos_R[:, None], inv_freq).reshape(b, g, attn.k, attn.h)
        k = k.transpose(0, 2, 1, 3)  # [B, K, G, H]
        gk = jax.lax.dynamic_update_slice(gk, k[..., None].astype(gk.dtype), (0, 0, 0, 0, slot))
        gv = jax.lax.dynamic_update_slice(gv, v[:, :, :, None].astype(gv.dtype),
                                          (0, 0, 0, slot, 0))
        new_gen.append((gk, gv))
        x = x + attn.o_proj(_attend(attn, q, pkv, prompt_mask_BxP, (gk, gv), gen_valid_S, g))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return _on(lay, model.logits(model.norm(x))), _on(lay, tuple(new_gen), kv_dim=1)


# ---- the two jitted programs ------------------------------------------------------------------

def _prefill_rows(cfg, b: int, p: int) -> int:
    """Prompts per prefill chunk: the model's attention materialises [rows, N, P, P] float32
    scores, so long prompts are prefilled a power-of-two number of rows at a time."""
    rows = b
    while rows > 1 and rows * cfg.num_heads * p * p * 4 > PREFILL_SCORES_BYTES:
        rows //= 2
    return rows


def _prefill(graphdef, lay, params, cache_B: KVCache, prompt_BxP, mask_BxP):
    """Runs the B prompts once into their cache; returns (last-position logits [B, V], cache).
    `lay`: the placement on a mesh (None: none)."""
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, _sampler_params(params, lay))
    b, p = prompt_BxP.shape
    rows = _prefill_rows(model.cfg, b, p)
    if rows >= b:
        h, cache_B = model.hidden(prompt_BxP, mask_BxT=mask_BxP, cache=cache_B)
        return _on(lay, model.logits(h[:, -1:])[:, 0]), _on_cache(lay, cache_B)

    def chunk(xs):  # `rows` prompts at a time (sequentially), each into a fresh cache
        tok, mask = xs
        c = init_cache(model.cfg, rows, p, cache_B.k[0].dtype)
        h, c = model.hidden(tok, mask_BxT=mask, cache=c)
        return model.logits(h[:, -1:])[:, 0], c.k, c.v

    n = b // rows
    logits, ks, vs = jax.lax.map(chunk, (prompt_BxP.reshape(n, rows, p),
                                         mask_BxP.reshape(n, rows, p)))
    flat = lambda a: a.reshape((b,) + a.shape[2:])  # noqa: E731
    cache_B = KVCache(k=tuple(map(flat, ks)), v=tuple(map(flat, vs)),
                      mask_BxS=mask_BxP.astype(bool), index=jnp.asarray(p, jnp.int32))
    return _on(lay, flat(logits)), _on_cache(lay, cache_B)


def _decode(graphdef, st: _Static, lay, params, gen_kv, cache_B: KVCache, logits_BxV, key,
            prompt_ids_B, valid_B):
    """Samples up to T tokens per row; stops when every row has finished.

    `gen_kv`: per layer (k [B, K, G, H, S], v [B, K, G, S, H]) with S >= T - 1 (donated;
    updated in place). `lay`: the placement on a mesh (None: none).
    Returns (SampleOutput with [B, G, T] / [B, G] arrays, the final `gen_kv`).
    """
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, _sampler_params(params, lay))
    b = logits_BxV.shape[0]
    g, t_max, pad = st.num_samples, st.max_new_tokens, st.pad_id
    r = b * g

    prompt_kv = _on(lay, tuple((k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))  # [B,K,H,P],
                               for k, v in zip(cache_B.k, cache_B.v)), kv_dim=1)  # [B,K,P,H]
    gen_kv = _on(lay, gen_kv, kv_dim=1)
    prompt_mask = cache_B.mask_BxS
    pos0_R = jnp.repeat(jnp.sum(prompt_mask, axis=1, dtype=jnp.int32), g)

    pid_R = jnp.repeat(prompt_ids_B.astype(jnp.int32), g)
    sid_R = jnp.tile(jnp.arange(g, dtype=jnp.int32), b)
    keys_R = jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(key, p), s))(pid_R,
                                                                                        sid_R)
    keys_R, valid_R = _on(lay, (keys_R, jnp.repeat(valid_B, g)))

    tok, logp = _select(_on(lay, jnp.repeat(logits_BxV, g, axis=0)), keys_R, 0, st)
    tokens = jnp.full((r, t_max), pad, jnp.int32).at[:, 0].set(jnp.where(valid_R, tok, pad))
    logps = jnp.zeros((r, t_max), jnp.float32).at[:, 0].set(jnp.where(valid_R, logp, 0.0))
    lengths = valid_R.astype(jnp.int32)
    done = ~valid_R | _is_eos(tok, st.eos_ids)
    tokens, logps, lengths, tok, done = _on(lay, (tokens, logps, lengths, tok, done))

    def cond(c):
        t, _, _, _, _, _, done = c
        return (t < t_max) & ~jnp.all(done)

    def body(c):
        t, gen_kv, tokens, logps, lengths, last, done = c
        # Step t feeds token t-1 (at position prompt_len + t - 1, generated slot t - 1).
        logits, gen_kv = _step(model, last, pos0_R + t - 1, t - 1, prompt_kv, prompt_mask,
                               gen_kv, g, lay)
        tok, logp = _select(logits, keys_R, t, st)
        live = ~done
        tokens = jax.lax.dynamic_update_slice(tokens, jnp.where(live, tok, pad)[:, None], (0, t))
        logps = jax.lax.dynamic_update_slice(logps, jnp.where(live, logp, 0.0)[:, None], (0, t))
        lengths = lengths + live.astype(jnp.int32)
        done = done | _is_eos(tok, st.eos_ids)
        return (t + 1, gen_kv, *_on(lay, (tokens, logps, lengths, tok, done)))

    init = (jnp.asarray(1, jnp.int32), gen_kv, tokens, logps, lengths, tok, done)
    _, gen_kv, tokens, logps, lengths, _, _ = jax.lax.while_loop(cond, body, init)
    out = SampleOutput(tokens=tokens.reshape(b, g, t_max), lengths=lengths.reshape(b, g),
                       logprobs=logps.reshape(b, g, t_max))
    return _on(lay, out), gen_kv


_JITTED: dict = {}  # (kind, graphdef, static config, layout) -> jitted function
_JITTED_UNHASHABLE: list = []  # [(key, jitted)] for graphdefs that cannot be hashed


def _jitted(kind: str, graphdef, st: _Static | None, lay: _Layout | None = None):
    """The jitted prefill (per model definition) or decode (per model definition and static
    config), per mesh layout, built once and cached; jit then keeps one executable per bucket
    shape. A graphdef whose config holds a dict (e.g. llama3 `rope_scaling`) is unhashable:
    found by equality."""
    key = (kind, graphdef, st, lay)
    try:
        return _JITTED[key]
    except TypeError:
        for k, fn in _JITTED_UNHASHABLE:
            if (k[0] == kind and k[2] == st and k[3] == lay
                    and (k[1] is graphdef or k[1] == graphdef)):
                return fn
    except KeyError:
        pass
    if kind == "prefill":
        fn = jax.jit(functools.partial(_prefill, graphdef, lay), donate_argnums=(1,))
    else:
        fn = jax.jit(functools.partial(_decode, graphdef, st, lay), donate_argnums=(1,))
    try:
        _JITTED[key] = fn
    except TypeError:
        _JITTED_UNHASHABLE.append((key, fn))
    return fn


def _programs(graphdef, st: _Static, lay: _Layout | None = None):
    """(prefill, decode) for a model definition, a static sampling configuration and a mesh
    layout (None: no mesh)."""
    return _jitted("prefill", graphdef, None, lay), _jitted("decode", graphdef, st, lay)


def _gen_slots(max_new_tokens: int) -> int:
    """Generated-token cache slots: T - 1 (the last token is never fed), rounded up to 8."""
    return max(8, -(-(max_new_tokens - 1) // 8) * 8)


# ---- public API -------------------------------------------------------------------------------

def _check_knobs(temperature, top_p, top_k, num_samples, max_new_tokens):
    if not (temperature >= 0):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k}")
    if int(num_samples) != num_samples or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")


def _eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, (int, np.integer)):
        return (int(eos),)
    return tuple(sorted({int(e) for e in eos}))


def _check_left_padded(mask: np.ndarray):
    """Every row must be some padding (False) followed by at least one real token (True)."""
    bad = np.nonzero(np.any(mask[:, :-1] & ~mask[:, 1:], axis=1) | ~mask[:, -1])[0]
    if bad.size:
        raise ValueError(
            f"prompt row {int(bad[0])} is not left-padded: its mask must be False... then True..., "
            f"ending with a real token (mask row: {mask[bad[0]].astype(int).tolist()})")


def sample(graphdef, params, prompt_BxP, prompt_mask_BxP, *, key, num_samples: int = 1,
           max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
           eos_ids: Sequence[int] | int | None = (), prompt_ids_B=None,
           pad_id: int = 0, mesh: Mesh | None = None) -> SampleOutput:
    """Samples `num_samples` continuations of each of B left-padded prompts.

    Args:
      graphdef, params: the model as from `models.split(model)`; params stay on device.
      prompt_BxP: int token ids, left-padded; prompt_mask_BxP: True on real tokens (a suffix of
        each row, at least one token). Host (numpy) inputs are checked for left padding.
      key: PRNG key; row (b, g) uses fold_in(fold_in(key, prompt_ids_B[b]), g), step t folds in t.
      num_samples: G, samples per prompt (the prompt is prefilled once, its cache shared).
      max_new_tokens: T, the per-row token budget.
      temperature, top_p, top_k: sampling knobs (temperature 0 = greedy, top_p 1 and top_k 0 or
        None = off); see the module docstring, also for what they do to `logprobs`.
      eos_ids: an id or ids that end a row (the EOS token is part of the output and its length).
      prompt_ids_B: int ids that identify the prompts for the PRNG (default arange(B)).
      pad_id: the token written after a row's end (and used to pad prompts).
      mesh: the ("data", "fsdp", "tensor") mesh that `params` live on (e.g. the trainer's): rows
        and caches are placed on it as the module docstring says. None: no placement.

    All of num_samples, max_new_tokens, temperature, top_p, top_k, eos_ids and pad_id are static:
    each distinct combination compiles its own programs (cached for the life of the process).

    Returns:
      SampleOutput(tokens [B, G, T] int32, lengths [B, G] int32, logprobs [B, G, T] float32) as
      device arrays.
    """
    top_k = 0 if top_k is None else top_k
    _check_knobs(temperature, top_p, top_k, num_samples, max_new_tokens)
    if prompt_BxP.ndim != 2 or tuple(prompt_mask_BxP.shape) != tuple(prompt_BxP.shape):
        raise ValueError(f"prompt_BxP {tuple(prompt_BxP.shape)} and prompt_mask_BxP "
                         f"{tuple(prompt_mask_BxP.shape)} must both be [B, P]")
    b, p = prompt_BxP.shape
    if b == 0 or p == 0:
        raise ValueError(f"sample() needs at least one prompt token, got prompts of shape {(b, p)}")
    bb, pb = batch_bucket(b), prompt_bucket(p)
    st = _Static(num_samples=int(num_samples), max_new_tokens=int(max_new_tokens),
                 temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                 eos_ids=_eos_tuple(eos_ids), pad_id=int(pad_id))
    if prompt_ids_B is None:
        prompt_ids_B = np.arange(b, dtype=np.int32)
    if tuple(np.shape(prompt_ids_B)) != (b,):
        raise ValueError(
            f"prompt_ids_B must have shape ({b},), got {tuple(np.shape(prompt_ids_B))}")

    host = not isinstance(prompt_BxP, jax.Array)
    xp = np if host else jnp
    if host:
        prompt_mask_BxP = np.asarray(prompt_mask_BxP).astype(bool)
        _check_left_padded(prompt_mask_BxP)
    tokens = xp.pad(xp.asarray(prompt_BxP).astype(xp.int32), ((0, bb - b), (pb - p, 0)),
                    constant_values=st.pad_id)
    mask = xp.pad(xp.asarray(prompt_mask_BxP).astype(bool), ((0, bb - b), (pb - p, 0)))
    ids = xp.pad(xp.asarray(prompt_ids_B).astype(xp.int32), (0, bb - b))
    valid = np.arange(bb) < b

    model = nnx.merge(graphdef, params)  # cheap: only to read the config and dtype
    cfg, dtype = model.cfg, jnp.dtype(model.dtype)
    s = _gen_slots(st.max_new_tokens)
    k_shape = (bb, cfg.num_kv_heads, st.num_samples, cfg.head_dim, s)
    v_shape = (bb, cfg.num_kv_heads, st.num_samples, s, cfg.head_dim)
    lay = _layout(mesh, cfg, bb)
    if lay is None:
        prompt_cache = init_cache(cfg, bb, pb, dtype)
        gen_kv = tuple((jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype))
                       for _ in range(cfg.num_layers))
    else:  # every array created or placed where the programs keep it (no later reshard)
        rows = _spec(lay)
        tokens, mask, ids, valid = (jax.device_put(x, rows) for x in (tokens, mask, ids, valid))
        key = jax.device_put(key, NamedSharding(mesh, P()))
        shapes = jax.eval_shape(lambda: init_cache(cfg, bb, pb, dtype))
        prompt_cache = jax.tree.map(lambda a, sh: jnp.zeros(a.shape, a.dtype, device=sh),
                                    shapes, _cache_shardings(lay, cfg.num_layers))
        gen_sh = _spec(lay, kv_dim=1)
        gen_kv = tuple((jnp.zeros(k_shape, dtype, device=gen_sh),
                        jnp.zeros(v_shape, dtype, device=gen_sh)) for _ in range(cfg.num_layers))
    prefill, decode = _programs(graphdef, st, lay)
    logits, prompt_cache = prefill(params, prompt_cache, tokens, mask)
    out, _ = decode(params, gen_kv, prompt_cache, logits, key, ids, valid)
    if bb != b:
        out = jax.tree.map(lambda x: x[:b], out)
    return out


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             eos_token_id: int | Sequence[int] | None = None, key=None, num_samples: int = 1,
             prompt_ids: Sequence[int] | None = None, pad_id: int = 0) -> SampleOutput:
    """Samples continuations of token-id prompts of varying lengths with a `Decoder`.

    `eos_token_id`: an id or a list of ids; None uses the model config's EOS ids (pass () for
    none). `key` defaults to PRNGKey(0); `prompt_ids` (default 0..N-1) identify the prompts for
    the PRNG. Returns numpy arrays, one row per sample, prompt-major: tokens int32 [N*G, T],
    lengths int32 [N*G], logprobs float32 [N*G, T] (G = num_samples).
    """
    if not len(prompts):
        raise ValueError("generate() needs at least one prompt")
    for i, pr in enumerate(prompts):
        if len(pr) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    n = len(prompts)
    tok, mask = left_pad(prompts, max(len(pr) for pr in prompts), pad_id)
    eos = model.cfg.eos_ids if eos_token_id is None else eos_token_id
    key = jax.random.PRNGKey(0) if key is None else key
    graphdef, params = nnx.split(model)
    ids = None if prompt_ids is None else np.asarray(prompt_ids, np.int32)
    out = jax.device_get(sample(
        graphdef, params, tok, mask, key=key, num_samples=num_samples,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        eos_ids=eos, prompt_ids_B=ids, pad_id=pad_id))
    rows = n * num_samples
    return SampleOutput(tokens=np.asarray(out.tokens).reshape(rows, -1),
                        lengths=np.asarray(out.lengths).reshape(rows),
                        logprobs=np.asarray(out.logprobs).reshape(rows, -1))
