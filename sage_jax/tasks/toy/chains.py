"""The built-in toy task: alternating chain arithmetic mod 10, at character level.

A problem is a start digit, two operations (+x or -x, x in 1..9) and a length k (the
difficulty knob, given as a letter: a = 1 step, e = 5). The reference solution applies the two
operations alternately, one step each, labelled by the steps left (the first has the problem's
letter, the last is `a`), restating the value it starts from and the operation before its
result, and ends with the answer, the last value:

    problem   7+3-8:e
    solution  e=7+3=0;d=0-8=2;c=2+3=5;b=5-8=7;a=7+3=0;A:0

The reward checks the work (`toy_reward`): every step the answer writes and the final value
must equal the reference's.

Why this shape (facts from a prototype, see issue 8, and from tuning earlier versions):
- Everything a step needs sits at a fixed distance behind it: it copies the previous result
  (4 characters back) and its operation (two steps back), then adds them with all three
  inputs next to each other. A step never has to find "the j-th operation" of the problem,
  which made length, not arithmetic, the bottleneck of the prototype. The only real work per
  step is one fact of a small table (10 digits x 18 operations, mod 10). Versions in which the
  fact needed a far-away value (the previous result not restated, two digits per value,
  operands that change every step) stayed near chance for 500+ SFT steps on 2 cores: the
  attention that fetches the value gets no signal until the arithmetic works, while a copy
  gets it at once.
- The count-down label makes stopping local too: after step `a` comes the answer. With labels
  that count up, the policy had to compare each label with the problem's; after 2380 SFT steps
  single steps were right 88% of the time but the answer line only 5%.
- The two operations together move the value by an amount coprime to 10 (the generator draws
  only such pairs), so a chain meets ten different values under each operation before any
  fact repeats: a problem of up to 20 steps never uses a fact twice, and a model that gets a
  step right with probability p passes a k-step problem about p^k of the time. The per-step
  error, not the length, is the bottleneck.
- The answer is one digit, so a final-answer reward would be right by chance 10% of the time
  and groups of 8 would seldom all fail; checking every step removes guessing, and a hint
  still removes exactly the steps it supplies.
- A hint supplies the first j steps; the hinted answer continues from step j + 1, so the hint
  removes j chances to fail. Levels (reference-derived): 1 = the first step, 2 = the first
  floor(k/2) steps, 3 = the first k - 1 steps; a level with no step (k = 1) is absent. No hint
  holds the last step or the answer line.
- With p near 0.87 a group of 8 answers is all wrong mostly when p^k is small, so the RL
  lengths are the long ones (see RL_SPEC); SFT covers every length 1..SFT_SPEC.max_steps.
- The SFT mix covers every length with no hint, with each hint level, and the hint-writing
  request (the reference solution in the prompt, the three-level JSON payload as the answer),
  so the policy can both use and write hints.

Prompt formats (<bos> first; the answer ends with <eos>):
    answer prompt    Q:7+3-8:e\\n          -> e=7+3=0;d=0-8=2;c=2+3=5;b=5-8=7;a=7+3=0;A:0
    hinted prompt    Q:7+3-8:e\\nH:e=7+3=0\\n  -> d=0-8=2;c=2+3=5;b=5-8=7;a=7+3=0;A:0
    hint request     S:e=7+3=0;d=0-8=2;c=2+3=5;b=5-8=7;a=7+3=0;A:0\\nH?e,d,b:
                         -> {"1":"e=7+3=0","2":"e=7+3=0;d=0-8=2","3":"e=7+3=0;...;b=5-8=7"}
The hint request shows the reference solution (it holds every step, so the problem text would
be redundant characters) and, after `H?`, the label of the last step each level should reach
(as the paper's request describes what each level holds): writing a hint is then copying
steps up to a named label, which the policy learns in SFT, rather than counting to k/2. The
payload is a JSON object with keys "1".."3", which `sage.parse_hints` reads.

With `ToyTask(hint_format="level")` the policy is asked once per level, as the paper's
Algorithm 1 samples one hint per level. The solution is padded with `.` to the width of the
longest solution and the level's end is marked with `|`, so the reply's i-th character is the
one a fixed distance back, and the reply ends where that character is the mark: a copy that one
attention head at one relative offset can do (with the end named only by the label after `H?`,
a first warm start copied up to the last step every time: level 3 right 49 %, levels 1-2 0 %):
    level request    S:e=7+3=0;d=0-8=2|c=2+3=5;b=5-8=7;a=7+3=0;A:0.....(to a fixed width)\nH?d:
                         -> e=7+3=0;d=0-8=2
A reply that holds the last step (`a=...`) or an `A:` line gives the answer away: refused.

The hard split (`ToySpec.rare_operands`, issue 33): operands whose facts the warm start never
(or rarely) sees and that only some long RL problems use. Every step is one fact of the table,
so what GRPO learns on the other problems does not carry over to these facts: a problem whose
pair holds a rare operand needs about k/2 facts the policy has to guess, is all-zero for GRPO,
and can only be learned where a hint leaves few of them to guess (a k-1 hint: at most one).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Iterable, Sequence

import numpy as np

from sage_jax.models.char_tokenizer import CharTokenizer
from sage_jax.models.decoder_config import DecoderConfig
from sage_jax.core.sage import LEVELS
from sage_jax.tasks.base import PayloadHints
from sage_jax.tasks.benchmarks import Problem
from sage_jax.tasks.data import Example

BASE = 10  # values are digits; every operation is mod 10
OPERANDS = tuple(range(1, BASE))
LABELS = "abcdefghijklmnopqrst"
MAX_STEPS = len(LABELS)
ANSWER_TAG = "A:"
QUESTION_TAG = "Q:"
HINT_TAG = "H:"
SOLUTION_TAG = "S:"
REQUEST_TAG = "H?"
STEP_SEP = ";"

_PROBLEM_RE = re.compile(r"^(\d)([-+])([1-9])([-+])([1-9]):([a-t])$")
_ANSWER_RE = re.compile(r"A:(\d+)")


# ---- problems and reference solutions --------------------------------------------------------

def apply_op(value: int, op: str, operand: int) -> int:
    """value + operand or value - operand, mod 10."""
    if op == "+":
        return (value + operand) % BASE
    if op == "-":
        return (value - operand) % BASE
    raise ValueError(f"unknown operation {op!r}")


def _net(op: str, operand: int) -> int:
    return operand if op == "+" else -operand


@dataclasses.dataclass(frozen=True)
class ToyProblem:
    """A start digit, two operations applied alternately, and k steps."""

    start: int
    pair: tuple[tuple[str, int], tuple[str, int]]
    k: int

    @property
    def ops(self) -> tuple[tuple[str, int], ...]:
        """The operation of each step: the pair, alternately."""
        return tuple(self.pair[j % 2] for j in range(self.k))

    @property
    def text(self) -> str:
        """The problem as the policy sees it, e.g. `7+3-8:e`."""
        (o1, x1), (o2, x2) = self.pair
        return f"{self.start}{o1}{x1}{o2}{x2}:{LABELS[self.k - 1]}"

    def uses(self, operands: Sequence[int]) -> bool:
        """Whether one of the problem's operations has an operand in `operands`."""
        return any(x in operands for _, x in self.pair)

    def values(self) -> list[int]:
        """The value after each step."""
        out, v = [], self.start
        for op, x in self.ops:
            v = apply_op(v, op, x)
            out.append(v)
        return out

    @property
    def answer(self) -> str:
        return str(self.values()[-1])

    def steps(self) -> list[str]:
        """Reference steps, labelled by the steps left (the last is 'a') and restating the
        value they start from: ['b=7+3=0', 'a=0-8=2'] for k = 2."""
        values = self.values()
        return [f"{LABELS[self.k - 1 - i]}={u}{op}{x}={v}" for i, ((op, x), u, v)
                in enumerate(zip(self.ops, [self.start, *values[:-1]], values))]

    @property
    def solution(self) -> str:
        return solution_text(self.steps(), self.answer)

    @classmethod
    def parse(cls, text: str) -> "ToyProblem":
        m = _PROBLEM_RE.match(text.strip())
        if not m:
            raise ValueError(f"not a toy problem: {text!r} (expected e.g. '7+3-8:e')")
        start, o1, x1, o2, x2, last = m.groups()
        return cls(int(start), ((o1, int(x1)), (o2, int(x2))), LABELS.index(last) + 1)


def solution_text(steps: Sequence[str], answer: str) -> str:
    return STEP_SEP.join([*steps, ANSWER_TAG + answer])


def random_problem(rng: np.random.Generator, k: int, *, rare: Sequence[int] = (),
                   use_rare: bool = False) -> ToyProblem:
    """A k-step problem whose two operations together move the value by an amount coprime to 10,
    so the chain visits all ten digits before a (value, operation) pair repeats: a problem of up
    to 20 steps never uses the same fact twice.

    With `rare` operands, the pair holds one of them when `use_rare` (so half the steps use a
    rare fact) and none of them otherwise."""
    if not 1 <= k <= MAX_STEPS:
        raise ValueError(f"k={k} steps is outside 1..{MAX_STEPS}")
    while True:
        pair = tuple((str(rng.choice(["+", "-"])), int(rng.choice(OPERANDS))) for _ in range(2))
        if math.gcd((_net(*pair[0]) + _net(*pair[1])) % BASE, BASE) != 1:
            continue
        if not rare or (sum(x in rare for _, x in pair) == 1) == use_rare:
            return ToyProblem(int(rng.integers(BASE)), pair, k)


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
    """1.0 when the response is right, else 0.0.

    The toy task's ground truth is the reference continuation (`ToyTask.reference`: the steps
    the prompt leaves to the answer, then `A:<value>`), and the reward checks the work: every
    step the response writes and its final answer must equal the reference's. With a bare
    number as ground truth only the last `A:<number>` is compared.
    """
    gt = str(ground_truth).strip()
    found = _ANSWER_RE.findall(response)
    if not found:
        return 0.0
    if ANSWER_TAG not in gt:
        try:
            return 1.0 if int(found[-1]) == int(gt) else 0.0
        except ValueError:
            return 0.0
    got, want = _steps_of(response.strip()), _steps_of(gt)
    if got != want:
        return 0.0
    return 1.0 if int(found[-1]) == int(_ANSWER_RE.findall(gt)[-1]) else 0.0


# ---- the task -------------------------------------------------------------------------------

HINT_FORMATS = ("payload", "level")
PAD_CHAR = "."  # fills the solution of a one-level request to its fixed width
LEVEL_END = "|"  # marks, in a one-level request, where the level's hint ends
_STEP_RE = re.compile(r"^[a-t]=\d[-+][1-9]=\d$")


class ToyTask(PayloadHints):
    """Prompt formats of the toy task (`sage_jax.tasks.base.Task`) through `CharTokenizer`.

    `hint_format` "payload" asks for every level in one JSON reply (`request_text`); "level" asks
    once per level (`level_request_text`) with the solution padded to the width of a
    `max_steps`-step solution, so a hint's i-th character sits a fixed distance behind the
    solution's i-th character: writing the hint is copying at one fixed offset."""

    name = "toy"
    reward_fn = staticmethod(toy_reward)
    system_prompt = None

    def __init__(self, tokenizer: CharTokenizer | None = None, *, hint_format: str = "payload",
                 max_steps: int = 16):
        if hint_format not in HINT_FORMATS:
            raise ValueError(f"toy hint_format must be one of {HINT_FORMATS}, got "
                             f"{hint_format!r}")
        self.tok = tokenizer or CharTokenizer()
        self.eos_ids = self.tok.eos_ids
        self.pad_id = self.tok.pad_id
        self.hint_format = hint_format
        self.width = len(solution_text(["a=0+1=1"] * max_steps, "0"))  # 8 * max_steps + 3

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
        k = len(_steps_of(solution))
        ends = ",".join(LABELS[k - n] if 0 < n <= min(k, len(LABELS)) else "-"
                        for n in hint_lengths(solution).values())
        return f"{SOLUTION_TAG}{solution}\n{REQUEST_TAG}{ends}:"

    def level_request_text(self, solution: str, level: int) -> str | None:
        """The request for one level: the solution with `|` instead of the `;` after the last
        step the hint holds, padded to the task's width, then after `H?` that step's label
        (None: the solution has no step for that level)."""
        solution = _one_line(solution)
        steps = _steps_of(solution)
        n = hint_lengths(solution).get(level, 0)
        if not n:
            return None
        head = STEP_SEP.join(steps[:n])
        marked = head + LEVEL_END + solution[len(head) + 1:]
        return (f"{SOLUTION_TAG}{marked.ljust(self.width, PAD_CHAR)}\n"
                f"{REQUEST_TAG}{LABELS[len(steps) - n]}:")

    def hint_requests(self, problem: str, solution: str) -> dict[int, list[int]]:
        """{0: the JSON request} ("payload"), or {level: that level's request} ("level")."""
        if self.hint_format == "payload":
            return {0: self.hint_request(problem, solution)}
        texts = {lvl: self.level_request_text(solution, lvl) for lvl in LEVELS}
        return {lvl: self.tok.encode(t, bos=True) for lvl, t in texts.items() if t}

    def read_hints(self, text: str, level: int, answer: str) -> tuple[dict[int, str], int]:
        """The usable hints in a reply to request `level` (0: the JSON payload); a one-level
        reply must be well-formed steps, and one that holds the last step (`a=...`) or an `A:`
        line gives the answer away: refused and counted."""
        if self.hint_format == "payload":
            return PayloadHints.read_hints(text, level, answer)
        hint = text.strip()
        steps = hint.split(STEP_SEP) if hint else []
        if ANSWER_TAG in hint or any(st.startswith("a=") for st in steps):
            return {}, 1
        if not steps or not all(_STEP_RE.match(st) for st in steps):
            return {}, 0
        return {level: hint}, 0

    # Task protocol
    def answer_prompt(self, problem: str) -> list[int]:
        return self.tok.encode(self.answer_text(problem), bos=True)

    def hinted_prompt(self, problem: str, hint: str) -> list[int]:
        return self.tok.encode(self.hinted_text(problem, hint), bos=True)

    def hint_request(self, problem: str, solution: str) -> list[int]:
        return self.tok.encode(self.request_text(problem, solution), bos=True)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode_until_eos(ids)

    @staticmethod
    def reference(problem: str, answer: str, hint: str | None = None) -> str:
        """The ground truth `toy_reward` checks an answer against: the reference continuation
        after `hint` (the whole solution without one)."""
        del answer  # the continuation ends with it
        return continuation(ToyProblem.parse(problem), hint)

    @staticmethod
    def extract_answer(text: str) -> str | None:
        """The value of the last `A:` line of a completion."""
        found = _ANSWER_RE.findall(text)
        return found[-1] if found else None

    @staticmethod
    def reference_hints(problem: str, solution: str, answer: str) -> dict[int, str]:
        """The levels of `reference_hints` (1 step, k/2 steps, k-1 steps of the solution)."""
        del problem, answer  # the solution's steps are all the rule needs
        return reference_hints(solution)

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
    """Which problems a split holds: lengths min_steps..max_steps, uniformly; with
    `rare_operands`, a `rare_share` of the problems of at least `rare_min_steps` steps hold one
    rare operand in their pair (half their steps then need a rare fact) and the others none."""

    min_steps: int = 1
    max_steps: int = 16
    rare_operands: tuple[int, ...] = ()
    rare_share: float = 0.0
    rare_min_steps: int = 1

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps <= MAX_STEPS:
            raise ValueError(f"need 1 <= min_steps <= max_steps <= {MAX_STEPS}, got "
                             f"{self.min_steps}..{self.max_steps}")
        if not set(self.rare_operands) <= set(OPERANDS) or len(self.rare_operands) >= 8:
            raise ValueError(f"rare operands must be at most 7 of {OPERANDS}, got "
                             f"{self.rare_operands}")
        if not 0.0 <= self.rare_share <= 1.0:
            raise ValueError(f"rare_share must be in [0, 1], got {self.rare_share}")

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(range(self.min_steps, self.max_steps + 1))

    def problem(self, rng: np.random.Generator, k: int) -> ToyProblem:
        """One k-step problem of this split (no extra draw from `rng` without rare operands)."""
        if not self.rare_operands:
            return random_problem(rng, k)
        use = k >= self.rare_min_steps and bool(rng.random() < self.rare_share)
        return random_problem(rng, k, rare=self.rare_operands, use_rare=use)

    def without_rare(self) -> "ToySpec":
        """The same lengths with no rare operand anywhere."""
        return dataclasses.replace(self, rare_share=0.0)


# Defaults of the embedded job (see `calibrate` and issue 8): SFT covers every length; RL and
# evaluation use the longer ones, where groups collapse.
SFT_SPEC = ToySpec(1, 16)
RL_SPEC = ToySpec(8, 16)
HELD_OUT_SEED = 30_000  # the held-out problems; training uses seed 0, calibration 10_000+


def make_problems(n: int, spec: ToySpec = RL_SPEC, *, seed: int = 0,
                  per_length: bool = False) -> list[ToyProblem]:
    """n problems (n per length when `per_length`), lengths cycling through the spec."""
    rng = np.random.default_rng([seed, 8])
    lengths = spec.lengths
    total = n * len(lengths) if per_length else n
    return [spec.problem(rng, lengths[i % len(lengths)]) for i in range(total)]


def to_example(p: ToyProblem, index: int) -> Example:
    return Example(problem=p.text, answer=p.answer, solution=p.solution, hint=None, index=index)


def make_examples(n: int, spec: ToySpec = RL_SPEC, *, seed: int = 0,
                  per_length: bool = False) -> list[Example]:
    """`Example`s (problem, answer, solution) for RL training or evaluation."""
    return [to_example(p, i) for i, p in enumerate(make_problems(n, spec, seed=seed,
                                                                 per_length=per_length))]


def held_out_problems(per_length: int, spec: ToySpec = RL_SPEC) -> list[ToyProblem]:
    """The held-out problems: `per_length` of every length of `spec`, lengths cycling (so any
    first n cover the lengths evenly); the one set of the toy job's evaluation, the study, in-
    training validation and `python -m sage_jax.evaluate`."""
    return make_problems(per_length, spec, seed=HELD_OUT_SEED, per_length=True)


def eval_problems(per_length: int, spec: ToySpec = RL_SPEC, *, limit: int | None = None
                  ) -> dict[str, list[Problem]]:
    """{"toy": `held_out_problems`} (the first `limit`) as benchmark problems."""
    got = held_out_problems(per_length, spec)[:limit]
    return {"toy": [Problem(problem=p.text, answer=p.answer, index=i, source="toy")
                    for i, p in enumerate(got)]}


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
    """(prompt ids, answer ids) of one SFT example: kind 'plain', 'hinted' (at `level`), 'write'
    (every level in one payload, or the request for `level` in the task's "level" format)."""
    if kind == "plain":
        return task.answer_prompt(problem.text), task.encode_answer(problem.solution)
    if kind == "hinted":
        hint = reference_hints(problem)[level]
        return (task.hinted_prompt(problem.text, hint),
                task.encode_answer(continuation(problem, hint)))
    if kind == "write" and task.hint_format == "level":
        return (task.hint_requests(problem.text, problem.solution)[level],
                task.encode_answer(reference_hints(problem)[level]))
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
        p = spec.problem(rng, lengths[int(rng.integers(len(lengths)))])
        kind = ("plain", "hinted", "write")[int(rng.choice(3, p=probs))]
        levels = sorted(reference_hints(p))
        if kind != "plain" and not levels:
            kind = "plain"
        level = (int(rng.choice(levels)) if kind == "hinted"
                 or (kind == "write" and task.hint_format == "level") else 0)
        out.append(sft_pair(task, p, kind, level))
    return out


def sft_examples(n: int, *, task: ToyTask | None = None, spec: ToySpec = SFT_SPEC,
                 mix: SFTMix = SFTMix(), seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """A fixed list of n SFT pairs (see `sft_draw`)."""
    return sft_draw(np.random.default_rng([seed, 9]), n, task=task, spec=spec, mix=mix)


# ---- the toy model --------------------------------------------------------------------------

def toy_model_config(**overrides) -> DecoderConfig:
    """A Llama-style decoder at toy size over the char vocabulary (about 0.8M parameters)."""
    tok = CharTokenizer()
    cfg = dict(family="llama", vocab_size=tok.vocab_size, hidden_size=128,
               intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32,
               rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               max_position_embeddings=512, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
               pad_token_id=tok.pad_id)
    cfg.update(overrides)
    return DecoderConfig(**cfg)
