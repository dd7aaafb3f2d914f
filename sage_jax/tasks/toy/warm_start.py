"""The toy model's SFT warm start: `warm_started_model(cfg)` is the toy task's built-in model
(what `run.build.load_model` returns with no model.path and task.toy.warm_start), the toy model
after `calibrate.warm_start`. It comes from, in order:
- a checkpoint shipped with the package, when it was made with the run's warm-start settings:
  `PACKAGED` (configs/toy_uniform.yaml's) or `PACKAGED_TAIL` (configs/toy_tail.yaml's and the
  default configs/toy.yaml's), each a copy
  of the cache folder below;
- the cache, a Hugging Face folder under `task.toy.cache_dir` (default $SAGE_JAX_CACHE or
  ~/.cache/sage_jax), keyed by everything that shapes the warm start;
- a fresh SFT, then cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from sage_jax import models
from sage_jax.tasks.toy import chains as toy
from sage_jax.tasks.toy import calibrate
from sage_jax.tasks.toy.toy_config import ToyConfig

DESIGN_VERSION = 5  # bump when the toy task's formats or the SFT recipe change
PACKAGED = Path(__file__).with_name("toy_sft")  # the shipped warm starts (module docstring)
PACKAGED_TAIL = Path(__file__).with_name("toy_tail_sft")


def spec(cfg) -> toy.ToySpec:
    """The RL / evaluation problems of the run (lengths, and the hard split's rare operands)."""
    t = cfg.task.section(ToyConfig)
    return toy.ToySpec(t.min_steps, t.max_steps, rare_operands=tuple(t.rare_operands),
                       rare_share=t.rare_share, rare_min_steps=t.rare_min_steps)


def sft_spec(cfg) -> toy.ToySpec:
    """The warm start's SFT problems: every length up to the run's longest, rare operands in
    `task.toy.sft_rare_share` of them."""
    t = cfg.task.section(ToyConfig)
    return toy.ToySpec(1, t.max_steps, rare_operands=tuple(t.rare_operands),
                       rare_share=t.sft_rare_share)


def make_task(cfg) -> toy.ToyTask:
    """The toy task in the run's hint format."""
    t = cfg.task.section(ToyConfig)
    return toy.ToyTask(hint_format=t.hint_format, max_steps=t.max_steps)


def sft_mix(cfg) -> toy.SFTMix:
    write = cfg.task.section(ToyConfig).sft_write_share
    return toy.SFTMix(plain=0.5 * (1 - write) / 0.9, hinted=0.4 * (1 - write) / 0.9, write=write)


LEVEL_REQUEST_VERSION = 2  # bump when the one-level hint request's format changes
# Settings that shape the warm start only when set; left out at their defaults, so the shipped
# checkpoint's settings (made before they existed) still match a default run.
_OPTIONAL = {"rare_operands": (), "sft_rare_share": 0.0, "hint_format": "payload",
             "sft_write_share": 0.1, "sft_target_write_prob": 0.0}


def cache_root(cfg) -> Path:
    root = (cfg.task.section(ToyConfig).cache_dir or os.environ.get("SAGE_JAX_CACHE")
            or "~/.cache/sage_jax")
    return Path(root).expanduser()


def warm_start_settings(cfg) -> dict:
    t = cfg.task.section(ToyConfig)
    return {"design": DESIGN_VERSION, "seed": t.sft_seed, "sft_steps": t.sft_steps,
            "target_step_acc": t.sft_target_step_acc, "sft_max_steps": t.max_steps,
            "eval_spec": [t.min_steps, t.max_steps], "defaults": calibrate.SFT_DEFAULTS,
            "model": toy.toy_model_config().to_hf_dict(),
            **{k: list(v) if isinstance(v, tuple) else v
               for k, d in _OPTIONAL.items() if (v := getattr(t, k)) != d},
            **({"level_request": LEVEL_REQUEST_VERSION} if t.hint_format == "level" else {})}


def cache_path(cfg) -> Path:
    blob = json.dumps(warm_start_settings(cfg), sort_keys=True, default=str).encode()
    return cache_root(cfg) / f"toy_sft-{hashlib.sha256(blob).hexdigest()[:12]}"


def packaged_settings(folder: Path | None = None) -> dict | None:
    """The warm-start settings a shipped checkpoint (default `PACKAGED`) was made with (None:
    none shipped there)."""
    meta = (folder or PACKAGED) / "sft.json"
    return json.loads(meta.read_text())["settings"] if meta.is_file() else None


def _same(a: dict, b: dict) -> bool:
    norm = lambda d: json.loads(json.dumps(d, sort_keys=True, default=str))  # noqa: E731
    return norm(a) == norm(b)


def warm_started_model(cfg, *, dtype=None, compute_dtype=None, progress=print):
    """The SFT warm start of the toy model (shipped, cached, or trained now and cached)."""
    for folder in (PACKAGED, PACKAGED_TAIL):
        shipped = packaged_settings(folder)
        if shipped is not None and _same(shipped, warm_start_settings(cfg)):
            progress(f"warm start: the shipped SFT model {folder}")
            return models.from_hf(folder, dtype=dtype, compute_dtype=compute_dtype,
                                  remat=cfg.model.remat)
    path = cache_path(cfg)
    if (path / "config.json").is_file():
        progress(f"warm start: cached SFT model {path}")
        return models.from_hf(path, dtype=dtype, compute_dtype=compute_dtype,
                              remat=cfg.model.remat)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    train_warm_start(cfg, tmp, progress=progress)
    if path.exists():  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return models.from_hf(path, dtype=dtype, compute_dtype=compute_dtype, remat=cfg.model.remat)


def train_warm_start(cfg, out: str | Path, *, progress=print):
    """SFT of a fresh toy model with the run's warm-start settings, saved to `out` as a Hugging
    Face folder with `sft.json` (the settings, steps, time, accuracy curve). Returns the model."""
    t = cfg.task.section(ToyConfig)
    progress(f"warm start: SFT of the toy model (at most {t.sft_steps} steps, until single-step "
             f"accuracy {t.sft_target_step_acc:.0%}); saved in {out}")
    model, result = calibrate.warm_start(
        seed=t.sft_seed, steps=t.sft_steps, target_step_acc=t.sft_target_step_acc,
        spec=sft_spec(cfg), eval_spec=spec(cfg), mix=sft_mix(cfg), task=make_task(cfg),
        target_write_prob=t.sft_target_write_prob, progress=progress)
    last = result.evals[-1][1] if result.evals else {}
    progress(f"warm start: {result.steps} SFT steps in {result.seconds:.0f}s, single-step "
             f"accuracy {last.get('step_acc', float('nan')):.3f}")
    out = Path(out)
    models.to_hf(model, out)
    (out / "sft.json").write_text(json.dumps(
        {"settings": warm_start_settings(cfg), "steps": result.steps,
         "seconds": result.seconds, "evals": result.evals, "losses": result.losses[-50:]},
        default=float, indent=1))
    return model
