"""Tests for sage_jax.tasks.benchmarks on the real benchmark files in shared/data."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sage_jax.infra.rewards import RewardPool
from sage_jax.tasks.math_grading import math_reward_checked, parse_answer
from sage_jax.tasks.benchmarks import (
    ALL_BENCHMARKS,
    BENCHMARKS,
    Problem,
    benchmark_path,
    load_benchmark,
    normalize_answer,
)

DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"

ROWS = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva_math": 272,
        "olympiadbench": 675, "gsm8k": 1319, "gpqa_diamond": 198}
LAYOUTS = {name: ("jsonl", "verl") for name in BENCHMARKS}
LAYOUTS.update(gsm8k=("jsonl",), gpqa_diamond=("verl",))
MATH_BENCHMARKS = BENCHMARKS + ("gsm8k",)
WRONG = "The answer is \\boxed{\\text{wrong}}."  # matches no ground truth, cheap to reject

FILES = [(name, layout) for name in ALL_BENCHMARKS for layout in LAYOUTS[name]]

# Ground truths math-verify can only read as text (so only identical text matches them).
TEXT_ONLY_ANSWERS = {
    # minerva_math row 269: latex2sympy reads E as Euler's number and cannot subscript it.
    "E_{1},E_{2}": "minerva_math",
}


RIGHT, REJECTS_WRONG, IS_MATH = 1, 2, 4


def ground_truth_checks(response: str, ground_truth: str) -> float:
    """Flags for one ground truth, checked in one worker so its parse is cached: RIGHT when the
    response (its boxed self) scores 1 with the math reward, REJECTS_WRONG when WRONG scores 0, and
    IS_MATH when math-verify reads it as a math object (else only identical text can match it)."""
    flags = RIGHT * (math_reward_checked(response, ground_truth) == 1.0)
    flags += REJECTS_WRONG * (math_reward_checked(WRONG, ground_truth) == 0.0)
    flags += IS_MATH * any(not isinstance(x, str) for x in parse_answer(ground_truth))
    return float(flags)


def test_benchmark_lists():
    assert BENCHMARKS == ("aime24", "aime25", "amc23", "math500", "minerva_math",
                          "olympiadbench")
    assert set(ALL_BENCHMARKS) == set(BENCHMARKS) | {"gsm8k", "gpqa_diamond"}


@pytest.mark.parametrize("name, layout", FILES)
def test_every_file_loads_completely(name, layout):
    problems = load_benchmark(name, DATA_DIR, layout=layout)
    assert len(problems) == ROWS[name]
    for i, p in enumerate(problems):
        assert isinstance(p, Problem)
        assert p.index == i and p.source == name
        assert p.problem.strip() and p.answer.strip(), (name, layout, i)
        assert "\x0c" not in p.problem and p.answer == p.answer.strip()


@pytest.mark.parametrize("name, index, answer", [
    ("aime24", 0, "204"),
    ("aime24", 29, "902"),
    ("aime25", 0, "70"),
    ("aime25", 1, "588"),
    ("amc23", 0, "27"),  # stored as the float 27.0 (JSONL) / the string "27.0" (verl)
    ("amc23", 39, "8"),
    ("math500", 0, "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("math500", 4, "\\text{Evelyn}"),
    ("minerva_math", 0, "1.6"),
    ("minerva_math", 57, "0.53"),  # verl's ground_truth here is the previous sub-question's
    ("minerva_math", 5, "\\arcsin(10/13)"),  # written np.arcsin(10/13) upstream
    ("olympiadbench", 0, "2"),
    ("olympiadbench", 13, "69,84"),  # final_answer ['$69$,$84$']
    ("olympiadbench", 34, "m_{\\max }=n^{2}-n-1"),
    ("olympiadbench", 96, "(0,4]"),  # "t(0,4]" upstream
])
def test_spot_checked_answers_in_both_layouts(name, index, answer):
    for layout in LAYOUTS[name]:
        assert load_benchmark(name, DATA_DIR, layout=layout)[index].answer == answer, layout


def test_spot_checked_single_layout_answers():
    gsm8k = load_benchmark("gsm8k", DATA_DIR)
    assert (gsm8k[0].answer, gsm8k[146].answer, gsm8k[611].answer) == ("18", "2125", "1450000")
    assert gsm8k[0].problem.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    gpqa = load_benchmark("gpqa_diamond", DATA_DIR)
    assert [p.answer for p in gpqa[:2]] == ["A", "A"] and gpqa[-1].answer == "D"
    assert all(p.answer in "ABCD" for p in gpqa)
    assert "Two quantum states with energies E1 and E2" in gpqa[0].problem


def test_problem_texts():
    math500 = load_benchmark("math500", DATA_DIR, layout="verl")
    assert math500[0].problem.startswith("Convert the point $(0,3)$ in rectangular coordinates")
    aime25 = load_benchmark("aime25", DATA_DIR, layout="verl")
    assert "\\frac{\\log_k" in aime25[18].problem and "\\triangle ABC" in aime25[19].problem
    raw = load_benchmark("aime25", DATA_DIR, layout="verl", repair=False)
    assert "\x0crac" in raw[18].problem and "\triangle" in raw[19].problem


def test_repair_false_keeps_upstream_ground_truths():
    raw = load_benchmark("minerva_math", DATA_DIR, layout="verl", repair=False)
    assert raw[57].answer == "4.4e7"
    assert load_benchmark("olympiadbench", DATA_DIR, repair=False)[96].answer == "t(0,4]"


def test_layouts_agree_and_auto_picks_a_file():
    for name in BENCHMARKS:
        jsonl = load_benchmark(name, DATA_DIR, layout="jsonl")
        verl = load_benchmark(name, DATA_DIR, layout="verl")
        assert [p.answer for p in jsonl] == [p.answer for p in verl], name
    assert load_benchmark("math500", DATA_DIR) == load_benchmark("math500", DATA_DIR,
                                                                 layout="jsonl")
    assert len(load_benchmark("gpqa_diamond", DATA_DIR)) == 198  # verl is its only layout
    assert len(load_benchmark("olympiadbench", DATA_DIR, limit=5)) == 5


def test_the_benchmark_folder_itself_is_a_data_dir_too():
    """--data-dir may be the data folder or the folder holding <name>/test.jsonl (or
    <name>.parquet) itself."""
    for layout, folder in (("jsonl", "eval"), ("verl", "eval_verl")):
        inside = load_benchmark("amc23", DATA_DIR / folder, layout=layout)
        assert inside == load_benchmark("amc23", DATA_DIR, layout=layout) and len(inside) == 40
    assert load_benchmark("math500", DATA_DIR / "eval", limit=3) == load_benchmark(
        "math500", DATA_DIR, limit=3)


def test_reexported_normalize_answer():
    assert normalize_answer(27.0) == "27"
    assert normalize_answer(" $x+1$ ") == "x+1"


# ----------------------------------------------------------------------------- errors


def test_unknown_benchmark_lists_known_ones():
    with pytest.raises(ValueError, match="known: aime24, aime25"):
        load_benchmark("aime99", DATA_DIR)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="gsm8k.parquet"):
        load_benchmark("gsm8k", DATA_DIR, layout="verl")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_benchmark("aime24", tmp_path)
    with pytest.raises(ValueError, match="layout"):
        benchmark_path("aime24", DATA_DIR, "csv")  # type: ignore[arg-type]


def _write_jsonl(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    path = benchmark_path(name, tmp_path, "jsonl")
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name, bad_row, field", [
    ("aime24", {"problem": "p"}, "'answer'"),
    ("aime24", {"problem": "p", "answer": "  "}, "'answer'"),
    ("aime24", {"answer": "3"}, "'problem' or 'question'"),
    ("minerva_math", {"problem": "p", "solution": "no box"}, "'solution'"),
    ("gsm8k", {"question": "q", "answer": "no marker"}, "'answer'"),
    ("olympiadbench", {"question": "q", "final_answer": []}, "'final_answer'"),
])
def test_jsonl_rows_without_ground_truth(tmp_path, name, bad_row, field):
    good = {"problem": "p", "question": "q", "answer": "1 #### 1", "solution": "\\boxed{1}",
            "final_answer": ["1"]}
    path = _write_jsonl(tmp_path, name, [good, bad_row])
    with pytest.raises(ValueError, match=f"{path}: row 1.*{field}"):
        load_benchmark(name, tmp_path, layout="jsonl")


def test_invalid_json_line_is_named(tmp_path):
    path = _write_jsonl(tmp_path, "aime24", [{"problem": "p", "answer": "1"}])
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match="line 2"):
        load_benchmark("aime24", tmp_path)


def test_verl_row_without_ground_truth(tmp_path):
    path = benchmark_path("aime24", tmp_path, "verl")
    path.parent.mkdir(parents=True)
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]
    rows = [{"prompt": prompt, "reward_model": {"ground_truth": "1", "style": "rule"}},
            {"prompt": prompt, "reward_model": {"ground_truth": "", "style": "rule"}}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"row 1.*reward_model\.ground_truth"):
        load_benchmark("aime24", tmp_path, layout="verl")


# ----------------------------------------------------------------------------- scoring


@pytest.fixture(scope="module")
def pool():
    with RewardPool(math_reward_checked, num_workers=2, timeout_s=20.0) as p:
        yield p


@pytest.mark.parametrize("name", MATH_BENCHMARKS)
@pytest.mark.slow
def test_every_ground_truth_scores_right_and_rejects_wrong(pool, name):
    """Every row in every layout: ``\\boxed{<ground truth>}`` scores 1, a wrong answer scores 0,
    and math-verify reads the ground truth as math (except the documented TEXT_ONLY_ANSWERS).

    The reward depends only on (response, ground truth), so each distinct answer is checked once.
    """
    rows = {}
    for layout in LAYOUTS[name]:
        for p in load_benchmark(name, DATA_DIR, layout=layout):
            rows.setdefault(p.answer, (layout, p.index))
    answers = sorted(rows)
    responses = ["... so the answer is \\boxed{" + a + "}" for a in answers]
    flags, stats = pool.score(responses, answers, fn=ground_truth_checks)
    assert stats["timeouts"] == stats["errors"] == stats["rejected"] == 0, stats
    flags = flags.astype(int)
    not_right = [(rows[a], a) for a, f in zip(answers, flags) if not f & RIGHT]
    not_wrong = [(rows[a], a) for a, f in zip(answers, flags) if not f & REJECTS_WRONG]
    text_only = {a for a, f in zip(answers, flags) if not f & IS_MATH}
    expected_text_only = {a for a, n in TEXT_ONLY_ANSWERS.items() if n == name}
    assert not not_right, f"boxed ground truth not accepted: {not_right}"
    assert not not_wrong, f"wrong answer accepted: {not_wrong}"
    unexpected = text_only ^ expected_text_only
    assert not unexpected, f"text-only ground truths: {[(rows.get(a), a) for a in unexpected]}"
