"""Rollout correction (`core.rollout_correction`): weights against hand-computed ones, the loss
they weight, and its config (the update with them: tests/engine/test_update.py)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.core import grpo, rollout_correction as rc
from sage_jax.config import ConfigError, RLConfig


def test_token_weights_are_the_ratio_truncated_at_the_cap():
    old = jnp.array([[0.0, -1.0, -1.2, -0.5, 0.0]])
    smp = jnp.array([[0.0, -1.5, -1.0, -0.5, 9.0]])  # column 4 is off the mask
    mask = jnp.array([[False, True, True, True, False]])
    w, ratio, changed = rc.weights(old, smp, mask, mode="token", cap=1.5)
    expected = [1.0, 1.5, math.exp(-0.2), 1.0, 1.0]  # exp(0.5) = 1.65 is truncated to 1.5
    np.testing.assert_allclose(np.asarray(w)[0], expected, rtol=1e-6)
    assert np.asarray(ratio)[0, 1] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert np.asarray(changed).tolist() == [[False, True, False, False, False]]
    m = rc.metrics(ratio, changed, mask, 3.0)
    assert float(m["rollout_correction/ratio_mean"]) == pytest.approx(
        (math.exp(0.5) + math.exp(-0.2) + 1.0) / 3, rel=1e-6)
    assert float(m["rollout_correction/ratio_max"]) == pytest.approx(math.exp(0.5), rel=1e-6)
    assert float(m["rollout_correction/masked_share"]) == pytest.approx(1 / 3)


def test_sequence_weights_drop_a_packed_answer_whose_product_leaves_the_cap():
    # one packed sequence, two answers (segments 1 and 2) after their prompts
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    mask = jnp.array([[False, True, True, True, False, True, True, False]])
    old = jnp.array([[0.0, -1.0, -1.0, -1.0, 0.0, -2.0, -0.3, 0.0]])
    smp = jnp.array([[5.0, -1.2, -1.1, -1.0, 5.0, -2.0, -1.0, 0.0]])
    # answer 1: log r = 0.2 + 0.1 + 0 = 0.3 (r = 1.35, kept at cap 2); answer 2: 0.7 (r = 2.01)
    w, ratio, changed = rc.weights(old, smp, mask, mode="sequence", cap=2.0, segments_ZxL=seg)
    assert np.asarray(w).tolist() == [[1, 1, 1, 1, 1, 0, 0, 1]]
    np.testing.assert_allclose(np.asarray(ratio)[0, [1, 5]], [math.exp(0.3), math.exp(0.7)],
                               rtol=1e-5)
    assert np.asarray(changed).tolist() == [[False] * 5 + [True, True, False]]
    # below 1/cap drops too; one row per sequence when segments are None
    w2, _, _ = rc.weights(smp, old, mask, mode="sequence", cap=2.0)  # log r = -1.0 over the row
    assert np.asarray(w2).tolist() == [[1, 0, 0, 0, 1, 0, 0, 1]]
    with pytest.raises(ValueError, match="one of"):
        rc.weights(old, smp, mask, mode="tokens", cap=2.0)


def test_the_policy_loss_weights_each_tokens_loss():
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    mask = jnp.array([[True, True, True]])
    weights = jnp.array([[0.5, 2.0, 0.0]])
    loss, _ = grpo.policy_loss(logp, logp, jnp.array([0.7]), mask, weights_NxT=weights)
    assert float(loss) == pytest.approx(-0.7 * (0.5 + 2.0 + 0.0) / 3)  # ratio 1: pg = -A


def test_config_recomputes_old_logprobs_and_needs_a_cap_above_one():
    rl = RLConfig(rollout_correction="sequence", old_logprobs="sampler")
    rl.validate()
    assert not rl.sampler_old_logprobs  # the sampler's log-probs would make the ratio 1
    assert RLConfig(old_logprobs="sampler").sampler_old_logprobs
    with pytest.raises(ConfigError, match="rollout_correction_cap"):
        RLConfig(rollout_correction="token", rollout_correction_cap=1.0).validate()
