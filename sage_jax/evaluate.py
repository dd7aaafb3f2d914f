"""`python -m sage_jax.evaluate`: hint-free avg@k / pass@k of a policy on math benchmarks.

    python -m sage_jax.evaluate --model HF_DIR --data-dir ../shared/data            # paper's six
    python -m sage_jax.evaluate --checkpoint runs/x --data-dir DATA --benchmarks math500,gsm8k
    python -m sage_jax.evaluate --checkpoint runs/x/200 --k 4 --limit 20 --max-new-tokens 1024

The model is a Hugging Face folder (`--model`) or a training run folder (`--checkpoint
WORKDIR[/STEP]`, latest step by default). Prompts are the training answer prompt (a system
instruction to reason step by step and box the answer, then the problem, through the model's chat
template) and never carry a hint. Each problem is sampled k times (paper: k=16 at temperature 0.6,
top-p 0.95); a sample scores 1 when its last `\\boxed{}` is equivalent to the ground truth.

Per benchmark: avg@k (mean accuracy over the k samples of every problem, the paper's number),
pass@k (share of problems with at least one correct sample), mean answer length in tokens (EOS
included) and the share of answers cut off at --max-new-tokens. The "paper avg" row is the mean
over the paper's six benchmarks (AIME24, AIME25, AMC23, MATH-500, Minerva, OlympiadBench) that
were evaluated. Outputs in --out: results.json, samples.jsonl (every completion with its
extracted answer and score) and table.txt.

A checkpoint of a toy-task run is evaluated on held-out problems of the toy task (benchmark
"toy"). For in-training validation the trainer calls `evaluate_problems` (see there).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sage_jax.rewards import extract_boxed
from sage_jax.tasks.benchmarks import ALL_BENCHMARKS, BENCHMARKS, Problem, load_benchmark
from sage_jax.tasks.base import ground_truth

__all__ = ["TOY_BENCHMARK", "aggregate", "eval_metrics", "evaluate_problems", "extract_answer",
           "format_table", "load_problems", "main", "paper_average", "problem_id", "toy_problems"]

TOY_BENCHMARK = "toy"
TOY_EVAL_PROBLEMS = 256  # size of the toy task's held-out evaluation set
TOY_EVAL_SEED = 31_337  # differs from the training (train.seed) and calibration (10_000+) seeds

Scorer = Callable[[Sequence[str], Sequence[str]], tuple[np.ndarray, Mapping[str, int]]]


# ---- problems ---------------------------------------------------------------------------------

def load_problems(names: Sequence[str], data_dir: str | Path | None, *, limit: int | None = None,
                  layout: str = "auto") -> dict[str, list[Problem]]:
    """{benchmark: its problems (the first `limit`)} for benchmark names of `ALL_BENCHMARKS` or
    "toy" (the toy task's held-out problems, which need no data folder)."""
    if not names:
        raise ValueError("no benchmarks to evaluate")
    unknown = [n for n in names if n not in ALL_BENCHMARKS + (TOY_BENCHMARK,)]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; known: "
                         f"{', '.join(ALL_BENCHMARKS + (TOY_BENCHMARK,))}")
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark listed twice in {', '.join(names)}")
    out = {}
    for name in names:
        if name == TOY_BENCHMARK:
            out[name] = toy_problems(limit=limit)
            continue
        if data_dir is None:
            raise ValueError(
                "no benchmark data folder: pass --data-dir (or set eval.data_dir), the folder "
                "that holds eval/<name>/test.jsonl or eval_verl/<name>.parquet")
        out[name] = load_benchmark(name, data_dir, layout=layout, limit=limit)
    return out


def toy_problems(n: int = TOY_EVAL_PROBLEMS, *, limit: int | None = None) -> list[Problem]:
    """Held-out problems of the built-in toy task, on its RL length distribution."""
    from sage_jax.tasks import toy
    n = n if limit is None else min(n, limit)
    return [Problem(problem=ex.problem, answer=ex.answer, index=ex.index, source=TOY_BENCHMARK)
            for ex in toy.make_examples(n, toy.RL_SPEC, seed=TOY_EVAL_SEED)]


def problem_id(benchmark: str, index: int) -> int:
    """A stable int32 id of a problem, the sampler's PRNG stream id: a problem's samples do not
    depend on which other problems share its batch, on --batch-size or on --limit."""
    return ((zlib.crc32(benchmark.encode()) % 20_000) * 100_000 + index) % (2 ** 31)


# ---- metrics ----------------------------------------------------------------------------------

def aggregate(scores_NxK, lengths_NxK, truncated_NxK) -> dict[str, float]:
    """One benchmark's metrics from its N problems x k samples.

    avg@k: mean score over all samples (= mean over problems of the per-problem accuracy);
    pass@k: share of problems with at least one sample scoring > 0; mean_length: mean tokens per
    answer; truncated_frac: share of answers cut off at the token budget.
    """
    scores = np.asarray(scores_NxK, np.float64)
    if scores.ndim != 2 or scores.size == 0:
        raise ValueError(f"scores must be [N problems, k samples] with N, k >= 1, got shape "
                         f"{scores.shape}")
    lengths = np.asarray(lengths_NxK, np.float64)
    truncated = np.asarray(truncated_NxK, bool)
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


_TOY_ANSWER_RE = re.compile(r"A:(\d+)")


def extract_answer(task, text: str) -> str | None:
    """The answer a completion gives, as its task's reward reads it (None: no answer found)."""
    if getattr(task, "reward_name", "math") == "toy":
        found = _TOY_ANSWER_RE.findall(text)
        return found[-1] if found else None
    return extract_boxed(text)


# ---- the evaluation loop ----------------------------------------------------------------------

def evaluate_problems(graphdef, params, task,
                      problems_by_benchmark: Mapping[str, Sequence[Problem]], *, k: int,
                      temperature: float, top_p: float, max_new_tokens: int, key,
                      scorer: Scorer, top_k: int = 0, batch_size: int = 64,
                      progress: bool = False, keep_samples: bool = False) -> dict[str, Any]:
    """Samples k hint-free answers per problem with the policy and scores them.

    Args:
      graphdef, params: the policy as `(graphdef, params)` (e.g. `models.split(model)`, or the
        trainer's `graphdef, state.params`).
      task: gives `answer_prompt(problem) -> ids`, `decode(ids) -> text`, `eos_ids`, `pad_id`
        (`MathTask`, `ToyTask`). Hints are never used.
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
    from sage_jax import sampling

    if k < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"k ({k}), batch_size ({batch_size}) and max_new_tokens "
                         f"({max_new_tokens}) must all be >= 1")
    items = [(name, p) for name, problems in problems_by_benchmark.items() for p in problems]
    if not items:
        raise ValueError("no problems to evaluate")
    empty = [name for name, problems in problems_by_benchmark.items() if not problems]
    if empty:
        raise ValueError(f"benchmark(s) with no problems: {', '.join(empty)}")
    prompts = [task.answer_prompt(p.problem) for _, p in items]
    order = sorted(range(len(items)), key=lambda i: -len(prompts[i]))  # longest first: OOM early
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    eos_ids = tuple(int(e) for e in task.eos_ids)
    pad_id = int(task.pad_id)

    scores = np.zeros((len(items), k), np.float32)
    lengths = np.zeros((len(items), k), np.int32)
    truncated = np.zeros((len(items), k), bool)
    texts: list[list[str]] = [[] for _ in items]
    reward_stats: dict[str, int] = {}
    tally = [0.0, 0]  # running (sum of scores, samples scored) for the progress bar
    t0 = time.perf_counter()

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(items), unit="problem", desc="eval", file=sys.stderr,
                   dynamic_ncols=True)

    def launch(chunk):
        width = sampling.prompt_bucket(max(len(prompts[i]) for i in chunk))
        tok = np.full((len(chunk), width), pad_id, np.int32)
        mask = np.zeros((len(chunk), width), bool)
        for r, i in enumerate(chunk):
            tok[r, width - len(prompts[i]):] = prompts[i]
            mask[r, width - len(prompts[i]):] = True
        ids = np.asarray([problem_id(items[i][0], items[i][1].index) for i in chunk], np.int32)
        return sampling.sample(graphdef, params, tok, mask, key=key, num_samples=k,
                               max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, eos_ids=eos_ids, prompt_ids_B=ids,
                               pad_id=pad_id)

    def finish(chunk, out):
        import jax
        out = jax.device_get(out)
        tok_BxKxT, len_BxK = np.asarray(out.tokens), np.asarray(out.lengths)
        responses, truths = [], []
        for r, i in enumerate(chunk):
            texts[i] = [task.decode(tok_BxKxT[r, g, :len_BxK[r, g]].tolist()) for g in range(k)]
            responses += texts[i]
            truths += [ground_truth(task, items[i][1])] * k
        got, stats = scorer(responses, truths)
        got = np.asarray(got, np.float32).reshape(len(chunk), k)
        for name, value in (stats or {}).items():
            if name != "n":
                reward_stats[name] = reward_stats.get(name, 0) + int(value)
        last = np.take_along_axis(tok_BxKxT, np.maximum(len_BxK - 1, 0)[..., None], -1)[..., 0]
        cut = (len_BxK >= max_new_tokens) & ~np.isin(last, eos_ids)
        scores[chunk], lengths[chunk], truncated[chunk] = got, len_BxK, cut
        tally[0] += float(got.sum())
        tally[1] += got.size
        if bar is not None:
            bar.set_postfix_str(f"avg@{k}={tally[0] / tally[1]:.3f}", refresh=False)
            bar.update(len(chunk))

    try:
        # The sampler dispatches asynchronously: the next batch runs on the device while the host
        # decodes and scores the previous one.
        pending = None
        for chunk in chunks:
            out = launch(chunk)
            if pending is not None:
                finish(*pending)
            pending = (chunk, out)
        finish(*pending)
    finally:
        if bar is not None:
            bar.close()

    per_benchmark, start = {}, 0
    for name, problems in problems_by_benchmark.items():
        sl = slice(start, start + len(problems))
        per_benchmark[name] = aggregate(scores[sl], lengths[sl], truncated[sl])
        start += len(problems)
    result: dict[str, Any] = {
        "benchmarks": per_benchmark, "average": paper_average(per_benchmark),
        "reward_stats": reward_stats, "generated_tokens": int(lengths.sum()),
        "time_s": time.perf_counter() - t0}
    if keep_samples:
        result["samples"] = [
            {"benchmark": name, "index": p.index, "sample": g, "problem": p.problem,
             "answer": p.answer, "completion": texts[i][g],
             "extracted": extract_answer(task, texts[i][g]), "score": float(scores[i, g]),
             "length": int(lengths[i, g]), "truncated": bool(truncated[i, g])}
            for i, (name, p) in enumerate(items) for g in range(k)]
    return result


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


# ---- the driver -------------------------------------------------------------------------------

def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m sage_jax.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face model folder (config.json, safetensors, "
                                     "tokenizer files)")
    src.add_argument("--checkpoint", metavar="WORKDIR[/STEP]",
                     help="training run folder (its latest checkpoint), or WORKDIR/STEP")
    p.add_argument("--benchmarks", default=None,
                   help=f"comma-separated, from {','.join(ALL_BENCHMARKS)} (default: the paper's "
                        f"six; a toy-task checkpoint: {TOY_BENCHMARK})")
    p.add_argument("--data-dir", default=None,
                   help="folder with eval/<name>/test.jsonl or eval_verl/<name>.parquet "
                        "(default: eval.data_dir of the run's config)")
    p.add_argument("--layout", choices=("auto", "jsonl", "verl"), default="auto",
                   help="benchmark file layout (auto: JSONL when present, else parquet)")
    p.add_argument("--k", type=int, default=16, help="samples per problem (default 16)")
    p.add_argument("--temperature", type=float, default=0.6, help="default 0.6")
    p.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    p.add_argument("--top-k", type=int, default=0, help="default 0 (off)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="answer token budget (default: eval.max_new_tokens of a run's config, "
                        "else 8192)")
    p.add_argument("--limit", type=int, default=None,
                   help="evaluate only the first n problems of each benchmark")
    p.add_argument("--batch-size", type=int, default=64,
                   help="prompts per sampler call (each call samples batch-size * k answers); "
                        "default 64")
    p.add_argument("--out", default=None,
                   help="results folder (default: WORKDIR/eval/step_<N> for --checkpoint, "
                        "eval_results/<model folder name> for --model)")
    p.add_argument("--system-prompt", default=None,
                   help="system message of the answer prompt (default: the training one, "
                        "'Please reason step by step, and put your final answer within "
                        "\\boxed{}.')")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="--model weights dtype (auto: float32 on CPU, else bfloat16); a "
                        "--checkpoint keeps its training dtypes")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--reward-timeout", type=float, default=5.0,
                   help="seconds per answer for the checker (default 5)")
    p.add_argument("--reward-workers", type=int, default=None,
                   help="checker processes (default: one per CPU, at most 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("k", "batch_size", "max_new_tokens", "limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    return args


def _policy(args):
    """(graphdef, params, task, info, run cfg or None) of --model or --checkpoint."""
    import jax
    import jax.numpy as jnp

    from sage_jax import build, models
    from sage_jax.tasks.math import ANSWER_SYSTEM, MathTask

    system = ANSWER_SYSTEM if args.system_prompt is None else args.system_prompt
    if args.model:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {path}: no config.json (expected a Hugging Face "
                                    f"model folder)")
        dtype = args.dtype
        if dtype == "auto":
            dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        try:
            tokenizer = models.Tokenizer(path)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise ValueError(
                f"--model {path}: could not load its tokenizer ({type(e).__name__}: {e}). A model "
                f"exported from a toy-task run has no tokenizer: evaluate that run with "
                f"--checkpoint instead") from None
        model = models.from_hf(path, dtype=jnp.dtype(dtype))
        task = MathTask(tokenizer, system_prompt=system)
        info = {"model": str(path), "dtype": dtype}
        cfg = None
    else:
        from sage_jax.export import split_checkpoint_path
        workdir, step = split_checkpoint_path(args.checkpoint)
        cfg, model, step = build.restore_policy(workdir, step)
        if cfg.task.name == "toy":
            task = build.load_task(cfg)
            if args.system_prompt is not None:
                print("note: --system-prompt does not apply to the toy task", file=sys.stderr)
        else:
            if not cfg.model.path or not Path(cfg.model.path).is_dir():
                raise FileNotFoundError(
                    f"the run's base model folder model.path={cfg.model.path!r} (needed for its "
                    f"tokenizer) does not exist; export the checkpoint and use --model")
            task = MathTask(models.Tokenizer(cfg.model.path), system_prompt=system)
        info = {"checkpoint": str(workdir), "step": int(step), "task": cfg.task.name,
                "method": cfg.rl.method, "dtype": cfg.model.dtype}
    if hasattr(task, "system_prompt"):
        info["system_prompt"] = task.system_prompt
    graphdef, params = models.split(model)
    return graphdef, params, task, info, cfg


def _benchmarks(args, cfg) -> list[str]:
    toy = cfg is not None and cfg.task.name == "toy"
    if args.benchmarks is None:
        return [TOY_BENCHMARK] if toy else list(BENCHMARKS)
    names = [n.strip() for n in args.benchmarks.split(",") if n.strip()]
    if toy and names != [TOY_BENCHMARK]:
        raise ValueError(f"this checkpoint is a toy-task run: it can only be evaluated on the "
                         f"toy task's problems (--benchmarks {TOY_BENCHMARK}); use --model with "
                         f"a math model for {', '.join(names)}")
    if not toy and TOY_BENCHMARK in names:
        raise ValueError(f"benchmark {TOY_BENCHMARK!r} needs a toy-task --checkpoint")
    return names


def _default_out(args, info) -> Path:
    if args.out:
        return Path(args.out)
    if "checkpoint" in info:
        return Path(info["checkpoint"]) / "eval" / f"step_{info['step']}"
    return Path("eval_results") / Path(info["model"]).resolve().name


def run(args) -> dict[str, Any]:
    """Evaluates as `args` (from the command line) say; prints the table, writes the files."""
    import jax

    from sage_jax import rewards

    graphdef, params, task, info, cfg = _policy(args)
    names = _benchmarks(args, cfg)
    data_dir = args.data_dir or (cfg.eval.data_dir if cfg is not None else None)
    problems = load_problems(names, data_dir, limit=args.limit, layout=args.layout)
    max_new = args.max_new_tokens or (cfg.eval.max_new_tokens if cfg is not None else 8192)
    out_dir = _default_out(args, info)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"k": args.k, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "max_new_tokens": max_new, "limit": args.limit,
                "batch_size": args.batch_size, "seed": args.seed,
                "data_dir": None if data_dir is None else str(data_dir), "layout": args.layout,
                "hints": False}
    listing = ", ".join(f"{n} ({len(p)})" for n, p in problems.items())
    print(f"evaluating {listing} with k={args.k}, temperature={args.temperature}, "
          f"top_p={args.top_p}, max_new_tokens={max_new}",
          file=sys.stderr, flush=True)
    with rewards.RewardPool(rewards.get_reward(task.reward_name), timeout_s=args.reward_timeout,
                            num_workers=args.reward_workers) as pool:
        _warm_up(pool)
        result = evaluate_problems(
            graphdef, params, task, problems, k=args.k, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, max_new_tokens=max_new,
            key=jax.random.PRNGKey(args.seed), scorer=pool.score, batch_size=args.batch_size,
            progress=not args.no_progress, keep_samples=True)
    samples = result.pop("samples")
    table = format_table(result)
    report = {**info, "settings": settings, **result}
    (out_dir / "results.json").write_text(json.dumps(_finite(report), indent=2) + "\n")
    with (out_dir / "samples.jsonl").open("w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    (out_dir / "table.txt").write_text(table + "\n")
    source = info.get("model") or f"{info['checkpoint']} step {info['step']}"
    print(f"\n{source}  (k={args.k}, temperature={args.temperature}, top_p={args.top_p}, "
          f"max_new_tokens={max_new}, no hints)\n{table}\n")
    stats = {k: v for k, v in result["reward_stats"].items() if v}
    if stats:
        print(f"reward checker: {stats} (each counted as a score of 0)")
    tok_s = result["generated_tokens"] / max(result["time_s"], 1e-9)
    print(f"{len(samples)} answers, {result['generated_tokens']} tokens in "
          f"{result['time_s']:.1f} s ({tok_s:.0f} tokens/s); wrote {out_dir}/results.json, "
          f"samples.jsonl, table.txt", flush=True)
    return report


def _warm_up(pool) -> None:
    """Lets every checker process import the reward's module (e.g. the toy task's, which pulls in
    jax) before the real answers, so that the import does not eat their timeout."""
    n = 2 * pool.num_workers
    pool.score(["\\boxed{0} A:0"] * n, ["0"] * n, timeout_s=max(120.0, pool.timeout_s))


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def main(argv=None) -> dict[str, Any]:
    args = _parse(argv)
    from sage_jax import config as config_lib
    try:
        return run(args)
    except (FileNotFoundError, ValueError, config_lib.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
