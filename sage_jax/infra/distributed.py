"""Multi-host runs: start `jax.distributed` from the environment, and the few host-side helpers
a multi-controller trainer needs (who is the main process, which rows a host scores, gathers).

One process runs per host (or per accelerator); every process runs the same program on the
global device mesh (`jax.devices()`: all processes' devices), so every process sees the same
sampled tokens and takes the same decisions. Host work that parses text (rewards) is split:
each process scores its `process_rows` and the scores are gathered back to every process.

When is `jax.distributed.initialize()` called (`initialize_from_env`, first thing in
`train.train`)? Decided from the environment, in this order:

* ``SAGE_JAX_DISTRIBUTED=0``: never (one process). ``=1``: always (arguments auto-detected by
  JAX where not given below).
* ``JAX_COORDINATOR_ADDRESS=host:port`` with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``:
  explicitly (any machines; e.g. two GPU nodes, or several processes on one machine). Process 0
  runs the coordinator at that address; every process must be able to reach it.
* SLURM (``srun``, more than one task) and Open MPI (``mpirun``, more than one rank): JAX
  detects the coordinator, process count and id (one process per task; on GPUs JAX gives task
  ``SLURM_LOCALID`` one GPU unless ``JAX_LOCAL_DEVICE_IDS`` says otherwise).
* A Cloud TPU VM (TPU chips on the PCI bus and `libtpu` installed): always, auto-detected from
  the TPU metadata (a single-host slice simply becomes one process).
* Otherwise: one process, nothing is initialised.

On CPU, cross-process collectives use gloo (JAX's default `jax_cpu_collectives_implementation`).

A lost process never hangs the others: JAX's coordination service expects a heartbeat from
every process, and when one stops (the process died, or its host went away) every other process
is terminated with an error that says a task died. ``SAGE_JAX_HEARTBEAT_TIMEOUT_S`` (default 60)
is how long a silent process is waited for, ``SAGE_JAX_SHUTDOWN_TIMEOUT_S`` (default 60) how long
the exit barrier waits for the others (`jax.distributed.initialize`'s heartbeat_timeout_seconds
and shutdown_timeout_seconds; JAX's own defaults are 100 and 300).
"""

from __future__ import annotations

import importlib.util
import os
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

ENV_MODE = "SAGE_JAX_DISTRIBUTED"


class DistributedError(RuntimeError):
    """The environment asks for a multi-process run that cannot be started as given."""


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} must be an integer") from None


def _on_cloud_tpu_vm(env: Mapping[str, str]) -> bool:
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and "tpu" not in platforms.split(","):
        return False
    if importlib.util.find_spec("libtpu") is None:
        return False
    try:  # scans the PCI bus only; does not start a backend
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # noqa: BLE001 - private helper moved or unreadable /sys: assume not
        return False


def cluster_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The keyword arguments for `jax.distributed.initialize` that the environment asks for
    ({} = let JAX auto-detect everything), or None for a single-process run. See the module
    docstring for the rules."""
    env = os.environ if env is None else env
    mode = env.get(ENV_MODE, "auto").strip().lower()
    if mode in ("0", "false", "no", "off"):
        return None
    if mode not in ("auto", "", "1", "true", "yes", "on"):
        raise DistributedError(f"{ENV_MODE}={env[ENV_MODE]!r}: use 0 (off), 1 (on) or auto")
    forced = mode in ("1", "true", "yes", "on")
    address = env.get("JAX_COORDINATOR_ADDRESS") or None
    num = _int_env(env, "JAX_NUM_PROCESSES")
    pid = _int_env(env, "JAX_PROCESS_ID")
    slurm = (all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                                     "SLURM_PROCID", "SLURM_LOCALID"))
             and (_int_env(env, "SLURM_NTASKS") or 1) > 1)
    ompi = ("OMPI_MCA_orte_hnp_uri" in env
            and (_int_env(env, "OMPI_COMM_WORLD_SIZE") or 1) > 1)
    explicit = {k: v for k, v in (("coordinator_address", address), ("num_processes", num),
                                  ("process_id", pid)) if v is not None}
    if address is not None or num is not None or pid is not None:
        if num == 1 and not forced:
            return None
        if not (address is not None and num is not None and pid is not None) and not (
                slurm or ompi):
            missing = [n for n, v in (("JAX_COORDINATOR_ADDRESS", address),
                                      ("JAX_NUM_PROCESSES", num), ("JAX_PROCESS_ID", pid))
                       if v is None]
            raise DistributedError(
                f"a multi-process run needs JAX_COORDINATOR_ADDRESS (host:port of process 0), "
                f"JAX_NUM_PROCESSES and JAX_PROCESS_ID (0 .. JAX_NUM_PROCESSES-1) on every "
                f"process; missing: {', '.join(missing)}")
        if num is not None and pid is not None and not 0 <= pid < num:
            raise DistributedError(
                f"JAX_PROCESS_ID={pid} must be in 0 .. JAX_NUM_PROCESSES-1 = {num - 1}")
        return explicit
    if forced or slurm or ompi or _on_cloud_tpu_vm(env):
        return {}
    return None


def liveness_from_env(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """`jax.distributed.initialize`'s heartbeat and shutdown timeouts (seconds) from the
    environment (see the module docstring)."""
    env = os.environ if env is None else env
    out = {}
    for name, key, default in (("SAGE_JAX_HEARTBEAT_TIMEOUT_S", "heartbeat_timeout_seconds", 60),
                               ("SAGE_JAX_SHUTDOWN_TIMEOUT_S", "shutdown_timeout_seconds", 60)):
        value = _int_env(env, name)
        if value is not None and value < 1:
            raise DistributedError(f"{name}={value}: must be >= 1 (seconds)")
        out[key] = default if value is None else value
    return out


def initialize_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Calls `jax.distributed.initialize` when the environment asks for a multi-process run
    (see the module docstring); returns whether JAX runs distributed. Idempotent, and a no-op
    for a single process. Must run before anything starts a JAX backend."""
    if jax.distributed.is_initialized():
        return True
    kwargs = cluster_from_env(env)
    if kwargs is None:
        return False
    try:
        jax.distributed.initialize(**kwargs, **liveness_from_env(env))
    except RuntimeError as e:
        if "before any JAX calls" in str(e) or "must be called before" in str(e):
            raise DistributedError(
                "the environment asks for a multi-process run, but JAX was already used in "
                "this process; call sage_jax.infra.distributed.initialize_from_env() before any other "
                f"JAX call (or set {ENV_MODE}=0 for a single process). JAX said: {e}") from e
        raise
    except ValueError as e:  # auto-detection found nothing
        raise DistributedError(
            f"jax.distributed.initialize() could not work out the processes from the "
            f"environment ({e}); set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
            f"JAX_PROCESS_ID") from e
    return True


def is_main() -> bool:
    """True on process 0, the one that prints, logs metrics and writes run files."""
    return jax.process_index() == 0


def process_rows(n_rows: int, process_index: int | None = None,
                 process_count: int | None = None) -> slice:
    """This process's contiguous share of `n_rows` host rows (e.g. texts to score): process p
    gets rows [p*c, (p+1)*c) with c = ceil(n_rows / process_count), cut at n_rows."""
    p = jax.process_index() if process_index is None else process_index
    k = jax.process_count() if process_count is None else process_count
    chunk = -(-n_rows // k)
    start = min(p * chunk, n_rows)
    return slice(start, min(start + chunk, n_rows))


def gather(x) -> np.ndarray:
    """Every process's `x` (same shape and dtype on each), stacked: [process_count, ...]."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def gather_rows(local, n_rows: int) -> np.ndarray:
    """The [n_rows, ...] array whose `process_rows(n_rows)` part each process holds in `local`."""
    local = np.asarray(local)
    if jax.process_count() == 1 or n_rows == 0:
        return local
    chunk = -(-n_rows // jax.process_count())
    padded = np.zeros((chunk,) + local.shape[1:], local.dtype)
    padded[:len(local)] = local
    return gather(padded).reshape((-1,) + local.shape[1:])[:n_rows]


def any_process(flag: bool) -> bool:
    """True when `flag` is true on any process (e.g. a stop signal that reached one host)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(gather(np.asarray(bool(flag))).any())


def check_same(values: Mapping[str, str]) -> None:
    """Raises DistributedError naming the entries of `values` (e.g. the run folder, the config)
    that differ between processes: every process must run the same command."""
    if jax.process_count() == 1:
        return
    names = sorted(values)
    mine = np.asarray([zlib.crc32(str(values[k]).encode()) for k in names], np.int64)
    every = gather(mine)
    bad = [k for j, k in enumerate(names) if (every[:, j] != every[0, j]).any()]
    if bad:
        raise DistributedError(
            f"the {len(every)} processes disagree on {', '.join(bad)}: run the same command "
            f"on every host, with an explicit --workdir on a filesystem they all see (the "
            f"default runs/<time> differs between hosts)")


def fetch(tree):
    """Host numpy copies of the arrays of `tree`, also of global arrays that span other
    processes' devices (gathered; every process must call it)."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


class ShardedScorer:
    """A reward scorer (`RewardPool`-like: `.score(responses, truths) -> (scores, stats)`,
    `.close()`) whose work is split over processes: each scores its `process_rows` and every
    process gets all scores and the summed stats. With one process it is the pool itself."""

    def __init__(self, pool):
        self.pool = pool

    def score(self, responses, ground_truths, **kwargs):
        if jax.process_count() == 1:
            return self.pool.score(responses, ground_truths, **kwargs)
        responses, ground_truths = list(responses), list(ground_truths)
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        n = len(responses)
        mine = process_rows(n)
        scores, stats = self.pool.score(responses[mine], ground_truths[mine], **kwargs)
        keys = sorted(stats)
        counts = gather(np.asarray([stats[k] for k in keys], np.int64)).sum(axis=0)
        return (gather_rows(np.asarray(scores, np.float32), n),
                {k: int(c) for k, c in zip(keys, counts)})

    __call__ = score

    def close(self) -> None:
        self.pool.close()
