"""Decoding rows that end at very different steps: segments, dropped rows, a growing cache.

The reference is a naive decoder that runs the model's full forward over prompt + tokens so far
at every step (no KV cache, one program per step width): the sampler must give the same tokens
(greedy, and sampling with the same per-row keys) and the teacher-forced log-probs, whether rows
are regrouped, dropped or on an 8-device mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax import models
from sage_jax.infra import parallel
from sage_jax.config import MeshConfig
from sage_jax.engine.sampler import programs, sampling, sampling_plan
from sage_jax.engine.sampler.select import select

T = 150  # rows end at many different steps; the cache grows from 32 to 152 slots


@pytest.fixture(autouse=True)
def _small_row_buckets(monkeypatch):
    """Regroups down to 8 rows for these tiny models too (a tiny model's default buckets start
    at 32 rows, more than these batches hold), so the tests here see rows regrouped."""
    monkeypatch.setattr(sampling_plan, "COARSE_ROW_BUCKET_MIN", sampling_plan.ROW_BUCKET_MIN)


def _model(seed=0):
    """A tiny random decoder with large weights: its greedy continuations wander over many
    tokens instead of settling into a short loop, so EOS ids can end rows at chosen steps."""
    cfg = models.DecoderConfig(family="llama", vocab_size=61, hidden_size=32, intermediate_size=64,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    graphdef, params = nnx.split(models.Decoder(cfg, rngs=nnx.Rngs(seed)))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 20.0 if x.ndim == 2 else x, params))


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 61, int(k)).tolist() for k in rng.integers(1, 20, n)]


def _naive(model, prompts, *, g, key, st, eos):
    """(tokens [N*G, T], lengths [N*G]) by full-forward recomputation with `select`'s rule."""
    graphdef, params = nnx.split(model)
    rows = [list(p) for p in prompts for _ in range(g)]
    pid = np.repeat(np.arange(len(prompts)), g)
    keys = jnp.stack([jax.random.fold_in(jax.random.fold_in(key, int(p)), j % g)
                      for j, p in enumerate(pid)])
    width = max(map(len, rows)) + T
    fwd = jax.jit(lambda p, s, m: models.apply(graphdef, p, s, mask_BxT=m)[:, -1])
    out = np.zeros((len(rows), T), np.int32)
    done = np.zeros(len(rows), bool)
    lengths = np.zeros(len(rows), np.int32)
    for t in range(T):
        seq = np.zeros((len(rows), width), np.int32)
        mask = np.zeros((len(rows), width), bool)
        for r, x in enumerate(rows):
            seq[r, width - len(x):], mask[r, width - len(x):] = x, True
        tok, _ = select(fwd(params, seq, mask), keys, t, st)
        tok = np.asarray(tok)
        for r in range(len(rows)):
            if not done[r]:
                out[r, t], lengths[r] = tok[r], t + 1
                rows[r].append(int(tok[r]))
                done[r] = tok[r] in eos
    return out, lengths


def _eos_for_mixed_ends(tokens):
    """EOS ids, absent from row 0's tokens (so it runs to the cap), chosen one by one so that
    rows 1, 2, ... end near steps 1, 5, 12, 20, 33, 45, 60, 90, 120 without cutting earlier
    rows."""
    first = [{} for _ in tokens]
    for r, row in enumerate(tokens):
        for t, x in enumerate(row.tolist()):
            first[r].setdefault(x, t)
    never = sorted(set(range(61)) - set(tokens[0].tolist()))
    eos, ends = [], {}

    def end(r, ids):
        return min([first[r][x] for x in ids if x in first[r]], default=T)

    for r, target in zip(range(1, len(tokens)), (1, 5, 12, 20, 33, 45, 60, 90, 120)):
        if end(r, eos) < T:
            continue  # already ended by an earlier choice
        ok = [x for x in never if x in first[r]
              and all(end(q, eos + [x]) == e for q, e in ends.items())]
        if ok:
            eos.append(min(ok, key=lambda x: abs(first[r][x] - target)))
            ends[r] = end(r, eos)
    return tuple(sorted(eos))


def _static(temperature, eos, g):
    return sampling_plan.Knobs(num_samples=g, max_new_tokens=T, temperature=temperature,
                            top_p=1.0, top_k=0, eos_ids=eos, pad_id=0)


@pytest.fixture(scope="module")
def case():
    model = _model()
    prompts = _prompts(12)
    key = jax.random.PRNGKey(3)
    free, _ = _naive(model, prompts, g=1, key=key, st=_static(0.0, (), 1), eos=())
    eos = _eos_for_mixed_ends(free)
    ref, lengths = _naive(model, prompts, g=1, key=key, st=_static(0.0, eos, 1), eos=eos)
    # The case this file is about: one row runs to the cap, others stop in many segments.
    assert lengths[0] == T and (lengths < T).sum() >= 8, lengths
    assert len(set((lengths - 1) // sampling_plan.DECODE_SEGMENT)) >= 4, lengths
    return model, prompts, key, eos, ref, lengths


@pytest.mark.slow
def test_greedy_rows_that_end_at_different_steps_equal_the_naive_decoder(case):
    model, prompts, key, eos, ref, lengths = case
    out = sampling.generate(model, prompts, max_new_tokens=T, temperature=0.0,
                            eos_token_id=eos, key=key)
    np.testing.assert_array_equal(out.lengths, lengths)
    np.testing.assert_array_equal(out.tokens, ref)
    # Finished rows stopped costing: well under the 16 bucketed rows x (T - 1) steps that
    # decoding every row to the end would take.
    assert out.decode_row_steps < 0.6 * 16 * (T - 1), out.decode_row_steps
    assert out.decode_row_steps >= int(lengths.sum()) - len(prompts)
    # The host waited once for the first tokens, then once per segment: a segment ends only
    # where the cache grows (32, 64, 128, 152 slots) or the running rows fit a smaller bucket
    # (16 rows -> 12 -> 8), not every DECODE_SEGMENT steps (which would be 10 segments here).
    assert out.host_syncs <= 1 + len(sampling_plan.slot_schedule(T, True)) + 2, out.host_syncs


@pytest.mark.slow
def test_logprobs_of_regrouped_rows_equal_the_full_forward(case):
    model, prompts, key, eos, _, _ = case
    out = sampling.generate(model, prompts, max_new_tokens=T, temperature=1.0,
                            eos_token_id=eos, key=key, num_samples=3)
    graphdef, params = nnx.split(model)
    rows = [list(p) + out.tokens[r, :out.lengths[r]].tolist()
            for r, p in enumerate(p for p in prompts for _ in range(3))]
    width = max(map(len, rows))  # right padding: a causal forward's earlier positions ignore it
    logits_all = models.apply(graphdef, params, jnp.asarray(
        [full + [0] * (width - len(full)) for full in rows]))  # one forward, one compile
    for r, full in enumerate(rows):
        n, plen = int(out.lengths[r]), len(full) - int(out.lengths[r])
        ref = jax.nn.log_softmax(logits_all[r, plen - 1:plen - 1 + n], axis=-1)
        np.testing.assert_allclose(out.logprobs[r, :n],
                                   np.take_along_axis(np.asarray(ref), out.tokens[r, :n, None],
                                                      -1)[:, 0], atol=2e-5, rtol=2e-5)
        assert (out.logprobs[r, n:] == 0).all() and (out.tokens[r, n:] == 0).all()


@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.slow
def test_sampled_tokens_follow_the_row_keys(case, g):
    """Sampling at temperature 1 with G rows per prompt (grouped, then one row per group after
    a regroup) draws exactly the naive decoder's tokens from the same per-row keys."""
    model, prompts, key, eos, _, _ = case
    ref, lengths = _naive(model, prompts[:6], g=g, key=key, st=_static(1.0, eos, g), eos=eos)
    out = sampling.generate(model, prompts[:6], max_new_tokens=T, temperature=1.0,
                            eos_token_id=eos, key=key, num_samples=g)
    np.testing.assert_array_equal(out.lengths, lengths)
    np.testing.assert_array_equal(out.tokens, ref)


@pytest.mark.slow
def test_an_8_device_mesh_gives_the_same_rows(case):
    model, prompts, key, eos, ref, lengths = case
    assert len(jax.devices()) >= 8, "conftest sets 8 CPU devices"
    mesh = parallel.make_mesh(MeshConfig(2, 2, 2), jax.devices()[:8])
    graphdef, params = nnx.split(model)
    params = jax.device_put(params, parallel.tree_shardings(params, mesh))
    tok, mask = sampling.left_pad(prompts, sampling_plan.prompt_bucket(max(map(len, prompts))), 0)
    out = sampling.sample(graphdef, params, tok, mask, key=key, num_samples=1,
                          max_new_tokens=T, temperature=0.0, eos_ids=eos, mesh=mesh)
    np.testing.assert_array_equal(out.lengths.reshape(-1), lengths)
    np.testing.assert_array_equal(out.tokens.reshape(len(prompts), T), ref)


def test_the_decode_loop_updates_its_cache_in_place(case):
    """No copy of a KV-cache-sized buffer inside the compiled decode segment (XLA copies the
    whole cache every step when a write is not ordered after the step's reads)."""
    model, _, _, _, _, _ = case
    graphdef, params = nnx.split(model)
    st = _static(0.0, (1,), 2)
    tok, mask = sampling.left_pad(_prompts(8, seed=1), 32, 0)
    logits, prompt_k, prompt_v = programs.get("prefill", graphdef, None, None)(params, tok,
                                                                                 mask)
    state, _, _ = programs.get("start", None, st, None, 64)(
        prompt_k, prompt_v, mask, logits, key=jax.random.PRNGKey(0), prompt_ids_B=jnp.arange(8),
        valid_B=jnp.ones(8, bool))
    seg = programs.get("segment", graphdef, st, None)
    hlo = seg.lower(params, state, jnp.int32(-1)).compile().as_text()
    shape = "f32[{}]".format(",".join(map(str, state.gen_k[0].shape)))
    copies = [line.strip() for line in hlo.splitlines() if " copy(" in line and shape in line]
    assert not copies, copies[:3]


@pytest.mark.slow
def test_a_long_call_waits_for_the_device_a_few_times_not_every_few_tokens():
    """8,191 decode steps (no row ends: the EOS id is outside the vocabulary) in one segment per
    cache size: 32, 64, ..., 8192 slots, the first tokens included 10 host syncs, not 512."""
    cfg = models.DecoderConfig(family="llama", vocab_size=61, hidden_size=16, intermediate_size=32,
                             num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    model = models.Decoder(cfg, rngs=nnx.Rngs(0))
    long = 8192
    out = sampling.generate(model, _prompts(2), max_new_tokens=long, temperature=1.0,
                            eos_token_id=999, key=jax.random.PRNGKey(0))
    assert (out.lengths == long).all()
    assert out.host_syncs == 1 + len(sampling_plan.slot_schedule(long, True)) == 10
