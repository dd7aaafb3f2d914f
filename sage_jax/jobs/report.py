"""A run's summary: a markdown table and a PNG plot from its metrics and accuracy by difficulty.

    write_summary(workdir, rows=read_metrics(workdir), accuracy={"SFT start": {8: .4, ...},
                  "after RL": {...}}, extra="...")

writes `summary.md` (the table, also returned as text) and `summary.png` (reward, all-zero
groups before and after hints, hint use per step, and accuracy by difficulty).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from sage_jax.infra.phases import phase_medians, phase_table

CURVES = (  # (metric, label) per panel of the training curves
    (("reward/mean", "reward"),),
    (("collapse/frac_all_zero", "all-zero groups"),
     ("collapse/frac_all_zero_after", "all-zero after hints")),
    (("hint/used_level_1", "hinted L1"), ("hint/used_level_2", "hinted L2"),
     ("hint/used_level_3", "hinted L3"), ("hint/rescued", "rescued")),
)


def _series(rows: Sequence[Mapping], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in rows if key in r and _finite(r[key])]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s), np.asarray(v, np.float64)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def training_table(rows: Sequence[Mapping], parts: int = 4) -> str:
    """Markdown: means of the main metrics over `parts` equal stretches of the run."""
    keys = [("reward/mean", "reward"), ("collapse/frac_all_zero", "all-zero"),
            ("collapse/frac_all_zero_after", "all-zero after hints"),
            ("hint/rescued", "rescued / step"), ("hint/frac_never_solved", "never solved"),
            ("time/step_s", "s / step")]
    keys = [(k, name) for k, name in keys if any(k in r for r in rows)]
    if not rows or not keys:
        return "(no training steps logged)"
    chunks = [c for c in np.array_split(np.arange(len(rows)), min(parts, len(rows))) if len(c)]
    lines = ["| steps | " + " | ".join(name for _, name in keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    for c in chunks:
        part = [rows[i] for i in c]
        cells = []
        for k, _ in keys:
            vals = [r[k] for r in part if k in r and _finite(r[k])]
            cells.append(f"{np.mean(vals):.3f}" if vals else "-")
        lines.append(f"| {part[0]['step']}-{part[-1]['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rescue_line(rows: Sequence[Mapping]) -> str:
    """One sentence: the all-zero groups of the run and how many hints rescued (made mixed)."""
    zero = sum(r.get("collapse/all_zero_groups", 0) or 0 for r in rows)
    rescued = sum(r.get("hint/rescued", 0) or 0 for r in rows)
    if not zero:
        return "No group was all-zero before hints."
    return (f"Rescued {rescued:.0f} of {zero:.0f} all-zero groups over the run "
            f"({rescued / zero:.0%}): re-sampled groups that came back mixed, so their prompt "
            f"reached the gradient.")


def accuracy_table(accuracy: Mapping[str, Mapping[int, float]]) -> str:
    """Markdown: pass rate by difficulty (rows) for each model (columns)."""
    if not accuracy:
        return "(no evaluation)"
    names = list(accuracy)
    ks = sorted({int(k) for a in accuracy.values() for k in a})
    lines = ["| steps (k) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for k in ks:
        cells = [f"{accuracy[n][k]:.3f}" if k in accuracy[n] else "-" for n in names]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    means = [f"{np.mean(list(accuracy[n].values())):.3f}" if accuracy[n] else "-"
             for n in names]
    lines.append("| all | " + " | ".join(means) + " |")
    return "\n".join(lines)


def plot(path: str | Path, rows: Sequence[Mapping],
         accuracy: Mapping[str, Mapping[int, float]] | None = None, title: str = "") -> Path:
    """Writes the PNG: one panel per group of `CURVES`, plus accuracy by difficulty."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(CURVES) + (1 if accuracy else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4), squeeze=False)
    for ax, curves in zip(axes[0], CURVES):
        for key, label in curves:
            s, v = _series(rows, key)
            if len(s):
                ax.plot(s, v, label=label, marker="." if len(s) < 40 else None)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("per step")
    if accuracy:
        ax = axes[0][-1]
        for name, acc in accuracy.items():
            ks = sorted(acc)
            ax.plot(ks, [acc[k] for k in ks], marker="o", label=name)
        ax.set_xlabel("difficulty (steps k)")
        ax.set_ylabel("no-hint pass rate")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(workdir: str | Path, rows: Sequence[Mapping],
                  accuracy: Mapping[str, Mapping[int, float]] | None = None, *,
                  title: str = "Summary", extra: str = "") -> str:
    """Writes workdir/summary.md and workdir/summary.png; returns the markdown."""
    workdir = Path(workdir)
    text = "\n\n".join(x for x in (
        f"# {title}", "## Training (means over stretches of the run)", training_table(rows),
        rescue_line(rows),
        "## Time by phase (median seconds per step, steps 3 on)",
        phase_table({"this run": phase_medians(rows)}),
        "## No-hint accuracy by difficulty", accuracy_table(accuracy or {}), extra,
        "![summary](summary.png)") if x) + "\n"
    (workdir / "summary.md").write_text(text)
    plot(workdir / "summary.png", rows, accuracy, title=title)
    return text
