"""A trained policy back from a run folder: the run's config, the model built from its model
config alone, and the checkpoint's parameters (nothing else is read: no training examples, no
optimiser, no warm start). A LoRA run's checkpoint holds the adapters only: its policy is the
run's base model (`build.load_model`, warm start included) with them, and the base must be the
one the adapters were trained on (`base_record`, `check_base`)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from sage_jax.infra import checkpoint
from sage_jax import config as config_lib, models
from sage_jax.config import Config
from sage_jax.engine.trainer.state import trainable_split
from sage_jax.run import build
from sage_jax.tasks import registry

BASE_KEY = "lora_base"  # a LoRA checkpoint's `extra`: the frozen base it was trained on


def split_checkpoint_path(path: str | Path) -> tuple[Path, int | None]:
    """(run folder, step or None for the latest) of `WORKDIR`, `WORKDIR/STEP` or
    `WORKDIR/checkpoints/STEP`."""
    path = Path(path)
    if (path / "config.yaml").is_file():
        return path, None
    if path.name.isdigit():
        parent = path.parent
        if parent.name == "checkpoints" and (parent.parent / "config.yaml").is_file():
            return parent.parent, int(path.name)
        if (parent / "config.yaml").is_file():
            return parent, int(path.name)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    raise FileNotFoundError(f"{path} is not a training run folder (no config.yaml): expected "
                            f"WORKDIR or WORKDIR/STEP of a `python -m sage_jax.train` run")


def model_config(cfg) -> models.DecoderConfig:
    """The architecture of the run's policy: model.path's config.json, else the task's built-in
    model."""
    if cfg.model.path:
        return models.DecoderConfig.from_hf_dir(models.check_model_dir(cfg.model.path))
    plugin = registry.plugin(cfg.task.name)
    if plugin.model_config is None:
        raise config_lib.ConfigError(f"task.name={cfg.task.name} needs model.path (a Hugging "
                                     f"Face folder)", key="model.path")
    return plugin.model_config(cfg)


def base_record(cfg: Config, params) -> dict:
    """A LoRA checkpoint's `extra` entry: the fingerprint of the frozen base in `params` (the
    model's parameters, adapters included) and the model.path it came from."""
    return {BASE_KEY: {"fingerprint": checkpoint.fingerprint(trainable_split(params)[1]),
                       "model_path": cfg.model.path}}


def check_base(extra: dict, now: dict, where: Path) -> None:
    """A one-line `CheckpointMismatchError` when the LoRA checkpoint at `where` (its `extra`)
    was trained on another base than `now` (`base_record` of the base at hand)."""
    saved, base = extra.get(BASE_KEY), now[BASE_KEY]
    if saved is None:
        raise checkpoint.CheckpointMismatchError(
            f"checkpoint {where} records no LoRA base (it was not saved by a LoRA run of this "
            f"version), so its adapters cannot be matched to model.path={base['model_path']!r}")
    if saved["fingerprint"] != base["fingerprint"]:
        raise checkpoint.CheckpointMismatchError(
            f"checkpoint {where} holds LoRA adapters of another base model: trained on "
            f"model.path={saved['model_path']!r} (base fingerprint "
            f"{saved['fingerprint'][:12]}), but model.path={base['model_path']!r} now gives "
            f"{base['fingerprint'][:12]}; use the base the run trained on")


def restore_policy(workdir: str | Path, step: int | None = None):
    """(cfg, model with the checkpoint's parameters in the run's model.dtype, step) from a
    training run folder (latest committed step by default); a LoRA run's model is its base
    (`build.load_model`) with the checkpoint's adapters (`models.merge_lora` folds them in),
    and a `CheckpointMismatchError` when the base is not the one they were trained on."""
    workdir = Path(workdir)
    cfg_file = workdir / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{workdir} is not a training run folder (no config.yaml)")
    cfg = registry.load_config(cfg_file, [], saved=True)
    dtype, cdtype = jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.compute_dtype)
    lora = cfg.model.lora.rank > 0
    ckpt = checkpoint.Checkpointer(workdir, keep=cfg.checkpoint.keep)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints")
        saved = ckpt.restore_subtree(step, "params")
        extra = ckpt.extra(step) if lora else {}
    finally:
        ckpt.close()
    where = ckpt.step_dir(step)
    if lora:
        graphdef, params = models.split(build.load_model(cfg))
        check_base(extra, base_record(cfg, params), where)
        adapters, base = trainable_split(params)
        return cfg, nnx.merge(graphdef, _fill(adapters, saved, where), base), step
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: models.Decoder(
        model_config(cfg), dtype=dtype, compute_dtype=cdtype, rngs=nnx.Rngs(0))))
    return cfg, nnx.merge(graphdef, _fill(abstract, saved, where)), step


def _fill(abstract, saved, where: Path):
    """`abstract` (an nnx.State of shapes, or of arrays to replace) with the values of `saved`
    (the checkpoint's params, as a nested dict), cast to the abstract dtypes; a missing, extra
    or mis-shaped tensor is a CheckpointError naming it."""
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]:
        keys = tuple(_key(k) for k in path)
        found[keys[:-1] if keys[-1] == "value" else keys] = leaf
    flat = dict(nnx.to_flat_state(abstract))
    names = lambda keys: ["/".join(map(str, k)) for k in sorted(keys, key=str)][:5]  # noqa: E731
    if set(flat) != set(found):
        raise checkpoint.CheckpointError(
            f"checkpoint {where}: its params do not fit the run's model (missing "
            f"{names(set(flat) - set(found))}, unexpected {names(set(found) - set(flat))})")
    for keys, var in flat.items():
        value = found[keys]
        if tuple(value.shape) != tuple(var.shape):
            raise checkpoint.CheckpointError(
                f"checkpoint {where}: tensor {'/'.join(map(str, keys))} has shape "
                f"{tuple(value.shape)}, the run's model expects {tuple(var.shape)}")
        var.set_value(jnp.asarray(value, var.dtype))
    return nnx.from_flat_state(flat)


def _key(k):
    k = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
    return int(k) if isinstance(k, str) and k.isdigit() else k
