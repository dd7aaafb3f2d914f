"""The math task: answer, hinted-answer and hint-request prompts through a chat template."""

from __future__ import annotations

import re
from typing import Iterable

from sage_jax.config import ConfigError
from sage_jax.core.sage import LEVELS
from sage_jax.models.hf_io import check_model_dir
from sage_jax.models.tokenizer import Tokenizer
from sage_jax.tasks.base import PayloadHints, TaskPlugin
from sage_jax.tasks.math_grading import extract_boxed, leaks_answer, math_reward_checked

# SAGE's and Qwen-Math's evaluation instruction; training uses the same one.
ANSWER_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
HINT_LEAD_IN = "\n\nHint: "
HINT_SYSTEM = ("You are a patient mathematics tutor. You help a student who is stuck by writing "
               "hints that point the way without ever giving away the final answer.")
HINT_REQUEST = """Here is a problem and its reference solution.

Problem:
{problem}

Reference solution:
{solution}

Write three hints for a student who has not solved this problem, each stronger than the last:
- level1 (minimal): only the key concept or idea to use.
- level2 (medium): the method, or an intermediate step to aim for.
- level3 (detailed): substantial guidance through most of the reasoning.
Never state the final answer and never use \\boxed{{}}. Reply with one JSON object and nothing else:
{{"level1": "...", "level2": "...", "level3": "..."}}"""


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\\$(])")
_FINAL = re.compile(r"\\boxed|^\s*####|final answer", re.I)


def solution_steps(solution: str) -> list[str]:
    """The steps of a worked solution: the sentences of its non-empty lines."""
    return [s.strip() for line in solution.splitlines() for s in _SENTENCE_END.split(line)
            if s.strip()]


def prefix_hints(solution: str, answer: str) -> dict[int, str]:
    """The `reference` hint levels of a math solution: the steps before the one that states the
    final answer (the first step with a `\\boxed{}`, a `####` line or "final answer", and a
    last step that names the answer are dropped); level l is the first round(l * n / 4) of the
    n remaining steps (a quarter, half, three quarters), at least one. A level that would be
    empty, repeat the level below or box the answer is absent."""
    steps = solution_steps(solution or "")
    for i, s in enumerate(steps):
        if _FINAL.search(s):
            steps = steps[:i]
            break
    want = str(answer).strip()
    if steps and want and re.search(rf"(?<![\w.]){re.escape(want)}(?![\w]|\.\d)", steps[-1]):
        steps = steps[:-1]
    out, last = {}, 0
    for level in LEVELS:
        n = min(max(1, round(level * len(steps) / 4)), len(steps))
        if n > last:
            text = "\n".join(steps[:n])
            if not leaks_answer(text, want):
                out[level] = text
            last = n
    return out


class MathTask(PayloadHints):
    """Math word problems scored by `math_grading.math_reward` (its timeouts and refusals counted)."""

    name = "math"
    reward_fn = staticmethod(math_reward_checked)

    def __init__(self, tokenizer: Tokenizer, *, system_prompt: str = ANSWER_SYSTEM):
        self.tok = tokenizer
        self.system_prompt = system_prompt
        self.eos_ids = tokenizer.eos_ids
        self.pad_id = tokenizer.pad_id

    def answer_prompt(self, problem: str) -> list[int]:
        return self.tok.encode_chat(problem, system=self.system_prompt)

    def hinted_prompt(self, problem: str, hint: str) -> list[int]:
        return self.tok.encode_chat(problem + HINT_LEAD_IN + hint, system=self.system_prompt)

    def hint_request(self, problem: str, solution: str) -> list[int]:
        user = HINT_REQUEST.format(problem=problem, solution=solution)
        return self.tok.encode_chat(user, system=HINT_SYSTEM)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(ids)

    @staticmethod
    def reference_hints(problem: str, solution: str, answer: str) -> dict[int, str]:
        del problem
        return prefix_hints(solution, answer)

    @staticmethod
    def reference(problem: str, answer: str, hint: str | None = None) -> str:
        """The final answer: the reward compares the last `\\boxed{}` with it."""
        del problem, hint
        return answer

    @staticmethod
    def extract_answer(text: str) -> str | None:
        return extract_boxed(text)


def make_task(cfg, model_path: str | None = None, system_prompt: str | None = None) -> MathTask:
    """Chat prompts through the tokenizer of `model_path` (default cfg.model.path)."""
    path = model_path or cfg.model.path
    if not path:
        raise ConfigError("task.name=math needs model.path (a Hugging Face folder)",
                          key="model.path")
    return MathTask(Tokenizer(check_model_dir(path)), system_prompt=system_prompt or ANSWER_SYSTEM)


PLUGIN = TaskPlugin(name="math", make_task=make_task)
