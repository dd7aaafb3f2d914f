"""Device mesh, partition rules and sharding helpers.

The mesh has three axes: "data" (rows), "fsdp" (rows too, and every weight matrix is split
along it) and "tensor" (where tensor parallelism goes: attention heads, MLP width, vocabulary).
Batch rows are split over ("data", "fsdp"). Parameters, and the optimiser state that mirrors
them, get a `PartitionSpec` from the first rule in `PARTITION_RULES` whose regex matches the
leaf's path (e.g. "layers/3/self_attn/q_proj/kernel"); a dimension that an axis does not divide
evenly stays whole, and leaves that match no rule (norm scales, scalars) are replicated. A LoRA
adapter splits its in (A) or out (B) axis as its kernel does, never its rank.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
ROWS = ("data", "fsdp")  # The mesh axes that batch rows are split over.

# (regex on the leaf path, axes per dimension). Kernels are stored [in, out].
PARTITION_RULES: tuple[tuple[str, tuple], ...] = (
    (r"embed_tokens", ("tensor", "fsdp")),                       # [V, D]
    (r"lm_head/kernel", ("fsdp", "tensor")),                     # [D, V]
    (r"(q_proj|k_proj|v_proj)/kernel", ("fsdp", "tensor")),      # [D, heads*H]
    (r"(q_proj|k_proj|v_proj)/bias", ("tensor",)),               # [heads*H]
    (r"o_proj/kernel", ("tensor", "fsdp")),                      # [N*H, D]
    (r"o_proj/bias", ("fsdp",)),                                 # [D]
    (r"(gate_proj|up_proj)/kernel", ("fsdp", "tensor")),         # [D, F]
    (r"(gate_proj|up_proj)/bias", ("tensor",)),                  # [F]
    (r"down_proj/kernel", ("tensor", "fsdp")),                   # [F, D]
    (r"down_proj/bias", ("fsdp",)),                              # [D]
    # LoRA adapters A [in, r] and B [r, out]: in and out split as the kernel's, r whole.
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/lora_a", ("fsdp", None)),   # [D, r]
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/lora_b", (None, "tensor")),  # [r, heads*H | F]
    (r"(o_proj|down_proj)/lora_a", ("tensor", None)),                       # [N*H | F, r]
    (r"(o_proj|down_proj)/lora_b", (None, "fsdp")),                         # [r, D]
)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: all) from a `MeshConfig`.

    One axis may be -1: it takes the devices left over (`MeshConfig.sizes`). The product must equal the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = list(mesh_cfg.sizes())
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(
                f"mesh axes {dict(zip(AXES, sizes))}: the fixed axes ({known} devices) do not "
                f"divide the {len(devices)} devices; change mesh.* so their product divides it")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = {math.prod(sizes)} "
            f"devices, but {len(devices)} are present; change mesh.data/fsdp/tensor so their "
            f"product is {len(devices)}, or set one of them to -1")
    try:
        grid = mesh_utils.create_device_mesh(sizes, devices=devices)
    except Exception:  # noqa: BLE001 - unusual topologies: plain order.
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, AXES)


def path_str(path) -> str:
    """"layers/0/self_attn/q_proj/kernel" for a pytree key path (attribute keys dropped)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey) and k.name != "value":
            parts.append(k.name)
    return "/".join(parts)


def spec_for(path: str, shape, mesh: Mesh, rules=PARTITION_RULES) -> P:
    """The PartitionSpec of one leaf: the first matching rule, dims an axis can't split kept
    whole; no match or a rank mismatch = replicated."""
    for pattern, axes in rules:
        if re.search(pattern, path) and len(axes) == len(shape):
            out = []
            for dim, axis in zip(shape, axes):
                size = 1 if axis is None else mesh.shape[axis]
                out.append(axis if axis is not None and size > 1 and dim % size == 0 else None)
            return P(*out)
    return P()


def tree_shardings(tree, mesh: Mesh, rules=PARTITION_RULES):
    """NamedShardings for every array leaf of `tree` (params, optimiser state, a TrainState)."""
    def one(path, leaf):
        return NamedSharding(mesh, spec_for(path_str(path), np.shape(leaf), mesh, rules))
    return jax.tree_util.tree_map_with_path(one, tree)


param_shardings = tree_shardings  # Same rules for params and everything that mirrors them.


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """Rows (dimension 0) split over ("data", "fsdp"); other dimensions whole."""
    return NamedSharding(mesh, P(ROWS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def row_shards(mesh: Mesh) -> int:
    """How many ways batch rows are split (data * fsdp)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_rows(n: int, mesh: Mesh, what: str = "batch") -> None:
    """Raises a ValueError unless `n` rows split evenly over data * fsdp."""
    k = row_shards(mesh)
    if n % k:
        raise ValueError(
            f"{what} has {n} rows, which do not split over mesh data={mesh.shape['data']} x "
            f"fsdp={mesh.shape['fsdp']} = {k}; use a row count divisible by {k} or change "
            f"mesh.data/mesh.fsdp")


def local_rows(n_rows: int, mesh: Mesh):
    """The global rows (of `n_rows`, split over ("data", "fsdp")) that this process's devices
    hold, ascending: `slice(None)` with one process, else a slice (or an index array when
    they are not contiguous). `batch[local_rows(n, mesh)]` is what `shard_batch` takes."""
    if jax.process_count() == 1:
        return slice(None)
    check_rows(n_rows, mesh, "the batch")
    spans = sorted({(s[0].start or 0, n_rows if s[0].stop is None else s[0].stop) for s in
                    rows_sharding(mesh).addressable_devices_indices_map((n_rows,)).values()})
    if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1])
    return np.concatenate([np.arange(a, b) for a, b in spans])


def replicate(x, mesh: Mesh) -> jax.Array:
    """A host value (the same on every process) as an array replicated over the whole mesh."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return jax.device_put(x, replicated(mesh))
    return jax.make_array_from_callback(x.shape, replicated(mesh), lambda idx: x[idx])


def shard_batch(batch: dict, mesh: Mesh, *, global_rows: int | None = None) -> dict:
    """Places every array of `batch` (rows first) with its rows split over ("data", "fsdp").

    Single process: arrays are global. Multi-process: each process passes its own rows,
    `batch[local_rows(global_rows, mesh)]`, and `global_rows` (inferred when None, assuming
    every process holds an equal share)."""
    sharding = rows_sharding(mesh)
    out = {}
    for key, x in batch.items():
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if jax.process_count() > 1:
            shape = None if global_rows is None else (global_rows,) + tuple(x.shape[1:])
            out[key] = jax.make_array_from_process_local_data(sharding, np.asarray(x), shape)
        else:
            check_rows(x.shape[0], mesh, f"batch[{key!r}]")
            out[key] = jax.device_put(x, sharding)
    return out
