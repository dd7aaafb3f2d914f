"""Run configuration: typed dataclasses, YAML files and dotted command-line overrides.

A run is described by one `Config`, built from (in order of precedence, lowest first) the
defaults below, a YAML file and `section.field=value` overrides:

    cfg = load_config("grpo_tiny", ["rl.group_size=4", "optim.lr=3e-6"])

The configs shipped with the package live in `CONFIG_DIR` (`sage_jax/configs/`); a config path
that is not a file is looked up there by name (`toy`, `toy.yaml` or `configs/toy.yaml`), so the
same command works from a checkout and from an installed wheel. `DEFAULT_CONFIG` is the built-in
toy job's.

Every key is checked: an unknown or misspelled key, a value of the wrong type, a value outside a
`Literal`'s choices or outside a field's allowed range is a `ConfigError` that names the dotted key
and says what is allowed. Defaults are the paper's settings (arXiv 2602.03143).

Sections are frozen dataclasses (hashable, so they can be static arguments to `jax.jit`); list
fields are therefore tuples. Each section checks its own ranges in `validate()`; `Config.validate()`
checks rules that span sections. Both run on construction, so a `Config` is always valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

CONFIG_DIR = Path(__file__).with_name("configs")  # the configs shipped with the package
DEFAULT_CONFIG = CONFIG_DIR / "toy.yaml"  # what `python -m sage_jax.train` runs without --config


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names the key and what is allowed."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key  # The field a section's `validate()` complained about, if any.


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raises a `ConfigError` for `key` unless `ok`; `allowed` says which values are valid."""
    if not ok:
        raise ConfigError(f"invalid value {value!r} for config key '{key}': {allowed}", key=key)


class _Section:
    """Base of all config sections: runs `validate()` whenever a section is constructed."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks value ranges; raises `ConfigError` on the first violation."""


# ----------------------------------------------------------------------------------------------
# Schema.

DType = Literal["float32", "bfloat16"]

PAPER_BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench")


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
    """Which policy model to train and at what precision."""

    path: str | None = None  # Hugging Face checkpoint folder; None = the built-in tiny model.
    dtype: DType = "bfloat16"  # Dtype the parameters are stored in.
    compute_dtype: DType = "bfloat16"  # Dtype of activations and matmuls.
    remat: bool = True  # Recompute each layer's activations in the backward pass to save memory.
    master_fp32: bool = True  # Keep float32 master weights for the optimiser when dtype is bf16.


@dataclasses.dataclass(frozen=True)
class DataConfig(_Section):
    """Training problems: files, their layout and which fields hold what."""

    train_files: tuple[str, ...] = ()  # Local JSON/JSONL/Parquet files or globs, or hub ids.
    format: Literal["auto", "json", "jsonl", "parquet", "hub"] = "auto"  # auto: by extension.
    problem_key: str = "problem"  # Field with the problem text (dotted paths reach nested fields).
    answer_key: str = "answer"  # Field with the ground-truth final answer.
    solution_key: str | None = "solution"  # Field with the reference solution; None = none.
    hint_key: str | None = None  # Field with ready-made hints (for hint.source: column).
    index_key: str | None = None  # Field with a stable row id; None = position in the files.
    layout: Literal["plain", "verl"] = "plain"  # verl: chat `prompt`, reward_model, extra_info.
    max_prompt_tokens: int = 2048  # Longer prompts are skipped (and counted), never truncated.
    skip_invalid: bool = False  # Skip (and count) rows missing problem/answer instead of failing.
    shuffle: bool = True  # Reshuffle the problems every epoch (deterministically, from the seed).

    def validate(self) -> None:
        _require(self.max_prompt_tokens >= 1, "max_prompt_tokens", self.max_prompt_tokens,
                 "must be >= 1")
        for name in ("problem_key", "answer_key", "solution_key", "hint_key", "index_key"):
            value = getattr(self, name)
            _require(value is None or value.strip() != "", name, value,
                     "must be a non-empty field name")


@dataclasses.dataclass(frozen=True)
class RLConfig(_Section):
    """The RL algorithm: rollouts, rewards, advantages and the clipped policy-gradient loss."""

    method: Literal["grpo", "sage", "sage_light", "resample"] = "sage"  # README: Methods and hint sources.
    group_size: int = 8  # G: answers sampled per prompt.
    prompts_per_step: int = 128  # B: prompts per training step.
    max_new_tokens: int = 8192  # Longest answer, end-of-sequence token included.
    temperature: float = 1.0  # Sampling temperature of rollouts.
    top_p: float = 1.0  # Nucleus sampling mass; 1.0 = off.
    top_k: int = 0  # Sample from the k most likely tokens only; 0 = off.
    adv_scale: Literal["group", "batch", "none"] = "group"  # Std that divides advantages.
    clip_low: float = 0.2  # PPO ratio clip below: 1 - clip_low.
    clip_high: float = 0.28  # PPO ratio clip above: 1 + clip_high (clip-higher).
    dual_clip: float = 3.0  # Dual-clip bound on negative advantages; 0 = off.
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean")  # How token losses are averaged into the batch loss.
    kl_beta: float = 0.0  # Weight of the k3 KL penalty to a frozen reference; 0 = none.
    minibatches: int = 2  # Optimiser updates per training step (the batch is split this way).
    # Sequences per gradient-accumulation pass; a smaller mini-batch is one pass; None = all.
    micro_batch_size: int | None = None
    # Answer rows the sampler decodes at once: a call's prompts are sampled in chunks of
    # rollout_micro_batch_size // answers-per-prompt (whole groups; the same answers, as each
    # row's randomness is its prompt's and its own), so the KV cache is that many rows; None = all.
    rollout_micro_batch_size: int | None = None
    epochs_per_batch: int = 1  # Passes over each step's rollouts.
    # The update packs whole rows end to end into its sequences (same loss and gradients,
    # fewer padding tokens; a micro-batch is then at most micro_batch_size packed sequences).
    padding_free: bool = True
    collapse_std: float = 0.0  # A group has collapsed when its reward std is <= this.
    success_threshold: float = 0.0  # A prompt is resolved when some answer's reward exceeds this.
    reward: str | None = None  # A registered reward name instead of the task's; None = task's.
    reward_timeout_s: float = 5.0  # Verifier time limit per answer; a timeout scores 0.
    loss_context: Literal["hinted", "plain"] = "hinted"  # Prompt hinted groups are trained on.
    # pi_old of the ratio: recomputed by the trainer before the update, or the sampler's own
    # log-probs (the same parameters, so equal up to float rounding; one forward pass less).
    # With loss_context=plain the trainer recomputes them anyway: hinted answers were sampled
    # in another context.
    old_logprobs: Literal["recompute", "sampler"] = "recompute"

    def validate(self) -> None:
        _require(self.group_size >= 2, "group_size", self.group_size,
                 "must be >= 2 (advantages compare answers within a group)")
        _require(self.prompts_per_step >= 1, "prompts_per_step", self.prompts_per_step,
                 "must be >= 1")
        _require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _require(self.temperature > 0, "temperature", self.temperature, "must be > 0")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _require(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 = off)")
        _require(0 <= self.clip_low < 1, "clip_low", self.clip_low, "must be in [0, 1)")
        _require(self.clip_high >= 0, "clip_high", self.clip_high, "must be >= 0")
        _require(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip", self.dual_clip,
                 "must be > 1, or 0 to turn dual-clip off")
        _require(self.kl_beta >= 0, "kl_beta", self.kl_beta, "must be >= 0")
        _require(self.minibatches >= 1, "minibatches", self.minibatches, "must be >= 1")
        _require(self.micro_batch_size is None or self.micro_batch_size >= 1,
                 "micro_batch_size", self.micro_batch_size, "must be >= 1, or null for all")
        _require(self.rollout_micro_batch_size is None
                 or self.rollout_micro_batch_size >= self.group_size, "rollout_micro_batch_size",
                 self.rollout_micro_batch_size,
                 "must be >= group_size (a group is sampled whole), or null for all")
        _require(self.epochs_per_batch >= 1, "epochs_per_batch", self.epochs_per_batch,
                 "must be >= 1")
        _require(self.collapse_std >= 0, "collapse_std", self.collapse_std, "must be >= 0")
        _require(self.reward_timeout_s > 0, "reward_timeout_s", self.reward_timeout_s,
                 "must be > 0")


@dataclasses.dataclass(frozen=True)
class HintConfig(_Section):
    """SAGE hints: where they come from, how they are written and (sage_light) leveled."""

    # online: the current policy writes them; offline: the initial policy, once; column: a data
    # field; reference: the task's fixed rule on the reference solution (no writing); auto: the
    # toy job's calibration gate picks online or reference (online where no gate runs).
    source: Literal["online", "offline", "column", "reference", "auto"] = "online"
    refresh_every: int = 1  # online: steps between rewrites of a prompt's hint; 0 = never.
    temperature: float = 0.0  # Sampling temperature when writing hints; 0 = greedy.
    max_new_tokens: int = 512  # Longest hint payload the policy may write.
    retries: int = 2  # Extra attempts after an unparseable hint payload.
    low: float = 0.1  # sage_light: raise the level when last accuracy <= low.
    high: float = 0.35  # sage_light: lower the level when last accuracy > high.
    max_level: int = 3  # Highest hint level (and re-sampling rounds for sage / resample).
    max_request_tokens: int = 4096  # Longer hint requests are skipped (counted), never cut.
    cache_bytes: int = 2048  # Bytes per level kept in the train state's hint cache.

    def validate(self) -> None:
        _require(self.max_request_tokens >= 1, "max_request_tokens", self.max_request_tokens,
                 "must be >= 1")
        _require(self.cache_bytes >= 16, "cache_bytes", self.cache_bytes, "must be >= 16")
        _require(self.refresh_every >= 0, "refresh_every", self.refresh_every,
                 "must be >= 0 (0 = never rewrite)")
        _require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _require(self.retries >= 0, "retries", self.retries, "must be >= 0")
        _require(0 <= self.low <= 1, "low", self.low, "must be in [0, 1]")
        _require(self.low <= self.high <= 1, "high", self.high,
                 f"must be in [low, 1] = [{self.low}, 1]")
        _require(self.max_level >= 1, "max_level", self.max_level, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class OptimConfig(_Section):
    """AdamW with gradient-norm clipping and a learning-rate schedule."""

    lr: float = 1e-6  # Peak learning rate.
    schedule: Literal["constant", "cosine", "linear"] = "constant"  # Decay after warm-up.
    warmup_steps: int = 0  # Linear warm-up steps from 0 to lr.
    weight_decay: float = 0.01  # Decoupled (AdamW) weight decay.
    b1: float = 0.9  # Adam first-moment decay.
    b2: float = 0.999  # Adam second-moment decay.
    eps: float = 1e-8  # Adam denominator epsilon.
    grad_clip: float = 1.0  # Global gradient-norm clip; 0 = off.

    def validate(self) -> None:
        _require(self.lr > 0, "lr", self.lr, "must be > 0")
        _require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        _require(0 <= self.b1 < 1, "b1", self.b1, "must be in [0, 1)")
        _require(0 <= self.b2 < 1, "b2", self.b2, "must be in [0, 1)")
        _require(self.eps > 0, "eps", self.eps, "must be > 0")
        _require(self.grad_clip >= 0, "grad_clip", self.grad_clip, "must be >= 0 (0 = off)")


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Section):
    """Length of the run, its seed, logging and where it writes."""

    steps: int = 500  # Training steps.
    seed: int = 0  # Seed of the run's PRNG key and of the data order.
    log_every: int = 1  # Steps between metric logs.
    samples_every: int = 10  # Steps between dumps of sample rollouts; 0 = never.
    workdir: str | None = None  # Folder for checkpoints, metrics and samples; None = none.
    resume_step: int | None = None  # Resume from this step (later ones are set aside).
    # JAX's persistent compilation cache (later runs load compiled programs); null = off.
    compile_cache: str | None = "~/.cache/sage_jax/xla"
    # Compile the step's programs for this run's devices before the weights load, print their
    # memory (`python -m sage_jax.aot`) and stop when one does not fit.
    aot_check: bool = False

    def validate(self) -> None:
        _require(self.steps >= 0, "steps", self.steps, "must be >= 0")
        _require(self.seed >= 0, "seed", self.seed, "must be >= 0")
        _require(self.log_every >= 1, "log_every", self.log_every, "must be >= 1")
        _require(self.resume_step is None or self.resume_step >= 0, "resume_step",
                 self.resume_step, "must be >= 0 (or null: the latest good checkpoint)")
        _require(self.samples_every >= 0, "samples_every", self.samples_every,
                 "must be >= 0 (0 = never)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(_Section):
    """How often the whole train state is saved, and how many saves are kept."""

    every: int = 50  # Steps between checkpoints; 0 = only at the end.
    keep: int = 3  # Most recent checkpoints kept.
    checksums: bool = True  # CRC-32 of each saved file, checked before a resume restores it.

    def validate(self) -> None:
        _require(self.every >= 0, "every", self.every, "must be >= 0")
        _require(self.keep >= 1, "keep", self.keep, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class MeshConfig(_Section):
    """Device mesh axis sizes; -1 = all devices left over. One axis takes the rest: fsdp or
    tensor when set to -1 (then data's default -1 counts as 1), else data."""

    data: int = -1  # Data-parallel axis.
    fsdp: int = 1  # Fully-sharded parameter axis.
    tensor: int = 1  # Tensor-parallel axis.

    def validate(self) -> None:
        for name in ("data", "fsdp", "tensor"):
            value = getattr(self, name)
            _require(value == -1 or value >= 1, name, value, "must be >= 1, or -1 for the rest")
        if [self.fsdp, self.tensor].count(-1) > 1:
            raise ConfigError(f"at most one of mesh.fsdp and mesh.tensor may be -1, got "
                              f"fsdp={self.fsdp}, tensor={self.tensor}")

    def sizes(self) -> tuple[int, int, int]:
        """(data, fsdp, tensor) with at most one -1 left (data's -1 yields to fsdp/tensor)."""
        data = 1 if self.data == -1 and -1 in (self.fsdp, self.tensor) else self.data
        return data, self.fsdp, self.tensor


@dataclasses.dataclass(frozen=True)
class LoggingConfig(_Section):
    """Where metrics go besides metrics.jsonl and TensorBoard: Weights & Biases."""

    wandb: bool = False  # Log to W&B (needs the wandb package); WANDB_* variables apply.
    project: str = "sage_jax"  # W&B project.
    entity: str | None = None  # W&B team or user; None = the default of the API key.
    name: str | None = None  # W&B run name; None = the run folder's name.
    tags: tuple[str, ...] = ()  # W&B run tags.
    mode: Literal["online", "offline", "disabled"] | None = None  # None = WANDB_MODE or online.


@dataclasses.dataclass(frozen=True)
class EvalConfig(_Section):
    """Hint-free evaluation: avg@k accuracy on benchmark files."""

    every: int = 0  # Steps between evaluations during training; 0 = off.
    benchmarks: tuple[str, ...] = PAPER_BENCHMARKS  # Benchmark names (files in data_dir).
    k: int = 16  # Samples per problem; the score is their mean accuracy (avg@k).
    temperature: float = 0.6  # Sampling temperature.
    top_p: float = 0.95  # Nucleus sampling mass.
    max_new_tokens: int = 8192  # Longest answer.
    data_dir: str | None = None  # Folder of benchmark files; None = the evaluator's default.
    limit: int | None = None  # Problems per benchmark (the first ones); None = all.

    def validate(self) -> None:
        _require(self.every >= 0, "every", self.every, "must be >= 0 (0 = off)")
        _require(self.k >= 1, "k", self.k, "must be >= 1")
        _require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _require(self.limit is None or self.limit >= 1, "limit", self.limit,
                 "must be >= 1, or null for all")


@dataclasses.dataclass(frozen=True)
class ToyConfig(_Section):
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

    def validate(self) -> None:
        _require(1 <= self.min_steps <= self.max_steps <= 20, "task.toy.min_steps/max_steps",
                 (self.min_steps, self.max_steps), "need 1 <= min_steps <= max_steps <= 20")
        for key in ("problems", "calibrate_per_length", "eval_per_length", "eval_samples"):
            _require(getattr(self, key) >= 1, f"task.toy.{key}", getattr(self, key), ">= 1")
        _require(self.sft_steps >= 0, "task.toy.sft_steps", self.sft_steps, ">= 0")
        _require(0 <= self.sft_target_step_acc < 1, "task.toy.sft_target_step_acc",
                 self.sft_target_step_acc, "in [0, 1)")


@dataclasses.dataclass(frozen=True)
class WordsConfig(_Section):
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
        _require(1 <= self.min_steps <= self.max_steps <= 12, "task.words.min_steps/max_steps",
                 (self.min_steps, self.max_steps), "need 1 <= min_steps <= max_steps <= 12")
        for key in ("problems", "sft_batch_size", "eval_per_length"):
            _require(getattr(self, key) >= 1, f"task.words.{key}", getattr(self, key), ">= 1")
        _require(self.sft_steps >= 0, "task.words.sft_steps", self.sft_steps, ">= 0")
        _require(self.sft_lr > 0, "task.words.sft_lr", self.sft_lr, "> 0")
        for key in ("sft_write_share", "sft_hinted_share"):
            _require(0 <= getattr(self, key) <= 1, f"task.words.{key}", getattr(self, key),
                     "in [0, 1]")
        _require(self.sft_write_share + self.sft_hinted_share <= 1, "task.words.sft_*_share",
                 self.sft_write_share + self.sft_hinted_share, "shares sum to at most 1")


@dataclasses.dataclass(frozen=True)
class TaskConfig(_Section):
    """Which task supplies problems, prompts and rewards."""

    # math: chat-template prompts on data files; toy: built-in task; words: generated word
    # problems on a Hugging Face model (model.path) warm-started on them.
    name: Literal["math", "toy", "words"] = "math"
    toy: ToyConfig = dataclasses.field(default_factory=ToyConfig)  # Used when name is toy.
    words: WordsConfig = dataclasses.field(default_factory=WordsConfig)  # When name is words.


@dataclasses.dataclass(frozen=True)
class Config(_Section):
    """A whole run."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    hint: HintConfig = dataclasses.field(default_factory=HintConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)

    def validate(self) -> None:
        """Rules that span sections."""
        rl = self.rl
        if rl.prompts_per_step % rl.minibatches:
            raise ConfigError(
                f"rl.prompts_per_step={rl.prompts_per_step} must be divisible by "
                f"rl.minibatches={rl.minibatches}")
        sequences = rl.prompts_per_step * rl.group_size // rl.minibatches
        if (rl.micro_batch_size is not None and rl.micro_batch_size < sequences
                and sequences % rl.micro_batch_size):
            raise ConfigError(
                f"rl.micro_batch_size={rl.micro_batch_size} must divide the {sequences} "
                f"sequences of a minibatch (rl.prompts_per_step * rl.group_size / "
                f"rl.minibatches)")
        hinted = rl.method in ("sage", "sage_light")
        if hinted and self.hint.source == "column" and self.data.hint_key is None:
            raise ConfigError(
                "hint.source='column' reads hints from the data: set data.hint_key")
        if (hinted and self.hint.source != "column" and self.data.layout == "plain"
                and self.data.solution_key is None):
            raise ConfigError(
                f"rl.method={rl.method!r} with hint.source={self.hint.source!r} takes hints "
                f"from reference solutions: set data.solution_key")


# ----------------------------------------------------------------------------------------------
# Mechanism: dict <-> dataclass with strict checking, YAML, overrides. Knows nothing of the schema.


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The resolved type of every field of dataclass `cls`, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the schema rooted at `cls`, sections included."""
    keys = []
    for name, tp in _field_types(cls).items():
        keys.append(_join(prefix, name))
        if _is_section(tp):
            keys += _all_keys(tp, _join(prefix, name))
    return keys


def _unknown_key(cls: type, name: str, prefix: str, root: type) -> ConfigError:
    """The error for key `name` not being a field of section `cls` (at dotted `prefix`)."""
    key = _join(prefix, name)
    match = difflib.get_close_matches(name, list(_field_types(cls)), n=1)
    suggestion = _join(prefix, match[0]) if match else None
    if suggestion is None:  # Maybe the right field in the wrong section, e.g. `group_size`.
        leaves = {k.rsplit(".", 1)[-1]: k for k in _all_keys(root)}
        match = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.8)
        suggestion = leaves[match[0]] if match else None
    hint = f" (did you mean '{suggestion}'?)" if suggestion else ""
    return ConfigError(f"unknown config key '{key}'{hint}", key=key)


def _type_name(tp: Any) -> str:
    """A readable name for type annotation `tp`, e.g. 'int or null', 'list of str'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}"
    if _is_section(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str, root: type) -> Any:
    """`value` checked against (and, where lossless, coerced to) type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_section(tp):
        value = {} if value is None else value  # An empty YAML section reads as null.
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"config key '{key}' is a section and expects a mapping, got {value!r}", key=key)
        return _build(tp, value, key, root)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _convert(value, arg, key, root)
                except ConfigError:
                    pass
    elif origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise ConfigError(
            f"invalid value {value!r} for config key '{key}': allowed values are "
            + ", ".join(repr(a) for a in args), key=key)
    elif origin in (list, tuple):
        if value is None or isinstance(value, Mapping):
            raise ConfigError(f"invalid value {value!r} for config key '{key}': expected "
                              f"{_type_name(tp)}", key=key)
        items = list(value) if isinstance(value, (list, tuple)) else [value]  # a -> [a]
        converted = [_convert(v, args[0], f"{key}[{i}]", root) for i, v in enumerate(items)]
        return tuple(converted) if origin is tuple else converted
    elif tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads `1e-6` (no dot) as a string.
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"config key '{key}' has an unsupported annotation {tp!r}")
    raise ConfigError(
        f"invalid value {value!r} ({type(value).__name__}) for config key '{key}': "
        f"expected {_type_name(tp)}", key=key)


def _build(cls: type, data: Mapping[str, Any], prefix: str, root: type) -> Any:
    """An instance of section `cls` from mapping `data`; missing keys take their defaults."""
    fields = _field_types(cls)
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            raise _unknown_key(cls, str(name), prefix, root)
        kwargs[name] = _convert(value, fields[name], _join(prefix, name), root)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if e.key is None or not prefix:
            raise
        key = _join(prefix, e.key)
        raise ConfigError(str(e).replace(f"'{e.key}'", f"'{key}'", 1), key=key) from None


def from_dict(data: Mapping[str, Any], cls: type = Config) -> Any:
    """A config (`Config` unless `cls` says otherwise) from a nested mapping, strictly checked."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {data!r}")
    return _build(cls, data, "", cls)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts, lists and scalars (what YAML holds)."""
    def plain(x: Any) -> Any:
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x
    return plain(cfg)


def to_yaml(cfg: Any) -> str:
    """The config as a YAML document that `load_config` reads back to an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: Any, path: str | Path) -> None:
    """Writes `to_yaml(cfg)` to `path`, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))


def _check_keys(data: Any, cls: type, prefix: str, root: type) -> None:
    """Raises for the first key in nested mapping `data` that is not in the schema."""
    if not isinstance(data, Mapping):
        return
    fields = _field_types(cls)
    for name, value in data.items():
        if name not in fields:
            raise _unknown_key(cls, str(name), prefix, root)
        if _is_section(fields[name]):
            _check_keys(value, fields[name], _join(prefix, name), root)


def _override_value(raw: str, tp: Any) -> Any:
    """Override text parsed as YAML, except that a `str` field keeps the text as written."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union,
                                                            types.UnionType) else (tp,)
    if str in args and value is not None and not isinstance(value, (str, list, dict)):
        return raw.strip()  # `data.hint_key=2024` or `model.path=1.10` stay text.
    return value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str],
                    cls: type = Config) -> dict[str, Any]:
    """A copy of nested mapping `data` with `a.b=value` overrides applied (values are YAML)."""
    result = _copy_dict(data)
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        section, node, prefix = cls, result, ""
        parts = key.split(".")
        for i, name in enumerate(parts):
            fields = _field_types(section)
            if name not in fields:
                raise _unknown_key(section, name, prefix, cls)
            tp = fields[name]
            prefix = _join(prefix, name)
            if i == len(parts) - 1:
                value = _override_value(raw, tp)
                if _is_section(tp) and isinstance(value, Mapping) and isinstance(
                        node.get(name), Mapping):
                    value = {**node[name], **value}
                node[name] = value
            elif not _is_section(tp):
                raise ConfigError(f"config key '{prefix}' is not a section, so "
                                  f"'{key}' does not exist", key=key)
            else:
                if not isinstance(node.get(name), dict):
                    node[name] = {}
                section, node = tp, node[name]
    return result


def _copy_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of nested mapping `data` whose mappings are plain dicts."""
    return {k: _copy_dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def resolve_config_path(path: str | Path) -> Path:
    """`path` when it is a file, else the shipped config of that name (`CONFIG_DIR`), else
    `path` unchanged (so the error names what the user wrote)."""
    path = Path(path)
    if path.is_file():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else path.name + ".yaml"
    shipped = CONFIG_DIR / name
    if shipped.is_file() and (len(path.parts) == 1 or path.parent.name == "configs"):
        return shipped
    return path


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at `path` (if any), then `overrides`; strictly checked."""
    data: Any = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte "
                              f"{e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        try:
            _check_keys(data, Config, "", Config)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}", key=e.key) from None
    try:
        return from_dict(apply_overrides(data, overrides))
    except ConfigError as e:
        if path is None:
            raise
        try:
            from_dict(data)
        except ConfigError:  # the file itself is invalid (not only with the overrides): name it
            raise ConfigError(f"{path}: {e}", key=e.key) from None
        raise
