"""The job behind `python -m sage_jax.train`: the task's default job where it has one (`JOBS`),
else the plain training run (`run.loop.train`)."""

from __future__ import annotations

from sage_jax.infra import compile_cache
from sage_jax.jobs import toy_job
from sage_jax.run import loop, vllm_engine

JOBS = {"toy": toy_job.run}  # task.name -> its default job (which falls back to loop.train itself)


def run(cfg, workdir) -> dict:
    """The training job of `cfg` in `workdir` (JAX's compilation cache in
    `train.compile_cache`); returns the last step's metrics."""
    vllm_engine.check(cfg)  # before a job's first work (the toy job's warm start)
    compile_cache.enable(cfg.train.compile_cache)
    return JOBS.get(cfg.task.name, loop.train)(cfg, workdir)
