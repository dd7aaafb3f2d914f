"""The registered SmolLM2 study (`scripts/smollm2_study.py`, docs/smollm2_study/registration.md):
its design against the registration, the report on hand-made runs (written only when every
registered run exists, from one commit and one warm start), and the script end to end on a
shrunken setting of the real model, stopped by SIGTERM in its first run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

import eval_fixtures  # noqa: E402
import smollm2_study as study  # noqa: E402
import study_claims  # noqa: E402

WARM = "ab" * 32


def _run(arm, seed, rates, *, timed=True, commit="c0ffee", warm=WARM, lr=1e-5):
    rates = np.asarray(rates, float)
    method = {"grpo": "grpo", "resample": "resample"}.get(arm, "sage")
    return {"arm": arm, "seed": seed, "accuracy": {"1": float(rates[:2].mean()),
                                                   "2": float(rates[2:].mean())},
            "per_problem": {"words-1": rates[:2].tolist(), "words-2": rates[2:].tolist()},
            "rl": {f"hint_right_level_{lvl}": 0.5 for lvl in (1, 2, 3)},
            "median_step_s": 10.0 * (1 + (arm != "grpo")), "wall_s": 600.0, "tokens": 2e6,
            "never_solved": {"any": 0.25, "unhinted": 0.5},
            "rescue": {"all_zero": 4, "mixed": 2, "tried": [4, 2, 1],
                       "rate": {"1": 0.5, "2": 0.5, "3": 1.0}},
            "timed": timed, "warm_start_sha256": warm,
            "provenance": {"commit": commit, "seed": seed,
                           "config": {"rl": {"method": method, "group_size": 4},
                                      "hint": {"source": "online"}, "optim": {"lr": lr},
                                      "train": {"seed": seed, "steps": 30}}}}


def test_the_design_is_the_registered_one():
    text = (REPO / study.REGISTRATION).read_text()
    design = study.load_design(REPO / study.DESIGN)
    a, b = study.PRIMARY
    assert f"**Primary contrast:** `{a} − {b}`" in text
    first = next(c for c in study_claims.CONTRASTS if c.primary)
    assert (first.a, first.b) == study.PRIMARY
    assert set(study.PRIMARY) <= set(design["arms"])
    assert len(design["seeds"]) >= 5 and design["eval"]["samples"] >= 8
    assert design["config"] == "smollm2_words"
    assert len(study.registered(design)) == len(design["arms"]) * len(design["seeds"])


def test_report_pairs_over_seeds_and_over_problems(tmp_path):
    runs = [_run("grpo", s, [0.5, 0.5, 0.0, 0.0]) for s in (0, 1)]
    runs += [_run("resample", 0, [0.5, 0.5, 0.25, 0.0]), _run("resample", 1, [0.5, 0.75, 0.0, 0.0])]
    runs += [_run("sage-online", 0, [0.75, 0.5, 0.25, 0.25]),
             _run("sage-online", 1, [0.5, 0.75, 0.25, 0.0], timed=False)]
    before = {"overall": 0.25, "se": 0.1, "weights_sha256": WARM}
    text = study.report(runs, before, tmp_path, "python scripts/smollm2_study.py")
    # over problems: sage-online − resample per problem, averaged over seeds 0, 1
    d = np.mean([[0.25, 0.0, 0.0, 0.25], [0.0, 0.0, 0.25, 0.0]], axis=0)
    se = d.std(ddof=1) / 2
    assert (f"{d.mean():+.3f} (SE {se:.3f}; 95 % CI {d.mean() - 1.96 * se:+.3f}, "
            f"{d.mean() + 1.96 * se:+.3f})") in text
    assert "| sage-online | 2 | 0.250 / 0.500 | 0.50 / 0.50 / 1.00 | 0.50 / 0.50 / 0.50 | " \
           "20.0 s (1) | 10.0 min | 2.00 M |" in text
    claims = (tmp_path / "claims.md").read_text()
    assert claims.index("| sage-online − resample |") < claims.index("| sage-online − grpo |")
    assert "Pre-registered in `docs/smollm2_study/registration.md`" in claims
    assert "| sage-online | 2 | 0.250 | 0.500 | 0.50 (4/8) | 2.00× (1) |" in claims  # s1 untimed


def _design(tmp_path, arms=("resample", "sage-online"), seeds=(0, 1)) -> Path:
    path = tmp_path / "design.json"
    path.write_text(json.dumps({
        "config": "smollm2_words", "arms": list(arms), "seeds": list(seeds),
        "eval": {"per_length": 1, "samples": 1}, "contended_cores": 0.15,
        "expected_minutes": {a: 1 for a in study.ARMS}}))
    return path


def test_a_partial_study_prints_progress_and_no_contrast(tmp_path, capsys):
    out = tmp_path / "out"
    design = _design(tmp_path)
    for r in (_run("resample", 0, [0.5, 0.5, 0.0, 0.0]),
              _run("sage-online", 0, [1.0, 1.0, 1.0, 1.0])):
        study._write_json(study.result_path(out, r["arm"], r["seed"]), r)
    assert study.main(["--out", str(out), "--design", str(design), "--partial"]) == 0
    printed = capsys.readouterr().out
    assert "PARTIAL PROGRESS (not a result): 2 of 4 registered runs finished" in printed
    assert "| sage-online-s1 | - | - | - | - |" in printed
    assert "accuracy" not in printed and "contrast" not in printed.replace(
        "the contrasts are read only when all exist", "")
    assert not (out / "claims.md").exists() and not (out / "README.md").exists()


def test_results_from_two_commits_two_warm_starts_or_two_configs_are_refused():
    warm = {"weights_sha256": WARM}
    same = [_run("resample", 0, [0.5] * 4), _run("sage-online", 0, [0.5] * 4)]
    study.check_consistent(same, warm)
    for odd, says in ((dict(commit="beef"), "clean commit"), (dict(warm="cd" * 32), "warm start"),
                      (dict(lr=1e-6), "another config")):
        with pytest.raises(study.StudyError, match=says):
            study.check_consistent([same[0], _run("sage-online", 1, [0.5] * 4, **odd)], warm)
    with pytest.raises(study.StudyError, match="clean commit"):
        study.check_consistent([_run("grpo", 0, [0.5] * 4, commit="c0ffee+dirty")], warm)


def test_a_retrained_warm_start_with_other_weights_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "warm"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"other weights")
    monkeypatch.setattr(study.hf_warm_start, "warm_start_folder", lambda cfg: folder)
    out = tmp_path / "out"
    study._write_json(out / "warm_start.json", {"weights_sha256": WARM})
    design = study.load_design(_design(tmp_path))
    with pytest.raises(study.StudyError, match="differs from the study's"):
        study.warm_start(out, design, ["model.path=/nowhere"])
    sha = study.hf_warm_start.weights_sha256(folder)
    study._write_json(out / "warm_start.json", {"weights_sha256": sha})
    assert study.warm_start(out, design, ["model.path=/nowhere"])["weights_sha256"] == sha


def test_contention_is_more_than_the_limit_of_other_cores():
    assert not study.is_contended(0.02, 0.15)
    assert study.is_contended(0.4, 0.15)
    assert study.is_contended(None, 0.15)  # not measured: not timed


@pytest.fixture
def tiny_qwen(tmp_path_factory):
    return eval_fixtures.tiny_qwen(tmp_path_factory.getbasetemp())


def _wait_for_rows(path: Path, rows: int, proc, limit_s: float) -> None:
    end = time.time() + limit_s
    while time.time() < end and proc.poll() is None:
        if path.is_file() and len(path.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never had {rows} rows (runner exit {proc.poll()})")


@pytest.mark.slow
def test_the_study_stops_on_sigterm_resumes_and_reports_when_complete(tiny_qwen, tmp_path):
    """The command on a random 2-layer Qwen2 with the real tokenizer (no warm start), on one CPU
    device as a user runs it: SIGTERM during the first run's second step ends the runner with
    nothing recorded and no second run started; the re-run resumes it (untimed), runs the other
    arm, and writes the report; a third run trains nothing."""
    out = tmp_path / "study"
    cmd = [sys.executable, str(REPO / "scripts" / "smollm2_study.py"), "--out", str(out),
           "--model", str(tiny_qwen), "--design", str(_design(tmp_path, seeds=(0,))),
           f"task.words.cache_dir={tmp_path / 'cache'}", "task.words.max_steps=3",
           "task.words.sft_steps=0", "data.max_prompt_tokens=96", "rl.max_new_tokens=16",
           "hint.max_new_tokens=16", "train.steps=4", "checkpoint.every=1",
           "train.samples_every=0", "rl.prompts_per_step=2", "rl.group_size=2",
           "rl.micro_batch_size=4", "--allow-dirty"]  # the suite may run on uncommitted work
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for_rows(out / "runs" / "resample-s0" / "metrics.jsonl", 1, proc, 900)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "resample-s0 stopped before its last step: not recorded" in stdout
    assert not (out / "results").exists() and not (out / "runs" / "sage-online-s0").exists()
    warm = json.loads((out / "warm_start.json").read_text())

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((out / "results" / "resample-s0.json").read_text())
    fresh = json.loads((out / "results" / "sage-online-s0.json").read_text())
    assert resumed["machine"]["resumed"] and not resumed["timed"]
    assert not fresh["machine"]["resumed"] and "other_cores" in fresh["machine"]
    assert resumed["rl"]["steps"] == fresh["rl"]["steps"] == 4  # each step logged once
    for res, arm in ((resumed, "resample"), (fresh, "sage-online")):
        assert res["warm_start_sha256"] == warm["weights_sha256"]
        assert res["provenance"]["seed"] == 0 and res["provenance"]["commit"]
        assert res["provenance"]["config"]["rl"]["method"] == arm.split("-")[0]
        assert sorted(res["per_problem"]) == ["words-1", "words-2", "words-3"]
    assert "| sage-online − resample |" in (out / "claims.md").read_text()
    assert "Primary contrast over problems (sage-online − resample" in again.stdout

    third = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0 and "finished in" not in third.stdout  # nothing retrained
    assert (out / "README.md").read_text() in third.stdout


def test_the_amendment_states_the_design_and_the_power_the_code_computes():
    text = (REPO / study.REGISTRATION).read_text()
    amendment = text[text.index("## Amendment of 2026-12-07"):]
    design = study.load_design(REPO / study.DESIGN)
    assert f"Arms: {', '.join(f'`{a}`' for a in design['arms'])}." in amendment
    assert f"Seeds 0-{max(design['seeds'])}" in amendment and design["seeds"] == list(range(5))
    assert (f"{design['eval']['per_length'] * 6} held-out problems "
            f"({design['eval']['per_length']} per length 1-6), "
            f"**{design['eval']['samples']} samples each**") in amendment
    assert f"at most {design['contended_cores']} cores" in amendment
    pin = amendment.split("**Pinned commit: `")[1].split("`")[0]
    assert len(pin) == 40
    assert f"git worktree add ../sage-smollm2-study {pin}" in amendment
    assert f"--pin {pin}" in amendment
    at_pin = subprocess.run(["git", "-C", str(REPO), "show", f"{pin}:{study.DESIGN}"],
                            capture_output=True, text=True)
    if at_pin.returncode == 0:  # a checkout with history: the design is the pinned one
        assert json.loads(at_pin.stdout) == design
    rows = []
    for seed_sd in (0.0060, 0.0100, 0.0200):
        p = study.power(pilot_se=0.020, pilot_samples=4, seed_sd=seed_sd,
                        seeds=len(design["seeds"]), samples=design["eval"]["samples"])
        rows.append(f"| {seed_sd:.4f} | {p['sd']:.4f} | {p['half_width']:.3f} | {p['mde']:.3f} |")
        if seed_sd == 0.0060:
            assert (f"per-seed SD {p['sd']:.4f}, **expected 95 % half-width "
                    f"{p['half_width']:.3f}**, minimum\n  detectable effect **{p['mde']:.3f}**"
                    ) in amendment
            assert f"At 8 samples\n  that is {p['eval_sd']:.4f}." in amendment
            assert p["half_width"] <= 0.02
    assert "\n".join(rows) in amendment


def test_the_assumed_training_sd_is_the_toy_studys():
    runs = json.loads((REPO / "docs/toy_tail/results.json").read_text())["runs"]
    d = study_claims.paired(runs, *study.PRIMARY, "all")
    assert len(d) == 5 and f"{np.std(d, ddof=1):.4f}" == "0.0060"
