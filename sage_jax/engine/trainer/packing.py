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
  old_logp_ZxL, ref_logp_ZxL, sampler_logp_ZxL, sampled_logp_ZxL  optional, as the `_NxL` ones
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

LENGTH_BUCKET_MIN = 16  # training rows are padded to multiples of 16 up to 256, then of 1/8 of
#                        their power of two


def length_bucket(n: int) -> int:
    """Padded length of a training row (prompt + answer) of n tokens: the next multiple of 1/8
    of n's power of two (at least 16): eight sizes per octave, so padding is under 1/8 and
    recompiles are few."""
    n = max(int(n), 1)
    step = max(LENGTH_BUCKET_MIN, 1 << max((n - 1).bit_length() - 4, 0))
    return -(-n // step) * step


PER_ROW = ("advantages_N", "level_N", "collapse_N")
# optional per-token arrays besides tokens and loss mask (see `update.py`)
PER_TOKEN = ("old_logp", "ref_logp", "sampler_logp", "sampled_logp")


def is_packed(batch: dict) -> bool:
    """Whether `batch` is in the packed form (its per-token arrays are `_ZxL`)."""
    return any(key.endswith("_ZxL") for key in batch)


def pack(batch: dict, *, minibatches: int, micro_batches: int, micro_rows: int,
         width: int | None = None) -> dict:
    """The packed form (above) of a padded numpy batch of the layout in `update.py`
    (`pack_rows` of its `rows_of`), in sequences of `width` columns (at least the batch's own)."""
    width = max(int(np.shape(batch["mask_NxL"])[1]), width or 0)
    return pack_rows(rows_of(batch), minibatches=minibatches, micro_batches=micro_batches,
                     micro_rows=micro_rows, width=width)


def pack_rows(rows: dict, *, minibatches: int, micro_batches: int, micro_rows: int,
              width: int) -> dict:
    """The packed form (above) of `rows` (`rows_of`'s form: row q's valid tokens, from the
    padded layout's row q), whose mini-batches are `micro_batches` micro-batches of `micro_rows`
    rows (`update.batch_split`), in sequences of `width` columns (at least the longest row)."""
    m, u, r = minibatches, micro_batches, micro_rows
    lengths = np.asarray([len(t) for t in rows["tokens"]], np.int64)
    n = len(lengths)
    # Row q -> [j, i, s] with q = s*M*U + j*U + i: mini-batch j = (q // U) % M.
    minibatch_of = (np.arange(n) // u) % m
    bins = []  # per mini-batch: a list of sequences, each a list of rows
    for j in range(m):
        members = np.flatnonzero(minibatch_of == j)
        seqs, room = [], []
        for q in members[np.argsort(-lengths[members], kind="stable")]:
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
    extra = [k for k in PER_TOKEN if k in rows]
    for k in extra:
        out[f"{k}_ZxL"] = np.zeros((s, width), np.float32)
    src = {k: rows[k] for k in ("tokens", *extra)}
    adv = np.asarray(rows["advantages_N"], np.float32)
    answer_len = np.asarray([np.sum(x) for x in rows["loss_mask"]], np.int64)
    for j, seqs in enumerate(bins):
        for c, seq in enumerate(seqs):
            i, slot = divmod(c, r)  # sequence c of mini-batch j: micro-batches fill in order
            dst = slot * m * u + j * u + i
            at = 0
            for seg, q in enumerate(seq, start=1):
                span = slice(at, at + int(lengths[q]))
                for k, x in src.items():
                    out[f"{k}_ZxL"][dst, span] = x[q]
                out["segments_ZxL"][dst, span] = seg
                out["loss_mask_ZxL"][dst, span] = rows["loss_mask"][q]
                out["advantages_ZxL"][dst, span] = adv[q]
                out["answer_len_ZxL"][dst, span] = answer_len[q]
                at += int(lengths[q])
    for k in PER_ROW:
        if k in rows:
            out[k] = np.asarray(rows[k])
    out["answer_len_N"] = answer_len.astype(np.float32)
    return out


def rows_of(batch: dict) -> dict:
    """The rows of a padded batch (`update.py`'s layout): per row its valid tokens (`tokens`),
    which of them get gradient (`loss_mask`) and, when the batch has them, its `PER_TOKEN`
    arrays on those tokens; the per-row arrays as they are. What `pack_rows` packs."""
    mask = np.asarray(batch["mask_NxL"], bool)
    loss = np.asarray(batch["loss_mask_NxL"], bool) & mask
    rows = {"tokens": [np.asarray(t)[m] for t, m in zip(batch["tokens_NxL"], mask)],
            "loss_mask": [x[m] for x, m in zip(loss, mask)]}
    for k in PER_TOKEN:
        if f"{k}_NxL" in batch:
            rows[k] = [np.asarray(x)[m] for x, m in zip(batch[f"{k}_NxL"], mask)]
    rows.update({k: np.asarray(batch[k]) for k in PER_ROW if k in batch})
    return rows


def pad_rows(rows: dict, width: int, pad_id: int = 0) -> dict:
    """The padded batch (`update.py`'s layout) of `rows` (`rows_of`'s form): each row from
    column 0, right-padded with `pad_id` to `width` columns."""
    n = len(rows["tokens"])
    tokens = np.full((n, width), pad_id, np.int32)
    mask = np.zeros((n, width), bool)
    loss = np.zeros((n, width), bool)
    extra = {k: np.zeros((n, width), np.float32) for k in PER_TOKEN if k in rows}
    for q, row in enumerate(rows["tokens"]):
        tokens[q, :len(row)], mask[q, :len(row)] = row, True
        loss[q, :len(row)] = rows["loss_mask"][q]
        for k, x in extra.items():
            x[q, :len(row)] = rows[k][q]
    batch = {"tokens_NxL": tokens, "mask_NxL": mask, "loss_mask_NxL": loss,
             **{f"{k}_NxL": x for k, x in extra.items()}}
    batch.update({k: rows[k] for k in PER_ROW if k in rows})
    return batch


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
    for k in PER_TOKEN:
        if f"{k}_NxL" in batch:
            out[f"{k}_ZxL"] = batch[f"{k}_NxL"]
    out.update({k: batch[k] for k in PER_ROW if k in batch})
    return out
