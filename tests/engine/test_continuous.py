"""Continuous batching (`sample(max_rows=...)`): more rows than slots give the same rows."""

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax import models
from sage_jax.config import MeshConfig
from sage_jax.engine.sampler import decode, sampling, sampling_plan
from sage_jax.infra import parallel


def _tiny(vocab=16, seed=3):
    """A small random model over 16 tokens: EOS ids come at different, early steps."""
    cfg = models.DecoderConfig(family="qwen2", vocab_size=vocab, hidden_size=32,
                               intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=8, qkv_bias=True)
    return models.Decoder(cfg, rngs=nnx.Rngs(seed))


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 16, n).tolist() for n in lengths]


KW = dict(max_new_tokens=40, num_samples=3, temperature=1.0, eos_token_id=(3, 7),
          key=jax.random.PRNGKey(5))


@pytest.mark.slow
def test_more_rows_than_slots_give_the_rows_of_one_batch():
    """7 prompts x 3 samples in 6 slots: every row's tokens and log-probs equal the lockstep
    call's, rows finish at many lengths (slots are refilled), and a decode segment never holds
    more than 6 rows."""
    model = _tiny()
    prompts = _prompts([4, 9, 6, 2, 11, 5, 3])
    ref = sampling.generate(model, prompts, **KW)
    before = decode.TRACE_COUNTS["decode"]
    out = sampling.generate(model, prompts, max_rows=6, **KW)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    assert len(set(ref.lengths.tolist())) >= 5  # rows end at many steps: refills happen
    assert (ref.lengths < KW["max_new_tokens"]).sum() >= 10
    # the segments ran at most 6 rows: row-steps <= 6 x (every row's steps, one at a time)
    assert out.decode_row_steps <= 6 * int((ref.lengths - 1).sum())
    assert out.decode_row_steps < ref.decode_row_steps or decode.TRACE_COUNTS["decode"] > before


@pytest.mark.slow
def test_continuous_batching_on_a_mesh_and_without_eos():
    """Rows that never end (no EOS: every row T tokens) and a one-device mesh: the same rows as
    the lockstep call; and a bad max_rows is a clear error."""
    model = _tiny(seed=4)
    prompts = _prompts([5, 8, 3, 6], seed=1)
    kw = dict(KW, eos_token_id=(), max_new_tokens=20)
    ref = sampling.generate(model, prompts, **kw)
    mesh = parallel.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    out = sampling.generate(model, prompts, max_rows=4, mesh=mesh, **kw)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert (out.lengths == 20).all()


def test_admission_buckets_and_a_bad_max_rows():
    """Admitted prompts are prefilled in power-of-two batches; max_rows below G is an error
    (raised before anything compiles)."""
    assert [sampling_plan.admit_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    model = _tiny()
    with pytest.raises(ValueError, match="max_rows must be an integer >= num_samples"):
        sampling.generate(model, _prompts([3, 4]), max_rows=2, **KW)
