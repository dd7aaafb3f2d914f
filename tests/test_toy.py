"""The toy task: generator, reward, hint levels, prompt formats, SFT mix; the char tokenizer."""

import pickle

import numpy as np
import pytest

from sage_jax import rewards, sage
from sage_jax.models.char_tokenizer import CharTokenizer
from sage_jax.tasks import toy


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
        for j in range(2, p.k):  # same operator as two steps back, operand one up (wrapping)
            (op, x), (op0, x0) = p.ops[j], p.ops[j - 2]
            r = toy.OPERANDS[op]
            assert op == op0 and r.index(x) == (r.index(x0) + 1) % len(r)
        for op, x in p.ops:
            tens, units = divmod(v, 10)
            f = {"+": lambda d: d + x, "-": lambda d: d - x, "*": lambda d: d * x}[op]
            v = f(tens) % 10 * 10 + f(units) % 10
            assert x in toy.OPERANDS[op]
        assert p.answer == str(v % toy.MOD).zfill(toy.WIDTH)
        assert toy.ToyProblem.parse(p.text) == p
        assert p.values()[-1] not in p.values()[:-1]  # no intermediate value is the answer
        for v in (p.start, *p.values()):  # operations permute digits: the two never merge
            assert v // 10 != v % 10
        assert p.solution.endswith(";A:" + p.answer)
        assert len(p.steps()) == p.k


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


# ---- reward ---------------------------------------------------------------------------------

def test_reward_reference_scores_one_and_wrong_final_number_zero():
    fn = rewards.get_reward("toy")
    assert fn is toy.toy_reward
    pickle.dumps(fn)
    for p in _problems(3):
        assert fn(p.solution, p.answer) == 1.0
        wrong = str((int(p.answer) + 1) % toy.MOD).zfill(toy.WIDTH)
        assert fn(p.solution[:-toy.WIDTH] + wrong, p.answer) == 0.0
        assert fn(p.solution.rsplit("A:", 1)[0], p.answer) == 0.0  # no final answer
    assert fn("a+1=02;A:7", "07") == 1.0  # the number, not its spelling
    assert fn("A:12;A:13", "12") == 0.0  # the last answer counts
    assert fn("", "12") == 0.0 and fn("A:", "12") == 0.0


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
            assert toy.toy_reward(h, p.answer) == 0.0
            assert p.answer not in [s.split("=")[1] for s in h.split(toy.STEP_SEP)]


def test_hint_payload_parses_back_with_sage_parser():
    for p in _problems(5, toy.ToySpec(2, 8)):
        ref = toy.reference_hints(p)
        assert toy.reference_hints(p.solution) == ref
        payload = toy.hint_payload(ref)
        assert sage.parse_hints(payload, ground_truth=p.answer) == ref


def test_continuation_completes_the_hint():
    for p in _problems(5, toy.ToySpec(2, 8)):
        assert toy.continuation(p, None) == p.solution
        for h in toy.reference_hints(p).values():
            assert h + toy.STEP_SEP + toy.continuation(p, h) == p.solution


# ---- prompt formats -------------------------------------------------------------------------

def test_prompt_formats():
    task = toy.ToyTask()
    tok = task.tok
    p = toy.ToyProblem(37, (("*", 3), ("+", 4)), 5)
    assert p.text == "37*3+4:e"
    assert p.solution == "a*3=91;b+4=35;c*7=15;d+5=60;e*9=40;A:40"
    assert task.answer_prompt(p.text) == [tok.bos_id] + tok.encode("Q:37*3+4:e\n")
    assert tok.decode(task.hinted_prompt(p.text, "a*3=91")) == "Q:37*3+4:e\nH:a*3=91\n"
    assert tok.decode(task.hint_request(p.text, p.solution)) == "S:" + p.solution + "\nH?a,b,d:"
    assert toy.reference_hints(p) == {1: "a*3=91", 2: "a*3=91;b+4=35",
                                      3: "a*3=91;b+4=35;c*7=15;d+5=60"}
    assert toy.continuation(p, "a*3=91;b+4=35") == "c*7=15;d+5=60;e*9=40;A:40"
    assert toy.next_operand("*", 9) == ("*", 3) and toy.next_operand("+", 9, 2) == ("+", 2)
    # policy-written hints may hold anything: kept on one line and in the vocabulary
    assert tok.decode(task.hinted_prompt(p.text, "x\ny\u00e9")) == "Q:37*3+4:e\nH:x y?\n"
    assert task.decode(tok.encode("a+5=12;A:12", eos=True) + [65, 66]) == "a+5=12;A:12"
    assert task.eos_ids == (tok.eos_id,) and task.pad_id == tok.pad_id
    assert task.reward_name in rewards.reward_names()


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
            assert ends == "H?" + ",".join(toy.LABELS[toy.hint_steps(k, lvl) - 1]
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
