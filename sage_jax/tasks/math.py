"""The math task: answer, hinted-answer and hint-request prompts through a chat template."""

from __future__ import annotations

from typing import Sequence

from sage_jax.models.tokenizer import Tokenizer

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


class MathTask:
    """Math word problems scored by `rewards.math_reward`."""

    reward_name = "math"

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

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids)
