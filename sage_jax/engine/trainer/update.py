"""The GRPO update: AdamW, and a jitted, sharded `train_step(state, batch) -> (state, metrics)`.

The rows (N = B*G rows, L = prompt + answer columns; rows may be in any order), in their padded
layout, the one callers build by hand:
  tokens_NxL     int32  the prompt, then the answer; padding before or after (positions count
                        valid tokens only, so both give the same log-probs)
  mask_NxL       bool   valid tokens (prompt and answer)
  loss_mask_NxL  bool   answer tokens, end-of-sequence included: the tokens that get gradient
  advantages_N   f32    one advantage per answer (`grpo.group_advantages`, flattened)
  old_logp_NxL   f32    optional: log p_old(tokens[t] | <t) on loss-mask columns; recomputed
                        from the state's params before the first update when absent
  ref_logp_NxL   f32    optional: the frozen reference's log-probs; required when rl.kl_beta > 0
  sampler_logp_NxL  f32  optional: the sampling engine's log-probs of the answer tokens;
                        required with a rollout correction (rl.rollout_correction)
  sampled_logp_NxL  f32  optional: the trainer's old log-probs of the answer tokens in the
                        context they were sampled in, when that is not the loss's (hinted rows
                        under rl.loss_context=plain); absent, the old log-probs are used
  level_N        int8   optional: the hint level of the row's group (0: no hint)
  collapse_N     int8   optional: the group's first-pass status (`core.sage.COLLAPSE_*` codes:
                        0 mixed, 1 all-zero, 2 all-one), before any hint or re-sample

`train_step` takes one form, the packed one (`packing`: Z sequences of L columns, whole
rows end to end per mini-batch, `PACKED_REQUIRED` and `PACKED_OPTIONAL`): `pack_batch` packs a
padded batch in sequences of the run's longest row (the cost follows the micro-batches that hold
rows, one without answer tokens is skipped, and a run compiles one program);
`packing.as_packed` keeps one row per sequence (no packing). Both give the same loss and
gradients; the trainer builds its packed batch directly (`rl.batching.update_batch`).

One step = `rl.epochs_per_batch` passes over `rl.minibatches` optimiser updates. Mini-batch j
holds rows j*U .. j*U+U-1 of every block of M*U rows (M mini-batches of U micro-batches), i.e.
rows are dealt out in stripes, so every device holds an equal share of every (micro-)batch
without moving data; shuffle rows beforehand for random mini-batches. A mini-batch is split into
micro-batches of `rl.micro_batch_size` rows (all devices together; at most the mini-batch)
whose gradients are summed; the loss denominators (answer tokens, or sequences for the seq-mean
modes) are those of the whole mini-batch, so the result does not depend on the micro-batch size.
Without given old log-probs and with one epoch, mini-batch 0 is only met by the first update,
on the sampling params: its old log-probs are that update's own (stop-gradient), not recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sage_jax.config import Config, OptimConfig, RLConfig
from sage_jax.core import grpo, rollout_correction, sage
from sage_jax import models
from sage_jax.infra import parallel
from sage_jax.engine.trainer import packing
from sage_jax.engine.trainer.state import TrainState, master_params, trainable_split

PACKED_REQUIRED = ("tokens_ZxL", "segments_ZxL", "loss_mask_ZxL", "advantages_ZxL",
                   "answer_len_ZxL", "advantages_N", "answer_len_N")
PACKED_OPTIONAL = ("old_logp_ZxL", "ref_logp_ZxL", "sampler_logp_ZxL", "sampled_logp_ZxL",
                   "level_N", "collapse_N")
DEFAULT_CHUNK = RLConfig.logprob_chunk  # Sequence columns per chunk of logits in the loss.


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """The settings the update reads; `of(cfg)` takes them from a run's config."""

    minibatches: int  # rl.minibatches: M optimiser updates per pass
    micro_batch_size: int | None  # rl.micro_batch_size: rows per micro-batch (None: all)
    epochs_per_batch: int  # rl.epochs_per_batch: passes over a step's batch
    clip_low: float  # rl.clip_low, rl.clip_high, rl.dual_clip: the clipped objective
    clip_high: float
    dual_clip: float
    kl_beta: float  # rl.kl_beta: weight of the KL to the reference (0: none)
    loss_agg: str  # rl.loss_agg
    norm_len: int  # rl.max_new_tokens: the length seq-mean-token-sum-norm divides by
    row_len: int  # columns of every packed sequence (`row_len`)
    optim: OptimConfig
    total_updates: int  # optimiser updates in the whole run (the lr schedule's length)
    seed: int  # train.seed: the state's rng
    master_fp32: bool  # model.master_fp32: float32 master params
    logprob_chunk: int | None = DEFAULT_CHUNK  # rl.logprob_chunk: columns per chunk of logits
    rollout_correction: str = "none"  # rl.rollout_correction: none, token or sequence
    rollout_correction_cap: float = 2.0  # rl.rollout_correction_cap
    lora: bool = False  # model.lora.rank > 0: the adapters are trained, the base is frozen

    @classmethod
    def of(cls, cfg: Config) -> UpdateSettings:
        rl = cfg.rl
        return cls(minibatches=rl.minibatches, micro_batch_size=rl.micro_batch_size,
                   epochs_per_batch=rl.epochs_per_batch, clip_low=rl.clip_low,
                   clip_high=rl.clip_high, dual_clip=rl.dual_clip, kl_beta=rl.kl_beta,
                   loss_agg=rl.loss_agg, norm_len=rl.max_new_tokens, row_len=row_len(cfg),
                   optim=cfg.optim, total_updates=total_updates(cfg), seed=cfg.train.seed,
                   master_fp32=cfg.model.master_fp32, logprob_chunk=rl.logprob_chunk,
                   rollout_correction=rl.rollout_correction,
                   rollout_correction_cap=rl.rollout_correction_cap,
                   lora=cfg.model.lora.rank > 0)


def total_updates(cfg: Config) -> int:
    """Optimiser updates in a whole run: train.steps * rl.minibatches * rl.epochs_per_batch."""
    return max(cfg.train.steps * cfg.rl.minibatches * cfg.rl.epochs_per_batch, 1)


def row_len(cfg: Config) -> int:
    """Columns of the run's longest training row (`Config.sample_prompt_len` and the longest
    answer), as `packing.length_bucket` pads it: the width of every packed batch."""
    return packing.length_bucket(cfg.sample_prompt_len() + cfg.rl.max_new_tokens)


def make_schedule(optim_cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate per optimiser update: linear warm-up from 0 over `warmup_steps`, then
    constant, cosine or linear decay to 0 at `total_steps`."""
    lr, warm = optim_cfg.lr, optim_cfg.warmup_steps
    decay = max(total_steps - warm, 1)
    main = {"constant": lambda: optax.constant_schedule(lr),
            "cosine": lambda: optax.cosine_decay_schedule(lr, decay),
            "linear": lambda: optax.linear_schedule(lr, 0.0, decay)}[optim_cfg.schedule]()
    if not warm:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), main], [warm])


def make_optimizer(optim_cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) (skipped when 0) then AdamW with the lr schedule."""
    adamw = optax.adamw(make_schedule(optim_cfg, total_steps), b1=optim_cfg.b1, b2=optim_cfg.b2,
                        eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay)
    if not optim_cfg.grad_clip:
        return adamw
    return optax.chain(optax.clip_by_global_norm(optim_cfg.grad_clip), adamw)


def init_train_state(model: models.Decoder, settings: UpdateSettings, mesh: Mesh
                     ) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, TrainState) for `model` at step 0, params and optimiser state placed on
    `mesh` by the partition rules (rng from train.seed). A ValueError when the model has LoRA
    adapters and the settings do not train them, or the other way round."""
    graphdef, params = models.split(model)
    adapters = bool(jax.tree.leaves(trainable_split(params)[0]))
    if adapters != settings.lora:
        raise ValueError(
            "model.lora.rank > 0 but the model has no LoRA adapters (models.with_lora adds "
            "them)" if settings.lora else "the model has LoRA adapters but model.lora.rank is "
            "0 (full fine-tuning would train them as well)")
    init = functools.partial(new_state, settings=settings)
    shardings = parallel.tree_shardings(jax.eval_shape(init, params), mesh)
    return graphdef, jax.jit(init, out_shardings=shardings)(params)


def new_state(params: nnx.State, settings: UpdateSettings) -> TrainState:
    """The `TrainState` at step 0 of the model parameters `params` (float32 masters with
    model.master_fp32, AdamW of `optim`, rng from train.seed; with LoRA, masters and AdamW
    state for the adapters only); pure, for jit or eval_shape."""
    if settings.lora:
        trained, frozen = trainable_split(params)
        trained = master_params(trained, settings.master_fp32)
        params = nnx.merge_state(trained, frozen)
    else:
        params = trained = master_params(params, settings.master_fp32)
    opt = make_optimizer(settings.optim, settings.total_updates)
    return TrainState(params=params, opt_state=opt.init(trained),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(settings.seed),
                      data_position=jnp.zeros((), jnp.int32))


def batch_split(n: int, settings: UpdateSettings) -> tuple[int, int, int]:
    """(minibatches M, micro-batches per mini-batch U, rows per micro-batch R) for N rows."""
    m = settings.minibatches
    if n % m:
        raise ValueError(f"batch has {n} rows, not divisible by rl.minibatches={m}")
    r = min(settings.micro_batch_size or n // m, n // m)  # a smaller mini-batch is one pass
    if (n // m) % r:
        raise ValueError(f"rl.micro_batch_size={r} does not divide the {n // m} rows of a "
                         f"mini-batch ({n} rows / rl.minibatches={m})")
    return m, n // m // r, r


def pack_batch(batch: dict, settings: UpdateSettings) -> dict:
    """The packed form (`packing`) of a padded numpy batch, for the run's mini-batches,
    in sequences of its longest row (`row_len`): every step's batch has one shape."""
    m, u, r = batch_split(len(batch["advantages_N"]), settings)
    return packing.pack(batch, minibatches=m, micro_batches=u, micro_rows=r,
                        width=settings.row_len)


def check_batch(batch: dict, settings: UpdateSettings, mesh: Mesh) -> None:
    """Raises a ValueError naming the key if `batch` is not the packed form above, or does not
    fit the mesh."""
    required, optional, tokens = PACKED_REQUIRED, PACKED_OPTIONAL, "tokens_ZxL"
    unknown = set(batch) - set(required) - set(optional)
    if unknown:
        padded = " (a padded batch: pack it, `pack_batch` or `packing.as_packed`)" if any(
            k.endswith("_NxL") for k in unknown) else ""
        raise ValueError(f"unknown batch keys {sorted(unknown)}{padded}; valid: "
                         f"{required + optional}")
    for key in required:
        if key not in batch:
            raise ValueError(f"batch is missing {key!r} (required: {required})")
    ref = "ref_logp_ZxL"
    if settings.kl_beta > 0 and ref not in batch:
        raise ValueError(f"rl.kl_beta={settings.kl_beta} needs {ref!r} in the batch")
    engine = "sampler_logp_ZxL"
    if settings.rollout_correction != "none" and engine not in batch:
        raise ValueError(f"rl.rollout_correction={settings.rollout_correction!r} needs "
                         f"{engine!r} (the sampling engine's log-probs) in the batch")
    shape = tuple(batch[tokens].shape)
    if len(shape) != 2 or not jnp.issubdtype(batch[tokens].dtype, jnp.integer):
        raise ValueError(f"batch[{tokens!r}] must be an integer 2-D array, got "
                         f"{batch[tokens].dtype}{list(shape)}")
    n = batch["advantages_N"].shape[0]
    for key in required + optional:
        if key in batch and key.endswith("xL") and tuple(batch[key].shape) != shape:
            raise ValueError(f"batch[{key!r}] has shape {list(batch[key].shape)}, expected "
                             f"{list(shape)} like {tokens}")
        if key in batch and key.endswith("_N") and tuple(batch[key].shape) != (n,):
            raise ValueError(f"batch[{key!r}] has shape {list(batch[key].shape)}, "
                             f"expected [{n}]")
    parallel.check_rows(n, mesh)
    m, _, r = batch_split(n, settings)
    parallel.check_rows(r, mesh, f"a micro-batch (rl.micro_batch_size={r})")
    if shape[0] != n:
        raise ValueError(f"a packed batch has as many sequences as rows ({n}: {m} "
                         f"mini-batches of {n // m // r} micro-batches of {r}), got {shape[0]} "
                         f"(engine.trainer.packing)")


def _micro_loss(params, mb, denoms, fresh=False, *, graphdef, settings: UpdateSettings, chunk,
                remat_logits, rows, frozen=None):
    """(loss, metrics) of one micro-batch; losses and metrics add up over a mini-batch.
    `fresh`: `params` are the ones the answers were sampled with, so the old log-probs are the
    current ones (not recomputed: the ratio is exactly 1). `frozen`: the model's parameters
    that `params` (then the trained part, with LoRA) lacks."""
    tok_denom, seq_denom = denoms
    loss_mask = mb["loss_mask_ZxL"]
    model = (nnx.merge(graphdef, params) if frozen is None
             else nnx.merge(graphdef, params, frozen))
    h = jax.lax.with_sharding_constraint(
        model.packed_hidden(mb["tokens_ZxL"], mb["segments_ZxL"]),
        rows)  # keep rows split (not D) for the logits
    logp, ent = grpo.logprobs_from_hidden(model.logits, h, mb["tokens_ZxL"], loss_mask,
                                          chunk=chunk, remat_logits=remat_logits)
    agg: dict[str, Any] = dict(agg=settings.loss_agg, norm_len=settings.norm_len,
                               row_len_ZxL=mb["answer_len_ZxL"],
                               denom=tok_denom if settings.loss_agg == "token-mean"
                               else seq_denom)
    old = jnp.where(fresh, jax.lax.stop_gradient(logp), mb["old_logp_ZxL"])
    weights, correction = None, {}
    if settings.rollout_correction != "none":
        sampled = mb.get("sampled_logp_ZxL", old)  # the trainer's, in the sampled context
        weights, ratio, changed = rollout_correction.weights(
            sampled, mb["sampler_logp_ZxL"], loss_mask, mode=settings.rollout_correction,
            cap=settings.rollout_correction_cap, segments_ZxL=mb["segments_ZxL"])
        correction = rollout_correction.metrics(ratio, changed, loss_mask, tok_denom)
    pg, metrics = grpo.policy_loss(logp, old, mb["advantages_ZxL"], loss_mask,
                                   clip_low=settings.clip_low, clip_high=settings.clip_high,
                                   dual_clip=settings.dual_clip, token_denom=tok_denom,
                                   weights_NxT=weights, **agg)
    metrics.update(correction)
    loss = pg
    if settings.kl_beta > 0:
        kl = grpo.aggregate(grpo.kl_k3(logp, mb["ref_logp_ZxL"]), loss_mask, **agg)
        loss = loss + settings.kl_beta * kl
        metrics["kl/ref"] = jax.lax.stop_gradient(kl)
    metrics.update(loss=jax.lax.stop_gradient(loss), pg_loss=jax.lax.stop_gradient(pg),
                   entropy=jnp.sum(jnp.where(loss_mask, ent, 0.0)) / tok_denom)
    return loss, metrics


def _prepare(params, batch, *, graphdef, settings, mesh, chunk, skip_first=False):
    """The per-token arrays of a packed batch split to [M, U, R, ...] (sequence
    r*M*U + j*U + i -> [j, i, r]), with old log-probs (recomputed from `params` when absent;
    with `skip_first`, not for mini-batch 0, which the first update takes fresh), and
    per-mini-batch answer-token and answer counts."""
    m, u, r = batch_split(batch["advantages_N"].shape[0], settings)
    split_sh = NamedSharding(mesh, P(None, None, parallel.ROWS))

    def split(x):
        x = jnp.moveaxis(x.reshape(r, m, u, *x.shape[1:]), 0, 2)
        return jax.lax.with_sharding_constraint(x, split_sh)

    data = {key: split(v) for key, v in batch.items() if key.endswith("_ZxL")}
    data["loss_mask_ZxL"] = data["loss_mask_ZxL"].astype(bool) & (data["segments_ZxL"] > 0)
    if "old_logp_ZxL" not in data:
        def old(mb):
            return grpo.packed_token_logprobs(graphdef, params, mb["tokens_ZxL"],
                                              mb["segments_ZxL"], mb["loss_mask_ZxL"],
                                              chunk=chunk)
        first = u if skip_first else 0
        flat = {key: data[key].reshape(m * u, *data[key].shape[2:])[first:]
                for key in ("tokens_ZxL", "segments_ZxL", "loss_mask_ZxL")}
        def old_or_skip(mb):  # a micro-batch of padding (packed batches) is skipped
            return jax.lax.cond(jnp.any(mb["loss_mask_ZxL"]), old,
                                lambda mb: jnp.zeros(mb["loss_mask_ZxL"].shape, jnp.float32),
                                mb)
        logp = jax.lax.map(old_or_skip, flat) if first < m * u else None
        if first:
            zeros = jnp.zeros((first, *data["loss_mask_ZxL"].shape[2:]), jnp.float32)
            logp = zeros if logp is None else jnp.concatenate([zeros, logp])
        assert logp is not None  # first < m * u whenever first is 0
        logp = logp.reshape(data["loss_mask_ZxL"].shape)
        data["old_logp_ZxL"] = jax.lax.stop_gradient(
            jax.lax.with_sharding_constraint(logp, split_sh))
    lm, seg = data["loss_mask_ZxL"], data["segments_ZxL"]
    tokens_M = jnp.sum(lm, axis=(1, 2, 3)).astype(jnp.float32)
    # An answer ends where the next column is not an answer token of the same row.
    pad = [(0, 0)] * 3 + [(0, 1)]
    goes_on = jnp.pad(lm, pad) [..., 1:] & (jnp.pad(seg, pad)[..., 1:] == seg)
    seqs_M = jnp.sum(lm & ~goes_on, axis=(1, 2, 3)).astype(jnp.float32)
    return data, tokens_M, seqs_M


def _accumulate(params, mini, tokens, seqs, *, graphdef, settings, mesh, chunk, remat_logits=True,
                fresh=False, frozen=None):
    """(grads, metrics) of one mini-batch [U, R, ...]: micro-batch gradients of `params` (with
    `frozen`, the rest of the model, held fixed) summed in a scan, each normalised by the whole
    mini-batch's token (or sequence) count (`fresh`: see `_micro_loss`)."""
    denoms = (jnp.maximum(tokens, 1.0), jnp.maximum(seqs, 1.0))
    loss_fn = functools.partial(_micro_loss, graphdef=graphdef, settings=settings, chunk=chunk,
                                remat_logits=remat_logits, rows=parallel.rows_sharding(mesh),
                                frozen=frozen)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    param_sh = parallel.tree_shardings(params, mesh)

    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], mini), denoms, fresh)
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[1], shapes[0][1]))

    def grads(mb):
        (_, metrics), g = grad_fn(params, mb, denoms, fresh)
        return g, metrics

    def micro(acc, mb):  # a micro-batch of padding (packed batches) is skipped
        g, metrics = jax.lax.cond(jnp.any(mb["loss_mask_ZxL"]), grads, lambda _: zero, mb)
        g = jax.tree.map(jnp.add, acc[0], g)
        metrics = {k: (jnp.maximum if k.endswith("_max") else jnp.add)(acc[1][k], v)
                   for k, v in metrics.items()}
        return (jax.lax.with_sharding_constraint(g, param_sh), metrics), None

    return jax.lax.scan(micro, zero, mini)[0]


def train_step(state: TrainState, batch: dict, *, graphdef, settings: UpdateSettings,
               mesh: Mesh, chunk: int | None = DEFAULT_CHUNK, remat_logits: bool = True):
    """(state, batch) -> (state', metrics): one GRPO training step (pure; jit it).

    With LoRA (`settings.lora`) only the adapters are differentiated and updated; the base
    parameters come out as they went in.

    Metrics (means over the step's optimiser updates): loss, pg_loss, grad_norm (before
    clipping; of the trained parameters), clip/frac_low, clip/frac_high, clip/frac_dual,
    kl/old_new, kl/ref (when kl_beta > 0), entropy (mean over answer tokens); lr (of the last
    update); tokens (answer tokens in the batch); batch/padding_share (the share of the token
    slots the update computes that are padding); with `level_N` / `collapse_N` in the batch, the
    shares of answer tokens from hinted groups (batch/hinted_token_frac) and from groups that
    collapsed to all zero before hints (batch/rescued_token_frac: the tokens SAGE's re-sampling
    brought back into the gradient), and the mean |advantage| over those rows
    (batch/hinted_abs_adv).
    """
    updates_per_step = settings.minibatches * settings.epochs_per_batch
    total = settings.total_updates
    tx, schedule = make_optimizer(settings.optim, total), make_schedule(settings.optim, total)
    # One pass over the batch: mini-batch 0 meets only the sampling params (update 0), so its
    # old log-probs are the first update's own (not recomputed).
    skip_first = "old_logp_ZxL" not in batch and settings.epochs_per_batch == 1
    data, tokens_M, seqs_M = _prepare(state.params, batch, graphdef=graphdef, settings=settings,
                                      mesh=mesh, chunk=chunk, skip_first=skip_first)
    trained, frozen = trainable_split(state.params) if settings.lora else (state.params, None)

    def update(carry, j):
        params, opt_state, u = carry
        mini = jax.tree.map(lambda x: x[j], data)  # [U, R, ...]
        grads, metrics = _accumulate(params, mini, tokens_M[j], seqs_M[j], graphdef=graphdef,
                                     settings=settings, mesh=mesh, chunk=chunk,
                                     remat_logits=remat_logits,
                                     fresh=skip_first & (u == 0), frozen=frozen)
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["lr"] = jnp.asarray(schedule(state.step * updates_per_step + u), jnp.float32)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, u + 1), metrics

    order = jnp.tile(jnp.arange(settings.minibatches), settings.epochs_per_batch)
    (params, opt_state, _), metrics = jax.lax.scan(
        update, (trained, state.opt_state, jnp.zeros((), jnp.int32)), order)
    if frozen is not None:
        assert isinstance(params, nnx.State)  # the scan gives back the trained part's pytree
        params = nnx.merge_state(params, frozen)
    metrics = {key: (v[-1] if key == "lr" else jnp.max(v) if key.endswith("_max")
                     else jnp.mean(v)) for key, v in metrics.items()}
    metrics["tokens"] = jnp.sum(tokens_M)
    # Of the token slots the update computes: the micro-batches that hold answer tokens.
    computed = jnp.any(data["loss_mask_ZxL"], axis=(2, 3), keepdims=True)
    metrics["batch/padding_share"] = 1.0 - (jnp.sum(computed & (data["segments_ZxL"] > 0))
                                            / jnp.maximum(jnp.sum(jnp.broadcast_to(
                                                computed, data["segments_ZxL"].shape)), 1))
    metrics.update(_sage_metrics(batch))
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


def _sage_metrics(batch: dict) -> dict:
    """Token shares of hinted / once-collapsed rows, from the packed batch's per-row arrays."""
    out = {}
    tokens_N = batch["answer_len_N"]
    total = jnp.maximum(jnp.sum(tokens_N), 1.0)
    if "level_N" in batch:
        hinted = batch["level_N"] > 0
        out["batch/hinted_token_frac"] = jnp.sum(jnp.where(hinted, tokens_N, 0.0)) / total
        abs_adv = jnp.where(hinted, jnp.abs(batch["advantages_N"]), 0.0)
        out["batch/hinted_abs_adv"] = jnp.sum(abs_adv) / jnp.maximum(jnp.sum(hinted), 1)
    if "collapse_N" in batch:
        zero = batch["collapse_N"] == sage.COLLAPSE_ALL_ZERO
        out["batch/rescued_token_frac"] = jnp.sum(
            jnp.where(zero & (batch["advantages_N"] != 0), tokens_N, 0.0)) / total
    return out


class TrainStep:
    """`step(state, batch) -> (state, metrics)`: checks the batch (clear errors before any
    compile), then runs `train_step` jitted with the state's partition-rule shardings, rows over
    ("data", "fsdp"), metrics replicated, and the state donated.

    chunk: sequence columns per chunk of logits (None = all at once; "config": the run's
    `rl.logprob_chunk`); remat_logits: recompute
    each chunk's logits in the backward pass (memory [R, C, V] instead of [R, L, V] floats for
    R rows per micro-batch)."""

    def __init__(self, graphdef, settings: UpdateSettings, mesh: Mesh, *,
                 chunk: int | None | Literal["config"] = "config", remat_logits: bool = True):
        self.graphdef, self.settings, self.mesh = graphdef, settings, mesh
        self.chunk = settings.logprob_chunk if chunk == "config" else chunk
        self.remat_logits = remat_logits
        self._jitted = {}

    def jitted(self, state):
        """The jitted function for states shaped like `state` (for `.lower(...)` etc.)."""
        key = jax.tree.structure(state)
        if key not in self._jitted:
            step = functools.partial(train_step, graphdef=self.graphdef, settings=self.settings,
                                     mesh=self.mesh, chunk=self.chunk,
                                     remat_logits=self.remat_logits)

            def train_step_on_mesh(state, batch):  # activations keep rows split (keep_rows)
                with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
                    return step(state, batch)
            sh = parallel.tree_shardings(state, self.mesh)
            self._jitted[key] = jax.jit(
                train_step_on_mesh, in_shardings=(sh, parallel.rows_sharding(self.mesh)),
                out_shardings=(sh, parallel.replicated(self.mesh)), donate_argnums=(0,))
        return self._jitted[key]

    def __call__(self, state: TrainState, batch: dict):
        check_batch(batch, self.settings, self.mesh)
        return self.jitted(state)(state, batch)


def make_logprob_fn(graphdef, mesh, *, micro_batch_size: int | None = None,
                    chunk: int | None = DEFAULT_CHUNK):
    """jitted (params, tokens_NxL, mask_NxL, need_NxL) -> logp_NxL, rows over ("data", "fsdp"),
    `micro_batch_size` rows at a time: old log-probs, or a frozen reference's log-probs."""
    rows = parallel.rows_sharding(mesh)

    def fn(params, tokens_NxL, mask_NxL, need_NxL):
        n = tokens_NxL.shape[0]
        r = micro_batch_size or n
        split = lambda x: jnp.moveaxis(x.reshape(r, n // r, *x.shape[1:]), 0, 1)  # noqa: E731
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # see TrainStep.jitted
            out = jax.lax.map(lambda a: grpo.token_logprobs(graphdef, params, a[0], a[1],
                                                            need_NxL=a[2], chunk=chunk),
                              (split(tokens_NxL), split(mask_NxL.astype(bool)),
                               split(need_NxL.astype(bool))))
        return jnp.moveaxis(out, 0, 1).reshape(tokens_NxL.shape)

    return jax.jit(fn, in_shardings=(None, rows, rows, rows), out_shardings=rows)
