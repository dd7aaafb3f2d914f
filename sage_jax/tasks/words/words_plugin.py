"""The words task's plug-in record `PLUGIN` (see the package docstring)."""

from __future__ import annotations

from sage_jax.config import ConfigError
from sage_jax.models.hf_io import check_model_dir
from sage_jax.models.tokenizer import Tokenizer
from sage_jax.tasks.base import TaskPlugin
from sage_jax.tasks.benchmarks import Problem
from sage_jax.tasks.data import Example
from sage_jax.tasks.words import hf_warm_start as warm_start, problems as wp
from sage_jax.tasks.words.prompts import ANSWER_SYSTEM, WordsTask
from sage_jax.tasks.words.words_config import WordsConfig

HELD_OUT_SEED = 31_337  # the held-out problems (training problems use task.words.seed)


def make_task(cfg, model_path: str | None = None, system_prompt: str | None = None) -> WordsTask:
    path = model_path or cfg.model.path
    if not path:
        raise ConfigError("task.name=words needs model.path (a Hugging Face folder)",
                          key="model.path")
    return WordsTask(Tokenizer(check_model_dir(path)), system_prompt=system_prompt or ANSWER_SYSTEM)


def to_example(p: wp.WordProblem, index: int) -> Example:
    return Example(problem=p.problem, answer=str(p.answer), solution=p.solution, hint=None,
                   index=index)


def examples(cfg) -> list[Example]:
    """task.words.problems generated problems of min_steps..max_steps steps."""
    w = cfg.task.section(WordsConfig)
    return [to_example(p, i) for i, p in enumerate(
        wp.make_problems(w.problems, min_steps=w.min_steps, max_steps=w.max_steps, seed=w.seed))]


def held_out(per_length: int, min_steps: int, max_steps: int) -> dict[str, list[Problem]]:
    """{"words-k": `per_length` held-out problems of k steps} for k in min_steps..max_steps."""
    got = wp.make_problems(per_length, min_steps=min_steps, max_steps=max_steps,
                           seed=HELD_OUT_SEED, per_length=True)
    out: dict[str, list[Problem]] = {}
    for i, p in enumerate(got):
        out.setdefault(f"words-{p.k}", []).append(
            Problem(problem=p.problem, answer=str(p.answer), index=i, source=f"words-{p.k}"))
    return out


def eval_problems(cfg, limit: int | None) -> dict[str, list[Problem]]:
    """The run's lengths' held-out problems (`limit` per length, default
    task.words.eval_per_length)."""
    w = cfg.task.section(WordsConfig)
    return held_out(limit or w.eval_per_length, w.min_steps, w.max_steps)


def start_from(cfg, dtype, compute_dtype):
    return warm_start.warm_started_model(cfg, dtype=dtype, compute_dtype=compute_dtype)


PLUGIN = TaskPlugin(name="words", make_task=make_task, examples=examples,
                    eval_problems=eval_problems, start_from=start_from,
                    start_folder=warm_start.warm_start_folder, config=WordsConfig)
