"""From a rollout's token lists to the update's batch (packed, or padded where a caller needs
it).

Shapes: B prompts, G answers each, N = B*G rows (prompt-major: row b*G + g), T answer columns
(rl.max_new_tokens), L train-row columns
(a `packing.length_bucket` of the longest prompt + answer: the same few sizes at every step,
each one update program).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sage_jax.config import Config
from sage_jax.core import grpo
from sage_jax.engine.trainer import packing, update
from sage_jax.infra import distributed, parallel
from sage_jax.rl.types import Rollout


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """How a run's rollouts become the update's batch, built once (`of`): `padding_free`
    (rl.padding_free), `loss_context` (rl.loss_context), `adv_scale` (rl.adv_scale),
    `sampler_logprobs` (the sampler's log-probs as the old ones: `RLConfig.sampler_old_logprobs`,
    from an engine whose log-probs are the trainer's model's),
    `engine_logprobs` (the engine's log-probs ride along as `sampler_logp`, for the rollout
    correction: rl.rollout_correction != none), and the task's `pad_id`."""

    padding_free: bool = True
    pad_id: int = 0
    loss_context: str = "hinted"
    adv_scale: str = "group"
    sampler_logprobs: bool = False
    engine_logprobs: bool = False

    @classmethod
    def of(cls, cfg: Config, pad_id: int, trainer_logprobs: bool = True) -> "BatchSettings":
        return cls(padding_free=cfg.rl.padding_free, pad_id=pad_id,
                   loss_context=cfg.rl.loss_context, adv_scale=cfg.rl.adv_scale,
                   sampler_logprobs=cfg.rl.sampler_old_logprobs and trainer_logprobs,
                   engine_logprobs=cfg.rl.rollout_correction != "none")

    @property
    def sampled_context(self) -> bool:
        """Whether the correction needs the trainer's log-probs in the context the answers were
        sampled in apart from the loss's (`answer_logprobs`): loss_context=plain."""
        return self.engine_logprobs and self.loss_context == "plain"


def update_batch(ro: Rollout, settings: update.UpdateSettings, batch: BatchSettings,
                 sampled_logprobs: np.ndarray | None = None,
                 ref_logprobs: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The batch `update.TrainStep` takes, of a rollout's rows (`train_rows`): with
    `batch.padding_free`, packed end to end (`packing.pack_rows`) in sequences of the run's
    longest row (`settings.row_len`); else one row per sequence (`packing.as_packed` of
    `train_batch`'s padded layout, L columns). `sampled_logprobs`, `ref_logprobs`: see
    `train_rows`."""
    rows = train_rows(ro, loss_context=batch.loss_context, adv_scale=batch.adv_scale,
                      sampler_logprobs=batch.sampler_logprobs,
                      engine_logprobs=batch.engine_logprobs, sampled_logprobs=sampled_logprobs,
                      ref_logprobs=ref_logprobs)
    width = packing.length_bucket(max(len(t) for t in rows["tokens"]))
    if not batch.padding_free:
        return packing.as_packed(packing.pad_rows(rows, width, batch.pad_id))
    m, u, r = update.batch_split(len(rows["tokens"]), settings)
    return packing.pack_rows(rows, minibatches=m, micro_batches=u, micro_rows=r,
                             width=max(width, settings.row_len))


def train_batch(ro: Rollout, *, loss_context: str = "hinted", adv_scale: str = "group",
                pad_id: int = 0, sampler_logprobs: bool = False) -> dict[str, np.ndarray]:
    """The padded batch of `train_rows` (see `update.py`): each row from column 0,
    right-padded to L (positions count valid tokens, so this equals a left-padded prompt)."""
    rows = train_rows(ro, loss_context=loss_context, adv_scale=adv_scale,
                      sampler_logprobs=sampler_logprobs)
    width = packing.length_bucket(max(len(t) for t in rows["tokens"]))
    return packing.pad_rows(rows, width, pad_id)


def train_rows(ro: Rollout, *, loss_context: str = "hinted", adv_scale: str = "group",
               sampler_logprobs: bool = False, engine_logprobs: bool = False,
               sampled_logprobs: np.ndarray | None = None,
               ref_logprobs: np.ndarray | None = None) -> dict:
    """The update's rows of a rollout (`packing.rows_of`'s form), prompt-major: each row its
    prompt then its answer (`loss_mask` on the answer tokens, end-of-sequence included), with
    its group's advantage, hint level and first-pass collapse status.

    `loss_context`: "hinted" trains on log pi(answer | prompt + hint) for hinted groups (the
    published setting); "plain" on log pi(answer | bare prompt) (the off-policy ablation).
    `sampler_logprobs`: the sampler's log-probs of the answers become the rows' old log-probs
    (`rl.old_logprobs=sampler`; only in the context they were sampled in, "hinted").
    `engine_logprobs`: they ride along as `sampler_logp` (the rollout correction's denominator).
    `sampled_logprobs` [B, G, T]: the trainer's log-probs of the answers in the context they
    were sampled in (`answer_logprobs`), as `sampled_logp`. `ref_logprobs` [B, G, T]: the
    frozen reference's log-probs of the answers in the loss's context, as `ref_logp`.
    """
    if loss_context not in ("hinted", "plain"):
        raise ValueError(f"loss_context must be 'hinted' or 'plain', got {loss_context!r}")
    if sampler_logprobs and loss_context != "hinted":
        raise ValueError("the sampler's log-probs are of the hinted context: they cannot be the "
                         "old log-probs of loss_context='plain'")
    prompts = ro.prompts if loss_context == "hinted" else ro.plain_prompts
    tokens_BxGxT, lengths_BxG = ro.samples.tokens, ro.samples.lengths
    g = tokens_BxGxT.shape[1]
    answers = {"old_logp": ro.samples.logprobs if sampler_logprobs else None,
               "sampler_logp": ro.samples.logprobs if engine_logprobs else None,
               "sampled_logp": sampled_logprobs, "ref_logp": ref_logprobs}
    answers = {k: v for k, v in answers.items() if v is not None}
    rows: dict = {"tokens": [], "loss_mask": [], **{k: [] for k in answers}}
    for i, p in enumerate(prompts):
        prompt = np.asarray(p, np.int32)
        for j in range(g):
            n = int(lengths_BxG[i, j])
            rows["tokens"].append(np.concatenate([prompt, tokens_BxGxT[i, j, :n]]))
            rows["loss_mask"].append(np.arange(len(p) + n) >= len(p))
            for k, logp_BxGxT in answers.items():
                rows[k].append(np.concatenate(
                    [np.zeros(len(p), np.float32), np.asarray(logp_BxGxT[i, j, :n], np.float32)]))
    adv = np.asarray(grpo.group_advantages(ro.rewards, scale=adv_scale), np.float32)
    rows.update(advantages_N=adv.reshape(-1), level_N=np.repeat(ro.level, g).astype(np.int8),
                collapse_N=np.repeat(ro.collapse, g).astype(np.int8))
    return rows


def answer_logprobs(ro: Rollout, logprob_fn, params, mesh, *, context: str = "hinted",
                    pad_id: int = 0) -> np.ndarray:
    """[B, G, T]: the log-probs under `params` (`update.make_logprob_fn`) of each answer after
    its prompt in `context` ("hinted": the one it was sampled in, a hinted group's hinted
    prompt; "plain": the bare prompt), 0 past its length."""
    b = train_batch(ro, loss_context=context, pad_id=pad_id)
    n = len(b["tokens_NxL"])
    local = parallel.local_rows(n, mesh)
    x = parallel.shard_batch({k: b[k][local] for k in ("tokens_NxL", "mask_NxL",
                                                       "loss_mask_NxL")}, mesh, global_rows=n)
    logp_NxL = distributed.fetch(logprob_fn(params, x["tokens_NxL"], x["mask_NxL"],
                                            x["loss_mask_NxL"]))
    prompts = ro.prompts if context == "hinted" else ro.plain_prompts
    lengths_BxG = np.asarray(ro.samples.lengths)
    out_BxGxT = np.zeros(np.shape(ro.samples.logprobs), np.float32)
    g = lengths_BxG.shape[1]
    for i, p in enumerate(prompts):
        for j in range(g):
            n_ij = int(lengths_BxG[i, j])
            out_BxGxT[i, j, :n_ij] = logp_NxL[i * g + j, len(p):len(p) + n_ij]
    return out_BxGxT
