"""Weights & Biases logging (`logging.wandb: true`): the scalars of each metrics.jsonl row, the
run's effective config, and at the end of the toy job its summary table and plot.

The run's W&B id is kept in the run folder (`wandb_id.txt`), so a resumed run continues the same
W&B run; W&B files go under the run folder (`wandb/`). The standard `WANDB_*` variables apply
(`WANDB_API_KEY`, `WANDB_MODE`, `WANDB_DIR`, ...); `logging.mode` overrides `WANDB_MODE`. Only
the main process logs. `wandb` is an optional dependency (`pip install wandb`).
"""

from __future__ import annotations

import datetime
import importlib.util
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from sage_jax.config import ConfigError

ID_FILE = "wandb_id.txt"


def require() -> None:
    """A ConfigError naming logging.wandb when the wandb package is not installed."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true needs the wandb package (pip install wandb), "
                          "which is not installed", key="logging.wandb")


class WandbRun:
    """One W&B run of a run folder: started, or resumed with the id kept there."""

    def __init__(self, workdir: str | Path, settings, config: Mapping[str, Any] | None = None):
        require()
        import wandb  # optional dependency, checked above

        workdir = Path(workdir)
        id_file = workdir / ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        _wait_for_a_new_offline_folder(workdir, run_id)
        self.run = wandb.init(
            project=settings.project, entity=settings.entity,
            name=settings.name or workdir.name, tags=list(settings.tags) or None,
            mode=settings.mode, dir=str(workdir), id=run_id, resume="allow",
            config=dict(config or {}))
        self._wandb = wandb

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        """The numeric values of a metrics.jsonl row (NaN rows hold None: left out) at `step`."""
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        self.run.log(scalars, step=int(step))

    def log_summary(self, table: list[dict[str, Any]], image: Path | None = None) -> None:
        """A table (rows of equal keys) and an image, e.g. the toy job's accuracy by length, into
        the run's summary (not its step history)."""
        payload: dict[str, Any] = {}
        if table:
            columns = list(table[0])
            payload["summary/table"] = self._wandb.Table(
                columns=columns, data=[[r.get(c) for c in columns] for r in table])
        if image is not None and Path(image).is_file():
            payload["summary/plot"] = self._wandb.Image(str(image))
        if payload:
            self.run.summary.update(payload)

    def finish(self) -> None:
        self.run.finish()


def _wait_for_a_new_offline_folder(workdir: Path, run_id: str) -> None:
    """W&B names an offline run's folder by its start second and id: the same run started again
    within that second (a short resumed job, then its summary) would write over the first
    folder's file and lose its history, so this waits for the next second."""
    def taken() -> bool:
        names = {f"offline-run-{t.strftime('%Y%m%d_%H%M%S')}-{run_id}"
                 for t in (datetime.datetime.now(), datetime.datetime.now(datetime.timezone.utc))}
        return any((workdir / "wandb" / n).exists() for n in names)

    for _ in range(40):  # at most 2 s
        if not taken():
            return
        time.sleep(0.05)
