"""The SmolLM2 word-problem study (issue 50): seeds × arms grpo, resample, sage-online and sage-ref
on SmolLM2-135M-Instruct, every run from the same warm start on the same prompts per seed,
analysed as pre-registered in docs/smollm2_study/registration.md.

    python scripts/smollm2_study.py --out docs/smollm2_study --seeds 3 [--model DIR] [k=v ...]

Each run trains `configs/smollm2_words.yaml` (plus the overrides) with its arm's method and hint
source and `train.seed=<seed>`, then evaluates the trained policy without hints on the held-out
problems (the same problems and sampling key for every run). A finished run's result is
OUT/results/<arm>-s<seed>.json (per-problem pass rates, never-solved shares, rescue per level,
hint correctness, cost, provenance); re-running the command skips finished runs, so a study may
span sessions. The report: OUT/claims.md (`study_claims.py`: paired over seeds, the registered
primary contrast first), OUT/README.md (per arm, and the primary contrast over problems as well)
and OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reproduce_toy  # noqa: E402
import smollm2_words as words  # noqa: E402
import study_claims  # noqa: E402
from sage_jax import config as config_lib  # noqa: E402
from sage_jax.infra import metrics as metrics_lib, provenance  # noqa: E402
from sage_jax.run import build, loop, restore  # noqa: E402
from sage_jax.tasks import registry  # noqa: E402

ARMS = {"grpo": ["rl.method=grpo"], "resample": ["rl.method=resample"],
        "sage-online": ["rl.method=sage", "hint.source=online"],
        "sage-ref": ["rl.method=sage", "hint.source=reference"]}
PRIMARY = ("sage-online", "resample")  # registered: held-out no-hint accuracy, paired over seeds
REGISTRATION = "docs/smollm2_study/registration.md"


def _lengths(rates: dict[str, np.ndarray]) -> dict[int, float]:
    return {int(name.split("-")[1]): float(v.mean()) for name, v in rates.items()}


def run_one(arm: str, seed: int, out: Path, base: list[str], ev: dict) -> dict:
    """Trains and evaluates one run (or reads its finished result)."""
    kept = out / "results" / f"{arm}-s{seed}.json"
    if kept.is_file():
        return json.loads(kept.read_text())
    cfg = registry.load_config("smollm2_words", [*base, *ARMS[arm], f"train.seed={seed}"])
    wd = out / "runs" / f"{arm}-s{seed}"
    t0 = time.perf_counter()
    loop.train(cfg, wd)
    train_s = time.perf_counter() - t0
    _, trained, _ = restore.restore_policy(wd)
    rates = words.pass_rates(trained, cfg, **ev)
    rows = metrics_lib.read_metrics(wd)
    res = {"arm": arm, "seed": seed, "accuracy": _lengths(rates),
           "per_problem": {k: v.tolist() for k, v in rates.items()},
           "rl": words.rl_summary(wd), "train_s": train_s,
           "wall_s": time.perf_counter() - t0,
           "median_step_s": float(np.nanmedian([r.get("time/step_s") for r in rows[1:]]
                                               or [np.nan])),
           "tokens": float(np.nansum([r.get("tokens/sampled", 0.0) for r in rows])),
           **reproduce_toy.visit_numbers(reproduce_toy.read_groups(wd), rows),
           "provenance": provenance.record(config_lib.to_dict(cfg), seed)}
    res = json.loads(json.dumps(res, default=float))  # as a later session reads it back
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(res, indent=1))
    print(f"{arm} seed {seed}: accuracy {np.mean(list(res['accuracy'].values())):.3f}, "
          f"{res['wall_s'] / 60:.1f} min", flush=True)
    return res


def over_problems(runs: list[dict], a: str, b: str) -> dict:
    """Arm a − arm b per held-out problem, averaged over the seeds both ran: mean, SE and 95 %
    interval over problems."""
    of = {arm: {r["seed"]: np.concatenate([np.asarray(v) for v in r["per_problem"].values()])
                for r in runs if r["arm"] == arm} for arm in (a, b)}
    seeds = sorted(set(of[a]) & set(of[b]))
    if not seeds:
        return {}
    d = np.mean([of[a][s] - of[b][s] for s in seeds], axis=0)
    m, se = float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))
    return {"diff": m, "se": se, "ci95": [m - 1.96 * se, m + 1.96 * se], "problems": len(d),
            "seeds": seeds}


def per_arm(runs: list[dict]) -> list[str]:
    """Per arm: never solved, rescue per level, hint correctness, cost (timed runs)."""
    lines = ["| arm | runs | never solved (any / bare) | rescue L1 / L2 / L3 | hints right L1 / L2 "
             "/ L3 | median step | wall per run | sampled tokens |", "|---" * 8 + "|"]
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        mean = lambda xs: float(np.nanmean(xs)) if len(xs) else float("nan")  # noqa: E731
        tried = np.sum([r["rescue"]["tried"] for r in rs], axis=0)
        solved = np.sum([[r["rescue"]["rate"][str(lvl)] * r["rescue"]["tried"][lvl - 1]
                          if r["rescue"]["tried"][lvl - 1] else 0 for lvl in (1, 2, 3)]
                         for r in rs], axis=0)
        rescue = " / ".join(f"{s / t:.2f}" if t else "-" for s, t in zip(solved, tried))
        right = " / ".join(f"{mean([r['rl'][f'hint_right_level_{lvl}'] for r in rs]):.2f}"
                           for lvl in (1, 2, 3)) if arm == "sage-online" else "-"
        timed = [r for r in rs if r.get("timed", True)]
        lines.append(
            f"| {arm} | {len(rs)} | {mean([r['never_solved']['any'] for r in rs]):.3f} / "
            f"{mean([r['never_solved']['unhinted'] for r in rs]):.3f} | {rescue} | {right} | "
            f"{mean([r['median_step_s'] for r in timed]):.1f} s | "
            f"{mean([r['wall_s'] for r in timed]) / 60:.1f} min | "
            f"{mean([r['tokens'] for r in rs]) / 1e6:.2f} M |")
    return lines


def report(runs: list[dict], before: dict, out: Path, command: str) -> str:
    """OUT/results.json, OUT/claims.md and OUT/README.md from the finished runs; the runs named
    in OUT/contended.json (they shared the machine) count for accuracy, not for time."""
    contended = out / "contended.json"
    untimed = set(json.loads(contended.read_text())["runs"]) if contended.is_file() else set()
    runs = [{**r, "timed": f"{r['arm']}-s{r['seed']}" not in untimed} for r in runs]
    (out / "results.json").write_text(json.dumps({"warm_start": before, "runs": runs}, indent=1,
                                                 default=float))
    study_claims.write(out, "SmolLM2-135M-Instruct on word problems (docs/smollm2_study)",
                       registered=REGISTRATION)
    p = over_problems(runs, *PRIMARY)
    lines = ["# SmolLM2-135M-Instruct word-problem study", "",
             f"Registered: [{Path(REGISTRATION).name}]({Path(REGISTRATION).name}). Command: "
             f"`{command}`. Finished runs: {len(runs)}. Claims, paired over seeds: "
             "[claims.md](claims.md).", "",
             f"Warm start: held-out no-hint accuracy {before['overall']:.3f} ± {before['se']:.3f} "
             "(SE over problems).", ""]
    if p:
        lines += [f"Primary contrast over problems ({PRIMARY[0]} − {PRIMARY[1]}, each problem's "
                  f"difference averaged over seeds {p['seeds']}, {p['problems']} problems): "
                  f"{p['diff']:+.3f} (SE {p['se']:.3f}; 95 % CI {p['ci95'][0]:+.3f}, "
                  f"{p['ci95'][1]:+.3f}).", ""]
    lines += ["## Per arm (means over seeds; rescue pooled over seeds)", "", *per_arm(runs), ""]
    text = "\n".join(lines)
    (out / "README.md").write_text(text)
    return text


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/smollm2_study")
    ap.add_argument("--model", default="~/models/smollm2-135m-instruct")
    ap.add_argument("--seeds", type=int, default=3, help="training seeds 0 .. seeds-1")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    ap.add_argument("--eval-per-length", type=int, default=32)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if [a for a in arms if a not in ARMS] or not arms:
        ap.error(f"--arms {args.arms!r}: choose from {list(ARMS)}")
    out, model_dir = Path(args.out), Path(args.model).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    words.convert(model_dir)
    base = [f"model.path={model_dir}", *args.overrides]
    ev = dict(per_length=args.eval_per_length, samples=args.eval_samples)
    start_file = out / "warm_start.json"
    if start_file.is_file():
        before = json.loads(start_file.read_text())
    else:
        cfg = registry.load_config("smollm2_words", base)
        before = {**words.accuracy_summary(words.pass_rates(build.load_model(cfg), cfg, **ev)),
                  "provenance": provenance.record(config_lib.to_dict(cfg), None)}
        start_file.write_text(json.dumps(before, indent=1, default=float))
    runs = [run_one(a, s, out, base, ev) for s in range(args.seeds) for a in arms]
    command = " ".join(["python scripts/smollm2_study.py", *(argv if argv is not None
                                                              else sys.argv[1:])])
    text = report(runs, before, out, command)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
