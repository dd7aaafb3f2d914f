"""Decode attention that reads only each row's live keys and values (Pallas on TPU and GPU, C++
on CPU).

A decode step attends from one new token per row over keys/values in the decode state's layout
(`decode.DecodeState`: keys transposed, [.., H, S], values [.., S, H]); the caches are padded
(prompt buckets, generated-cache buckets) and the XLA path (`decode._attend`) reads every
column. Here each row reads only its live column range [lo, hi):

* `over_prompt(q_BxKxMxH, k_BxKxHxP, v_BxKxPxH, lo_B, hi_B)`: the prompt's keys/values, shared
  by the M = G*Gq queries of a group (the prompt is left-padded: lo = P - its length, hi = P).
* `over_rows(q_BxKxGxQxH, k_BxKxGxHxS, v_BxKxGxSxH, hi_BxG)`: each row's generated keys/values,
  live in [0, hi).

Both return a `Partial`: the attention output over that range, normalised, float32, and its
log-sum-exp (`MASKED_SCORE` over an empty range), which `combine` merges with other ranges
exactly as one softmax over their union would.

`write_rows(k_BxKxGxHxS, v_BxKxGxSxH, nk_BxKxGxH, nv_BxKxGxH, at_BxG)` writes each row's new
key and value at its own slot (a slot outside the cache: not written), in place. On TPU a
kernel rewrites the one column block that holds the slot: XLA's scatter would make TPU layout
assignment pick a scatter-friendly layout for the decode loop's caches and copy all of them
into it at every call (a temporary as large as the generated caches).

Kernels, chosen by the platform in one place (`implementation`):
* "tpu" (Mosaic): a grid over (group, column block); each block's index map clamps to the
  group's live blocks, so a block outside them is neither fetched (the pipeline skips a
  repeated block index) nor computed; an online softmax accumulates in VMEM.
* "gpu" (Triton): one program per group, looping over its live blocks only.
* "cpu": the C++ kernel of `cpu_attention` (an XLA FFI call; float32, where it was built), which
  also writes the cache; `decode._step` calls it directly.
* "xla": no kernel (the caller's einsum path); shapes and dtypes the kernels do not take.
"tpu-interpret" and "gpu-interpret" run the same kernels in Pallas interpret mode (on CPU: the
equality tests); `python -m sage_jax.aot` compiles them for TPU and GPU topologies.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from sage_jax.engine.sampler import cpu_attention, placement
from sage_jax.models.decoder import MASKED_SCORE

TPU_BLOCKS = (512, 256, 128)  # column blocks (lane-aligned); a cache of other size is one block
GPU_BLOCK = 128  # the largest column block; smaller powers of two (>= GPU_MIN) divide other sizes
GPU_MIN = 16  # Triton's dot needs every dimension >= 16 (and a power of two)
PLATFORMS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "cpu": "cpu"}
INTERPRET = "-interpret"  # an implementation's name with this suffix: Pallas interpret mode


class Partial(NamedTuple):
    """Attention over one column range: out [..., H] float32 (normalised), lse [...] float32."""

    out: jax.Array
    lse: jax.Array


def implementation(lay: placement.Layout | None) -> str:
    """The decode attention of programs placed by `lay` (on the default backend without one):
    "tpu", "gpu" (Pallas kernels) or "xla"."""
    platform = (lay.mesh.devices.flat[0].platform if lay is not None
                else jax.default_backend())
    return PLATFORMS.get(platform, "xla")


def supports(impl: str, head_dim: int, prompt_cols: int, slots: int, dtypes=()) -> bool:
    """Whether `impl`'s kernels take these cache sizes (and compute and cache `dtypes`: the CPU
    kernel is float32 only, and runs only where it was built), else the XLA path runs."""
    impl = impl.removesuffix(INTERPRET)
    if impl == "tpu":
        return True
    if impl == "cpu":
        return cpu_attention.supports(dtypes)
    if impl == "gpu":
        return all(_gpu_block(n) >= GPU_MIN for n in (prompt_cols, slots)) and (
            head_dim >= GPU_MIN and head_dim & (head_dim - 1) == 0)
    return False


def column_block(impl: str, n: int) -> int:
    """The columns `impl` reads at a time from a cache of n columns (n: the XLA path, which
    reads every column)."""
    impl = impl.removesuffix(INTERPRET)
    return _tpu_block(n) if impl == "tpu" else _gpu_block(n) if impl == "gpu" else n


def columns_read(impl: str, live: int, n: int) -> int:
    """Columns of an n-column cache that `impl` reads for a row with `live` live columns (from
    its first): whole blocks up to the last live one."""
    blk = column_block(impl, n)
    return min(n, -(-live // blk) * blk)


def combine(*parts: Partial) -> jax.Array:
    """The attention over the union of the parts' ranges (float32 [..., H])."""
    m = functools.reduce(jnp.maximum, [p.lse for p in parts])
    w = [jnp.exp(p.lse - m) for p in parts]
    total = functools.reduce(jnp.add, w)
    return functools.reduce(jnp.add, [wi[..., None] * p.out for wi, p in zip(w, parts)]) / (
        total[..., None])


def over_prompt(impl: str, lay, q_BxKxMxH, k_BxKxHxP, v_BxKxPxH, lo_B, hi_B) -> Partial:
    """Each group's M queries over its prompt columns [lo, hi)."""
    run = _kernel(impl, grouped=False)
    spec = _spec(lay)
    return _placed(lay, run, (spec, spec, spec, _rows(lay), _rows(lay)))(
        q_BxKxMxH, k_BxKxHxP, v_BxKxPxH, lo_B.astype(jnp.int32), hi_B.astype(jnp.int32))


def over_rows(impl: str, lay, q_BxKxGxQxH, k_BxKxGxHxS, v_BxKxGxSxH, hi_BxG) -> Partial:
    """Each row's Q queries over its own generated columns [0, hi)."""
    run = _kernel(impl, grouped=True)
    lo_BxG = jnp.zeros_like(hi_BxG, jnp.int32)
    spec = _spec(lay)
    return _placed(lay, run, (spec, spec, spec, _rows(lay), _rows(lay)))(
        q_BxKxGxQxH, k_BxKxGxHxS, v_BxKxGxSxH, lo_BxG, hi_BxG.astype(jnp.int32))


def write_rows(impl: str, lay, k_BxKxGxHxS, v_BxKxGxSxH, nk_BxKxGxH, nv_BxKxGxH, at_BxG
               ) -> tuple[jax.Array, jax.Array]:
    """The caches with row (b, g)'s new key/value at slot at_BxG[b, g] (not written where the
    slot is outside [0, S))."""
    if impl.removesuffix(INTERPRET) != "tpu":
        b, kh, g, h, s = k_BxKxGxHxS.shape
        b_R, g_R = jnp.arange(b * g) // g, jnp.arange(b * g) % g
        at_R = at_BxG.reshape(-1)
        at_R = jnp.where((at_R >= 0) & (at_R < s), at_R, s)  # s: dropped
        row = lambda x: x.transpose(0, 2, 1, 3).reshape(b * g, kh, h)  # noqa: E731
        return (k_BxKxGxHxS.at[b_R, :, g_R, :, at_R].set(row(nk_BxKxGxH).astype(
                    k_BxKxGxHxS.dtype), mode="drop"),
                v_BxKxGxSxH.at[b_R, :, g_R, at_R, :].set(row(nv_BxKxGxH).astype(
                    v_BxKxGxSxH.dtype), mode="drop"))
    run = functools.partial(_tpu_write, interpret=impl.endswith(INTERPRET))
    spec = _spec(lay)
    return _placed(lay, run, (spec, spec, spec, spec, _rows(lay)), out_specs=(spec, spec))(
        k_BxKxGxHxS, v_BxKxGxSxH, nk_BxKxGxH.astype(k_BxKxGxHxS.dtype),
        nv_BxKxGxH.astype(v_BxKxGxSxH.dtype), at_BxG.astype(jnp.int32))


def _kernel(impl: str, grouped: bool):
    base = impl.removesuffix(INTERPRET)
    return functools.partial(_KERNELS[base], grouped=grouped, interpret=base != impl)


def _spec(lay):
    return None if lay is None else P(lay.rows, lay.kv)


def _rows(lay):
    return None if lay is None else P(lay.rows)


def _placed(lay, run, in_specs, out_specs=None):
    """`run` on each device's rows and KV heads (a kernel is not split by the SPMD partitioner
    itself: without this it would gather the caches onto every device)."""
    if lay is None:
        return run
    return jax.shard_map(run, mesh=lay.mesh, in_specs=in_specs,
                         out_specs=_spec(lay) if out_specs is None else out_specs,
                         check_vma=False)


def _flat_ranges(lo, hi):
    """[B] or [B, G] ranges as flat int32 [B*G] (row-major, the grid's order)."""
    return lo.reshape(-1), hi.reshape(-1)


# ---- TPU (Mosaic) ----------------------------------------------------------------------------

def _tpu_block(n: int) -> int:
    return next((b for b in TPU_BLOCKS if n % b == 0), n)


def live_block(j, lo, hi, block: int, blocks: int):
    """The block the TPU kernel's step j fetches for columns [lo, hi): j clamped to the live
    blocks (and to the cache: an empty range names a block inside it). Outside the live blocks
    it repeats a block index, which the pipeline does not fetch again."""
    # lax.div (truncating; the same for the non-negative counts here): a floor division
    # lowers through a sign op that Mosaic resolves on the default backend, not the target
    first = jnp.minimum(jax.lax.div(lo, block), blocks - 1)
    return jnp.clip(j, first, jnp.clip(jax.lax.div(hi - 1, block), first, blocks - 1))


def _tpu(q, k, v, lo, hi, *, grouped: bool, interpret: bool) -> Partial:
    """q [B, K, (G,) M, H], k [B, K, (G,) H, S], v [B, K, (G,) S, H]; lo, hi [B] or [B, G]."""
    b, kh, h, s = q.shape[0], q.shape[1], q.shape[-1], k.shape[-1]
    g = q.shape[2] if grouped else 1
    m = q.shape[-2]
    blk = _tpu_block(s)
    nb = s // blk
    lo_f, hi_f = _flat_ranges(lo, hi)

    def live(i, j, lo_ref, hi_ref):
        return live_block(j, lo_ref[i], hi_ref[i], blk, nb)

    if grouped:
        grid = (b, g, nb)
        whole = lambda bi, gi, j, lr, hr: (bi, 0, gi, 0, 0)  # noqa: E731
        col = lambda bi, gi, j, lr, hr: live(bi * g + gi, j, lr, hr)  # noqa: E731
        qspec = pl.BlockSpec((None, kh, None, m, h), whole)
        kspec = pl.BlockSpec((None, kh, None, h, blk),
                             lambda *a: (a[0], 0, a[1], 0, col(*a)))
        vspec = pl.BlockSpec((None, kh, None, blk, h),
                             lambda *a: (a[0], 0, a[1], col(*a), 0))
        lspec = pl.BlockSpec((None, kh, None, m, 1), whole)
        out_shape = (jax.ShapeDtypeStruct((b, kh, g, m, h), jnp.float32),
                     jax.ShapeDtypeStruct((b, kh, g, m, 1), jnp.float32))
        sem = ("parallel", "parallel", "arbitrary")
    else:
        grid = (b, nb)
        qspec = pl.BlockSpec((None, kh, m, h), lambda bi, j, lr, hr: (bi, 0, 0, 0))
        kspec = pl.BlockSpec((None, kh, h, blk),
                             lambda bi, j, lr, hr: (bi, 0, 0, live(bi, j, lr, hr)))
        vspec = pl.BlockSpec((None, kh, blk, h),
                             lambda bi, j, lr, hr: (bi, 0, live(bi, j, lr, hr), 0))
        lspec = pl.BlockSpec((None, kh, m, 1), lambda bi, j, lr, hr: (bi, 0, 0, 0))
        out_shape = (jax.ShapeDtypeStruct((b, kh, m, h), jnp.float32),
                     jax.ShapeDtypeStruct((b, kh, m, 1), jnp.float32))
        sem = ("parallel", "arbitrary")

    def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc):
        r = pl.program_id(0) * g + (pl.program_id(1) if grouped else 0)
        j = pl.program_id(len(grid) - 1)
        row_lo, row_hi = lo_ref[r], hi_ref[r]
        c0 = j * blk

        @pl.when(j == 0)
        def _():
            m_sc[...] = jnp.full(m_sc.shape, MASKED_SCORE, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        @pl.when((c0 < row_hi) & (c0 + blk > row_lo))
        def _():
            cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (m, blk), 1)
            keep = (cols >= row_lo) & (cols < row_hi)
            for x in range(kh):  # the KV heads of the block, one small matmul each
                qx = q_ref[x]
                sc = jnp.dot(qx, k_ref[x].astype(qx.dtype),
                             preferred_element_type=jnp.float32) / math.sqrt(h)
                sc = jnp.where(keep, sc, MASKED_SCORE)
                m_prev = m_sc[x]
                m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
                a = jnp.exp(m_prev - m_new)
                p = jnp.exp(sc - m_new)
                l_sc[x] = a * l_sc[x] + jnp.sum(p, axis=1, keepdims=True)
                acc_sc[x] = a * acc_sc[x] + jnp.dot(p.astype(qx.dtype),
                                                    v_ref[x].astype(qx.dtype),
                                                    preferred_element_type=jnp.float32)
                m_sc[x] = m_new

        @pl.when(j == nb - 1)
        def _():
            l = l_sc[...]
            some = l > 0
            o_ref[...] = acc_sc[...] / jnp.where(some, l, 1.0)
            lse_ref[...] = jnp.where(some, m_sc[...] + jnp.log(jnp.where(some, l, 1.0)),
                                     MASKED_SCORE)

    o, lse = pl.pallas_call(
        kernel, out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid, in_specs=[qspec, kspec, vspec],
            out_specs=[qspec, lspec],
            scratch_shapes=[pltpu.VMEM((kh, m, 1), jnp.float32),
                            pltpu.VMEM((kh, m, 1), jnp.float32),
                            pltpu.VMEM((kh, m, h), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=sem),
        interpret=interpret, name="decode_attention_tpu")(lo_f, hi_f, q, k, v)
    return Partial(o, lse[..., 0])


WRITE_BLOCK = 128  # the columns (keys) or rows (values) a TPU cache write rewrites


def _tpu_write(k, v, nk, nv, at, *, interpret: bool):
    """k [B, K, G, H, S], v [B, K, G, S, H], nk/nv [B, K, G, H], at [B, G]: each grid step
    (b, g) reads the block of WRITE_BLOCK slots that holds its slot, sets the slot, writes the
    block back; the caches are the outputs' buffers (aliased), so no other block moves."""
    b, kh, g, h, s = k.shape
    blk = WRITE_BLOCK if s % WRITE_BLOCK == 0 else s  # a lane-aligned block, or all
    nb = s // blk
    at_f = at.reshape(-1)

    def block(bi, gi, at_ref):  # an outside slot names the last block, left as it was
        return jnp.clip(jax.lax.div(at_ref[bi * g + gi], blk), 0, nb - 1)

    kspec = pl.BlockSpec((None, kh, None, h, blk),
                         lambda bi, gi, a: (bi, 0, gi, 0, block(bi, gi, a)))
    vspec = pl.BlockSpec((None, kh, None, blk, h),
                         lambda bi, gi, a: (bi, 0, gi, block(bi, gi, a), 0))
    nspec = pl.BlockSpec((None, kh, None, 1, h), lambda bi, gi, a: (bi, 0, gi, 0, 0))

    def kernel(at_ref, nk_ref, nv_ref, k_ref, v_ref, k_out, v_out):
        r = pl.program_id(0) * g + pl.program_id(1)
        col = at_ref[r] - block(pl.program_id(0), pl.program_id(1), at_ref) * blk
        kcol = jax.lax.broadcasted_iota(jnp.int32, (kh, h, blk), 2) == col
        vrow = jax.lax.broadcasted_iota(jnp.int32, (kh, blk, h), 1) == col
        k_out[...] = jnp.where(kcol, jnp.swapaxes(nk_ref[...], 1, 2), k_ref[...])
        v_out[...] = jnp.where(vrow, nv_ref[...], v_ref[...])

    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype),
                           jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, g), in_specs=[nspec, nspec, kspec, vspec],
            out_specs=[kspec, vspec]),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret, name="decode_cache_write_tpu")(
            at_f, nk[:, :, :, None, :], nv[:, :, :, None, :], k, v)


# ---- GPU (Triton) ----------------------------------------------------------------------------

def _gpu_block(n: int) -> int:
    """The largest power of two <= GPU_BLOCK that divides n."""
    return min(GPU_BLOCK, n & -n)


def _gpu(q, k, v, lo, hi, *, grouped: bool, interpret: bool) -> Partial:
    """As `_tpu`; the queries are padded to a power of two >= 16 rows for Triton's dot."""
    b, kh, h, s = q.shape[0], q.shape[1], q.shape[-1], k.shape[-1]
    g = q.shape[2] if grouped else 1
    m = q.shape[-2]
    mp = max(GPU_MIN, pl.next_power_of_2(m))
    q = jnp.pad(q, [(0, 0)] * (q.ndim - 2) + [(0, mp - m), (0, 0)])
    blk = _gpu_block(s)
    lo_f, hi_f = _flat_ranges(lo, hi)

    if grouped:
        grid = (b, g)
        at = lambda shape: pl.BlockSpec((None, kh, None, *shape),  # noqa: E731
                                        lambda bi, gi: (bi, 0, gi, 0, 0))
        out_shape = (jax.ShapeDtypeStruct((b, kh, g, mp, h), jnp.float32),
                     jax.ShapeDtypeStruct((b, kh, g, mp), jnp.float32))
        lspec = pl.BlockSpec((None, kh, None, mp), lambda bi, gi: (bi, 0, gi, 0))
    else:
        grid = (b,)
        at = lambda shape: pl.BlockSpec((None, kh, *shape),  # noqa: E731
                                        lambda bi: (bi, 0, 0, 0))
        out_shape = (jax.ShapeDtypeStruct((b, kh, mp, h), jnp.float32),
                     jax.ShapeDtypeStruct((b, kh, mp), jnp.float32))
        lspec = pl.BlockSpec((None, kh, mp), lambda bi: (bi, 0, 0))
    rspec = pl.BlockSpec((b * g,), lambda *_: (0,))

    def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
        r = pl.program_id(0) * g + (pl.program_id(1) if grouped else 0)
        row_lo, row_hi = lo_ref[r], hi_ref[r]
        first = row_lo // blk
        end = jnp.where(row_hi > row_lo, pl.cdiv(row_hi, blk), first)
        for x in range(kh):
            qx = q_ref[x]

            def body(j, carry, qx=qx, x=x):
                acc, m_prev, l_prev = carry
                c0 = j * blk
                sc = jnp.dot(qx, k_ref[x, :, pl.ds(c0, blk)].astype(qx.dtype),
                             preferred_element_type=jnp.float32) / math.sqrt(h)
                cols = c0 + jnp.arange(blk)
                sc = jnp.where(((cols >= row_lo) & (cols < row_hi))[None, :], sc, MASKED_SCORE)
                m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1))
                a = jnp.exp(m_prev - m_new)
                p = jnp.exp(sc - m_new[:, None])
                acc = a[:, None] * acc + jnp.dot(p.astype(qx.dtype),
                                                 v_ref[x, pl.ds(c0, blk), :].astype(qx.dtype),
                                                 preferred_element_type=jnp.float32)
                return acc, m_new, a * l_prev + jnp.sum(p, axis=1)

            init = (jnp.zeros((mp, h), jnp.float32), jnp.full((mp,), MASKED_SCORE, jnp.float32),
                    jnp.zeros((mp,), jnp.float32))
            acc, m_i, l_i = jax.lax.fori_loop(first, end, body, init)
            some = l_i > 0
            safe = jnp.where(some, l_i, 1.0)
            o_ref[x] = acc / safe[:, None]
            lse_ref[x] = jnp.where(some, m_i + jnp.log(safe), MASKED_SCORE)

    o, lse = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid,
        in_specs=[rspec, rspec, at((mp, h)), at((h, s)), at((s, h))],
        out_specs=[at((mp, h)), lspec],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="decode_attention_gpu")(lo_f, hi_f, q, k, v)
    return Partial(o[..., :m, :], lse[..., :m])


_KERNELS = {"tpu": _tpu, "gpu": _gpu}
