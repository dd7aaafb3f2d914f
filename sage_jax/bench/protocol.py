"""The timing protocol of every benchmark: wait for a quiet machine, warm up, time N calls, take
the median, and flag a sitting where other processes took the cores.

It is the protocol the peer scripts in ../shared/bench/peers/ follow (the same JSON keys, the same
environment variables), so one sitting compares like with like; it lives here so that an
installed `sage_jax` benchmarks itself with nothing outside the package.

    PEERS_QUIET_WAIT_S       longest wait for a quiet machine before timing (default 900; 0: none)
    PEERS_OTHER_CORES_LIMIT  cores other processes may use while we time (default 0.15)
    PEERS_MAX_RETRIES        re-timings of a contended sitting (default 2)
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import statistics
import sys
import time
from typing import Callable

from sage_jax.infra import provenance


def log(*args) -> None:
    """A progress line on stderr (stdout holds only the JSON record)."""
    print(*args, file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _machine_busy_s() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    return (user + nice + system + irq + softirq) / hz, steal / hz


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class CpuShare:
    """Cores used by this process and by every other one while the `with` body runs."""

    def __enter__(self) -> "CpuShare":
        self._start = (_machine_busy_s(), _own_cpu_s(), time.perf_counter())
        self.cores: dict[str, float] = {}
        return self

    def __exit__(self, *exc) -> bool:
        (machine0, own0, t0), machine1 = self._start, _machine_busy_s()
        wall = time.perf_counter() - t0
        if machine0 is None or machine1 is None or wall <= 0:
            return False
        own = _own_cpu_s() - own0
        self.cores = {"own_cores": round(own / wall, 2),
                      "other_cores": round(max(0.0, machine1[0] - machine0[0] - own) / wall, 2),
                      "steal_cores": round((machine1[1] - machine0[1]) / wall, 2)}
        return False


def wait_for_quiet(window_s: float = 2.0) -> float:
    """Waits (at most PEERS_QUIET_WAIT_S) until other processes use few cores; seconds waited."""
    limit, longest = _env("PEERS_OTHER_CORES_LIMIT", 0.15), _env("PEERS_QUIET_WAIT_S", 900)
    start = last_said = time.perf_counter()
    while longest > 0:
        with CpuShare() as share:
            time.sleep(window_s)
        other = share.cores.get("other_cores", 0.0)
        now = time.perf_counter()
        if other < limit:
            break
        if now - start > longest:
            log(f"  no quiet machine after {now - start:.0f} s (others use {other} cores); "
                "timing anyway")
            break
        if now - last_said > 30 or last_said == start:
            log(f"  waiting for a quiet machine (others use {other} cores)")
            last_said = now
    return time.perf_counter() - start


@dataclasses.dataclass
class Timing:
    """What one sitting measured: warm-up and timed seconds, and how quiet it was."""

    warm_s: list[float]
    times_s: list[float]
    cpu: dict[str, float]
    retries: int
    quiet_wait_s: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def contended(self) -> bool:
        return self.cpu.get("other_cores", 0.0) > _env("PEERS_OTHER_CORES_LIMIT", 0.15)


def time_calls(fn: Callable[[int], object], w: dict) -> Timing:
    """`fn(i)` for the workload's warm-up calls, then its timed calls (i = 1000, 1001, ...),
    after a quiet-machine wait; a contended sitting is timed again up to PEERS_MAX_RETRIES
    times."""
    t = w["timing"]
    waited = wait_for_quiet()
    warm = []
    for i in range(t.get("warmup_calls", 1)):
        t0 = time.perf_counter()
        fn(i)
        warm.append(time.perf_counter() - t0)
        log(f"  warm-up call {i}: {warm[-1]:.3f} s")
    retries, most = 0, int(_env("PEERS_MAX_RETRIES", 2))
    while True:
        times = []
        with CpuShare() as share:
            for j in range(t.get("timed_calls", 3)):
                t0 = time.perf_counter()
                fn(1000 + j)
                times.append(time.perf_counter() - t0)
                log(f"  timed call {j}: {times[-1]:.3f} s")
        timing = Timing(warm, times, share.cores, retries, waited)
        if not timing.contended or retries >= most:
            return timing
        log(f"  other processes used {share.cores['other_cores']} cores while timing; "
            f"retry {retries + 1}/{most}")
        retries += 1
        timing.quiet_wait_s = waited = waited + wait_for_quiet()


def emit(peer: str, workload: str, w: dict, timing: Timing, *, tokens_per_call: int | None = None,
         extra: dict | None = None) -> dict:
    """Prints and returns the sitting's JSON record; tokens_per_s = tokens_per_call (default:
    every row's max_new_tokens) / the median call."""
    s = w["sampling"]
    rows = s["num_prompts"] * s["samples_per_prompt"]
    tokens = rows * s["max_new_tokens"] if tokens_per_call is None else tokens_per_call
    rec = {
        "peer": peer, "workload": workload, "commit": provenance.commit(),
        "tokens_per_s": round(tokens / timing.median_s, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "median_s": round(timing.median_s, 4),
        "times_s": [round(x, 4) for x in timing.times_s],
        "warmup_s": [round(x, 4) for x in timing.warm_s],
        "batch": rows, "new_tokens_per_seq": s["max_new_tokens"],
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "cpu_during_timed": timing.cpu, "contended": timing.contended,
        "retries": timing.retries, "quiet_wait_s": round(timing.quiet_wait_s, 1),
        **(extra or {}),
    }
    print(json.dumps(rec), flush=True)
    return rec
