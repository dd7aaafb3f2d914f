"""A reward registry, and a process pool that runs reward functions safely.

A reward function has the signature ``fn(response: str, ground_truth: str) -> float``. Functions go
to worker processes by reference, so they must be picklable: defined at module level (not a lambda,
closure or bound method of an unpicklable object). A function may raise; `RewardPool` turns any
exception, and any answer that runs past its deadline, into a 0.0 score and counts it; raising
`RewardTimeout` or `RewardRejected` gets the answer counted as a timeout or a refusal. Tasks bring
their own rewards (the paper's math reward is `tasks/math_grading.py`, registered as "math").
"""

from __future__ import annotations

import importlib
import math
import multiprocessing as mp
import os
import pickle
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

RewardFn = Callable[[str, str], float]


class RewardTimeout(TimeoutError):
    """The checker ran out of time, so the answer could not be judged."""


class RewardRejected(ValueError):
    """The answer was refused before checking (e.g. an absurdly long boxed expression)."""


# ----------------------------------------------------------------------------- registry

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str, fn: RewardFn, *, overwrite: bool = False) -> None:
    """Make `fn(response, ground_truth) -> float` available as `name`.

    `fn` must be picklable (a module-level function) because it runs in worker processes.
    """
    if not callable(fn):
        raise TypeError(f"reward {name!r} is not callable: {fn!r}")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise TypeError(f"reward {name!r} must be picklable (a module-level function): {e}") from e
    if name in _REGISTRY and _REGISTRY[name] is not fn and not overwrite:
        raise ValueError(f"reward {name!r} is already registered; pass overwrite=True to replace")
    _REGISTRY[name] = fn


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name`."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY)}") from None


# ----------------------------------------------------------------------------- worker pool


def _worker_main(conn: Connection, memory_limit_mb: int | None,
                 preload: str | None = None) -> None:
    """Worker loop: receive (fn, response, ground_truth), send (status, score).

    `preload`: the reward function's module, imported before the worker reports ready, so a
    heavy import (the toy task's pulls in jax) never counts against the first answer's timeout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and shuts us down
    if memory_limit_mb is not None:
        import resource

        limit = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    if preload:
        try:
            importlib.import_module(preload)
        except Exception:  # noqa: BLE001 - unpickling the task will report it, as before
            pass
    conn.send(("ready", 0.0))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        fn, response, ground_truth = task
        try:
            value = float(fn(response, ground_truth))
            reply = ("ok", value) if math.isfinite(value) else ("errors", 0.0)
        except TimeoutError:
            reply = ("timeouts", 0.0)
        except RewardRejected:
            reply = ("rejected", 0.0)
        except BaseException:  # noqa: BLE001 - any failure of a reward is a counted zero
            reply = ("errors", 0.0)
        conn.send(reply)


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0


def _default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


# What scores a batch: (responses, ground truths) -> (rewards [N], counts of how scoring went),
# e.g. `RewardPool.score`.
Scorer = Callable[[Sequence[str], Sequence[str]], "tuple[np.ndarray, dict[str, int]]"]


class RewardPool:
    """Persistent worker processes that score (response, ground truth) pairs with hard timeouts.

    Each answer gets `timeout_s` seconds from dispatch; a worker that overruns is killed and
    replaced. Timeouts, exceptions, worker crashes and refused inputs all score 0.0 and are counted
    in the stats returned by `score`; nothing from a reward function is ever raised. Pairs with
    more than `max_chars` characters are refused without being sent to a worker. Use as a context
    manager or call `close()`. Not thread-safe. Workers start with 'forkserver' (else 'spawn'),
    so a script that creates a pool needs the usual ``if __name__ == "__main__":`` guard.
    """

    def __init__(self, fn: RewardFn | str, *, num_workers: int | None = None,
                 timeout_s: float = 5.0, max_chars: int | None = 1_000_000,
                 memory_limit_mb: int | None = 4096, start_method: str | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.fn = self._resolve(fn)
        self.num_workers = num_workers or _default_workers()
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.memory_limit_mb = memory_limit_mb
        if start_method is None:
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload([__name__])
        self._workers: list[_Worker] = []
        self._closed = False
        for _ in range(self.num_workers):
            self._workers.append(self._start_worker())

    @staticmethod
    def _resolve(fn: RewardFn | str) -> RewardFn:
        return get_reward(fn) if isinstance(fn, str) else fn

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        preload = getattr(self.fn, "__module__", None)
        process = self._ctx.Process(target=_worker_main,
                                    args=(child, self.memory_limit_mb, preload),
                                    daemon=True, name="sage-reward-worker")
        process.start()
        child.close()
        return _Worker(process, parent)

    def _replace(self, slot: int) -> None:
        old = self._workers[slot]
        if old.process.is_alive():
            old.process.kill()
        old.process.join(timeout=5)
        old.conn.close()
        self._workers[slot] = self._start_worker()

    def warm_up(self, timeout_s: float = 120.0) -> None:
        """Waits until every worker has imported the reward's module (a task's may pull in jax),
        by scoring one empty answer per worker, so that the import does not eat the timeout of
        the first real answers."""
        n = 2 * self.num_workers
        self.score([""] * n, [""] * n, timeout_s=max(timeout_s, self.timeout_s))

    def score(self, responses: Sequence[str], ground_truths: Sequence[str], *,
              fn: RewardFn | str | None = None,
              timeout_s: float | None = None) -> tuple[np.ndarray, dict[str, int]]:
        """Scores[N] (float32) for the pairs, and counts: n, timeouts, killed, errors, rejected.

        `killed` counts the timeouts that needed a worker to be killed (a subset of `timeouts`).
        """
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        fn = self.fn if fn is None else self._resolve(fn)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self._score(responses, ground_truths, fn, timeout_s)
        except BaseException:  # e.g. Ctrl-C: drop busy workers so no stale reply leaks later
            for slot, w in enumerate(self._workers):
                if w.task is not None:
                    self._replace(slot)
            raise

    def _score(self, responses: Sequence[str], ground_truths: Sequence[str], fn: RewardFn,
               timeout_s: float) -> tuple[np.ndarray, dict[str, int]]:
        n = len(responses)
        scores = np.zeros(n, np.float32)
        stats = {"n": n, "timeouts": 0, "killed": 0, "errors": 0, "rejected": 0}
        todo: deque[int] = deque()
        for i, (response, truth) in enumerate(zip(responses, ground_truths)):
            if not isinstance(response, str) or not isinstance(truth, str):
                stats["errors"] += 1
            elif self.max_chars is not None and len(response) + len(truth) > self.max_chars:
                stats["rejected"] += 1
            else:
                todo.append(i)
        startup_failures = 0
        while todo or any(w.task is not None for w in self._workers):
            for slot, w in enumerate(self._workers):
                if w.ready and w.task is None and todo:
                    i = todo.popleft()
                    try:
                        w.conn.send((fn, responses[i], ground_truths[i]))
                    except (BrokenPipeError, OSError):
                        todo.appendleft(i)
                        self._replace(slot)
                        continue
                    w.task, w.deadline = i, time.monotonic() + timeout_s
            busy = [w.deadline for w in self._workers if w.task is not None]
            wait_s = max(0.0, min(busy) - time.monotonic()) if busy else 60.0
            waiting = {w.conn: slot for slot, w in enumerate(self._workers)
                       if w.task is not None or not w.ready}
            events = wait(list(waiting), wait_s)
            if not events and not busy:
                raise RuntimeError("reward workers did not start within 60 s")
            for conn in events:
                slot = waiting[conn]
                w = self._workers[slot]
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):  # the worker died (crash, out of memory, ...)
                    if w.task is None:
                        startup_failures += 1
                        if startup_failures > 3 * self.num_workers:
                            raise RuntimeError("reward workers keep dying at start-up") from None
                    else:
                        stats["errors"] += 1
                    self._replace(slot)
                    continue
                if status == "ready":
                    w.ready = True
                    continue
                if status == "ok":
                    scores[w.task] = value
                else:
                    stats[status] += 1
                w.task = None
            now = time.monotonic()
            for slot, w in enumerate(self._workers):
                if w.task is not None and now >= w.deadline:
                    stats["timeouts"] += 1
                    stats["killed"] += 1
                    self._replace(slot)
        return scores, stats

    def close(self) -> None:
        """Stop all workers. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for w in self._workers:
            try:
                if w.task is None:
                    w.conn.send(None)
                else:
                    w.process.kill()
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=2)
            w.conn.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

