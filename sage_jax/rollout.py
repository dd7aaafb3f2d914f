"""One rollout phase: sample -> reward -> collapse -> hints -> re-sample, for every method.

Methods (one code path):
  grpo        one un-hinted group per prompt.
  sage        un-hinted groups; then for level 1, 2, 3 only the still-unresolved prompts that have a
              hint at that level get a fresh hinted group, which replaces their whole group.
  resample    the same escalation budget as sage (up to three fresh groups for unresolved
              prompts) but without hints: separates the hint's effect from extra samples.
  sage_light  a per-prompt level carried across epochs picks the hint before a single pass.

Rollouts stay shaped [B, G, ...]; a group is replaced whole, never mixed. The sampler and the
scorer are passed in, so tests can drive this with a scripted policy double.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from sage_jax import sage
from sage_jax.tasks.base import Task, ground_truth
from sage_jax.tasks.data import Example


class Samples(NamedTuple):
    """Host arrays from the sampler: tokens [B, G, T], lengths [B, G], logprobs [B, G, T]."""

    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray


class GroupSampler(Protocol):
    def __call__(self, prompts: Sequence[Sequence[int]], *, prompt_ids: np.ndarray, salt: int,
                 num_samples: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int) -> Samples:
        """G answers per prompt. Randomness derives from (step, prompt_ids[b], sample, salt)."""


Scorer = Callable[[Sequence[str], Sequence[str]], "tuple[np.ndarray, dict]"]


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    method: str = "sage"
    group_size: int = 8
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    collapse_std: float = 0.0
    success_threshold: float = 0.0
    hint_source: str = "online"  # online | offline | column | reference
    hint_refresh_every: int = 1  # rewrite cached hints every N steps (0: never)
    hint_temperature: float = 0.0
    hint_max_new_tokens: int = 512
    hint_retries: int = 2
    hint_max_request_tokens: int = 4096
    light_low: float = 0.1
    light_high: float = 0.35
    max_level: int = 3


@dataclasses.dataclass
class SageTables:
    """Per-dataset-prompt SAGE arrays (host copies of TrainState.sage), all indexed by [M]."""

    hint_level: np.ndarray  # int8: sage_light level used the last time the prompt was seen
    last_accuracy: np.ndarray  # float32
    seen: np.ndarray  # bool
    ever_solved: np.ndarray  # bool
    hint_cache: np.ndarray  # uint8 [M, 3, W]: last good payload per level (UTF-8, 0-padded)
    hint_step: np.ndarray  # int32: step the cached payload was written (-1: none)

    @classmethod
    def empty(cls, num_prompts: int, hint_width: int = 2048) -> "SageTables":
        m = num_prompts
        return cls(hint_level=np.zeros(m, np.int8), last_accuracy=np.zeros(m, np.float32),
                   seen=np.zeros(m, bool), ever_solved=np.zeros(m, bool),
                   hint_cache=np.zeros((m, 3, hint_width), np.uint8),
                   hint_step=np.full(m, -1, np.int32))

    def as_dict(self) -> dict[str, np.ndarray]:
        return dataclasses.asdict(self)

    def cached_hints(self, i: int) -> dict[int, str]:
        out = {lvl: sage.decode_hint(self.hint_cache[i, lvl - 1]) for lvl in sage.LEVELS}
        return {k: v for k, v in out.items() if v}

    def store_hints(self, i: int, hints: dict[int, str], step: int) -> None:
        width = self.hint_cache.shape[-1]
        for lvl in sage.LEVELS:
            self.hint_cache[i, lvl - 1] = sage.encode_hint(hints.get(lvl), width)
        self.hint_step[i] = step


COLLAPSE_MIXED, COLLAPSE_ALL_ZERO, COLLAPSE_ALL_ONE = 0, 1, 2  # codes of `Rollout.collapse`


@dataclasses.dataclass
class Rollout:
    """One step's groups. `prompts[b]` is the context the answers were sampled with."""

    prompts: list[list[int]]  # hinted prompt for hinted groups
    plain_prompts: list[list[int]]  # the bare answer prompt of every row
    samples: Samples
    rewards: np.ndarray  # float32 [B, G]
    level: np.ndarray  # int8 [B]: hint level of the group (0: no hint)
    collapse: np.ndarray  # int8 [B]: first-pass status, COLLAPSE_MIXED / _ALL_ZERO / _ALL_ONE
    round: np.ndarray  # int8 [B]: 0 first pass, k = k-th re-sample
    hints: list[str | None]
    texts: list[list[str]]  # decoded answers [B][G]
    metrics: dict[str, float]


def _hint_payload_from_column(text: str | None) -> dict[int, str]:
    if not text:
        return {}
    parsed = sage.parse_hints(text)
    return parsed if parsed else {lvl: text.strip() for lvl in sage.LEVELS}


def write_hints(indices: Sequence[int], examples: Sequence[Example], task: Task,
                sampler: GroupSampler, s: RolloutSettings, *, dataset_ids: np.ndarray
                ) -> tuple[dict[int, dict[int, str]], dict[str, int]]:
    """The policy writes a hint payload for each row in `indices` (batched, with retries).

    Returns {row: {level: hint}} for rows whose payload parsed, and counts of rows whose request
    was too long or whose output never parsed.
    """
    out: dict[int, dict[int, str]] = {}
    todo, too_long = [], 0
    requests = {}
    for i in indices:
        ex = examples[i]
        req = task.hint_request(ex.problem, ex.solution or "")
        if len(req) > s.hint_max_request_tokens:
            too_long += 1
            continue
        requests[i] = req
        todo.append(i)
    for attempt in range(s.hint_retries + 1):
        if not todo:
            break
        got = sampler([requests[i] for i in todo], prompt_ids=dataset_ids[todo],
                      salt=1000 + attempt, num_samples=1, max_new_tokens=s.hint_max_new_tokens,
                      temperature=s.hint_temperature, top_p=1.0, top_k=0)
        failed = []
        for j, i in enumerate(todo):
            text = task.decode(got.tokens[j, 0, :got.lengths[j, 0]])
            hints = sage.parse_hints(text, ground_truth=examples[i].answer)
            if hints:
                out[i] = hints
            else:
                failed.append(i)
        todo = failed
    return out, {"too_long": too_long, "failed": len(todo)}


def _score(samples: Samples, rows: Sequence[int], examples, task: Task, scorer: Scorer,
           hints: dict[int, str | None]):
    """Rewards [rows, G] and texts of the samples; `hints[i]`: the hint row i was asked with."""
    texts = [[task.decode(samples.tokens[j, g, :samples.lengths[j, g]])
              for g in range(samples.tokens.shape[1])] for j in range(len(rows))]
    flat = [t for row in texts for t in row]
    gts = [ground_truth(task, examples[i], hints.get(i)) for i in rows
           for _ in range(samples.tokens.shape[1])]
    scores, _ = scorer(flat, gts)
    return np.asarray(scores, np.float32).reshape(len(rows), -1), texts


def _fit(samples: Samples, t: int) -> Samples:
    """Pads or crops the answer axis to t tokens."""
    pad = t - samples.tokens.shape[-1]
    if pad == 0:
        return samples
    if pad < 0:
        return Samples(samples.tokens[..., :t], np.minimum(samples.lengths, t),
                       samples.logprobs[..., :t])
    w = ((0, 0), (0, 0), (0, pad))
    return Samples(np.pad(samples.tokens, w), samples.lengths, np.pad(samples.logprobs, w))


def run(examples: Sequence[Example], dataset_ids: np.ndarray, *, task: Task,
        sampler: GroupSampler, scorer: Scorer, settings: RolloutSettings, tables: SageTables,
        step: int) -> Rollout:
    """Samples, scores and (per method) hints one step of prompts; updates `tables` in place."""
    s = settings
    b = len(examples)
    rows = np.arange(b)
    dataset_ids = np.asarray(dataset_ids)
    plain = [task.answer_prompt(ex.problem) for ex in examples]
    prompts = list(plain)
    level = np.zeros(b, np.int8)
    rnd = np.zeros(b, np.int8)
    hints: list[str | None] = [None] * b
    metrics: dict[str, float] = {}
    t_hint = t_resample = 0.0

    def sample(sel, ctx, salt):
        return _fit(sampler([ctx[i] for i in sel], prompt_ids=dataset_ids[sel], salt=salt,
                            num_samples=s.group_size, max_new_tokens=s.max_new_tokens,
                            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k),
                    s.max_new_tokens)

    payloads: dict[int, dict[int, str]] = {}
    write_failed = too_long = 0

    def get_payloads(need_rows):
        """Hint payloads for rows, from the source (writing them where the source says so)."""
        nonlocal write_failed, too_long
        t0 = time.perf_counter()
        to_write = []
        for i in need_rows:
            d = int(dataset_ids[i])
            if s.hint_source == "column":
                payloads[i] = _hint_payload_from_column(examples[i].hint)
                continue
            if s.hint_source == "reference":
                ex = examples[i]
                payloads[i] = (task.reference_hints(ex.problem, ex.solution, ex.answer)
                               if ex.solution else {})
                continue
            cached = tables.cached_hints(d)
            fresh = (tables.hint_step[d] >= 0 and (
                s.hint_source == "offline" or s.hint_refresh_every == 0
                or step - tables.hint_step[d] < s.hint_refresh_every))
            if cached and fresh:
                payloads[i] = cached
            elif examples[i].solution:
                to_write.append(i)
        if to_write:
            written, counts = write_hints(to_write, examples, task, sampler, s,
                                          dataset_ids=dataset_ids)
            write_failed += counts["failed"]
            too_long += counts["too_long"]
            for i in to_write:
                d = int(dataset_ids[i])
                if i in written:
                    tables.store_hints(d, written[i], step)
                    payloads[i] = written[i]
                else:  # keep the last good payload, if any
                    payloads[i] = tables.cached_hints(d)
        return time.perf_counter() - t0

    if s.method == "sage_light":
        seen = tables.seen[dataset_ids]
        want = sage.sage_light_levels(tables.hint_level[dataset_ids],
                                      tables.last_accuracy[dataset_ids], seen,
                                      low=s.light_low, high=s.light_high, max_level=s.max_level)
        need = [i for i in rows if want[i] > 0]
        metrics["hint/prompts_needing_hint"] = float(len(need))
        t_hint += get_payloads(need)
        for i in need:
            p = payloads.get(i, {})
            usable = [lvl for lvl in p if lvl <= want[i]]
            if usable:  # the wanted level, or the strongest one below it that exists
                lvl = max(usable)
                level[i], hints[i] = lvl, p[lvl]
                prompts[i] = task.hinted_prompt(examples[i].problem, p[lvl])
        tables.hint_level[dataset_ids] = want
    samples = sample(rows, prompts, salt=0)
    rewards, texts = _score(samples, rows, examples, task, scorer, dict(enumerate(hints)))
    st = sage.group_status(rewards, collapse_std=s.collapse_std,
                           success_threshold=s.success_threshold)
    metrics["collapse/frac_all_zero"] = float(st["all_zero"].mean())
    metrics["collapse/all_zero_groups"] = float(st["all_zero"].sum())
    metrics["collapse/frac_all_one"] = float(st["all_one"].mean())
    resolved = st["resolved"].copy()
    collapse = np.where(st["all_zero"], COLLAPSE_ALL_ZERO,
                        np.where(st["all_one"], COLLAPSE_ALL_ONE, COLLAPSE_MIXED)).astype(np.int8)

    if s.method in ("sage", "resample"):
        unresolved = [i for i in rows if not resolved[i]]
        if s.method == "sage":
            need = [i for i in unresolved if examples[i].solution or s.hint_source == "column"]
            metrics["hint/prompts_needing_hint"] = float(len(need))
            t_hint += get_payloads(need)
        t0 = time.perf_counter()
        for lvl in range(1, s.max_level + 1):
            if s.method == "sage":
                sel = [i for i in rows if not resolved[i] and lvl in payloads.get(i, {})]
            else:
                sel = [i for i in rows if not resolved[i]]
            if not sel:
                continue
            ctx = {i: (task.hinted_prompt(examples[i].problem, payloads[i][lvl])
                       if s.method == "sage" else plain[i]) for i in sel}
            got = sample(np.asarray(sel), ctx, salt=lvl)
            r, tx = _score(got, sel, examples, task, scorer,
                           {i: payloads[i][lvl] if s.method == "sage" else None
                            for i in sel})
            for j, i in enumerate(sel):  # replace the whole group
                samples.tokens[i], samples.lengths[i] = got.tokens[j], got.lengths[j]
                samples.logprobs[i] = got.logprobs[j]
                rewards[i], texts[i], rnd[i], prompts[i] = r[j], tx[j], lvl, ctx[i]
                if s.method == "sage":
                    level[i], hints[i] = lvl, payloads[i][lvl]
            resolved = sage.group_status(rewards, collapse_std=s.collapse_std,
                                         success_threshold=s.success_threshold)["resolved"]
            metrics[f"hint/used_level_{lvl}"] = float(len(sel))
        t_resample = time.perf_counter() - t0

    after = sage.group_status(rewards, collapse_std=s.collapse_std,
                              success_threshold=s.success_threshold)
    metrics["collapse/frac_all_zero_after"] = float(after["all_zero"].mean())
    hinted = rnd > 0
    metrics["hint/rescued"] = float((hinted & after["mixed"]).sum())
    metrics["hint/write_failed"] = float(write_failed)
    metrics["hint/request_too_long"] = float(too_long)
    metrics.setdefault("hint/prompts_needing_hint", 0.0)
    for lvl in sage.LEVELS:
        metrics.setdefault(f"hint/used_level_{lvl}", float((level == lvl).sum())
                           if s.method == "sage_light" else 0.0)
    for lvl in range(4):
        at = level == lvl
        metrics[f"hint/acc_level_{lvl}"] = float(rewards[at].mean()) if at.any() else float("nan")
    # Per-prompt tables: accuracy of the group that is trained on, solved-ever, seen.
    acc = (rewards > s.success_threshold).mean(axis=1)
    tables.last_accuracy[dataset_ids] = acc
    tables.ever_solved[dataset_ids] |= after["resolved"]
    tables.seen[dataset_ids] = True
    seen_total = tables.seen.sum()
    metrics["hint/frac_never_solved"] = float(
        (tables.seen & ~tables.ever_solved).sum() / max(seen_total, 1))
    metrics["time/hint_s"] = t_hint
    metrics["time/resample_s"] = t_resample
    return Rollout(prompts=prompts, plain_prompts=plain, samples=samples, rewards=rewards,
                   level=level, collapse=collapse, round=rnd, hints=hints, texts=texts,
                   metrics=metrics)
