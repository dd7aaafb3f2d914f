"""A run's pieces from its config: the task, the policy model at its starting point, the
training examples, the one initial `TrainState` (parameters, optimiser, SAGE tables) and the
rollout engine. Tasks come from `tasks.registry`; nothing here knows a task by name."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sage_jax import config as config_lib, models
from sage_jax.config import Config
from sage_jax.engine import programs, update
from sage_jax.engine.state import TrainState
from sage_jax.rl import engines
from sage_jax.rl.types import RolloutEngine, SageTables
from sage_jax.run import vllm_engine
from sage_jax.tasks import data as data_lib, registry
from sage_jax.tasks.base import Task
from sage_jax.tasks.data import Example


def load_task(cfg: Config, model_path: str | None = None) -> Task:
    """The task of `cfg.task.name`, its prompts through the tokenizer of `model_path` (default
    model.path) where the task uses one."""
    return registry.plugin(cfg.task.name).make_task(cfg, model_path, None)


def load_model(cfg: Config) -> models.Decoder:
    """The policy at its starting point: model.path (through the task's `start_from`, e.g. a
    warm start, where it has one), else the task's built-in model; each built with
    `model.remat` (the plug-ins read it from `cfg`)."""
    dtype, cdtype = jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.compute_dtype)
    plugin = registry.plugin(cfg.task.name)
    if cfg.model.path and plugin.start_from is not None:
        model = plugin.start_from(cfg, dtype, cdtype)
    elif cfg.model.path:
        model = models.from_hf(cfg.model.path, dtype=dtype, compute_dtype=cdtype,
                               remat=cfg.model.remat)
    else:
        if plugin.make_model is None:
            raise config_lib.ConfigError(f"task.name={cfg.task.name} needs model.path (a "
                                         f"Hugging Face folder)", key="model.path")
        model = plugin.make_model(cfg, dtype, cdtype)
    if model.remat != cfg.model.remat:
        raise config_lib.ConfigError(f"task {cfg.task.name!r} built its model without "
                                     f"model.remat={cfg.model.remat}", key="model.remat")
    return model


def model_dims(cfg: Config) -> models.DecoderConfig:
    """The policy's dimensions without its weights: model.path's config.json (of a hub id,
    that file alone is fetched), else the task's built-in model's."""
    if cfg.model.path:
        return models.DecoderConfig.from_hf_dir(models.hub.resolve(cfg.model.path,
                                                                 config_only=True))
    return load_model(cfg).cfg


def load_examples(cfg: Config, task: Task) -> tuple[list[Example], dict[str, Any]]:
    """(training examples, stats): data.train_files, else the task's built-in examples."""
    plugin = registry.plugin(cfg.task.name)
    if not cfg.data.train_files and plugin.examples is not None:
        examples = plugin.examples(cfg)
        too_long = [e for e in examples
                    if len(task.answer_prompt(e.problem)) > cfg.data.max_prompt_tokens]
        if too_long:  # the rollout's rows are only data.max_prompt_tokens wide
            raise config_lib.ConfigError(
                f"{len(too_long)} of the {len(examples)} built-in {cfg.task.name} problems have "
                f"prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens} "
                f"(the longest: {max(len(task.answer_prompt(e.problem)) for e in too_long)} "
                f"tokens); raise it", key="data.max_prompt_tokens")
        return examples, {"examples": len(examples),
                          "source": f"built-in {cfg.task.name} problems"}
    return data_lib.load_examples(cfg.data,
                                  count_tokens=lambda problem: len(task.answer_prompt(problem)))


def initial_state(model: models.Decoder, cfg: Config, mesh: Mesh, num_examples: int
                  ) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, TrainState at step 0): the model's parameters and optimiser state placed on
    `mesh`, and empty SAGE tables for `num_examples` training prompts."""
    graphdef, state = update.init_train_state(model, update.UpdateSettings.of(cfg), mesh)
    tables = SageTables.empty(num_examples, cfg.hint.cache_bytes)
    return graphdef, state.replace(sage=tables.arrays())


def check_rollout_engine(cfg: Config) -> None:
    """A one-line `ConfigError` when `rollout.engine` cannot sample in this process (before any
    work)."""
    vllm_engine.check(cfg)


def rollout_engine(cfg: Config, dims: models.DecoderConfig, graphdef: nnx.GraphDef,
                   params: Any, task: Task, mesh: Mesh | None = None) -> RolloutEngine:
    """The run's `rollout.engine`, synced to `params` (the policy of `graphdef`, of `dims`,
    placed on `mesh`): `native` samples them where they are; `vllm` starts vLLM from
    model.path."""
    if cfg.rollout.engine == "vllm":
        return vllm_engine.build(cfg, dims, graphdef, params, task.eos_ids, task.pad_id)
    kept = (programs.budget(dims.num_layers) if cfg.rollout.programs_kept is None
            else cfg.rollout.programs_kept)
    return engines.NativeEngine(graphdef, params, eos_ids=task.eos_ids, pad_id=task.pad_id,
                                mesh=mesh, max_rows=cfg.rollout.micro_batch_size,
                                continuous=cfg.rollout.continuous_batching, programs_kept=kept)
