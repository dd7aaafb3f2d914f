"""The word-problem task's config section, `task.words.*` (brought by its plug-in; see
`config.TaskConfig`)."""

from __future__ import annotations

import dataclasses

from sage_jax import config


@dataclasses.dataclass(frozen=True)
class WordsConfig(config.Section):
    """Generated arithmetic word problems (task.name: words) and the SFT warm start of the
    model at model.path on them."""

    min_steps: int = 1  # Fewest steps of the RL and evaluation problems.
    max_steps: int = 6  # Most steps; the warm start sees every length from 1 to this.
    problems: int = 4096  # Generated RL training problems (when data.train_files is empty).
    seed: int = 0  # Seed of the training problems (held-out problems use their own seed).
    sft_steps: int = 80  # Warm-start SFT steps (0: start RL from model.path as it is).
    sft_batch_size: int = 8  # Examples per SFT step.
    sft_lr: float = 5.0e-5  # SFT learning rate (AdamW, linear warm-up over 10 steps).
    sft_seed: int = 0  # Seed of the SFT examples.
    sft_write_share: float = 0.3  # Share of hint-writing examples in the SFT mix.
    sft_hinted_share: float = 0.2  # Share of hinted answers (the rest: plain answers).
    cache_dir: str | None = None  # Warm-start cache; None = $SAGE_JAX_CACHE or ~/.cache/sage_jax.
    eval_per_length: int = 16  # Held-out problems per length in `eval_problems`.

    def validate(self) -> None:
        config.require(1 <= self.min_steps <= self.max_steps <= 12, "min_steps/max_steps",
                       (self.min_steps, self.max_steps), "need 1 <= min_steps <= max_steps <= 12")
        for key in ("problems", "sft_batch_size", "eval_per_length"):
            config.require(getattr(self, key) >= 1, key, getattr(self, key), ">= 1")
        config.require(self.sft_steps >= 0, "sft_steps", self.sft_steps, ">= 0")
        config.require(self.sft_lr > 0, "sft_lr", self.sft_lr, "> 0")
        for key in ("sft_write_share", "sft_hinted_share"):
            config.require(0 <= getattr(self, key) <= 1, key, getattr(self, key),
                           "in [0, 1]")
        config.require(self.sft_write_share + self.sft_hinted_share <= 1, "sft_*_share",
                       self.sft_write_share + self.sft_hinted_share, "shares sum to at most 1")
