"""The toy study's report (`scripts/toy_study_report.py`) and claims table
(`scripts/study_claims.py`) on hand-made run results: the hard split's table and paired
differences; the toy studies' reconstructed provenance."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import reconstruct_provenance  # noqa: E402
import reproduce_toy  # noqa: E402
import study_claims  # noqa: E402
import toy_study_report as study  # noqa: E402


def _run(arm, seed, acc, hard, rest):
    return {"arm": arm, "seed": seed, "steps": 2, "median_step_s": 1.0 + (arm != "grpo"),
            "accuracy": {8: acc, 9: acc}, "split": {"hard": hard, "rest": rest},
            "never_solved": {"any": 0.5, "unhinted": 0.5},
            "rescue": {"all_zero": 4, "mixed": 2, "hinted": 2, "hinted_solved": 1,
                       "rate": {1: 0.0, 2: 0.5, 3: 1.0}, "tried": [2, 2, 1]},
            "transfer": {"hinted": [1, 2], "resampled": [0, 0], "stayed": [0, 1]},
            "curve": [{"step": 2, "tokens": 10.0, "seconds": 2.0, "accuracy": {8: acc, 9: acc}}],
            "curves": {k: [0.5, 0.5] for k in ("reward/mean", "collapse/frac_all_zero",
                                                "collapse/frac_all_zero_after")}}


def test_report_pairs_the_hard_split_by_seed(tmp_path):
    runs = [_run("grpo", 0, 0.5, 0.0, 0.9), _run("grpo", 1, 0.6, 0.1, 0.9),
            _run("sage-online", 0, 0.6, 0.2, 0.9), _run("sage-online", 1, 0.7, 0.4, 0.95)]
    start = [{"seed": s, "accuracy": {8: 0.4, 9: 0.4}, "split": {"hard": 0.0, "rest": 0.8}}
             for s in (0, 1)]
    text = study.report(runs, start, ["grpo", "sage-online"], tmp_path, "note")
    assert "## No-hint accuracy on the hard split" in text
    # hard split: sage-online 0.2, 0.4 vs grpo 0.0, 0.1 -> paired differences 0.2, 0.3
    m, h = study.interval([0.2 - 0.0, 0.4 - 0.1])
    assert f"| sage-online | 0.300 ± {study.interval([0.2, 0.4])[1]:.3f} | {m:.3f} ± {h:.3f} |" \
        in text
    assert "[claims.md](claims.md)" in text  # the claims are the claims table's
    claims = study_claims.markdown({"runs": runs}, "hand-made")
    row = next(x for x in claims.splitlines() if x.startswith("| sage-online − grpo |"))
    assert row.split(" | ")[1:4] == ["SAGE with self-written hints beats GRPO",
                                     "self-written vs none", "2"]
    assert row.split(" | ")[5] == f"{m:+.3f} ± {h:.3f} (not shown)"  # the hard split, paired
    assert "| sage-online | 2 | - | 0.00 M | 2.00 s | 2.00× (paired by seed) |" in text  # cost
    assert (tmp_path / "accuracy.png").is_file()


def test_contended_runs_are_left_out_of_the_times_only(tmp_path):
    runs = [_run("grpo", 0, 0.5, 0.0, 0.9), _run("grpo", 1, 0.6, 0.1, 0.9),
            _run("sage-online", 0, 0.6, 0.2, 0.9), _run("sage-online", 1, 0.7, 0.4, 0.95)]
    runs[3]["median_step_s"] = 9.0  # seed 1 shared the machine
    start = [{"seed": s, "accuracy": {8: 0.4, 9: 0.4}} for s in (0, 1)]
    (tmp_path / "contended.json").write_text('{"runs": ["sage-online-s1"]}')
    text = study.report(runs, start, ["grpo", "sage-online"], tmp_path, "note")
    assert "not from sage-online-s1 (contended.json)" in text
    assert "| sage-online | 1 | - | 0.00 M | 2.00 s | 2.00× (paired by seed) |" in text
    assert "| sage-online | 2 | 0.650 ± " in text  # its accuracy still counts


def test_phase_table_uses_the_timed_runs_that_logged_phases(tmp_path):
    runs = [_run("grpo", 0, 0.5, 0.0, 0.9), _run("sage-online", 0, 0.6, 0.2, 0.9),
            _run("sage-online", 1, 0.7, 0.4, 0.95)]
    runs[1]["phases"] = {"time/step_s": 4.0, "time/hint_s": 1.0, "time/update_s": 3.0}
    runs[2]["phases"] = {"time/step_s": 40.0, "time/hint_s": 10.0, "time/update_s": 30.0}
    (tmp_path / "contended.json").write_text('{"runs": ["sage-online-s1"]}')
    start = [{"seed": 0, "accuracy": {8: 0.4, 9: 0.4}}]
    text = study.report(runs, start, ["grpo", "sage-online"], tmp_path, "note")
    assert "| phase | sage-online (s) |" in text  # grpo logged no phases
    assert "| hint writing | 1.000 (25%) |" in text and "| whole step | 4.000 |" in text


@pytest.mark.parametrize("name", ["toy_study", "toy_tail"])
def test_the_toy_studies_runs_carry_their_reconstructed_provenance(name):
    """Every run of the two toy studies has a provenance entry, labelled as reconstructed; with
    the repository's history here, re-reading it gives the committed file (the commit whose
    results first hold the run, its parent, the arm's overrides there)."""
    folder = SCRIPTS.parent / "docs" / name
    prov = json.loads((folder / "provenance.json").read_text())
    results = json.loads((folder / "results.json").read_text())["runs"]
    assert set(prov["runs"]) == {f"{r['arm']}-s{r['seed']}" for r in results}
    assert prov["reconstructed"] is True and prov["label"].startswith("reconstructed")
    for run, entry in prov["runs"].items():
        assert entry["overrides"] and all("=" in o for o in entry["overrides"]), run
        assert all(len(entry[k]) == 40 for k in ("landed_in", "code_no_later_than")), run
    try:
        reconstruct_provenance.git("cat-file", "-e", prov["runs"][run]["landed_in"])
    except subprocess.CalledProcessError:
        pytest.skip("the repository's history is not here (a shallow clone)")
    assert reconstruct_provenance.reconstruct(folder) == prov


@pytest.mark.parametrize("name", ["toy_study", "toy_tail"])
def test_the_committed_toy_reports_are_their_results_rendered(name, tmp_path):
    """Each toy study's README is what its own command prints from the committed results
    (`--report-only` in a copy of the folder): no figure in it was typed."""
    folder = SCRIPTS.parent / "docs" / name
    readme = (folder / "README.md").read_text()
    command = readme.split("Command: `python scripts/reproduce_toy.py ")[1].split("`")[0].split()
    out = command[command.index("--out") + 1]
    copy = tmp_path / name
    shutil.copytree(folder, copy)
    command[command.index("--out") + 1] = str(copy)
    reproduce_toy.main([*command, "--report-only"])
    assert (copy / "README.md").read_text().replace(str(copy), out) == readme
