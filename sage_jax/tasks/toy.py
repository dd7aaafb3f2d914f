"""The built-in toy task: alternating two-digit chain arithmetic, at character level.

A problem is a two-digit start value, two operations and a length k (the difficulty knob,
given as the label of the last step). The reference solution applies the two operations
alternately, one labelled step each, restating the operation before its result; each
operation's operand goes up every time it is used (+/-: 1..9 then 1 again; *: 3, 7, 9, 3...).
An operation acts on each digit separately, mod 10, with no carries (37 +4 -> 71, 37 *3 -> 91).
The solution ends with the answer:

    problem   37*3+4:e                                 (start 37; *3, +4, *7, +5, *9)
    solution  a*3=91;b+4=35;c*7=15;d+5=60;e*9=40;A:40

Why this shape (facts from a prototype, see issue 8, and from tuning this one):
- Everything a step needs sits at a fixed distance behind it: the previous value 6 characters
  back, the operation it increments (for steps c, d, ...) 14 back, and the prompt has a fixed
  width. So a step never has to find "the j-th operation" of the problem, which made length,
  not arithmetic, the bottleneck of the prototype (labelled variants that look operations up by
  content, `07+a5*b3`, spent the whole SFT budget learning the lookup). The only real work per
  step is two arithmetic facts from one small table (10 digits x {+1..+9, -1..-9, *2..*9} mod
  10), so a model that gets a step right with probability p passes a k-step problem about p^k
  of the time: the per-step error, not the length, is the bottleneck. Stopping is one
  comparison (step label vs. the problem's last label).
- Digitwise arithmetic learns like mod-10 arithmetic (true mod-100 arithmetic, with carries,
  was far slower to learn) while a guessed answer is right only ~1% of the time (single-digit
  answers were guessed right 10% of the time, so groups of 8 seldom collapsed). Every operation
  permutes the digits, so the two digits never merge (with *5 or *2 they did, and long chains
  became a one-digit task that was easier than short ones).
- The operand increments keep a chain from cycling through the same few facts (with fixed
  operands a chain repeats within a few steps and pass rates hardly fall with length).
- A hint supplies the first j steps; the hinted answer continues from step j + 1, so the hint
  removes j chances to fail. Levels (reference-derived): 1 = the first step, 2 = the first
  floor(k/2) steps, 3 = the first k - 1 steps; a level with no step (k = 1) is absent. The
  generator makes every intermediate value differ from the final answer, so no hint holds it.
- With p near 0.87 a group of 8 answers is all wrong mostly when p^k is small, so the RL
  lengths are the long ones (see RL_SPEC); SFT covers every length 1..SFT_SPEC.max_steps.
- The SFT mix covers every length with no hint, with each hint level, and the hint-writing
  request (the reference solution in the prompt, the three-level JSON payload as the answer),
  so the policy can both use and write hints.

Prompt formats (<bos> first; the answer ends with <eos>):
    answer prompt    Q:37*3+4:e\\n             -> a*3=91;b+4=35;c*7=15;d+5=60;e*9=40;A:40
    hinted prompt    Q:37*3+4:e\\nH:a*3=91\\n   -> b+4=35;c*7=15;d+5=60;e*9=40;A:40
    hint request     S:a*3=91;b+4=35;c*7=15;d+5=60;e*9=40;A:40\\nH?a,b,d:
                         -> {"1":"a*3=91","2":"a*3=91;b+4=35","3":"a*3=91;...;d+5=60"}
The hint request shows the reference solution (it holds every step, so the problem text would
be redundant characters) and, after `H?`, the label of the last step each level should reach
(as the paper's request describes what each level holds): writing a hint is then copying
steps up to a named label, which the policy learns in SFT, rather than counting to k/2. The
payload is a JSON object with keys "1".."3", which `sage.parse_hints` reads.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Sequence

import numpy as np

from sage_jax.models.char_tokenizer import CharTokenizer
from sage_jax.models.config import ModelConfig
from sage_jax.rewards import get_reward, register_reward
from sage_jax.sage import LEVELS
from sage_jax.tasks.data import Example

BASE = 10  # each digit is computed mod 10, with no carries
WIDTH = 2  # digits of a value
MOD = BASE ** WIDTH  # number of distinct values
LABELS = "abcdefghijklmnopqrst"
MAX_STEPS = len(LABELS)
OPS = ("+", "-", "*")
# Every operation permutes the digits 0..9 (no *2, *4, *5, ...), so two different digits stay
# different: the two digits of a value never merge into one lane, and no chain gets stuck.
OPERANDS = {"+": tuple(range(1, 10)), "-": tuple(range(1, 10)), "*": (3, 7, 9)}
ANSWER_TAG = "A:"
QUESTION_TAG = "Q:"
HINT_TAG = "H:"
SOLUTION_TAG = "S:"
REQUEST_TAG = "H?"
STEP_SEP = ";"

_PROBLEM_RE = re.compile(r"^(\d+)([-+*])(\d)([-+*])(\d):([a-z])$")
_ANSWER_RE = re.compile(r"A:(\d+)")


# ---- problems and reference solutions --------------------------------------------------------

def _digit_op(d: int, op: str, operand: int) -> int:
    if op == "+":
        return (d + operand) % BASE
    if op == "-":
        return (d - operand) % BASE
    if op == "*":
        return (d * operand) % BASE
    raise ValueError(f"unknown operation {op!r}")


def apply_op(value: int, op: str, operand: int) -> int:
    """The operation applied to each digit of `value` separately, mod 10 (no carries)."""
    out, scale = 0, 1
    for _ in range(WIDTH):
        out += _digit_op(value // scale % BASE, op, operand) * scale
        scale *= BASE
    return out


@dataclasses.dataclass(frozen=True)
class ToyProblem:
    """A start value, two operations (applied alternately) and k steps."""

    start: int
    pair: tuple[tuple[str, int], tuple[str, int]]
    k: int

    @property
    def ops(self) -> tuple[tuple[str, int], ...]:
        """The operation of each step: the pair alternates, and each operation's operand goes
        up by one every time it is used (wrapping around its range)."""
        return tuple(next_operand(*self.pair[j % 2], j // 2) for j in range(self.k))

    @property
    def text(self) -> str:
        """The problem as the policy sees it, e.g. `37*3+4:e`."""
        (o1, x1), (o2, x2) = self.pair
        return f"{self.start:0{WIDTH}d}{o1}{x1}{o2}{x2}:{LABELS[self.k - 1]}"

    def values(self) -> list[int]:
        """The value after each step."""
        out, v = [], self.start
        for op, x in self.ops:
            v = apply_op(v, op, x)
            out.append(v)
        return out

    @property
    def answer(self) -> str:
        return f"{self.values()[-1]:0{WIDTH}d}"

    def steps(self) -> list[str]:
        """Reference steps, e.g. ['a*3=91', 'b+4=35']."""
        return [f"{LABELS[i]}{op}{x}={v:0{WIDTH}d}"
                for i, ((op, x), v) in enumerate(zip(self.ops, self.values()))]

    @property
    def solution(self) -> str:
        return solution_text(self.steps(), self.answer)

    @classmethod
    def parse(cls, text: str) -> "ToyProblem":
        m = _PROBLEM_RE.match(text.strip())
        if not m:
            raise ValueError(f"not a toy problem: {text!r} (expected e.g. '37*3+4:e')")
        start, o1, x1, o2, x2, last = m.groups()
        return cls(int(start), ((o1, int(x1)), (o2, int(x2))), LABELS.index(last) + 1)


def next_operand(op: str, operand: int, uses: int = 1) -> tuple[str, int]:
    """The operation after `uses` increments of its operand (wrapping within OPERANDS[op])."""
    r = OPERANDS[op]
    return op, r[(r.index(operand) + uses) % len(r)]


def solution_text(steps: Sequence[str], answer: str) -> str:
    return STEP_SEP.join([*steps, ANSWER_TAG + answer])


def random_problem(rng: np.random.Generator, k: int, ops: str = "".join(OPS)) -> ToyProblem:
    """A k-step problem with operators drawn from `ops`. The start value has two different
    digits; the two operations never undo each other (+x then -x, whose operands also rise in
    step: a trivial 2-cycle); no intermediate value equals the final answer, so no hint holds
    it."""
    if not 1 <= k <= MAX_STEPS:
        raise ValueError(f"k={k} steps is outside 1..{MAX_STEPS}")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops must be a non-empty subset of {''.join(OPS)!r}, got {ops!r}")
    for _ in range(100_000):
        start = int(rng.integers(MOD))
        if len(set(f"{start:0{WIDTH}d}")) < WIDTH:
            continue
        pair = []
        for _ in range(2):
            op = ops[int(rng.integers(len(ops)))]
            pair.append((op, int(rng.choice(OPERANDS[op]))))
        (o1, x1), (o2, x2) = pair
        if {o1, o2} == {"+", "-"} and x1 == x2:
            continue
        p = ToyProblem(start, (pair[0], pair[1]), k)
        values = p.values()
        if values[-1] not in values[:-1]:  # no hint holds the answer's value
            return p
    raise ValueError(f"found no {k}-step problem with operators {ops!r} whose answer differs "
                     "from every intermediate value")


# ---- hints ----------------------------------------------------------------------------------

def hint_steps(k: int, level: int) -> int:
    """How many reference steps the level-`level` hint of a k-step problem gives (0: none)."""
    n = {1: 1, 2: k // 2, 3: k - 1}[level]
    return max(0, min(n, k - 1))


def _steps_of(solution: str) -> list[str]:
    return [s for s in solution.split(STEP_SEP) if s and not s.startswith(ANSWER_TAG)]


def hint_lengths(solution: str) -> dict[int, int]:
    """{level: number of steps} the hints of a solution have (0: the level is absent)."""
    k = len(_steps_of(solution))
    return {level: hint_steps(k, level) for level in LEVELS}


def reference_hints(problem: ToyProblem | str) -> dict[int, str]:
    """{level: hint} from the reference steps (of a problem, or of its solution text); levels
    with no step are absent."""
    if isinstance(problem, str):
        steps = _steps_of(problem)
    else:
        steps = problem.steps()
    out = {}
    for level in LEVELS:
        n = hint_steps(len(steps), level)
        if n:
            out[level] = STEP_SEP.join(steps[:n])
    return out


def hint_payload(hints: dict[int, str]) -> str:
    """The JSON object the policy writes: {"1": ..., "2": ..., "3": ...}."""
    return json.dumps({str(k): v for k, v in sorted(hints.items())}, separators=(",", ":"))


def continuation(problem: ToyProblem, hint: str | None) -> str:
    """The reference answer after a hinted prompt: the steps the hint does not give, then A:."""
    steps = problem.steps()
    n = 0 if not hint else len(hint.split(STEP_SEP))
    return solution_text(steps[n:], problem.answer)


# ---- reward ---------------------------------------------------------------------------------

def toy_reward(response: str, ground_truth: str) -> float:
    """1.0 when the last `A:<number>` of the response equals the ground truth (mod-100 value)."""
    found = _ANSWER_RE.findall(response)
    if not found:
        return 0.0
    try:
        return 1.0 if int(found[-1]) == int(str(ground_truth).strip()) else 0.0
    except ValueError:
        return 0.0


try:
    register_reward("toy", toy_reward)
except ValueError:  # re-imported under another module name; keep the first one
    pass
assert get_reward("toy") is not None


# ---- the task -------------------------------------------------------------------------------

class ToyTask:
    """Prompt formats of the toy task (`sage_jax.tasks.base.Task`) through `CharTokenizer`."""

    reward_name = "toy"

    def __init__(self, tokenizer: CharTokenizer | None = None):
        self.tok = tokenizer or CharTokenizer()
        self.eos_ids = self.tok.eos_ids
        self.pad_id = self.tok.pad_id

    # text forms
    @staticmethod
    def answer_text(problem: str) -> str:
        return f"{QUESTION_TAG}{problem}\n"

    @staticmethod
    def hinted_text(problem: str, hint: str) -> str:
        return f"{QUESTION_TAG}{problem}\n{HINT_TAG}{_one_line(hint)}\n"

    @staticmethod
    def request_text(problem: str, solution: str) -> str:
        solution = _one_line(solution)
        ends = ",".join(LABELS[n - 1] if 0 < n <= len(LABELS) else "-"
                        for n in hint_lengths(solution).values())
        return f"{SOLUTION_TAG}{solution}\n{REQUEST_TAG}{ends}:"

    # Task protocol
    def answer_prompt(self, problem: str) -> list[int]:
        return self.tok.encode(self.answer_text(problem), bos=True)

    def hinted_prompt(self, problem: str, hint: str) -> list[int]:
        return self.tok.encode(self.hinted_text(problem, hint), bos=True)

    def hint_request(self, problem: str, solution: str) -> list[int]:
        return self.tok.encode(self.request_text(problem, solution), bos=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode_until_eos(ids)

    def encode_answer(self, text: str) -> list[int]:
        """Ids of an answer (or hint payload) with its closing <eos>."""
        return self.tok.encode(text, eos=True)


def _one_line(text: str) -> str:
    """Policy-written text may hold any character; keep it on one line and in the vocabulary."""
    text = " ".join(str(text).split())
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text)


# ---- datasets -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToySpec:
    """Which problems a split holds: lengths min_steps..max_steps, uniformly; operators `ops`."""

    min_steps: int = 1
    max_steps: int = 16
    ops: str = "+-*"

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps <= MAX_STEPS:
            raise ValueError(f"need 1 <= min_steps <= max_steps <= {MAX_STEPS}, got "
                             f"{self.min_steps}..{self.max_steps}")
        if not self.ops or set(self.ops) - set(OPS):
            raise ValueError(f"ops must be a non-empty subset of {''.join(OPS)!r}: {self.ops!r}")

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(range(self.min_steps, self.max_steps + 1))


# Defaults of the embedded job (see `calibrate` and issue 8): SFT covers every length; RL and
# evaluation use the longer ones, where groups collapse.
SFT_SPEC = ToySpec(1, 16)
RL_SPEC = ToySpec(8, 16)


def make_problems(n: int, spec: ToySpec = RL_SPEC, *, seed: int = 0,
                  per_length: bool = False) -> list[ToyProblem]:
    """n problems (n per length when `per_length`), lengths cycling through the spec."""
    rng = np.random.default_rng([seed, 8])
    lengths = spec.lengths
    total = n * len(lengths) if per_length else n
    return [random_problem(rng, lengths[i % len(lengths)], spec.ops) for i in range(total)]


def to_example(p: ToyProblem, index: int) -> Example:
    return Example(problem=p.text, answer=p.answer, solution=p.solution, hint=None, index=index)


def make_examples(n: int, spec: ToySpec = RL_SPEC, *, seed: int = 0,
                  per_length: bool = False) -> list[Example]:
    """`Example`s (problem, answer, solution) for RL training or evaluation."""
    return [to_example(p, i) for i, p in enumerate(make_problems(n, spec, seed=seed,
                                                                 per_length=per_length))]


def write_examples(path, examples: Sequence[Example]) -> None:
    """Writes examples as JSONL (problem, answer, solution, index) for `sage_jax.tasks.data`."""
    with open(path, "w") as f:
        for ex in examples:
            f.write(json.dumps({"problem": ex.problem, "answer": ex.answer,
                                "solution": ex.solution, "index": ex.index}) + "\n")


# ---- the SFT mix ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SFTMix:
    """Shares of the SFT kinds: plain answers, hinted answers (split evenly over the levels a
    problem has), and hint-writing requests."""

    plain: float = 0.5
    hinted: float = 0.4
    write: float = 0.1

    def probs(self) -> np.ndarray:
        p = np.asarray([self.plain, self.hinted, self.write], np.float64)
        if (p < 0).any() or p.sum() <= 0:
            raise ValueError(f"SFT mix shares must be >= 0 and not all 0: {self}")
        return p / p.sum()


def sft_pair(task: ToyTask, problem: ToyProblem, kind: str,
             level: int = 0) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one SFT example: kind 'plain', 'hinted' (at `level`), 'write'."""
    if kind == "plain":
        return task.answer_prompt(problem.text), task.encode_answer(problem.solution)
    if kind == "hinted":
        hint = reference_hints(problem)[level]
        return (task.hinted_prompt(problem.text, hint),
                task.encode_answer(continuation(problem, hint)))
    if kind == "write":
        return (task.hint_request(problem.text, problem.solution),
                task.encode_answer(hint_payload(reference_hints(problem))))
    raise ValueError(f"unknown SFT kind {kind!r}")


def sft_draw(rng: np.random.Generator, n: int, *, task: ToyTask | None = None,
             spec: ToySpec = SFT_SPEC, mix: SFTMix = SFTMix()) -> list[tuple[list[int], list[int]]]:
    """n fresh SFT (prompt, answer) pairs from `rng`: every length of `spec`; plain, hinted at
    every level, and hint-writing in the shares of `mix`. A 1-step problem has no hint, so it is
    always plain."""
    task = task or ToyTask()
    probs = mix.probs()
    lengths = spec.lengths
    out = []
    for _ in range(n):
        p = random_problem(rng, lengths[int(rng.integers(len(lengths)))], spec.ops)
        kind = ("plain", "hinted", "write")[int(rng.choice(3, p=probs))]
        levels = sorted(reference_hints(p))
        if kind != "plain" and not levels:
            kind = "plain"
        level = int(rng.choice(levels)) if kind == "hinted" else 0
        out.append(sft_pair(task, p, kind, level))
    return out


def sft_examples(n: int, *, task: ToyTask | None = None, spec: ToySpec = SFT_SPEC,
                 mix: SFTMix = SFTMix(), seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """A fixed list of n SFT pairs (see `sft_draw`)."""
    return sft_draw(np.random.default_rng([seed, 9]), n, task=task, spec=spec, mix=mix)


# ---- the toy model --------------------------------------------------------------------------

def toy_model_config(**overrides) -> ModelConfig:
    """A Llama-style decoder at toy size over the char vocabulary (about 0.8M parameters)."""
    tok = CharTokenizer()
    cfg = dict(family="llama", vocab_size=tok.vocab_size, hidden_size=128,
               intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32,
               rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               max_position_embeddings=512, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
               pad_token_id=tok.pad_id)
    cfg.update(overrides)
    return ModelConfig(**cfg)
