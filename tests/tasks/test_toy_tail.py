"""The toy task's hard split (rare operands) and its one-level hint requests (issue 33)."""

import dataclasses

import numpy as np
import pytest

from sage_jax import config
from sage_jax.tasks.toy import chains as toy
from sage_jax.tasks.toy import warm_start
from sage_jax.tasks.toy.toy_config import ToyConfig
from sage_jax.tasks import registry

TAIL = toy.ToySpec(8, 16, rare_operands=(7,), rare_share=0.4, rare_min_steps=10)


def test_rare_operands_only_where_the_spec_puts_them():
    probs = toy.make_problems(2000, TAIL, seed=0)
    rare = [p for p in probs if p.uses((7,))]
    assert all(p.k >= 10 for p in rare)  # never below rare_min_steps
    eligible = sum(p.k >= 10 for p in probs)
    assert 0.35 < len(rare) / eligible < 0.45  # rare_share of the eligible problems
    for p in rare:  # exactly one operation of the pair is rare: half the steps use its facts
        assert sum(x == 7 for _, x in p.pair) == 1
    never = toy.make_problems(500, TAIL.without_rare(), seed=0)
    assert not any(p.uses((7,)) for p in never)
    always = toy.make_problems(200, dataclasses.replace(TAIL, rare_share=1.0, rare_min_steps=1),
                               seed=0)
    assert all(p.uses((7,)) for p in always)


def test_a_spec_without_rare_operands_draws_as_before():
    """No extra draw from the generator: the default split (and the shipped warm start's data)
    is unchanged by the hard split's options."""
    rng = np.random.default_rng([3, 8])
    lengths = toy.RL_SPEC.lengths
    expected = [toy.random_problem(rng, lengths[i % len(lengths)]) for i in range(50)]
    assert toy.make_problems(50, toy.RL_SPEC, seed=3) == expected


@pytest.mark.parametrize("bad", [dict(rare_operands=(0,)), dict(rare_share=1.5),
                                 dict(rare_operands=tuple(range(1, 9)))])
def test_spec_rejects_bad_rare_settings(bad):
    with pytest.raises(ValueError):
        toy.ToySpec(8, 16, **bad)


def test_one_level_request_is_a_copy_at_one_fixed_offset():
    task = toy.ToyTask(hint_format="level", max_steps=16)
    lengths = set()
    for p in toy.make_problems(3, toy.ToySpec(2, 16), seed=1, per_length=True):
        reqs = task.hint_requests(p.text, p.solution)
        assert set(reqs) == set(toy.reference_hints(p))  # one request per level there is
        for level, req in reqs.items():
            hint = toy.reference_hints(p)[level]
            text = task.tok.decode(req)
            shown = text[2:].split("\n")[0].rstrip(toy.PAD_CHAR)
            assert shown == hint + toy.LEVEL_END + p.solution[len(hint) + 1:]
            assert "A:" not in text.split("\n")[1]
            lengths.add(len(req))
            # the reply's i-th token (its <eos> too) is the one len(req) - 3 positions back,
            # read as: a character of the solution, or the level's end mark
            full = req + task.encode_answer(hint)
            assert all(full[len(req) + i] == full[3 + i] for i in range(len(hint)))
            assert full[3 + len(hint)] == task.tok.encode(toy.LEVEL_END)[0]
            assert full[len(req) + len(hint)] == task.tok.eos_id
            assert task.read_hints(hint, level, p.answer) == ({level: hint}, 0)
    assert len(lengths) == 1


def test_one_level_replies_refuse_the_answer_and_junk():
    task = toy.ToyTask(hint_format="level")
    p = toy.ToyProblem(7, (("+", 3), ("-", 8)), 5)
    assert task.read_hints("e=7+3=0;d=0-8=2\n", 2, p.answer) == ({2: "e=7+3=0;d=0-8=2"}, 0)
    assert task.read_hints(p.solution, 3, p.answer) == ({}, 1)  # the whole solution
    assert task.read_hints("e=7+3=0;a=0-8=2", 2, p.answer) == ({}, 1)  # the last step
    assert task.read_hints("e=7+3=0;zz", 2, p.answer) == ({}, 0)
    assert task.read_hints("", 1, p.answer) == ({}, 0)
    payload = toy.ToyTask()  # the JSON format reads every level from one reply
    assert payload.read_hints(toy.hint_payload(toy.reference_hints(p)), 0, p.answer)[0] == \
        toy.reference_hints(p)
    with pytest.raises(ValueError, match="hint_format"):
        toy.ToyTask(hint_format="json")


def test_sft_mix_writes_one_level_per_request():
    task = toy.ToyTask(hint_format="level", max_steps=12)
    pairs = toy.sft_examples(800, task=task, spec=toy.ToySpec(1, 12),
                             mix=toy.SFTMix(plain=0.2, hinted=0.2, write=0.6), seed=2)
    levels = set()
    for prompt, answer in pairs:
        text, ans = task.tok.decode(prompt), task.tok.decode(answer)
        if not text.startswith("S:"):
            continue
        solution = text[2:].split("\n")[0].rstrip(toy.PAD_CHAR).replace(toy.LEVEL_END, ";")
        got = [lvl for lvl, h in toy.reference_hints(solution).items() if h == ans]
        assert got, (text, ans)
        levels.update(got)
    assert levels == {1, 2, 3}


def test_tail_config_sets_the_hard_split_and_its_own_warm_start():
    cfg = registry.load_config("sage_jax/configs/toy_tail.yaml")
    spec = warm_start.spec(cfg)
    assert spec.rare_operands == (7,) and spec.rare_share > 0
    assert warm_start.sft_spec(cfg).rare_share == cfg.task.section(ToyConfig).sft_rare_share
    assert warm_start.make_task(cfg).hint_format == "level"
    default = registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml", [])
    assert warm_start.cache_path(cfg) != warm_start.cache_path(default)
    with pytest.raises(config.ConfigError, match="rare_operands"):
        registry.load_config(config.DEFAULT_CONFIG, ["task.toy.rare_operands=[0]"])
