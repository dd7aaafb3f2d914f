"""The toy study's numbers and report, from the per-run results of `reproduce_toy.py` (pure:
dicts in, markdown and PNGs out; nothing here trains).

A run's result (`runs/<arm>-s<seed>/study.json`) holds its final no-hint accuracy by length, an
accuracy curve over checkpoints (with cumulative sampled tokens and step seconds), its metrics
curves and per-prompt visit records from `groups.jsonl` (dataset id, first-pass status, level,
round, solved), from which the never-solved shares, rescue rates and hint transfer come.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from sage_jax.infra.phases import PHASES, STEP, phase_table

ALL_ZERO = 1  # `sage_jax.core.sage.COLLAPSE_ALL_ZERO`
T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
NO_RESCUE = 0.02  # an arm that rescued under this share of its all-zero groups tests nothing


def interval(values) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval); the half-width is nan for fewer than 2."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], np.float64)
    if len(v) == 0:
        return float("nan"), float("nan")
    if len(v) < 2:
        return float(v.mean()), float("nan")
    return float(v.mean()), T95.get(len(v) - 1, 1.96) * float(v.std(ddof=1)) / math.sqrt(len(v))


def fmt(values, digits: int = 3) -> str:
    m, h = interval(values)
    if math.isnan(m):
        return "-"
    return f"{m:.{digits}f}" + ("" if math.isnan(h) else f" ± {h:.{digits}f}")


def overall(acc: dict) -> float:
    return float(np.mean(list(acc.values())))


# ---- per-prompt visits (groups.jsonl) -------------------------------------------------------

def visits(groups: list[dict]) -> dict[int, list[dict]]:
    """{dataset id: [visit, ...] in step order}; a visit has step, collapse, level, round,
    solved, and `first_unhinted` (its first pass had no hint) and `solved_unhinted`."""
    out: dict[int, list[dict]] = {}
    for row in groups:
        for j, i in enumerate(row["id"]):
            lvl, rnd, col = row["level"][j], row["round"][j], row["collapse"][j]
            first_unhinted = rnd > 0 or lvl == 0  # sage: re-sampled after a bare first pass
            v = {"step": row["step"], "collapse": col, "level": lvl, "round": rnd,
                 "solved": bool(row["solved"][j]), "first_unhinted": first_unhinted}
            v["solved_unhinted"] = bool((lvl == 0 and v["solved"])
                                        or (first_unhinted and col != ALL_ZERO))
            out.setdefault(int(i), []).append(v)
    return out


def never_solved(groups: list[dict]) -> dict[str, float]:
    """Shares of the visited training prompts never solved (any context) and never solved
    without a hint, over the whole run (the paper's Table 2)."""
    vs = visits(groups)
    if not vs:
        return {"any": float("nan"), "unhinted": float("nan")}
    return {"any": float(np.mean([not any(v["solved"] for v in x) for x in vs.values()])),
            "unhinted": float(np.mean([not any(v["solved_unhinted"] for v in x)
                                       for x in vs.values()]))}


def rescue_by_level(groups: list[dict], max_level: int = 3) -> dict:
    """Of the first-pass all-zero groups: how many were re-sampled at each level and how many of
    those that level solved; plus all-zero groups and rescued groups overall, and the groups
    trained with a hint (any method) and how many of them were solved."""
    tried = np.zeros(max_level + 1, int)
    solved = np.zeros(max_level + 1, int)
    zero = rescued = hinted = hinted_solved = 0
    for row in groups:
        for col, rnd, ok, lvl in zip(row["collapse"], row["round"], row["solved"], row["level"]):
            hinted += lvl > 0
            hinted_solved += bool(lvl > 0 and ok)
            if col != ALL_ZERO:
                continue
            zero += 1
            tried[1:rnd + 1] += 1
            if rnd and ok:
                solved[rnd] += 1
                rescued += 1
    return {"all_zero": zero, "rescued": rescued, "hinted": hinted,
            "hinted_solved": hinted_solved,
            "rate": {lvl: (solved[lvl] / tried[lvl] if tried[lvl] else float("nan"))
                     for lvl in range(1, max_level + 1)},
            "tried": tried[1:].tolist()}


def transfer(groups: list[dict]) -> dict[str, list[int]]:
    """Hint transfer: for visits whose bare first pass was all-zero, split by what happened then
    (`hinted`: re-sampled with a hint and solved; `resampled`: solved by a re-sample without a
    hint; `stayed`: still all-zero), [next visits solved without a hint, next visits]."""
    out = {"hinted": [0, 0], "resampled": [0, 0], "stayed": [0, 0]}
    for xs in visits(groups).values():
        for now, nxt in zip(xs, xs[1:]):
            if now["collapse"] != ALL_ZERO or not now["first_unhinted"]:
                continue
            if not nxt["first_unhinted"]:
                continue  # sage_light: the next visit started hinted; not a no-hint test
            kind = ("stayed" if not now["solved"] else
                    "hinted" if now["level"] > 0 else "resampled")
            out[kind][0] += int(nxt["collapse"] != ALL_ZERO)
            out[kind][1] += 1
    return out


# ---- the report -----------------------------------------------------------------------------

def _rate(pair) -> str:
    k, n = pair
    return f"{k / n:.2f} ({k}/{n})" if n else "-"


def _pooled(rs, key) -> list[int]:
    return [sum(r["transfer"][key][0] for r in rs), sum(r["transfer"][key][1] for r in rs)]


def arm_summary(rs: list[dict], grpo: list[dict]) -> dict:
    """The headline numbers of one arm's runs (paired with grpo's by seed)."""
    base = {r["seed"]: overall(r["accuracy"]) for r in grpo}
    diffs = [overall(r["accuracy"]) - base[r["seed"]] for r in rs if r["seed"] in base]
    hard = {r["seed"]: r["split"]["hard"] for r in rs if "split" in r}
    hard_base = {r["seed"]: r["split"]["hard"] for r in grpo if "split" in r}
    zero = sum(r["rescue"]["all_zero"] for r in rs)
    rescued = sum(r["rescue"]["mixed"] for r in rs)  # re-sampled groups that came back mixed
    hinted = sum(r["rescue"].get("hinted", 0) for r in rs)
    hinted_solved = sum(r["rescue"].get("hinted_solved", 0) for r in rs)
    grpo_step = {r["seed"]: r["median_step_s"] for r in grpo if r.get("timed", True)}
    ratio = [r["median_step_s"] / grpo_step[r["seed"]] for r in rs
             if r["seed"] in grpo_step and r.get("timed", True)]
    return {"acc": [overall(r["accuracy"]) for r in rs], "diff": diffs,
            "by_seed": {r["seed"]: overall(r["accuracy"]) for r in rs},
            "hard": list(hard.values()), "hard_by_seed": hard,
            "hard_diff": [v - hard_base[s] for s, v in hard.items() if s in hard_base],
            "rest": [r["split"]["rest"] for r in rs if "split" in r],
            "never": [r["never_solved"]["any"] for r in rs],
            "never_unhinted": [r["never_solved"]["unhinted"] for r in rs],
            "rescue_share": rescued / zero if zero else float("nan"),
            "rescued": rescued, "all_zero": zero, "hinted": hinted,
            "hinted_solved": hinted_solved, "time_ratio": ratio,
            "escalates": rs[0]["arm"].startswith("sage-") or rs[0]["arm"] == "resample",
            "self_hints": rs[0]["arm"].startswith("sage")}


def untested(s: dict) -> str:
    """The label of a SAGE arm whose hints rescued (almost) nothing."""
    if s["self_hints"] and s["escalates"] and s["all_zero"] and s["rescue_share"] < NO_RESCUE:
        return (f"rescued {s['rescued']} of {s['all_zero']} all-zero groups: "
                "NOT a test of SAGE (its hints rescued nothing)")
    return ""


def report(results: list[dict], start: list[dict], arms: list[str], out: Path, note: str,
           write_acc: dict | None = None) -> str:
    """Writes OUT/README.md, OUT/results.json and the plots; returns the markdown."""
    if not results:
        return "(no finished runs to report)"
    contended = out / "contended.json"  # runs whose wall-clock overlapped other work
    untimed = set(json.loads(contended.read_text())["runs"]) if contended.is_file() else set()
    results = [{**r, "timed": f"{r['arm']}-s{r['seed']}" not in untimed} for r in results]
    by = {a: sorted([r for r in results if r["arm"] == a], key=lambda r: r["seed"])
          for a in arms}
    by = {a: rs for a, rs in by.items() if rs}
    arms = list(by)
    grpo = by.get("grpo", [])
    summ = {a: arm_summary(rs, grpo) for a, rs in by.items()}
    ks = sorted({k for r in results for k in r["accuracy"]})
    lines = ["# Toy reproduction study", "", note, ""]
    reading = out / "reading.md"  # the hand-written reading, kept when the report is rewritten
    if reading.is_file():
        lines += [reading.read_text().strip(), ""]
    if write_acc:
        lines += [f"Hint writing of the SFT start (greedy, {write_acc['problems']} held-out "
                  "problems of the RL lengths, exact match with the reference levels): "
                  + ", ".join(f"L{k} {v:.0%}" for k, v in write_acc["acc"].items())
                  + f"; parsed {write_acc['parse_rate']:.0%}. The `sage-online` and "
                  "`sage-offline` arms use these self-written hints.", ""]
    lines += ["## Headline (means ± 95% t-interval over seeds)", "",
              "| arm | runs | no-hint accuracy | paired Δ vs grpo | never solved | never solved "
              "without a hint | rescued (mixed) / all-zero groups | hinted groups solved | step "
              "time vs "
              "grpo | note |", "|---|---|---|---|---|---|---|---|---|---|",
              f"| SFT start | {len(start)} | {fmt([overall(r['accuracy']) for r in start])} "
              "| | | | | | | |"]
    for a in arms:
        s = summ[a]
        share = (f"{s['rescue_share']:.2f} ({s['rescued']}/{s['all_zero']})"
                 if s["all_zero"] and s["escalates"] else "-")
        solved = (f"{s['hinted_solved'] / s['hinted']:.2f} ({s['hinted_solved']}/{s['hinted']})"
                  if s["hinted"] else "-")
        ratio = f"{np.median(s['time_ratio']):.2f}×" if s["time_ratio"] else "-"
        lines.append(f"| {a} | {len(by[a])} | {fmt(s['acc'])} | "
                     f"{fmt(s['diff']) if a != 'grpo' else ''} | {fmt(s['never'])} | "
                     f"{fmt(s['never_unhinted'])} | {share} | {solved} | {ratio} | "
                     f"{untested(s)} |")
    if any(summ[a]["hard"] for a in arms):
        lines += ["", "## No-hint accuracy on the hard split (problems that use a rare operand) "
                  "and on the rest", "",
                  "| arm | hard split | paired Δ vs grpo (hard) | rest |", "|---|---|---|---|",
                  f"| SFT start | {fmt([r['split']['hard'] for r in start if 'split' in r])} | "
                  f"| {fmt([r['split']['rest'] for r in start if 'split' in r])} |"]
        for a in arms:
            s = summ[a]
            lines.append(f"| {a} | {fmt(s['hard'])} | "
                         f"{fmt(s['hard_diff']) if a != 'grpo' else ''} | {fmt(s['rest'])} |")
    lines += ["", "## Cost (per run, medians over seeds; times only from runs that had the machine "
              "to themselves" + (f", not from {', '.join(sorted(untimed))} (contended.json)"
                                 if untimed else "") + ")", "",
              "| arm | timed runs | wall time (training + evaluations) | sampled tokens (every "
              "sampler call) | median step | step time vs grpo |", "|---|---|---|---|---|---|"]
    for a in arms:
        timed = [r for r in by[a] if r["timed"]]
        wall = [r["wall_s"] / 60 for r in timed if "wall_s" in r]
        tokens = [r["curve"][-1]["tokens"] / 1e6 for r in by[a] if r.get("curve")]
        step = [r["median_step_s"] for r in timed if "median_step_s" in r]
        ratio = summ[a]["time_ratio"]
        lines.append(f"| {a} | {len(timed)} | " + " | ".join(
            f"{np.median(v):.{d}f}{unit}" if v else "-" for v, d, unit in (
                (wall, 1, " min"), (tokens, 2, " M"), (step, 2, " s"),
                (ratio, 2, "× (paired by seed)"))) + " |")
    lines += ["", "## Time by phase (median seconds per step over the timed runs' medians of steps "
              "3 on)", "", arm_phase_table(by), "",
              "## What the paper claims, and what holds here", "",
              "The claims table, every contrast paired by seed with its hint source: "
              "[claims.md](claims.md) (`scripts/study_claims.py`, generated from results.json).",
              "", "## No-hint accuracy by difficulty", "",
              "| steps (k) | SFT start | " + " | ".join(arms) + " |",
              "|---" * (len(arms) + 2) + "|"]
    for k in ks:
        cells = [fmt([r["accuracy"][k] for r in start])] + [
            fmt([r["accuracy"][k] for r in by[a]]) for a in arms]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "## Rescue rate per level (share of the re-sampled all-zero groups that the "
              "level solved, i.e. some answer right, pooled over seeds; \"rescued (mixed)\" above "
              "counts only groups that came back mixed, with non-zero advantages)", "",
              "| arm | level 1 | level 2 | level 3 |", "|---|---|---|---|"]
    for a in arms:
        tried = np.sum([r["rescue"]["tried"] for r in by[a]], axis=0)
        if not tried.any():
            continue
        solved = np.sum([[r["rescue"]["rate"][lvl] * r["rescue"]["tried"][lvl - 1]
                          if r["rescue"]["tried"][lvl - 1] else 0 for lvl in (1, 2, 3)]
                         for r in by[a]], axis=0)
        lines.append(f"| {a} | " + " | ".join(
            f"{s / t:.2f} ({s:.0f}/{t})" if t else "-" for s, t in zip(solved, tried)) + " |")
    lines += ["", "## Hint transfer", "",
              "Training prompts whose bare first pass was all-zero: the share solved *without* "
              "a hint at their next visit, after being rescued with a hint, after a re-sample "
              "without a hint solved them (`resample`), and after staying all-zero (pooled over "
              "seeds; k/n visits).", "",
              "| arm | rescued with a hint | solved by a re-sample | stayed all-zero |",
              "|---|---|---|---|"]
    for a in arms:
        lines.append(f"| {a} | {_rate(_pooled(by[a], 'hinted'))} | "
                     f"{_rate(_pooled(by[a], 'resampled'))} | {_rate(_pooled(by[a], 'stayed'))} |")
    lines += ["", "Per-run results: `results.json` (and `runs/<arm>-s<seed>/study.json`, not "
              "committed, next to the run folders). Runs made before the runner recorded its "
              "commit and config have them reconstructed from the git history in "
              "`provenance.json` (`scripts/reconstruct_provenance.py`), labelled as such.", "",
              "![accuracy by difficulty](accuracy.png)", "",
              "![accuracy against sampled tokens and wall-clock](efficiency.png)", "",
              "![training curves](curves.png)", ""]
    text = "\n".join(lines)
    (out / "README.md").write_text(text)
    (out / "results.json").write_text(json.dumps(
        {"sft_start": start, "write_accuracy": write_acc, "runs": results}, indent=1))
    plots(by, start, arms, ks, out)
    return text


def arm_phase_table(by: dict) -> str:
    """Markdown: each arm's phases (`infra.phases`), medians over its timed runs that logged
    them (runs from before the phases were logged have none)."""
    cols = {}
    for a, rs in by.items():
        got = [r["phases"] for r in rs if r.get("timed", True) and r.get("phases")]
        if got:
            cols[a] = {k: float(np.median([p.get(k, 0.0) for p in got]))
                       for k, _ in (*PHASES, (STEP, ""))}
    return phase_table(cols)


def plots(by: dict, start: list[dict], arms: list[str], ks: list[int], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in [("SFT start", start)] + [(a, by[a]) for a in arms]:
        ms, hs = zip(*[interval([r["accuracy"][k] for r in rs]) for k in ks])
        ax.errorbar(ks, ms, yerr=np.nan_to_num(hs), marker="o", capsize=3, label=name)
    ax.set(xlabel="difficulty (steps k)", ylabel="no-hint pass rate", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for a in arms:
        pts = [r["curve"] for r in by[a]]
        n = min(len(p) for p in pts)
        if not n:
            continue
        acc = np.mean([[overall(c["accuracy"]) for c in p[:n]] for p in pts], 0)
        for ax, key in zip(axes, ("tokens", "seconds")):
            ax.plot(np.mean([[c[key] for c in p[:n]] for p in pts], 0), acc, marker="o",
                    label=a)
    axes[0].set(xlabel="cumulative sampled tokens", ylabel="no-hint accuracy")
    axes[1].set(xlabel="cumulative step seconds")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "efficiency.png", dpi=110)
    plt.close(fig)

    keys = [("reward/mean", "reward"), ("collapse/frac_all_zero", "all-zero groups"),
            ("collapse/frac_all_zero_after", "all-zero after hints / re-samples")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4))
    for ax, (key, label) in zip(axes, keys):
        for a in arms:
            n = min(len(r["curves"][key]) for r in by[a])
            curves = np.asarray([r["curves"][key][:n] for r in by[a]], np.float64)
            if curves.size:
                ax.plot(np.arange(1, n + 1), np.nanmean(curves, 0), label=a)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
