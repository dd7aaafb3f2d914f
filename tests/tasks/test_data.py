"""Training data: loading files of every supported kind, row errors, skipping, and the order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sage_jax.config import DataConfig
from sage_jax.tasks.data import (
    DataError,
    Example,
    epoch_order,
    load_examples,
    next_batch_indices,
)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
AIME = DATA / "train" / "aime_1983_2023_with_solutions.json"
AMC23_VERL = DATA / "eval_verl" / "amc23.parquet"


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_json_list_file():
    examples, stats = load_examples(DataConfig(train_files=(str(AIME),)))
    assert len(examples) == 975 and stats["rows_read"] == 975 and stats["examples"] == 975
    assert stats["skipped_invalid"] == stats["skipped_too_long"] == 0
    first = examples[0]
    assert first.problem.startswith("Let $x$, $y$ and $z$ all exceed $1$")
    assert first.answer == "60" and "\\boxed{60}" in first.solution
    assert first.hint is None and [e.index for e in examples[:3]] == [0, 1, 2]


def test_verl_parquet():
    examples, stats = load_examples(DataConfig(train_files=(str(AMC23_VERL),), layout="verl"))
    assert len(examples) == 40 and stats["rows_read"] == 40
    first = examples[0]
    assert first.problem.startswith("Cities $A$ and $B$ are $45$ miles apart.")
    assert "reason step by step" not in first.problem  # the system message is not the problem
    assert first.answer == "27"  # ground truth "27.0"
    assert first.solution is None  # empty extra_info.solution
    assert first.index == 0 and examples[6].index == 7  # extra_info.index, not the position


def test_jsonl_with_dotted_keys_and_answer_types(tmp_path):
    rows = [
        {"q": {"text": "1+1?"}, "meta": {"gt": 2, "sol": "1+1=2", "id": 10}, "h": "add"},
        {"q": {"text": "half?"}, "meta": {"gt": 0.5, "sol": "", "id": 11}, "h": None},
        {"q": {"text": "big?"}, "meta": {"gt": 27.0, "sol": None, "id": 12}, "h": " "},
    ]
    cfg = DataConfig(train_files=(_jsonl(tmp_path / "d.jsonl", rows),), problem_key="q.text",
                     answer_key="meta.gt", solution_key="meta.sol", hint_key="h",
                     index_key="meta.id")
    examples, stats = load_examples(cfg)
    assert examples[0] == Example("1+1?", "2", "1+1=2", "add", 10)
    assert [e.answer for e in examples] == ["2", "0.5", "27"]
    assert [e.solution for e in examples[1:]] == [None, None]
    assert [e.hint for e in examples[1:]] == [None, None]
    assert [e.index for e in examples] == [10, 11, 12]
    assert stats["with_solution"] == 1 and stats["with_hint"] == 1


def test_parquet_and_positions_across_files(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["p0", "p1"], "answer": ["a0", "a1"]}), path)
    second = _jsonl(tmp_path / "e.jsonl", [{"problem": "p2", "answer": "a2"}])
    examples, stats = load_examples(DataConfig(train_files=(str(path), second)))
    assert [(e.problem, e.answer, e.index) for e in examples] == [
        ("p0", "a0", 0), ("p1", "a1", 1), ("p2", "a2", 2)]
    assert stats["files"] == [str(path), second]
    glob_cfg = DataConfig(train_files=(str(tmp_path / "*.parquet"),), format="parquet")
    assert load_examples(glob_cfg)[0] == examples[:2]


def test_bad_rows(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [
        {"problem": "ok", "answer": "1"},
        {"problem": "no answer", "answer": None},
        {"problem": "", "answer": "3"},
        {"problem": "fine", "answer": "4"},
    ])
    with pytest.raises(DataError) as e:
        load_examples(DataConfig(train_files=(path,)))
    assert "bad.jsonl: row 1" in str(e.value) and "'answer'" in str(e.value)
    examples, stats = load_examples(DataConfig(train_files=(path,), skip_invalid=True))
    assert [(e.problem, e.index) for e in examples] == [("ok", 0), ("fine", 3)]
    assert stats["rows_read"] == 4 and stats["skipped_invalid"] == 2
    with pytest.raises(DataError, match="no field 'question'"):  # a misnamed column fails
        load_examples(DataConfig(train_files=(path,), problem_key="question", skip_invalid=True))
    with pytest.raises(DataError, match="not found"):
        load_examples(DataConfig(train_files=(str(tmp_path / "missing.jsonl"),)))


def test_too_long_prompts_are_skipped_and_counted(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [
        {"problem": "one two three", "answer": "1"},
        {"problem": "one two three four five", "answer": "2"},
    ])
    cfg = DataConfig(train_files=(path,), max_prompt_tokens=3)
    examples, stats = load_examples(cfg, count_tokens=lambda text: len(text.split()))
    assert [e.problem for e in examples] == ["one two three"]  # kept whole, never truncated
    assert stats["skipped_too_long"] == 1 and stats["examples"] == 1
    with pytest.raises(DataError, match="no usable training examples"):
        load_examples(cfg, count_tokens=lambda text: 99)


def test_epoch_order():
    a = epoch_order(10, seed=3, epoch=0)
    assert sorted(a.tolist()) == list(range(10))
    assert np.array_equal(a, epoch_order(10, seed=3, epoch=0))
    assert not np.array_equal(a, epoch_order(10, seed=3, epoch=1))
    assert not np.array_equal(a, epoch_order(10, seed=4, epoch=0))


def test_batches_cross_epochs():
    n, seed = 10, 0
    idx, pos = next_batch_indices(8, 4, n, seed)
    assert pos == 12
    expected = np.concatenate([epoch_order(n, seed, 0)[8:], epoch_order(n, seed, 1)[:2]])
    assert np.array_equal(idx, expected)
    idx, pos = next_batch_indices(5, 3, n, seed, shuffle=False)
    assert idx.tolist() == [5, 6, 7] and pos == 8
    idx, pos = next_batch_indices(0, 25, n, seed)  # a batch larger than the data
    assert pos == 25 and len(idx) == 25 and sorted(idx[:10].tolist()) == list(range(10))


def test_resume_gives_the_same_batches():
    n, batch, seed = 7, 3, 5
    pos, straight = 0, []
    for _ in range(6):
        idx, pos = next_batch_indices(pos, batch, n, seed)
        straight.append(idx)
    saved = 3 * batch  # the position a checkpoint after step 3 holds
    resumed, pos = [], saved
    for _ in range(3):
        idx, pos = next_batch_indices(pos, batch, n, seed)
        resumed.append(idx)
    assert all(np.array_equal(a, b) for a, b in zip(straight[3:], resumed))
    seen = np.concatenate(straight)[:2 * n]  # each epoch visits every example once
    assert sorted(seen[:n].tolist()) == sorted(seen[n:].tolist()) == list(range(n))
