"""The Task interface: a task owns its three prompt formats and names its reward."""

from __future__ import annotations

from typing import Protocol, Sequence


class Task(Protocol):
    """Prompt formats and decoding for one task (math through a chat template, toy by chars)."""

    reward_name: str  # a name registered in `sage_jax.rewards`
    eos_ids: tuple[int, ...]
    pad_id: int

    def answer_prompt(self, problem: str) -> list[int]:
        """Token ids of the prompt that asks for an answer (no hint)."""

    def hinted_prompt(self, problem: str, hint: str) -> list[int]:
        """Token ids of the answer prompt with a hint after the problem."""

    def hint_request(self, problem: str, solution: str) -> list[int]:
        """Token ids of the prompt asking the policy for a JSON hint payload."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids (special tokens dropped)."""

    def reference_hints(self, problem: str, solution: str, answer: str) -> dict[int, str]:
        """{level: hint} derived from the reference solution by the task's fixed rule (the
        `reference` hint source): prefixes of the solution at several strengths, never the final
        answer. Levels the solution is too short for are absent."""


def ground_truth(task: Task, example, hint: str | None = None) -> str:
    """What `task`'s reward compares an answer to, for an example (`.problem`, `.answer`) asked
    with `hint` (None: no hint): `task.reference(problem, answer, hint)` where the task defines it
    (the toy task checks the whole continuation), else the final answer."""
    reference = getattr(task, "reference", None)
    return example.answer if reference is None else reference(example.problem, example.answer,
                                                              hint)
