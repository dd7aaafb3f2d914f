"""The registered SmolLM2 study (`scripts/smollm2_study.py`, docs/smollm2_study/registration.md):
its report on hand-made runs, and the script end to end on a shrunken setting of the real model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

import eval_fixtures  # noqa: E402
import smollm2_study as study  # noqa: E402
import study_claims  # noqa: E402


def _run(arm, seed, rates):
    rates = np.asarray(rates, float)
    return {"arm": arm, "seed": seed, "accuracy": {"1": float(rates[:2].mean()),
                                                   "2": float(rates[2:].mean())},
            "per_problem": {"words-1": rates[:2].tolist(), "words-2": rates[2:].tolist()},
            "rl": {f"hint_right_level_{lvl}": 0.5 for lvl in (1, 2, 3)},
            "median_step_s": 10.0 * (1 + (arm != "grpo")), "wall_s": 600.0, "tokens": 2e6,
            "never_solved": {"any": 0.25, "unhinted": 0.5},
            "rescue": {"all_zero": 4, "mixed": 2, "tried": [4, 2, 1],
                       "rate": {"1": 0.5, "2": 0.5, "3": 1.0}}}


def test_registration_names_the_primary_contrast_the_code_reports_first():
    text = (REPO / study.REGISTRATION).read_text()
    a, b = study.PRIMARY
    assert f"**Primary contrast:** `{a} − {b}`" in text
    first = next(c for c in study_claims.CONTRASTS if c.primary)
    assert (first.a, first.b) == study.PRIMARY
    assert "scripts/smollm2_study.py --out docs/smollm2_study --seeds 3" in text
    assert set(study.ARMS) == {"grpo", "resample", "sage-online", "sage-ref"}


def test_report_pairs_over_seeds_and_over_problems(tmp_path):
    runs = [_run("grpo", s, [0.5, 0.5, 0.0, 0.0]) for s in (0, 1)]
    runs += [_run("resample", 0, [0.5, 0.5, 0.25, 0.0]), _run("resample", 1, [0.5, 0.75, 0.0, 0.0])]
    runs += [_run("sage-online", 0, [0.75, 0.5, 0.25, 0.25]),
             _run("sage-online", 1, [0.5, 0.75, 0.25, 0.0])]
    before = {"overall": 0.25, "se": 0.1}
    (tmp_path / "contended.json").write_text('{"runs": ["sage-online-s1"]}')
    text = study.report(runs, before, tmp_path, "python scripts/smollm2_study.py")
    # over problems: sage-online − resample per problem, averaged over seeds 0, 1
    d = np.mean([[0.25, 0.0, 0.0, 0.25], [0.0, 0.0, 0.25, 0.0]], axis=0)
    se = d.std(ddof=1) / 2
    assert (f"{d.mean():+.3f} (SE {se:.3f}; 95 % CI {d.mean() - 1.96 * se:+.3f}, "
            f"{d.mean() + 1.96 * se:+.3f})") in text
    assert "| sage-online | 2 | 0.250 / 0.500 | 0.50 / 0.50 / 1.00 | 0.50 / 0.50 / 0.50 | " \
           "20.0 s | 10.0 min | 2.00 M |" in text
    claims = (tmp_path / "claims.md").read_text()
    assert claims.index("| sage-online − resample |") < claims.index("| sage-online − grpo |")
    assert "Pre-registered in `docs/smollm2_study/registration.md`" in claims
    assert "| sage-online | 2 | 0.250 | 0.500 | 0.50 (4/8) | 2.00× (1) |" in claims  # s1 untimed
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["timed"] for r in saved["runs"] if r["arm"] == "sage-online"] == [True, False]


@pytest.fixture
def tiny_qwen(tmp_path_factory):
    return eval_fixtures.tiny_qwen(tmp_path_factory.getbasetemp())


@pytest.mark.slow
def test_the_study_runs_on_a_shrunken_setting_and_resumes(tiny_qwen, tmp_path):
    """The command end to end on a random 2-layer Qwen2 with the real tokenizer (no warm start,
    one RL step per run), on one CPU device as a user runs it: every arm's result file, the
    claims, and a second run that trains nothing."""
    out = tmp_path / "study"
    cmd = [sys.executable, str(REPO / "scripts" / "smollm2_study.py"), "--out", str(out),
           "--model", str(tiny_qwen), "--seeds", "1", "--arms", ",".join(study.ARMS),
           "--eval-per-length", "1", "--eval-samples", "1",
           f"task.words.cache_dir={tmp_path / 'cache'}", "task.words.max_steps=3",
           "task.words.sft_steps=0", "data.max_prompt_tokens=96", "rl.max_new_tokens=16",
           "hint.max_new_tokens=16", "train.steps=1", "checkpoint.every=1",
           "train.samples_every=0", "rl.prompts_per_step=2", "rl.group_size=2",
           "rl.micro_batch_size=4"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stderr[-3000:]
    for arm in study.ARMS:
        res = json.loads((out / "results" / f"{arm}-s0.json").read_text())
        assert res["provenance"]["seed"] == 0 and res["provenance"]["commit"]
        assert res["provenance"]["config"]["rl"]["method"] == arm.split("-")[0]
        assert sorted(res["per_problem"]) == ["words-1", "words-2", "words-3"]
        assert {"never_solved", "rescue", "rl", "median_step_s", "tokens"} <= set(res)
        assert f"{arm} seed 0: accuracy" in first.stdout
    ref = json.loads((out / "results" / "sage-ref-s0.json").read_text())["provenance"]
    assert ref["config"]["hint"]["source"] == "reference"
    assert "| sage-online − resample |" in (out / "claims.md").read_text()
    assert "Primary contrast over problems (sage-online − resample" in first.stdout
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "seed 0: accuracy" not in again.stdout  # nothing retrained
    assert (out / "README.md").read_text() in again.stdout
