"""TrainState: everything a run carries from step to step, as one pytree (checkpointed whole).

The model's `graphdef` and the optax transform are static: they are rebuilt from the config and
never stored in the state.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

SageArrays = dict[str, np.ndarray]
"""`TrainState.sage`: per-prompt SAGE arrays by name, host arrays indexed by training example
(what `rl.types.SageTables.arrays()` gives); empty in a state that carries none."""


class TrainState(flax.struct.PyTreeNode):
    """params: the policy's parameter pytree (`models.split(model)[1]`), float32 masters when
    the model is stored in bf16 and master_fp32 is on (with LoRA: the adapters only; the frozen
    base stays in the model dtype); opt_state: optax state of the trained params (with LoRA:
    of the adapters, `trainable_split`);
    step: int32 training steps done (one step = one `train_step` call, i.e. `rl.minibatches *
    rl.epochs_per_batch` optimiser updates); rng: the run's PRNG key (raw uint32[2], so it
    checkpoints as a plain array); data_position: int32 position in the data stream;
    sage: the per-prompt SAGE arrays (`SageArrays`; empty where the state carries none: the
    train step's state, whose inputs are then the same at every step)."""

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array
    data_position: jax.Array
    sage: SageArrays = flax.struct.field(default_factory=dict)


def master_params(params, master_fp32: bool = True):
    """`params` with floating leaves cast to float32 when `master_fp32` (else unchanged)."""
    if not master_fp32:
        return params
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def trainable_split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(trained, frozen) parts of a LoRA model's `params`: its adapters (`nnx.LoRAParam`) and
    everything else; `nnx.merge_state(trained, frozen)` is `params` again."""
    trained, frozen = nnx.split_state(params, nnx.LoRAParam, ...)
    return trained, frozen


def param_counts(params: nnx.State, lora: bool) -> dict[str, int]:
    """{"params/trainable": elements the optimiser updates (the adapters' with `lora`, else
    all), "params/total": all elements of `params`}."""
    total = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))
    trained = trainable_split(params)[0] if lora else params
    return {"params/trainable": sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(trained)),
            "params/total": total}


def checkpointed(state: TrainState, lora: bool) -> TrainState:
    """What a checkpoint holds of `state`: all of it; with `lora`, params are the adapters
    only (the frozen base is rebuilt from the run's model, `with_base` puts it back)."""
    return state.replace(params=trainable_split(state.params)[0]) if lora else state


def with_base(saved: TrainState, state: TrainState, lora: bool) -> TrainState:
    """`saved` (a restored `checkpointed` state) with `state`'s frozen base merged back into
    its params (with `lora`; else `saved` itself)."""
    if not lora:
        return saved
    return saved.replace(params=nnx.merge_state(saved.params, trainable_split(state.params)[1]))


def without_adapters(params: nnx.State) -> nnx.State:
    """A LoRA model's `params` with its adapters zeroed: the frozen base's function (the KL
    reference of a LoRA run), without a second copy of the base."""
    trained, frozen = trainable_split(params)
    return nnx.merge_state(jax.tree.map(jnp.zeros_like, trained), frozen)
