"""Generated arithmetic word problems with worked solutions, difficulty = number of steps.

A problem starts from a count ("Mia has 7 shells.") and changes it `k` times (gets more, gives
some away, doubles, buys bags of them); the question asks for the final count. Its reference
solution is one sentence per change, each with its equation, then the boxed answer:

    Mia gets 5 more: 7 + 5 = 12.
    Mia gives away 3: 12 - 3 = 9.
    The answer is \\boxed{9}.

The supply is unlimited (`make_problems(n, seed=...)` for any seed) and exact, so a run never
revisits a prompt unless it asks to. Every step needs an addition, a subtraction or a product of
numbers below 100, so a step-by-step solver's chance of a right answer falls with `k`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eli", "Ana", "Ben", "Kim")
ITEMS = ("apples", "shells", "coins", "stickers", "marbles", "cards", "pens", "books",
         "stamps", "beads", "eggs", "rocks")
MAX_VALUE = 99  # every count along a chain stays in 1..99
OPS = ("add", "sub", "double", "bags")


@dataclasses.dataclass(frozen=True)
class WordProblem:
    """One problem: its text, its solution steps (the last one computes the answer), the
    answer, and k (the number of steps)."""

    problem: str
    steps: tuple[str, ...]
    answer: int

    @property
    def k(self) -> int:
        return len(self.steps)

    @property
    def solution(self) -> str:
        return "\n".join(self.steps) + f"\nThe answer is \\boxed{{{self.answer}}}."


def _step(rng: np.random.Generator, name: str, item: str, a: int) -> tuple[str, str, int]:
    """One change of the count `a`: (problem sentence, solution sentence, new count)."""
    ops = [op for op in OPS if op != "double" or 2 * a <= MAX_VALUE]
    ops = [op for op in ops if op != "bags" or a + 4 <= MAX_VALUE]
    ops = [op for op in ops if op != "sub" or a >= 3]
    ops = [op for op in ops if op != "add" or a + 2 <= MAX_VALUE]
    op = ops[int(rng.integers(len(ops)))]
    if op == "add":
        x = int(rng.integers(2, min(30, MAX_VALUE - a) + 1))
        return (f"{name} gets {x} more {item}.", f"{name} gets {x} more: {a} + {x} = {a + x}.",
                a + x)
    if op == "sub":
        x = int(rng.integers(1, a))
        return (f"{name} gives {x} {item} away.", f"{name} gives away {x}: {a} - {x} = {a - x}.",
                a - x)
    if op == "double":
        return (f"The number of {item} {name} has doubles.",
                f"The {item} double: {a} * 2 = {2 * a}.", 2 * a)
    room = MAX_VALUE - a
    bags = int(rng.integers(2, min(6, room // 2) + 1))
    each = int(rng.integers(2, min(9, room // bags) + 1))
    return (f"{name} buys {bags} bags with {each} {item} in each.",
            f"{name} buys {bags} * {each} = {bags * each}: {a} + {bags * each} = "
            f"{a + bags * each}.", a + bags * each)


def make_problem(rng: np.random.Generator, k: int) -> WordProblem:
    """A problem of `k` steps drawn with `rng`."""
    if k < 1:
        raise ValueError(f"a word problem needs at least one step, got k={k}")
    name = NAMES[int(rng.integers(len(NAMES)))]
    item = ITEMS[int(rng.integers(len(ITEMS)))]
    a = int(rng.integers(3, 31))
    text, steps = [f"{name} has {a} {item}."], []
    for _ in range(k):
        said, solved, a = _step(rng, name, item, a)
        text.append(said)
        steps.append(solved)
    text.append(f"How many {item} does {name} have now?")
    return WordProblem(problem=" ".join(text), steps=tuple(steps), answer=a)


def make_problems(n: int, *, min_steps: int, max_steps: int, seed: int,
                  per_length: bool = False) -> list[WordProblem]:
    """`n` problems with k uniform in [min_steps, max_steps] (per_length: `n` of each k, in
    order of k). The same (n, lengths, seed) always gives the same problems."""
    rng = np.random.default_rng([seed, 7919])
    if per_length:
        return [make_problem(rng, k) for k in range(min_steps, max_steps + 1) for _ in range(n)]
    return [make_problem(rng, int(rng.integers(min_steps, max_steps + 1))) for _ in range(n)]


def first_steps(solution: str, level: int) -> str | None:
    """The first `level` steps of a reference solution, when the solution has more steps than
    that (the step that computes the answer is never part of a hint); else None."""
    steps = [s for s in solution.splitlines() if s.strip() and "\\boxed" not in s]
    return "\n".join(steps[:level]) if 0 < level < len(steps) else None
