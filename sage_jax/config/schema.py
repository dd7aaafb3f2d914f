"""The run configuration's schema: one frozen dataclass per section, with the paper's defaults
(arXiv 2602.03143) and each section's range checks.

Sections are frozen dataclasses (hashable, so they can be static arguments to `jax.jit`); list
fields are therefore tuples. Each section checks its own ranges in `validate()`; `Config.validate()`
checks rules that span sections. Both run on construction, so a `Config` is always valid. Reading
and writing configs (YAML, overrides, strict key checks) is `loader.py`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeVar


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names the key and what is allowed."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key  # The field a section's `validate()` complained about, if any.


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raises a `ConfigError` for `key` unless `ok`; `allowed` says which values are valid."""
    if not ok:
        raise ConfigError(f"invalid value {value!r} for config key '{key}': {allowed}", key=key)


def check_sampling(temperature: float, top_p: float = 1.0, top_k: int = 0) -> None:
    """The sampling knobs' ranges, the one check of every config section and sampler call that
    sets them: temperature >= 0 (0 = greedy), top_p in (0, 1], top_k an integer >= 0 (0 = off)."""
    for ok, key, value, allowed in (
            (temperature >= 0, "temperature", temperature, "must be >= 0 (0 = greedy)"),
            (0 < top_p <= 1, "top_p", top_p, "must be in (0, 1]"),
            (int(top_k) == top_k and top_k >= 0, "top_k", top_k,
             "must be an integer >= 0 (0 = off)")):
        if not ok:
            raise ConfigError(f"invalid value {value!r} for sampling knob '{key}': {allowed}",
                              key=key)


class Section:
    """Base of all config sections: runs `validate()` whenever a section is constructed."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks value ranges; raises `ConfigError` on the first violation."""


S = TypeVar("S", bound=Section)


# ----------------------------------------------------------------------------------------------
# Schema.

DType = Literal["float32", "bfloat16"]

PAPER_BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench")


# The decoder's projections that can carry LoRA adapters (`models.decoder.LORA_TARGETS`).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig(Section):
    """LoRA: low-rank adapters on some projections are trained, the base weights stay frozen.
    Each targeted projection computes y = x W + (x A) B * alpha / rank."""

    rank: int = 0  # r of the adapters A [in, r] and B [r, out]; 0 = off (full fine-tuning).
    alpha: float = 16.0  # The adapters' scale is alpha / rank (as PEFT's lora_alpha).
    targets: tuple[str, ...] = LORA_TARGETS  # The projections (of every layer) given adapters.

    def validate(self) -> None:
        require(self.rank >= 0, "rank", self.rank, "must be >= 0 (0 = off)")
        require(self.alpha > 0, "alpha", self.alpha, "must be > 0")
        require(len(self.targets) > 0 and all(t in LORA_TARGETS for t in self.targets),
                "targets", self.targets,
                f"a non-empty list of the projections {', '.join(LORA_TARGETS)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """Which policy model to train and at what precision."""

    path: str | None = None  # Hugging Face checkpoint folder; None = the built-in tiny model.
    dtype: DType = "bfloat16"  # Dtype the parameters are stored in.
    compute_dtype: DType = "bfloat16"  # Dtype of activations and matmuls.
    remat: bool = True  # Recompute each layer's activations in the backward pass to save memory.
    master_fp32: bool = True  # Keep float32 master weights for the optimiser when dtype is bf16.
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # LoRA (rank 0: off).


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
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
        require(self.max_prompt_tokens >= 1, "max_prompt_tokens", self.max_prompt_tokens,
                 "must be >= 1")
        for name in ("problem_key", "answer_key", "solution_key", "hint_key", "index_key"):
            value = getattr(self, name)
            require(value is None or value.strip() != "", name, value,
                     "must be a non-empty field name")


HINTED_METHODS = ("sage", "sage_light")  # rl.method values that take hints (`RLConfig.hinted`)


@dataclasses.dataclass(frozen=True)
class RLConfig(Section):
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
    # in another context; with rollout.engine=vllm too: the old log-probs are JAX's.
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    # Rollout correction (`core.rollout_correction`): weight the loss by the trainer's old
    # policy over the sampling engine's, per answer token in the context it was sampled in:
    # token = truncated importance weights min(r, cap); sequence = drop an answer whose ratio
    # leaves [1/cap, cap]. With it on the old log-probs are recomputed whatever old_logprobs
    # says (the sampler's would make r = 1).
    rollout_correction: Literal["none", "token", "sequence"] = "none"
    rollout_correction_cap: float = 2.0  # The cap of rollout_correction (> 1).
    # Sequence columns per chunk of logits in the update's log-probs (loss and recomputed
    # old log-probs); smaller: fewer [rows, chunk, vocab] float32 temporaries, the same values;
    # None = all columns at once.
    logprob_chunk: int | None = 256

    @property
    def hinted(self) -> bool:
        """Whether `method` takes hints (`HINTED_METHODS`)."""
        return self.method in HINTED_METHODS

    @property
    def sampler_old_logprobs(self) -> bool:
        """Whether the sampler's log-probs are the update's old ones: old_logprobs=sampler, in
        the context they were sampled in (loss_context=hinted), without a rollout correction
        (whose ratio they would make 1)."""
        return (self.old_logprobs == "sampler" and self.loss_context == "hinted"
                and self.rollout_correction == "none")

    def validate(self) -> None:
        require(self.group_size >= 2, "group_size", self.group_size,
                 "must be >= 2 (advantages compare answers within a group)")
        require(self.prompts_per_step >= 1, "prompts_per_step", self.prompts_per_step,
                 "must be >= 1")
        require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        check_sampling(self.temperature, self.top_p, self.top_k)
        require(self.temperature > 0, "temperature", self.temperature,
                "must be > 0 (a greedy group has nothing to compare)")
        require(0 <= self.clip_low < 1, "clip_low", self.clip_low, "must be in [0, 1)")
        require(self.clip_high >= 0, "clip_high", self.clip_high, "must be >= 0")
        require(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip", self.dual_clip,
                 "must be > 1, or 0 to turn dual-clip off")
        require(self.kl_beta >= 0, "kl_beta", self.kl_beta, "must be >= 0")
        require(self.logprob_chunk is None or self.logprob_chunk >= 1, "logprob_chunk",
                self.logprob_chunk, "must be >= 1, or null for all columns at once")
        require(self.minibatches >= 1, "minibatches", self.minibatches, "must be >= 1")
        require(self.micro_batch_size is None or self.micro_batch_size >= 1,
                 "micro_batch_size", self.micro_batch_size, "must be >= 1, or null for all")
        require(self.epochs_per_batch >= 1, "epochs_per_batch", self.epochs_per_batch,
                 "must be >= 1")
        require(self.collapse_std >= 0, "collapse_std", self.collapse_std, "must be >= 0")
        require(self.reward_timeout_s > 0, "reward_timeout_s", self.reward_timeout_s,
                 "must be > 0")
        require(self.rollout_correction_cap > 1, "rollout_correction_cap",
                self.rollout_correction_cap, "must be > 1")


@dataclasses.dataclass(frozen=True)
class HintConfig(Section):
    """SAGE hints: where they come from, how they are written and (sage_light) leveled."""

    # online: the current policy writes them; offline: the initial policy, once; column: a data
    # field; reference: the task's fixed rule on the reference solution (no writing); auto: the
    # toy job's calibration gate picks online or reference (reference where the gate is off;
    # `run.loop.train` rejects an unresolved auto).
    source: Literal["online", "offline", "column", "reference", "auto"] = "online"
    refresh_every: int = 1  # online: steps between rewrites of a prompt's hint; 0 = never.
    temperature: float = 0.0  # Sampling temperature when writing hints; 0 = greedy.
    max_new_tokens: int = 512  # Longest hint payload the policy may write.
    retries: int = 2  # Extra attempts after an unparseable hint payload.
    low: float = 0.1  # sage_light: raise the level when last accuracy <= low.
    high: float = 0.35  # sage_light: lower the level when last accuracy > high.
    max_level: int = 3  # Highest hint level (and re-sampling rounds for sage / resample).
    # sage / resample re-sampling: sequential = one sampler call per level, for the prompts
    # still unresolved; speculative = every level of every unresolved prompt in one call, then
    # kept level by level as sequential keeps them (each row's key folds in its level, so the
    # groups kept are those of sequential escalation with the same keys; the answers of levels
    # not needed are sampled and dropped). The two draw from different keys.
    escalation: Literal["sequential", "speculative"] = "sequential"
    max_request_tokens: int = 4096  # Longer hint requests are skipped (counted), never cut.
    cache_bytes: int = 2048  # Bytes per level kept in the train state's hint cache.

    def validate(self) -> None:
        require(self.max_request_tokens >= 1, "max_request_tokens", self.max_request_tokens,
                 "must be >= 1")
        require(self.cache_bytes >= 16, "cache_bytes", self.cache_bytes, "must be >= 16")
        require(self.refresh_every >= 0, "refresh_every", self.refresh_every,
                 "must be >= 0 (0 = never rewrite)")
        check_sampling(self.temperature)
        require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        require(self.retries >= 0, "retries", self.retries, "must be >= 0")
        require(0 <= self.low <= 1, "low", self.low, "must be in [0, 1]")
        require(self.low <= self.high <= 1, "high", self.high,
                 f"must be in [low, 1] = [{self.low}, 1]")
        require(self.max_level >= 1, "max_level", self.max_level, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
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
        require(self.lr > 0, "lr", self.lr, "must be > 0")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        require(0 <= self.b1 < 1, "b1", self.b1, "must be in [0, 1)")
        require(0 <= self.b2 < 1, "b2", self.b2, "must be in [0, 1)")
        require(self.eps > 0, "eps", self.eps, "must be > 0")
        require(self.grad_clip >= 0, "grad_clip", self.grad_clip, "must be >= 0 (0 = off)")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
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
        require(self.steps >= 0, "steps", self.steps, "must be >= 0")
        require(self.seed >= 0, "seed", self.seed, "must be >= 0")
        require(self.log_every >= 1, "log_every", self.log_every, "must be >= 1")
        require(self.resume_step is None or self.resume_step >= 0, "resume_step",
                 self.resume_step, "must be >= 0 (or null: the latest good checkpoint)")
        require(self.samples_every >= 0, "samples_every", self.samples_every,
                 "must be >= 0 (0 = never)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """How often the whole train state is saved, and how many saves are kept."""

    every: int = 50  # Steps between checkpoints; 0 = only at the end.
    keep: int = 3  # Most recent checkpoints kept.
    checksums: bool = True  # CRC-32 of each saved file, checked before a resume restores it.

    def validate(self) -> None:
        require(self.every >= 0, "every", self.every, "must be >= 0")
        require(self.keep >= 1, "keep", self.keep, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """Device mesh axis sizes; -1 = all devices left over. One axis takes the rest: fsdp or
    tensor when set to -1 (then data's default -1 counts as 1), else data."""

    data: int = -1  # Data-parallel axis.
    fsdp: int = 1  # Fully-sharded parameter axis.
    tensor: int = 1  # Tensor-parallel axis.

    def validate(self) -> None:
        for name in ("data", "fsdp", "tensor"):
            value = getattr(self, name)
            require(value == -1 or value >= 1, name, value, "must be >= 1, or -1 for the rest")
        if [self.fsdp, self.tensor].count(-1) > 1:
            raise ConfigError(f"at most one of mesh.fsdp and mesh.tensor may be -1, got "
                              f"fsdp={self.fsdp}, tensor={self.tensor}")

    def sizes(self) -> tuple[int, int, int]:
        """(data, fsdp, tensor) with at most one -1 left (data's -1 yields to fsdp/tensor)."""
        data = 1 if self.data == -1 and -1 in (self.fsdp, self.tensor) else self.data
        return data, self.fsdp, self.tensor


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    """The engine that samples every rollout pass (the first pass, hint writing, hinted
    re-samples) and the validation, and its settings (docs/running.md, "Rollouts with vLLM")."""

    engine: Literal["native", "vllm"] = "native"  # native: the jit sampler; vllm: sage_jax[vllm].
    vllm_memory: float = 0.3  # vllm: share of the accelerator's memory for its weights and cache.
    # native: answer rows the sampler decodes at once (its KV cache's rows); None = all at once.
    # A call with more rows samples its prompts in chunks of micro_batch_size // answers-per-
    # prompt (whole groups), or, with continuous_batching, refills a finished row's slot with
    # the next pending prompt's rows (one row per group, each with its prompt's keys/values:
    # more cache than chunks). Either way the same answers: each row's randomness is its own.
    micro_batch_size: int | None = None
    continuous_batching: bool = False
    # native: compiled sampler programs kept between steps; past it, the engine drops them all
    # at its sync (the next step compiles or reloads what it needs). More: fewer recompiles,
    # more host memory (about 22 MB a program for a 30-layer 135M model). None =
    # `engine.sampler.programs.budget` of the model's layers (48 for 30 layers).
    programs_kept: int | None = None
    # native, LoRA runs (model.lora.rank > 0): false = the adapters run in place at every
    # projection, x W + (x A) B * alpha / r (no copy of the weights); true = they are folded
    # into a copy of the adapted kernels once per step (at the sync), and the plain model of
    # those samples (no adapter dots while decoding; one merged copy of those kernels held).
    # No effect at rank 0 or with vllm (it always gets the merged kernels).
    lora_merged: bool = False

    def validate(self) -> None:
        require(0 < self.vllm_memory <= 1, "vllm_memory", self.vllm_memory,
                "must be in (0, 1]")
        require(self.micro_batch_size is None or self.micro_batch_size >= 1,
                "micro_batch_size", self.micro_batch_size, "must be >= 1, or null for all")
        require(self.programs_kept is None or self.programs_kept >= 0, "programs_kept",
                self.programs_kept, "must be >= 0, or null for the model's default")


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    """Where metrics go besides metrics.jsonl and TensorBoard: Weights & Biases."""

    wandb: bool = False  # Log to W&B (needs the wandb package); WANDB_* variables apply.
    project: str = "sage_jax"  # W&B project.
    entity: str | None = None  # W&B team or user; None = the default of the API key.
    name: str | None = None  # W&B run name; None = the run folder's name.
    tags: tuple[str, ...] = ()  # W&B run tags.
    mode: Literal["online", "offline", "disabled"] | None = None  # None = WANDB_MODE or online.


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """Hint-free evaluation: avg@k accuracy on benchmark files."""

    every: int = 0  # Steps between evaluations during training; 0 = off.
    benchmarks: tuple[str, ...] = PAPER_BENCHMARKS  # Benchmark names (files in data_dir).
    k: int = 16  # Samples per problem; the score is their mean accuracy (avg@k).
    temperature: float = 0.6  # Sampling temperature.
    top_p: float = 0.95  # Nucleus sampling mass.
    max_new_tokens: int = 8192  # Longest answer.
    data_dir: str | None = None  # Folder of benchmark files; None = their Hub datasets.
    limit: int | None = None  # Problems per benchmark (the first ones); None = all.

    def validate(self) -> None:
        require(self.every >= 0, "every", self.every, "must be >= 0 (0 = off)")
        require(self.k >= 1, "k", self.k, "must be >= 1")
        check_sampling(self.temperature, self.top_p)
        require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        require(self.limit is None or self.limit >= 1, "limit", self.limit,
                 "must be >= 1, or null for all")


@dataclasses.dataclass(frozen=True)
class TaskConfig(Section):
    """Which task supplies problems, prompts and rewards, and the task plug-ins' own sections.

    A plug-in (`sage_jax.tasks.registry`) may bring a section of its own settings, written
    `task.<name>.<key>` in YAML and overrides; `section(cls)` reads it. Only a loader given the
    task table knows those sections (`sage_jax.tasks.registry.load_config`)."""

    name: str = "math"  # A task of the task table: math (data files), toy, words, ...
    sections: tuple[tuple[str, Section], ...] = ()  # (task name, its plug-in's section).

    def validate(self) -> None:
        require(self.name.strip() != "", "name", self.name, "a task name")

    def section(self, cls: type[S]) -> S:
        """The plug-in section of type `cls` (its defaults when the config holds none)."""
        for _, section in self.sections:
            if isinstance(section, cls):
                return section
        return cls()


@dataclasses.dataclass(frozen=True)
class Config(Section):
    """A whole run."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
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
        rows = self.rollout.micro_batch_size
        if rows is not None and rows < rl.group_size:
            raise ConfigError(
                f"rollout.micro_batch_size={rows} must be >= rl.group_size={rl.group_size} (a "
                f"group is sampled whole), or null for all", key="rollout.micro_batch_size")
        hinted = rl.hinted
        if hinted and self.hint.source == "column" and self.data.hint_key is None:
            raise ConfigError(
                "hint.source='column' reads hints from the data: set data.hint_key")
        if (hinted and self.hint.source != "column" and self.data.layout == "plain"
                and self.data.solution_key is None):
            raise ConfigError(
                f"rl.method={rl.method!r} with hint.source={self.hint.source!r} takes hints "
                f"from reference solutions: set data.solution_key")

    @property
    def writes_hints(self) -> bool:
        """Whether the policy writes hints during the run (a hinted method whose hint source is
        online, offline, or auto, which may resolve to online)."""
        return self.rl.hinted and self.hint.source in ("online", "offline", "auto")

    def sample_prompt_len(self, prompt_len: int | None = None) -> int:
        """The longest prompt the rollout samples from: `prompt_len` (default
        data.max_prompt_tokens), plus hint.max_new_tokens for a hinted method's prompts."""
        return ((prompt_len or self.data.max_prompt_tokens)
                + (self.hint.max_new_tokens if self.rl.hinted else 0))
