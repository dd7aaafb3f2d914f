"""Warm start and calibration of the toy testbed.

`warm_start` trains the toy model with `sage_jax.engine.trainer.sft_step` on the toy SFT mix and stops when the
teacher-forced single-step accuracy (at temperature 1) reaches a target, so the policy starts RL
where single steps are right about 85-90% of the time.

`teacher_forced` measures, in one forward pass per batch and without sampling, the exact
probability (temperature 1) that the policy writes each reference step, given the prompt (plain or
hinted) and the correct steps before it.

`calibrate` is the gate the default job prints before RL: sampled groups on the RL prompt
distribution -> share of all-zero groups per length, pass rate per length with no hint and with
level-1/2/3 reference hints, and the policy's own hint-writing accuracy per level.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax.config import HINTED_METHODS
from sage_jax.core import sage
from sage_jax.engine.trainer import sft_step as sft
from sage_jax.models.decoder import Decoder
from sage_jax.tasks.toy import chains as toy

SFT_DEFAULTS = dict(steps=6000, batch_size=32, lr=3e-3, warmup=50, target_step_acc=0.87,
                    eval_every=10, eval_per_length=8, bucket=32, short_max_steps=4,
                    short_target=0.8)
GATE_ALL_ZERO = 0.35  # at least this share of groups all-zero at step 0
GATE_L3_MARGIN = 0.10  # level-3 pass rate at the hardest length at least this above no hint
GATE_WRITE_ACC = 0.5  # self-written hints (online / offline): level 1 right at least this often
SELF_WRITTEN = ("online", "offline")  # hint sources whose hints the policy writes


def pick_hint_source(source: str, write_acc_l1: float | None) -> tuple[str, str]:
    """(hint source, why) for a configured `hint.source`: `auto` becomes `online` when the
    policy's own level-1 hints match the reference at least `GATE_WRITE_ACC` of the time (None:
    not measured), else `reference`; any other source stays as configured."""
    if source != "auto":
        return source, "as configured (hint.source)"
    if write_acc_l1 is None:
        return "reference", "auto without a calibration gate: hints from the reference solution"
    if write_acc_l1 >= GATE_WRITE_ACC:
        return "online", (f"auto: the policy's own level-1 hints match the reference "
                          f"{write_acc_l1:.0%} of the time (>= {GATE_WRITE_ACC:.0%})")
    return "reference", (f"auto: the policy's own level-1 hints match the reference only "
                         f"{write_acc_l1:.0%} of the time (< {GATE_WRITE_ACC:.0%}), so "
                         f"self-written hints would rescue nothing; hints from the reference "
                         f"solution instead")


# ---- teacher forcing ------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _logprob_fn(graphdef):
    return jax.jit(functools.partial(sft.next_token_logprobs, graphdef))


def teacher_forced(model: Decoder, problems: Sequence[toy.ToyProblem], *, level: int = 0,
                   task: toy.ToyTask | None = None, batch_size: int = 256) -> dict:
    """Per-problem and per-step probabilities of the reference answer at temperature 1.

    With `level` > 0 the prompt holds the level's reference hint (problems without that level are
    skipped) and the steps are those after the hint. Returns:
      pass_prob [N]: probability of sampling exactly the reference continuation (<eos> included),
        and pass_logprob [N] its log;
      step_prob: list of arrays, one per problem, P(step j right | all before right) for each
        step the answer writes (the step's chars and its ';'); the final `A:..<eos>` is folded
        into the last step;
      k [N]: problem lengths; index [N]: positions of the kept problems in `problems`.
    """
    task = task or toy.ToyTask()
    graphdef, params = nnx.split(model)
    fn = _logprob_fn(graphdef)
    rows, keep = [], []
    for i, p in enumerate(problems):
        if level:
            hints = toy.reference_hints(p)
            if level not in hints:
                continue
            prompt = task.hinted_prompt(p.text, hints[level])
            answer = toy.continuation(p, hints[level])
        else:
            prompt, answer = task.answer_prompt(p.text), p.solution
        rows.append((prompt, task.encode_answer(answer), answer))
        keep.append(i)
    pass_prob, pass_logprob, step_logprob = [], [], []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s:s + batch_size]
        tokens, mask = sft.make_batch([(pr, an) for pr, an, _ in chunk], pad_id=task.pad_id)
        n = len(chunk)
        if n < batch_size and len(rows) > batch_size:  # keep one compiled batch shape
            tokens = np.pad(tokens, ((0, batch_size - n), (0, 0)))
        lp = np.asarray(fn(params, jnp.asarray(tokens)))[:n]
        for (pr, an, text), row in zip(chunk, lp):
            a = row[len(pr) - 1:len(pr) - 1 + len(an)]  # log p of each answer token (+ <eos>)
            pass_logprob.append(float(a.sum()))
            pass_prob.append(float(np.exp(a.sum())))
            # split the answer text into steps: 'a+5=12;' ... the last step takes 'A:xx<eos>'
            parts = text.split(toy.STEP_SEP)
            bounds, pos = [], 0
            for j, part in enumerate(parts[:-1]):
                end = pos + len(part) + 1
                bounds.append((pos, end))
                pos = end
            if bounds:
                bounds[-1] = (bounds[-1][0], len(an))
            else:
                bounds = [(0, len(an))]
            step_logprob.append(np.asarray([a[b0:b1].sum() for b0, b1 in bounds], np.float64))
    ks = np.asarray([problems[i].k for i in keep], np.int32)
    return {"pass_prob": np.asarray(pass_prob), "pass_logprob": np.asarray(pass_logprob),
            "step_prob": [np.exp(s) for s in step_logprob], "step_logprob": step_logprob,
            "k": ks,
            "index": np.asarray(keep, np.int32)}


def step_accuracy(model: Decoder, problems: Sequence[toy.ToyProblem], **kw) -> dict:
    """Summary of `teacher_forced`: mean single-step accuracy, pass prob and expected share of
    all-zero groups of 8 (E[(1 - q)^8]), overall and per length."""
    tf = teacher_forced(model, problems, **kw)
    steps = np.concatenate(tf["step_prob"]) if tf["step_prob"] else np.zeros(0)
    q = tf["pass_prob"]
    out = {"step_acc": float(steps.mean()) if steps.size else float("nan"),
           "pass": float(q.mean()), "all_zero_g8": float(((1 - q) ** 8).mean())}
    for k in sorted(set(tf["k"].tolist())):
        sel = tf["k"] == k
        out[f"pass_k{k}"] = float(q[sel].mean())
    return out


# ---- warm start -----------------------------------------------------------------------------

def warm_start(*, seed: int = 0, steps: int = SFT_DEFAULTS["steps"],
               batch_size: int = SFT_DEFAULTS["batch_size"], lr: float = SFT_DEFAULTS["lr"],
               warmup: int = SFT_DEFAULTS["warmup"],
               target_step_acc: float = SFT_DEFAULTS["target_step_acc"],
               eval_every: int = SFT_DEFAULTS["eval_every"],
               eval_per_length: int = SFT_DEFAULTS["eval_per_length"],
               bucket: int = SFT_DEFAULTS["bucket"],
               short_max_steps: int = SFT_DEFAULTS["short_max_steps"],
               short_target: float = SFT_DEFAULTS["short_target"],
               spec: toy.ToySpec = toy.SFT_SPEC, eval_spec: toy.ToySpec = toy.RL_SPEC,
               mix: toy.SFTMix = toy.SFTMix(), task: toy.ToyTask | None = None,
               target_write_prob: float = 0.0,
               model_overrides: dict | None = None,
               progress: Callable[[str], None] | None = None):
    """A fresh toy model trained on the SFT mix until the teacher-forced single-step accuracy
    on held-out problems of `eval_spec` (the RL lengths, rare operands left out) reaches
    `target_step_acc` (0: train all `steps`); with `target_write_prob`, also the single-step
    accuracy after each reference hint level reaches it, and the probability of writing each
    level's hint exactly (`write_prob`) reaches `target_write_prob`.

    Curriculum: while the single-step accuracy on held-out problems of 2..`short_max_steps`
    steps is below `short_target`, the SFT problems have at most `short_max_steps` steps (short
    rows make steps several times cheaper, and the arithmetic is learned in them); from then
    on every length of `spec`. `short_max_steps` 0 skips the short phase.

    Returns (model, `sft.SFTResult`).
    """
    task = task or toy.ToyTask()
    model = Decoder(toy.toy_model_config(**(model_overrides or {})), rngs=nnx.Rngs(seed))
    held_out = toy.make_problems(eval_per_length, eval_spec.without_rare(), seed=10_000 + seed,
                                 per_length=True)
    short = min(short_max_steps, spec.max_steps)
    short_spec = dataclasses.replace(spec, max_steps=short) if short else None
    short_held_out = (toy.make_problems(eval_per_length, toy.ToySpec(min(2, short), short),
                                        seed=10_000 + seed, per_length=True) if short else None)
    state = {"step": 0, "acc": 0.0, "short": short_spec is not None}

    def draw(rng, n):
        return toy.sft_draw(rng, n, task=task, spec=short_spec if state["short"] else spec,
                            mix=mix)

    # Single-step accuracy rises sharply once the arithmetic "clicks", so near the target the
    # model is evaluated every other step.
    def evaluate(m):
        state["step"] += 1
        if state["short"]:
            if state["step"] % eval_every:
                return {}
            met = step_accuracy(m, short_held_out, task=task)
            if met["step_acc"] >= short_target:
                state["short"] = False
                if progress:
                    progress(f"sft: short problems learned (single-step accuracy "
                             f"{met['step_acc']:.3f} at step {state['step']}); now every length")
            return {"short_step_acc": met["step_acc"]}
        near = target_step_acc and target_step_acc - 0.35 <= state["acc"] < target_step_acc
        if state["step"] % (2 if near else eval_every):
            return {}
        met = step_accuracy(m, held_out, task=task)
        state["acc"] = met["step_acc"]
        if target_write_prob and met["step_acc"] >= target_step_acc:
            for level in sage.LEVELS:
                met[f"write_prob_l{level}"] = write_prob(m, held_out, task=task, level=level)
                met[f"hinted_step_acc_l{level}"] = step_accuracy(
                    m, held_out, task=task, level=level)["step_acc"]
        return met

    def stop(met):
        if met.get("step_acc", 0.0) < target_step_acc:
            return False
        if not target_write_prob:
            return True
        return all(met.get(f"write_prob_l{lv}", 0.0) >= target_write_prob
                   and met.get(f"hinted_step_acc_l{lv}", 0.0) >= target_step_acc
                   for lv in sage.LEVELS)

    return sft.train_sft(model, draw, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         pad_id=task.pad_id, warmup=warmup, eval_every=1 if eval_every else 0,
                         bucket=bucket, eval_fn=evaluate if eval_every else None,
                         stop_fn=stop if target_step_acc else None,
                         progress=progress)


# ---- sampled calibration --------------------------------------------------------------------

STEP_CHARS = 8  # "a=7+3=0;"


def max_answer_tokens(k: int) -> int:
    """Room for a k-step answer (the steps, 'A:' and the value, <eos>) with a margin."""
    return STEP_CHARS * k + 12


def max_payload_tokens(k: int) -> int:
    """Room for the hint payload of a k-step problem (levels 1..3 repeat 1 + k/2 + k-1 steps)."""
    return STEP_CHARS * (1 + k // 2 + k) + 32


def _rows(engine, prompts, *, key, prompt_ids, num_samples: int, max_new_tokens: int,
          temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N*G, T], lengths [N*G]) of `engine.sample` (a `RolloutEngine`'s contract),
    one row per answer, prompt-major."""
    got = engine.sample(prompts, key=key, prompt_ids=np.asarray(prompt_ids, np.int32),
                        num_samples=num_samples, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_p=1.0, top_k=0)
    return (np.asarray(got.tokens).reshape(-1, got.tokens.shape[-1]),
            np.asarray(got.lengths).reshape(-1))


def sample_rewards(engine, problems: Sequence[toy.ToyProblem], *, group_size: int,
                   temperature: float = 1.0, key=None, level: int = 0,
                   task: toy.ToyTask | None = None, prompt_ids=None):
    """Rewards [N, group_size] of answers to `problems` sampled by `engine` (a
    `RolloutEngine`, e.g. `rl.engines.NativeEngine` on the policy, with the task's EOS and
    padding) with the level's reference hint in the prompt when `level` > 0 (every problem
    must have that level), and the texts [N*G]."""
    task = task or toy.ToyTask()
    if level:
        prompts = [task.hinted_prompt(p.text, toy.reference_hints(p)[level]) for p in problems]
    else:
        prompts = [task.answer_prompt(p.text) for p in problems]
    kmax = max(p.k for p in problems)
    ids = np.arange(len(problems)) if prompt_ids is None else prompt_ids
    tokens, lengths = _rows(engine, prompts, key=jax.random.PRNGKey(0) if key is None else key,
                            prompt_ids=ids, num_samples=group_size,
                            max_new_tokens=max_answer_tokens(kmax), temperature=temperature)
    texts = [task.decode(tokens[r, :lengths[r]]) for r in range(len(lengths))]
    truths = [toy.continuation(p, toy.reference_hints(p)[level] if level else None)
              for p in problems]
    r = np.asarray([toy.toy_reward(t, truths[r // group_size])
                    for r, t in enumerate(texts)], np.float32)
    return r.reshape(len(problems), group_size), texts


def hint_write_accuracy(engine, problems: Sequence[toy.ToyProblem], *,
                        task: toy.ToyTask | None = None, temperature: float = 0.0,
                        key=None, levels: Sequence[int] = (1, 2, 3)) -> dict:
    """The policy (sampled by `engine`, as in `sample_rewards`) answers the task's hint requests (`task.hint_requests`: one JSON payload per
    problem, or one request per level) at `temperature` (0 = greedy); returns {"parse_rate":
    share of replies with a usable hint (`task.read_hints`), "leaked": levels refused for giving
    the answer away, "acc": {level: share whose level-l hint equals the reference one (of the
    problems that have that level)}, "samples": 3 replies}."""
    task = task or toy.ToyTask()
    kmax = max(p.k for p in problems)
    todo = [(r, lvl, req) for r, p in enumerate(problems)
            for lvl, req in task.hint_requests(p.text, p.solution).items()]
    tokens, lengths = _rows(engine, [req for _, _, req in todo],
                            key=jax.random.PRNGKey(1000) if key is None else key,
                            prompt_ids=np.arange(len(todo)), num_samples=1,
                            max_new_tokens=max_payload_tokens(kmax), temperature=temperature)
    parsed_ok, leaked, samples = 0, 0, []
    written: list[dict[int, str]] = [{} for _ in problems]
    for j, (r, lvl, _) in enumerate(todo):
        text = task.decode(tokens[j, :lengths[j]])
        hints, n_leaked = task.read_hints(text, lvl, problems[r].answer)
        parsed_ok += bool(hints)
        leaked += n_leaked
        written[r].update(hints)
        if j < 3:
            samples.append(text)
    right = {lvl: 0 for lvl in levels}
    have = {lvl: 0 for lvl in levels}
    for p, got_hints in zip(problems, written):
        ref = toy.reference_hints(p)
        for lvl in levels:
            if lvl in ref:
                have[lvl] += 1
                right[lvl] += got_hints.get(lvl) == ref[lvl]
    return {"parse_rate": parsed_ok / max(len(todo), 1), "leaked": leaked,
            "acc": {lvl: right[lvl] / max(have[lvl], 1) for lvl in levels}, "samples": samples}


def write_prob(model: Decoder, problems: Sequence[toy.ToyProblem], *, task: toy.ToyTask,
               level: int = 1, batch_size: int = 256) -> float:
    """Mean probability (temperature 1, teacher-forced) that the policy writes exactly the
    reference level-`level` hint (with its <eos>) in reply to the task's request for it; for the
    "payload" format, the whole JSON payload. Problems without that level are skipped."""
    graphdef, params = nnx.split(model)
    fn = _logprob_fn(graphdef)
    rows = []
    for p in problems:
        ref = toy.reference_hints(p)
        if level not in ref:
            continue
        if task.hint_format == "level":
            rows.append(toy.sft_pair(task, p, "write", level))
        else:
            rows.append(toy.sft_pair(task, p, "write"))
    probs = []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s:s + batch_size]
        tokens, _ = sft.make_batch(chunk, pad_id=task.pad_id)
        lp = np.asarray(fn(params, jnp.asarray(tokens)))
        for (pr, an), row in zip(chunk, lp):
            probs.append(float(np.exp(row[len(pr) - 1:len(pr) - 1 + len(an)].sum())))
    return float(np.mean(probs)) if probs else float("nan")


def calibrate(engine, *, task: toy.ToyTask | None = None,
              spec: toy.ToySpec = toy.RL_SPEC, problems_per_length: int = 32,
              group_size: int = 8, temperature: float = 1.0, hint_temperature: float = 0.0,
              levels: Sequence[int] = (1, 2, 3), seed: int = 0,
              problems: Sequence[toy.ToyProblem] | None = None, method: str = "sage",
              hint_source: str = "online") -> dict:
    """Sampled calibration of a policy on the RL prompt distribution.

    `engine` samples the policy (a `RolloutEngine`, as in `sample_rewards`). For each length of
    `spec`,
    `problems_per_length` problems get a group of `group_size` answers with no hint and with each
    reference hint level; the policy also writes one hint payload per problem (at
    `hint_temperature`, 0 = greedy), scored against the reference-derived hints.

    Returns a dict:
      all_zero, all_zero_by_k: share of no-hint groups with every answer wrong;
      pass_by_level: {level: {k: pass rate}} (level 0 = no hint) and pass_by_level_all;
      hint_parse_rate: share of replies with a usable hint (`task.read_hints`); hint_leaked:
        levels refused for giving the answer away;
      hint_write_acc: {level: share of problems whose written level-l hint equals the reference};
      hint_source, hint_source_reason: the source RL uses (`pick_hint_source` of `hint_source`);
      gate: {"all_zero": bool, "l3_above_no_hint": bool, "self_hints": bool, "passed": bool}
        and gate_notes (text). `self_hints` fails when `method` hints (sage, sage_light) with
        hints the policy writes itself (online, offline) and its level-1 hints are right less
        than `GATE_WRITE_ACC` of the time: SAGE then degenerates to GRPO;
      seconds.
    """
    t0 = time.perf_counter()
    task = task or toy.ToyTask()
    if problems is None:
        problems = toy.make_problems(problems_per_length, spec, seed=20_000 + seed,
                                     per_length=True)
    key = jax.random.PRNGKey(seed)
    out = _pass_rates(engine, problems, task=task, group_size=group_size,
                      temperature=temperature, levels=levels, key=key)
    writing = hint_write_accuracy(engine, problems, task=task,
                                  temperature=hint_temperature, key=jax.random.fold_in(key, 1000),
                                  levels=levels)
    out["hint_parse_rate"], out["hint_write_acc"] = writing["parse_rate"], writing["acc"]
    out["hint_leaked"] = writing["leaked"]
    out["samples"]["write"] = writing["samples"]
    out.update(_gate(out, levels=levels, method=method, hint_source=hint_source,
                     kmax=max(p.k for p in problems)))
    out["seconds"] = time.perf_counter() - t0
    return out


def _pass_rates(engine, problems, *, task, group_size, temperature, levels, key) -> dict:
    """Pass rates by level (0: no hint) and length, the all-zero share, a few sample texts."""
    ks = np.asarray([p.k for p in problems])
    out: dict = {"group_size": group_size, "temperature": temperature,
                 "problems": len(problems), "lengths": sorted(set(ks.tolist()))}
    pass_by_level: dict[int, dict[int, float]] = {}
    pass_all: dict[int, float] = {}
    examples: dict = {}
    for level in (0, *levels):
        idx = [i for i, p in enumerate(problems)
               if level == 0 or level in toy.reference_hints(p)]
        if not idx:
            continue
        rewards, texts = sample_rewards(engine, [problems[i] for i in idx], level=level,
                                        group_size=group_size, temperature=temperature,
                                        key=jax.random.fold_in(key, level), task=task,
                                        prompt_ids=idx)
        examples[level] = texts[:: group_size][:3]
        kk = ks[idx]
        pass_by_level[level] = {int(k): float(rewards[kk == k].mean()) for k in sorted(set(kk))}
        pass_all[level] = float(rewards.mean())
        if level == 0:
            az = rewards.max(axis=1) == 0
            out["all_zero"] = float(az.mean())
            out["all_zero_by_k"] = {int(k): float(az[kk == k].mean()) for k in sorted(set(kk))}
    out.update(pass_by_level=pass_by_level, pass_by_level_all=pass_all, samples=examples)
    return out


def _gate(cal: dict, *, levels, method: str, hint_source: str, kmax: int) -> dict:
    """The gate's checks and notes from the measured `cal`, and the hint source RL uses."""
    notes = []
    ok_zero = cal["all_zero"] >= GATE_ALL_ZERO
    notes.append(f"all-zero groups {cal['all_zero']:.0%} (want >= {GATE_ALL_ZERO:.0%}): "
                 + ("ok" if ok_zero else "FAIL"))
    by_level = cal["pass_by_level"]
    if 3 in by_level and kmax in by_level[3]:
        l3, l0 = by_level[3][kmax], by_level[0][kmax]
        ok_l3 = l3 >= l0 + GATE_L3_MARGIN
        notes.append(f"pass at k={kmax}: level-3 hint {l3:.0%} vs no hint {l0:.0%} "
                     f"(want +{GATE_L3_MARGIN:.0%}): " + ("ok" if ok_l3 else "FAIL"))
    else:
        ok_l3 = False
        notes.append("no level-3 hints measured: FAIL")
    notes.append("hint writing (policy vs reference) " + ", ".join(
        f"L{lvl} {cal['hint_write_acc'][lvl]:.0%}" for lvl in levels)
        + f", parsed {cal['hint_parse_rate']:.0%}")
    l1 = cal["hint_write_acc"].get(1)
    source, why = pick_hint_source(hint_source, l1)
    ok_self = True
    if method in HINTED_METHODS and source in SELF_WRITTEN:
        ok_self = l1 is not None and l1 >= GATE_WRITE_ACC
        got = "not measured" if l1 is None else f"{l1:.0%}"
        notes.append(f"self-written hints ({method}, hint.source={source}): level 1 right "
                     f"{got} (want >= {GATE_WRITE_ACC:.0%}): " + (
                         "ok" if ok_self else "FAIL: the policy cannot write its hints, so "
                         "SAGE rescues nothing and degenerates to GRPO"))
    notes.append(f"hint source: {source} ({why})")
    return {"hint_source": source, "hint_source_reason": why,
            "gate": {"all_zero": bool(ok_zero), "l3_above_no_hint": bool(ok_l3),
                     "self_hints": bool(ok_self), "passed": bool(ok_zero and ok_l3 and ok_self)},
            "gate_notes": notes}


def format_calibration(cal: dict) -> str:
    """A small text table of `calibrate`'s result."""
    levels = sorted(cal["pass_by_level"])
    ks = cal["lengths"]
    lines = ["k    all-zero  " + "  ".join(f"pass L{lv}" for lv in levels)]
    for k in ks:
        cells = [f"{cal['pass_by_level'][lv].get(k, float('nan')):7.2f}" for lv in levels]
        lines.append(f"{k:<4d} {cal['all_zero_by_k'].get(k, float('nan')):8.2f}  "
                     + "  ".join(cells))
    lines.append(f"all  {cal['all_zero']:8.2f}  " + "  ".join(
        f"{cal['pass_by_level_all'][lv]:7.2f}" for lv in levels))
    lines += cal["gate_notes"]
    return "\n".join(lines)
