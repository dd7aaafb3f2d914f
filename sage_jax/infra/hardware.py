"""Accelerators a run is compiled for without having them: named topologies, their compile-only
devices (`jax.experimental.topologies`), and each chip's peak FLOP/s, HBM and bandwidth.

`--topology` names, as the clouds name slices (`v5p-16`: 16 TensorCores = 8 chips of 2 cores
each; `v5litepod-16`, `v6e-16`: 16 chips), as libtpu names topologies (`v5p:2x2x2`,
`v5e:2x2`), or GPUs as `8xh100` (chips x kind, one host).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re

import jax
from jax.experimental import topologies


class HardwareError(ValueError):
    """A topology that cannot be named or compiled for here (with what to install)."""


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What XLA's GPU compiler reads of a GPU it cannot see (its target config): compute
    capability, SMs, FP32 lanes per SM, boost clock, L2 and shared memory per SM / per block."""

    sm: tuple[int, int]
    sms: int
    fp32_per_sm: int
    clock_ghz: float
    l2_bytes: int
    smem_per_sm: int
    smem_per_block: int  # opt-in maximum


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's published peak numbers (dense bf16 FLOP/s, HBM bytes, HBM
    bytes/s), the libtpu / CUDA name of its kind, and where the numbers come from."""

    name: str
    platform: str  # "tpu" or "cuda"
    peak_flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    source: str
    cores_per_chip: int = 1  # TensorCores a cloud slice name counts per chip (v4, v5p: 2)
    gpu: Gpu | None = None


GB, GIB, KIB, MIB = 1e9, 1024 ** 3, 1024, 1024 ** 2
# CUDA C++ Programming Guide, "Compute Capabilities" (shared memory per SM / per block, opt-in)
# and the A100 / H100 whitepapers (SMs, FP32 lanes per SM, boost clock, L2).
_A100 = Gpu((8, 0), 108, 64, 1.41, 40 * MIB, 164 * KIB, 163 * KIB)
_H100 = Gpu((9, 0), 132, 128, 1.98, 50 * MIB, 228 * KIB, 227 * KIB)
CHIPS = {
    "v4": Chip("v4", "tpu", 275e12, 32 * GIB, 1200 * GB,
               "cloud.google.com/tpu/docs/v4 (bf16 peak, HBM2 32 GiB, 1200 GB/s)",
               cores_per_chip=2),
    "v5e": Chip("v5e", "tpu", 197e12, 16 * GIB, 819 * GB,
                "cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GB, 819 GB/s)"),
    "v5p": Chip("v5p", "tpu", 459e12, 95 * GIB, 2765 * GB,
                "cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GB, 2765 GB/s)",
                cores_per_chip=2),
    "v6e": Chip("v6e", "tpu", 918e12, 32 * GIB, 1640 * GB,
                "cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 32 GB, 1640 GB/s)"),
    "a100-80gb": Chip("a100-80gb", "cuda", 312e12, 80 * GIB, 2039 * GB,
                      "NVIDIA A100 datasheet (SXM 80GB: 312 TFLOP/s dense bf16, 2039 GB/s)",
                      gpu=_A100),
    "h100": Chip("h100", "cuda", 989e12, 80 * GIB, 3350 * GB,
                 "NVIDIA H100 datasheet (SXM: 989 TFLOP/s dense bf16, 80 GB, 3.35 TB/s)",
                 gpu=_H100),
    "h200": Chip("h200", "cuda", 989e12, 141 * GIB, 4800 * GB,
                 "NVIDIA H200 datasheet (SXM: 989 TFLOP/s dense bf16, 141 GB, 4.8 TB/s)",
                 gpu=_H100),
}
_CLOUD_KIND = {"v4": "v4", "v5p": "v5p", "v5litepod": "v5e", "v5e": "v5e", "v6e": "v6e"}
# Chips of a slice -> libtpu topology (the shapes Cloud TPU offers for small slices).
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A named slice: its chip, libtpu topology name (TPU) or chip count (GPU)."""

    name: str
    chip: Chip
    chips: int
    tpu_name: str | None = None


def parse(name: str) -> Topology:
    """The `Topology` of a `--topology` name (see the module docstring)."""
    gpu = re.fullmatch(r"(\d+)x([a-z0-9-]+)", name)
    if gpu and gpu.group(2) in CHIPS and CHIPS[gpu.group(2)].platform == "cuda":
        return Topology(name, xla_share(CHIPS[gpu.group(2)]), int(gpu.group(1)))
    raw = re.fullmatch(r"(v4|v5p|v5e|v6e):(\d+(?:x\d+)+)", name)
    if raw:
        chip = CHIPS[raw.group(1)]
        return Topology(name, chip, math.prod(int(x) for x in raw.group(2).split("x")), name)
    cloud = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", name)
    if cloud:
        chip = CHIPS[_CLOUD_KIND[cloud.group(1)]]
        chips = int(cloud.group(2)) // chip.cores_per_chip
        shapes = _SHAPES_3D if chip.cores_per_chip == 2 else _SHAPES_2D
        if chips in shapes:
            kind = "v5e" if chip.name == "v5e" else chip.name
            return Topology(name, chip, chips, f"{kind}:{shapes[chips]}")
    gpus = sorted(k for k, c in CHIPS.items() if c.platform == "cuda")
    raise HardwareError(
        f"unknown topology {name!r}: name a TPU slice (v4-8, v5p-16, v5litepod-16, v6e-8, ...; "
        f"or libtpu's v5p:2x2x2, v5e:2x2) or GPUs as <count>x<kind>, kind one of {gpus}")


def xla_share(chip: Chip) -> Chip:
    """`chip` with the HBM that XLA's GPU allocator may use: XLA_PYTHON_CLIENT_MEM_FRACTION of
    it (jax's default 0.75), all of it with XLA_PYTHON_CLIENT_ALLOCATOR=platform."""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        return chip
    share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    return dataclasses.replace(
        chip, hbm_bytes=int(chip.hbm_bytes * share),
        source=f"{chip.source}; {share:.0%} of it for XLA (XLA_PYTHON_CLIENT_MEM_FRACTION)")


def gpu_target_config(chip: Chip) -> str:
    """The XLA GPU target config (text proto) of `chip`, from its table entry."""
    g = chip.gpu
    info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=48 * KIB,
                shared_memory_per_core=g.smem_per_sm, threads_per_core_limit=2048,
                core_count=g.sms, fpus_per_core=g.fp32_per_sm, block_dim_limit_x=2 ** 31 - 1,
                block_dim_limit_y=65535, block_dim_limit_z=65535,
                memory_bandwidth=int(chip.hbm_bandwidth), l2_cache_size=g.l2_bytes,
                clock_rate_ghz=g.clock_ghz, device_memory_size=CHIPS[chip.name].hbm_bytes,
                shared_memory_per_block_optin=g.smem_per_block, registers_per_core_limit=65536,
                registers_per_block_limit=65536)
    fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {g.sm[0]} "
            f"minor: {g.sm[1]} }}\n}}\nplatform_name: \"CUDA\"\n"
            f"device_description_str: \"{chip.name}\"\n")


def _host_bounds(topo: Topology) -> dict:
    """libtpu's `chips_per_host_bounds` for a slice smaller than a host (a v5e-1: `v5e:1x1`,
    which libtpu's default 2x2x1 host does not divide); nothing for larger slices."""
    dims = [int(x) for x in (topo.tpu_name or "").partition(":")[2].split("x") if x]
    if not dims or math.prod(dims) >= 4:
        return {}
    return {"chips_per_host_bounds": tuple(dims + [1] * (3 - len(dims)))}


def compile_devices(topo: Topology) -> list:
    """Compile-only devices of `topo` (no accelerator needed): programs lowered on a mesh of
    them compile for that hardware and report its memory use."""
    if topo.chip.platform == "tpu":
        # Compile-only: several processes may load libtpu at once (it locks by default); off a
        # TPU VM, tell libtpu there is no TPU to discover (else it prints a page of warnings;
        # the compiled programs are the same).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
            for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                               ("TPU_ACCELERATOR_TYPE", "v5litepod-4")):
                os.environ.setdefault(key, value)
        try:
            desc = topologies.get_topology_desc(topology_name=topo.tpu_name, platform="tpu",
                                                **_host_bounds(topo))
        except Exception as e:  # noqa: BLE001 - no libtpu, or a name libtpu refuses
            raise HardwareError(
                f"cannot compile for TPU {topo.name} ({topo.tpu_name}): {_first_line(e)}; "
                f"install the TPU compiler that matches jax {jax.__version__}: "
                f"pip install -r requirements-tpu.txt (or pip install 'sage_jax[tpu]')") from e
        return list(desc.devices)
    # Without a GPU, the CUDA plugin registers only when jax is not told to use CUDA (else it
    # checks the driver first): a process that has not started jax yet is put on the CPU.
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    try:
        desc = topologies.get_topology_desc(
            platform="cuda", topology_name=topo.chip.name, topology=f"1x1x{topo.chips}",
            target_config=gpu_target_config(topo.chip))
    except Exception as e:  # noqa: BLE001 - no CUDA plugin, or it did not register
        raise HardwareError(
            f"cannot compile for GPUs {topo.name}: {_first_line(e)}; install the GPU compiler "
            f"that matches jax {jax.__version__}: pip install -r requirements-gpu-aot.txt (or "
            f"pip install 'sage_jax[gpu-aot]'); on a machine without a GPU, compile in a fresh "
            f"process (python -m sage_jax.aot does) or with JAX_PLATFORMS=cpu") from e
    return list(desc.devices)


# device_kind substrings (lower case) -> chip, most specific first.
_KINDS = (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6 lite", "v6e"), ("v6e", "v6e"),
          ("v5", "v5p"), ("v4", "v4"), ("h200", "h200"), ("h100", "h100"),
          ("a100", "a100-80gb"))


def chip_of(device) -> Chip:
    """The `Chip` of a (real or compile-only) device, its HBM read from the device where it
    reports one; a CPU or an unknown kind gets nominal numbers (the host's memory)."""
    kind = str(getattr(device, "device_kind", "")).lower()
    chip = next((CHIPS[c] for key, c in _KINDS if key in kind), None)
    if chip is None:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        chip = Chip(kind or "cpu", "cpu", 1e12, host, 50 * GB,
                    "nominal: not an accelerator (host memory, 1 TFLOP/s, 50 GB/s)")
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - compile-only and CPU devices have no stats
        limit = None
    return dataclasses.replace(chip, hbm_bytes=int(limit)) if limit else chip


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
