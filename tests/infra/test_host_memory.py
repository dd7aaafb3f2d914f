"""`host_memory.tune_malloc` and `trim`: freed buffers go back to the system, so RSS follows live
memory."""

import os
import subprocess
import sys

import pytest

from sage_jax.infra import host_memory

CODE = """
import sys
import numpy as np
from sage_jax.infra import host_memory
if sys.argv[1] == "1":
    assert host_memory.tune_malloc()
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
big = np.ones(2 << 20)  # 16 MB from mmap; freeing it lets glibc serve 8 MB from its heap
del big
blocks = [np.ones(1 << 20) for _ in range(40)]  # 40 x 8 MB, as a run's buffers
before = rss_mb()
last, pin = blocks[-1], np.ones(64)  # the newest block and a small one stay alive
del blocks
print(before, rss_mb())
"""


def _rss(tuned: bool) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", host_memory.ENV)}
    got = subprocess.run([sys.executable, "-c", CODE, "1" if tuned else "0"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    before, after = map(int, got.stdout.split())
    return before, after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_tuned_malloc_returns_freed_buffers_to_the_system():
    before, after = _rss(tuned=True)
    assert before - after > 250, (before, after)  # 39 freed blocks of 8 MB left the process
    before0, after0 = _rss(tuned=False)
    assert before0 - after0 < before - after - 150, ((before0, after0), (before, after))


def test_tune_malloc_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "0")
    assert host_memory.tune_malloc() is False


TRIM = """
import numpy as np
from sage_jax.infra import host_memory
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
blocks = [np.ones(8 << 10) for _ in range(6000)]  # 6000 x 64 KB from malloc's heap
pin = blocks[-1]  # the newest block stays alive, so the heap's top cannot shrink
del blocks
before = rss_mb()
assert host_memory.trim()
print(before, rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_trim_returns_the_heap_that_freed_small_buffers_left():
    got = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr
    before, after = map(int, got.stdout.split())
    assert before - after > 250, (before, after)  # most of the 375 MB freed left the process

