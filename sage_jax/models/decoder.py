"""Flax NNX decoder for Llama-3.x, Qwen2/2.5 and Qwen3: RMSNorm, RoPE, GQA, SwiGLU.

Shapes: B batch, T new tokens, S cache slots, D hidden, Q query heads, K kv heads,
H head dim, F MLP width, V vocab, Z packed sequences (rows end to end), L their columns.

Two ways to call it:
  * `model(tokens_BxT)` -> float32 logits_BxTxV (positions 0..T-1, no padding), or with
    `mask_BxT` for left-padded rows (positions count valid tokens only);
  * `model(tokens_BxT, cache=cache)` -> (logits_BxTxV, cache'): appends T tokens to an explicit
    `KVCache` pytree and attends to everything valid in it.
`packed_hidden(tokens_ZxL, segments_ZxL)` gives the hidden states of rows packed end to end.
Inside `jax.jit`, use the pure form `apply(graphdef, params, tokens_BxT, ...)`.

LoRA: a `Decoder` built with `lora=LoraSpec(...)` (or `with_lora(model, spec)`) gives each
targeted projection adapters `lora_a` [in, r] and `lora_b` [r, out] (`nnx.LoRAParam`, B zero at
the start), so every entry point above uses them; `merge_lora` folds them into the kernels.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from sage_jax.models.decoder_config import DecoderConfig
from sage_jax.infra.parallel import ROWS

MASKED_SCORE = -1e30  # finite "minus infinity": a fully masked (padding) row stays finite
# Causal self-attention (no cache) runs in query blocks that read only the keys up to their
# own end: less work and smaller scores than the full [T, T] product (each block's keys and
# values are a slice, copied, so short rows stay one block). Blocks of at least
# ATTN_BLOCK_MIN queries, at most ATTN_BLOCKS_MAX of them (each is its own op in the program).
ATTN_BLOCK_MIN = 128
ATTN_BLOCKS_MAX = 8


@flax.struct.dataclass
class KVCache:
    """Per-layer keys and values, which slots hold real tokens, and the next free slot.

    k, v: tuples (one per layer) of [B, S, K, H] arrays in the compute dtype.
    mask_BxS: True where the slot holds a real (non-padding) token.
    index: int32 scalar, the next slot to write (shared by all rows: prompts are left-padded).
    """

    k: tuple
    v: tuple
    mask_BxS: jax.Array
    index: jax.Array

    @property
    def size(self) -> int:
        return self.mask_BxS.shape[1]


def init_cache(cfg: DecoderConfig, batch: int, size: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of `size` slots per row."""
    shape = (batch, size, cfg.num_kv_heads, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   mask_BxS=jnp.zeros((batch, size), bool), index=jnp.zeros((), jnp.int32))


def rope_inv_freq(cfg: DecoderConfig) -> jax.Array:
    """RoPE inverse frequencies [H/2] in float32, with llama3 scaling when configured."""
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    s = cfg.rope_scaling
    if not s:
        return inv
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BxTxQxH: jax.Array, positions_BxT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the rotate-half convention of Hugging Face."""
    freqs = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x_BxTxQxH.dtype), jnp.sin(emb).astype(x_BxTxQxH.dtype)
    x1, x2 = jnp.split(x_BxTxQxH, 2, axis=-1)
    return x_BxTxQxH * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def keep_rows(x: jax.Array) -> jax.Array:
    """`x` with dimension 0 (rows, or rows x positions flattened) split over the mesh's row axes
    when traced under `jax.sharding.use_abstract_mesh` (the train step does): the partitioner
    then gathers a sharded weight to each device's rows instead of gathering every device's
    rows to a weight shard. A no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in ROWS if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, P(axes, *[P.UNCONSTRAINED] * (x.ndim - 1)))


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype))


# The projections of a block that can carry LoRA adapters (config: `model.lora.targets`).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of rank `rank` on the projections named in `targets` (of every layer),
    scaled by alpha / rank as PEFT does; `seed` starts the adapters' own random stream, so the
    base weights' initialisation is the same with or without adapters."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS
    seed: int = 0

    def __post_init__(self):
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if self.rank < 1 or self.alpha <= 0 or unknown or not self.targets:
            raise ValueError(f"LoraSpec needs rank >= 1, alpha > 0 and targets among "
                             f"{LORA_TARGETS}; got rank={self.rank}, alpha={self.alpha}, "
                             f"targets={self.targets}")

    @classmethod
    def of(cls, lora, seed: int = 0) -> LoraSpec | None:
        """The spec of a config's `model.lora` section (rank, alpha, targets), adapters drawn
        from `seed`; None when its rank is 0 (no adapters)."""
        return cls(lora.rank, lora.alpha, tuple(lora.targets), seed) if lora.rank else None


def _target(lora: LoraSpec | None, name: str) -> LoraSpec | None:
    """`lora` when it targets projection `name`, else None."""
    return lora if lora is not None and name in lora.targets else None


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel stored [in, out]. With a `lora` spec (adapters drawn
    from `lora_rngs`' `lora` stream) y gains (x @ lora_a) @ lora_b * alpha / rank, computed in
    the compute dtype: lora_a [in, r] uniform in +-1/sqrt(in) (PEFT's kaiming-uniform with
    a = sqrt(5)), lora_b [r, out] zeros, both `nnx.LoRAParam`s in the kernel's dtype."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, cdtype, rngs: nnx.Rngs,
                 lora: LoraSpec | None = None, lora_rngs: nnx.Rngs | None = None):
        self.kernel = _normal(rngs, (d_in, d_out), dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.cdtype = cdtype
        if lora is None:
            self.lora_a = self.lora_b = None
            self.lora_scale = 0.0
        else:
            assert lora_rngs is not None, "a LoRA Linear draws its adapters from lora_rngs"
            bound = 1.0 / math.sqrt(d_in)
            self.lora_a = nnx.LoRAParam(jax.random.uniform(
                lora_rngs.lora(), (d_in, lora.rank), jnp.float32, -bound, bound).astype(dtype))
            self.lora_b = nnx.LoRAParam(jnp.zeros((lora.rank, d_out), dtype))
            self.lora_scale = lora.alpha / lora.rank  # a static Python float

    def __call__(self, x: jax.Array) -> jax.Array:
        # As a 2-D matmul: with 3-D operands XLA:CPU transposes activations for the weight
        # gradient, which made the update step ~20% slower.
        x2 = x.reshape(-1, x.shape[-1]).astype(self.cdtype)
        y = jnp.dot(x2, self.kernel[...].astype(self.cdtype))
        if self.lora_a is not None:
            y = y + self._adapted(x2)
        y = keep_rows(y)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.cdtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _adapted(self, x2: jax.Array) -> jax.Array:
        """The adapters' term (x @ lora_a) @ lora_b * alpha / rank [rows, out] in the compute
        dtype, of the 2-D rows `x2` already in it."""
        assert self.lora_a is not None and self.lora_b is not None
        xa = keep_rows(jnp.dot(x2, self.lora_a[...].astype(self.cdtype)))
        return (jnp.dot(xa, self.lora_b[...].astype(self.cdtype))
                * jnp.asarray(self.lora_scale, self.cdtype))

    def merged_kernel(self) -> jax.Array:
        """The kernel with the adapters folded in, kernel + lora_a @ lora_b * alpha / rank
        (summed in float32, in the kernel's dtype); the kernel itself without adapters."""
        w = self.kernel[...]
        if self.lora_a is None or self.lora_b is None:
            return w
        delta = jnp.dot(self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(
            jnp.float32)) * self.lora_scale
        return (w.astype(jnp.float32) + delta).astype(w.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled in the compute dtype (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float, *, dtype, cdtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.cdtype = cdtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.cdtype) * x32.astype(self.cdtype)


def causal_blocks(t: int) -> list[tuple[int, int]]:
    """Query blocks [(start, end)] of causal self-attention over t positions: block
    [start, end) attends to keys [0, end) only."""
    n = max(1, min(ATTN_BLOCKS_MAX, t // ATTN_BLOCK_MIN))
    c = -(-t // n)
    return [(a, min(a + c, t)) for a in range(0, t, c)]


def _attend(q_BxTxKxJxH, k_BxSxKxH, v_BxSxKxH, allowed_BxTxS):
    """Scaled dot-product attention with float32 scores and softmax: out [B, T, K, J, H]."""
    h = q_BxTxKxJxH.shape[-1]
    cd = q_BxTxKxJxH.dtype
    scores = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxJxH, k_BxSxKxH.astype(cd),
                        preferred_element_type=jnp.float32) / math.sqrt(h)
    scores = jnp.where(allowed_BxTxS[:, None, None], scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(cd)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH.astype(cd))


class Attention(nnx.Module):
    """Grouped-query self-attention with optional q/k/v bias and Qwen3 q/k norm: `qkv`, then
    `core`; the block (`Block.wire`) applies `o_proj`."""

    def __init__(self, cfg: DecoderConfig, *, dtype, cdtype, rngs: nnx.Rngs,
                 lora: LoraSpec | None = None, lora_rngs: nnx.Rngs | None = None):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=dtype, cdtype=cdtype, rngs=rngs, lora_rngs=lora_rngs)
        self.q_proj = Linear(d, n * h, bias=cfg.qkv_bias, lora=_target(lora, "q_proj"), **kw)
        self.k_proj = Linear(d, k * h, bias=cfg.qkv_bias, lora=_target(lora, "k_proj"), **kw)
        self.v_proj = Linear(d, k * h, bias=cfg.qkv_bias, lora=_target(lora, "v_proj"), **kw)
        self.o_proj = Linear(n * h, d, bias=cfg.o_bias, lora=_target(lora, "o_proj"), **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, cdtype=cdtype)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, cdtype=cdtype)
        else:
            self.q_norm = self.k_norm = None
        self.n, self.k, self.h = n, k, h

    def qkv(self, x_BxTxD, positions_BxT, inv_freq):
        """(queries [B, T, Q, H], keys [B, T, K, H], values [B, T, K, H]) of the normed hidden
        states at `positions_BxT`: projected, q/k-normed (Qwen3) and rotated."""
        b, t, _ = x_BxTxD.shape
        q = self.q_proj(x_BxTxD).reshape(b, t, self.n, self.h)
        k = self.k_proj(x_BxTxD).reshape(b, t, self.k, self.h)
        v = self.v_proj(x_BxTxD).reshape(b, t, self.k, self.h)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions_BxT, inv_freq), apply_rope(k, positions_BxT, inv_freq), v

    def core(self, q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, allowed_BxTxS, kv=None):
        """The attention core: (heads' output [B, T, Q*H] before `o_proj`, (keys, values) it
        read [B, S, K, H]); `kv` = (cache_k, cache_v, index) appends to a cache first. Without
        `kv`, `allowed_BxTxS` must be causal (S = T; never a later key)."""
        b, t = q_BxTxQxH.shape[:2]
        k, v = k_BxTxKxH, v_BxTxKxH
        if kv is not None:
            cache_k, cache_v, index = kv
            k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, index, 0, 0))
            v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, index, 0, 0))
        q_BxTxKxJxH = q_BxTxQxH.reshape(b, t, self.k, self.n // self.k, self.h)
        if kv is None:  # causal: each query block reads the keys up to its own end only
            out = jnp.concatenate(
                [_attend(q_BxTxKxJxH[:, a:e], k[:, :e], v[:, :e], allowed_BxTxS[:, a:e, :e])
                 for a, e in causal_blocks(t)], axis=1)
        else:
            out = _attend(q_BxTxKxJxH, k, v, allowed_BxTxS)
        return out.reshape(b, t, self.n * self.h), (k, v)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig, *, dtype, cdtype, rngs: nnx.Rngs,
                 lora: LoraSpec | None = None, lora_rngs: nnx.Rngs | None = None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        kw = dict(bias=cfg.mlp_bias, dtype=dtype, cdtype=cdtype, rngs=rngs, lora_rngs=lora_rngs)
        self.gate_proj = Linear(d, f, lora=_target(lora, "gate_proj"), **kw)
        self.up_proj = Linear(d, f, lora=_target(lora, "up_proj"), **kw)
        self.down_proj = Linear(f, d, lora=_target(lora, "down_proj"), **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: DecoderConfig, *, dtype, cdtype, rngs: nnx.Rngs,
                 lora: LoraSpec | None = None, lora_rngs: nnx.Rngs | None = None):
        kw = dict(dtype=dtype, cdtype=cdtype, rngs=rngs, lora=lora, lora_rngs=lora_rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                                       cdtype=cdtype)
        self.self_attn = Attention(cfg, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                                                cdtype=cdtype)
        self.mlp = MLP(cfg, **kw)

    def wire(self, x_BxTxD, attend):
        """The block around an attention core: `attend(self_attn, normed x_BxTxD)` returns
        (the heads' output [B, T, Q*H] before `o_proj`, anything else it carries), and the
        block returns (its output [B, T, D], that else). The sampler's decode step plugs its
        own cache and core in here."""
        a, carried = attend(self.self_attn, self.input_layernorm(x_BxTxD))
        x = x_BxTxD + self.self_attn.o_proj(a)
        return x + self.mlp(self.post_attention_layernorm(x)), carried

    def __call__(self, x, positions, inv_freq, allowed, kv=None):
        def attend(attn, h):
            q, k, v = attn.qkv(h, positions, inv_freq)
            return attn.core(q, k, v, allowed, kv)

        return self.wire(x, attend)


def _rematted(layer: Block, *args):
    """`layer(*args)` with its intermediates recomputed in the backward pass, as a pure function
    of the layer's arrays (NNX's own `nnx.remat` writes the layer's state back after the call,
    which fails when the layer was merged inside another trace, e.g. a `lax.map`)."""
    graphdef, state = nnx.split(layer)
    return recompute_in_backward(lambda st, *a: nnx.merge(graphdef, st)(*a))(state, *args)


def recompute_in_backward(f):
    """`f(params, *inputs)` that keeps only its arguments for the backward pass and recomputes
    the rest there, once the output's cotangent has arrived. Plain `jax.checkpoint` leaves the
    recomputation free to run early, and XLA:CPU runs it with the forward pass (it drops
    optimization barriers, then merges the two copies), so the memory comes back. Here the
    recomputation waits for the cotangent: an optimization barrier over both (GPU, TPU), and
    each input shaped like the first output gets `+ 0 * its cotangent` (exact for a finite
    cotangent, elementwise so shards stay put, and not folded by XLA: CPU)."""

    @jax.custom_vjp
    def call(params, *inputs):
        return f(params, *inputs)

    def fwd(params, *inputs):
        return f(params, *inputs), (params, inputs)

    def bwd(saved, g):
        (params, inputs), g = jax.lax.optimization_barrier((saved, g))
        g0 = jax.tree.leaves(g)[0]

        def tie(x):
            if x.shape != g0.shape or not jnp.issubdtype(x.dtype, jnp.floating):
                return x
            return x + (0.0 * g0).astype(x.dtype)

        return jax.vjp(f, params, *jax.tree.map(tie, inputs))[1](g)

    call.defvjp(fwd, bwd)
    return call


class Decoder(nnx.Module):
    """Causal LM: embeddings, `num_layers` blocks, final norm, LM head (tied or not); with
    `lora`, adapters on its targeted projections (drawn from the spec's seed: the other weights
    are the same as without)."""

    def __init__(self, cfg: DecoderConfig, *, dtype=jnp.float32, compute_dtype=None,
                 rngs: nnx.Rngs | None = None, remat: bool = False,
                 lora: LoraSpec | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        lora_rngs = None if lora is None else nnx.Rngs(lora=lora.seed)
        cdtype = compute_dtype or dtype
        self.cfg = cfg
        self.dtype, self.compute_dtype, self.remat = dtype, cdtype, remat
        self.embed_tokens = _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([Block(cfg, dtype=dtype, cdtype=cdtype, rngs=rngs, lora=lora,
                                      lora_rngs=lora_rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, cdtype=cdtype)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype,
                               cdtype=cdtype, rngs=rngs))

    def hidden(self, tokens_BxT, *, positions_BxT=None, mask_BxT=None,
               cache: KVCache | None = None):
        """Final-norm hidden states [B, T, D] (and the updated cache when one is given)."""
        b, t = tokens_BxT.shape
        mask_BxT = jnp.ones((b, t), bool) if mask_BxT is None else mask_BxT.astype(bool)
        if cache is None:
            return self.prompt_kv(tokens_BxT, mask_BxT, positions_BxT)[0]
        key_mask_BxS = jax.lax.dynamic_update_slice(cache.mask_BxS, mask_BxT, (0, cache.index))
        q_slot_T = cache.index + jnp.arange(t)
        if positions_BxT is None:
            before = jnp.sum(cache.mask_BxS, axis=1, keepdims=True)
            positions_BxT = jnp.maximum(before + jnp.cumsum(mask_BxT, axis=1) - 1, 0)
        s = key_mask_BxS.shape[1]
        allowed_BxTxS = (jnp.arange(s)[None, :] <= q_slot_T[:, None])[None] & key_mask_BxS[:, None]
        h, new_k, new_v = self._layers(tokens_BxT, positions_BxT, allowed_BxTxS, cache)
        return h, KVCache(k=tuple(new_k), v=tuple(new_v), mask_BxS=key_mask_BxS,
                          index=cache.index + t)

    def packed_hidden(self, tokens_ZxL, segments_ZxL):
        """Final-norm hidden states [Z, L, D] of rows packed end to end (`engine.trainer.packing`):
        `segments_ZxL` is 0 on padding and 1, 2, ... on the packed rows; a token attends within
        its own row only and positions restart at 0 in each row."""
        z, length = tokens_ZxL.shape
        seg = segments_ZxL
        first = jnp.concatenate([jnp.ones((z, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        start = jax.lax.cummax(jnp.where(first, jnp.arange(length)[None], 0), axis=1)
        causal = jnp.arange(length)[None, :] <= jnp.arange(length)[:, None]
        allowed_ZxLxL = causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg > 0)[:, None, :]
        return self._layers(tokens_ZxL, jnp.arange(length)[None] - start, allowed_ZxLxL)[0]

    def prompt_kv(self, tokens_BxT, mask_BxT, positions_BxT=None):
        """(final-norm hidden states [B, T, D], keys and values per layer [B, T, K, H]) of
        left-padded rows (`mask_BxT` True on real tokens; positions count them unless given),
        without a cache: what `hidden` with an empty cache of T slots would return and store."""
        mask_BxT = mask_BxT.astype(bool)
        t = tokens_BxT.shape[1]
        if positions_BxT is None:
            positions_BxT = jnp.maximum(jnp.cumsum(mask_BxT, axis=1) - 1, 0)
        allowed_BxTxS = (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None] & mask_BxT[:, None]
        h, ks, vs = self._layers(tokens_BxT, positions_BxT, allowed_BxTxS)
        return h, tuple(ks), tuple(vs)

    def _layers(self, tokens_BxT, positions_BxT, allowed_BxTxS, cache: KVCache | None = None):
        """Embedding, blocks and final norm: (h [B, T, D], the blocks' keys and values)."""
        inv_freq = rope_inv_freq(self.cfg)
        x = self.embed(tokens_BxT)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i], cache.index)
            call = _rematted if self.remat else type(layer).__call__
            x, (k, v) = call(layer, x, positions_BxT, inv_freq, allowed_BxTxS, kv)
            new_k.append(k)
            new_v.append(v)
        return self.norm(x), new_k, new_v

    def embed(self, tokens: jax.Array) -> jax.Array:
        """The first block's input: token embeddings (any shape of ids; D appended) in the
        compute dtype."""
        return keep_rows(self.embed_tokens[...][tokens].astype(self.compute_dtype))

    def head(self, x_BxTxD: jax.Array) -> jax.Array:
        """float32 logits [B, T, V] of the last block's output: final norm, then LM head."""
        return self.logits(self.norm(x_BxTxD))

    def logits(self, h_BxTxD: jax.Array) -> jax.Array:
        """float32 logits [B, T, V] from final hidden states."""
        w = (self.embed_tokens[...].T if self.lm_head is None else self.lm_head.kernel[...])
        h2 = h_BxTxD.reshape(-1, h_BxTxD.shape[-1]).astype(self.compute_dtype)  # 2-D: see Linear
        out = keep_rows(jnp.dot(h2, w.astype(self.compute_dtype),
                                preferred_element_type=jnp.float32))
        return out.reshape(*h_BxTxD.shape[:-1], out.shape[-1])

    def __call__(self, tokens_BxT, *, positions_BxT=None, mask_BxT=None,
                 cache: KVCache | None = None):
        out = self.hidden(tokens_BxT, positions_BxT=positions_BxT, mask_BxT=mask_BxT, cache=cache)
        if cache is None:
            return self.logits(out)
        h, cache = out
        return self.logits(h), cache


def with_lora(model: Decoder, lora: LoraSpec) -> Decoder:
    """`model` with fresh adapters of `lora` (B zero: the same function) on its targeted
    projections; its own weights are taken as they are (shared, not copied)."""
    def build():
        return Decoder(model.cfg, dtype=model.dtype, compute_dtype=model.compute_dtype,
                       remat=model.remat, lora=lora)

    graphdef = nnx.graphdef(nnx.eval_shape(build))
    # Under jit only the adapters are computed: the base weights' initialisation is dead code.
    adapters = jax.jit(lambda: nnx.state(build(), nnx.LoRAParam))()
    return nnx.merge(graphdef, nnx.state(model), adapters)


def merge_lora(model: Decoder) -> Decoder:
    """A plain `Decoder` (no adapters) whose kernels are `model`'s with its adapters folded in
    (`Linear.merged_kernel`); `model` itself is unchanged."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(
        model.cfg, dtype=model.dtype, compute_dtype=model.compute_dtype, remat=model.remat)))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.LoRAParam))))
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and module.lora_a is not None:
            flat[(*path, "kernel")] = nnx.Param(module.merged_kernel())
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def merged_params(graphdef, params):
    """The parameters of `merge_lora(merge(graphdef, params))`: a LoRA model's adapters folded
    into its kernels, for the plain `Decoder` of the same config; pure, for jit."""
    return nnx.split(merge_lora(nnx.merge(graphdef, params)))[1]


def split(model: Decoder):
    """(graphdef, params): the model as a static definition and a pytree of arrays."""
    return nnx.split(model)


def merge(graphdef, params) -> Decoder:
    return nnx.merge(graphdef, params)


def apply(graphdef, params, tokens_BxT, **kwargs):
    """Pure form of `Decoder.__call__`, for use inside `jax.jit`."""
    return nnx.merge(graphdef, params)(tokens_BxT, **kwargs)
