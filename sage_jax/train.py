"""`python -m sage_jax.train [--config FILE] [--workdir DIR] [section.key=value ...]`.

Runs (or resumes: re-run the same command) one training run: data -> rollout (sample, reward,
SAGE hints) -> batch -> jitted update, with orbax checkpoints, metrics (console progress,
DIR/metrics.jsonl, TensorBoard when installed) and sample logs (DIR/samples.jsonl).
With no arguments it runs the built-in default, the toy job of `sage_jax/configs/toy.yaml`, into
a fresh `runs/` folder. `run(cfg, workdir)` is the same from Python: the task's default job
(`JOBS`: the toy task's is `sage_jax.jobs.toy_job`) where it has one, else the plain training
run `sage_jax.run.loop.train`.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from sage_jax.infra import checkpoint, cli, compile_cache
from sage_jax import config as config_lib
from sage_jax.jobs import toy_job
from sage_jax.run import build, loop
from sage_jax.run.loop import TrainingError
from sage_jax.tasks import registry

JOBS = {"toy": toy_job.run}  # task.name -> its default job (which falls back to loop.train itself)


def run(cfg, workdir) -> dict:
    """The training job of `cfg` in `workdir` (JAX's compilation cache in
    `train.compile_cache`); returns the last step's metrics."""
    build.check_rollout_engine(cfg)  # before a job's first work (the toy job's warm start)
    compile_cache.enable(cfg.train.compile_cache)
    return JOBS.get(cfg.task.name, loop.train)(cfg, workdir)


def parse(argv=None):
    """(cfg, workdir) from the command line."""
    p = argparse.ArgumentParser(
        prog="python -m sage_jax.train", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="YAML config file, or the name of a shipped one (toy, grpo_tiny, "
                        "paper_qwen2.5-7b, ...; default: toy)")
    p.add_argument("--workdir", default=None,
                   help="run folder; re-running on the same folder resumes (default: runs/<time>)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. rl.method=grpo optim.lr=3e-6 train.steps=10")
    args = p.parse_args(argv)
    source = args.config or config_lib.DEFAULT_CONFIG
    # a run folder's own config.yaml (resuming from it) is read with moved keys migrated
    saved = Path(source).is_file() and (Path(source).parent / loop.PROVENANCE_FILE).is_file()
    cfg = registry.load_config(source, args.overrides, saved=saved)
    workdir = args.workdir or cfg.train.workdir or Path("runs") / datetime.datetime.now(
    ).strftime("%Y%m%d-%H%M%S")
    print(describe(source, args.overrides), flush=True)
    return cfg, workdir


def describe(source, overrides) -> str:
    """One line: the config file and the command line's overrides (the whole resolved config is
    written to the run folder's config.yaml, whose path `run.loop` prints)."""
    return (f"config: {config_lib.resolve_config_path(source)}; overrides: "
            + (" ".join(overrides) if overrides else "none"))


def main(argv=None):
    def command():
        cfg, workdir = parse(argv)
        return run(cfg, workdir)

    cli.run_command(command, (ValueError, FileNotFoundError, TrainingError, checkpoint.CheckpointError))


if __name__ == "__main__":
    main()
