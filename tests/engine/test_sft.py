"""SFT trainer: batches and masks, loss goes down, early stop; toy teacher-forced metrics."""

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax import models
from sage_jax.engine.trainer import sft_step as sft
from sage_jax.models.decoder import Decoder
from sage_jax.rl import engines
from sage_jax.rl.types import Samples
from sage_jax.tasks.toy import chains as toy
from sage_jax.tasks.toy import calibrate as toy_calibrate


def _tiny(seed=0):
    return Decoder(toy.toy_model_config(hidden_size=32, intermediate_size=64, num_layers=1,
                                        num_heads=2, num_kv_heads=1, head_dim=16),
                   rngs=nnx.Rngs(seed))


def test_make_batch_masks_answer_tokens_only():
    tokens, mask = sft.make_batch([([1, 5, 6], [7, 2]), ([1, 9], [3, 4, 2])], pad_id=0, bucket=8)
    assert tokens.shape == (2, 8) and mask.shape == (2, 7)
    assert tokens[0].tolist() == [1, 5, 6, 7, 2, 0, 0, 0]
    # mask[t] scores the prediction of tokens[t + 1]
    assert np.nonzero(mask[0])[0].tolist() == [2, 3]
    assert tokens[0, 3:5].tolist() == [7, 2]
    assert np.nonzero(mask[1])[0].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="empty answer"):
        sft.make_batch([([1], [])], pad_id=0)
    with pytest.raises(ValueError, match="max_len"):
        sft.make_batch([([1] * 10, [2])], pad_id=0, bucket=4, max_len=8)


@pytest.mark.slow
def test_sft_loss_ignores_prompt_and_padding():
    model = _tiny()
    g, p = nnx.split(model)
    tokens, mask = sft.make_batch([([1, 5, 6], [7, 2])], pad_id=0, bucket=8)
    a = float(sft.sft_loss(g, p, tokens, mask))
    b = float(sft.sft_loss(g, p, np.where(np.arange(8) >= 5, 33, tokens), mask))  # padding
    assert a == pytest.approx(b, rel=1e-6)
    lp = np.asarray(sft.next_token_logprobs(g, p, tokens))
    assert a == pytest.approx(-lp[0, [2, 3]].mean(), rel=1e-5)


@pytest.mark.slow
def test_the_loss_in_column_chunks_equals_the_whole_one():
    """`logprob_chunk`: the logits made a few columns at a time (the update's
    `grpo.logprobs_from_hidden`) give the same log-probs, loss and gradient."""
    g, p = nnx.split(_tiny())
    tokens, mask = sft.make_batch([([1, 5, 6], [7, 2]), ([1, 9], [3, 4, 8, 2])], pad_id=0,
                                  bucket=12)
    whole = np.asarray(sft.next_token_logprobs(g, p, tokens))
    grad = jax.grad(lambda q: sft.sft_loss(g, q, tokens, mask))(p)
    for chunk in (5, 32):  # chunks that split the row, and one wider than it
        np.testing.assert_allclose(sft.next_token_logprobs(g, p, tokens, chunk=chunk), whole,
                                   rtol=1e-5, atol=1e-6)
        chunked = jax.grad(lambda q: sft.sft_loss(g, q, tokens, mask, chunk=chunk))(p)
        for x, y in zip(jax.tree.leaves(chunked), jax.tree.leaves(grad)):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_train_sft_reduces_loss_and_stops_early():
    task = toy.ToyTask()
    pairs = toy.sft_examples(64, task=task, spec=toy.ToySpec(1, 2), seed=0)
    model = _tiny()
    before = nnx.state(model)
    before = jax.tree.map(np.asarray, before)
    model, res = sft.train_sft(model, pairs, steps=30, batch_size=16, lr=1e-2, seed=0,
                               warmup=5, log_every=0, bucket=64, sort_pool=2)
    assert res.steps == 30 and len(res.losses) == 30 and not res.stopped_early
    assert np.mean(res.losses[-5:]) < 0.7 * np.mean(res.losses[:3])
    after = jax.tree.map(np.asarray, nnx.state(model))
    assert any(not np.allclose(x, y) for x, y in zip(jax.tree.leaves(before),
                                                   jax.tree.leaves(after)))
    calls = []
    model, res = sft.train_sft(_tiny(), lambda rng, n: toy.sft_draw(rng, n, task=task),
                               steps=20, batch_size=8, lr=1e-2, log_every=0, eval_every=4,
                               eval_fn=lambda m: calls.append(1) or {"x": len(calls)},
                               stop_fn=lambda met: met["x"] >= 2)
    assert res.stopped_early and res.steps == 8 and [s for s, _ in res.evals] == [4, 8]


def test_teacher_forced_probabilities_are_consistent():
    model = _tiny()
    probs = toy.make_problems(3, toy.ToySpec(2, 4), seed=1, per_length=True)
    tf = toy_calibrate.teacher_forced(model, probs)
    assert len(tf["pass_prob"]) == len(probs)
    for lq, steps, p in zip(tf["pass_logprob"], tf["step_logprob"], probs):
        assert len(steps) == p.k and lq < 0
        assert lq == pytest.approx(steps.sum(), rel=1e-4)
    hinted = toy_calibrate.teacher_forced(model, probs, level=3)
    assert [len(s) for s in hinted["step_logprob"]] == [1] * len(probs)  # only the last step left
    summary = toy_calibrate.step_accuracy(model, probs)
    assert 0 <= summary["step_acc"] < 1 and summary["all_zero_g8"] > 0.9


@pytest.mark.slow
def test_calibrate_reports_every_number_and_the_gate():
    model = _tiny()
    task = toy.ToyTask()
    engine = engines.NativeEngine(*models.split(model), eos_ids=task.eos_ids, pad_id=task.pad_id)
    cal = toy_calibrate.calibrate(engine, task=task, spec=toy.ToySpec(2, 3),
                                  problems_per_length=2, group_size=2, levels=(1, 3))
    assert cal["lengths"] == [2, 3] and cal["problems"] == 4
    assert set(cal["pass_by_level"]) == {0, 1, 3}
    assert set(cal["all_zero_by_k"]) == {2, 3} and 0 <= cal["all_zero"] <= 1
    assert set(cal["hint_write_acc"]) == {1, 3}
    assert set(cal["gate"]) == {"all_zero", "l3_above_no_hint", "self_hints", "passed"}
    text = toy_calibrate.format_calibration(cal)
    assert "all-zero" in text and "hint writing" in text


class ScriptedToyPolicy:
    """A `RolloutEngine` double on the toy formats: bare prompts get a wrong answer, level-3 hinted
    prompts the right continuation (so groups collapse and hints help), and hint requests the
    reference payload (`copies`) or one with every digit off by one."""

    def __init__(self, copies: bool, hint_format: str = "payload"):
        self.copies, self.task = copies, toy.ToyTask(hint_format=hint_format)

    def answer(self, text: str) -> str:
        if text.startswith(toy.SOLUTION_TAG):
            solution, ends = text[2:].split("\n")
            solution = solution.rstrip(toy.PAD_CHAR).replace(toy.LEVEL_END, toy.STEP_SEP)
            hints = toy.reference_hints(solution)
            if not self.copies:
                hints = {lvl: "".join(str((int(c) + 1) % 10) if c.isdigit() else c for c in h)
                         for lvl, h in hints.items()}
            if "," not in ends:  # one level: the hint that ends at the named step
                return next(h for h in hints.values() if h.split(";")[-1][0] == ends[2])
            return toy.hint_payload(hints)
        problem, _, rest = text[2:].partition("\n")
        hint = rest[2:].strip() if rest.startswith(toy.HINT_TAG) else ""
        p = toy.ToyProblem.parse(problem)
        if hint and hint == toy.reference_hints(p).get(3):
            return toy.continuation(p, hint)
        return "a=0+0=0;A:0"

    def sample(self, prompts, *, max_new_tokens, num_samples, **kw):
        del kw
        rows = [self.task.encode_answer(self.answer(self.task.tok.decode(p)))[:max_new_tokens]
                for p in prompts for _ in range(num_samples)]
        tokens = np.zeros((len(rows), max_new_tokens), np.int32)
        for r, ids in enumerate(rows):
            tokens[r, :len(ids)] = ids
        lengths = np.asarray([len(x) for x in rows])
        return Samples(tokens.reshape(len(prompts), num_samples, -1),
                       lengths.reshape(len(prompts), num_samples), np.zeros(tokens.shape))


@pytest.mark.parametrize("hint_format", ["payload", "level"])
@pytest.mark.parametrize("copies", [True, False])
def test_gate_fails_when_the_policy_cannot_write_its_hints(copies, hint_format):
    policy = ScriptedToyPolicy(copies, hint_format)
    kw = dict(spec=toy.ToySpec(4, 6), problems_per_length=3, group_size=2, task=policy.task)
    cal = toy_calibrate.calibrate(policy, method="sage", hint_source="online", **kw)
    assert cal["hint_leaked"] == 0 and (cal["hint_parse_rate"] == 1.0 or not copies)
    assert cal["gate"]["all_zero"] and cal["gate"]["l3_above_no_hint"]
    assert cal["hint_write_acc"] == ({1: 1.0, 2: 1.0, 3: 1.0} if copies
                                     else {1: 0.0, 2: 0.0, 3: 0.0})
    assert cal["gate"]["self_hints"] is copies and cal["gate"]["passed"] is copies
    notes = "\n".join(cal["gate_notes"])
    assert ("degenerates to GRPO" in notes) is not copies
    # auto picks the policy's own hints only when they are right; GRPO has nothing to check
    auto = toy_calibrate.calibrate(policy, method="sage", hint_source="auto", **kw)
    assert auto["hint_source"] == ("online" if copies else "reference")
    assert auto["gate"]["passed"]  # reference hints need no writing skill
    grpo = toy_calibrate.calibrate(policy, method="grpo", hint_source="online", **kw)
    assert grpo["gate"]["self_hints"] and grpo["gate"]["passed"]
