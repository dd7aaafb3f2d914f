"""The sampling plan is the call's plan: every program `sampling.sample` runs has a shape that
`SamplingPlan` lists (what `analysis.compile_check` compiles and `analysis.memory` sizes)."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax import models
from sage_jax.engine import programs, sampling
from sage_jax.engine.sampling_plan import Knobs, SamplingPlan


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


@pytest.mark.slow
@pytest.mark.parametrize("max_rows", [None, 6])
def test_every_program_a_call_runs_is_in_its_plan(monkeypatch, max_rows):
    """A call's prefills, decode segments (rows, rows per group, cache slots) and first cache
    are among its plan's; the regrouped rows are the plan's row buckets."""
    seen = []
    real = programs.get

    def spy(kind, *args):
        fn = real(kind, *args)

        def call(*a):
            if kind == "segment":
                st = a[1]
                seen.append(("segment", st.rows, st.group, st.slots))
            elif kind == "prefill":
                seen.append(("prefill",) + tuple(a[1].shape))
            return fn(*a)
        return call

    monkeypatch.setattr(programs, "get", spy)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 16, n).tolist() for n in (4, 9, 6, 2, 11, 5, 3)]
    model = _tiny()
    sampling.generate(model, prompts, max_new_tokens=40, num_samples=3, eos_token_id=(3, 7),
                      key=jax.random.PRNGKey(5), max_rows=max_rows)
    plan = SamplingPlan.of(_knobs(), len(prompts), 11, num_params=model.cfg.num_params(),
                           max_rows=max_rows)
    shapes = {(d.rows, d.rows_per_group, d.slots) for d in plan.decode_shapes(all_buckets=True)}
    segments = [s[1:] for s in seen if s[0] == "segment"]
    assert segments and set(segments) <= shapes, (segments, shapes)
    prefills = {s[1:] for s in seen if s[0] == "prefill"}
    if max_rows is None:
        assert prefills == {(plan.batch, plan.prompt_cols)}
    else:
        assert (plan.prefill_prompts, plan.prompt_cols) in prefills
        assert {p for p, _ in prefills} <= {1, 2}  # admissions of up to 6 // 3 prompts


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
