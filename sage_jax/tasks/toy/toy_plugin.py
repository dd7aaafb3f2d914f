"""The toy task's plug-in record `PLUGIN` (see the package docstring)."""

from __future__ import annotations

from flax import nnx

from sage_jax import models
from sage_jax.tasks.base import TaskPlugin
from sage_jax.tasks.toy import chains as toy
from sage_jax.tasks.toy import warm_start
from sage_jax.tasks.toy.toy_config import ToyConfig


def make_task(cfg, model_path=None, system_prompt=None) -> toy.ToyTask:
    del model_path, system_prompt  # character-level prompts, no system message
    return warm_start.make_task(cfg)


def model_config(cfg) -> models.DecoderConfig:
    del cfg
    return toy.toy_model_config()


def make_model(cfg, dtype, compute_dtype) -> models.Decoder:
    """The SFT warm start when task.toy.warm_start, else a random init from train.seed."""
    if cfg.task.section(ToyConfig).warm_start:
        return warm_start.warm_started_model(cfg, dtype=dtype, compute_dtype=compute_dtype)
    return models.Decoder(toy.toy_model_config(), dtype=dtype, compute_dtype=compute_dtype,
                          rngs=nnx.Rngs(cfg.train.seed), remat=cfg.model.remat)


def examples(cfg) -> list:
    """task.toy.problems training problems on the run's lengths (seed 0)."""
    return toy.make_examples(cfg.task.section(ToyConfig).problems, warm_start.spec(cfg), seed=0)


def eval_problems(cfg, limit: int | None) -> dict:
    """The held-out problems of the run's lengths (task.toy.eval_per_length per length; the
    first `limit`), the toy job's evaluation set."""
    return toy.eval_problems(cfg.task.section(ToyConfig).eval_per_length, warm_start.spec(cfg),
                             limit=limit)


PLUGIN = TaskPlugin(name="toy", make_task=make_task, model_config=model_config,
                    make_model=make_model, examples=examples, config=ToyConfig,
                    eval_problems=eval_problems)
