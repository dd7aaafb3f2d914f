"""The toy task's config section, `task.toy.*` (brought by its plug-in; see `config.TaskConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from sage_jax import config


@dataclasses.dataclass(frozen=True)
class ToyConfig(config.Section):
    """The built-in toy task (task.name: toy): its lengths, warm start, calibration, report."""

    min_steps: int = 8  # Shortest chain (arithmetic steps) of the RL and evaluation problems.
    max_steps: int = 16  # Longest chain; SFT covers every length from 1 to this.
    problems: int = 512  # Built-in RL training problems (when data.train_files is empty).
    warm_start: bool = True  # model.path null: start RL from the SFT warm start (cached).
    sft_seed: int = 0  # Seed of the warm start (kept apart from train.seed: one SFT start).
    sft_steps: int = 6000  # Most SFT steps of the warm start.
    sft_target_step_acc: float = 0.87  # Stop SFT at this single-step accuracy (0: never).
    cache_dir: str | None = None  # Warm-start cache; None = $SAGE_JAX_CACHE or ~/.cache/sage_jax.
    calibrate: bool = True  # Measure and print the calibration gate before RL.
    calibrate_per_length: int = 16  # Problems per length in the calibration.
    report: bool = True  # After RL: no-hint evaluation by length, summary.md and summary.png.
    eval_per_length: int = 32  # Problems per length in the final evaluation.
    eval_samples: int = 4  # Samples per problem in the final evaluation (pass rate = mean).
    # The hard split (docs/toy_tail): operands whose facts only rare_share of the RL and
    # evaluation problems of >= rare_min_steps steps use, and sft_rare_share of the warm start's.
    rare_operands: tuple[int, ...] = ()
    rare_share: float = 0.0  # Share of RL / evaluation problems (>= rare_min_steps) with one.
    rare_min_steps: int = 1  # Shortest RL / evaluation problem that may hold a rare operand.
    sft_rare_share: float = 0.0  # Share of the warm start's SFT problems with one (0: never).
    hint_format: Literal["payload", "level"] = "payload"  # One JSON reply, or one per level.
    sft_write_share: float = 0.1  # Share of hint-writing examples in the warm start's SFT mix.
    # > 0: SFT also runs until P(exact hint) >= this and hinted step accuracy reaches the
    # target, at every level.
    sft_target_write_prob: float = 0.0

    def validate(self) -> None:
        config.require(1 <= self.min_steps <= self.max_steps <= 20, "min_steps/max_steps",
                       (self.min_steps, self.max_steps), "need 1 <= min_steps <= max_steps <= 20")
        config.require(set(self.rare_operands) <= set(range(1, 10)) and len(self.rare_operands) < 8,
                       "rare_operands", self.rare_operands, "at most 7 of the operands 1..9")
        for key in ("rare_share", "sft_rare_share", "sft_target_write_prob"):
            config.require(0 <= getattr(self, key) <= 1, key, getattr(self, key),
                           "in [0, 1]")
        config.require(0 <= self.sft_write_share < 1, "sft_write_share",
                       self.sft_write_share, "in [0, 1)")
        for key in ("problems", "calibrate_per_length", "eval_per_length", "eval_samples"):
            config.require(getattr(self, key) >= 1, key, getattr(self, key), ">= 1")
        config.require(self.sft_steps >= 0, "sft_steps", self.sft_steps, ">= 0")
        config.require(0 <= self.sft_target_step_acc < 1, "sft_target_step_acc",
                       self.sft_target_step_acc, "in [0, 1)")
