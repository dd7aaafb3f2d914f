"""A full training step -- rollout on the trainer's sharded weights, rewards, SAGE hints and
hinted re-sampling, the update -- on 8 fake CPU devices gives the same samples, metrics and
parameters as on one device, for meshes over data, fsdp and tensor."""

import time

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax.run import loop
from sage_jax.rl import batching, engines, rollout
from sage_jax import config, models
from sage_jax.infra import parallel
from sage_jax.core import grpo
from sage_jax.engine.sampler import sampling, sampling_plan
from sage_jax.engine.trainer import packing, update
from sage_jax.tasks.toy import chains as toy
from sage_jax.tasks.data import Example

settings_of = update.UpdateSettings.of  # the update's settings of a run's Config

MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 1, 8)]
PROMPTS, GROUP, NEW = 8, 2, 8
# Dims split 8 ways where the partition rules split them: hidden 64 (fsdp), 16 query / 8 KV
# heads of 8 (tensor; the KV caches' head axis too), MLP 128, char vocabulary 128.
MODEL = toy.toy_model_config(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=16,
                             num_kv_heads=8, head_dim=8)
CFG = config.Config(
    model=config.ModelConfig(dtype="float32", compute_dtype="float32", remat=False),
    rl=config.RLConfig(method="sage", prompts_per_step=PROMPTS, group_size=GROUP,
                       max_new_tokens=NEW, minibatches=2, temperature=1.0),
    # Toy prompts and hints are short: rows of 288 columns (`update.row_len`), not the
    # defaults' 2,816 (the packed batch is N sequences of that width).
    data=config.DataConfig(hint_key="hint", max_prompt_tokens=128),
    hint=config.HintConfig(source="column", max_new_tokens=128),
    # lr 1e-4: AdamW's first steps, g / (|g| + eps), amplify the float noise of gradients near
    # zero (the gradients themselves agree to ~5e-7 of each leaf's scale), so the parameters'
    # differences scale with lr; at 1e-3 they reach ~2.5e-5.
    optim=config.OptimConfig(lr=1e-4),
    train=config.TrainConfig(steps=1))
# Reference hints in the dataset column (hint.source=column), so hinted groups re-sample.
# 3-step problems: every hinted prompt (levels 1-3) fits one prompt bucket (fewer compiles).
EXAMPLES = [Example(problem=p.text, answer=p.answer, solution=p.solution,
                    hint=toy.hint_payload(toy.reference_hints(p)), index=i)
            for i, p in enumerate(toy.make_problems(PROMPTS, toy.ToySpec(3, 3), seed=3))]


def digit_scorer(responses, ground_truths):
    """1 when the answer holds a digit. A random tiny model never solves a toy problem (every
    group would collapse to 0 and the update would see zero advantages); with this, about half
    the answers score, so groups are mixed and some prompts stay unresolved and get hints."""
    return np.array([float(any(c.isdigit() for c in r)) for r in responses], np.float32), {}


def one_step(shape):
    """One training step on a (data, fsdp, tensor) mesh, wired as `loop.train` wires it."""
    t0 = time.perf_counter()
    devices = jax.devices()[:1] if shape == (1, 1, 1) else None
    mesh = parallel.make_mesh(config.MeshConfig(*shape), devices)
    loop.check_fits(CFG, mesh)
    task = toy.ToyTask()
    graphdef, state = update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(0)),
                                              settings_of(CFG), mesh)
    idx = np.arange(PROMPTS)
    tables = rollout.SageTables.empty(len(EXAMPLES), CFG.hint.cache_bytes)
    sampler = engines.StepSampler(engines.NativeEngine(
        graphdef, state.params, eos_ids=task.eos_ids, pad_id=task.pad_id, mesh=mesh),
        jax.random.fold_in(state.rng, 0))
    ro = rollout.run([EXAMPLES[i] for i in idx], idx, task=task, sampler=sampler,
                     scorer=digit_scorer, rl=CFG.rl, hint=CFG.hint, tables=tables,
                     step=0)
    # Greedy samples of the final (partly hinted) contexts, straight from the array API.
    tok, mask = sampling.left_pad(ro.prompts, sampling_plan.prompt_bucket(
        max(len(p) for p in ro.prompts)), task.pad_id)
    greedy = sampling.sample(graphdef, state.params, tok, mask, key=jax.random.PRNGKey(1),
                             num_samples=GROUP, max_new_tokens=NEW, temperature=0.0,
                             eos_ids=task.eos_ids, prompt_ids_B=idx, pad_id=task.pad_id,
                             mesh=mesh)
    batch = batching.update_batch(ro, settings_of(CFG), batching.BatchSettings.of(CFG, task.pad_id))
    before = jax.tree.map(np.asarray, state.params)  # (the step donates the state)
    state, upd = update.TrainStep(graphdef, settings_of(CFG), mesh)(state,
                                                             parallel.shard_batch(batch, mesh))
    return dict(mesh=mesh, samples=ro.samples, rewards=ro.rewards, level=ro.level,
                rollout={k: v for k, v in ro.metrics.items() if not k.startswith("time/")},
                greedy=greedy, greedy_host=jax.device_get(greedy), update=jax.device_get(upd),
                params=jax.tree.map(np.asarray, state.params), before=before,
                seconds=time.perf_counter() - t0)


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def reference():
    ref = one_step((1, 1, 1))
    # The step is not trivial: hinted groups were re-sampled, advantages are non-zero.
    assert ref["rollout"]["hint/used_level_1"] > 0, ref["rollout"]
    assert 0 < ref["rewards"].mean() < 1 and ref["update"]["grad_norm"] > 0
    assert max_diff(ref["params"], ref["before"]) > 1e-4  # the 2 updates moved the weights
    return ref


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.slow
def test_training_step_on_a_mesh_equals_one_device(shape, reference, capsys):
    got = one_step(shape)
    ref = reference
    # The sampler decodes on the mesh and hands back host arrays (every process gets them all).
    assert isinstance(got["greedy"].tokens, np.ndarray)
    # Rollout: the same tokens (sampled with per-row keys, then greedy), rewards, hint levels.
    for k in ("tokens", "lengths"):
        np.testing.assert_array_equal(getattr(got["samples"], k), getattr(ref["samples"], k))
        np.testing.assert_array_equal(getattr(got["greedy_host"], k),
                                      getattr(ref["greedy_host"], k))
    np.testing.assert_array_equal(got["rewards"], ref["rewards"])
    np.testing.assert_array_equal(got["level"], ref["level"])
    assert got["rollout"].keys() == ref["rollout"].keys()
    for k, v in ref["rollout"].items():
        np.testing.assert_equal(got["rollout"][k], v, err_msg=k)  # NaN == NaN here
    d_logp = max_diff(got["samples"].logprobs, ref["samples"].logprobs)
    d_greedy = max_diff(got["greedy_host"].logprobs, ref["greedy_host"].logprobs)
    # Update: metrics and parameters.
    # The metric closest to its tolerance (|diff| <= 1e-7 + 1e-5 |ref|), and its diff.
    worst = max(ref["update"], key=lambda k: abs(got["update"][k] - ref["update"][k])
                / (1e-7 + 1e-5 * abs(ref["update"][k])))
    d_worst = abs(got["update"][worst] - ref["update"][worst])
    d_params = max_diff(got["params"], ref["params"])
    with capsys.disabled():
        print(f"\nmesh {shape}: rollout logprob diff {d_logp:.1e}, greedy logprob diff "
              f"{d_greedy:.1e}, worst metric {worst} {ref['update'][worst]:.3g} +- {d_worst:.1e}, "
              f"max |param diff| {d_params:.1e} ({got['seconds']:.1f}s; 1 device "
              f"{ref['seconds']:.1f}s)", end="")
    assert d_logp < 1e-5 and d_greedy < 1e-5
    for k, v in ref["update"].items():
        np.testing.assert_allclose(got["update"][k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    assert d_params < 1e-5


@pytest.mark.slow
def test_sampler_logprobs_as_old_logprobs_give_the_recomputed_step():
    """rl.old_logprobs=sampler: the rollout's own log-probs, placed on the batch's answer
    columns, are the trainer's recomputed old log-probs (float rounding apart), and the step
    they give equals the recomputing one (hinted groups included)."""
    mesh = parallel.make_mesh(config.MeshConfig(1, 1, 1), jax.devices()[:1])
    task = toy.ToyTask()

    def fresh():
        return update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(0)),
                                       settings_of(CFG), mesh)

    graphdef, state = fresh()
    idx = np.arange(PROMPTS)
    sampler = engines.StepSampler(engines.NativeEngine(
        graphdef, state.params, eos_ids=task.eos_ids, pad_id=task.pad_id, mesh=mesh),
        jax.random.fold_in(state.rng, 0))
    ro = rollout.run([EXAMPLES[i] for i in idx], idx, task=task, sampler=sampler,
                     scorer=digit_scorer, rl=CFG.rl, hint=CFG.hint,
                     tables=rollout.SageTables.empty(len(EXAMPLES), CFG.hint.cache_bytes),
                     step=0)
    assert ro.level.max() > 0  # some groups were re-sampled with a hint
    given = batching.train_batch(ro, pad_id=task.pad_id, sampler_logprobs=True)
    plain = {k: v for k, v in given.items() if k != "old_logp_NxL"}
    assert plain.keys() == batching.train_batch(ro, pad_id=task.pad_id).keys()
    loss = given["loss_mask_NxL"]
    recomputed = np.asarray(grpo.token_logprobs(graphdef, state.params, given["tokens_NxL"],
                                                given["mask_NxL"], need_NxL=loss))
    np.testing.assert_allclose(given["old_logp_NxL"][loss], recomputed[loss], atol=2e-5)
    assert np.all(given["old_logp_NxL"][~loss] == 0) and np.all(recomputed[loss] < 0)
    step = update.TrainStep(graphdef, settings_of(CFG), mesh)
    got = [step(s, parallel.shard_batch(packing.as_packed(b), mesh)) for s, b in ((state, given),
                                                               (fresh()[1], plain))]
    (s_given, m_given), (s_plain, m_plain) = jax.device_get(got)
    for k, v in m_plain.items():
        np.testing.assert_allclose(m_given[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    assert max_diff(s_given.params, s_plain.params) < 1e-5
    with pytest.raises(ValueError, match="plain"):
        batching.train_batch(ro, loss_context="plain", sampler_logprobs=True)


def policy_rollout(graphdef, state, mesh, idx, max_rows, continuous=False):
    """The toy rollout of EXAMPLES[idx] on the policy, `max_rows` rows decoding at once."""
    task = toy.ToyTask()
    sampler = engines.StepSampler(engines.NativeEngine(
        graphdef, state.params, eos_ids=task.eos_ids, pad_id=task.pad_id, mesh=mesh,
        settings=engines.SamplerSettings(max_rows=max_rows, continuous=continuous)),
        jax.random.fold_in(state.rng, 0))
    return rollout.run([EXAMPLES[i] for i in idx], idx, task=task, sampler=sampler,
                       scorer=digit_scorer, rl=CFG.rl, hint=CFG.hint,
                       tables=rollout.SageTables.empty(len(EXAMPLES), CFG.hint.cache_bytes),
                       step=0)


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2)])
def test_rollout_in_chunks_samples_the_same_answers(shape, monkeypatch):
    """rollout.micro_batch_size: a rollout (hinted re-samples included) sampled a few whole
    groups at a time gives the answers and log-probs of sampling every prompt at once."""
    devices = jax.devices()[:1] if shape == (1, 1, 1) else None
    mesh = parallel.make_mesh(config.MeshConfig(*shape), devices)
    task = toy.ToyTask()
    graphdef, state = update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(0)),
                                              settings_of(CFG), mesh)
    idx = np.arange(PROMPTS)
    sizes = []  # prompts of each sampling.sample call
    sample = sampling.sample

    def counted(graphdef, params, prompt_BxP, *args, **kw):
        sizes.append(prompt_BxP.shape[0])
        return sample(graphdef, params, prompt_BxP, *args, **kw)
    monkeypatch.setattr(sampling, "sample", counted)

    def run(max_rows):
        sizes.clear()
        return policy_rollout(graphdef, state, mesh, idx, max_rows), list(sizes)

    (whole, whole_sizes), (chunked, chunk_sizes) = run(None), run(3 * GROUP)
    assert whole.level.max() > 0  # some groups were re-sampled with a hint
    assert whole_sizes[0] == PROMPTS and max(chunk_sizes) == 3  # 3 prompts a call at most
    assert chunk_sizes[:3] == [3, 3, 2] and len(chunk_sizes) > len(whole_sizes)
    np.testing.assert_array_equal(chunked.samples.tokens, whole.samples.tokens)
    np.testing.assert_array_equal(chunked.samples.lengths, whole.samples.lengths)
    np.testing.assert_allclose(chunked.samples.logprobs, whole.samples.logprobs, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2)])
def test_rollout_with_fewer_slots_than_rows_samples_the_same_answers(shape, monkeypatch):
    """rollout.micro_batch_size: a rollout (hinted re-samples included) whose calls decode at
    most 3 groups' rows at once, refilling finished rows' slots (rollout.continuous_batching), gives
    the answers and log-probs of decoding every row at once."""
    devices = jax.devices()[:1] if shape == (1, 1, 1) else None
    mesh = parallel.make_mesh(config.MeshConfig(*shape), devices)
    task = toy.ToyTask()
    graphdef, state = update.init_train_state(models.Decoder(MODEL, rngs=nnx.Rngs(0)),
                                              settings_of(CFG), mesh)
    idx = np.arange(PROMPTS)
    slots = []  # the slots of each call that batched continuously
    continuous = sampling._continuous

    def counted(graphdef, params, plan, *args, **kw):
        slots.append(plan.slots)
        return continuous(graphdef, params, plan, *args, **kw)
    monkeypatch.setattr(sampling, "_continuous", counted)

    def run(max_rows):
        slots.clear()
        return policy_rollout(graphdef, state, mesh, idx, max_rows, continuous=True), list(slots)

    (whole, whole_slots), (chunked, chunk_slots) = run(None), run(3 * GROUP)
    assert whole.level.max() > 0  # some groups were re-sampled with a hint
    assert whole_slots == [] and chunk_slots and set(chunk_slots) <= {
        -(-3 * GROUP // parallel.row_shards(mesh)) * parallel.row_shards(mesh)}
    np.testing.assert_array_equal(chunked.samples.tokens, whole.samples.tokens)
    np.testing.assert_array_equal(chunked.samples.lengths, whole.samples.lengths)
    np.testing.assert_allclose(chunked.samples.logprobs, whole.samples.logprobs, atol=1e-5)
    np.testing.assert_array_equal(chunked.level, whole.level)
    with pytest.raises(ValueError, match="rollout.micro_batch_size"):
        config.Config(rl=config.RLConfig(group_size=8),
                      rollout=config.RolloutConfig(micro_batch_size=4)).validate()
