"""One rollout phase: sample -> reward -> collapse -> hints -> re-sample, for every method.

Methods (`METHODS`, one small function each over the same pieces):
  grpo        one un-hinted group per prompt.
  sage        un-hinted groups; then for level 1, 2, 3 only the still-unresolved prompts that have a
              hint at that level get a fresh hinted group, which replaces their whole group.
  resample    the same escalation budget as sage (up to three fresh groups for unresolved
              prompts) but without hints: separates the hint's effect from extra samples.
  sage_light  a per-prompt level carried across epochs picks the hint before a single pass.

Rollouts stay shaped [B, G, ...]; a group is replaced whole, never mixed. Settings come from the
run's `cfg.rl` (sampling, collapse) and `cfg.hint` (the hint source and SAGE-light levels). The
sampler and the scorer are passed in, so tests can drive this with a scripted policy double.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from sage_jax.config import HintConfig, RLConfig
from sage_jax.core import sage
from sage_jax.core.sage import COLLAPSE_ALL_ONE, COLLAPSE_ALL_ZERO, COLLAPSE_MIXED
from sage_jax.infra.rewards import Scorer
from sage_jax.rl.types import GroupSampler, Rollout, SageTables, Samples
from sage_jax.tasks.base import Task
from sage_jax.tasks.data import Example




# ---- hint payloads from the source -----------------------------------------------------------

class HintSource:
    """Hint payloads {level: hint} for a step's rows, from `hint.source`: the data's `hint`
    column, the task's reference rule, or written by the policy (online: rewritten every
    `hint.refresh_every` steps; offline: once) and kept in the SAGE tables. Counts what
    writing did (`write_hints`' counts, and per level the hints written and those equal to the
    task's reference hint) and the time it spends."""

    def __init__(self, hint: HintConfig, *, examples: Sequence[Example], dataset_ids: np.ndarray,
                 task: Task, sampler: GroupSampler, tables: SageTables, step: int):
        self.hint, self.examples, self.ids = hint, examples, dataset_ids
        self.task, self.sampler, self.tables, self.step = task, sampler, tables, step
        # column and reference read hints; every other source has the policy write them, and
        # only offline keeps them for the run (auto a job's gate has not resolved writes online)
        self.source = hint.source
        self.payloads: dict[int, dict[int, str]] = {}
        self.written_text: dict[int, str] = {}  # row -> what the policy wrote this step
        self.counts: dict[str, int] = dict.fromkeys(
            ("requests", "too_long", "parsed", "leaked", "failed"), 0)
        self.written = np.zeros(4, np.int64)  # [level]: hints the policy wrote this step
        self.right = np.zeros(4, np.int64)  # [level]: of those, equal to the reference hint
        self.seconds = 0.0

    def has_solution(self, i: int) -> bool:
        """Whether row i can get a hint at all (a solution, or the data's hint column)."""
        return bool(self.examples[i].solution) or self.source == "column"

    def get(self, rows: Sequence[int]) -> dict[int, dict[int, str]]:
        """Fills `payloads` for `rows` (a row with nothing to hint from gets no entry or an
        empty one); returns it."""
        t0 = time.perf_counter()
        to_write = []
        for i in rows:
            ex = self.examples[i]
            if self.source == "column":
                self.payloads[i] = _hint_payload_from_column(ex.hint)
            elif self.source == "reference":
                self.payloads[i] = (self.task.reference_hints(ex.problem, ex.solution, ex.answer)
                                    if ex.solution else {})
            elif self._cached_is_fresh(int(self.ids[i])):
                self.payloads[i] = self.tables.cached_hints(int(self.ids[i]))
            elif ex.solution:
                to_write.append(i)
        if to_write:
            self._write(to_write)
        self.seconds += time.perf_counter() - t0
        return self.payloads

    def _cached_is_fresh(self, d: int) -> bool:
        every = self.hint.refresh_every
        return bool(self.tables.cached_hints(d)) and self.tables.hint_step[d] >= 0 and (
            self.source == "offline" or every == 0 or self.step - self.tables.hint_step[d] < every)

    def _write(self, rows: list[int]) -> None:
        written, counts, texts = write_hints(rows, self.examples, self.task, self.sampler,
                                             self.hint, dataset_ids=self.ids)
        self.written_text.update(texts)
        for k, v in counts.items():
            self.counts[k] += v
        for i in rows:
            d = int(self.ids[i])
            if i in written:
                ex = self.examples[i]
                assert ex.solution is not None, "get writes only rows with a solution"
                ref = self.task.reference_hints(ex.problem, ex.solution, ex.answer)
                for lvl, text in written[i].items():
                    self.written[lvl] += 1
                    self.right[lvl] += _same_text(text, ref.get(lvl))
                self.tables.store_hints(d, written[i], self.step)
                self.payloads[i] = written[i]
            else:  # keep the last good payload, if any
                self.payloads[i] = self.tables.cached_hints(d)


def _same_text(a: str, b: str | None) -> bool:
    """Equal up to whitespace."""
    return b is not None and " ".join(a.split()) == " ".join(b.split())


def _hint_payload_from_column(text: str | None) -> dict[int, str]:
    if not text:
        return {}
    parsed = sage.parse_hints(text)
    return parsed if parsed else {lvl: text.strip() for lvl in sage.LEVELS}


def write_hints(indices: Sequence[int], examples: Sequence[Example], task: Task,
                sampler: GroupSampler, hint: HintConfig, *, dataset_ids: np.ndarray
                ) -> tuple[dict[int, dict[int, str]], dict[str, int], dict[int, str]]:
    """The policy writes hints for each row in `indices`: every request of
    `task.hint_requests` (one per level, or one for all levels), batched, with `hint.retries`
    retries of the requests whose reply gave nothing usable, at `hint.temperature`.

    Returns {row: {level: hint}} for rows that got at least one level; counts: requests,
    too_long (requests over hint.max_request_tokens, not sent), parsed (requests whose reply
    gave a usable hint), leaked (levels refused for giving the answer away, over all attempts),
    failed (rows with no usable level); and {row: the replies of its last attempts, one line
    per request}.
    """
    out: dict[int, dict[int, str]] = {}
    replies: dict[tuple[int, int], str] = {}
    counts = {"requests": 0, "too_long": 0, "parsed": 0, "leaked": 0}
    requests: dict[tuple[int, int], list[int]] = {}
    for i in indices:
        ex = examples[i]
        for level, req in task.hint_requests(ex.problem, ex.solution or "").items():
            counts["requests"] += 1
            if len(req) > hint.max_request_tokens:
                counts["too_long"] += 1
            else:
                requests[(i, level)] = req
    todo = list(requests)
    for attempt in range(hint.retries + 1):
        if not todo:
            break
        got = sampler([requests[r] for r in todo], prompt_ids=dataset_ids[[i for i, _ in todo]],
                      salt=1000 + attempt, num_samples=1, max_new_tokens=hint.max_new_tokens,
                      temperature=hint.temperature, top_p=1.0, top_k=0)
        failed = []
        for j, (i, level) in enumerate(todo):
            text = replies[(i, level)] = task.decode(got.tokens[j, 0, :got.lengths[j, 0]])
            hints, leaked = task.read_hints(text, level, examples[i].answer)
            counts["leaked"] += leaked
            if hints:
                out.setdefault(i, {}).update(hints)
                counts["parsed"] += 1
            else:
                failed.append((i, level))
        todo = failed
    counts["failed"] = sum(1 for i in indices if i not in out)
    texts = {i: "\n".join(t for (r, _), t in sorted(replies.items()) if r == i)
             for i in {r for r, _ in replies}}
    return {i: dict(sorted(h.items())) for i, h in out.items()}, counts, texts


# ---- the groups of one step ------------------------------------------------------------------

def _score(samples: Samples, rows: Sequence[int], examples, task: Task, scorer: Scorer,
           hints: dict[int, str | None]):
    """Rewards [rows, G] and texts of the samples; `hints[i]`: the hint row i was asked with."""
    texts = [[task.decode(samples.tokens[j, g, :samples.lengths[j, g]])
              for g in range(samples.tokens.shape[1])] for j in range(len(rows))]
    flat = [t for row in texts for t in row]
    gts = [task.reference(examples[i].problem, examples[i].answer, hints.get(i)) for i in rows
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


@dataclasses.dataclass
class _Step:
    """One step's groups while they are sampled, re-sampled and hinted (host arrays [B, ...])."""

    examples: Sequence[Example]
    ids: np.ndarray  # dataset ids [B]
    task: Task
    sampler: GroupSampler
    scorer: Scorer
    rl: RLConfig
    plain: list[list[int]]
    prompts: list[list[int]]
    level: np.ndarray  # int8 [B]
    rnd: np.ndarray  # int8 [B]
    hints: list[str | None]
    metrics: dict[str, float]
    samples: Samples | None = None
    rewards: np.ndarray | None = None
    texts: list[list[str]] | None = None
    collapse: np.ndarray | None = None
    # re-sample keys: (salt=level, the prompt's id), or folded (salt FOLDED_SALT, the prompt's
    # id * LEVEL_STRIDE + level: one call can then hold every level; `hint.escalation`)
    folded_keys: bool = False
    # seconds per phase of `infra.phases.PHASES` that the rollout runs (without "time/", "_s")
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def timed(self, phase: str, t0: float) -> None:
        """Adds the time since `t0` to `phase`."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    @classmethod
    def start(cls, examples: Sequence[Example], ids: np.ndarray, *, task: Task,
              sampler: GroupSampler, scorer: Scorer, rl: RLConfig) -> "_Step":
        b = len(examples)
        plain = [task.answer_prompt(ex.problem) for ex in examples]
        return cls(examples, np.asarray(ids), task, sampler, scorer, rl, plain, list(plain),
                   np.zeros(b, np.int8), np.zeros(b, np.int8), [None] * b, {})

    def sample(self, rows: Sequence[int], prompts: dict | list, salt: int,
               prompt_ids: np.ndarray | None = None) -> Samples:
        """G answers for each row of `rows` (prompts[row]); keys from `salt` and `prompt_ids`
        (default: the rows' dataset ids)."""
        rl = self.rl
        ids = self.ids[np.asarray(rows)] if prompt_ids is None else prompt_ids
        got = self.sampler([prompts[i] for i in rows], prompt_ids=ids, salt=salt, num_samples=rl.group_size,
                           max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                           top_p=rl.top_p, top_k=rl.top_k)
        return _fit(got, rl.max_new_tokens)

    def status(self) -> dict[str, np.ndarray]:
        assert self.rewards is not None, "first_pass sets the rewards"
        return sage.group_status(self.rewards, collapse_std=self.rl.collapse_std,
                                 success_threshold=self.rl.success_threshold)

    def unresolved(self) -> list[int]:
        resolved = self.status()["resolved"]
        return [i for i in range(len(self.examples)) if not resolved[i]]

    def replace(self, i: int, got: Samples, j: int, rewards, texts, prompt, rnd: int) -> None:
        """Row i's whole group becomes row j of `got`."""
        assert self.samples is not None and self.rewards is not None and self.texts is not None
        self.samples.tokens[i], self.samples.lengths[i] = got.tokens[j], got.lengths[j]
        self.samples.logprobs[i] = got.logprobs[j]
        self.rewards[i], self.texts[i], self.rnd[i], self.prompts[i] = (
            rewards[j], texts[j], rnd, prompt)


def first_pass(g: _Step) -> None:
    """One group per prompt with its current context; records the first-pass status."""
    rows = list(range(len(g.examples)))
    t0 = time.perf_counter()
    g.samples = g.sample(rows, g.prompts, salt=0)
    g.timed("first_sample", t0)
    t0 = time.perf_counter()
    g.rewards, g.texts = _score(g.samples, rows, g.examples, g.task, g.scorer,
                                dict(enumerate(g.hints)))
    g.timed("first_reward", t0)
    st = g.status()
    g.metrics["collapse/frac_all_zero"] = float(st["all_zero"].mean())
    g.metrics["collapse/all_zero_groups"] = float(st["all_zero"].sum())
    g.metrics["collapse/frac_all_one"] = float(st["all_one"].mean())
    g.collapse = np.where(st["all_zero"], COLLAPSE_ALL_ZERO, np.where(
        st["all_one"], COLLAPSE_ALL_ONE, COLLAPSE_MIXED)).astype(np.int8)


FOLDED_SALT = 4  # re-sample salt of folded keys (first pass 0, levels 1-3, hint writing 1000+)
LEVEL_STRIDE = 4  # folded keys: prompt id * LEVEL_STRIDE + level


def _resample_keys(g: _Step, rows: Sequence[int], lvl: int) -> tuple[int, np.ndarray]:
    """(salt, prompt ids) of the fresh groups of `rows` at level `lvl`."""
    ids = g.ids[np.asarray(rows)]
    if g.folded_keys:
        return FOLDED_SALT, ids.astype(np.int64) * LEVEL_STRIDE + lvl
    return lvl, ids


HintOf = Callable[[int, int], "str | None"]  # (row, level) -> that level's hint, None: none


def _wanted(g: _Step, lvl: int, hint_of: HintOf | None) -> list[int]:
    """The still-unresolved rows that get a fresh group at level `lvl`."""
    return [i for i in g.unresolved() if hint_of is None or hint_of(i, lvl) is not None]


def escalate(g: _Step, lvl: int, hint_of: HintOf | None) -> None:
    """Round `lvl`: every still-unresolved prompt (with a level-`lvl` hint, when `hint_of` is
    given) gets a fresh group, which replaces its whole group."""
    sel = _wanted(g, lvl, hint_of)
    if not sel:
        return
    t0 = time.perf_counter()
    hint = {i: None if hint_of is None else hint_of(i, lvl) for i in sel}
    ctx = {i: _context(g, i, hint[i]) for i in sel}
    salt, ids = _resample_keys(g, sel, lvl)
    _keep(g, lvl, sel, g.sample(sel, ctx, salt=salt, prompt_ids=ids), hint, ctx)
    g.timed(f"resample_level_{lvl}", t0)


def escalate_speculative(g: _Step, max_level: int, hint_of: HintOf | None) -> None:
    """Every level of every unresolved prompt (with a hint at that level) sampled in one call
    with folded keys, then kept level by level exactly as `escalate` keeps them: a level's
    groups are scored and replace their prompt's group only while it is unresolved. The one
    call's time counts to level 1."""
    g.folded_keys = True
    first = g.unresolved()
    todo = [(i, lvl) for lvl in range(1, max_level + 1) for i in first
            if hint_of is None or hint_of(i, lvl) is not None]
    if not todo:
        return
    t0 = time.perf_counter()
    hint = {(i, lvl): None if hint_of is None else hint_of(i, lvl) for i, lvl in todo}
    ctx = {(i, lvl): _context(g, i, hint[(i, lvl)]) for i, lvl in todo}
    ids = np.concatenate([_resample_keys(g, [i], lvl)[1] for i, lvl in todo])
    got = g.sample(list(range(len(todo))), [ctx[r] for r in todo], salt=FOLDED_SALT,
                   prompt_ids=ids)
    g.timed("resample_level_1", t0)
    at = {r: j for j, r in enumerate(todo)}
    for lvl in range(1, max_level + 1):
        sel = [i for i in _wanted(g, lvl, hint_of) if (i, lvl) in at]
        if not sel:
            continue
        t0 = time.perf_counter()
        j = np.asarray([at[(i, lvl)] for i in sel])
        _keep(g, lvl, sel, Samples(got.tokens[j], got.lengths[j], got.logprobs[j]),
              {i: hint[(i, lvl)] for i in sel}, {i: ctx[(i, lvl)] for i in sel})
        g.timed(f"resample_level_{lvl}", t0)


def _keep(g: _Step, lvl: int, sel: list[int], got: Samples, hint: dict, ctx: dict) -> None:
    """Scores `got` (row j: row sel[j]'s fresh group at level `lvl`) and makes each row's
    fresh group its group."""
    rewards, texts = _score(got, sel, g.examples, g.task, g.scorer, hint)
    for j, i in enumerate(sel):
        g.replace(i, got, j, rewards, texts, ctx[i], lvl)
        if hint[i] is not None:
            g.level[i], g.hints[i] = lvl, hint[i]
    g.metrics[f"hint/used_level_{lvl}"] = float(len(sel))


def escalate_all(g: _Step, hint: HintConfig, hint_of: HintOf | None) -> None:
    """Levels 1..hint.max_level, as `hint.escalation` says."""
    if hint.escalation == "speculative":
        escalate_speculative(g, hint.max_level, hint_of)
        return
    for lvl in range(1, hint.max_level + 1):
        escalate(g, lvl, hint_of)


def _context(g: _Step, i: int, hint: str | None) -> list[int]:
    """Row i's prompt: the bare one, or with `hint`."""
    return g.plain[i] if hint is None else g.task.hinted_prompt(g.examples[i].problem, hint)


# ---- the methods -----------------------------------------------------------------------------

def _grpo(g: _Step, source: HintSource, tables: SageTables, hint: HintConfig) -> None:
    first_pass(g)


def _resample(g: _Step, source: HintSource, tables: SageTables, hint: HintConfig) -> None:
    first_pass(g)
    escalate_all(g, hint, None)


def _sage(g: _Step, source: HintSource, tables: SageTables, hint: HintConfig) -> None:
    first_pass(g)
    need = [i for i in g.unresolved() if source.has_solution(i)]
    g.metrics["hint/prompts_needing_hint"] = float(len(need))
    payloads = source.get(need)
    escalate_all(g, hint, lambda i, lvl: payloads.get(i, {}).get(lvl))


def _sage_light(g: _Step, source: HintSource, tables: SageTables, hint: HintConfig
                ) -> None:
    ids = g.ids
    want = sage.sage_light_levels(tables.hint_level[ids], tables.last_accuracy[ids],
                                  tables.seen[ids], low=hint.low, high=hint.high,
                                  max_level=hint.max_level)
    need = [i for i in range(len(ids)) if want[i] > 0]
    g.metrics["hint/prompts_needing_hint"] = float(len(need))
    payloads = source.get(need)
    for i in need:
        usable = [lvl for lvl in payloads.get(i, {}) if lvl <= want[i]]
        if usable:  # the wanted level, or the strongest one below it that exists
            lvl = max(usable)
            g.level[i], g.hints[i] = lvl, payloads[i][lvl]
            g.prompts[i] = g.task.hinted_prompt(g.examples[i].problem, payloads[i][lvl])
    tables.hint_level[ids] = want
    first_pass(g)
    for lvl in sage.LEVELS:
        g.metrics[f"hint/used_level_{lvl}"] = float((g.level == lvl).sum())


METHODS = {"grpo": _grpo, "resample": _resample, "sage": _sage, "sage_light": _sage_light}


# ---- one step ----------------------------------------------------------------------------------

def run(examples: Sequence[Example], dataset_ids: np.ndarray, *, task: Task,
        sampler: GroupSampler, scorer: Scorer, rl: RLConfig, hint: HintConfig,
        tables: SageTables, step: int) -> Rollout:
    """Samples, scores and (per `rl.method`) hints one step of prompts, with the settings of
    `rl` (cfg.rl) and `hint` (cfg.hint); updates `tables` in place."""
    t0 = time.perf_counter()
    g = _Step.start(examples, dataset_ids, task=task, sampler=sampler, scorer=scorer, rl=rl)
    source = HintSource(hint, examples=examples, dataset_ids=g.ids, task=task, sampler=sampler,
                        tables=tables, step=step)
    METHODS[rl.method](g, source, tables, hint)
    after = g.status()
    _record(g, source, after, tables)
    _record_time(g, source, time.perf_counter() - t0)
    assert g.samples is not None and g.rewards is not None and g.texts is not None
    assert g.collapse is not None, "first_pass sets the collapse status"
    return Rollout(prompts=g.prompts, plain_prompts=g.plain, samples=g.samples,
                   rewards=g.rewards, level=g.level, collapse=g.collapse, round=g.rnd,
                   hints=g.hints, texts=g.texts, metrics=g.metrics,
                   hint_written=[source.written_text.get(i) for i in range(len(examples))])


def _record(g: _Step, source: HintSource, after: dict, tables: SageTables) -> None:
    """The step's hint and collapse metrics, and the per-prompt tables (accuracy of the group
    that is trained on, solved-ever, seen)."""
    m, rewards = g.metrics, g.rewards
    assert rewards is not None, "first_pass sets the rewards"
    m["collapse/frac_all_zero_after"] = float(after["all_zero"].mean())
    m["hint/rescued"] = float(((g.rnd > 0) & after["mixed"]).sum())
    m["hint/write_failed"] = float(source.counts["failed"])
    m["hint/request_too_long"] = float(source.counts["too_long"])
    m["hint/requests"] = float(source.counts["requests"])
    m["hint/requests_parsed"] = float(source.counts["parsed"])
    m["hint/leaked"] = float(source.counts["leaked"])
    for lvl in sage.LEVELS:
        m[f"hint/written_level_{lvl}"] = float(source.written[lvl])
        m[f"hint/right_level_{lvl}"] = float(source.right[lvl])
    m.setdefault("hint/prompts_needing_hint", 0.0)
    for lvl in sage.LEVELS:
        m.setdefault(f"hint/used_level_{lvl}", 0.0)
    for lvl in range(4):
        at = g.level == lvl
        m[f"hint/acc_level_{lvl}"] = float(rewards[at].mean()) if at.any() else float("nan")
    ids = g.ids
    tables.last_accuracy[ids] = (rewards > g.rl.success_threshold).mean(axis=1)
    tables.ever_solved[ids] |= after["resolved"]
    tables.seen[ids] = True
    m["hint/frac_never_solved"] = float(
        (tables.seen & ~tables.ever_solved).sum() / max(tables.seen.sum(), 1))


def _record_time(g: _Step, source: HintSource, total: float) -> None:
    """The rollout's phases (`infra.phases.PHASES`): first pass, hint writing, each re-sample
    level, and the rest of `total` as host work; `time/resample_s` sums the levels."""
    m, sec = g.metrics, {"first_sample": 0.0, "first_reward": 0.0, **g.seconds}
    levels = [sec.get(f"resample_level_{lvl}", 0.0) for lvl in sage.LEVELS]
    for lvl, s in zip(sage.LEVELS, levels):
        m[f"time/resample_level_{lvl}_s"] = s
    m["time/first_sample_s"], m["time/first_reward_s"] = sec["first_sample"], sec["first_reward"]
    m["time/hint_s"] = source.seconds
    m["time/resample_s"] = float(sum(levels))
    m["time/rollout_host_s"] = total - sum(sec.values()) - source.seconds
