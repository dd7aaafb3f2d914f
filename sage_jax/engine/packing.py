"""The update's packed batch: each mini-batch's rows packed end to end into fixed-length
sequences, so that the update's cost follows the real tokens rather than the padding.

A row (prompt then answer, its `mask_NxL` tokens) never straddles two sequences; a sequence
holds whole rows, each a segment: `segments_ZxL` is 0 on padding and 1, 2, ... on the rows in
order, so attention never crosses rows and positions restart at 0 in each row. Rows are packed
per mini-batch (first-fit, longest first), so mini-batch membership is that of the padded
layout (see `update.py`), and the loss denominators, the per-row log-probs and hence the
gradients are those of the padded batch.

Packed batch (Z = M * U * R sequences of L columns; N rows):
  tokens_ZxL      int32  the rows' tokens, end to end; 0 on padding
  segments_ZxL    int32  0 on padding, else 1 + the row's index within its sequence
  loss_mask_ZxL   bool   answer tokens (as `loss_mask_NxL`)
  advantages_ZxL  f32    the row's advantage on each of its tokens
  answer_len_ZxL  f32    the row's answer-token count on each of its tokens
  old_logp_ZxL, ref_logp_ZxL  optional, as the `_NxL` ones
  advantages_N, level_N, collapse_N, answer_len_N  per row, for the batch metrics

The shape is the padded layout's, whatever the rows (Z = N; L = `width`, the run's longest row
when given), so a run compiles one update program. The sequences that hold rows fill a
mini-batch's micro-batches in order and the rest are padding: the update skips a micro-batch
without answer tokens, so the work follows the micro-batches that hold rows. Sequence s sits at
mini-batch j, micro-batch i, slot r with s = r*M*U + j*U + i (the stripes of `update.py`);
a mini-batch's sequence c sits at micro-batch c // R, slot c % R.
"""

from __future__ import annotations

import numpy as np

PER_ROW = ("advantages_N", "level_N", "collapse_N")


def is_packed(batch: dict) -> bool:
    """Whether `batch` is in the packed form (its per-token arrays are `_ZxL`)."""
    return any(key.endswith("_ZxL") for key in batch)


def pack(batch: dict, *, minibatches: int, micro_batches: int, micro_rows: int,
         width: int | None = None) -> dict:
    """The packed form (above) of a padded numpy batch of the layout in `update.py`, whose
    mini-batches are `micro_batches` micro-batches of `micro_rows` rows (`update.layout`), in
    sequences of `width` columns (at least the batch's own)."""
    m, u, r = minibatches, micro_batches, micro_rows
    mask = np.asarray(batch["mask_NxL"], bool)
    n = mask.shape[0]
    width = max(int(mask.shape[1]), width or 0)
    loss = np.asarray(batch["loss_mask_NxL"], bool) & mask
    lengths = mask.sum(1)
    # Row q -> [j, i, s] with q = s*M*U + j*U + i: mini-batch j = (q // U) % M.
    minibatch_of = (np.arange(n) // u) % m
    bins = []  # per mini-batch: a list of sequences, each a list of rows
    for j in range(m):
        rows = np.flatnonzero(minibatch_of == j)
        seqs, room = [], []
        for q in rows[np.argsort(-lengths[rows], kind="stable")]:
            k = next((k for k, left in enumerate(room) if left >= lengths[q]), None)
            if k is None:
                seqs.append([])
                room.append(width)
                k = len(seqs) - 1
            seqs[k].append(int(q))
            room[k] -= int(lengths[q])
        bins.append(seqs)
    s = n  # at most one sequence per row: the padded layout's U x R per mini-batch
    out = {"tokens_ZxL": np.zeros((s, width), np.int32),
           "segments_ZxL": np.zeros((s, width), np.int32),
           "loss_mask_ZxL": np.zeros((s, width), bool),
           "advantages_ZxL": np.zeros((s, width), np.float32),
           "answer_len_ZxL": np.zeros((s, width), np.float32)}
    extra = [k for k in ("old_logp", "ref_logp") if f"{k}_NxL" in batch]
    for k in extra:
        out[f"{k}_ZxL"] = np.zeros((s, width), np.float32)
    src = {k: np.asarray(batch[f"{k}_NxL"]) for k in ("tokens", *extra)}
    adv = np.asarray(batch["advantages_N"], np.float32)
    answer_len = loss.sum(1)
    for j, seqs in enumerate(bins):
        for c, rows in enumerate(seqs):
            i, slot = divmod(c, r)  # sequence c of mini-batch j: micro-batches fill in order
            dst = slot * m * u + j * u + i
            at = 0
            for seg, q in enumerate(rows, start=1):
                cols = np.flatnonzero(mask[q])
                span = slice(at, at + len(cols))
                for k, x in src.items():
                    out[f"{k}_ZxL"][dst, span] = x[q, cols]
                out["segments_ZxL"][dst, span] = seg
                out["loss_mask_ZxL"][dst, span] = loss[q, cols]
                out["advantages_ZxL"][dst, span] = adv[q]
                out["answer_len_ZxL"][dst, span] = answer_len[q]
                at += len(cols)
    for k in PER_ROW:
        if k in batch:
            out[k] = np.asarray(batch[k])
    out["answer_len_N"] = answer_len.astype(np.float32)
    return out


def as_packed(batch: dict, xp=np) -> dict:
    """The packed form of a padded batch with one row per sequence (no packing: Z = N), with
    `xp` = numpy or jax.numpy (inside jit)."""
    mask = batch["mask_NxL"].astype(bool)
    loss = batch["loss_mask_NxL"].astype(bool) & mask
    answer_len = xp.sum(loss, axis=1).astype(xp.float32)
    ones = xp.ones(mask.shape, xp.float32)
    out = {"tokens_ZxL": batch["tokens_NxL"], "segments_ZxL": mask.astype(xp.int32),
           "loss_mask_ZxL": loss,
           "advantages_ZxL": batch["advantages_N"].astype(xp.float32)[:, None] * ones,
           "answer_len_ZxL": answer_len[:, None] * ones, "answer_len_N": answer_len}
    for k in ("old_logp", "ref_logp"):
        if f"{k}_NxL" in batch:
            out[f"{k}_ZxL"] = batch[f"{k}_NxL"]
    out.update({k: batch[k] for k in PER_ROW if k in batch})
    return out
