"""The built-in toy task's default job around `run.loop.train`:

    warm start (SFT, shipped or cached) -> calibration gate -> RL -> no-hint evaluation by
    difficulty -> summary.md + summary.png in the run folder.

It runs for a toy-task run on the task's built-in model (no model.path), single-process (the toy
job is a one-machine testbed); any other run is the plain training run.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from sage_jax import models
from sage_jax.infra import distributed, metrics as metrics_lib, parallel, wandb_log
from sage_jax.jobs import report
from sage_jax.rl.types import RolloutEngine
from sage_jax.run import build, loop, restore
from sage_jax.tasks.toy import calibrate, chains as toy
from sage_jax.tasks.toy.toy_config import ToyConfig
from sage_jax.tasks.toy.warm_start import make_task, spec

# Where the multi-seed studies of this task are reported, printed at the end of every default toy
# run's summary. Their numbers live only in the generated claims tables (issue 50).
STUDIES = """## What the multi-seed studies found

The claims tables, generated from the studies' results files (held-out no-hint accuracy of each
arm against GRPO and the no-hint re-sampling control, paired by seed, each labelled by who wrote
its hints), are in the repository: `docs/toy_tail/claims.md` (the hard split, where GRPO stalls
and the policy writes its own hints) and `docs/toy_study/claims.md` (the toy task without a hard
split, where GRPO leaves almost nothing unsolved). This run's before/after accuracy is one seed
and compares with no baseline: the same command with `rl.method=resample` (re-sampling without
hints) or `rl.method=grpo` is the comparison, and the tables say what held over seeds.
"""


def run(cfg, workdir) -> dict:
    """`loop.train` with `hint.source: auto` resolved (`with_hint_source`), and around it on a
    toy run of the built-in model: the calibration gate before RL on a fresh run (whose pick
    resolves `auto`), the no-hint evaluation by difficulty and summary.md/.png after. Returns the
    last step's metrics."""
    distributed.initialize_from_env()  # before anything below starts a JAX backend
    if not (is_default_toy_run(cfg) and jax.process_count() == 1):
        return loop.train(with_hint_source(cfg, workdir), workdir)
    fresh = not (Path(workdir) / "checkpoints").is_dir()
    cal = None
    if fresh and cfg.task.section(ToyConfig).calibrate:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        cal = before_rl(cfg, workdir, build.load_model(cfg))
    cfg = with_hint_source(cfg, workdir, cal)
    metrics = loop.train(cfg, workdir)
    after_rl(cfg, workdir)
    return metrics


def is_default_toy_run(cfg) -> bool:
    return cfg.task.name == "toy" and not cfg.model.path


def model_engine(cfg, model) -> RolloutEngine:
    """The run's rollout engine (`rollout.engine`) on `model`'s weights, placed on the run's
    mesh (`mesh.*`) as the trainer places them: the calibration and evaluation then run the
    sampling programs RL compiles anyway."""
    mesh = parallel.make_mesh(cfg.mesh)
    graphdef, params = models.split(model)
    params = jax.device_put(params, parallel.tree_shardings(params, mesh))
    return build.rollout_engine(cfg, model.cfg, graphdef, params, make_task(cfg), mesh)


def before_rl(cfg, workdir: str | Path, model) -> dict | None:
    """The calibration gate on a fresh run (printed, and saved as calibration.json)."""
    if not (is_default_toy_run(cfg) and cfg.task.section(ToyConfig).calibrate):
        return None
    workdir = Path(workdir)
    print("calibration (step 0 policy on the RL prompt distribution):", flush=True)
    per_length = cfg.task.section(ToyConfig).calibrate_per_length
    cal = calibrate.calibrate(model_engine(cfg, model), spec=spec(cfg), task=make_task(cfg),
                                  problems_per_length=per_length,
                                  group_size=cfg.rl.group_size, temperature=cfg.rl.temperature,
                                  seed=cfg.train.seed, method=cfg.rl.method,
                                  hint_source=cfg.hint.source)
    print(calibrate.format_calibration(cal), flush=True)
    if not cal["gate"]["passed"]:
        print("calibration gate: NOT passed (see above); continuing with RL anyway", flush=True)
    (workdir / "calibration.json").write_text(json.dumps(cal, indent=1, default=str))
    return cal


def with_hint_source(cfg, workdir: str | Path, cal: dict | None = None):
    """`cfg` with `hint.source: auto` resolved (`calibrate.pick_hint_source`) by the
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
        source, why = calibrate.pick_hint_source("auto", None)
    if not printed:
        print(f"hint source: {source} ({why})", flush=True)
    return dataclasses.replace(cfg, hint=dataclasses.replace(cfg.hint, source=source))


def held_out_rewards(model, cfg, *, seed: int = 0) -> tuple[list[toy.ToyProblem], np.ndarray]:
    """The held-out problems (`task.toy.eval_per_length` per length, the same set for every run)
    and their no-hint rewards [N, task.toy.eval_samples], sampled at the rollout temperature
    from a key of `seed`."""
    t = cfg.task.section(ToyConfig)
    problems = toy.held_out_problems(t.eval_per_length, spec(cfg))
    rewards, _ = calibrate.sample_rewards(
        model_engine(cfg, model), problems, group_size=t.eval_samples,
        temperature=cfg.rl.temperature, key=jax.random.PRNGKey(77 + seed))
    return problems, rewards


def accuracy_by_length(model, cfg, *, seed: int = 0) -> dict[int, float]:
    """No-hint pass rate per length on the held-out problems (`held_out_rewards`)."""
    return by_length(*held_out_rewards(model, cfg, seed=seed))


def by_length(problems, rewards) -> dict[int, float]:
    """Pass rate per problem length of rewards [N, samples]."""
    ks = np.asarray([p.k for p in problems])
    return {int(k): float(rewards[ks == k].mean()) for k in sorted(set(ks.tolist()))}


def accuracy_by_split(problems, rewards, rare_operands) -> dict[str, float]:
    """No-hint pass rate of `held_out_rewards`' result on the hard split (problems that use one
    of `rare_operands`) and on the rest."""
    hard = np.asarray([p.uses(rare_operands) for p in problems])
    return {"hard": float(rewards[hard].mean()) if hard.any() else float("nan"),
            "rest": float(rewards[~hard].mean()) if (~hard).any() else float("nan"),
            "all": float(rewards.mean()), "hard_problems": int(hard.sum()),
            "rest_problems": int((~hard).sum())}


def hard_split_change(before, after, rare_operands) -> dict[str, float]:
    """The trained policy's no-hint pass rate minus the start's on the hard split, paired over
    its problems (`held_out_rewards` results of both on the same problems): mean, standard
    error and the number of problems."""
    (problems, r0), (_, r1) = before, after
    hard = np.asarray([p.uses(rare_operands) for p in problems])
    d = r1[hard].mean(axis=1) - r0[hard].mean(axis=1)
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    return {"diff": float(d.mean()) if len(d) else float("nan"), "se": se, "problems": len(d)}


def hard_split_line(change: dict[str, float], steps: int) -> str:
    """Whether this run's RL moved the hard split (a 95 % interval over its problems), said
    plainly, and where the multi-seed study of longer runs is."""
    m, h = change["diff"], 1.96 * change["se"]
    moved = ("did not move it" if not m - h > 0 and not m + h < 0 else
             "raised it" if m > 0 else "lowered it")
    return (f"**{steps} RL steps {moved}**: hard-split pass rate after − before {m:+.3f} ± "
            f"{h:.3f} (95 % over its {change['problems']} problems). The default job's 20 steps "
            "are too few to move the hard split reliably; the hard-split study "
            "(`docs/toy_tail/`, 60 steps, 5 seeds, paired by seed) is what shows what RL does "
            "there.")


def after_rl(cfg, workdir: str | Path, *, start_model=None) -> str | None:
    """No-hint accuracy by difficulty of the SFT start and of the trained policy, then
    summary.md / summary.png / eval_by_length.json in the run folder. Returns the markdown."""
    if not (is_default_toy_run(cfg) and cfg.task.section(ToyConfig).report):
        return None
    workdir = Path(workdir)
    t0 = time.perf_counter()
    print("evaluation: no-hint pass rate by difficulty (held-out problems)", flush=True)
    _, trained, step = restore.restore_policy(workdir)
    start = start_model if start_model is not None else build.load_model(cfg)
    policies = {"SFT start": start, f"after {cfg.rl.method} ({step} steps)": trained}
    held_out = {name: held_out_rewards(m, cfg, seed=cfg.train.seed)
                for name, m in policies.items()}
    accuracy = {name: by_length(*pr) for name, pr in held_out.items()}
    (workdir / "eval_by_length.json").write_text(json.dumps(accuracy, indent=1))
    rows = metrics_lib.read_metrics(workdir)
    cal_file = workdir / "calibration.json"
    extra = ""
    rare = cfg.task.section(ToyConfig).rare_operands
    if rare:
        split = {name: accuracy_by_split(*pr, rare) for name, pr in held_out.items()}
        (workdir / "eval_by_split.json").write_text(json.dumps(split, indent=1))
        extra += (f"## Hard split (operands {list(rare)})\n\n| policy | hard split | rest | all |"
                  "\n|---|---|---|---|\n" + "\n".join(
                      f"| {name} | {a['hard']:.3f} ({a['hard_problems']}) | {a['rest']:.3f} "
                      f"({a['rest_problems']}) | {a['all']:.3f} |" for name, a in split.items())
                  + "\n\n" + hard_split_line(hard_split_change(*held_out.values(), rare), step)
                  + "\n\n")
    if cal_file.is_file():
        cal = json.loads(cal_file.read_text())
        extra += "## Calibration at step 0\n\n" + "\n".join(
            f"- {n}" for n in cal.get("gate_notes", [])) + "\n\n"
    extra += STUDIES
    text = report.write_summary(
        workdir, rows, accuracy, extra=extra,
        title=f"toy task, {cfg.rl.method}, {step} RL steps, seed {cfg.train.seed}")
    print(text, flush=True)
    print(f"wrote {workdir / 'summary.md'} and {workdir / 'summary.png'} "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    if cfg.logging.wandb:  # the same W&B run (its id is in the run folder)
        run = wandb_log.WandbRun(workdir, cfg.logging)
        run.log_summary([{"policy": name, **{f"k={k}": v for k, v in acc.items()}}
                         for name, acc in accuracy.items()], workdir / "summary.png")
        run.finish()
    return text
