"""`python -m sage_jax.sft [--out DIR] [--config FILE] [section.key=value ...]`: warm-starts the
toy model on the toy task's SFT mix (settings `task.toy.*` of a run config) and saves it as a
Hugging Face folder. `--out sage_jax/tasks/toy/toy_sft` regenerates the checkpoint shipped with the
package. The SFT library is `sage_jax.engine.trainer.sft_step`.
"""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

from sage_jax.infra import cli
from sage_jax import config as config_lib
from sage_jax.tasks.toy import warm_start
from sage_jax.tasks import registry


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m sage_jax.sft",
        description="Warm-start the toy model on the toy task's SFT mix, with the warm-start "
                    "settings (task.toy.*) of a run config. `--config toy_uniform --out "
                    "sage_jax/tasks/toy/toy_sft` and `--config toy_tail --out "
                    "sage_jax/tasks/toy/toy_tail_sft` regenerate the checkpoints shipped with the "
                    "package.")
    ap.add_argument("--out", default="runs/toy_sft", help="checkpoint folder (HF format)")
    ap.add_argument("--config", default=None,
                    help="YAML config whose task.toy settings to use (default: the built-in "
                         "toy.yaml; toy_uniform for sage_jax/tasks/toy/toy_sft)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. task.toy.sft_seed=1")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def run():
        cfg = registry.load_config(args.config or config_lib.DEFAULT_CONFIG, args.overrides)
        warm_start.train_warm_start(cfg, args.out, progress=print)
        print(f"saved {args.out}")

    cli.run_command(run, (config_lib.ConfigError, FileNotFoundError))


if __name__ == "__main__":
    main()
