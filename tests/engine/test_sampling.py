"""Sampler: greedy parity with `transformers`, log-probs, PRNG, EOS, buckets, knobs; LoRA
adapters in place and merged (the native engine's `merge_lora`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_reference import TINY_CONFIGS, make_hf_model
from sage_jax import models
from sage_jax.infra import parallel
from sage_jax.config import MeshConfig
from sage_jax.engine.sampler import decode, placement, programs, sampling, sampling_plan
from sage_jax.engine.trainer import packing
from sage_jax.rl import engines


def _tiny(vocab=97, seed=0, **kw):
    """A small random qwen2-shaped Decoder of our own (no checkpoint needed)."""
    cfg = models.DecoderConfig(family="qwen2", vocab_size=vocab, hidden_size=32,
                             intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8, qkv_bias=True, **kw)
    return models.Decoder(cfg, rngs=nnx.Rngs(seed))


def _sharpen(model, factor):
    """Scales the LM head so the next-token distribution is peaked (few likely tokens)."""
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * factor
    return model


def _prompts(vocab, lengths, seed=0, low=2):
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab, n).tolist() for n in lengths]


def _teacher_forced_logprobs(model, prompts, out, num_samples=1):
    """log_softmax of the model's own full forward over prompt + generated, at each token
    (all rows in one jitted, left-padded batch)."""
    rows, t = out.tokens.shape
    width = max(len(p) for p in prompts) + t
    seq = np.zeros((rows, width), np.int32)
    mask = np.zeros((rows, width), bool)
    cols = np.zeros((rows, t), np.int32)
    for r in range(rows):
        pr, n = list(prompts[r // num_samples]), int(out.lengths[r])
        full = pr + out.tokens[r, :n].tolist()
        seq[r, width - len(full):], mask[r, width - len(full):] = full, True
        cols[r, :n] = width - n - 1 + np.arange(n)  # the logits that predict generated token j
    graphdef, params = nnx.split(model)
    logits = jax.jit(lambda p, s, m: models.apply(graphdef, p, s, mask_BxT=m))(params, seq, mask)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    at = logp[np.arange(rows)[:, None], cols]  # [rows, T, V]
    res = np.take_along_axis(at, out.tokens[..., None], -1)[..., 0]
    return np.where(np.arange(t)[None] < out.lengths[:, None], res, 0.0).astype(np.float32)


# ---- parity with transformers -----------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def hf_pair(request, tmp_path_factory):
    hf = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, models.from_hf(path)


@pytest.mark.slow
def test_greedy_matches_transformers_generate(hf_pair):
    hf, ours = hf_pair
    vocab, new = hf.config.vocab_size, 16
    prompts = _prompts(vocab, [3, 11, 6, 17, 1], seed=1)
    # One left-padded batch of all prompts (EOS = the config's id 1, as for transformers).
    out = sampling.generate(ours, prompts, max_new_tokens=new, temperature=0.0)
    for i, pr in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([pr]), max_new_tokens=new, do_sample=False,
                              eos_token_id=1, pad_token_id=0)[0, len(pr):].tolist()
        got = out.tokens[i].tolist()
        diff = next((j for j in range(len(ref)) if got[j] != ref[j]), None)
        if diff is None:
            assert out.lengths[i] == len(ref), (i, got, ref)
            assert got[len(ref):] == [0] * (new - len(ref))
            continue
        # Forgiven only at a near-tie of the reference logits.
        with torch.no_grad():
            logits = hf(torch.tensor([pr + ref[:diff]])).logits[0, -1].float().numpy()
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] < 1e-4, (
            f"prompt {i}: first difference at {diff}, reference top-2 gap {top2[1] - top2[0]:.2e}"
            f"\nours {got}\nref  {ref}")


# ---- log-probs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("knobs", [dict(temperature=1.0),
                                   dict(temperature=0.7, top_p=0.9, top_k=20),
                                   dict(temperature=0.0)])
@pytest.mark.slow
def test_logprobs_equal_teacher_forced_log_softmax(knobs):
    model = _tiny(seed=1)
    prompts = _prompts(97, [4, 13, 7], seed=2)
    out = sampling.generate(model, prompts, max_new_tokens=12, num_samples=3, eos_token_id=5,
                            key=jax.random.PRNGKey(7), **knobs)
    assert out.tokens.shape == (9, 12) and out.logprobs.dtype == np.float32
    ref = _teacher_forced_logprobs(model, prompts, out, num_samples=3)
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-4)
    after = np.arange(12)[None] >= out.lengths[:, None]
    assert (out.logprobs[after] == 0).all()


# ---- randomness ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_same_key_same_tokens_independent_of_batch_and_bucket():
    model = _tiny(seed=2)
    base = _prompts(97, [4, 9, 6], seed=3)
    # (the same static configuration as other tests here: their compiled programs are reused)
    kw = dict(max_new_tokens=12, num_samples=3, temperature=1.0, eos_token_id=5)
    key = jax.random.PRNGKey(11)
    a = sampling.generate(model, base, key=key, prompt_ids=[0, 1, 2], **kw)
    b = sampling.generate(model, base, key=key, prompt_ids=[0, 1, 2], **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)

    # The same prompts among 9 others (batch bucket 8 -> 16) and with a 40-token prompt in the
    # batch (prompt bucket 16 -> 48), at other positions: the same rows come out.
    extra = _prompts(97, [5, 40, 3, 8, 12, 2, 7, 9, 4], seed=4)
    big = [extra[0], base[2], extra[1], extra[2], base[0], *extra[3:8], base[1], extra[8]]
    ids = [100, 2, 101, 102, 0, 103, 104, 105, 106, 107, 1, 108]
    assert sampling_plan.batch_bucket(len(big)) != sampling_plan.batch_bucket(len(base))
    assert sampling_plan.prompt_bucket(40) != sampling_plan.prompt_bucket(9)
    c = sampling.generate(model, big, key=key, prompt_ids=ids, **kw)
    for pid, pos in [(0, 4), (1, 10), (2, 1)]:
        rows_a, rows_c = slice(3 * pid, 3 * pid + 3), slice(3 * pos, 3 * pos + 3)
        np.testing.assert_array_equal(c.tokens[rows_c], a.tokens[rows_a])
        np.testing.assert_allclose(c.logprobs[rows_c], a.logprobs[rows_a], atol=1e-5)

    # The G samples of a prompt differ, and another key gives other tokens.
    assert not np.array_equal(a.tokens[0], a.tokens[1])
    d = sampling.generate(model, base, key=jax.random.PRNGKey(12), prompt_ids=[0, 1, 2], **kw)
    assert not np.array_equal(a.tokens, d.tokens)


@pytest.mark.slow
def test_generate_on_a_mesh_gives_the_same_rows_with_the_trainers_programs():
    """`generate(mesh=...)` (the toy job's calibration and evaluation) samples what `generate`
    does, and runs the programs of `sample` on trainer-placed parameters (no new executable)."""
    model = _tiny(seed=2)
    base = _prompts(97, [4, 9, 6], seed=3)
    kw = dict(max_new_tokens=12, num_samples=3, temperature=1.0, eos_token_id=5,
              key=jax.random.PRNGKey(11), prompt_ids=[0, 1, 2])
    mesh = parallel.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    a = sampling.generate(model, base, **kw)
    b = sampling.generate(model, base, mesh=mesh, **kw)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.logprobs, a.logprobs)
    graphdef, params = nnx.split(model)
    params = jax.device_put(params, parallel.tree_shardings(params, mesh))  # as the trainer
    lay = placement.layout(mesh, model.cfg.num_kv_heads, sampling_plan.batch_bucket(3))
    prefill = programs.get("prefill", graphdef, None, lay)
    size = prefill._cache_size()
    tok, mask = sampling.left_pad(base, sampling_plan.prompt_bucket(9), 0)
    c = sampling.sample(graphdef, params, tok, mask, key=kw["key"], num_samples=3,
                        max_new_tokens=12, temperature=1.0, eos_ids=(5,),
                        prompt_ids_B=np.arange(3, dtype=np.int32), mesh=mesh)
    assert prefill._cache_size() == size > 0
    np.testing.assert_array_equal(np.asarray(c.tokens).reshape(9, -1), a.tokens)


@pytest.mark.slow
def test_the_sampler_decodes_with_the_lora_adapters():
    """A LoRA model samples through its adapters: with B = 0 the rows of the same model without
    adapters; with a non-zero B other rows, the ones of a plain model whose kernels hold the
    adapters folded in by hand (numpy)."""
    spec = models.LoraSpec(rank=4, alpha=8.0)
    plain = _tiny(seed=3)
    lora = models.Decoder(plain.cfg, rngs=nnx.Rngs(3), lora=spec)
    prompts = _prompts(97, [4, 9, 6], seed=5)
    kw = dict(max_new_tokens=12, num_samples=3, temperature=1.0, eos_token_id=5,
              key=jax.random.PRNGKey(11), prompt_ids=[0, 1, 2])
    a = sampling.generate(plain, prompts, **kw)
    b = sampling.generate(lora, prompts, **kw)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-6)

    rng = np.random.default_rng(0)
    folded = _tiny(seed=3)
    for path, m in nnx.iter_graph(lora):
        if isinstance(m, models.decoder.Linear) and m.lora_b is not None:
            m.lora_b[...] = jnp.asarray(0.3 * rng.standard_normal(m.lora_b.shape), jnp.float32)
            w = np.asarray(m.kernel[...], np.float64) + (
                np.asarray(m.lora_a[...], np.float64) @ np.asarray(m.lora_b[...], np.float64)
                * spec.alpha / spec.rank)
            target = folded
            for key in path:
                target = target[key] if isinstance(key, int) else getattr(target, key)
            target.kernel[...] = jnp.asarray(w, jnp.float32)
    c = sampling.generate(lora, prompts, **kw)
    assert not np.array_equal(c.tokens, a.tokens)
    d = sampling.generate(folded, prompts, **kw)
    np.testing.assert_array_equal(c.tokens, d.tokens)
    np.testing.assert_allclose(c.logprobs, d.logprobs, atol=1e-4)


def _lora_model(b_seed: int, vocab: int = 128) -> models.Decoder:
    """`_tiny(vocab, seed=3)`'s weights with rank-4 adapters (alpha 8) whose B is random, drawn
    from `b_seed` (fresh ones are 0: the base's function)."""
    model = models.Decoder(_tiny(vocab).cfg, rngs=nnx.Rngs(3),
                           lora=models.LoraSpec(rank=4, alpha=8.0))
    rng = np.random.default_rng(b_seed)
    for _, m in nnx.iter_graph(model):
        if isinstance(m, models.decoder.Linear) and m.lora_b is not None:
            m.lora_b[...] = jnp.asarray(0.3 * rng.standard_normal(m.lora_b.shape), jnp.float32)
    return model


def _native(graphdef, params, mesh=None, **kw) -> engines.NativeEngine:
    """The native engine on `params` (on `mesh`: placed there first, see `_placed`)."""
    return engines.NativeEngine(graphdef, params, eos_ids=(5,), pad_id=0, mesh=mesh, **kw)


def _placed(model, mesh):
    """(graphdef, params) of `model`, the params placed on `mesh` as the trainer places them."""
    graphdef, params = nnx.split(model)
    return graphdef, jax.device_put(params, parallel.tree_shardings(params, mesh))


def _by_name(params) -> dict:
    """{"layers/0/mlp/gate_proj/kernel": array, ...}"""
    return {parallel.path_str(k): x for k, x in jax.tree_util.tree_flatten_with_path(params)[0]}


GREEDY = dict(key=jax.random.PRNGKey(5), prompt_ids=[0, 1, 2, 3], num_samples=2,
              max_new_tokens=12, temperature=0.0, top_p=1.0, top_k=0)


def _assert_same_rows(got, want):
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2)])
def test_the_merged_lora_engine_samples_what_the_adapters_in_place_sample(shape):
    """rollout.lora_merged: the native engine that folds a LoRA policy's adapters (B non-zero)
    into its kernels samples the greedy rows of the engine that runs them in place, and of the
    plain model `models.merge_lora` builds (log-probs within 1e-4), not the base's; it samples
    that plain model's definition with no adapter. Its adapted kernels are new arrays with the
    sharding the trainer's rules give the plain model's kernel of that name (on the 8-device
    mesh too); every other leaf is the policy's own array (no copy)."""
    mesh = parallel.make_mesh(MeshConfig(*shape), jax.devices()[:int(np.prod(shape))])
    lora = _lora_model(0)
    prompts = _prompts(128, [4, 9, 6, 7], seed=5)
    graphdef, params = _placed(lora, mesh)
    in_place = _native(graphdef, params, mesh)
    merged = _native(graphdef, params, mesh, merge_lora=True)
    plain = _native(*_placed(models.merge_lora(lora), mesh), mesh)
    base = _native(*_placed(models.Decoder(lora.cfg, rngs=nnx.Rngs(3)), mesh), mesh)
    assert merged.graphdef == plain.graphdef != graphdef
    assert not engines.has_adapters(merged.params) and engines.has_adapters(in_place.params)
    want, got, policy = (_by_name(e.params) for e in (plain, merged, in_place))
    assert got.keys() == want.keys()
    folded = [n for n in got if n.removesuffix("kernel") + "lora_a" in policy]
    assert len(folded) == 7 * lora.cfg.num_layers
    for name, x in got.items():
        assert x.sharding == want[name].sharding, (name, x.sharding, want[name].sharding)
        np.testing.assert_allclose(np.asarray(x), np.asarray(want[name]), atol=1e-6,
                                   err_msg=name)
        assert (x is policy[name]) == (name not in folded), name  # the rest: shared, no copy
    if shape != (1, 1, 1):  # the rules split the kernels here
        assert not got["layers/0/mlp/gate_proj/kernel"].sharding.is_fully_replicated
    rows = merged.sample(prompts, **GREEDY)
    _assert_same_rows(rows, in_place.sample(prompts, **GREEDY))
    _assert_same_rows(rows, plain.sample(prompts, **GREEDY))
    assert not np.array_equal(rows.tokens, base.sample(prompts, **GREEDY).tokens)


@pytest.mark.slow
def test_the_merged_lora_engine_merges_the_adapters_again_at_each_sync():
    """After a sync with other adapters the merged engine samples what the in-place engine
    samples with those (not its first merged kernels); a policy without adapters samples as it
    is (the flag does nothing at rank 0)."""
    prompts = _prompts(128, [4, 9, 6, 7], seed=5)
    graphdef, first = nnx.split(_lora_model(0))
    _, second = nnx.split(_lora_model(1))
    merged = _native(graphdef, first, merge_lora=True)
    before = merged.sample(prompts, **GREEDY)
    _assert_same_rows(before, _native(graphdef, first).sample(prompts, **GREEDY))
    merged.sync(second)
    after = merged.sample(prompts, **GREEDY)
    assert not np.array_equal(after.tokens, before.tokens)
    _assert_same_rows(after, _native(graphdef, second).sample(prompts, **GREEDY))

    graphdef, params = nnx.split(_tiny(128))
    plain = _native(graphdef, params, merge_lora=True)
    assert plain.folder is None and plain.graphdef == graphdef and plain.params is params


# ---- EOS and padding ----------------------------------------------------------------------------

@pytest.mark.slow
def test_rows_stop_at_eos_and_are_padded_after():
    # 16-token vocabulary, near-uniform next-token distribution: EOS ids 3 and 7 come soon.
    model = _tiny(vocab=16, seed=3)
    prompts = _prompts(16, [3, 8, 5, 12, 1, 6], seed=5)
    t, pad = 40, 11
    out = sampling.generate(model, prompts, max_new_tokens=t, num_samples=4,
                            eos_token_id=[3, 7], pad_id=pad, key=jax.random.PRNGKey(3))
    early = 0
    for r in range(out.tokens.shape[0]):
        row, n = out.tokens[r], int(out.lengths[r])
        hits = np.nonzero(np.isin(row, [3, 7]))[0]
        if n < t:
            early += 1
            assert row[n - 1] in (3, 7), (r, row, n)  # the EOS token is included
            assert not np.isin(row[:n - 1], [3, 7]).any()
            assert (row[n:] == pad).all()
            assert (out.logprobs[r, n:] == 0).all()
        else:
            assert len(hits) == 0 or hits[0] == t - 1
        assert (out.logprobs[r, :n] < 0).all()
    assert early >= 20, early
    ref = _teacher_forced_logprobs(model, prompts, out, num_samples=4)
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-4)


def test_all_rows_finished_ends_the_loop():
    model = _tiny(seed=4)
    prompts = _prompts(97, [3, 6, 2], seed=6)
    first = sampling.generate(model, prompts, max_new_tokens=1, temperature=0.0)
    # With every row's greedy first token as an EOS id, every row ends at its first token.
    out = sampling.generate(model, prompts, max_new_tokens=64, temperature=0.0,
                            eos_token_id=first.tokens[:, 0].tolist())
    assert (out.lengths == 1).all()
    np.testing.assert_array_equal(out.tokens[:, 0], first.tokens[:, 0])
    assert (out.tokens[:, 1:] == 0).all() and (out.logprobs[:, 1:] == 0).all()


# ---- compilation ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_second_batch_in_the_same_bucket_does_not_recompile():
    model = _tiny(seed=5)
    kw = dict(max_new_tokens=6, num_samples=2, temperature=0.9, eos_token_id=4)
    sampling.generate(model, _prompts(97, [3, 9, 5], seed=7), **kw)
    before = dict(decode.TRACE_COUNTS)
    graphdef, _ = nnx.split(model)
    st = sampling_plan.Knobs(num_samples=2, max_new_tokens=6, temperature=0.9, top_p=1.0, top_k=0,
                          eos_ids=(4,), pad_id=0)
    prefill = programs.get("prefill", graphdef, None, None)
    segment = programs.get("segment", graphdef, st, None)
    sizes = (prefill._cache_size(), segment._cache_size())
    # Other prompts of other lengths, same buckets (8 prompts, 16 tokens, 8 rows of 6 live).
    sampling.generate(model, _prompts(97, [14, 2, 16], seed=8), **kw,
                      key=jax.random.PRNGKey(5))
    assert decode.TRACE_COUNTS == before
    assert (prefill._cache_size(), segment._cache_size()) == sizes
    # A new bucket (128 prompt tokens, used by no other test) does compile: the counter works.
    sampling.generate(model, _prompts(97, [100], seed=9), **kw)
    assert decode.TRACE_COUNTS["prefill"] == before["prefill"] + 1
    assert decode.TRACE_COUNTS["decode"] == before["decode"] + 1


# ---- sampling knobs ----------------------------------------------------------------------------

@pytest.mark.slow
def test_top_k_1_and_tiny_top_p_equal_greedy():
    model = _tiny(seed=6)
    prompts = _prompts(97, [5, 2, 10], seed=10)
    kw = dict(max_new_tokens=12, num_samples=3, eos_token_id=5)
    greedy = sampling.generate(model, prompts, temperature=0.0, **kw)
    assert (greedy.tokens.reshape(3, 3, 12) == greedy.tokens[::3, None]).all()
    for knobs in [dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=1e-6),
                  dict(temperature=0.5, top_k=1, top_p=0.5)]:
        out = sampling.generate(model, prompts, key=jax.random.PRNGKey(1), **knobs, **kw)
        np.testing.assert_array_equal(out.tokens, greedy.tokens, err_msg=str(knobs))
        np.testing.assert_allclose(out.logprobs, greedy.logprobs, atol=1e-6)


@pytest.mark.slow
def test_temperature_sampling_gives_varied_outputs():
    model = _tiny(seed=7)
    out = sampling.generate(model, _prompts(97, [6], seed=11), max_new_tokens=8, num_samples=8,
                            temperature=1.0, eos_token_id=())
    assert len({tuple(r) for r in out.tokens.tolist()}) == 8
    greedy = sampling.generate(model, _prompts(97, [6], seed=11), max_new_tokens=8,
                               temperature=0.0, eos_token_id=())
    assert not (out.tokens == greedy.tokens[0]).all(axis=1).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0),
                                                     (1.0, 4, 1.0), (0.8, 0, 0.7),
                                                     (1.0, 6, 0.8)])
@pytest.mark.slow
def test_first_token_distribution(temperature, top_k, top_p):
    """Empirical first-token frequencies match softmax(logits / T) after top-k, then top-p."""
    model = _sharpen(_tiny(seed=8), 40.0)
    prompt = _prompts(97, [5], seed=12)[0]
    n_prompts, g = 8, 1000
    out = sampling.generate(model, [prompt] * n_prompts, max_new_tokens=1, num_samples=g,
                            temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=(),
                            prompt_ids=list(range(n_prompts)), key=jax.random.PRNGKey(2))
    logits = np.asarray(model(jnp.asarray([prompt]))[0, -1], np.float64) / temperature
    order = np.argsort(-logits)
    keep = np.ones_like(logits, bool)
    if top_k:
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(logits - logits.max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        ps = p[order]
        cut = np.searchsorted(np.cumsum(ps), top_p) + 1  # smallest prefix with mass >= top_p
        keep[order[cut:]] = False
        p = np.where(keep, p, 0.0) / p[order[:cut]].sum()
    freq = np.bincount(out.tokens[:, 0], minlength=p.size) / out.tokens.shape[0]
    assert (freq[~keep] == 0).all(), "a filtered-out token was sampled"
    assert 0.5 * np.abs(freq - p).sum() < 0.03, (np.round(freq[order[:8]], 3),
                                                 np.round(p[order[:8]], 3))


# ---- array-level API and errors ----------------------------------------------------------------

def test_array_api_shapes_and_generate_agree():
    model = _tiny(seed=9)
    prompts = _prompts(97, [3, 7], seed=13)
    tok = np.zeros((2, 7), np.int32)
    mask = np.zeros((2, 7), bool)
    for i, pr in enumerate(prompts):
        tok[i, 7 - len(pr):], mask[i, 7 - len(pr):] = pr, True
    graphdef, params = nnx.split(model)
    out = sampling.sample(graphdef, params, jnp.asarray(tok), jnp.asarray(mask),
                          key=jax.random.PRNGKey(4), num_samples=3, max_new_tokens=12,
                          eos_ids=(5,), prompt_ids_B=jnp.asarray([0, 1]))
    assert out.tokens.shape == (2, 3, 12) and out.tokens.dtype == jnp.int32
    assert out.lengths.shape == (2, 3) and out.logprobs.shape == (2, 3, 12)
    ref = sampling.generate(model, prompts, max_new_tokens=12, num_samples=3, eos_token_id=5,
                            key=jax.random.PRNGKey(4))
    np.testing.assert_array_equal(np.asarray(out.tokens).reshape(6, 12), ref.tokens)
    np.testing.assert_array_equal(np.asarray(out.lengths).reshape(6), ref.lengths)


def test_bad_inputs_are_clear_errors():
    model = _tiny(seed=10)
    graphdef, params = nnx.split(model)
    tok = np.ones((2, 4), np.int32)
    right_padded = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
    with pytest.raises(ValueError, match="row 1 is not left-padded"):
        sampling.sample(graphdef, params, tok, right_padded, key=jax.random.PRNGKey(0),
                        max_new_tokens=3)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampling.generate(model, [[1, 2], []], max_new_tokens=3)
    with pytest.raises(ValueError, match="top_p"):
        sampling.generate(model, [[1, 2]], max_new_tokens=3, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        sampling.generate(model, [[1, 2]], max_new_tokens=3, temperature=-1.0)


def test_buckets():
    assert [sampling_plan.prompt_bucket(n) for n in (1, 16, 17, 25, 64, 65, 141, 1000)] == [
        16, 16, 24, 32, 64, 96, 192, 1024]
    assert [sampling_plan.prompt_bucket(n, fine=False) for n in (1, 17, 25, 65, 141)] == [
        16, 32, 32, 128, 256]
    assert [sampling_plan.row_bucket(n) for n in (1, 8, 9, 13, 17, 33, 100)] == [
        8, 8, 12, 16, 24, 48, 128]
    assert [sampling_plan.row_bucket(n, shards=6) for n in (1, 13, 25)] == [12, 18, 36]
    assert [sampling_plan.row_bucket(n, shards=8) for n in (9, 17, 25)] == [16, 24, 32]
    assert [sampling_plan.row_bucket(n, fine=False) for n in (1, 9, 17, 33)] == [32, 32, 32, 64]
    assert [sampling_plan.row_bucket(n, shards=6, fine=False) for n in (1, 37)] == [36, 72]
    assert sampling_plan.fine_buckets(sampling_plan.FINE_BUCKETS_MIN_PARAMS)
    assert not sampling_plan.fine_buckets(sampling_plan.FINE_BUCKETS_MIN_PARAMS - 1)
    assert [sampling_plan.slot_bucket(n, 384) for n in (1, 33, 129, 200, 300)] == [32, 64, 256, 256,
                                                                               384]
    assert sampling_plan.slot_bucket(16, 72) == 32 and sampling_plan.slot_bucket(40, 72) == 64
    assert sampling_plan.slot_bucket(70, 72) == sampling_plan.gen_slots(72) == 72
    assert [sampling_plan.batch_bucket(n) for n in (1, 8, 9, 128, 129)] == [8, 8, 16, 128, 256]


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.slow
def test_chunked_prefill_of_long_prompts_gives_the_same_result(monkeypatch, remat):
    """Prefill in chunks of prompts (a `lax.map` that merges the model) equals one whole
    prefill, with and without model.remat (NNX's own remat failed to trace there)."""
    model = _tiny(seed=11)
    model.remat = remat
    prompts = _prompts(97, [30, 5, 17, 9, 26], seed=14)
    kw = dict(max_new_tokens=12, num_samples=3, temperature=1.0, eos_token_id=5)
    whole = sampling.generate(model, prompts, **kw)
    # 8 prompt rows of 32 tokens: a budget of two rows' scores prefills 4 chunks of 2.
    monkeypatch.setattr(decode, "PREFILL_SCORES_BYTES", 2 * 4 * 32 * 32 * 4)
    assert decode.prefill_rows(model.cfg, 8, 32) == 2
    monkeypatch.setattr(programs, "_CACHE", {})  # fresh programs, traced with the new budget
    chunked = sampling.generate(model, prompts, **kw)
    np.testing.assert_array_equal(chunked.tokens, whole.tokens)
    np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-5)


def test_length_bucket_pads_under_an_eighth():
    assert [packing.length_bucket(n) for n in (1, 16, 17, 100, 129, 145, 1000, 8300)] == [
        16, 16, 32, 112, 144, 160, 1024, 9216]
    for n in range(1, 5000, 7):
        b = packing.length_bucket(n)
        assert n <= b and (b - n) < max(16, n / 8)


@pytest.mark.slow
def test_drop_programs_bounds_the_compiled_programs_and_changes_no_result(monkeypatch):
    """Past the limit every compiled sampler program is dropped (the trainer calls this between
    steps); programs compile again when needed, and the samples are the same."""
    model = _tiny(seed=11)
    kw = dict(max_new_tokens=5, num_samples=2, temperature=0.8, eos_token_id=4)
    prompts = [_prompts(97, [n], seed=n) for n in (3, 20, 40)]  # three prompt buckets
    first = [sampling.generate(model, p, **kw) for p in prompts]
    held = programs.compiled()
    assert held >= 3
    assert not programs.drop(limit=held)  # at the limit: kept
    assert programs.drop(limit=held - 1)
    assert programs.compiled() == 0
    again = [sampling.generate(model, p, **kw) for p in prompts]
    assert programs.compiled() > 0
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_the_trainer_keeps_more_programs_of_a_smaller_model():
    """The programs kept between steps are counted in program-layers: SmolLM2-135M's 30
    layers keep 48 (about 1 GB of host memory), the toy's 4 keep 360 (a SAGE step's prompt
    lengths no longer drop and recompile every program every other step), never fewer than
    48."""
    assert programs.budget(30) == programs.MAX_PROGRAMS == 48
    assert programs.budget(4) == 360
    assert programs.budget(80) == 48
