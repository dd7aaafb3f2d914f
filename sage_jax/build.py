"""Build a run's pieces from its config: the policy model, its task and its training data;
and rebuild a trained policy from a run folder's checkpoint."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from sage_jax import checkpoint, config as config_lib, models, parallel, rollout, update
from sage_jax.tasks import data as data_lib


def load_task(cfg, model_path: str | None = None):
    """The task of `cfg.task.name` (math: chat prompts with the model folder's tokenizer)."""
    if cfg.task.name == "toy":
        from sage_jax.tasks import toy
        return toy.ToyTask()
    from sage_jax.tasks.math import MathTask
    path = model_path or cfg.model.path
    if not path:
        raise config_lib.ConfigError("task.name=math needs model.path (a Hugging Face folder)",
                                     key="model.path")
    return MathTask(models.Tokenizer(path))


def load_model(cfg) -> models.Decoder:
    """The policy at its starting point: model.path, or the built-in toy model (its SFT warm
    start when task.toy.warm_start, else randomly initialised); `model.remat` set on it."""
    model = _load_weights(cfg)
    model.remat = cfg.model.remat  # recompute each layer in the backward pass (a static flag)
    return model


def _load_weights(cfg) -> models.Decoder:
    dtype, cdtype = jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.compute_dtype)
    if cfg.model.path:
        return models.from_hf(cfg.model.path, dtype=dtype, compute_dtype=cdtype)
    if cfg.task.name != "toy":
        raise config_lib.ConfigError("task.name=math needs model.path (a Hugging Face folder)",
                                     key="model.path")
    from sage_jax.tasks import toy, toy_job
    if cfg.task.toy.warm_start:
        return toy_job.warm_started_model(cfg, dtype=dtype, compute_dtype=cdtype)
    return models.Decoder(toy.toy_model_config(), dtype=dtype, compute_dtype=cdtype,
                          rngs=nnx.Rngs(cfg.train.seed))


def load_examples(cfg, task):
    """(training examples, stats): data.train_files, or the toy task's built-in problems."""
    if cfg.task.name == "toy" and not cfg.data.train_files:
        from sage_jax.tasks import toy, toy_job
        examples = toy.make_examples(cfg.task.toy.problems, toy_job.spec(cfg), seed=0)
        return examples, {"examples": len(examples), "source": "built-in toy problems"}
    return data_lib.load_examples(cfg.data,
                                  count_tokens=lambda problem: len(task.answer_prompt(problem)))


def restore_policy(workdir: str | Path, step: int | None = None):
    """(cfg, model with the checkpoint's parameters, step) from a training run folder."""
    workdir = Path(workdir)
    cfg_file = workdir / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{workdir} is not a training run folder (no config.yaml)")
    cfg = config_lib.load_config(cfg_file, [])
    task = load_task(cfg)
    model = load_model(cfg)
    examples, _ = load_examples(cfg, task)
    mesh = parallel.make_mesh(cfg.mesh)
    _, state = update.init_train_state(model, cfg, mesh)  # the restore target's structure
    state = state.replace(
        sage=rollout.SageTables.empty(len(examples), cfg.hint.cache_bytes).as_dict())
    ckpt = checkpoint.Checkpointer(workdir, keep=cfg.checkpoint.keep)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints")
        state, _ = ckpt.restore(step, target=state)
    finally:
        ckpt.close()
    params = jax.tree.map(lambda p, ref: p.astype(ref.dtype), state.params,
                          nnx.state(model, nnx.Param))
    nnx.update(model, params)
    return cfg, model, step
