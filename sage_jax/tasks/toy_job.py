"""The embedded default job around `sage_jax.train.train` on the toy task:

    warm start (SFT, cached) -> calibration gate -> RL -> no-hint evaluation by difficulty
    -> summary.md + summary.png in the run folder.

`warm_started_model(cfg)` is what `build.load_model` returns for the toy task with no
model.path: the toy model after `toy_calibrate.warm_start`. It comes from, in order:
- the checkpoint shipped with the package (`PACKAGED`, made by `python -m sage_jax.sft --out
  sage_jax/tasks/toy_sft`), when it was made with the run's warm-start settings;
- the cache, a Hugging Face folder under `task.toy.cache_dir` (default $SAGE_JAX_CACHE or
  ~/.cache/sage_jax), keyed by everything that shapes the warm start;
- a fresh SFT, then cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np

from sage_jax import config as config_lib, models
from sage_jax.tasks import toy, toy_calibrate

DESIGN_VERSION = 5  # bump when the toy task's formats or the SFT recipe change
PACKAGED = Path(__file__).with_name("toy_sft")  # the shipped warm start (see module docstring)
EVAL_SEED = 30_000  # the held-out evaluation problems (training problems use seed 0)


def spec(cfg) -> toy.ToySpec:
    """The RL / evaluation lengths of the run."""
    return toy.ToySpec(cfg.task.toy.min_steps, cfg.task.toy.max_steps)


def cache_root(cfg) -> Path:
    root = cfg.task.toy.cache_dir or os.environ.get("SAGE_JAX_CACHE") or "~/.cache/sage_jax"
    return Path(root).expanduser()


def warm_start_settings(cfg) -> dict:
    t = cfg.task.toy
    return {"design": DESIGN_VERSION, "seed": t.sft_seed, "sft_steps": t.sft_steps,
            "target_step_acc": t.sft_target_step_acc, "sft_max_steps": t.max_steps,
            "eval_spec": [t.min_steps, t.max_steps], "defaults": toy_calibrate.SFT_DEFAULTS,
            "model": toy.toy_model_config().to_hf_dict()}


def cache_path(cfg) -> Path:
    blob = json.dumps(warm_start_settings(cfg), sort_keys=True, default=str).encode()
    return cache_root(cfg) / f"toy_sft-{hashlib.sha256(blob).hexdigest()[:12]}"


def packaged_settings() -> dict | None:
    """The warm-start settings the shipped checkpoint was made with (None: none shipped)."""
    meta = PACKAGED / "sft.json"
    return json.loads(meta.read_text())["settings"] if meta.is_file() else None


def _same(a: dict, b: dict) -> bool:
    norm = lambda d: json.loads(json.dumps(d, sort_keys=True, default=str))  # noqa: E731
    return norm(a) == norm(b)


def warm_started_model(cfg, *, dtype=None, compute_dtype=None, progress=print):
    """The SFT warm start of the toy model (shipped, cached, or trained now and cached)."""
    shipped = packaged_settings()
    if shipped is not None and _same(shipped, warm_start_settings(cfg)):
        progress(f"warm start: the shipped SFT model {PACKAGED}")
        return models.from_hf(PACKAGED, dtype=dtype, compute_dtype=compute_dtype)
    path = cache_path(cfg)
    if (path / "config.json").is_file():
        progress(f"warm start: cached SFT model {path}")
        return models.from_hf(path, dtype=dtype, compute_dtype=compute_dtype)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model = train_warm_start(cfg, tmp, progress=progress)
    if path.exists():  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)
    if dtype is not None or compute_dtype is not None:
        return models.from_hf(path, dtype=dtype, compute_dtype=compute_dtype)
    return model


def train_warm_start(cfg, out: str | Path, *, progress=print):
    """SFT of a fresh toy model with the run's warm-start settings, saved to `out` as a Hugging
    Face folder with `sft.json` (the settings, steps, time, accuracy curve). Returns the model."""
    t = cfg.task.toy
    progress(f"warm start: SFT of the toy model (at most {t.sft_steps} steps, until single-step "
             f"accuracy {t.sft_target_step_acc:.0%}); saved in {out}")
    model, result = toy_calibrate.warm_start(
        seed=t.sft_seed, steps=t.sft_steps, target_step_acc=t.sft_target_step_acc,
        spec=toy.ToySpec(1, t.max_steps), eval_spec=spec(cfg), progress=progress)
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


def is_default_toy_run(cfg) -> bool:
    return cfg.task.name == "toy" and not cfg.model.path


def before_rl(cfg, workdir: str | Path, model) -> dict | None:
    """The calibration gate on a fresh run (printed, and saved as calibration.json)."""
    if not (is_default_toy_run(cfg) and cfg.task.toy.calibrate):
        return None
    workdir = Path(workdir)
    print("calibration (step 0 policy on the RL prompt distribution):", flush=True)
    cal = toy_calibrate.calibrate(model, spec=spec(cfg),
                                  problems_per_length=cfg.task.toy.calibrate_per_length,
                                  group_size=cfg.rl.group_size, temperature=cfg.rl.temperature,
                                  seed=cfg.train.seed, method=cfg.rl.method,
                                  hint_source=cfg.hint.source)
    print(toy_calibrate.format_calibration(cal), flush=True)
    if not cal["gate"]["passed"]:
        print("calibration gate: NOT passed (see above); continuing with RL anyway", flush=True)
    (workdir / "calibration.json").write_text(json.dumps(cal, indent=1, default=str))
    return cal


def with_hint_source(cfg, workdir: str | Path, cal: dict | None = None):
    """`cfg` with `hint.source: auto` resolved (`toy_calibrate.pick_hint_source`) by the
    calibration of this run (`cal`, else the run folder's calibration.json, so a resumed run
    keeps its choice); printed. Other sources are returned unchanged."""
    if cfg.hint.source != "auto":
        return cfg
    printed = cal is not None  # the gate's notes name it
    cal_file = Path(workdir) / "calibration.json"
    if cal is None and cal_file.is_file():
        cal = json.loads(cal_file.read_text())
    if cal is not None and "hint_source" in cal:
        source, why = cal["hint_source"], cal["hint_source_reason"]
    else:
        source, why = toy_calibrate.pick_hint_source("auto", None)
    if not printed:
        print(f"hint source: {source} ({why})", flush=True)
    return config_lib.from_dict({**config_lib.to_dict(cfg),
                                 "hint": {**config_lib.to_dict(cfg.hint), "source": source}})


def accuracy_by_length(model, cfg, *, seed: int = 0) -> dict[int, float]:
    """No-hint pass rate per length on held-out problems (`task.toy.eval_per_length` each, the
    same set for every run; `task.toy.eval_samples` samples each at the rollout temperature, from
    a key of `seed`)."""
    t = cfg.task.toy
    problems = toy.make_problems(t.eval_per_length, spec(cfg), seed=EVAL_SEED, per_length=True)
    rewards, _ = toy_calibrate.sample_rewards(
        model, problems, group_size=t.eval_samples, temperature=cfg.rl.temperature,
        key=jax.random.PRNGKey(77 + seed))
    ks = np.asarray([p.k for p in problems])
    return {int(k): float(rewards[ks == k].mean()) for k in sorted(set(ks.tolist()))}


def after_rl(cfg, workdir: str | Path, *, start_model=None) -> str | None:
    """No-hint accuracy by difficulty of the SFT start and of the trained policy, then
    summary.md / summary.png / eval_by_length.json in the run folder. Returns the markdown."""
    if not (is_default_toy_run(cfg) and cfg.task.toy.report):
        return None
    from sage_jax import build, metrics as metrics_lib, report

    workdir = Path(workdir)
    t0 = time.perf_counter()
    print("evaluation: no-hint pass rate by difficulty (held-out problems)", flush=True)
    _, trained, step = build.restore_policy(workdir)
    start = start_model if start_model is not None else build.load_model(cfg)
    accuracy = {"SFT start": accuracy_by_length(start, cfg, seed=cfg.train.seed),
                f"after {cfg.rl.method} ({step} steps)": accuracy_by_length(
                    trained, cfg, seed=cfg.train.seed)}
    (workdir / "eval_by_length.json").write_text(json.dumps(accuracy, indent=1))
    rows = metrics_lib.read_metrics(workdir)
    cal_file = workdir / "calibration.json"
    extra = ""
    if cal_file.is_file():
        cal = json.loads(cal_file.read_text())
        extra = "## Calibration at step 0\n\n" + "\n".join(
            f"- {n}" for n in cal.get("gate_notes", []))
    text = report.write_summary(
        workdir, rows, accuracy, extra=extra,
        title=f"toy task, {cfg.rl.method}, {step} RL steps, seed {cfg.train.seed}")
    print(text, flush=True)
    print(f"wrote {workdir / 'summary.md'} and {workdir / 'summary.png'} "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return text
