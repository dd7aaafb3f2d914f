"""The Pallas decode-attention kernels (`engine/sampler/decode_attention.py`) equal the XLA path
(`decode._attend`, the one the parity tests check against transformers): one layer's attention
on ranges that start, end and cross column blocks, empty and whole; then whole sampling calls
on a mesh. Both kernels run in Pallas interpret mode on CPU; `tests/analysis/test_aot.py`
compiles them for TPU and GPU."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax import models
from sage_jax.config import MeshConfig
from sage_jax.engine.sampler import decode, decode_attention, programs, sampling
from sage_jax.infra import parallel


def _layer_inputs(b, g, kh, gq, h, p, s, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    n = lambda i, *shape: jax.random.normal(ks[i], shape, jnp.float32)  # noqa: E731
    queries = n(0, b * g, kh * gq * h)
    prompt = (n(1, b, kh, h, p), n(2, b, kh, p, h))
    gen = (n(3, b, kh, g, h, s), n(4, b, kh, g, s, h))
    new = (n(5, b, kh, g, h), n(6, b, kh, g, h))
    return queries, prompt, gen, new


# (implementation, prompt columns, generated slots): the TPU kernel's column blocks are 128
# wide here (3 of them), the GPU kernel's 16 (prompt) and 32 (generated)
CASES = [("tpu-interpret", 384, 384), ("gpu-interpret", 48, 96)]


@pytest.mark.parametrize("impl,p,s", CASES)
def test_a_kernel_equals_the_xla_attention(impl, p, s):
    """4 groups x 3 rows, 2 KV heads x 3 query heads: prompts of 0, 1, a block and a bit, and
    all columns; generated slots of 0, 1, a block boundary, the whole cache and beyond it."""
    b, g, kh, gq, h = 4, 3, 2, 3, 16
    attn = types.SimpleNamespace(k=kh, h=h, n=kh * gq)
    queries, prompt, gen, new = _layer_inputs(b, g, kh, gq, h, p, s)
    real_B = jnp.array([0, 1, p // 3 + 5, p])
    mask_BxP = jnp.arange(p)[None, :] >= p - real_B[:, None]
    slot_R = jnp.array([-1, 0, 1, s // 3, s // 3 + 1, 2 * s // 3 - 1, s, s + 4, 7, 17, 5, 2])
    valid_RxS = jnp.arange(s)[None, :] < slot_R[:, None]
    want = decode._attend(attn, queries, prompt, mask_BxP, gen, valid_RxS, new, g)
    got = jax.jit(lambda *a: decode._attend_live(impl, None, attn, *a, g))(
        queries, prompt, mask_BxP, gen, slot_R, new)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_a_kernel_skips_the_blocks_outside_a_rows_range():
    """Column blocks (128 wide here) past a row's live range are not read: NaNs there, which a
    masked einsum would carry into the result, leave the kernels' output finite and equal; an
    empty range gives the masked score as its log-sum-exp."""
    b, g, kh, gq, h, s = 2, 2, 1, 2, 16, 384
    q = jax.random.normal(jax.random.PRNGKey(1), (b, kh, g, gq, h))
    k = jax.random.normal(jax.random.PRNGKey(2), (b, kh, g, h, s))
    v = jax.random.normal(jax.random.PRNGKey(3), (b, kh, g, s, h))
    hi = jnp.array([[5, 130], [0, 384]])
    live_end = -(-hi // 128) * 128
    dead = jnp.arange(s)[None, None, None, :] >= live_end.reshape(b, 1, g, 1)  # [B, 1, G, S]
    for impl in ("tpu-interpret", "gpu-interpret"):
        clean = decode_attention.over_rows(impl, None, q, k, v, hi)
        dirty = decode_attention.over_rows(
            impl, None, q, jnp.where(dead[:, :, :, None, :], jnp.nan, k),
            jnp.where(dead[..., None], jnp.nan, v), hi)
        np.testing.assert_array_equal(np.asarray(dirty.out), np.asarray(clean.out))
        assert np.isfinite(np.asarray(clean.out)).all()
        assert clean.lse[1, 0, 0, 0] == np.float32(decode_attention.MASKED_SCORE)  # empty


def test_the_tpu_kernel_fetches_only_live_blocks_inside_the_cache():
    """For every range [lo, hi) of a 4-block cache, the blocks its grid steps name: each inside
    the cache, in order (the pipeline fetches a block once), exactly the live blocks (one block
    inside the cache for an empty range)."""
    blk, nb, n = 16, 4, 16 * 4 + 1
    lo, hi = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    got = np.stack([np.asarray(decode_attention.live_block(j, jnp.asarray(lo), jnp.asarray(hi),
                                                           blk, nb)) for j in range(nb)], -1)
    assert ((0 <= got) & (got < nb)).all() and (np.diff(got, axis=-1) >= 0).all()
    for a in range(n):
        for b in range(n):
            live = {j for j in range(nb) if j * blk < b and (j + 1) * blk > a}
            assert set(got[a, b].tolist()) == live or (not live and len(set(got[a, b])) == 1), (
                a, b, got[a, b])


@pytest.mark.parametrize("s", [384, 96])
def test_the_tpu_cache_write_equals_the_scatter(s):
    """Each row's new key/value lands at its own slot, in its own block (first, last, inside,
    a block's edges), rows with a slot outside the cache write nothing, and nothing else in
    the cache changes; at 96 slots the write block is the whole cache."""
    b, g, kh, h = 3, 4, 2, 16
    ks = jax.random.split(jax.random.PRNGKey(4), 4)
    k = jax.random.normal(ks[0], (b, kh, g, h, s))
    v = jax.random.normal(ks[1], (b, kh, g, s, h))
    nk, nv = (jax.random.normal(x, (b, kh, g, h)) for x in ks[2:])
    at = jnp.array([0, 1, 31, 32, 127, 128, 129, s - 1, s, -1, s + 7, 64]).reshape(b, g)
    want = decode_attention.write_rows("xla", None, k, v, nk, nv, at)
    got = jax.jit(lambda *a: decode_attention.write_rows("tpu-interpret", None, *a))(
        k, v, nk, nv, at)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(want[0]), np.asarray(k))  # something was written
    np.testing.assert_array_equal(np.asarray(want[0])[0, :, 0, :, 0], np.asarray(nk)[0, :, 0])
    np.testing.assert_array_equal(np.asarray(want[1])[1, :, 3, s - 1], np.asarray(nv)[1, :, 3])
    unwritten = np.ones((b, g, s), bool)
    for i, a in enumerate(np.asarray(at).ravel()):
        if 0 <= a < s:
            unwritten[i // g, i % g, a] = False
    np.testing.assert_array_equal(np.asarray(got[0]).transpose(0, 2, 4, 1, 3)[unwritten],
                                  np.asarray(k).transpose(0, 2, 4, 1, 3)[unwritten])


def test_the_implementation_is_chosen_by_platform():
    """TPU and GPU programs use the Pallas kernels, where they take the shapes (Triton's dot:
    head dim and column blocks powers of two >= 16); CPU ones the C++ kernel
    (tests/engine/test_cpu_attention.py)."""
    assert decode_attention.implementation(None) == "cpu"  # the tests' CPU backend
    assert decode_attention.supports("tpu", 64, 24, 96)
    assert decode_attention.supports("gpu", 64, 48, 96)
    assert not decode_attention.supports("gpu", 64, 24, 96)  # 24 = 8 x 3: blocks of 8
    assert not decode_attention.supports("gpu", 80, 48, 96)
    assert not decode_attention.supports("xla", 64, 48, 96)


def _tiny():
    cfg = models.DecoderConfig(family="qwen2", vocab_size=32, hidden_size=64,
                               intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=16, qkv_bias=True)
    return models.Decoder(cfg, rngs=nnx.Rngs(7))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["tpu-interpret", "gpu-interpret"])
def test_sampling_with_a_kernel_equals_the_xla_path(impl, monkeypatch):
    """A whole call on a mesh of 8 CPU devices (rows over data x fsdp, KV heads over tensor:
    the kernels run per shard), sampled, with EOS and continuous batching (rows at different
    steps, slots refilled): the same tokens and lengths, log-probs within 1e-5."""
    model = _tiny()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 32, n).tolist() for n in (3, 17, 9, 30)]
    kw = dict(max_new_tokens=40, num_samples=2, temperature=1.0, eos_token_id=(3, 5),
              max_rows=4, key=jax.random.PRNGKey(3),
              mesh=parallel.make_mesh(MeshConfig(2, 2, 2), jax.devices()[:8]))
    monkeypatch.setattr(decode_attention, "implementation", lambda lay: "xla")
    programs.drop(0)
    want = sampling.generate(model, prompts, **kw)
    monkeypatch.setattr(decode_attention, "implementation", lambda lay: impl)
    programs.drop(0)
    got = sampling.generate(model, prompts, **kw)
    programs.drop(0)
    assert len(set(want.lengths.ravel().tolist())) >= 3  # rows end at different steps
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
