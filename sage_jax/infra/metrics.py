"""Training metrics: a JSONL file, TensorBoard (when installed), a progress bar, and timers.

Files under ``workdir``:
  * ``metrics.jsonl``: one JSON object per logged step, ``{"step": s, "<name>": value, ...}``.
    Values are plain JSON numbers (jax/numpy scalars are converted); non-finite floats (NaN, +-inf)
    are written as ``null`` so the file is standard JSON that any tool reads, and `read_metrics`
    turns ``null`` back into ``float("nan")``.
  * ``samples.jsonl``: one JSON object per sample record, ``{"step": s, **record}``.
  * ``groups.jsonl``: one JSON object per step with per-prompt lists (dataset ids, first-pass
    status, hint level, resolved), ``{"step": s, **record}``: each prompt's history over visits.

Only the main process (``is_main=True``, i.e. ``jax.process_index() == 0``) writes anything; on
other processes every method is a no-op, so callers need no ``if``.

Resuming: ``MetricsLogger(..., resume_step=k)`` drops the lines with ``step > k`` (and any torn
last line of a crashed run) from both files before appending, so after a resume from the checkpoint
of step ``k`` every step appears exactly once. Pass ``resume_step=0`` for a fresh start in a workdir
that already has metrics; ``None`` (default) appends without touching the files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

__all__ = ["MetricsLogger", "Timer", "read_metrics", "to_json_value"]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
GROUPS_FILE = "groups.jsonl"

# Progress-bar fields: (metric name, short label, format).
_BAR_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("collapse/frac_all_zero", "collapse", "{:.2f}"),
    ("throughput/tokens_per_s", "tok/s", "{:.0f}"),
)


def to_json_value(value: Any, *, name: str = "value") -> Any:
    """Converts a metric value (python/numpy/jax scalar, 0-d or 1-element array, str) to JSON.

    Non-finite floats become None (JSON null). Raises ValueError naming ``name`` for arrays with
    more than one element and for unsupported types.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if not isinstance(value, (int, float, np.generic)):
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise ValueError(f"metric {name!r}: unsupported type {type(value).__name__}")
        arr = np.asarray(value)  # works for jax arrays (pulls the value to the host)
        if arr.size != 1:
            raise ValueError(f"metric {name!r} must be a scalar, got an array of shape {arr.shape}")
        value = arr.reshape(()).item()
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise ValueError(f"metric {name!r}: unsupported type {type(value).__name__}")


def _nan_for_null(obj: dict) -> dict:
    return {k: (float("nan") if v is None else v) for k, v in obj.items()}


def read_metrics(path: str | Path) -> list[dict]:
    """Reads a ``metrics.jsonl`` (or the workdir holding one) into a list of dicts.

    ``null`` values come back as ``float("nan")``. A torn last line (a crash mid-write) is skipped
    with a warning; a malformed line elsewhere raises ValueError naming the file and line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    rows, lines = [], path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                log.warning("%s: skipping torn last line %d", path, i)
                continue
            raise ValueError(f"{path}:{i}: not a JSON object: {e}") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}")
        rows.append(_nan_for_null(obj))
    return rows


def _truncate_jsonl(path: Path, resume_step: int) -> None:
    """Keeps the lines of ``path`` whose "step" is <= resume_step; rewrites atomically."""
    if not path.exists():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
            step = obj["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            dropped += 1  # torn or foreign line
            continue
        if step <= resume_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        log.info("%s: dropping %d line(s) after resume step %d", path, dropped, resume_step)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _tensorboard_writer(logdir: Path) -> Any | None:
    """A SummaryWriter from tensorboardX or torch.utils.tensorboard, or None if neither works."""
    for module in ("tensorboardX", "torch.utils.tensorboard"):
        try:
            mod = __import__(module, fromlist=["SummaryWriter"])
            return mod.SummaryWriter(str(logdir))
        except Exception:  # not installed (torch's needs the tensorboard package) or broken
            continue
    return None


class MetricsLogger:
    """Writes per-step metrics to ``workdir/metrics.jsonl``, TensorBoard and a tqdm progress bar.

    Args:
      workdir: run directory (created if missing).
      total_steps: number of training steps, for the progress bar's ETA.
      is_main: only the main process writes (pass ``jax.process_index() == 0``).
      tensorboard: write TensorBoard scalars to ``workdir/tb`` if tensorboardX or
        torch.utils.tensorboard is importable; ``self.tb`` is the writer or None.
      resume_step: drop logged steps after this one (see module docstring).
      progress: show the progress bar (to ``stream``, default stderr; works without a TTY).
      console_every: also print a one-line summary every this many steps (0: never).
      wandb_run: a `wandb_log.WandbRun` that gets every row too (finished by `close`).
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        total_steps: int,
        is_main: bool = True,
        tensorboard: bool = True,
        resume_step: int | None = None,
        progress: bool = True,
        console_every: int = 0,
        stream: IO[str] | None = None,
        wandb_run: Any = None,
    ):
        self.workdir = Path(workdir)
        self.total_steps = int(total_steps)
        self.is_main = bool(is_main)
        self.console_every = int(console_every)
        self.metrics_path = self.workdir / METRICS_FILE
        self.samples_path = self.workdir / SAMPLES_FILE
        self.groups_path = self.workdir / GROUPS_FILE
        self.tb = None
        self.bar = None
        self.wandb_run = wandb_run if is_main else None
        self._metrics_f: IO[str] | None = None
        self._samples_f: IO[str] | None = None
        self._groups_f: IO[str] | None = None
        self._last_step = 0 if resume_step is None else int(resume_step)
        if not self.is_main:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            _truncate_jsonl(self.metrics_path, int(resume_step))
            _truncate_jsonl(self.samples_path, int(resume_step))
            _truncate_jsonl(self.groups_path, int(resume_step))
        self._metrics_f = open(self.metrics_path, "a", encoding="utf-8")
        if tensorboard:
            self.tb = _tensorboard_writer(self.workdir / "tb")
        if progress:
            self.bar = tqdm(
                total=self.total_steps,
                initial=min(self._last_step, self.total_steps),
                desc="train",
                unit="step",
                file=stream if stream is not None else sys.stderr,
                dynamic_ncols=True,
                mininterval=0.5,
            )

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Records ``metrics`` for ``step``; returns the JSON-ready dict that was written."""
        step = int(step)
        row = {"step": step}
        for k, v in metrics.items():
            if k == "step":
                raise ValueError("metric name 'step' is reserved")
            row[str(k)] = to_json_value(v, name=k)
        if not self.is_main:
            return row
        self._metrics_f.write(json.dumps(row, allow_nan=False) + "\n")
        self._metrics_f.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(step, row)
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)
        if self.bar is not None:
            self.bar.update(max(0, min(step, self.total_steps) - self.bar.n))
            self.bar.set_postfix_str(self._summary(row), refresh=False)
        if self.console_every and step % self.console_every == 0:
            self._write_line(f"step {step}/{self.total_steps} " + self._summary(row))
        self._last_step = step
        return row

    @staticmethod
    def _summary(row: Mapping[str, Any]) -> str:
        parts = []
        for key, label, fmt in _BAR_FIELDS:
            v = row.get(key)
            if v is None and key in row:
                parts.append(f"{label}=nan")
            elif isinstance(v, (int, float)):
                parts.append(f"{label}={fmt.format(v)}")
        return " ".join(parts)

    def _write_line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.bar.fp)
        else:
            print(text, file=sys.stderr, flush=True)

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Appends ``{"step": step, **record}`` per record to ``workdir/samples.jsonl``."""
        if not self.is_main:
            return
        if self._samples_f is None:
            self._samples_f = open(self.samples_path, "a", encoding="utf-8")
        for i, rec in enumerate(records):
            row = {"step": int(step)}
            for k, v in rec.items():
                if isinstance(v, (list, tuple, dict)):
                    row[k] = v  # must already be JSON (token ids, nested info)
                else:
                    row[k] = to_json_value(v, name=f"samples[{i}].{k}")
            try:
                line = json.dumps(row, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"sample record {i} of step {step} is not JSON-serialisable: {e}") from e
            self._samples_f.write(line + "\n")
        self._samples_f.flush()

    def log_groups(self, step: int, record: Mapping[str, list]) -> None:
        """Appends ``{"step": step, **record}`` (lists of JSON numbers) to ``groups.jsonl``."""
        if not self.is_main:
            return
        if self._groups_f is None:
            self._groups_f = open(self.groups_path, "a", encoding="utf-8")
        row = {"step": int(step), **{k: [to_json_value(x, name=k) for x in v]
                                     for k, v in record.items()}}
        self._groups_f.write(json.dumps(row, allow_nan=False) + "\n")
        self._groups_f.flush()

    def close(self) -> None:
        for f in (self._metrics_f, self._samples_f, self._groups_f):
            if f is not None:
                f.close()
        self._metrics_f = self._samples_f = self._groups_f = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Timer:
    """Wall-clock timers for ``time/<name>_s`` metrics.

    Usage::

        timer = Timer()
        with timer("sample"):
            out = sample(...)
            jax.block_until_ready(out)   # JAX is asynchronous: block inside the timed region
        logger.log(step, {**other, **timer.metrics()})

    Repeated sections with the same name add up until `metrics` (which resets by default).
    """

    def __init__(self) -> None:
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] += time.perf_counter() - start

    def metrics(self, *, reset: bool = True) -> dict[str, float]:
        out = {f"time/{name}_s": total for name, total in self._totals.items()}
        if reset:
            self._totals.clear()
        return out
