"""The studies' claims tables (`scripts/study_claims.py`) are what the committed results say, and
the README, the studies' readings and the toy job quote nothing else: a number that drifts from
its results file fails here."""

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import study_claims  # noqa: E402

STUDIES = ("toy_tail", "toy_study")
NUMBER = re.compile(r"[+-]?\d+\.\d+[×%]?|\d+%|\d+/\d+")
# the paper's own figures and model names, quoted beside ours
NOT_OURS = ("(paper: 2.3×)", "1.5B-7B", "Llama-3.2-3B")
BLOCK = re.compile(r"<!-- claims: (\S+) -->\n(.*?)\n<!-- /claims -->", re.S)


def numbers(text: str) -> set[str]:
    text = text.replace("−", "-")
    for phrase in NOT_OURS:
        text = text.replace(phrase, "")
    return set(NUMBER.findall(text))


def unsourced(text: str, *sources: str) -> set[str]:
    """The numbers of `text` that none of `sources` holds (minus signs in either spelling)."""
    pool = " ".join(s.replace("−", "-") for s in sources)
    return {n for n in numbers(text) if n not in pool}


def section(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i:text.index(end, i)]


@pytest.mark.parametrize("study", STUDIES)
def test_claims_table_is_generated_from_the_results(study):
    folder = REPO / "docs" / study
    results = json.loads((folder / "results.json").read_text())
    assert (folder / "claims.md").read_text() == study_claims.markdown(
        results, study_claims.TITLES[study]), f"rerun python scripts/study_claims.py docs/{study}"


def test_primary_contrasts_include_self_written_hints_against_resampling():
    primary = [(c.a, c.b, c.hints) for c in study_claims.CONTRASTS if c.primary]
    assert ("sage-online", "resample", "self-written vs none") in primary
    assert ("sage-ref", "resample", "reference vs none") in primary


def test_paired_interval_and_labels_on_hand_made_runs():
    def run(arm, seed, acc, hard, rest):
        return {"arm": arm, "seed": seed, "accuracy": {8: acc, 9: acc},
                "split": {"hard": hard, "rest": rest}, "median_step_s": 1.0,
                "never_solved": {"any": 0.5, "unhinted": 0.5},
                "rescue": {"all_zero": 10, "mixed": 0}}
    runs = [run("resample", 0, 0.5, 0.1, 0.9), run("resample", 1, 0.6, 0.2, 0.9),
            run("sage-online", 0, 0.6, 0.3, 0.9), run("sage-online", 1, 0.8, 0.3, 0.8)]
    (row,) = study_claims.claims(runs)
    m, h = study_claims.interval([0.1, 0.2])
    assert row["all"] == f"{m:+.3f} ± {h:.3f} (not shown)"
    assert row["hard"].startswith("+0.150 ± ")
    assert row["contrast"].hints == "self-written vs none"
    assert row["note"].startswith("not a test of SAGE: sage-online's hints rescued 0 of 20")
    text = study_claims.markdown({"runs": runs}, "hand-made")
    assert "2 contrasts" not in text and "3 intervals are reported (1 contrasts × 3 splits)" in text


def test_readme_quotes_the_claims_tables_verbatim():
    readme = (REPO / "README.md").read_text()
    blocks = BLOCK.findall(readme)
    assert {path for path, _ in blocks} == {f"docs/{s}/claims.md" for s in STUDIES}
    for path, block in blocks:
        table = (REPO / path).read_text().splitlines()
        assert [line for line in block.splitlines() if line not in table] == [], path
    assert "sage-online − resample" in dict(blocks)["docs/toy_tail/claims.md"]


def test_readme_readings_and_job_numbers_come_from_results_files():
    claims = {s: (REPO / "docs" / s / "claims.md").read_text() for s in STUDIES}
    readme = (REPO / "README.md").read_text()
    toy = section(readme, "What it shows of the paper's claims", "**On a real LLM.**")
    cost = section((REPO / "docs" / "benchmarks.md").read_text(), "<!-- step_cost -->",
                   "<!-- /step_cost -->")  # the step-cost sitting (test_bench_docs.py)
    assert unsourced(toy, *claims.values(), cost) == set()
    smol = section(readme, "After the warm start the model writes hints", "docs/smollm2_laptop.md")
    record = (REPO / "docs" / "smollm2_laptop.md").read_text()
    assert unsourced(smol, section(record, "SAGE − GRPO after RL, paired", "\n")) == set()
    assert "+0.035" in smol and "−0.004, +0.075" in smol and "one training run" in smol
    for s in STUDIES:
        reading = (REPO / "docs" / s / "reading.md").read_text()
        generated = (REPO / "docs" / s / "README.md").read_text().replace(reading.strip(), "")
        assert unsourced(reading, claims[s], generated) == set(), s
    job = (REPO / "docs" / "toy_job.md").read_text()
    assert "±" not in job and not re.search(r"± ?\d", (REPO / "sage_jax" / "jobs" /
                                                       "toy_job.py").read_text())


def test_the_default_jobs_measured_gate_is_its_results_file():
    doc = (REPO / "docs" / "toy_job.md").read_text()
    gate = json.loads((REPO / "docs" / "toy_job_gate.json").read_text())
    acc, cal = gate["calibration"]["hint_write_acc"], gate["calibration"]
    assert cal["hint_source"] == "online" and gate["provenance"]["config"]["train"]["steps"] == 20
    assert (f"level 1 {acc['1']:.0%}, level 2 {acc['2']:.0%}, level 3 {acc['3']:.0%} of the time "
            f"(parsed {cal['hint_parse_rate']:.0%})") in " ".join(doc.split())

    # the job timed on a quiet machine with empty caches: its record, and what its summary said
    t = json.loads((REPO / "docs" / "toy_job_time_2026-12-08.json").read_text())
    assert t["exit_status"] == 0 and t["steps"] == t["config"]["train"]["steps"] == 20
    assert t["config"]["rl"]["method"] == "sage" and len(t["commit"]) == 40
    assert (f"the job took {t['elapsed_s']:.0f} s from start to summary, at a peak RSS of "
            f"{t['peak_rss_mib']:,.0f} MiB; its 20 RL steps' median step was "
            f"{t['median_step_s']:.2f} s") in " ".join(doc.split())
    assert t["hard_split_line"].startswith("**20 RL steps did not move it**")
    assert "did not move the hard split (pass rate after − before +0.000 over its 81 problems)" \
        in " ".join(doc.split()) and "+0.000" in t["hard_split_line"]
    assert "81 problems" in t["hard_split_line"]


def test_a_drifted_number_is_caught():
    claims = (REPO / "docs" / "toy_tail" / "claims.md").read_text()
    assert unsourced("sage-online − resample: -0.002 ± 0.007", claims) == set()
    assert unsourced("sage-online − resample: -0.003 ± 0.007", claims) == {"-0.003"}
    assert unsourced("costs 3.7× GRPO's", claims) == {"3.7×"}
