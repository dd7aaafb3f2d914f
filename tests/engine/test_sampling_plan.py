"""The sampling plan is the call's plan: every program `sampling.sample` runs is one that
`SamplingPlan.programs` lists (what `analysis.compile_check` compiles and `analysis.memory`
sizes)."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax import models
from sage_jax.analysis import compile_check
from sage_jax.config import MeshConfig
from sage_jax.engine.sampler import programs, sampling, sampling_plan
from sage_jax.engine.sampler.sampling_plan import Knobs, SamplingPlan
from sage_jax.infra import parallel


def _knobs(g=3, t=40, eos=(3, 7)):
    return Knobs(num_samples=g, max_new_tokens=t, temperature=1.0, top_p=1.0, top_k=0,
                 eos_ids=eos, pad_id=0)


def test_a_plan_of_known_sizes():
    """5 prompts of 20 tokens, 3 answers of up to 40 tokens, a toy-sized model: 8 prompt rows,
    24 columns (coarse buckets: 32), cache slots 32 then 40; continuous with 6 slots."""
    plan = SamplingPlan.of(_knobs(), 5, 20, num_params=1000)
    assert (plan.batch, plan.prompt_cols, plan.first_rows) == (8, 32, 24)
    assert not plan.continuous and plan.prefill_prompts == 8
    assert plan.schedule == {32: 32, 40: 7} and plan.first_cache == 32
    assert plan.grow == (32, 40) and plan.drop_rows is None  # 24 rows: no coarse bucket below
    assert [(d.rows, d.rows_per_group, d.slots) for d in plan.decode_shapes()] == [
        (24, 3, 32), (24, 3, 40)]
    fine = SamplingPlan.of(_knobs(), 5, 20, num_params=10 ** 8, shards=2)
    assert fine.prompt_cols == 24 and fine.smaller_rows == [8, 12, 16] and fine.drop_rows == 16
    assert fine.rows_for(13) == 16 and fine.stop_at(24) == 16
    cont = SamplingPlan.of(_knobs(), 7, 20, num_params=1000, max_rows=5, shards=2)
    assert cont.continuous and cont.slots == cont.first_rows == 6
    assert cont.prefill_prompts == 2 and cont.admit_at == 3
    assert {d.rows_per_group for d in cont.decode_shapes()} == {1}
    assert not SamplingPlan.of(_knobs(), 2, 20, num_params=1000, max_rows=6).continuous


def _tiny():
    cfg = models.DecoderConfig(family="qwen2", vocab_size=16, hidden_size=32,
                               intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=8, qkv_bias=True)
    return models.Decoder(cfg, rngs=nnx.Rngs(3))


class _Spy:
    """A sampler program that notes each signature it is called or traced with: (kind, static
    argument, the shapes and dtypes of its arguments but the weights)."""

    def __init__(self, kind, extra, fn, seen):
        self.kind, self.extra, self.fn, self.seen = kind, extra, fn, seen

    def _note(self, args):
        if self.kind in programs.TAKE_PARAMS:
            args = args[1:]
        leaves = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args))
        self.seen.add((self.kind, self.extra, leaves))

    def __call__(self, *args):
        self._note(args)
        return self.fn(*args)

    def trace(self, *args):
        self._note(args)
        return self.fn.trace(*args)


def _spying(monkeypatch, seen, real):
    """`programs.get` (`real`) noting in `seen` what its programs run."""

    def get(kind, graphdef=None, knobs=None, lay=None, extra=None):
        return _Spy(kind, extra, real(kind, graphdef, knobs, lay, extra), seen)

    monkeypatch.setattr(programs, "get", get)


@pytest.mark.slow
@pytest.mark.parametrize("max_rows", [None, 16], ids=["lockstep", "continuous"])
def test_what_calls_run_is_within_what_compile_check_compiles(monkeypatch, max_rows):
    """Real calls (rows ending at random steps: the cache grows, rows regroup, continuous
    batching admits prompts as slots free) run only programs, static arguments and argument
    shapes that `compile_check` compiles for the call's plan (`SamplingPlan.programs(every=True)`),
    `empty` and `admit` included; and the executor refuses a program its plan does not list."""
    monkeypatch.setattr(sampling_plan, "FINE_BUCKETS_MIN_PARAMS", 0)  # the 1.5x buckets too
    mesh = parallel.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    model = _tiny()
    graphdef, params = nnx.split(model)
    ran, compiled, real = set(), set(), programs.get
    _spying(monkeypatch, ran, real)
    rng = np.random.default_rng(0)
    n = 8 if max_rows is None else 12
    for seed in range(3):
        prompts = [rng.integers(4, 16, k).tolist() for k in rng.integers(2, 12, n)]
        prompts[0] = prompts[0][:1] + [5] * 10  # 11 tokens: the same prompt bucket each call
        sampling.generate(model, prompts, max_new_tokens=80, num_samples=2, eos_token_id=3,
                          key=jax.random.PRNGKey(seed), mesh=mesh, max_rows=max_rows)
    plan = SamplingPlan.of(_knobs(g=2, t=80, eos=(3,)), n, 11, num_params=1, max_rows=max_rows)
    kinds = {k for k, _, _ in ran}
    assert kinds >= ({"prefill", "empty", "admit", "segment"} if max_rows else
                     {"prefill", "start", "segment", "regroup", "rows"}), kinds
    _spying(monkeypatch, compiled, real)
    progs = compile_check.plan_programs("rollout", plan, graphdef, params, model.cfg, mesh,
                                        every=True)
    assert len(progs) == len(plan.programs(every=True)) and all(q.error is None for q in progs)
    assert ran <= compiled, sorted(ran - compiled)
    assert len(compiled) > len(ran)  # `every` lists programs these calls did not need
    default = {q.name.split("/")[1].split("@")[0] for q in compile_check.plan_programs(
        "rollout", plan, graphdef, params, model.cfg, mesh)}
    assert default >= {"prefill", "decode", "grow", "drop", "rows"} | (
        {"empty", "admit"} if max_rows else {"start"}), default
    with pytest.raises(RuntimeError, match="not among the programs"):
        sampling._program(plan, sampling_plan.ProgramSpec.prefill(plan.batch * 2))


def test_the_library_docs_show_what_the_plan_says():
    """docs/library.md's plan example prints what this plan gives (the comments are its output)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "library.md").read_text()
    knobs = Knobs(num_samples=8, max_new_tokens=384, temperature=1.0, top_p=1.0, top_k=0,
                  eos_ids=(2,), pad_id=0)
    plan = SamplingPlan.of(knobs, prompts=32, prompt_len=120, num_params=135_000_000,
                           max_rows=64)
    assert "SamplingPlan.of(knobs, prompts=32, prompt_len=120, num_params=135_000_000, " \
           "max_rows=64)" in doc
    assert f"# {plan.continuous}, {plan.prompt_cols}, {plan.schedule}" in doc
    shapes = [(d.rows, d.rows_per_group, d.slots) for d in plan.decode_shapes()]
    assert f"# {shapes}" in doc
    assert f"# {[q.label for q in plan.programs()]}" in doc
    assert f"len(plan.programs(every=True))   # {len(plan.programs(every=True))}" in doc
