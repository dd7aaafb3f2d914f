"""Loaders for the math evaluation benchmarks, in Qwen-eval JSONL and verl parquet layouts.

`data_dir` is the folder holding ``eval/<name>/test.jsonl`` (Qwen-eval layout) and
``eval_verl/<name>.parquet`` (verl layout). Both layouts give the same problems in the same order;
``Problem.index`` is the row's position in its file.

Known upstream defects, repaired by default (``repair=True``):
- verl minerva_math: ``reward_model.ground_truth`` is wrong in dozens of rows (in multi-part
  questions it is often the previous sub-question's answer, quoted in the prompt). The answer is
  taken from the last box of ``extra_info.solution`` instead, the same solution text as the
  Qwen-eval file, so both layouts agree.
- olympiadbench: one ground truth is malformed in both layouts ("t(0,4]" for t in (0, 4]).
- verl aime25: a JSON-escaping bug turned "\\f" and "\\t" of LaTeX commands in problem texts
  into control characters (form feed + "rac" for "\\frac", TAB + "riangle" for "\\triangle").
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq

from sage_jax.tasks.math_grading import extract_boxed, normalize_answer

__all__ = ["ALL_BENCHMARKS", "ANSWER_FORMS", "BENCHMARKS", "Problem", "benchmark_path",
           "load_benchmark", "normalize_answer", "read_fields", "repair_escapes", "to_problems"]

BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench")
"""The paper's six in-distribution benchmarks (their mean accuracy is the headline number)."""

ALL_BENCHMARKS = BENCHMARKS + ("gsm8k", "gpqa_diamond")
"""Every benchmark with a loader; gpqa_diamond (answers A-D) exists only in the verl layout."""

Layout = Literal["auto", "jsonl", "verl"]

# Upstream JSON-escaping bug in some verl files: "\f" and "\t" of LaTeX commands became control
# characters (e.g. "\x0c" + "rac" for "\frac", TAB + "riangle" for "\triangle").
_FORM_FEED_RE = re.compile("\x0c")
_TAB_COMMAND_RE = re.compile("\t(?=(?:riangle|imes|heta|frac|ext|extbf|ilde|au)\\b)")
_NUMPY_CALL_RE = re.compile(r"\bnp\.(?=[a-z]+\()")  # Minerva writes e.g. np.arcsin(10/13)

# Ground truths that are malformed upstream (same text in both layouts), by benchmark.
_ANSWER_FIXES = {
    "olympiadbench": {"t(0,4]": "(0,4]"},  # "all t such that ...": t in (0, 4]; "\in" was lost
}


@dataclass(frozen=True)
class Problem:
    """One evaluation problem: its text, normalised ground-truth answer, row index and benchmark."""

    problem: str
    answer: str
    index: int
    source: str


def benchmark_path(name: str, data_dir: str | Path, layout: Literal["jsonl", "verl"]) -> Path:
    """Where the file of benchmark `name` lives in `layout` under `data_dir`: the data folder
    (`eval/<name>/test.jsonl`, `eval_verl/<name>.parquet`) or the benchmark folder itself
    (`<name>/test.jsonl`, `<name>.parquet`)."""
    data_dir = Path(data_dir)
    if layout == "jsonl":
        inside = data_dir / name / "test.jsonl"
        return inside if inside.is_file() else data_dir / "eval" / name / "test.jsonl"
    if layout == "verl":
        inside = data_dir / f"{name}.parquet"
        return inside if inside.is_file() else data_dir / "eval_verl" / f"{name}.parquet"
    raise ValueError(f"unknown layout {layout!r}; expected 'jsonl' or 'verl'")


def load_benchmark(name: str, data_dir: str | Path, *, layout: Layout = "auto",
                   limit: int | None = None, repair: bool = True) -> list[Problem]:
    """Problems of benchmark `name` (one of `ALL_BENCHMARKS`), at most `limit` of them.

    `layout="auto"` uses the JSONL file when present, else the parquet file. `repair=False` keeps
    the known upstream defects (see the module docstring) as the files have them.
    """
    if name not in ALL_BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(ALL_BENCHMARKS)}")
    if layout == "auto":
        jsonl = benchmark_path(name, data_dir, "jsonl")
        layout = "jsonl" if jsonl.is_file() else "verl"
    path = benchmark_path(name, data_dir, layout)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark {name!r} ({layout} layout): no file at {path}")
    rows = _read_jsonl(path) if layout == "jsonl" else pq.read_table(path).to_pylist()
    return to_problems(name, rows, str(path), _from_jsonl if layout == "jsonl" else _from_verl,
                       limit=limit, repair=repair)


RowReader = Callable[[str, dict[str, Any], str, bool], tuple[str, str]]
"""(benchmark, row, where, repair) -> (problem text, normalised answer); ValueError naming where."""


def to_problems(name: str, rows: list[dict[str, Any]], where: str, read: RowReader, *,
                limit: int | None = None, repair: bool = True) -> list[Problem]:
    """The first `limit` of `rows` as `Problem`s of benchmark `name`, each read by `read`, with
    the known malformed ground truths fixed when `repair`."""
    rows = rows if limit is None else rows[:limit]
    problems = []
    for i, row in enumerate(rows):
        text, answer = read(name, row, f"{where}: row {i}", repair)
        if repair:
            answer = _ANSWER_FIXES.get(name, {}).get(answer, answer)
        problems.append(Problem(problem=text, answer=answer, index=i, source=name))
    return problems


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i + 1} is not valid JSON: {e}") from None
    return rows


def _field(row: dict[str, Any], keys: tuple[str, ...], where: str) -> Any:
    for key in keys:
        value = row.get(key)
        if value is not None and value != "":
            return value
    wanted = " or ".join(repr(k) for k in keys)
    raise ValueError(f"{where}: no {wanted} field (keys: {sorted(row)})")


def _checked_answer(raw: Any, where: str, field: str) -> str:
    try:
        answer = normalize_answer(raw)
        answer = _NUMPY_CALL_RE.sub("\\\\", answer)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad ground truth in field {field!r}: {e}") from None
    if not answer:
        raise ValueError(f"{where}: empty ground truth in field {field!r} ({raw!r})")
    return answer


def _gsm8k_answer(text: str, where: str) -> str:
    if "####" not in text:
        raise ValueError(f"{where}: field 'answer' has no '#### <number>' line")
    return text.rsplit("####", 1)[1].strip().replace(",", "")


def _olympiad_answer(final_answer: Any, where: str) -> str:
    """OlympiadBench's final_answer: a list of strings (or its string form), joined by commas."""
    if isinstance(final_answer, str):
        try:
            final_answer = ast.literal_eval(final_answer)  # parses literals only, never runs code
        except (ValueError, SyntaxError):
            final_answer = [final_answer]
    if not isinstance(final_answer, (list, tuple)) or not final_answer:
        raise ValueError(f"{where}: field 'final_answer' is not a non-empty list")
    return ", ".join(normalize_answer(a) for a in final_answer)


ANSWER_FORMS: dict[str, Callable[[Any, str], Any]] = {
    "as_is": lambda x, where: x,
    "boxed": lambda s, where: extract_boxed(s),  # the last \\boxed{} of a worked solution
    "list": _olympiad_answer,  # OlympiadBench's final_answer list, joined by commas
    "gsm8k": _gsm8k_answer,  # the number after "####" of a worked solution
}
"""How an answer field gives the ground truth, by name (given, with `where` for errors)."""

_JSONL_ANSWER = {"minerva_math": ("solution", "boxed"), "olympiadbench": ("final_answer", "list"),
                 "gsm8k": ("answer", "gsm8k")}


def _from_jsonl(name: str, row: dict[str, Any], where: str, repair: bool) -> tuple[str, str]:
    field, form = _JSONL_ANSWER.get(name, ("answer", "as_is"))
    return read_fields(row, where, ("problem", "question"), field, form)


def read_fields(row: dict[str, Any], where: str, problem_keys: tuple[str, ...], answer_key: str,
                form: str, repair: bool = False) -> tuple[str, str]:
    """(problem text, normalised answer) of a row with the problem under the first present of
    `problem_keys` and the answer under `answer_key` in `ANSWER_FORMS[form]`; `repair`: LaTeX
    escapes turned into control characters are restored in the text."""
    text = _field(row, problem_keys, where)
    raw = ANSWER_FORMS[form](_field(row, (answer_key,), where), where)
    if raw is None:
        raise ValueError(f"{where}: no balanced \\boxed{{...}} answer in field {answer_key!r}")
    return (repair_escapes(text) if repair else text), _checked_answer(raw, where, answer_key)


def repair_escapes(text: str) -> str:
    """`text` with the LaTeX commands that a JSON-escaping bug made control characters restored."""
    return _TAB_COMMAND_RE.sub(r"\\t", _FORM_FEED_RE.sub(r"\\f", text))


def _from_verl(name: str, row: dict[str, Any], where: str, repair: bool) -> tuple[str, str]:
    messages = row.get("prompt")
    if not isinstance(messages, list):
        raise ValueError(f"{where}: field 'prompt' is not a list of messages")
    user = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not user or not user[-1]:
        raise ValueError(f"{where}: field 'prompt' has no user message")
    text = repair_escapes(user[-1]) if repair else user[-1]
    if repair and name == "minerva_math":
        solution = (row.get("extra_info") or {}).get("solution") or ""
        raw = extract_boxed(solution)
        if raw is None:
            raise ValueError(f"{where}: no balanced \\boxed{{...}} in field 'extra_info.solution'")
        return text, _checked_answer(raw, where, "extra_info.solution")
    reward_model = row.get("reward_model") or {}
    raw = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if raw is None or raw == "":
        raise ValueError(f"{where}: no ground truth in field 'reward_model.ground_truth'")
    if name == "olympiadbench":
        raw = _olympiad_answer([raw], where)
    return text, _checked_answer(raw, where, "reward_model.ground_truth")
