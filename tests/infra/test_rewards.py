"""Tests for sage_jax.infra.rewards: the reward registry and RewardPool (timeouts, crashes,
memory limits, refusals), with the math reward and stand-in rewards."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from sage_jax.infra import rewards
from sage_jax.infra.rewards import RewardPool, get_reward, register_reward
from sage_jax.tasks.math_grading import extract_boxed, math_reward_checked

HANG_GUARD_S = 30.0  # generous bound: only catches hangs, not slowness


def boxed(answer: str) -> str:
    return "Some reasoning... so the answer is \\boxed{" + answer + "}."


# Module-level scorers: workers receive reward functions by reference, so they must be importable.
def exact_match(response: str, ground_truth: str) -> float:
    return float(extract_boxed(response) == ground_truth)


def always_half(response: str, ground_truth: str) -> float:
    return 0.5


def raises(response: str, ground_truth: str) -> float:
    raise RuntimeError("scorer bug")


def returns_nan(response: str, ground_truth: str) -> float:
    return float("nan")


def sleeps_forever(response: str, ground_truth: str) -> float:
    time.sleep(3600)
    return 1.0


def kills_worker(response: str, ground_truth: str) -> float:
    os._exit(3)


def allocates_4gib(response: str, ground_truth: str) -> float:
    return float(len(bytearray(4 * 2**30)) > 0)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(math_reward_checked, num_workers=2, timeout_s=10.0) as p:
        yield p


# ----------------------------------------------------------------------------- RewardPool


def test_pool_scores_batch_and_is_reusable(pool):
    responses = [boxed("0.5"), boxed("3"), "no box", boxed("\\sqrt{8}")]
    truths = ["1/2", "4", "4", "2\\sqrt{2}"]
    for _ in range(2):
        scores, stats = pool.score(responses, truths)
        assert scores.dtype == np.float32
        np.testing.assert_array_equal(scores, [1, 0, 0, 1])
        assert stats == {"n": 4, "timeouts": 0, "killed": 0, "errors": 0, "rejected": 0}
    assert pool.score([], [])[0].shape == (0,)
    with pytest.raises(ValueError, match="ground truths"):
        pool.score(["a"], [])


@pytest.mark.slow
def test_pool_hostile_inputs_score_zero_quickly(pool):
    hostile = [
        boxed("9^{9^{9^{9}}}"),                        # astronomically large power
        boxed("(" * 10_000 + "1" + ")" * 10_000),      # deep nesting, over the size limit
        boxed("(" * 300 + "1" + ")" * 300),            # deep nesting that stalls the parser
        "x" * 3_000_000,                               # megabytes of text
        "\\boxed{" + "{" * 900_000,                    # near-megabyte unbalanced box
    ]
    responses = hostile + [boxed("5")]
    start = time.monotonic()
    scores, stats = pool.score(responses, ["5"] * len(responses))
    elapsed = time.monotonic() - start
    assert elapsed < HANG_GUARD_S
    np.testing.assert_array_equal(scores, [0, 0, 0, 0, 0, 1])
    # The power tower always outlasts the limit; whether the 300-deep nesting does depends on
    # the machine's speed (it parsed in time, scoring 0, in one CI run), so it is not counted.
    assert stats["timeouts"] >= 1
    assert stats["rejected"] >= 2  # the 20,000-char box and the 3 MB text
    assert stats["errors"] == 0


def test_pool_kills_hung_worker_and_recovers():
    with RewardPool(sleeps_forever, num_workers=2, timeout_s=1.0) as p:
        start = time.monotonic()
        scores, stats = p.score(["a", "b", "c"], ["1", "2", "3"])
        assert time.monotonic() - start < HANG_GUARD_S
        np.testing.assert_array_equal(scores, [0, 0, 0])
        assert stats["timeouts"] == stats["killed"] == 3
        # the respawned workers grade again (a first math grading in a new worker can take
        # over the pool's 1 s on a busy machine, so this call has its own timeout)
        scores, stats = p.score([boxed("0.5")], ["1/2"], fn="math", timeout_s=HANG_GUARD_S)
        assert scores.tolist() == [1.0] and stats["timeouts"] == 0


def test_pool_counts_exceptions_and_crashes():
    with RewardPool(raises, num_workers=2) as p:
        scores, stats = p.score(["a"] * 3, ["b"] * 3)
        assert scores.tolist() == [0, 0, 0] and stats["errors"] == 3
        scores, stats = p.score(["a", "b"], ["b", "c"], fn=returns_nan)
        assert scores.tolist() == [0, 0] and stats["errors"] == 2
        scores, stats = p.score(["a", "b"], ["b", "c"], fn=kills_worker)
        assert scores.tolist() == [0, 0] and stats["errors"] == 2
        scores, stats = p.score(["a"], ["b"], fn=always_half)
        assert scores.tolist() == [0.5] and stats["errors"] == 0


def test_pool_memory_limit_turns_huge_allocations_into_errors():
    with RewardPool(allocates_4gib, num_workers=1, memory_limit_mb=1024) as p:
        scores, stats = p.score(["a"], ["b"])
        assert scores.tolist() == [0.0] and stats["errors"] == 1
        assert p.score([boxed("2")], ["2"], fn="math")[0].tolist() == [1.0]


def test_pool_counts_non_string_inputs_as_errors(pool):
    scores, stats = pool.score([None, boxed("2")], ["1", "2"])
    assert scores.tolist() == [0.0, 1.0]
    assert stats["errors"] == 1


def test_closed_pool_refuses_work():
    p = RewardPool(math_reward_checked, num_workers=1)
    p.close()
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.score(["a"], ["b"])


# ----------------------------------------------------------------------------- registry


@pytest.fixture
def registry_name():
    name = "test_exact_match"
    yield name
    rewards._REGISTRY.pop(name, None)


def test_registry(registry_name):
    register_reward(registry_name, exact_match)
    assert get_reward(registry_name) is exact_match
    register_reward(registry_name, exact_match)  # same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward(registry_name, always_half)
    register_reward(registry_name, always_half, overwrite=True)
    assert get_reward(registry_name) is always_half


def test_registered_task_reward_runs_in_pool(registry_name):
    register_reward(registry_name, exact_match)
    with RewardPool(registry_name, num_workers=1) as p:
        scores, _ = p.score([boxed("8,3"), boxed("8,4")], ["8,3", "8,3"])
    assert scores.tolist() == [1.0, 0.0]


def test_registry_errors():
    with pytest.raises(KeyError, match="math"):
        get_reward("no_such_reward")
    with pytest.raises(TypeError, match="picklable"):
        register_reward("lambda_reward", lambda r, g: 1.0)
    with pytest.raises(TypeError, match="callable"):
        register_reward("not_callable", 3)  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        get_reward("lambda_reward")
