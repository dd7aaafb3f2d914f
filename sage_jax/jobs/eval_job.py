"""The job behind `python -m sage_jax.evaluate`: load the policy (a model folder, or a run's
checkpoint restored without training), pick its problems (the paper's benchmarks, or the run's
task's built-in problems), evaluate, print the table and write results.json, samples.jsonl and
table.txt."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from sage_jax import config as config_lib, models
from sage_jax.infra import provenance, rewards
from sage_jax.eval import accuracy as eval_lib
from sage_jax.rl.types import RolloutEngine
from sage_jax.run import build, restore, vllm_engine
from sage_jax.tasks import registry
from sage_jax.tasks.benchmarks import BENCHMARKS
from sage_jax.tasks.math import ANSWER_SYSTEM, MathTask


def _policy(args):
    """(model, task, info, run cfg or None, Hugging Face folder or None) of --model or
    --checkpoint."""
    if args.model:
        try:
            path = models.check_model_dir(args.model)  # a folder, or a hub id
        except FileNotFoundError as e:
            raise FileNotFoundError(f"--model {e}") from None
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
        system = ANSWER_SYSTEM if args.system_prompt is None else args.system_prompt
        task = MathTask(tokenizer, system_prompt=system)
        info = {"model": str(args.model), "dtype": dtype}
        cfg, folder = None, path
    else:
        workdir, step = restore.split_checkpoint_path(args.checkpoint)
        cfg, model, step = restore.restore_policy(workdir, step)
        plugin = registry.plugin(cfg.task.name)
        if plugin.model_config is None and not (cfg.model.path
                                                and models.hub.resolve(cfg.model.path).is_dir()):
            raise FileNotFoundError(
                f"the run's base model folder model.path={cfg.model.path!r} (needed for its "
                f"tokenizer) does not exist; export the checkpoint and use --model")
        task = plugin.make_task(cfg, None, args.system_prompt)
        if args.system_prompt is not None and task.system_prompt is None:
            print(f"note: --system-prompt does not apply to the {cfg.task.name} task",
                  file=sys.stderr)
        info = {"checkpoint": str(workdir), "step": int(step), "task": cfg.task.name,
                "method": cfg.rl.method, "dtype": cfg.model.dtype}
        folder = models.hub.resolve(cfg.model.path) if cfg.model.path else None
    if task.system_prompt is not None:
        info["system_prompt"] = task.system_prompt
    return model, task, info, cfg, folder


def _engine(args, model, task, cfg, folder, max_len: int) -> RolloutEngine:
    """The `--engine` that samples (default: the run's `rollout.engine`, else native), synced
    to the model's weights."""
    name = args.engine or (cfg.rollout.engine if cfg is not None else "native")
    _check_installed(name)
    if name == "vllm" and folder is None:
        raise config_lib.ConfigError("--engine vllm starts from a Hugging Face model folder, and "
                                     "this run has none (model.path): use --engine native",
                                     key="engine")
    graphdef, params = models.split(model)
    return build.engine_named(name, model.cfg, graphdef, params, task, folder=folder,
                              rollout=cfg.rollout if cfg is not None else
                              config_lib.RolloutConfig(),
                              dtype=jnp.dtype(model.compute_dtype).name, max_len=max_len,
                              seed=args.seed)


def _problems(args, cfg, data_dir):
    """{benchmark: problems}: a run's task's built-in problems where it has them (no other
    benchmark applies), else --benchmarks (default: the paper's six) from `data_dir` (None: the
    Hub)."""
    names = None if args.benchmarks is None else [
        n.strip() for n in args.benchmarks.split(",") if n.strip()]
    builtin = registry.plugin(cfg.task.name).eval_problems if cfg is not None else None
    if builtin is None:
        return eval_lib.load_problems(names or list(BENCHMARKS), data_dir, limit=args.limit,
                                      layout=args.layout)
    problems = builtin(cfg, args.limit)
    if names is not None and names != list(problems):
        raise ValueError(f"this checkpoint is a {cfg.task.name}-task run: it can only be "
                         f"evaluated on its task's problems (--benchmarks "
                         f"{','.join(problems)}); use --model with a math model for "
                         f"{', '.join(names)}")
    return problems


def _default_out(args, info) -> Path:
    if args.out:
        return Path(args.out)
    if "checkpoint" in info:
        return Path(info["checkpoint"]) / "eval" / f"step_{info['step']}"
    return Path("eval_results") / Path(info["model"]).resolve().name


def _check_installed(engine: str | None) -> None:
    if engine == "vllm" and not vllm_engine.installed():
        raise config_lib.ConfigError(f"--engine vllm needs vLLM, which is not installed: "
                                     f"{vllm_engine.INSTALL}", key="engine")


def run(args) -> dict[str, Any]:
    """Evaluates as `args` (from the command line) say; prints the table, writes the files."""
    _check_installed(args.engine)  # before any work
    model, task, info, cfg, folder = _policy(args)
    data_dir = args.data_dir or (cfg.eval.data_dir if cfg is not None else None)
    problems = _problems(args, cfg, data_dir)
    max_new = args.max_new_tokens or (cfg or config_lib.Config()).eval.max_new_tokens
    longest = max(len(task.answer_prompt(p.problem)) for ps in problems.values() for p in ps)
    engine = _engine(args, model, task, cfg, folder, longest + max_new)
    info["engine"] = engine.name
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
    with rewards.RewardPool(task.reward_fn, timeout_s=args.reward_timeout,
                            num_workers=args.reward_workers) as pool:
        pool.warm_up()
        result = eval_lib.evaluate_problems(
            engine, task, problems, k=args.k, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, max_new_tokens=max_new,
            key=jax.random.PRNGKey(args.seed), scorer=pool.score, batch_size=args.batch_size,
            progress=not args.no_progress, keep_samples=True)
    samples = result.pop("samples")
    table = eval_lib.format_table(result)
    report = {**info, "settings": settings, **result, "provenance": provenance.record(
        config_lib.to_dict(cfg) if cfg is not None else {}, args.seed)}
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


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
