"""The math benchmarks from public Hugging Face Hub datasets, for an evaluation without a data
folder (`python -m sage_jax.evaluate` without `--data-dir`).

`HUB_SOURCES` names, per benchmark, the dataset, its config and split, the problem and answer
fields and the answer's form (`benchmarks.ANSWER_FORMS`). The dataset's files and README.md are
fetched into the Hugging Face cache (`models.hub.dataset`; `HF_HUB_OFFLINE=1` reads only the
cache) and read with `datasets.load_dataset` on that snapshot, which follows the README's
`configs`. The rows get the local loader's repairs (`benchmarks.to_problems`): the malformed
ground truths, Minerva's `np.` calls, and LaTeX escapes turned into control characters.

The local files (`../shared/data/eval`, SOURCES.md there) are the Qwen2.5-Math evaluation copies;
these datasets hold the same benchmarks: `tests/tasks/test_hub_benchmarks.py` checks the loader
on their layout, rebuilt from the local files, and lists what it cannot check offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets

from sage_jax.models import hub
from sage_jax.tasks.benchmarks import Problem, read_fields, to_problems


@dataclass(frozen=True)
class HubSource:
    """Where a benchmark's problems are on the Hub and which fields hold them."""

    repo: str  # dataset id, `org/name`
    split: str
    problem: str  # field with the problem text
    answer: str  # field with the ground truth
    form: str = "as_is"  # how `answer` gives the ground truth: a key of ANSWER_FORMS
    config: str | None = None  # the dataset's config (subset); None: its default


HUB_SOURCES = {
    "aime24": HubSource("HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    "aime25": HubSource("math-ai/aime25", "test", "problem", "answer"),
    "amc23": HubSource("math-ai/amc23", "test", "question", "answer"),
    "math500": HubSource("HuggingFaceH4/MATH-500", "test", "problem", "answer"),
    "minerva_math": HubSource("math-ai/minervamath", "test", "question", "answer"),
    "olympiadbench": HubSource("math-ai/olympiadbench", "test", "question", "final_answer",
                               "list"),
    "gsm8k": HubSource("openai/gsm8k", "test", "question", "answer", "gsm8k", config="main"),
}
"""Benchmark name -> its Hub dataset (gpqa_diamond has none: it needs a data folder)."""


def load_hub_benchmark(name: str, *, limit: int | None = None, repair: bool = True
                       ) -> list[Problem]:
    """Problems of benchmark `name` from its Hub dataset (`HUB_SOURCES`), at most `limit`."""
    if name not in HUB_SOURCES:
        raise ValueError(f"benchmark {name!r} has no Hub source (those with one: "
                         f"{', '.join(HUB_SOURCES)}); pass --data-dir with its file")
    src = HUB_SOURCES[name]
    folder = hub.dataset(src.repo, instead="pass --data-dir (a folder with "
                                           f"eval/{name}/test.jsonl)")
    where = f"Hub dataset {src.repo} ({src.config or 'default'}/{src.split})"
    try:
        rows = datasets.load_dataset(str(folder), src.config, split=src.split).to_list()
    except Exception as e:  # datasets raises many types; say which dataset and split failed
        raise ValueError(f"{where} in {folder}: {type(e).__name__}: {e}") from e

    def read(bench: str, row: dict[str, Any], at: str, fix: bool) -> tuple[str, str]:
        return read_fields(row, at, (src.problem,), src.answer, src.form, repair=fix)

    return to_problems(name, rows, where, read, limit=limit, repair=repair)
