"""A run's pieces from its config: the task, the policy model at its starting point, the
training examples, the one initial `TrainState` (parameters, optimiser, SAGE tables) and the
rollout engine. Tasks come from `tasks.registry`; nothing here knows a task by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sage_jax import config as config_lib, models
from sage_jax.config import Config, RolloutConfig
from sage_jax.engine.trainer import update
from sage_jax.engine.trainer.state import TrainState
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
    `model.remat` (the plug-ins read it from `cfg`), and given fresh adapters with
    model.lora.rank > 0 (`models.with_lora`, drawn from train.seed)."""
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
    lora = models.LoraSpec.of(cfg.model.lora, cfg.train.seed)
    return model if lora is None else models.with_lora(model, lora)


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
        vllm_engine.check(cfg)
        assert cfg.model.path is not None  # the check requires one
        return engine_named("vllm", dims, graphdef, params, task,
                            folder=models.hub.resolve(cfg.model.path), rollout=cfg.rollout,
                            dtype=cfg.model.compute_dtype, seed=cfg.train.seed,
                            max_len=max(update.row_len(cfg), cfg.hint.max_request_tokens
                                        + cfg.hint.max_new_tokens))
    return engine_named("native", dims, graphdef, params, task, mesh=mesh,
                        sampler=engines.SamplerSettings.of(cfg, dims.num_layers),
                        rollout=cfg.rollout)


def engine_named(name: str, dims: models.DecoderConfig, graphdef: nnx.GraphDef, params: Any,
                 task: Task, *, mesh: Mesh | None = None,
                 sampler: engines.SamplerSettings = engines.SamplerSettings(),
                 folder: Path | None = None, rollout: RolloutConfig = RolloutConfig(),
                 dtype: str = "bfloat16", max_len: int = 0, seed: int = 0) -> RolloutEngine:
    """The rollout engine `name` (`RolloutConfig.engine`'s values), synced to `params`: the one
    place that builds an engine. `native`: on `mesh` with `sampler`, a LoRA policy's adapters
    folded into its kernels at each sync with `rollout.lora_merged` (else run in place);
    `vllm`: started from the Hugging Face model `folder` with `rollout.vllm_memory`, computing
    in `dtype`, for sequences up to `max_len` tokens, seeded with `seed` (it always gets the
    merged kernels)."""
    if name == "native":
        return engines.NativeEngine(graphdef, params, eos_ids=task.eos_ids, pad_id=task.pad_id,
                                    mesh=mesh, settings=sampler,
                                    merge_lora=rollout.lora_merged)
    if name == "vllm":
        if folder is None:
            raise config_lib.ConfigError(
                "the vLLM engine starts from a Hugging Face model folder (model.path), and "
                "there is none: use the native engine", key="rollout.engine")
        engine = vllm_engine.VllmEngine(folder, dims, graphdef, dtype=dtype,
                                        memory=rollout.vllm_memory, max_len=max_len,
                                        eos_ids=task.eos_ids, pad_id=task.pad_id, seed=seed)
        engine.sync(params)
        return engine
    raise config_lib.ConfigError(f"unknown rollout engine {name!r}", key="rollout.engine")
