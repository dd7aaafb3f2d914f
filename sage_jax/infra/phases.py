"""Where a step's time goes: the phases of `time/step_s`, disjoint and in order, and their table.

Every run's metrics.jsonl has one `time/<phase>_s` per phase below; they add up to
`time/step_s` (up to the few statements between the timed sections). `time/sample_s`,
`time/reward_s` and `time/resample_s` are totals over every sampler call, every scoring call
and every re-sample level, so they overlap the phases and are not part of the sum.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

PHASES = (  # (metric, label), in the order a step runs them
    ("time/first_sample_s", "first pass: sample"),
    ("time/first_reward_s", "first pass: reward"),
    ("time/hint_s", "hint writing"),
    ("time/resample_level_1_s", "re-sample level 1 (sample + reward)"),
    ("time/resample_level_2_s", "re-sample level 2 (sample + reward)"),
    ("time/resample_level_3_s", "re-sample level 3 (sample + reward)"),
    ("time/rollout_host_s", "rollout host work (prompts, status, tables)"),
    ("time/host_s", "host work between phases (batch, memory trims, program drops)"),
    ("time/update_s", "update (old log-probs + optimiser steps)"),
)
STEP = "time/step_s"


def phase_sum(row: Mapping[str, float]) -> float:
    """The sum of a metrics row's phases (missing ones count 0)."""
    return float(sum(row.get(k, 0.0) for k, _ in PHASES))


def phase_medians(rows: Sequence[Mapping], skip: int = 2) -> dict[str, float]:
    """Median seconds of each phase and of the whole step over `rows[skip:]` (the first steps
    compile; a shorter run keeps its last step); {} without rows."""
    rows = [r for r in rows[min(skip, max(len(rows) - 1, 0)):] if STEP in r]
    if not rows:
        return {}
    return {k: float(np.median([r.get(k, 0.0) for r in rows])) for k, _ in (*PHASES, (STEP, ""))}


def phase_table(columns: Mapping[str, Mapping[str, float]]) -> str:
    """Markdown: one row per phase, one column per run (each `phase_medians`), the share of the
    step in brackets; a last row with the whole step. '(no timed steps)' when all are empty."""
    columns = {name: m for name, m in columns.items() if m}
    if not columns:
        return "(no timed steps)"
    names = list(columns)
    lines = ["| phase | " + " | ".join(f"{n} (s)" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for key, label in (*PHASES, (STEP, "whole step")):
        cells = []
        for n in names:
            v, step = columns[n].get(key, math.nan), columns[n].get(STEP, math.nan)
            share = f" ({v / step:.0%})" if key != STEP and step > 0 else ""
            cells.append(f"{v:.3f}{share}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
