"""Jobs: what a command runs around the library. `run(cfg, workdir)` is `python -m sage_jax.train`:
the task's default job where it has one (`JOBS`), else the plain training run."""

from __future__ import annotations

from sage_jax.jobs import toy
from sage_jax.run import loop

JOBS = {"toy": toy.run}  # task.name -> its default job (which falls back to loop.train itself)


def run(cfg, workdir) -> dict:
    """The training job of `cfg` in `workdir`; returns the last step's metrics."""
    return JOBS.get(cfg.task.name, loop.train)(cfg, workdir)
