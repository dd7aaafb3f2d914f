"""Math answers graded as the paper grades them: the last ``\\boxed{...}`` of a response,
checked for mathematical equivalence with the ground truth by the `math-verify` library.

`math_reward` is the paper's reward (1.0 or 0.0). `math_reward_checked`, registered as the "math"
reward, raises `RewardTimeout` / `RewardRejected` instead of scoring 0.0 for a timeout or a
refused input, so that `RewardPool`'s stats count them. `leaks_answer` is the hint check built on
it: a hint that boxes the final answer gives it away.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
from typing import Any

import numpy as np
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from sage_jax.infra.rewards import RewardRejected, RewardTimeout, register_reward

logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs whole inputs on timeout

MAX_BOXED_CHARS = 2_000
"""Boxed answers longer than this are refused (`RewardRejected`) instead of parsed."""

SOFT_TIMEOUT_S = 5
"""Per-step math-verify timeout (whole seconds, SIGALRM-based; used only in a main thread)."""

_BOX_OPEN_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)
_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")
_INTEGRAL_FLOAT_RE = re.compile(r"[+-]?\d+\.0*")
_SCI_NUMBER_RE = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d+)(?![\w.])")
_TRAILING_POINT_RE = re.compile(r"(?<=\d)\.(?=$|[\s/),\]}*])")  # "1./3", "(1., 2.)", "5."
_MACRO_SUBSCRIPT_RE = re.compile(r"_(?:\{\s*\\([A-Za-z]+)\s*\}|\\([A-Za-z]+))")
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())

# ---- answer text --------------------------------------------------------------------------

def _box_span(text: str, open_end: int) -> int | None:
    """Index of the brace closing a group opened just before `open_end`; None if unbalanced."""
    depth = 1
    for m in _BRACE_TOKEN_RE.finditer(text, open_end):
        token = m.group()
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, stripped.

    Braces must balance (escaped ``\\{`` and ``\\}`` do not count). Returns None when there is no
    box, the last box is empty, or its braces never close (e.g. a truncated answer).
    """
    last = None
    for last in _BOX_OPEN_RE.finditer(text):
        pass
    if last is None:
        return None
    close = _box_span(text, last.end())
    if close is None:
        return None
    content = text[last.end():close].strip()
    return content or None


def normalize_answer(answer: Any) -> str:
    """Canonical ground-truth string: integral floats as integers (27.0 -> "27"), no ``$``.

    Accepts str, int or float. Strips whitespace, a box wrapping the whole answer, and unescaped
    dollar signs (``$69$,$84$`` -> ``69,84``); escaped ``\\$`` (currency) is kept.
    """
    if isinstance(answer, (bool, np.bool_)) or answer is None:
        raise TypeError(f"answer must be a str, int or float, got {answer!r}")
    if isinstance(answer, (int, np.integer)):
        return str(int(answer))
    if isinstance(answer, (float, np.floating)):
        value = float(answer)
        if not math.isfinite(value):
            raise ValueError(f"answer is not a finite number: {answer!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, int or float, got {type(answer).__name__}")
    text = answer.strip()
    box = _BOX_OPEN_RE.match(text)
    if box is not None and _box_span(text, box.end()) == len(text) - 1:
        text = text[box.end():-1].strip()
    text = _UNESCAPED_DOLLAR_RE.sub("", text).strip()
    if _INTEGRAL_FLOAT_RE.fullmatch(text):
        text = text.split(".")[0]
    return text


# ---- math reward --------------------------------------------------------------------------

def _soft_timeout() -> int | None:
    """math-verify's SIGALRM timeouts work only in the main thread; elsewhere disable them."""
    return SOFT_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _prepare(text: str) -> str:
    """Rewrite what math-verify misreads: 3.8e35 (as 3.8*e*35), 1./3, and macro subscripts
    such as m_{\\max} or L_\\odot (unparseable; they become plain names, m_{max})."""
    text = _SCI_NUMBER_RE.sub(r"\1 \\times 10^{\2}", text)
    text = _TRAILING_POINT_RE.sub("", text)
    return _MACRO_SUBSCRIPT_RE.sub(lambda m: "_{" + (m.group(1) or m.group(2)) + "}", text)


@functools.lru_cache(maxsize=2048)  # a prompt's ground truth and its G answers repeat a lot
def _parse(latex: str, timeout_s: int | None) -> tuple:
    try:
        return tuple(parse("\\boxed{" + latex + "}", extraction_config=_EXTRACTION,
                     parsing_timeout=timeout_s, raise_on_error=True))
    except TimeoutException:
        raise RewardTimeout("math-verify timed out while parsing") from None
    except Exception:  # unparseable: judged by the string fallback only, or not at all
        return ()


def parse_answer(latex: str) -> tuple:
    """math-verify's reading of a bare LaTeX answer: SymPy objects and/or its string fallback.

    An answer that yields only strings can be matched by identical text alone.
    """
    return _parse(_prepare(latex), _soft_timeout())


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """Whether two bare LaTeX answers (no box) are mathematically equivalent per math-verify.

    Identical strings are equivalent without parsing. Raises `RewardTimeout` when a parse or
    every failing comparison ran out of time.
    """
    if answer.strip() == ground_truth.strip():
        return True
    timeout_s = _soft_timeout()
    gold, pred = parse_answer(ground_truth), parse_answer(answer)
    timed_out = False
    for g in gold:
        for p in pred:
            try:
                if verify(g, p, timeout_seconds=timeout_s, raise_on_error=True):
                    return True
            except TimeoutException:
                timed_out = True
            except Exception:  # e.g. sympy cannot compare these two kinds of object
                continue
    if timed_out:
        raise RewardTimeout("math-verify timed out while comparing")
    return False


def math_reward(response: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer in `response` equals `ground_truth` mathematically, else 0.0.

    No box, an empty box, unbalanced braces, a boxed answer over `MAX_BOXED_CHARS` and a
    math-verify timeout all score 0.0. `math_reward_checked` (the registered "math" reward) raises
    for the last two instead, so that `RewardPool` can count them.
    """
    try:
        return math_reward_checked(response, ground_truth)
    except (RewardTimeout, RewardRejected):
        return 0.0


def math_reward_checked(response: str, ground_truth: str) -> float:
    """`math_reward`, but raises `RewardRejected` for a boxed answer over `MAX_BOXED_CHARS` and
    `RewardTimeout` when math-verify runs out of time. Raises ValueError for an empty ground truth.
    """
    answer = extract_boxed(response)
    if answer is None:
        return 0.0
    if len(answer) > MAX_BOXED_CHARS:
        raise RewardRejected(f"boxed answer has {len(answer)} chars (limit {MAX_BOXED_CHARS})")
    gold = normalize_answer(ground_truth)
    if not gold:
        raise ValueError("ground truth is empty")
    return 1.0 if is_equivalent(answer, gold) else 0.0


def leaks_answer(hint: str, ground_truth: str) -> bool:
    """True when the hint boxes an answer equivalent to the ground truth."""
    if extract_boxed(hint) is None:
        return False
    return math_reward(hint, ground_truth) > 0


register_reward("math", math_reward_checked)  # its timeouts and refusals get counted
