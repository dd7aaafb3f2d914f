"""The word-problem task: chat prompts, a boxed-answer reward, and hints written one level per
request ("write the first l steps of this solution"), read leniently, leaks refused."""

from __future__ import annotations

import re

from sage_jax.core.sage import LEVELS
from sage_jax.models.tokenizer import Tokenizer
from sage_jax.tasks.math import MathTask
from sage_jax.tasks.words.problems import first_steps

ANSWER_SYSTEM = "Solve the problem step by step. Put the final answer in \\boxed{}."
HINT_SYSTEM = "You write hints: the first steps of a solution, never its final answer."
HINT_REQUEST = "{problem}\n\nSolution:\n{solution}\n\nWrite only the first {count} of this solution."
_LEAK = re.compile(r"\\boxed|\banswer\b", re.I)


def _count(level: int) -> str:
    return "step" if level == 1 else f"{level} steps"


class WordsTask(MathTask):
    """Arithmetic word problems (`tasks.words.problems`) through a chat template; the answer
    prompt, hinted prompt and reward are `MathTask`'s with a shorter system message."""

    name = "words"

    def __init__(self, tokenizer: Tokenizer, *, system_prompt: str = ANSWER_SYSTEM):
        super().__init__(tokenizer, system_prompt=system_prompt)

    def hint_request_text(self, problem: str, solution: str, level: int) -> str:
        """The user message asking for the level-`level` hint."""
        return HINT_REQUEST.format(problem=problem, solution=solution, count=_count(level))

    def hint_requests(self, problem: str, solution: str) -> dict[int, list[int]]:
        """One request per level the solution allows (level l: its first l steps)."""
        return {lvl: self.tok.encode_chat(self.hint_request_text(problem, solution, lvl),
                                          system=HINT_SYSTEM)
                for lvl in LEVELS if first_steps(solution, lvl) is not None}

    @staticmethod
    def read_hints(text: str, level: int, answer: str) -> tuple[dict[int, str], int]:
        """The reply's first `level` non-empty lines as the level's hint; refused (and counted)
        when they box an answer or speak of "the answer"."""
        del answer  # a hint that names the answer says so in words or a box
        lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()][:level]
        hint = "\n".join(lines)
        if not hint:
            return {}, 0
        if _LEAK.search(hint):
            return {}, 1
        return {level: hint}, 0

    @staticmethod
    def reference_hints(problem: str, solution: str, answer: str) -> dict[int, str]:
        """Level l: the solution's first l steps, for the levels below its step count."""
        del problem, answer
        return {lvl: h for lvl in LEVELS if (h := first_steps(solution or "", lvl)) is not None}
