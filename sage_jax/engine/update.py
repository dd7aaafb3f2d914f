"""The GRPO update: AdamW, and a jitted, sharded `train_step(state, batch) -> (state, metrics)`.

Batch (N = B*G rows, L = prompt + answer columns; rows may be in any order):
  tokens_NxL     int32  the prompt, then the answer; padding before or after (positions count
                        valid tokens only, so both give the same log-probs)
  mask_NxL       bool   valid tokens (prompt and answer)
  loss_mask_NxL  bool   answer tokens, end-of-sequence included: the tokens that get gradient
  advantages_N   f32    one advantage per answer (`grpo.group_advantages`, flattened)
  old_logp_NxL   f32    optional: log p_old(tokens[t] | <t) on loss-mask columns; recomputed
                        from the state's params before the first update when absent
  ref_logp_NxL   f32    optional: the frozen reference's log-probs; required when rl.kl_beta > 0
  level_N        int8   optional: the hint level of the row's group (0: no hint)
  collapse_N     int8   optional: the group's first-pass status (`core.sage.COLLAPSE_*` codes:
                        0 mixed, 1 all-zero, 2 all-one), before any hint or re-sample

The packed form of this batch (`engine.packing`: whole rows end to end in the same number of
sequences, of the run's longest row, per mini-batch) gives the same loss and gradients at the
cost of the micro-batches that hold rows (one without answer tokens is skipped) and with one
program per run; `pack_batch` makes it, `train_step` takes either.

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

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sage_jax.config import Config, OptimConfig, RLConfig
from sage_jax.core import grpo, sage
from sage_jax import models
from sage_jax.infra import parallel
from sage_jax.engine import packing, sampling
from sage_jax.engine.state import TrainState, master_params

REQUIRED = ("tokens_NxL", "mask_NxL", "loss_mask_NxL", "advantages_N")
OPTIONAL = ("old_logp_NxL", "ref_logp_NxL", "level_N", "collapse_N")
PACKED_REQUIRED = ("tokens_SxL", "segments_SxL", "loss_mask_SxL", "advantages_SxL",
                   "answer_len_SxL", "advantages_N", "answer_len_N")
PACKED_OPTIONAL = ("old_logp_SxL", "ref_logp_SxL", "level_N", "collapse_N")
DEFAULT_CHUNK = RLConfig.logprob_chunk  # Sequence columns per chunk of logits in the loss.


def total_updates(cfg: Config) -> int:
    """Optimiser updates in a whole run: train.steps * rl.minibatches * rl.epochs_per_batch."""
    return max(cfg.train.steps * cfg.rl.minibatches * cfg.rl.epochs_per_batch, 1)


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


def init_train_state(model: models.Decoder, cfg: Config, mesh: Mesh
                     ) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, TrainState) for `model` at step 0, params and optimiser state placed on
    `mesh` by the partition rules (rng from train.seed)."""
    graphdef, params = models.split(model)
    init = functools.partial(new_state, cfg=cfg)
    shardings = parallel.tree_shardings(jax.eval_shape(init, params), mesh)
    return graphdef, jax.jit(init, out_shardings=shardings)(params)


def new_state(params: nnx.State, cfg: Config) -> TrainState:
    """The `TrainState` at step 0 of the model parameters `params` (float32 masters with
    model.master_fp32, AdamW of `cfg.optim`, rng from train.seed); pure, for jit or eval_shape."""
    params = master_params(params, cfg.model.master_fp32)
    return TrainState(params=params,
                      opt_state=make_optimizer(cfg.optim, total_updates(cfg)).init(params),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(cfg.train.seed),
                      data_position=jnp.zeros((), jnp.int32))


def layout(n: int, rl: RLConfig) -> tuple[int, int, int]:
    """(minibatches M, micro-batches per mini-batch U, rows per micro-batch R) for N rows."""
    m = rl.minibatches
    if n % m:
        raise ValueError(f"batch has {n} rows, not divisible by rl.minibatches={m}")
    r = min(rl.micro_batch_size or n // m, n // m)  # a smaller mini-batch is one pass
    if (n // m) % r:
        raise ValueError(f"rl.micro_batch_size={r} does not divide the {n // m} rows of a "
                         f"mini-batch ({n} rows / rl.minibatches={m})")
    return m, n // m // r, r


def sample_prompt_len(cfg: Config, prompt_len: int | None = None) -> int:
    """The longest prompt the rollout samples from: `prompt_len` (default
    data.max_prompt_tokens), plus hint.max_new_tokens for SAGE's hinted prompts."""
    hinted = cfg.rl.method in ("sage", "sage_light")
    return (prompt_len or cfg.data.max_prompt_tokens) + (cfg.hint.max_new_tokens if hinted else 0)


def row_len(cfg: Config) -> int:
    """Columns of the run's longest training row (`sample_prompt_len` and the longest answer),
    as `sampling.length_bucket` pads it: the width of every packed batch."""
    return sampling.length_bucket(sample_prompt_len(cfg) + cfg.rl.max_new_tokens)


def pack_batch(batch: dict, cfg: Config) -> dict:
    """The packed form (`engine.packing`) of a padded numpy batch, for `cfg`'s mini-batches,
    in sequences of the run's longest row (`row_len`): every step's batch has one shape."""
    m, u, r = layout(len(batch["advantages_N"]), cfg.rl)
    return packing.pack(batch, minibatches=m, micro_batches=u, micro_rows=r,
                        width=row_len(cfg))


def check_batch(batch: dict, cfg: Config, mesh: Mesh) -> None:
    """Raises a ValueError naming the key if `batch` does not fit the layout above (padded or
    packed) or the mesh."""
    packed = packing.is_packed(batch)
    required, optional = (PACKED_REQUIRED, PACKED_OPTIONAL) if packed else (REQUIRED, OPTIONAL)
    tokens = "tokens_SxL" if packed else "tokens_NxL"
    unknown = set(batch) - set(required) - set(optional)
    if unknown:
        raise ValueError(f"unknown batch keys {sorted(unknown)}; valid: {required + optional}")
    for key in required:
        if key not in batch:
            raise ValueError(f"batch is missing {key!r} (required: {required})")
    ref = "ref_logp_SxL" if packed else "ref_logp_NxL"
    if cfg.rl.kl_beta > 0 and ref not in batch:
        raise ValueError(f"rl.kl_beta={cfg.rl.kl_beta} needs {ref!r} in the batch")
    shape = tuple(batch[tokens].shape)
    if len(shape) != 2 or not jnp.issubdtype(batch[tokens].dtype, jnp.integer):
        raise ValueError(f"batch[{tokens!r}] must be an integer 2-D array, got "
                         f"{batch[tokens].dtype}{list(shape)}")
    n = batch["advantages_N"].shape[0] if packed else shape[0]
    for key in required + optional:
        if key in batch and key.endswith("xL") and tuple(batch[key].shape) != shape:
            raise ValueError(f"batch[{key!r}] has shape {list(batch[key].shape)}, expected "
                             f"{list(shape)} like {tokens}")
        if key in batch and key.endswith("_N") and tuple(batch[key].shape) != (n,):
            raise ValueError(f"batch[{key!r}] has shape {list(batch[key].shape)}, "
                             f"expected [{n}]")
    parallel.check_rows(n, mesh)
    m, _, r = layout(n, cfg.rl)
    parallel.check_rows(r, mesh, f"a micro-batch (rl.micro_batch_size={r})")
    if packed and shape[0] != n:
        raise ValueError(f"a packed batch has as many sequences as rows ({n}: {m} "
                         f"mini-batches of {n // m // r} micro-batches of {r}), got {shape[0]} "
                         f"(engine.packing)")


def _micro_loss(params, mb, denoms, fresh=False, *, graphdef, rl, chunk, remat, rows):
    """(loss, metrics) of one micro-batch; losses and metrics add up over a mini-batch.
    `fresh`: `params` are the ones the answers were sampled with, so the old log-probs are the
    current ones (not recomputed: the ratio is exactly 1)."""
    tok_denom, seq_denom = denoms
    loss_mask = mb["loss_mask_SxL"]
    model = nnx.merge(graphdef, params)
    h = jax.lax.with_sharding_constraint(
        model.hidden(mb["tokens_SxL"], segments_BxT=mb["segments_SxL"]),
        rows)  # keep rows split (not D) for the logits
    logp, ent = grpo.logprobs_from_hidden(model.logits, h, mb["tokens_SxL"], loss_mask,
                                          chunk=chunk, remat=remat)
    agg = dict(agg=rl.loss_agg, norm_len=rl.max_new_tokens, row_len_NxT=mb["answer_len_SxL"],
               denom=tok_denom if rl.loss_agg == "token-mean" else seq_denom)
    old = jnp.where(fresh, jax.lax.stop_gradient(logp), mb["old_logp_SxL"])
    pg, metrics = grpo.policy_loss(logp, old, mb["advantages_SxL"], loss_mask,
                                   clip_low=rl.clip_low, clip_high=rl.clip_high,
                                   dual_clip=rl.dual_clip, token_denom=tok_denom, **agg)
    loss = pg
    if rl.kl_beta > 0:
        kl = grpo.aggregate(grpo.kl_k3(logp, mb["ref_logp_SxL"]), loss_mask, **agg)
        loss = loss + rl.kl_beta * kl
        metrics["kl/ref"] = jax.lax.stop_gradient(kl)
    metrics.update(loss=jax.lax.stop_gradient(loss), pg_loss=jax.lax.stop_gradient(pg),
                   entropy=jnp.sum(jnp.where(loss_mask, ent, 0.0)) / tok_denom)
    return loss, metrics


def _prepare(params, batch, *, graphdef, rl, mesh, chunk, skip_first=False):
    """The per-token arrays of a packed batch split to [M, U, R, ...] (sequence
    r*M*U + j*U + i -> [j, i, r]), with old log-probs (recomputed from `params` when absent;
    with `skip_first`, not for mini-batch 0, which the first update takes fresh), and
    per-mini-batch answer-token and answer counts."""
    m, k, r = layout(batch["advantages_N"].shape[0], rl)
    split_sh = NamedSharding(mesh, P(None, None, parallel.ROWS))

    def split(x):
        x = jnp.moveaxis(x.reshape(r, m, k, *x.shape[1:]), 0, 2)
        return jax.lax.with_sharding_constraint(x, split_sh)

    data = {key: split(v) for key, v in batch.items() if key.endswith("_SxL")}
    data["loss_mask_SxL"] = data["loss_mask_SxL"].astype(bool) & (data["segments_SxL"] > 0)
    if "old_logp_SxL" not in data:
        def old(mb):
            return grpo.token_logprobs(graphdef, params, mb["tokens_SxL"], None,
                                       segments_NxL=mb["segments_SxL"],
                                       need_NxL=mb["loss_mask_SxL"], chunk=chunk)
        first = k if skip_first else 0
        flat = {key: data[key].reshape(m * k, *data[key].shape[2:])[first:]
                for key in ("tokens_SxL", "segments_SxL", "loss_mask_SxL")}
        def old_or_skip(mb):  # a micro-batch of padding (packed batches) is skipped
            return jax.lax.cond(jnp.any(mb["loss_mask_SxL"]), old,
                                lambda mb: jnp.zeros(mb["loss_mask_SxL"].shape, jnp.float32),
                                mb)
        logp = jax.lax.map(old_or_skip, flat) if first < m * k else None
        if first:
            zeros = jnp.zeros((first, *data["loss_mask_SxL"].shape[2:]), jnp.float32)
            logp = zeros if logp is None else jnp.concatenate([zeros, logp])
        assert logp is not None  # first < m * k whenever first is 0
        logp = logp.reshape(data["loss_mask_SxL"].shape)
        data["old_logp_SxL"] = jax.lax.stop_gradient(
            jax.lax.with_sharding_constraint(logp, split_sh))
    lm, seg = data["loss_mask_SxL"], data["segments_SxL"]
    tokens_M = jnp.sum(lm, axis=(1, 2, 3)).astype(jnp.float32)
    # An answer ends where the next column is not an answer token of the same row.
    pad = [(0, 0)] * 3 + [(0, 1)]
    goes_on = jnp.pad(lm, pad) [..., 1:] & (jnp.pad(seg, pad)[..., 1:] == seg)
    seqs_M = jnp.sum(lm & ~goes_on, axis=(1, 2, 3)).astype(jnp.float32)
    return data, tokens_M, seqs_M


def _accumulate(params, mini, tokens, seqs, *, graphdef, rl, mesh, chunk, remat=True,
                fresh=False):
    """(grads, metrics) of one mini-batch [U, R, ...]: micro-batch gradients summed in a scan,
    each normalised by the whole mini-batch's token (or sequence) count (`fresh`: see
    `_micro_loss`)."""
    denoms = (jnp.maximum(tokens, 1.0), jnp.maximum(seqs, 1.0))
    loss_fn = functools.partial(_micro_loss, graphdef=graphdef, rl=rl, chunk=chunk, remat=remat,
                                rows=parallel.rows_sharding(mesh))
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    param_sh = parallel.tree_shardings(params, mesh)

    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], mini), denoms, fresh)
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[1], shapes[0][1]))

    def grads(mb):
        (_, metrics), g = grad_fn(params, mb, denoms, fresh)
        return g, metrics

    def micro(acc, mb):  # a micro-batch of padding (packed batches) is skipped
        g, metrics = jax.lax.cond(jnp.any(mb["loss_mask_SxL"]), grads, lambda _: zero, mb)
        g, metrics = jax.tree.map(jnp.add, acc, (g, metrics))
        return (jax.lax.with_sharding_constraint(g, param_sh), metrics), None

    return jax.lax.scan(micro, zero, mini)[0]


def train_step(state: TrainState, batch: dict, *, graphdef, cfg: Config, mesh: Mesh,
               chunk: int | None = DEFAULT_CHUNK, remat_logits: bool = True):
    """(state, batch) -> (state', metrics): one GRPO training step (pure; jit it).

    Metrics (means over the step's optimiser updates): loss, pg_loss, grad_norm (before
    clipping), clip/frac_low, clip/frac_high, clip/frac_dual, kl/old_new, kl/ref (when
    kl_beta > 0), entropy (mean over answer tokens); lr (of the last update); tokens (answer
    tokens in the batch); batch/padding_share (the share of the token slots the update
    computes that are padding); with `level_N` / `collapse_N` in the batch, the shares of answer
    tokens from hinted groups (batch/hinted_token_frac) and from groups that collapsed to all
    zero before hints (batch/rescued_token_frac: the tokens SAGE's re-sampling brought back
    into the gradient), and the mean |advantage| over those rows (batch/hinted_abs_adv).
    """
    rl = cfg.rl
    updates_per_step = rl.minibatches * rl.epochs_per_batch
    total = total_updates(cfg)
    tx, schedule = make_optimizer(cfg.optim, total), make_schedule(cfg.optim, total)
    # One pass over the batch: mini-batch 0 meets only the sampling params (update 0), so its
    # old log-probs are the first update's own (not recomputed).
    batch = _packed(batch)
    skip_first = "old_logp_SxL" not in batch and rl.epochs_per_batch == 1
    data, tokens_M, seqs_M = _prepare(state.params, batch, graphdef=graphdef, rl=rl, mesh=mesh,
                                      chunk=chunk, skip_first=skip_first)

    def update(carry, j):
        params, opt_state, u = carry
        mini = jax.tree.map(lambda x: x[j], data)  # [U, R, ...]
        grads, metrics = _accumulate(params, mini, tokens_M[j], seqs_M[j], graphdef=graphdef,
                                     rl=rl, mesh=mesh, chunk=chunk, remat=remat_logits,
                                     fresh=skip_first & (u == 0))
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["lr"] = jnp.asarray(schedule(state.step * updates_per_step + u), jnp.float32)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, u + 1), metrics

    order = jnp.tile(jnp.arange(rl.minibatches), rl.epochs_per_batch)
    (params, opt_state, _), metrics = jax.lax.scan(
        update, (state.params, state.opt_state, jnp.zeros((), jnp.int32)), order)
    metrics = {key: (v[-1] if key == "lr" else jnp.mean(v)) for key, v in metrics.items()}
    metrics["tokens"] = jnp.sum(tokens_M)
    # Of the token slots the update computes: the micro-batches that hold answer tokens.
    computed = jnp.any(data["loss_mask_SxL"], axis=(2, 3), keepdims=True)
    metrics["batch/padding_share"] = 1.0 - (jnp.sum(computed & (data["segments_SxL"] > 0))
                                            / jnp.maximum(jnp.sum(jnp.broadcast_to(
                                                computed, data["segments_SxL"].shape)), 1))
    metrics.update(_sage_metrics(batch))
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


def _packed(batch: dict) -> dict:
    return batch if packing.is_packed(batch) else packing.as_packed(batch, jnp)


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

    def __init__(self, graphdef, cfg: Config, mesh: Mesh, *,
                 chunk: int | None | Literal["config"] = "config", remat_logits: bool = True):
        self.graphdef, self.cfg, self.mesh = graphdef, cfg, mesh
        self.chunk = cfg.rl.logprob_chunk if chunk == "config" else chunk
        self.remat_logits = remat_logits
        self._jitted = {}

    def jitted(self, state):
        """The jitted function for states shaped like `state` (for `.lower(...)` etc.)."""
        key = jax.tree.structure(state)
        if key not in self._jitted:
            step = functools.partial(train_step, graphdef=self.graphdef, cfg=self.cfg,
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
        check_batch(batch, self.cfg, self.mesh)
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
