"""Where the sampler's arrays live on a ("data", "fsdp", "tensor") mesh.

Rows (prompts, or answer rows) are split over ("data", "fsdp") when that divides their count
(else replicated); the KV caches' KV-head axis over "tensor" when that divides the KV heads (the
attention heads' split in the partition rules). The weights are used with the trainer's
partition rules minus "fsdp" (`SAMPLER_RULES`): decode feeds one token per row per step, so
fsdp-split weights would be gathered at every step; they are regathered once per program.
"""

from __future__ import annotations

import dataclasses
from typing import overload

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sage_jax.infra import parallel

SAMPLER_RULES = tuple((pattern, tuple(None if a == "fsdp" else a for a in axes))
                      for pattern, axes in parallel.PARTITION_RULES)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one sampling program's arrays live (hashable: part of the jit cache key).

    rows: the mesh axes of the row dimension (None: replicated); kv: the mesh axis of the
    KV-head dimension of the caches (None: whole)."""

    mesh: Mesh
    rows: tuple | None
    kv: str | None


@overload
def layout(mesh: Mesh, num_kv_heads: int, num_rows: int) -> Layout: ...
@overload
def layout(mesh: Mesh | None, num_kv_heads: int, num_rows: int) -> Layout | None: ...
def layout(mesh: Mesh | None, num_kv_heads: int, num_rows: int) -> Layout | None:
    """Rows over ("data", "fsdp") when that divides `num_rows`, KV heads over "tensor" when
    that divides them; None without a mesh."""
    if mesh is None:
        return None
    rows = parallel.ROWS if num_rows % parallel.row_shards(mesh) == 0 else None
    t = mesh.shape["tensor"]
    kv = "tensor" if t > 1 and num_kv_heads % t == 0 else None
    return Layout(mesh, rows, kv)


def spec(lay: Layout, kv_dim: int | None = None) -> NamedSharding:
    """Rows on dimension 0 and, with `kv_dim`, KV heads on that dimension; the rest whole."""
    parts = [lay.rows] + ([None] * (kv_dim - 1) + [lay.kv] if kv_dim else [])
    return NamedSharding(lay.mesh, P(*parts))


def replicated(lay: Layout) -> NamedSharding:
    return NamedSharding(lay.mesh, P())


def on(lay: Layout | None, tree, kv_dim: int | None = None):
    """Every array of `tree` (rows first) constrained inside jit to `spec(lay, kv_dim)`;
    unchanged without a mesh."""
    if lay is None:
        return tree
    sh = spec(lay, kv_dim)
    return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: sh, tree))


def sampler_params(params, lay: Layout | None, compute_dtype):
    """The weights as the sampler reads them: matrices (the embedding included) in
    `compute_dtype` when stored wider (the model casts them so at every use, so the outputs are
    the same; the regathered copy and the bytes each decode step reads are halved), resharded
    on device to `SAMPLER_RULES` (no reshard without "fsdp")."""
    narrow = jnp.dtype(compute_dtype)

    def cast(x):
        wider = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > narrow.itemsize
        return x.astype(narrow) if wider and x.ndim >= 2 else x

    params = jax.tree.map(cast, params)
    if lay is None or lay.mesh.shape["fsdp"] == 1:
        return params
    return jax.lax.with_sharding_constraint(
        params, parallel.tree_shardings(params, lay.mesh, SAMPLER_RULES))
