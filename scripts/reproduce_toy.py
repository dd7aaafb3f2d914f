"""The toy reproduction study: every method from the same SFT start, on the same prompts, at equal
RL steps, over several seeds; writes a markdown report and PNG plots.

    python scripts/reproduce_toy.py --seeds 3 --methods grpo,resample,sage,sage_light \
        --out docs/toy_study [--steps 30] [section.key=value ...]

Runs go to OUT/runs/<method>-s<seed> (re-running resumes finished or interrupted runs). The report
(OUT/README.md) has: no-hint accuracy by difficulty (mean and 95% t-interval over seeds, on
`task.toy.eval_per_length` held-out prompts per length, the same for every run), the share of
training prompts never solved (the paper's Table 2 analogue), collapse and rescue rates over
steps, and wall-clock per method relative to GRPO.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sage_jax import build, config, train  # noqa: E402
from sage_jax.metrics import read_metrics  # noqa: E402
from sage_jax.tasks import toy_job  # noqa: E402

T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def interval(values) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval) over seeds."""
    v = np.asarray(values, np.float64)
    if len(v) < 2:
        return float(v.mean()), float("nan")
    return float(v.mean()), T95.get(len(v) - 1, 1.96) * float(v.std(ddof=1)) / math.sqrt(len(v))


def fmt(values, digits: int = 3) -> str:
    m, h = interval(values)
    return f"{m:.{digits}f}" + ("" if math.isnan(h) else f" ± {h:.{digits}f}")


def _int_keys(result: dict) -> dict:
    """A result read back from JSON, its accuracy keyed by int length again."""
    return {**result, "accuracy": {int(k): v for k, v in result["accuracy"].items()}}


def run_one(method: str, seed: int, steps: int, out: Path, overrides: list[str]) -> dict:
    """Trains (or resumes) one run and evaluates it; the result is cached in the run folder."""
    wd = out / "runs" / f"{method}-s{seed}"
    done = wd / "study.json"
    if done.is_file():
        return _int_keys(json.loads(done.read_text()))
    cfg = config.load_config(train.DEFAULT_CONFIG, [
        f"rl.method={method}", f"train.seed={seed}", f"train.steps={steps}",
        "task.toy.calibrate=false", "task.toy.report=false", "train.samples_every=0",
        *overrides])
    t0 = time.perf_counter()
    train.train(cfg, wd)
    wall = time.perf_counter() - t0
    _, model, step = build.restore_policy(wd)
    rows = read_metrics(wd)
    res = {"method": method, "seed": seed, "steps": step, "wall_s": wall,
           "step_s": float(sum(r.get("time/step_s", 0.0) for r in rows)),
           "accuracy": toy_job.accuracy_by_length(model, cfg, seed=seed),
           "never_solved": rows[-1].get("hint/frac_never_solved", float("nan")),
           "curves": {k: [r.get(k, float("nan")) for r in rows] for k in (
               "reward/mean", "collapse/frac_all_zero", "collapse/frac_all_zero_after",
               "hint/rescued", "hint/prompts_needing_hint")}}
    done.write_text(json.dumps(res, indent=1))
    print(f"{method} seed {seed}: {steps} steps in {wall:.0f}s, accuracy "
          + " ".join(f"k{k}={v:.2f}" for k, v in res["accuracy"].items()), flush=True)
    return res


def start_accuracy(seeds, out: Path, overrides: list[str]) -> list[dict]:
    """No-hint accuracy of the SFT start itself, with each seed's sampling key."""
    path = out / "sft_start.json"
    if path.is_file():
        return [_int_keys(r) for r in json.loads(path.read_text())]
    cfg = config.load_config(train.DEFAULT_CONFIG, overrides)
    model = build.load_model(cfg)
    res = [{"seed": s, "accuracy": toy_job.accuracy_by_length(model, cfg, seed=s)}
           for s in seeds]
    path.write_text(json.dumps(res, indent=1))
    return res


def report(results: list[dict], start: list[dict], methods: list[str], out: Path,
           cfg_note: str) -> str:
    by = {m: [r for r in results if r["method"] == m] for m in methods}
    ks = sorted({k for r in results for k in r["accuracy"]})
    acc = lambda rs, k: [r["accuracy"][k] for r in rs]  # noqa: E731
    cols = ["SFT start", *methods]
    lines = ["# Toy reproduction study", "", cfg_note, "",
             "## No-hint accuracy by difficulty (mean ± 95% t-interval over seeds)", "",
             "| steps (k) | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for k in ks:
        cells = [fmt(acc(start, k))] + [fmt(acc(by[m], k)) for m in methods]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    mean_all = lambda rs: [np.mean(list(r["accuracy"].values())) for r in rs]  # noqa: E731
    lines.append("| all | " + " | ".join([fmt(mean_all(start))]
                                          + [fmt(mean_all(by[m])) for m in methods]) + " |")
    grpo_s = np.mean([r["step_s"] for r in by.get("grpo", [])]) if by.get("grpo") else None
    lines += ["", "## Training: never-solved prompts, collapse, rescue, wall-clock", "",
              "| method | never solved (Table 2 analogue) | all-zero groups | all-zero after "
              "hints | rescued / step | wall-clock vs grpo |", "|---|---|---|---|---|---|"]
    for m in methods:
        rs = by[m]
        mean_curve = lambda key: [np.nanmean(r["curves"][key]) for r in rs]  # noqa: E731
        rel = (f"{np.mean([r['step_s'] for r in rs]) / grpo_s:.2f}×" if grpo_s else "-")
        lines.append(f"| {m} | {fmt([r['never_solved'] for r in rs])} | "
                     f"{fmt(mean_curve('collapse/frac_all_zero'))} | "
                     f"{fmt(mean_curve('collapse/frac_all_zero_after'))} | "
                     f"{fmt(mean_curve('hint/rescued'), 2)} | {rel} |")
    lines += ["", "Runs per method: " + ", ".join(f"{m}: {len(by[m])}" for m in methods)
              + ". Per-run results: `results.json` (also `runs/<method>-s<seed>/study.json`, "
              "not committed, with the checkpoints).", "",
              "![accuracy by difficulty](accuracy.png)", "", "![training curves](curves.png)",
              ""]
    text = "\n".join(lines)
    (out / "README.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"sft_start": start, "runs": results}, indent=1))
    plots(by, start, methods, ks, out)
    return text


def plots(by, start, methods, ks, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in [("SFT start", start)] + [(m, by[m]) for m in methods]:
        ms, hs = zip(*[interval([r["accuracy"][k] for r in rs]) for k in ks])
        ax.errorbar(ks, ms, yerr=np.nan_to_num(hs), marker="o", capsize=3, label=name)
    ax.set_xlabel("difficulty (steps k)")
    ax.set_ylabel("no-hint pass rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)
    plt.close(fig)

    keys = [("reward/mean", "reward"), ("collapse/frac_all_zero", "all-zero groups"),
            ("collapse/frac_all_zero_after", "all-zero after hints / re-samples")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4))
    for ax, (key, label) in zip(axes, keys):
        for m in methods:
            curves = np.asarray([r["curves"][key] for r in by[m]], np.float64)
            if curves.size:
                ax.plot(np.arange(1, curves.shape[1] + 1), np.nanmean(curves, 0), label=m)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--methods", default="grpo,resample,sage,sage_light")
    ap.add_argument("--steps", type=int, default=None,
                    help="RL steps per run (default: train.steps of configs/toy.yaml)")
    ap.add_argument("--eval-per-length", type=int, default=32,
                    help="held-out test prompts per difficulty (task.toy.eval_per_length)")
    ap.add_argument("--out", default="docs/toy_study")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args(argv)
    args.overrides = [f"task.toy.eval_per_length={args.eval_per_length}", *args.overrides]
    methods = [m for m in args.methods.split(",") if m]
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    base = config.load_config(train.DEFAULT_CONFIG, args.overrides)
    steps = args.steps or base.train.steps
    seeds = list(range(args.seeds))
    t0 = time.perf_counter()
    start = start_accuracy(seeds, out, list(args.overrides))
    results = [run_one(m, s, steps, out, list(args.overrides)) for s in seeds for m in methods]
    t = base.task.toy
    note = (f"Toy task (chain arithmetic, lengths {t.min_steps}..{t.max_steps}), toy model "
            f"warm-started by SFT (seed {t.sft_seed}), then {steps} RL steps of "
            f"{base.rl.prompts_per_step} prompts × {base.rl.group_size} answers, lr "
            f"{base.optim.lr}, seeds {seeds}; evaluation: {t.eval_per_length} held-out prompts "
            f"per length × {t.eval_samples} samples at temperature {base.rl.temperature}, no "
            f"hints. Command: `python scripts/reproduce_toy.py --seeds {args.seeds} --methods "
            f"{args.methods} --steps {steps} --eval-per-length {args.eval_per_length}"
            + (" " + " ".join(args.overrides[1:]) if args.overrides[1:] else "") + "`.")
    text = report(results, start, methods, out, note)
    print(text)
    print(f"study done in {time.perf_counter() - t0:.0f}s; report {out / 'README.md'}")
    return text


if __name__ == "__main__":
    main()
