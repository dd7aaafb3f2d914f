"""SAGE's rollout semantics (`rl.rollout`) with a scripted policy double, and the update
batch it becomes (`rl.batching`)."""

import json

import numpy as np
import pytest

from sage_jax.rl import batching, rollout
from sage_jax.config import Config, DataConfig, HintConfig, RLConfig
from sage_jax.engine.sampler import sampling_plan
from sage_jax.engine.trainer import packing, update
from sage_jax.tasks.base import PayloadHints
from sage_jax.tasks.data import Example

G = 4


class CharTask(PayloadHints):
    """Prompts are characters; 'Q:<problem>' asks, '|H:<hint>' adds a hint, 'R:' requests one."""

    name = "chars"
    eos_ids = (0,)
    pad_id = 0
    system_prompt = None

    @staticmethod
    def reference(problem, answer, hint=None):
        return answer

    def answer_prompt(self, problem):
        return [ord(c) for c in "Q:" + problem]

    def hinted_prompt(self, problem, hint):
        return [ord(c) for c in "Q:" + problem + "|H:" + hint]

    def hint_request(self, problem, solution):
        return [ord(c) for c in "R:" + problem]

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids if int(i))

    def reference_hints(self, problem, solution, answer):
        """Levels 1..3: the first 1, 2, 3 ';'-steps of the solution (the last is the answer)."""
        steps = solution.split(";")[:-1]
        return {lvl: ";".join(steps[:lvl]) for lvl in (1, 2, 3) if lvl <= len(steps)}


class ScriptedPolicy:
    """Answers right only when the prompt's hint level is >= the problem's 'need' level.

    Problems are named 'p<id>n<need>'; hints written for them are 'L<level>'. Records calls.
    """

    def __init__(self, bad_payload_for=()):
        self.calls = []
        self.bad = set(bad_payload_for)

    def __call__(self, prompts, *, prompt_ids, salt, num_samples, max_new_tokens, temperature,
                 top_p, top_k):
        texts = ["".join(chr(t) for t in p) for p in prompts]
        self.calls.append((salt, list(prompt_ids), texts))
        outs = []
        for text in texts:
            if text.startswith("R:"):
                name = text[2:]
                payload = ("not json at all" if name in self.bad else
                           json.dumps({"level1": "L1", "level2": "L2", "level3": "L3"}))
                outs.append([payload] * num_samples)
                continue
            problem, _, hint = text[2:].partition("|H:")
            need = int(problem.split("n")[1])
            have = int(hint.split(";")[-1][1:]) if hint else 0  # 'L1;L2' is a level-2 hint
            ans = "RIGHT" if have >= need else "WRONG"
            outs.append([f"{ans}@{have}"] * num_samples)
        t = max_new_tokens
        tokens = np.zeros((len(prompts), num_samples, t), np.int32)
        lengths = np.zeros((len(prompts), num_samples), np.int32)
        for b, row in enumerate(outs):
            for g, s in enumerate(row):
                ids = [ord(c) for c in s][:t]
                tokens[b, g, :len(ids)] = ids
                lengths[b, g] = len(ids)
        return rollout.Samples(tokens, lengths, np.zeros(tokens.shape, np.float32))


def scorer(responses, gts):
    return np.array([1.0 if r.startswith("RIGHT") else 0.0 for r in responses]), {}


def make_examples(needs, with_solution=True):
    return [Example(problem=f"p{i}n{n}", answer="RIGHT", solution="sol" if with_solution else None,
                    hint=None, index=i) for i, n in enumerate(needs)]


def run(method, examples, ids=None, tables=None, step=0, policy=None, **kw):
    policy = policy or ScriptedPolicy()
    tables = tables or rollout.SageTables.empty(len(examples), hint_width=64)
    rl = RLConfig(method=method, group_size=G, max_new_tokens=16)
    hint = HintConfig(**{k.removeprefix("hint_"): v for k, v in kw.items()})
    ids = np.arange(len(examples)) if ids is None else ids
    out = rollout.run([examples[i] for i in ids], np.asarray(ids), task=CharTask(),
                      sampler=policy, scorer=scorer, rl=rl, hint=hint, tables=tables, step=step)
    return out, policy, tables


def test_sage_escalates_only_unresolved_prompts_and_replaces_whole_groups():
    ex = make_examples([0, 1, 2, 3, 4])
    out, policy, _ = run("sage", ex)
    np.testing.assert_array_equal(out.level, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(out.round, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(out.rewards.max(1), [1, 1, 1, 1, 0])
    # The collapse mask is the first pass's: prompt 0 all right, the others all wrong.
    np.testing.assert_array_equal(out.collapse, [rollout.COLLAPSE_ALL_ONE]
                                  + [rollout.COLLAPSE_ALL_ZERO] * 4)
    # Every answer of a group comes from the same context (never mixed).
    for b in range(5):
        assert len({t.split("@")[1] for t in out.texts[b]}) == 1
        assert out.texts[b][0].endswith(f"@{out.level[b]}")
    # Which prompts each call re-sampled: level k only for prompts unresolved before it.
    answer_calls = [(salt, ids) for salt, ids, texts in policy.calls if texts[0].startswith("Q:")]
    assert answer_calls == [(0, [0, 1, 2, 3, 4]), (1, [1, 2, 3, 4]), (2, [2, 3, 4]), (3, [3, 4])]
    hint_calls = [ids for salt, ids, texts in policy.calls if texts[0].startswith("R:")]
    assert hint_calls == [[1, 2, 3, 4]]  # one batched request for all that need a hint
    # The prompt a hinted group trains on is the hinted context; the plain one is kept too.
    assert "".join(map(chr, out.prompts[2])).endswith("|H:L2")
    assert "".join(map(chr, out.plain_prompts[2])) == "Q:p2n2"
    m = out.metrics
    assert m["collapse/frac_all_zero"] == pytest.approx(4 / 5)
    assert m["collapse/frac_all_one"] == pytest.approx(1 / 5)
    assert m["collapse/frac_all_zero_after"] == pytest.approx(1 / 5)
    assert m["hint/prompts_needing_hint"] == 4
    assert (m["hint/used_level_1"], m["hint/used_level_2"], m["hint/used_level_3"]) == (4, 3, 2)
    assert m["hint/acc_level_0"] == 1.0 and m["hint/acc_level_3"] == 0.5
    assert m["hint/write_failed"] == 0
    # Groups here are all-right or all-wrong, so none became mixed.
    assert m["hint/rescued"] == 0


def test_scorer_gets_the_tasks_reference_for_the_context_each_group_was_asked_in():
    """A task with `reference` (the toy task: the continuation after the hint) is scored
    against the reference for the hint each group saw; plain and re-sampled groups get the
    no-hint reference."""

    class RefTask(CharTask):
        def reference(self, problem, answer, hint=None):
            return f"{problem}/{hint or '-'}"

    seen = []

    def recording_scorer(responses, gts):
        seen.extend(zip(responses, gts))
        return scorer(responses, gts)

    for method, expected in (("sage", {"@0": "-", "@1": "L1", "@2": "L2"}),
                             ("resample", {"@0": "-"})):
        seen.clear()
        ex = make_examples([0, 2])
        rollout.run(ex, np.arange(2), task=RefTask(), sampler=ScriptedPolicy(),
                    scorer=recording_scorer, hint=HintConfig(),
                    rl=RLConfig(method=method, group_size=G, max_new_tokens=16),
                    tables=rollout.SageTables.empty(2, hint_width=64), step=0)
        assert len(seen) == G * (2 + (2 if method == "sage" else 3))
        for response, gt in seen:
            problem, hint = gt.split("/")
            assert problem in ("p0n0", "p1n2")
            assert hint == expected["@" + response.split("@")[1]]


def test_sage_levels_restart_every_step():
    ex = make_examples([0, 2])
    tables = rollout.SageTables.empty(2, hint_width=64)
    run("sage", ex, tables=tables, step=0)
    out, policy, _ = run("sage", ex, tables=tables, step=1)
    first = [ids for salt, ids, texts in policy.calls if salt == 0]
    assert first == [[0, 1]]  # both start un-hinted again
    np.testing.assert_array_equal(out.level, [0, 2])


def test_prompts_without_solution_or_unparseable_hints_keep_their_group():
    ex = make_examples([1, 1, 1])
    ex[1] = Example(problem="p1n1", answer="RIGHT", solution=None, hint=None, index=1)
    policy = ScriptedPolicy(bad_payload_for={"p2n1"})
    out, policy, _ = run("sage", ex, policy=policy, hint_retries=2)
    np.testing.assert_array_equal(out.level, [1, 0, 0])
    assert out.metrics["hint/write_failed"] == 1
    assert out.metrics["hint/prompts_needing_hint"] == 2
    retries = [ids for salt, ids, texts in policy.calls if texts[0].startswith("R:")]
    assert retries == [[0, 2], [2], [2]]  # first try, then 2 retries of the failure
    assert out.rewards[1].max() == 0 and out.rewards[2].max() == 0
    # What the policy wrote is kept for the sample log, parsed or not; none where not asked.
    assert json.loads(out.hint_written[0])["level1"] == "L1"
    assert out.hint_written[1] is None and out.hint_written[2] == "not json at all"


def test_resample_control_has_the_same_budget_without_hints():
    ex = make_examples([0, 1, 4])
    out, policy, _ = run("resample", ex)
    np.testing.assert_array_equal(out.level, [0, 0, 0])
    np.testing.assert_array_equal(out.round, [0, 3, 3])
    assert not any(t[0].startswith("R:") for _, _, t in policy.calls)
    assert all("|H:" not in t for _, _, texts in policy.calls for t in texts)
    assert [ids for _, ids, _ in policy.calls] == [[0, 1, 2], [1, 2], [1, 2], [1, 2]]


def test_grpo_samples_once():
    ex = make_examples([0, 1, 4])
    out, policy, _ = run("grpo", ex)
    assert len(policy.calls) == 1
    np.testing.assert_array_equal(out.level, [0, 0, 0])
    assert out.metrics["collapse/frac_all_zero_after"] == out.metrics["collapse/frac_all_zero"]


def test_sage_light_levels_follow_last_accuracy():
    ex = make_examples([2, 0])
    tables = rollout.SageTables.empty(2, hint_width=64)
    levels = []
    for step in range(4):
        out, _, _ = run("sage_light", ex, tables=tables, step=step)
        levels.append(list(out.level))
    # p0 needs level 2: 0 (first time) -> 1 (acc 0 <= low) -> 2 (acc 0) -> 2 (acc 1 > high: but
    # stored level then drops to 1 at the next visit). p1 always right: stays 0.
    assert levels == [[0, 0], [1, 0], [2, 0], [1, 0]]
    assert tables.seen.all() and tables.ever_solved.all()
    np.testing.assert_array_equal(tables.hint_level, [1, 0])


def test_sage_light_reuses_last_good_payload_when_writing_fails():
    ex = make_examples([1])
    tables = rollout.SageTables.empty(1, hint_width=64)
    run("sage_light", ex, tables=tables, step=0)  # first visit: no hint, acc 0
    tables.store_hints(0, {1: "L1", 2: "L2", 3: "L3"}, step=0)
    policy = ScriptedPolicy(bad_payload_for={"p0n1"})
    out, _, _ = run("sage_light", ex, tables=tables, step=1, policy=policy)
    assert out.level[0] == 1 and out.hints[0] == "L1"
    assert out.metrics["hint/write_failed"] == 1


def test_offline_hints_are_written_once_and_reused():
    ex = make_examples([1, 2])
    tables = rollout.SageTables.empty(2, hint_width=64)
    _, p0, _ = run("sage", ex, tables=tables, step=0, hint_source="offline")
    _, p1, _ = run("sage", ex, tables=tables, step=5, hint_source="offline")
    count = lambda p: sum(t[0].startswith("R:") for _, _, t in p.calls)
    assert (count(p0), count(p1)) == (1, 0)
    _, p2, _ = run("sage", ex, tables=tables, step=6, hint_refresh_every=3)
    assert count(p2) == 1  # written at step 0, refreshed every 3 steps


def test_column_hints():
    ex = [Example(problem="p0n2", answer="RIGHT", solution=None,
                  hint=json.dumps({"level1": "L1", "level2": "L2"}), index=0)]
    out, policy, _ = run("sage", ex, hint_source="column")
    assert out.level[0] == 2
    assert not any(t[0].startswith("R:") for _, _, t in policy.calls)


def test_frac_never_solved_counts_seen_prompts():
    ex = make_examples([0, 9, 9, 9])
    tables = rollout.SageTables.empty(4, hint_width=64)
    out, _, _ = run("grpo", ex, ids=np.array([0, 1]), tables=tables)
    assert out.metrics["hint/frac_never_solved"] == 0.5


def test_hinted_vs_plain_loss_context_differs_exactly_by_the_hint_tokens():
    ex = make_examples([0, 2])
    out, _, _ = run("sage", ex)
    hinted = batching.train_batch(out, loss_context="hinted")
    plain = batching.train_batch(out, loss_context="plain")
    for key in ("advantages_N", "level_N", "collapse_N"):
        np.testing.assert_array_equal(hinted[key], plain[key])
    # The per-prompt level and collapse mask reach the update batch, one entry per row.
    np.testing.assert_array_equal(hinted["level_N"], np.repeat(out.level, G))
    np.testing.assert_array_equal(hinted["collapse_N"], np.repeat(out.collapse, G))
    for row in range(2 * G):
        b = row // G
        def parts(batch):
            tok, mask, loss = (batch[k][row] for k in ("tokens_NxL", "mask_NxL", "loss_mask_NxL"))
            return tok[mask & ~loss].tolist(), tok[loss].tolist()
        (hp, ha), (pp, pa) = parts(hinted), parts(plain)
        assert ha == pa  # the same answer tokens get the loss
        assert pp == out.plain_prompts[b]
        if out.level[b]:  # hinted context = bare prompt + the hint's tokens, nothing else
            assert hp == out.prompts[b] and hp[:len(pp)] == pp
            assert "".join(map(chr, hp[len(pp):])) == "|H:" + out.hints[b]
        else:
            assert hp == pp


@pytest.mark.slow
def test_packed_train_rows_give_the_log_probs_of_left_padded_rows():
    """The update's rows are packed (prompt, answer, right padding); their log-probs equal
    those of the sampler's layout (prompt left-padded to P columns, answer in T columns)."""
    from flax import nnx

    from sage_jax.core import grpo
    from sage_jax import models
    from sage_jax.engine.sampler import sampling
    ex = make_examples([0, 2, 3, 1])
    out, _, _ = run("sage", ex)
    batch = batching.train_batch(out, loss_context="hinted")
    t = out.samples.tokens.shape[-1]
    p = sampling_plan.prompt_bucket(max(len(x) for x in out.prompts))
    ptok, pmask = sampling.left_pad(out.prompts, p, 0)
    rows = np.arange(len(ex) * G) // G
    ans = out.samples.tokens.reshape(-1, t)
    alive = np.arange(t)[None] < out.samples.lengths.reshape(-1, 1)
    old_tok = np.concatenate([ptok[rows], ans], 1)
    old_mask = np.concatenate([pmask[rows], alive], 1)
    old_loss = np.concatenate([np.zeros_like(pmask[rows]), alive], 1)
    longest = max(len(out.prompts[r]) + n for r, n in zip(rows, out.samples.lengths.ravel()))
    assert batch["tokens_NxL"].shape[1] == packing.length_bucket(longest)
    cfg = models.DecoderConfig(family="llama", vocab_size=128, hidden_size=32,
                             intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8)
    graphdef, params = nnx.split(models.Decoder(cfg, rngs=nnx.Rngs(3)))
    new = np.asarray(grpo.token_logprobs(graphdef, params, batch["tokens_NxL"],
                                         batch["mask_NxL"], need_NxL=batch["loss_mask_NxL"]))
    old = np.asarray(grpo.token_logprobs(graphdef, params, old_tok, old_mask, need_NxL=old_loss))
    for n in range(len(rows)):
        np.testing.assert_array_equal(batch["tokens_NxL"][n][batch["loss_mask_NxL"][n]],
                                      old_tok[n][old_loss[n]])
        np.testing.assert_allclose(new[n][batch["loss_mask_NxL"][n]], old[n][old_loss[n]],
                                   atol=2e-5)
    assert batch["loss_mask_NxL"].sum() == old_loss.sum() > 0


def test_reference_hints_rescue_collapsed_groups_without_writing_and_train_on_them():
    ex = [Example(problem=f"p{i}n{n}", answer="RIGHT", solution="L1;L2;L3;RIGHT", hint=None,
                  index=i) for i, n in enumerate([0, 1, 2, 3, 4])]
    out, policy, tables = run("sage", ex, hint_source="reference")
    assert not [c for c in policy.calls if c[2][0].startswith("R:")]  # nothing was written
    np.testing.assert_array_equal(out.level, [0, 1, 2, 3, 3])
    assert out.hints[1:] == ["L1", "L1;L2", "L1;L2;L3", "L1;L2;L3"]
    assert out.metrics["collapse/all_zero_groups"] == 4
    # all-zero groups rescued: p1..p3 solved with their hint, p4 (needs more) stays all-zero
    assert out.metrics["hint/rescued"] == 0  # groups are all-RIGHT or all-WRONG in the double
    np.testing.assert_array_equal(out.rewards.max(1), [1, 1, 1, 1, 0])
    assert out.metrics["collapse/frac_all_zero_after"] == 0.2
    assert (tables.hint_step == -1).all()  # reference hints are not cached: nothing to refresh
    batch = batching.train_batch(out, loss_context="hinted")
    for b in (1, 2, 3):  # the update trains on the hinted context
        row = batch["tokens_NxL"][b * G][batch["mask_NxL"][b * G] & ~batch["loss_mask_NxL"][b * G]]
        assert "".join(map(chr, row)) == "Q:" + ex[b].problem + "|H:" + out.hints[b]


def test_reference_source_rescues_a_mixed_group_with_a_stochastic_policy():
    """With answers right half the time once hinted, the rescued groups are mixed: they get
    non-zero advantages (what SAGE is for)."""

    class Half(ScriptedPolicy):
        def __call__(self, prompts, **kw):
            out = super().__call__(prompts, **kw)
            out.tokens[:, 1::2] = out.tokens[:, :1]  # every other sample copies the first
            wrong = np.asarray([ord(c) for c in "WRONG@0"])
            out.tokens[:, 1::2, :len(wrong)] = wrong
            out.lengths[:, 1::2] = len(wrong)
            return out

    ex = [Example(problem="p0n2", answer="RIGHT", solution="L1;L2;L3;RIGHT", hint=None,
                  index=0)]
    out, _, _ = run("sage", ex, policy=Half(), hint_source="reference")
    assert out.collapse[0] == rollout.COLLAPSE_ALL_ZERO and out.level[0] == 2
    assert out.metrics["hint/rescued"] == 1 and out.metrics["collapse/frac_all_zero_after"] == 0
    adv = batching.train_batch(out)["advantages_N"]
    assert (adv[::2] > 0).all() and (adv[1::2] < 0).all()


@pytest.mark.parametrize("minibatches", [1, 2])
def test_the_update_batch_is_packed_from_the_rows_as_the_padded_batch_packs(minibatches):
    """rl.padding_free: `update_batch` packs the rollout's rows directly, array for array what
    packing the padded `train_batch` gives; without it, the padded batch one row per sequence."""
    out, _, _ = run("sage", make_examples([0, 2, 3, 1]))
    settings = update.UpdateSettings.of(Config(
        rl=RLConfig(method="sage", prompts_per_step=4, group_size=G, minibatches=minibatches,
                    max_new_tokens=out.samples.tokens.shape[-1]),
        data=DataConfig(max_prompt_tokens=8)))
    padded = batching.train_batch(out, pad_id=3)
    for padding_free, want in ((True, update.pack_batch(padded, settings)),
                               (False, packing.as_packed(padded))):
        got = batching.update_batch(
            out, settings, batching.BatchSettings(padding_free=padding_free, pad_id=3))
        assert got.keys() == want.keys() and packing.is_packed(got)
        for k in want:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert want["tokens_ZxL"].shape == padded["tokens_NxL"].shape  # one row per sequence
    assert (got["tokens_ZxL"][~got["segments_ZxL"].astype(bool)] == 3).any()  # pad_id kept


class KeyedPolicy(ScriptedPolicy):
    """Each answer right with probability (level + 0.5) / 5, drawn from its key (salt, prompt id,
    sample) alone, and its tokens carry the draw: equal keys give equal answers in any call."""

    def __call__(self, prompts, *, prompt_ids, salt, num_samples, max_new_tokens, **kw):
        out = super().__call__(prompts, prompt_ids=prompt_ids, salt=salt,
                               num_samples=num_samples, max_new_tokens=max_new_tokens, **kw)
        for b, text in enumerate(self.calls[-1][2]):
            if text.startswith("R:"):
                continue
            hint = text.partition("|H:")[2]
            have = int(hint.split(";")[-1][1:]) if hint else 0
            for g in range(num_samples):
                u = np.random.default_rng([salt, int(prompt_ids[b]), g]).random()
                s = f"{'RIGHT' if u < (have + 0.5) / 5 else 'WRONG'}@{have}#{u:.6f}"
                out.tokens[b, g] = 0
                out.tokens[b, g, :len(s)] = [ord(c) for c in s]
                out.lengths[b, g] = len(s)
        return out


@pytest.mark.parametrize("method", ["sage", "resample"])
def test_speculative_escalation_keeps_the_groups_of_sequential_escalation(method):
    """hint.escalation=speculative: one call for every level, and the groups kept (tokens,
    rewards, levels, contexts) are those of level-by-level escalation with the same keys."""
    ex = make_examples([1, 2, 3, 4, 2, 3, 1, 4] * 2)
    ids = np.arange(len(ex))
    hint = HintConfig(source="online", escalation="speculative")
    rl = RLConfig(method=method, group_size=G, max_new_tokens=24)

    def step(speculative):
        policy = KeyedPolicy()
        g = rollout._Step.start(ex, ids, task=CharTask(), sampler=policy, scorer=scorer, rl=rl)
        tables = rollout.SageTables.empty(len(ex), hint_width=64)
        source = rollout.HintSource(hint, examples=ex, dataset_ids=ids, task=CharTask(),
                                    sampler=policy, tables=tables, step=0)
        rollout.first_pass(g)
        payloads = source.get(g.unresolved()) if method == "sage" else {}
        hint_of = (lambda i, lvl: payloads.get(i, {}).get(lvl)) if method == "sage" else None
        if speculative:
            rollout.escalate_all(g, hint, hint_of)
        else:
            g.folded_keys = True  # the same keys, one call per level
            for lvl in (1, 2, 3):
                rollout.escalate(g, lvl, hint_of)
        return g, policy

    seq, seq_policy = step(False)
    spec, spec_policy = step(True)
    assert seq.samples is not None and spec.samples is not None
    np.testing.assert_array_equal(spec.samples.tokens, seq.samples.tokens)
    np.testing.assert_array_equal(spec.samples.lengths, seq.samples.lengths)
    np.testing.assert_array_equal(spec.rewards, seq.rewards)
    np.testing.assert_array_equal(spec.level, seq.level)
    np.testing.assert_array_equal(spec.rnd, seq.rnd)
    assert spec.prompts == seq.prompts and spec.hints == seq.hints and spec.texts == seq.texts
    assert {k: v for k, v in spec.metrics.items() if k.startswith("hint/used")} == {
        k: v for k, v in seq.metrics.items() if k.startswith("hint/used")}
    assert seq.rnd.max() >= 2 and (method == "resample" or {1, 2} <= set(seq.rnd.tolist()))

    def answer_calls(policy):
        return [ids for _, ids, texts in policy.calls if texts[0].startswith("Q:")]
    levels = sum(seq.metrics.get(f"hint/used_level_{lvl}", 0) > 0 for lvl in (1, 2, 3))
    assert len(answer_calls(seq_policy)) == 1 + levels and len(answer_calls(spec_policy)) == 2
    # speculative: every level of the first pass's unresolved prompts, in one call
    first_unresolved = int((seq.collapse != rollout.COLLAPSE_ALL_ONE).sum() - (
        (seq.collapse == rollout.COLLAPSE_MIXED).sum()))
    assert len(answer_calls(spec_policy)[1]) == 3 * first_unresolved
    assert sum(map(len, answer_calls(seq_policy)[1:])) < 3 * first_unresolved  # unneeded levels


def test_the_rollout_correction_rows_carry_the_engines_and_the_sampled_contexts_log_probs():
    """Under loss_context=plain a hinted answer's rows start with the bare prompt, but the
    correction's log-probs stay those of the context it was sampled in: the engine's ride along
    (`sampler_logp`), and the trainer's are computed on the hinted prompt (`sampled_logp`)."""
    import jax
    from flax import nnx

    from sage_jax import models
    from sage_jax.config import MeshConfig
    from sage_jax.core import grpo
    from sage_jax.infra import parallel
    from sage_jax.rl.types import Rollout, Samples

    rng = np.random.default_rng(0)
    plain = [[5, 6, 7], [8, 9]]
    hinted = [[5, 6, 7], [8, 9, 10, 11, 12]]  # group 1 was sampled with a hint
    lengths = np.array([[3, 1], [2, 4]])
    tokens = rng.integers(1, 30, (2, 2, 4)).astype(np.int32)
    engine = np.where(np.arange(4) < lengths[..., None], -rng.random((2, 2, 4)), 0.0)
    engine = engine.astype(np.float32)
    ro = Rollout(prompts=hinted, plain_prompts=plain,
                 samples=Samples(tokens, lengths, engine),
                 rewards=np.array([[1, 0], [0, 1]], np.float32), level=np.array([0, 1], np.int8),
                 collapse=np.zeros(2, np.int8), round=np.zeros(2, np.int8),
                 hints=[None, "h"], texts=[[""] * 2] * 2, metrics={})
    cfg = models.DecoderConfig(family="llama", vocab_size=32, hidden_size=16,
                               intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                               head_dim=8)
    graphdef, params = nnx.split(models.Decoder(cfg, rngs=nnx.Rngs(1)))
    mesh = parallel.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    sampled = batching.answer_logprobs(
        ro, update.make_logprob_fn(graphdef, mesh), params, mesh, context="hinted")
    rows = batching.train_rows(ro, loss_context="plain", engine_logprobs=True,
                               sampled_logprobs=sampled)
    for q, (i, j) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        n = lengths[i, j]
        answer = tokens[i, j, :n]
        assert rows["tokens"][q].tolist() == plain[i] + answer.tolist()
        np.testing.assert_array_equal(rows["sampler_logp"][q][len(plain[i]):], engine[i, j, :n])
        in_context = {}
        for name, prompt in (("hinted", hinted[i]), ("plain", plain[i])):
            row = np.zeros((1, 12), np.int32)  # right-padded: one shape, one compile
            row[0, :len(prompt) + n] = prompt + answer.tolist()
            logp = grpo.token_logprobs(graphdef, params, row, row > 0)
            in_context[name] = np.asarray(logp)[0, len(prompt):len(prompt) + n]
        np.testing.assert_allclose(rows["sampled_logp"][q][len(plain[i]):], in_context["hinted"],
                                   atol=1e-5)
        if i == 1:  # the hinted group: its sampled context is not the loss's
            assert np.abs(in_context["hinted"] - in_context["plain"]).max() > 1e-3
    assert "old_logp" not in rows
