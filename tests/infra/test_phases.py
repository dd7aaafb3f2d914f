"""The phase table of a step's time (`infra.phases`)."""

import math

from sage_jax.infra.phases import PHASES, STEP, phase_medians, phase_sum, phase_table


def _row(step_s, **parts):
    return {STEP: step_s, **{f"time/{k}_s": v for k, v in parts.items()}}


def test_phase_sum_counts_only_the_phases():
    r = _row(3.0, first_sample=1.0, update=1.5, host=0.25, sample=9.0, reward=9.0, resample=9.0)
    assert phase_sum(r) == 2.75


def test_medians_skip_the_compiling_steps_and_table_lists_every_phase():
    rows = [_row(100.0, update=99.0)] + [_row(s, update=s / 2, first_sample=s / 4)
                                         for s in (2.0, 4.0, 6.0)]
    m = phase_medians(rows, skip=1)
    assert m[STEP] == 4.0 and m["time/update_s"] == 2.0 and m["time/first_sample_s"] == 1.0
    assert m["time/hint_s"] == 0.0 and phase_medians([]) == {}
    assert phase_medians(rows, skip=9)[STEP] == 6.0  # a short run keeps its last step
    text = phase_table({"grpo": m, "empty": {}})
    lines = text.splitlines()
    assert len(lines) == 2 + len(PHASES) + 1 and "empty" not in text
    assert "| update (old log-probs + optimiser steps) | 2.000 (50%) |" in text
    assert lines[-1] == "| whole step | 4.000 |"
    assert phase_table({}) == "(no timed steps)" and not math.isnan(m[STEP])
