"""The toy reproduction study: every arm from the same SFT start, on the same training prompts and
evaluation problems, at equal RL steps, over several seeds; writes a markdown report and plots.

    python scripts/reproduce_toy.py --seeds 5 --steps 60 --out docs/toy_study [section.key=value ...]

Arms (`--arms`, default all): grpo; resample (the no-hint re-sampling control); sage-ref (SAGE
with `hint.source=reference`); sage-online and sage-offline (hints the policy writes itself,
every step or once; the report gives the SFT start's measured write accuracy next to them);
sage-ref-plain (reference hints, `rl.loss_context=plain`: the paper's off-policy ablation);
sage_light-ref (SAGE-light with reference hints). The study's prompt pool
(`--problems`, default 128 prompts at 16 per step) is small enough that prompts are revisited,
so SAGE-light has levels to carry and hint transfer can be measured.

Runs go to OUT/runs/<arm>-s<seed> (not committed); a finished run's result is also written to
OUT/results/<arm>-s<seed>.json (small, committed). Re-running the same command resumes: a
finished run (either file exists) is skipped; an unfinished one continues from its last checkpoint (every
`--checkpoint-every` steps). Each run is evaluated without hints at every `--eval-every` steps
(and at its end) on the same held-out problems, for accuracy against sampled tokens and
wall-clock. The report (`toy_study_report.py`) and the claims table (`study_claims.py`,
OUT/claims.md) are written from all finished runs, so a study may span several sessions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import study_claims  # noqa: E402
import toy_study_report as study  # noqa: E402
from sage_jax.infra import checkpoint, compile_cache, provenance
from sage_jax import config  # noqa: E402
from sage_jax.infra.phases import phase_medians  # noqa: E402
from sage_jax.jobs import toy_job  # noqa: E402
from sage_jax.infra.metrics import GROUPS_FILE, read_metrics  # noqa: E402
from sage_jax.run import build, loop, restore  # noqa: E402
from sage_jax.tasks.toy import chains as toy  # noqa: E402
from sage_jax.tasks.toy import calibrate as toy_calibrate  # noqa: E402
from sage_jax.tasks import registry  # noqa: E402
from sage_jax.tasks.toy import warm_start  # noqa: E402
from sage_jax.tasks.toy.toy_config import ToyConfig  # noqa: E402

ARMS = {
    "grpo": ["rl.method=grpo"],
    "resample": ["rl.method=resample"],
    "sage-ref": ["rl.method=sage", "hint.source=reference"],
    "sage-online": ["rl.method=sage", "hint.source=online"],
    "sage-offline": ["rl.method=sage", "hint.source=offline"],
    "sage-ref-plain": ["rl.method=sage", "hint.source=reference", "rl.loss_context=plain"],
    "sage_light-ref": ["rl.method=sage_light", "hint.source=reference"],
    "sage_light-online": ["rl.method=sage_light", "hint.source=online"],
    "sage-online-plain": ["rl.method=sage", "hint.source=online", "rl.loss_context=plain"],
}
BASE = config.CONFIG_DIR / "toy_uniform.yaml"  # docs/toy_study's task (the default until issue 50)
CURVES = ("reward/mean", "collapse/frac_all_zero", "collapse/frac_all_zero_after",
          "hint/rescued", "hint/prompts_needing_hint")


def _int_keys(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}


def _read_result(path: Path) -> dict:
    """A finished run's study.json; its per-prompt numbers are measured again from the run's
    groups.jsonl (so every run is read by the same analysis)."""
    res = _int_run(json.loads(path.read_text()))
    if (path.parent / GROUPS_FILE).is_file():
        res.update(visit_numbers(read_groups(path.parent), read_metrics(path.parent)))
        res["rescue"]["rate"] = _int_keys(res["rescue"]["rate"])
    return res


def _int_run(res: dict) -> dict:
    """A run read back from JSON, with its difficulty and level keys as ints again."""
    res["accuracy"] = _int_keys(res["accuracy"])
    for c in res["curve"]:
        c["accuracy"] = _int_keys(c["accuracy"])
    res["rescue"]["rate"] = _int_keys(res["rescue"]["rate"])
    return res


def _reported(out: Path) -> dict[tuple[str, int], dict]:
    """{(arm, seed): run} of OUT/results.json, the runs of a study reported before its per-run
    files were kept (docs/toy_study)."""
    path = out / "results.json"
    if not path.is_file():
        return {}
    return {(r["arm"], r["seed"]): _int_run(r) for r in json.loads(path.read_text())["runs"]}


def visit_numbers(groups: list[dict], rows: list[dict]) -> dict:
    """Never-solved shares, rescues (mixed groups, from the metrics; solved, per level) and
    hint transfer of one run."""
    rescue = study.rescue_by_level(groups)
    rescue["mixed"] = int(sum(r.get("hint/rescued", 0) for r in rows))
    return {"never_solved": study.never_solved(groups), "rescue": rescue,
            "transfer": study.transfer(groups)}


def run_config(arm: str, seed: int, steps: int, overrides: list[str], ckpt_every: int,
               base: str | Path = BASE):
    return registry.load_config(base, [
        *ARMS[arm], f"train.seed={seed}", f"train.steps={steps}", "task.toy.calibrate=false",
        "task.toy.report=false", "train.samples_every=0", f"checkpoint.every={ckpt_every}",
        "checkpoint.keep=1000", *overrides])


def read_groups(workdir: Path) -> list[dict]:
    path = workdir / GROUPS_FILE
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_one(arm: str, seed: int, steps: int, out: Path, overrides: list[str], *,
            eval_every: int, ckpt_every: int, base: str | Path = BASE) -> dict:
    """Trains (or resumes) one run, evaluates its checkpoints; cached in the run folder."""
    wd = out / "runs" / f"{arm}-s{seed}"
    done = wd / "study.json"
    kept = out / "results" / f"{arm}-s{seed}.json"
    if done.is_file():
        return _read_result(done)
    if kept.is_file():  # a finished run of an earlier session (its run folder is gone)
        return _read_result(kept)
    cfg = run_config(arm, seed, steps, overrides, ckpt_every, base)
    t0 = time.perf_counter()
    loop.train(cfg, wd)
    wall = time.perf_counter() - t0
    rows = read_metrics(wd)
    groups = read_groups(wd)
    tokens = np.cumsum([r.get("tokens/sampled", 0.0) for r in rows])
    seconds = np.cumsum([r.get("time/step_s", 0.0) for r in rows])
    ckpt = checkpoint.Checkpointer(wd, keep=1000)
    saved = ckpt.all_steps()
    ckpt.close()
    points = [s for s in saved if s % eval_every == 0 or s == max(saved)]
    curve = []
    for s in points:
        _, model, _ = restore.restore_policy(wd, step=s)
        curve.append({"step": s, "tokens": float(tokens[s - 1]), "seconds": float(seconds[s - 1]),
                      **held_out_accuracy(model, cfg, seed)})
    for s in saved[:-1]:  # keep the last checkpoint only (disk); the curve is measured
        shutil.rmtree(wd / "checkpoints" / str(s), ignore_errors=True)
    step_s = [r["time/step_s"] for r in rows[1:] if "time/step_s" in r]  # step 1 compiles
    res = {"arm": arm, "seed": seed, "steps": len(rows), "wall_s": wall,
           "median_step_s": float(np.median(step_s)) if step_s else float("nan"),
           "phases": phase_medians(rows),
           "accuracy": curve[-1]["accuracy"], "curve": curve,
           **({"split": curve[-1]["split"]} if "split" in curve[-1] else {}),
           **visit_numbers(groups, rows),
           "curves": {k: [r.get(k, float("nan")) for r in rows] for k in CURVES},
           "provenance": provenance.record(config.to_dict(cfg), seed)}
    done.write_text(json.dumps(res, indent=1))
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(res, indent=1))
    print(f"{arm} seed {seed}: {len(rows)} steps in {wall:.0f}s, no-hint accuracy "
          f"{study.overall(res['accuracy']):.3f}", flush=True)
    return res


def held_out_accuracy(model, cfg, seed: int) -> dict:
    """{"accuracy": by length} of the held-out problems, and {"split": hard split and rest}
    when the run has rare operands (one sampling for both)."""
    problems, rewards = toy_job.held_out_rewards(model, cfg, seed=seed)
    out = {"accuracy": toy_job.by_length(problems, rewards)}
    rare = cfg.task.section(ToyConfig).rare_operands
    if rare:
        out["split"] = toy_job.accuracy_by_split(problems, rewards, rare)
    return out


def start_accuracy(seeds, out: Path, overrides: list[str],
                   base: str | Path = BASE) -> list[dict]:
    """No-hint accuracy of the SFT start itself, with each seed's sampling key."""
    path = out / "sft_start.json"
    if path.is_file():
        return [{**r, "accuracy": _int_keys(r["accuracy"])} for r in json.loads(path.read_text())]
    cfg = registry.load_config(base, overrides)
    model = build.load_model(cfg)
    res = [{"seed": s, **held_out_accuracy(model, cfg, s),
            "provenance": provenance.record(config.to_dict(cfg), s)} for s in seeds]
    path.write_text(json.dumps(res, indent=1))
    return res


def write_accuracy(out: Path, overrides: list[str], base: str | Path = BASE) -> dict:
    """The SFT start's greedy hint-writing accuracy per level on held-out RL-length problems."""
    path = out / "write_accuracy.json"
    if path.is_file():
        res = json.loads(path.read_text())
        return {**res, "acc": _int_keys(res["acc"])}
    cfg = registry.load_config(base, overrides)
    problems = toy.held_out_problems(cfg.task.section(ToyConfig).eval_per_length,
                                     warm_start.spec(cfg))
    res = toy_calibrate.hint_write_accuracy(toy_job.model_engine(cfg, build.load_model(cfg)),
                                            problems, task=warm_start.make_task(cfg))
    res = {"problems": len(problems), **res,  # greedy: no sampling seed
           "provenance": provenance.record(config.to_dict(cfg), None)}
    path.write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5, help="seeds first-seed .. seeds-1")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="run only seeds from this one (e.g. to split a study over processes)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    ap.add_argument("--steps", type=int, default=60, help="RL steps per run")
    ap.add_argument("--problems", type=int, default=128, help="training prompt pool")
    ap.add_argument("--eval-per-length", type=int, default=32,
                    help="held-out test prompts per difficulty (task.toy.eval_per_length)")
    ap.add_argument("--eval-every", type=int, default=20, help="evaluate every N steps")
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--out", default="docs/toy_study")
    ap.add_argument("--config", default=str(BASE),
                    help="the runs' base config (default: toy_uniform, docs/toy_study's)")
    ap.add_argument("--report-only", action="store_true",
                    help="write the report from the finished runs; train nothing")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    if args.eval_every % args.checkpoint_every:
        ap.error("--eval-every must be a multiple of --checkpoint-every")
    overrides = [f"task.toy.eval_per_length={args.eval_per_length}",
                 f"task.toy.problems={args.problems}", *args.overrides]
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    compile_cache.enable(registry.load_config(args.config, overrides).train.compile_cache)
    seeds = list(range(args.first_seed, args.seeds))
    t0 = time.perf_counter()
    start = start_accuracy(seeds, out, overrides, args.config)
    writing = write_accuracy(out, overrides, args.config)
    results = []
    reported = _reported(out) if args.report_only else {}
    for s in seeds:
        for a in arms:
            done = out / "runs" / f"{a}-s{s}" / "study.json"
            kept = out / "results" / f"{a}-s{s}.json"
            if args.report_only:
                if done.is_file() or kept.is_file():
                    results.append(_read_result(done if done.is_file() else kept))
                elif (a, s) in reported:
                    results.append(reported[(a, s)])
                continue
            results.append(run_one(a, s, args.steps, out, overrides,
                                   eval_every=args.eval_every, ckpt_every=args.checkpoint_every,
                                   base=args.config))
    base = registry.load_config(args.config, overrides)
    t = base.task.section(ToyConfig)
    note = (f"Toy task (chain arithmetic, lengths {t.min_steps}..{t.max_steps}), toy model "
            f"warm-started by SFT (seed {t.sft_seed}), then {args.steps} RL steps of "
            f"{base.rl.prompts_per_step} prompts × {base.rl.group_size} answers from a pool of "
            f"{t.problems}, lr {base.optim.lr}, seeds {seeds}; evaluation: {t.eval_per_length} "
            f"held-out prompts per length × {t.eval_samples} samples at temperature "
            f"{base.rl.temperature}, no hints. Command: `python scripts/reproduce_toy.py "
            + (f"--config {args.config} " if args.config != str(BASE) else "")
            + f"--seeds {args.seeds} --arms {args.arms} --steps {args.steps} --problems "
            f"{args.problems} --eval-per-length {args.eval_per_length} --eval-every "
            f"{args.eval_every} --out {args.out}"
            + (" " + " ".join(args.overrides) if args.overrides else "")
            + "`.")
    text = study.report(results, start, arms, out, note, write_acc=writing)
    study_claims.write(out, study_claims.TITLES.get(out.name))
    print(text)
    print(f"study: {len(results)} runs reported in {time.perf_counter() - t0:.0f}s; report "
          f"{out / 'README.md'}")
    return text


if __name__ == "__main__":
    main()
