"""The Task interface, and the plug-in record through which generic code builds a task.

A task owns its prompt formats, its reward and how an answer is read. A `TaskPlugin` says how to
build the task from a run's config and what the task has built in (a model, training examples,
held-out problems); `sage_jax.tasks.registry.TASKS` maps `task.name` to plug-ins. Generic code
(the run, the evaluator, export) asks these two and never branches on a task's name.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Protocol

from sage_jax.core import sage
from sage_jax.infra.rewards import RewardFn
from sage_jax.tasks.math_grading import leaks_answer


class Task(Protocol):
    """Prompt formats, decoding and scoring for one task (math through a chat template, toy by
    chars)."""

    name: str
    reward_fn: RewardFn  # a module-level function (the reward workers import it by name)
    eos_ids: tuple[int, ...]
    pad_id: int
    system_prompt: str | None  # the answer prompt's system message (None: the task has none)

    def answer_prompt(self, problem: str) -> list[int]:
        """Token ids of the prompt that asks for an answer (no hint)."""

    def hinted_prompt(self, problem: str, hint: str) -> list[int]:
        """Token ids of the answer prompt with a hint after the problem."""

    def hint_requests(self, problem: str, solution: str) -> dict[int, list[int]]:
        """Token ids of the prompts that ask the policy for hints: {level: request}, one per
        level the solution allows, or {0: request} for one request whose reply holds every
        level (a JSON payload)."""

    def read_hints(self, text: str, level: int, answer: str) -> tuple[dict[int, str], int]:
        """The usable hints {level: hint} in the policy's reply to request `level`, and how many
        levels were refused for giving the final `answer` away."""

    def decode(self, ids: Iterable[int]) -> str:
        """Text of generated ids (special tokens dropped)."""

    def reference(self, problem: str, answer: str, hint: str | None = None) -> str:
        """What `reward_fn` compares an answer to, for a problem asked with `hint` (None: no
        hint): the final answer (math), the whole reference continuation (toy)."""

    def extract_answer(self, text: str) -> str | None:
        """The final answer a completion gives, as the reward reads it (None: none found)."""

    def reference_hints(self, problem: str, solution: str, answer: str) -> dict[int, str]:
        """{level: hint} derived from the reference solution by the task's fixed rule (the
        `reference` hint source): prefixes of the solution at several strengths, never the final
        answer. Levels the solution is too short for are absent."""


class PayloadHints:
    """`hint_requests` / `read_hints` of a task that asks for every level in one JSON payload
    (`self.hint_request(problem, solution)`), read by `core.sage.read_payload`; a level that
    boxes the final answer is refused (`math_grading.leaks_answer`)."""

    def hint_requests(self, problem: str, solution: str) -> dict[int, list[int]]:
        return {0: self.hint_request(problem, solution)}  # type: ignore[attr-defined]

    @staticmethod
    def read_hints(text: str, level: int, answer: str) -> tuple[dict[int, str], int]:
        del level
        return sage.read_payload(text, functools.partial(leaks_answer, ground_truth=answer))


@dataclasses.dataclass(frozen=True)
class TaskPlugin:
    """How to build a task from a run's `Config`, and what it has built in.

    make_task(cfg, model_path, system_prompt) -> Task: `model_path` is the model folder whose
      tokenizer the prompts use (None: cfg.model.path); `system_prompt` overrides the task's
      answer system message where it has one (None: its default).
    model_config(cfg) -> DecoderConfig: the built-in model's architecture, used when model.path
      is empty (None: the task needs model.path).
    make_model(cfg, dtype, compute_dtype) -> Decoder: the built-in model at its starting point,
      built with `remat=cfg.model.remat` (as `start_from` too).
    examples(cfg) -> list[Example]: built-in training examples, used when data.train_files is
      empty (None: the task needs data files).
    eval_problems(cfg, limit) -> {benchmark: [Problem]}: built-in held-out problems, evaluated
      instead of cfg.eval.benchmarks (None: the task is evaluated on benchmark files).
    start_from(cfg, dtype, compute_dtype) -> Decoder: the policy's starting point made from the
      model at model.path (e.g. a cached SFT warm start on the task; None: model.path as is).
    start_folder(cfg) -> Path: the Hugging Face folder `start_from` loads, the base a LoRA
      run's exported adapters belong to (None: model.path).
    config: the task's config section class, read as `cfg.task.section(config)` and written
      `task.<name>.<key>` (None: the task has no settings).
    """

    name: str
    make_task: Callable[[Any, str | None, str | None], Task]
    model_config: Callable[[Any], Any] | None = None
    make_model: Callable[[Any, Any, Any], Any] | None = None
    examples: Callable[[Any], list] | None = None
    eval_problems: Callable[[Any, int | None], dict[str, list]] | None = None
    start_from: Callable[[Any, Any, Any], Any] | None = None
    start_folder: Callable[[Any], Any] | None = None
    config: type | None = None
