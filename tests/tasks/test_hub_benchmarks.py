"""The benchmarks from their Hub datasets (`tasks.hub_benchmarks`), offline: a Hugging Face cache
laid out as huggingface_hub lays out dataset repos (`datasets--org--name/snapshots/<rev>/...`),
each repo's files in its Hub layout (file names, README `configs`, field names) rebuilt from the
local Qwen-eval files in ../shared/data. With HF_HUB_OFFLINE=1 every benchmark loads, and its
problems and answers equal the local loader's, or the test lists the rows that differ and why.

What this cannot check offline: that the live datasets hold these rows in this order. The layouts
written here are the datasets' published ones (file names and fields from their cards); the rows
are the local files' (the same benchmarks, from the Qwen2.5-Math evaluation copies)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sage_jax.eval import accuracy as eval_lib
from sage_jax.tasks.benchmarks import load_benchmark
from sage_jax.tasks.hub_benchmarks import HUB_SOURCES, load_hub_benchmark
from sage_jax.tasks.math_grading import extract_boxed

REVISION = "0123456789abcdef0123456789abcdef01234567"
GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


def _local_rows(data: Path, name: str) -> list[dict[str, Any]]:
    lines = (data / "eval" / name / "test.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _hub_rows(data: Path, name: str) -> list[dict[str, Any]]:
    """The local rows with the Hub dataset's field names."""
    rows = _local_rows(data, name)
    if name == "aime24":  # HuggingFaceH4/aime_2024: id, problem, solution, answer, url, year
        return [{k: r[k] for k in ("id", "problem", "solution", "answer", "url")} | {"year": "2024"}
                for r in rows]
    if name == "aime25":  # math-ai/aime25: problem, answer, id
        return [{"problem": r["question"], "answer": r["answer"], "id": i}
                for i, r in enumerate(rows)]
    if name == "amc23":  # math-ai/amc23: id, question, answer, url
        return [{k: r[k] for k in ("id", "question", "answer", "url")} for r in rows]
    if name == "minerva_math":  # math-ai/minervamath: question, answer (the solution's box)
        return [{"question": r["problem"], "answer": extract_boxed(r["solution"])} for r in rows]
    if name == "olympiadbench":  # math-ai/olympiadbench: id, question, final_answer (a list)
        return [{"id": r["id"], "question": r["question"], "final_answer": r["final_answer"]}
                for r in rows]
    return rows  # MATH-500 and gsm8k: the Hub's own fields


def _write(repo: Path, name: str, rows: list[dict[str, Any]]) -> None:
    """`rows` as the dataset repo of benchmark `name` lays out its files."""
    src = HUB_SOURCES[name]
    if src.repo.startswith("HuggingFaceH4/aime") or src.repo == "openai/gsm8k":
        sub = "main" if src.config == "main" else "data"
        path = repo / sub / f"{src.split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), path)
        if src.config == "main":
            (repo / "README.md").write_text(GSM8K_README)
            pq.write_table(pa.Table.from_pylist(rows[:2]),
                           repo / "main" / "train-00000-of-00001.parquet")
        return
    repo.mkdir(parents=True)
    (repo / f"{src.split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory, shared_data) -> Path:
    """A hub cache holding every benchmark's dataset repo (main -> REVISION)."""
    hub = tmp_path_factory.mktemp("hub")
    for name, src in HUB_SOURCES.items():
        org, repo = src.repo.split("/")
        root = hub / f"datasets--{org}--{repo}"
        _write(root / "snapshots" / REVISION, name, _hub_rows(shared_data, name))
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(REVISION)
    return hub


@pytest.fixture
def hub_cache(hub_folder, tmp_path, monkeypatch):
    """The environment reads `hub_folder`, offline."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    return hub_folder


def _differences(hub, local) -> list[str]:
    out = [f"{len(hub)} rows from the Hub, {len(local)} in the local file"] if (
        len(hub) != len(local)) else []
    for h, l in zip(hub, local):
        for field in ("problem", "answer"):
            if getattr(h, field) != getattr(l, field):
                out.append(f"row {h.index}: {field} {getattr(h, field)[:60]!r} != "
                           f"{getattr(l, field)[:60]!r}")
    return out


@pytest.mark.parametrize("name", sorted(HUB_SOURCES))
def test_a_benchmark_from_its_hub_layout_equals_the_local_file(hub_cache, shared_data, name):
    hub = load_hub_benchmark(name)
    local = load_benchmark(name, shared_data, layout="jsonl")
    assert len(local) > 0 and all(p.source == name for p in hub)
    assert _differences(hub, local) == []
    assert [p.index for p in hub] == list(range(len(hub)))


def test_the_repairs_apply_to_hub_rows(hub_cache, shared_data):
    """The malformed OlympiadBench ground truth is fixed on the Hub path too; `repair=False` keeps
    it, and the differences name the row."""
    fixed, raw = load_hub_benchmark("olympiadbench"), load_hub_benchmark("olympiadbench",
                                                                        repair=False)
    diff = _differences(raw, fixed)
    assert len(diff) == 1 and "answer 't(0,4]' != '(0,4]'" in diff[0], diff


def test_the_evaluator_without_a_data_folder_reads_the_hub(hub_cache):
    problems = eval_lib.load_problems(["math500", "gsm8k"], None, limit=3)
    assert [len(p) for p in problems.values()] == [3, 3]
    assert problems["gsm8k"][0].answer == "18"  # Janet's ducks: "#### 18"


def test_a_dataset_not_in_the_cache_offline_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"dataset HuggingFaceH4/aime_2024: not in the "
                                                r"Hugging Face cache .* pass --data-dir"):
        eval_lib.load_problems(["aime24"], None)
    with pytest.raises(ValueError, match="gpqa_diamond' has no Hub source.*--data-dir"):
        load_hub_benchmark("gpqa_diamond")


def test_a_dataset_without_the_named_field_is_one_clear_error(hub_cache, monkeypatch):
    src = HUB_SOURCES["aime25"]
    monkeypatch.setitem(HUB_SOURCES, "aime25", dataclasses.replace(src, problem="prompt"))
    with pytest.raises(ValueError, match=r"Hub dataset math-ai/aime25 \(default/test\): row 0: "
                                         r"no 'prompt' field \(keys: \['answer', 'id', "
                                         r"'problem'\]\)"):
        load_hub_benchmark("aime25")
