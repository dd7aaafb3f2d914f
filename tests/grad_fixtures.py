"""A reference gradient for the update tests: one mini-batch's gradient, accumulated over
micro-batches exactly as `engine.trainer.update.train_step` accumulates it for one optimiser update."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sage_jax.engine.trainer import packing, update


def minibatch_grads(params, batch, *, graphdef, cfg, mesh, chunk=update.DEFAULT_CHUNK,
                    remat_logits=True):
    """(grads, metrics) of the whole `batch` taken as one mini-batch, accumulated over
    micro-batches of `cfg.rl.micro_batch_size` rows (what one optimiser update uses)."""
    settings = dataclasses.replace(update.UpdateSettings.of(cfg), minibatches=1)
    data, tokens_M, seqs_M = update._prepare(params, _packed(batch), graphdef=graphdef,
                                             settings=settings, mesh=mesh, chunk=chunk)
    return update._accumulate(params, jax.tree.map(lambda x: x[0], data), tokens_M[0],
                              seqs_M[0], graphdef=graphdef, settings=settings, mesh=mesh,
                              chunk=chunk,
                              remat_logits=remat_logits)


def _packed(batch: dict) -> dict:
    """`batch` in the packed form the update takes (a padded one: one row per sequence)."""
    return batch if packing.is_packed(batch) else packing.as_packed(batch, jnp)
