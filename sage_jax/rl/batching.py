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
from sage_jax.rl.types import Rollout


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """How a run's rollouts become the update's batch, built once (`of`): `padding_free`
    (rl.padding_free), `loss_context` (rl.loss_context), `adv_scale` (rl.adv_scale),
    `sampler_logprobs` (the sampler's log-probs as the old ones: rl.old_logprobs=sampler, in
    the hinted context, from an engine whose log-probs are the trainer's model's), and the
    task's `pad_id`."""

    padding_free: bool = True
    pad_id: int = 0
    loss_context: str = "hinted"
    adv_scale: str = "group"
    sampler_logprobs: bool = False

    @classmethod
    def of(cls, cfg: Config, pad_id: int, trainer_logprobs: bool = True) -> "BatchSettings":
        return cls(padding_free=cfg.rl.padding_free, pad_id=pad_id,
                   loss_context=cfg.rl.loss_context, adv_scale=cfg.rl.adv_scale,
                   sampler_logprobs=cfg.rl.old_logprobs == "sampler"
                   and cfg.rl.loss_context == "hinted" and trainer_logprobs)


def update_batch(ro: Rollout, settings: update.UpdateSettings,
                 batch: BatchSettings) -> dict[str, np.ndarray]:
    """The batch `update.TrainStep` takes, of a rollout's rows (`train_rows`): with
    `batch.padding_free`, packed end to end (`packing.pack_rows`) in sequences of the run's
    longest row (`settings.row_len`); else one row per sequence (`packing.as_packed` of
    `train_batch`'s padded layout, L columns)."""
    rows = train_rows(ro, loss_context=batch.loss_context, adv_scale=batch.adv_scale,
                      sampler_logprobs=batch.sampler_logprobs)
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
               sampler_logprobs: bool = False) -> dict:
    """The update's rows of a rollout (`packing.rows_of`'s form), prompt-major: each row its
    prompt then its answer (`loss_mask` on the answer tokens, end-of-sequence included), with
    its group's advantage, hint level and first-pass collapse status.

    `loss_context`: "hinted" trains on log pi(answer | prompt + hint) for hinted groups (the
    published setting); "plain" on log pi(answer | bare prompt) (the off-policy ablation).
    `sampler_logprobs`: the sampler's log-probs of the answers become the rows' old log-probs
    (`rl.old_logprobs=sampler`; only in the context they were sampled in, "hinted").
    """
    if loss_context not in ("hinted", "plain"):
        raise ValueError(f"loss_context must be 'hinted' or 'plain', got {loss_context!r}")
    if sampler_logprobs and loss_context != "hinted":
        raise ValueError("the sampler's log-probs are of the hinted context: they cannot be the "
                         "old log-probs of loss_context='plain'")
    prompts = ro.prompts if loss_context == "hinted" else ro.plain_prompts
    tokens_BxGxT, lengths_BxG = ro.samples.tokens, ro.samples.lengths
    g = tokens_BxGxT.shape[1]
    rows: dict = {"tokens": [], "loss_mask": []}
    if sampler_logprobs:
        rows["old_logp"] = []
    for i, p in enumerate(prompts):
        prompt = np.asarray(p, np.int32)
        for j in range(g):
            n = int(lengths_BxG[i, j])
            rows["tokens"].append(np.concatenate([prompt, tokens_BxGxT[i, j, :n]]))
            rows["loss_mask"].append(np.arange(len(p) + n) >= len(p))
            if sampler_logprobs:
                rows["old_logp"].append(np.concatenate(
                    [np.zeros(len(p), np.float32), ro.samples.logprobs[i, j, :n]]))
    adv = np.asarray(grpo.group_advantages(ro.rewards, scale=adv_scale), np.float32)
    rows.update(advantages_N=adv.reshape(-1), level_N=np.repeat(ro.level, g).astype(np.int8),
                collapse_N=np.repeat(ro.collapse, g).astype(np.int8))
    return rows
