"""`python -m sage_jax.evaluate`: hint-free avg@k / pass@k of a policy on math benchmarks.

    python -m sage_jax.evaluate --model HF_DIR --data-dir ../shared/data            # paper's six
    python -m sage_jax.evaluate --model Qwen/Qwen2.5-0.5B-Instruct     # six, from the Hub datasets
    python -m sage_jax.evaluate --checkpoint runs/x --data-dir DATA --benchmarks math500,gsm8k
    python -m sage_jax.evaluate --checkpoint runs/x/200 --k 4 --limit 20 --max-new-tokens 1024

The model is a Hugging Face folder (`--model`) or a training run folder (`--checkpoint
WORKDIR[/STEP]`, latest step by default). Prompts are the training answer prompt (a system
instruction to reason step by step and box the answer, then the problem, through the model's chat
template) and never carry a hint. Each problem is sampled k times (paper: k=16 at temperature 0.6,
top-p 0.95), by the run's rollout engine (`--engine`: native, the default, or vllm); a sample
scores 1 when its last `\\boxed{}` is equivalent to the ground truth.

Per benchmark: avg@k (mean accuracy over the k samples of every problem, the paper's number),
pass@k (share of problems with at least one correct sample), mean answer length in tokens (EOS
included) and the share of answers cut off at --max-new-tokens. The "paper avg" row is the mean
over the paper's six benchmarks (AIME24, AIME25, AMC23, MATH-500, Minerva, OlympiadBench) that
were evaluated. Outputs in --out: results.json, samples.jsonl (every completion with its
extracted answer and score) and table.txt.

A checkpoint of a run of a task with built-in problems (the toy task) is evaluated on those
(benchmark "toy"). The library is `sage_jax.eval.accuracy` and the job `sage_jax.jobs.eval_job`.
"""

from __future__ import annotations

import argparse
from typing import Any

from sage_jax.infra import cli
from sage_jax import config as config_lib
from sage_jax.jobs import eval_job as job
from sage_jax.tasks.benchmarks import ALL_BENCHMARKS


_DEFAULTS = config_lib.EvalConfig()  # the flags' defaults are the eval section's


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
                        f"six; a toy-task checkpoint: toy)")
    p.add_argument("--data-dir", default=None,
                   help="folder with eval/<name>/test.jsonl or eval_verl/<name>.parquet "
                        "(default: eval.data_dir of the run's config; without either, each "
                        "benchmark's Hugging Face Hub dataset, see docs/running.md)")
    p.add_argument("--layout", choices=("auto", "jsonl", "verl"), default="auto",
                   help="benchmark file layout (auto: JSONL when present, else parquet)")
    p.add_argument("--k", type=int, default=_DEFAULTS.k,
                   help=f"samples per problem (default {_DEFAULTS.k})")
    p.add_argument("--temperature", type=float, default=_DEFAULTS.temperature,
                   help=f"default {_DEFAULTS.temperature}")
    p.add_argument("--top-p", type=float, default=_DEFAULTS.top_p,
                   help=f"default {_DEFAULTS.top_p}")
    p.add_argument("--top-k", type=int, default=0, help="default 0 (off)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="answer token budget (default: eval.max_new_tokens of a run's config, "
                        f"else {_DEFAULTS.max_new_tokens})")
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
    p.add_argument("--engine", choices=("native", "vllm"), default=None,
                   help="what samples (default: a run's rollout.engine, else native); vllm is "
                        "the optional extra sage_jax[vllm] and needs a Hugging Face model "
                        "folder (--model, or the run's model.path)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--reward-timeout", type=float, default=5.0,
                   help="seconds per answer for the checker (default 5)")
    p.add_argument("--reward-workers", type=int, default=None,
                   help="checker processes (default: one per CPU, at most 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    try:  # the eval section's checks, and the samplers'
        max_new = _DEFAULTS.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
        config_lib.EvalConfig(k=args.k, temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=max_new, limit=args.limit)
        config_lib.check_sampling(args.temperature, args.top_p, args.top_k)
    except config_lib.ConfigError as e:
        p.error(f"--{(e.key or '').replace('_', '-')}: {e}")
    return args


def main(argv=None) -> dict[str, Any]:
    args = _parse(argv)
    return cli.run_command(lambda: job.run(args),
                           (FileNotFoundError, ValueError, config_lib.ConfigError))


if __name__ == "__main__":
    main()
