"""Host memory of a CPU run: glibc malloc tuned so the process's resident memory follows its live
buffers. XLA's CPU buffers are allocated with malloc; by default glibc serves those of up to
32 MB from per-thread arenas and keeps them after they are freed, so the RSS of a sampling call
grows well past what it holds (measured on SmolLM2-135M: peak 4.4 GB, 1.5 GB live)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 1 << 20  # buffers of 1 MB and more come from mmap and go back on free
ARENA_MAX = 2  # malloc arenas (glibc's default: 8 per core)
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc's mallopt parameters
ENV = "SAGE_JAX_TUNE_MALLOC"  # 0: leave malloc as it is


def tune_malloc() -> bool:
    """Sets glibc's mmap threshold to `MMAP_THRESHOLD` and its arena limit to `ARENA_MAX`
    (before the run allocates its buffers: the entry commands call it first), unless the
    process set MALLOC_MMAP_THRESHOLD_ / MALLOC_ARENA_MAX itself or SAGE_JAX_TUNE_MALLOC=0.
    Returns whether it did (False off glibc)."""
    if os.environ.get(ENV, "1") == "0":
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    done = True
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        done &= mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    if "MALLOC_ARENA_MAX" not in os.environ:
        done &= mallopt(_M_ARENA_MAX, ARENA_MAX) == 1
    return bool(done)


def trim() -> bool:
    """Hands the free memory in malloc's heaps back to the system (glibc `malloc_trim`): what a
    step's small freed buffers and a compile's garbage leave behind (measured on SmolLM2-135M:
    1.5 GB after each update). The training loop calls it between phases; False off glibc."""
    malloc_trim = _glibc("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))


def _glibc(name: str):
    """The C library's function `name`, or None (not glibc, or no such function)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
