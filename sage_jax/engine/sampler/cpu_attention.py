"""Decode attention on CPU by a C++ kernel (`cpu_attention.cc`, an XLA FFI custom call) that
reads each row's live prompt columns and generated slots only, splits the work over XLA's
intra-op thread pool and writes each row's new key/value into its cache in place.

    attend(lay, q_BxGxKxD, pk_BxKxHxP, pv_BxKxPxH, lo_B, gk_BxKxGxHxS, gv_BxKxGxSxH,
           nk_BxGxKxH, nv_BxGxKxH, at_BxG) -> (out_BxGxKxD, gk, gv)

(D = Q*H: a KV head's Q query heads, flattened; lo_B: the first live prompt column; at_BxG:
each row's slot, read before it and written at it.) The XLA path (`decode._attend` and the
scatter of `decode_attention.write_rows`) stays the reference and the fallback.

The library is built with the machine's C++ compiler on first use into a cache (default
~/.cache/sage_jax/kernels, or $SAGE_JAX_KERNEL_CACHE) under a name keyed by the source, the
compiler and its flags, the CPU and the jaxlib version; the build writes a temporary file and
renames it, so concurrent builds never leave a partial library. `status()` says, in one line
logged once, whether the kernel runs or why the XLA path does (no compiler, a failed build,
float32 only, SAGE_JAX_CPU_KERNEL=0).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sage_jax.engine.sampler import placement

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "sage_decode_attention_cpu"
SYMBOL = "SageDecodeAttention"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
ENV_OFF = "SAGE_JAX_CPU_KERNEL"  # "0": the XLA path


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_identity() -> str:
    """The CPU model and flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(dict.fromkeys(keep))


def build_key(cxx: str) -> str:
    """What the built library depends on: source, compiler (path and version), flags, CPU,
    jaxlib."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout.splitlines()[:1]
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cxx.encode(), "\n".join(version).encode(),
                 " ".join(FLAGS).encode(), _cpu_identity().encode(),
                 importlib.metadata.version("jaxlib").encode(), platform.machine().encode()):
        h.update(part + b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("SAGE_JAX_KERNEL_CACHE") or "~/.cache/sage_jax/kernels"
                ).expanduser()


def build(cxx: str, out_dir: Path | None = None) -> Path:
    """The kernel library for this machine (built now unless cached); CalledProcessError with
    the compiler's message when the build fails."""
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"cpu_attention-{build_key(cxx)}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".cpu_attention-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp],
                       check=True, capture_output=True, text=True, timeout=600)
        os.replace(tmp, lib)  # whole or not at all; a concurrent build renames the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def status() -> tuple[bool, str]:
    """(whether the kernel runs, the one line saying which path runs and why); builds and
    registers the kernel the first time."""
    if os.environ.get(ENV_OFF, "1") == "0":
        ok, why = False, f"XLA path ({ENV_OFF}=0)"
    elif (cxx := compiler()) is None:
        ok, why = False, "XLA path (no C++ compiler found: g++, c++ or $CXX)"
    else:
        try:
            lib = build(cxx)
            handler = getattr(ctypes.cdll.LoadLibrary(str(lib)), SYMBOL)
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
            ok, why = True, f"C++ kernel ({lib})"
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            ok, why = False, f"XLA path (the kernel did not build: {detail.strip()[-300:]})"
    print(f"CPU decode attention: {why}", flush=True)
    return ok, why


def supports(dtypes) -> bool:
    """Whether the kernel runs for arrays of these dtypes (float32 only) on this machine."""
    return all(jnp.dtype(d) == jnp.float32 for d in dtypes) and status()[0]


def _call(q, pk, pv, lo, gk, gv, nk, nv, at):
    return jax.ffi.ffi_call(
        TARGET, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                 jax.ShapeDtypeStruct(gk.shape, jnp.float32),
                 jax.ShapeDtypeStruct(gv.shape, jnp.float32)),
        input_output_aliases={4: 1, 5: 2})(q, pk, pv, lo, gk, gv, nk, nv, at)


def attend(lay, q_BxGxKxD, pk_BxKxHxP, pv_BxKxPxH, lo_B, gk_BxKxGxHxS, gv_BxKxGxSxH,
           nk_BxGxKxH, nv_BxGxKxH, at_BxG):
    """(attention output [B, G, K, D] float32, generated keys and values with each row's new
    one at its slot); per shard of rows and KV heads under a mesh layout."""
    args = (q_BxGxKxD, pk_BxKxHxP, pv_BxKxPxH, lo_B.astype(jnp.int32), gk_BxKxGxHxS,
            gv_BxKxGxSxH, nk_BxGxKxH, nv_BxGxKxH, at_BxG.astype(jnp.int32))
    if lay is None:
        return _call(*args)
    rows_gk = P(lay.rows, None, lay.kv)  # [B, G, K, ...]
    kv = P(lay.rows, lay.kv)  # [B, K, ...]
    return jax.shard_map(_call, mesh=lay.mesh,
                         in_specs=(rows_gk, kv, kv, P(lay.rows), kv, kv, rows_gk, rows_gk,
                                   P(lay.rows)),
                         out_specs=(rows_gk, kv, kv), check_vma=False)(*args)
