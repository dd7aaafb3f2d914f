"""Tests for sage_jax.tasks.math_grading: boxed extraction, answer normalisation, math
equivalence, its timeouts, and its place in the reward registry."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from math_verify.errors import TimeoutException

from sage_jax.infra.rewards import RewardRejected, RewardTimeout, get_reward
from sage_jax.tasks.base import PayloadHints
from sage_jax.tasks import math_grading
from sage_jax.tasks.math_grading import (
    MAX_BOXED_CHARS, extract_boxed, leaks_answer, math_reward, math_reward_checked,
    normalize_answer,
)


def boxed(answer: str) -> str:
    return "Some reasoning... so the answer is \\boxed{" + answer + "}."


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{42}", "42"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{\\left\\{ x \\right\\}}", "\\left\\{ x \\right\\}"),
    ("\\fbox{7}", "7"),
    ("\\boxed {  3 }", "3"),
    ("\\boxed{1} and \\fbox{2}", "2"),
    ("no box here", None),
    ("\\boxed{}", None),
    ("\\boxed{   }", None),
    ("\\boxed{\\frac{1}{2}", None),
    ("\\boxed{4} then a truncated \\boxed{5", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("raw, expected", [
    (27.0, "27"),
    (2.5, "2.5"),
    (7, "7"),
    ("27.0", "27"),
    ("  $\\frac{1}{2}$ ", "\\frac{1}{2}"),
    ("$69$,$84$", "69,84"),
    ("\\$18.90", "\\$18.90"),
    ("\\boxed{5}", "5"),
    ("1.5", "1.5"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize("raw", [None, True, float("nan"), ["1"]])
def test_normalize_answer_rejects_non_answers(raw):
    with pytest.raises((TypeError, ValueError)):
        normalize_answer(raw)


# ----------------------------------------------------------------------------- math_reward


@pytest.mark.parametrize("answer, truth", [
    ("0.5", "1/2"),
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{3}{4}", "\\frac34"),
    ("0.75", "\\dfrac{3}{4}"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("[1, 2)", "[1,2)"),
    ("(-\\infty, 3]", "(-\\infty,3]"),
    ("(1, 2, 3)", "\\left( 1,2,3 \\right)"),
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\{2, 1\\}", "\\{1,2\\}"),
    ("84, 69", "69,84"),
    ("50", "50\\%"),
    ("50\\%", "50"),
    ("1,000", "1000"),
    ("1000", "1,000"),
    ("32348", "\\$32,\\!348"),
    ("27", "27.0"),
    ("27", 27.0),
    ("3.83 \\times 10^{35}", "3.83e35"),
    ("-\\frac{1}{3}", "-1./3"),
    ("\\$18.90", "18.90"),
    ("x = 3", "3"),
    ("90^\\circ", "90"),
    ("\\text{Evelyn}", "\\text{Evelyn}"),
    ("\\text{(C)}", "C"),
    ("n^2 - n - 1", "m_{\\max }=n^{2}-n-1"),
    ("\\frac{L_\\odot}{M_\\odot}", "\\frac{L_{\\odot}}{M_{\\odot}}"),
])
def test_math_reward_equivalent(answer, truth):
    assert math_reward(boxed(answer), truth) == 1.0


@pytest.mark.parametrize("answer, truth", [
    ("0.51", "1/2"),
    ("28", "27.0"),
    ("2\\sqrt{3}", "\\sqrt{8}"),
    ("[1, 2]", "[1,2)"),
    ("(1, 2, 4)", "(1,2,3)"),
    ("\\{1, 3\\}", "\\{1,2\\}"),
    ("100", "1,000"),
    ("5", "50\\%"),
    ("B", "A"),
])
def test_math_reward_wrong(answer, truth):
    assert math_reward(boxed(answer), truth) == 0.0


@pytest.mark.parametrize("response", [
    "The answer is 4.",
    "\\boxed{}",
    "\\boxed{4",
    "\\boxed{4} but no, it is \\boxed{4",
    "",
])
def test_math_reward_no_usable_box_is_zero(response):
    assert math_reward(response, "4") == 0.0


def test_last_box_wins():
    response = "Maybe \\boxed{3}? No, the answer is \\boxed{4}."
    assert math_reward(response, "4") == 1.0
    assert math_reward(response, "3") == 0.0


def test_huge_box_is_refused():
    response = boxed("1+" * MAX_BOXED_CHARS + "1")
    assert math_reward(response, "5") == 0.0
    with pytest.raises(RewardRejected):
        math_reward_checked(response, "5")


def test_timeouts_score_zero_or_raise_when_checked(monkeypatch):
    def slow(*args, **kwargs):
        raise TimeoutException("simulated")

    monkeypatch.setattr(math_grading, "verify", slow)
    assert math_reward(boxed("0.5"), "1/2") == 0.0
    with pytest.raises(RewardTimeout):
        math_reward_checked(boxed("0.5"), "1/2")


def test_math_reward_works_off_the_main_thread():
    with ThreadPoolExecutor(max_workers=2) as ex:
        scores = list(ex.map(math_reward, [boxed("0.5"), boxed("3")], ["1/2", "4"]))
    assert scores == [1.0, 0.0]


def test_math_is_the_registered_math_reward():
    assert get_reward("math") is math_reward_checked


def test_leaks_answer_only_for_a_boxed_equal_answer():
    assert leaks_answer("so it is \\boxed{\\frac{1}{2}}", "0.5")
    assert not leaks_answer("so it is \\boxed{3}", "0.5")
    assert not leaks_answer("the answer is 0.5", "0.5")  # only a box counts


def test_a_payload_level_that_boxes_the_answer_is_refused_and_counted():
    text = json.dumps({"level1": "Use symmetry.", "level2": "So it is \\boxed{\\frac{1}{2}}",
                       "level3": "The answer is \\boxed{0.5}."})
    assert PayloadHints.read_hints(text, 0, "1/2") == ({1: "Use symmetry."}, 2)
    assert PayloadHints.read_hints(text, 0, "7") == (
        {1: "Use symmetry.", 2: "So it is \\boxed{\\frac{1}{2}}", 3: "The answer is \\boxed{0.5}."}, 0)
