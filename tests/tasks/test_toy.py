"""The toy task: generator, reward, hint levels, prompt formats, SFT mix; the char tokenizer."""

import pickle

import numpy as np
import pytest

from sage_jax.core import sage
from sage_jax.models.char_tokenizer import CharTokenizer
from sage_jax.tasks.base import PayloadHints
from sage_jax.tasks.toy import chains as toy


def _problems(n=20, spec=toy.ToySpec(1, toy.MAX_STEPS), seed=0):
    return toy.make_problems(n, spec, seed=seed, per_length=True)


# ---- tokenizer ------------------------------------------------------------------------------

def test_char_tokenizer_round_trips():
    tok = CharTokenizer()
    text = "Q:07+a5*b3-c4\nH:a+5=12\n{\"1\":\"x\"} ~!\t"
    ids = tok.encode(text)
    assert len(ids) == len(text) and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    full = tok.encode(text, bos=True, eos=True)
    assert full[0] == tok.bos_id and full[-1] == tok.eos_id and tok.eos_id in tok.eos_ids
    assert tok.decode(full) == text
    assert tok.decode(full, skip_special_tokens=False) == "<bos>" + text + "<eos>"
    assert tok.decode_until_eos(tok.encode("ab", eos=True) + tok.encode("cd")) == "ab"
    every = "".join(chr(c) for c in (9, 10, *range(32, 127)))
    assert tok.decode(tok.encode(every)) == every
    assert tok.pad_id not in tok.encode(every)


def test_char_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match="position 1"):
        CharTokenizer().encode("a\u00e9")


# ---- generator ------------------------------------------------------------------------------

def test_generator_is_exact_and_deterministic():
    probs = _problems()
    assert probs == _problems()
    assert {p.k for p in probs} == set(range(1, toy.MAX_STEPS + 1))
    for p in probs:
        v = p.start
        assert len(p.ops) == p.k and p.ops[:2] == p.pair[:p.k]
        facts = set()
        for j, (op, x) in enumerate(p.ops):
            assert (op, x) == p.pair[j % 2] and op in "+-" and 1 <= x <= 9
            facts.add((v, op, x))
            v = (v + x if op == "+" else v - x) % 10
            assert p.values()[j] == v
        assert len(facts) == p.k  # no fact is used twice within a problem
        assert p.answer == str(v) and toy.ToyProblem.parse(p.text) == p
        steps = p.steps()
        assert len(steps) == p.k and p.solution == ";".join(steps) + ";A:" + p.answer
        starts = [p.start, *p.values()[:-1]]
        # labelled by the steps left (the last step is 'a'), from, operation, result
        for j, (step, (op, x)) in enumerate(zip(steps, p.ops)):
            assert step == f"{toy.LABELS[p.k - 1 - j]}={starts[j]}{op}{x}={p.values()[j]}"
    # the two operations move the value by an amount coprime to 10: 20 steps, 20 facts
    for p in _problems(3, toy.ToySpec(20, 20)):
        assert len(set(zip(p.ops, [p.start, *p.values()[:-1]]))) == 20


def test_examples_carry_problem_answer_solution():
    exs = toy.make_examples(6, toy.RL_SPEC, seed=3)
    assert [e.index for e in exs] == list(range(6))
    for e in exs:
        p = toy.ToyProblem.parse(e.problem)
        assert e.answer == p.answer and e.solution == p.solution
        assert toy.RL_SPEC.min_steps <= p.k <= toy.RL_SPEC.max_steps


def test_spec_validates():
    with pytest.raises(ValueError):
        toy.ToySpec(0, 3)
    with pytest.raises(ValueError):
        toy.random_problem(np.random.default_rng(0), toy.MAX_STEPS + 1)
    with pytest.raises(ValueError, match="not a toy problem"):
        toy.ToyProblem.parse("37*3+4:e")
    with pytest.raises(ValueError, match="not a toy problem"):
        toy.ToyProblem.parse("7*3-8:e")


# ---- reward ---------------------------------------------------------------------------------

def test_reward_reference_scores_one_and_wrong_final_number_zero():
    task = toy.ToyTask()
    fn = task.reward_fn
    assert fn is toy.toy_reward
    assert pickle.loads(pickle.dumps(fn)) is fn  # the reward workers get it by name
    for p in _problems(3):
        gt = task.reference(p.text, p.answer)
        assert gt == p.solution
        assert fn(p.solution, gt) == 1.0
        wrong = str((int(p.answer) + 1) % 10)
        assert fn(p.solution[:-1] + wrong, gt) == 0.0
        assert fn(p.solution.rsplit("A:", 1)[0], gt) == 0.0  # no final answer
    assert fn("", "a=7+3=0;A:0") == 0.0 and fn("A:", "a=7+3=0;A:0") == 0.0


def test_reward_checks_every_step_not_only_the_answer():
    task = toy.ToyTask()
    p = toy.ToyProblem(7, (("+", 3), ("-", 8)), 5)
    gt = task.reference(p.text, p.answer)
    assert toy.toy_reward(p.solution, gt) == 1.0
    # a wrong step that happens to end on the right answer scores 0 (no guessing)
    bad = p.solution.replace("d=0-8=2;c=2", "d=0-8=3;c=3")
    assert bad != p.solution and bad.endswith("A:" + p.answer)
    assert toy.toy_reward(bad, gt) == 0.0
    assert toy.toy_reward("A:" + p.answer, gt) == 0.0  # skipping the work
    assert toy.toy_reward(p.steps()[-1] + ";A:" + p.answer, gt) == 0.0
    # after a hint, the reference is the rest of the solution
    hint = toy.reference_hints(p)[2]
    gt_h = task.reference(p.text, p.answer, hint)
    assert gt_h == toy.continuation(p, hint) == "c=2+3=5;b=5-8=7;a=7+3=0;A:0"
    assert toy.toy_reward(gt_h, gt_h) == 1.0 and toy.toy_reward(p.solution, gt_h) == 0.0
    assert toy.toy_reward(" " + gt_h + " ", gt_h) == 1.0
    # a bare number as ground truth compares the final answer only
    assert toy.toy_reward("a=1+1=2;A:7", "7") == 1.0 and toy.toy_reward("A:12;A:13", "12") == 0.0


def test_reference_is_the_continuation_and_extract_answer_the_last_value():
    p = toy.ToyProblem(7, (("+", 3), ("-", 8)), 5)
    task = toy.ToyTask()
    assert task.reference(p.text, p.answer) == p.solution
    assert task.reference(p.text, p.answer, "e=7+3=0") == toy.continuation(p, "e=7+3=0")
    assert task.extract_answer("e=7+3=0;A:3 then A:4") == "4"
    assert task.extract_answer("no answer") is None


# ---- hints ----------------------------------------------------------------------------------

def test_hint_levels_are_prefixes_and_never_contain_the_answer():
    for p in _problems(30):
        hints = toy.reference_hints(p)
        steps = p.steps()
        if p.k == 1:
            assert hints == {}
            continue
        assert set(hints) == {1, 2, 3}
        n = {lvl: len(h.split(toy.STEP_SEP)) for lvl, h in hints.items()}
        assert n == {1: 1, 2: max(1, p.k // 2), 3: p.k - 1}
        assert n[1] <= n[2] <= n[3] < p.k
        for lvl, h in hints.items():
            assert h.split(toy.STEP_SEP) == steps[:n[lvl]]
            assert p.solution.startswith(h + toy.STEP_SEP)
            # never the final answer: no answer line and never the step that computes it
            assert "A:" not in h and steps[-1] not in h.split(toy.STEP_SEP)
            assert toy.toy_reward(h, p.solution) == 0.0
            assert toy.toy_reward(h, toy.continuation(p, h)) == 0.0


def test_hint_payload_parses_back_with_sage_parser():
    for p in _problems(5, toy.ToySpec(2, 8)):
        ref = toy.reference_hints(p)
        assert toy.reference_hints(p.solution) == ref
        payload = toy.hint_payload(ref)
        assert PayloadHints.read_hints(payload, 0, p.answer) == (ref, 0)


def test_continuation_completes_the_hint():
    for p in _problems(5, toy.ToySpec(2, 8)):
        assert toy.continuation(p, None) == p.solution
        for h in toy.reference_hints(p).values():
            assert h + toy.STEP_SEP + toy.continuation(p, h) == p.solution


# ---- prompt formats -------------------------------------------------------------------------

def test_prompt_formats():
    task = toy.ToyTask()
    tok = task.tok
    p = toy.ToyProblem(7, (("+", 3), ("-", 8)), 5)
    assert p.text == "7+3-8:e"
    assert p.solution == "e=7+3=0;d=0-8=2;c=2+3=5;b=5-8=7;a=7+3=0;A:0"
    assert task.answer_prompt(p.text) == [tok.bos_id] + tok.encode("Q:7+3-8:e\n")
    assert tok.decode(task.hinted_prompt(p.text, "e=7+3=0")) == "Q:7+3-8:e\nH:e=7+3=0\n"
    assert tok.decode(task.hint_request(p.text, p.solution)) == "S:" + p.solution + "\nH?e,d,b:"
    assert toy.reference_hints(p) == {1: "e=7+3=0", 2: "e=7+3=0;d=0-8=2",
                                      3: "e=7+3=0;d=0-8=2;c=2+3=5;b=5-8=7"}
    assert toy.continuation(p, "e=7+3=0;d=0-8=2") == "c=2+3=5;b=5-8=7;a=7+3=0;A:0"
    # policy-written hints may hold anything: kept on one line and in the vocabulary
    assert tok.decode(task.hinted_prompt(p.text, "x\ny\u00e9")) == "Q:7+3-8:e\nH:x y?\n"
    assert task.decode(tok.encode("a=7+3=0;A:0", eos=True) + [65, 66]) == "a=7+3=0;A:0"
    assert task.eos_ids == (tok.eos_id,) and task.pad_id == tok.pad_id
    assert task.name == "toy" and task.system_prompt is None


def test_sft_mix_covers_every_length_kind_and_level():
    task = toy.ToyTask()
    pairs = toy.sft_examples(3000, task=task, seed=1)
    kinds, lengths = set(), set()
    for prompt, answer in pairs:
        assert prompt[0] == task.tok.bos_id and answer[-1] == task.tok.eos_id
        text, ans = task.tok.decode(prompt), task.tok.decode(answer)
        if text.startswith("S:"):  # hint request: the reference solution only
            solution, ends = text[2:].split("\n")
            k = solution.count(";")
            kinds.add(("write", k))
            assert ends == "H?" + ",".join(toy.LABELS[k - toy.hint_steps(k, lvl)]
                                           for lvl in (1, 2, 3)) + ":"
            assert sage.parse_hints(ans) == toy.reference_hints(solution)
            continue
        p = toy.ToyProblem.parse(text.split("\n")[0][2:])
        lengths.add(p.k)
        if "\nH:" in text:
            hint = text.split("\nH:")[1].rstrip("\n")
            level = [lvl for lvl, h in toy.reference_hints(p).items() if h == hint]
            assert level and hint + ";" + ans == p.solution
            kinds.update(("hinted", lvl, p.k) for lvl in level)
        else:
            assert ans == p.solution
            kinds.add(("plain", p.k))
    assert lengths == set(toy.SFT_SPEC.lengths)
    for k in toy.SFT_SPEC.lengths:
        assert ("plain", k) in kinds
        if k >= 2:
            assert ("write", k) in kinds
            assert all(("hinted", lvl, k) in kinds for lvl in (1, 2, 3))


def test_toy_model_config_is_toy_sized():
    cfg = toy.toy_model_config()
    assert cfg.vocab_size == CharTokenizer.vocab_size
    assert 0.5e6 < cfg.num_params() < 1.2e6
    assert cfg.eos_ids == CharTokenizer.eos_ids


def test_reference_source_levels_are_the_tasks_rule_and_never_the_answer():
    task = toy.ToyTask()
    for p in toy.make_problems(40, toy.ToySpec(1, 16), seed=3):
        got = task.reference_hints(p.text, p.solution, p.answer)
        assert got == toy.reference_hints(p)
        for hint in got.values():
            assert toy.ANSWER_TAG not in hint and p.solution.startswith(hint)
            assert len(hint.split(toy.STEP_SEP)) < p.k  # never the last step


def test_math_reference_hints_are_solution_prefixes_without_the_final_answer():
    import json
    from pathlib import Path

    from sage_jax.tasks import math as math_task
    path = Path(__file__).resolve().parents[3] / "shared/data/eval/math500/test.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()[:200]]
    levels_seen = set()
    for r in rows:
        hints = math_task.MathTask.reference_hints(r["problem"], r["solution"], r["answer"])
        levels_seen |= set(hints)
        steps = math_task.solution_steps(r["solution"])
        prev = ""
        for lvl in sorted(hints):
            h = hints[lvl]
            assert h.split("\n") == steps[:len(h.split("\n"))]  # a prefix of the steps
            assert len(h) > len(prev) and h.startswith(prev)  # each level stronger
            assert "\\boxed" not in h
            prev = h
    assert levels_seen == {1, 2, 3}
    gsm = ("She sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 "
           "clips in April and May.\n#### 72")
    assert math_task.prefix_hints(gsm, "72") == {1: "She sold 48/2 = <<48/2=24>>24 clips in May."}
    assert math_task.prefix_hints("The answer is $\\boxed{5}$.", "5") == {}
