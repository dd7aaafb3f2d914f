"""Hint-free evaluation of a policy: avg@k / pass@k / answer lengths per benchmark, the paper's
six-benchmark average, and the console table. `python -m sage_jax.evaluate` (see there) drives it
for a model folder or a run's checkpoint; the trainer calls `evaluate_problems` for in-training
validation.
"""


from __future__ import annotations

import dataclasses
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from sage_jax.rl.types import RolloutEngine
from sage_jax.infra.rewards import Scorer
from sage_jax.tasks.benchmarks import ALL_BENCHMARKS, BENCHMARKS, Problem, load_benchmark
from sage_jax.tasks.hub_benchmarks import load_hub_benchmark


# ---- problems ---------------------------------------------------------------------------------

def load_problems(names: Sequence[str], data_dir: str | Path | None, *, limit: int | None = None,
                  layout: str = "auto") -> dict[str, list[Problem]]:
    """{benchmark: its problems (the first `limit`)} for benchmark names of `ALL_BENCHMARKS`, read
    from `data_dir`, or without one from their Hub datasets (`tasks.hub_benchmarks`)."""
    if not names:
        raise ValueError("no benchmarks to evaluate")
    unknown = [n for n in names if n not in ALL_BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; known: "
                         f"{', '.join(ALL_BENCHMARKS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark listed twice in {', '.join(names)}")
    if data_dir is None:
        return {name: load_hub_benchmark(name, limit=limit) for name in names}
    return {name: load_benchmark(name, data_dir, layout=layout, limit=limit) for name in names}


def problem_id(benchmark: str, index: int) -> int:
    """A stable int32 id of a problem, the sampler's PRNG stream id: a problem's samples do not
    depend on which other problems share its batch, on --batch-size or on --limit."""
    return ((zlib.crc32(benchmark.encode()) % 20_000) * 100_000 + index) % (2 ** 31)


# ---- metrics ----------------------------------------------------------------------------------

def aggregate(scores_BxG, lengths_BxG, truncated_BxG) -> dict[str, float]:
    """One benchmark's metrics from its B problems x G samples (G = k).

    avg@k: mean score over all samples (= mean over problems of the per-problem accuracy);
    pass@k: share of problems with at least one sample scoring > 0; mean_length: mean tokens per
    answer; truncated_frac: share of answers cut off at the token budget.
    """
    scores = np.asarray(scores_BxG, np.float64)
    if scores.ndim != 2 or scores.size == 0:
        raise ValueError(f"scores must be [N problems, k samples] with N, k >= 1, got shape "
                         f"{scores.shape}")
    lengths = np.asarray(lengths_BxG, np.float64)
    truncated = np.asarray(truncated_BxG, bool)
    if lengths.shape != scores.shape or truncated.shape != scores.shape:
        raise ValueError(f"scores {scores.shape}, lengths {lengths.shape} and truncated "
                         f"{truncated.shape} must have the same shape")
    n, k = scores.shape
    return {"n": int(n), "k": int(k), "avg@k": float(scores.mean()),
            "pass@k": float((scores > 0).any(axis=1).mean()),
            "mean_length": float(lengths.mean()), "truncated_frac": float(truncated.mean())}


def paper_average(per_benchmark: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """Unweighted mean of avg@k, pass@k, mean length and truncated share over the paper's six
    benchmarks that are present (None when none is); `complete` says whether all six are."""
    names = [b for b in BENCHMARKS if b in per_benchmark]
    if not names:
        return None
    mean = {key: float(np.mean([per_benchmark[b][key] for b in names]))
            for key in ("avg@k", "pass@k", "mean_length", "truncated_frac")}
    return {"benchmarks": names, "complete": len(names) == len(BENCHMARKS),
            "n": int(sum(per_benchmark[b]["n"] for b in names)),
            "k": per_benchmark[names[0]]["k"], **mean}


# ---- the evaluation loop ----------------------------------------------------------------------

def evaluate_problems(engine: RolloutEngine, task,
                      problems_by_benchmark: Mapping[str, Sequence[Problem]], *, k: int,
                      temperature: float, top_p: float, max_new_tokens: int, key,
                      scorer: Scorer, top_k: int = 0, batch_size: int = 64,
                      progress: bool = False, keep_samples: bool = False) -> dict[str, Any]:
    """Samples k hint-free answers per problem with the policy and scores them.

    Args:
      engine: the `RolloutEngine` that samples, synced to the policy (e.g.
        `rl.engines.NativeEngine(*models.split(model), eos_ids=..., pad_id=...)`, or a run's).
      task: a `tasks.base.Task` (`MathTask`, `ToyTask`): its answer prompt, decoding, reference
        and answer extraction. Hints are never used.
      problems_by_benchmark: {benchmark name: problems}, e.g. from `load_problems`.
      k, temperature, top_p, top_k, max_new_tokens: sampling settings (paper: 16, 0.6, 0.95, 0).
      key: PRNG key. The samples of a problem depend only on (key, benchmark, problem index).
      scorer: `scorer(responses, ground_truths) -> (scores [N], stats)`, e.g. `RewardPool.score`
        of the task's reward.
      batch_size: prompts per sampler call (each call has batch_size * k rows); problems of all
        benchmarks are sorted by prompt length and batched together.
      progress: show a progress bar (tqdm, with ETA) on stderr.
      keep_samples: also return every completion.

    Returns a dict:
      "benchmarks": {name: {"n", "k", "avg@k", "pass@k", "mean_length", "truncated_frac"}}
        (fractions in [0, 1], lengths in tokens), in the order of `problems_by_benchmark`;
      "average": `paper_average` of them (None when none of the paper's six is present);
      "reward_stats": the scorer's summed counts (timeouts, errors, ...);
      "generated_tokens", "time_s";
      "samples" (with keep_samples): one dict per completion, ordered by benchmark, problem and
        sample: benchmark, index, sample, problem, answer (ground truth), completion, extracted,
        score, length, truncated.
    `eval_metrics(result)` flattens it into `eval/<benchmark>/avg@k`-style scalars for logging.
    """
    items = _items(problems_by_benchmark, k=k, batch_size=batch_size,
                   max_new_tokens=max_new_tokens)
    prompts = [task.answer_prompt(p.problem) for _, p in items]
    order = sorted(range(len(items)), key=lambda i: -len(prompts[i]))  # longest first: OOM early
    eos_ids = tuple(int(e) for e in task.eos_ids)
    got = _Scored.empty(len(items), k)
    t0 = time.perf_counter()
    bar = tqdm(total=len(items), unit="problem", desc="eval", file=sys.stderr,
               dynamic_ncols=True) if progress else None

    def launch(chunk):
        ids = np.asarray([problem_id(items[i][0], items[i][1].index) for i in chunk], np.int32)
        return engine.sample([prompts[i] for i in chunk], key=key, prompt_ids=ids,
                             num_samples=k, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, top_k=top_k)

    def finish(chunk, out):  # the engine returns host arrays: nothing overlaps
        got.add(chunk, np.asarray(out.tokens), np.asarray(out.lengths), task=task,
                problems=[items[i][1] for i in chunk], scorer=scorer,
                max_new_tokens=max_new_tokens, eos_ids=eos_ids)
        if bar is not None:
            bar.set_postfix_str(f"avg@{k}={got.running_mean():.3f}", refresh=False)
            bar.update(len(chunk))

    try:
        for chunk in (order[i:i + batch_size] for i in range(0, len(order), batch_size)):
            finish(chunk, launch(chunk))
    finally:
        if bar is not None:
            bar.close()
    result = got.result(problems_by_benchmark, seconds=time.perf_counter() - t0)
    if keep_samples:
        result["samples"] = got.samples(items, task)
    return result


def _items(problems_by_benchmark, *, k, batch_size, max_new_tokens) -> list[tuple[str, Problem]]:
    """[(benchmark, problem)] in order; a ValueError for settings or benchmarks that are empty."""
    if k < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"k ({k}), batch_size ({batch_size}) and max_new_tokens "
                         f"({max_new_tokens}) must all be >= 1")
    items = [(name, p) for name, problems in problems_by_benchmark.items() for p in problems]
    if not items:
        raise ValueError("no problems to evaluate")
    empty = [name for name, problems in problems_by_benchmark.items() if not problems]
    if empty:
        raise ValueError(f"benchmark(s) with no problems: {', '.join(empty)}")
    return items


@dataclasses.dataclass
class _Scored:
    """Per problem (rows in `items` order) x sample: score, length, truncated, text."""

    scores: np.ndarray  # float32 [P, G]
    lengths: np.ndarray  # int32 [P, G]
    truncated: np.ndarray  # bool [P, G]
    texts: list[list[str]]
    reward_stats: dict[str, int]
    done: list[int]  # rows scored so far

    @classmethod
    def empty(cls, n: int, k: int) -> "_Scored":
        return cls(np.zeros((n, k), np.float32), np.zeros((n, k), np.int32),
                   np.zeros((n, k), bool), [[] for _ in range(n)], {}, [])

    def add(self, rows, tok_BxGxT, len_BxG, *, task, problems, scorer, max_new_tokens,
            eos_ids) -> None:
        """Decodes and scores the samples of `rows` (whose problems are `problems`)."""
        k = len_BxG.shape[1]
        responses, truths = [], []
        for r, (i, p) in enumerate(zip(rows, problems)):
            self.texts[i] = [task.decode(tok_BxGxT[r, g, :len_BxG[r, g]].tolist())
                             for g in range(k)]
            responses += self.texts[i]
            truths += [task.reference(p.problem, p.answer)] * k
        got, stats = scorer(responses, truths)
        for name, value in (stats or {}).items():
            if name != "n":
                self.reward_stats[name] = self.reward_stats.get(name, 0) + int(value)
        last = np.take_along_axis(tok_BxGxT, np.maximum(len_BxG - 1, 0)[..., None], -1)[..., 0]
        self.scores[rows] = np.asarray(got, np.float32).reshape(len(rows), k)
        self.lengths[rows] = len_BxG
        self.truncated[rows] = (len_BxG >= max_new_tokens) & ~np.isin(last, eos_ids)
        self.done += list(rows)

    def running_mean(self) -> float:
        return float(self.scores[self.done].mean())

    def result(self, problems_by_benchmark, *, seconds: float) -> dict[str, Any]:
        per_benchmark, start = {}, 0
        for name, problems in problems_by_benchmark.items():
            sl = slice(start, start + len(problems))
            per_benchmark[name] = aggregate(self.scores[sl], self.lengths[sl],
                                            self.truncated[sl])
            start += len(problems)
        return {"benchmarks": per_benchmark, "average": paper_average(per_benchmark),
                "reward_stats": self.reward_stats,
                "generated_tokens": int(self.lengths.sum()), "time_s": seconds}

    def samples(self, items, task) -> list[dict]:
        return [{"benchmark": name, "index": p.index, "sample": g, "problem": p.problem,
                 "answer": p.answer, "completion": self.texts[i][g],
                 "extracted": task.extract_answer(self.texts[i][g]),
                 "score": float(self.scores[i, g]), "length": int(self.lengths[i, g]),
                 "truncated": bool(self.truncated[i, g])}
                for i, (name, p) in enumerate(items) for g in range(self.scores.shape[1])]


def eval_metrics(result: Mapping[str, Any], prefix: str = "eval") -> dict[str, float]:
    """Flat scalars of an `evaluate_problems` result for a metrics logger:
    `{prefix}/<benchmark>/avg@<k>`, `.../pass@<k>`, `.../mean_length`, `.../truncated_frac`, and
    the same under `{prefix}/paper_avg/` when any of the paper's six was evaluated."""
    out = {}
    rows = dict(result["benchmarks"])
    if result.get("average"):
        rows["paper_avg"] = result["average"]
    for name, m in rows.items():
        k = m["k"]
        out[f"{prefix}/{name}/avg@{k}"] = m["avg@k"]
        out[f"{prefix}/{name}/pass@{k}"] = m["pass@k"]
        out[f"{prefix}/{name}/mean_length"] = m["mean_length"]
        out[f"{prefix}/{name}/truncated_frac"] = m["truncated_frac"]
    return out


def format_table(result: Mapping[str, Any]) -> str:
    """The console table: benchmark, n, avg@k and pass@k (%), mean length, truncated (%)."""
    per = result["benchmarks"]
    k = next(iter(per.values()))["k"]
    head = ("benchmark", "n", f"avg@{k} %", f"pass@{k} %", "mean len", "truncated %")
    rows = [(name, str(m["n"]), f"{100 * m['avg@k']:.1f}", f"{100 * m['pass@k']:.1f}",
             f"{m['mean_length']:.1f}", f"{100 * m['truncated_frac']:.1f}")
            for name, m in per.items()]
    avg = result.get("average")
    footer = []
    if avg:
        label = ("paper avg (6)" if avg["complete"]
                 else f"paper avg ({len(avg['benchmarks'])}/{len(BENCHMARKS)})")
        footer = [(label, str(avg["n"]), f"{100 * avg['avg@k']:.1f}",
                   f"{100 * avg['pass@k']:.1f}", f"{avg['mean_length']:.1f}",
                   f"{100 * avg['truncated_frac']:.1f}")]
    widths = [max(len(r[c]) for r in [head, *rows, *footer]) for c in range(len(head))]

    def line(r):
        return "  ".join(r[0].ljust(widths[0]) if c == 0 else r[c].rjust(widths[c])
                         for c in range(len(r)))

    rule = "  ".join("-" * w for w in widths)
    out = [line(head), rule, *map(line, rows)]
    if footer:
        out += [rule, line(footer[0])]
    return "\n".join(out)
