"""Supervised fine-tuning: masked cross-entropy on answer tokens, AdamW, one jitted step.

It warm-starts the toy model before RL, and it is the paper's SFT baseline (train on reference
answers instead of RL). An example is a pair (prompt ids, answer ids); the answer's ids should end
with the end-of-sequence token, which gets gradient like every answer token. Prompt tokens get no
loss. Rows are right-padded to a few bucketed lengths, so the step compiles a handful of times.

    model, log = train_sft(model, examples, steps=600, batch_size=64, lr=2e-3, seed=0)

`python -m sage_jax.sft` (the command) warm-starts the toy model with it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sage_jax.config import OptimConfig
from sage_jax.core import grpo
from sage_jax.engine.trainer import update
from sage_jax.models import decoder as dec

log = logging.getLogger(__name__)

Pair = tuple[Sequence[int], Sequence[int]]


# ---- batches --------------------------------------------------------------------------------

def bucket_length(n: int, bucket: int) -> int:
    return int(math.ceil(n / bucket) * bucket)


def make_batch(pairs: Sequence[Pair], *, pad_id: int, bucket: int = 32,
               max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """tokens [B, T] (right-padded) and loss_mask [B, T-1]: True where token t+1 is an answer
    token, i.e. where the logits at position t are scored."""
    lengths = [len(p) + len(a) for p, a in pairs]
    t = bucket_length(max(lengths), bucket)
    if max_len is not None and t > max_len:
        raise ValueError(f"an SFT example has {max(lengths)} tokens, more than max_len={max_len}")
    tokens = np.full((len(pairs), t), pad_id, np.int32)
    mask = np.zeros((len(pairs), t - 1), bool)
    for i, (p, a) in enumerate(pairs):
        if not a:
            raise ValueError(f"SFT example {i} has an empty answer")
        if not p:
            raise ValueError(f"SFT example {i} has an empty prompt (start it with <bos>)")
        n = len(p) + len(a)
        tokens[i, :len(p)] = p
        tokens[i, len(p):n] = a
        mask[i, len(p) - 1:n - 1] = True
    return tokens, mask


# ---- loss and step --------------------------------------------------------------------------

def next_token_logprobs(graphdef, params, tokens_BxT, *, chunk: int | None = None):
    """[B, T-1] float32: column t is log p(tokens[t+1] | tokens[<=t]) (one column shorter than
    the tokens; `core.grpo.token_logprobs` instead aligns column t with token t). `chunk`: the
    logits made that many columns at a time (`grpo.logprobs_from_hidden`), else all at once."""
    if chunk is not None:
        model = nnx.merge(graphdef, params)
        need_BxT = jnp.ones(tokens_BxT.shape, bool)
        return grpo.logprobs_from_hidden(model.logits, model.hidden(tokens_BxT), tokens_BxT,
                                         need_BxT, chunk=chunk)[0][:, 1:]
    logits = dec.apply(graphdef, params, tokens_BxT[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens_BxT[:, 1:, None], axis=-1)[..., 0]


def sft_loss(graphdef, params, tokens_BxT, mask_BxTm1, *, chunk: int | None = None):
    """Mean negative log-likelihood over the answer tokens of the batch."""
    lp = next_token_logprobs(graphdef, params, tokens_BxT, chunk=chunk)
    m = mask_BxTm1.astype(jnp.float32)
    return -(lp * m).sum() / jnp.maximum(m.sum(), 1.0)


SFT_B2 = 0.98  # Adam b2 of the SFT recipe (RL uses optim.b2, 0.999 by default)
Schedule = Literal["constant", "cosine", "linear"]  # as `OptimConfig.schedule`


def make_optimizer(lr: float, *, warmup: int = 50, weight_decay: float = 0.01,
                   b1: float = 0.9, b2: float = SFT_B2, clip: float = 1.0,
                   schedule: Schedule = "constant", steps: int = 1
                   ) -> optax.GradientTransformation:
    """The RL optimiser (`update.make_optimizer`: clip, AdamW, linear warm-up then `schedule`
    over `steps` updates) with SFT's settings."""
    cfg = OptimConfig(lr=lr, schedule=schedule, warmup_steps=max(warmup, 1),
                      weight_decay=weight_decay, b1=b1, b2=b2, grad_clip=clip)
    return update.make_optimizer(cfg, steps)


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *,
                    chunk: int | None = None):
    """jit(params, opt_state, tokens, mask) -> (params, opt_state, loss)."""

    def step(params, opt_state, tokens, mask):
        loss, grads = jax.value_and_grad(
            lambda p: sft_loss(graphdef, p, tokens, mask, chunk=chunk))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


# ---- the trainer ----------------------------------------------------------------------------

@dataclasses.dataclass
class SFTResult:
    """What `train_sft` did: per-step losses, evaluations [(step, metrics)], why it stopped."""

    losses: list[float]
    evals: list[tuple[int, dict]]
    steps: int
    seconds: float
    stopped_early: bool


def train_sft(model: nnx.Module, examples: Sequence[Pair] | Callable[[np.random.Generator, int],
                                                                     Sequence[Pair]],
              *, steps: int, batch_size: int = 64, lr: float = 2e-3, seed: int = 0,
              pad_id: int = 0, bucket: int = 32, max_len: int | None = None,
              warmup: int = 50, weight_decay: float = 0.01, clip: float = 1.0,
              schedule: Schedule = "constant", sort_pool: int = 8,
              eval_every: int = 0, eval_fn: Callable[[nnx.Module], dict] | None = None,
              stop_fn: Callable[[dict], bool] | None = None, log_every: int = 50,
              progress: Callable[[str], None] | None = None,
              logprob_chunk: int | None = None) -> tuple[nnx.Module, SFTResult]:
    """Trains `model` in place on (prompt, answer) pairs and returns it with an `SFTResult`.

    `examples` is a list of pairs (batches are drawn from it with replacement, seeded) or a
    function `(rng, n) -> n pairs` that makes fresh ones. Every `eval_every` steps `eval_fn(model)`
    returns metrics (an empty dict: skipped); training stops early when `stop_fn(metrics)` is
    true. `progress` gets one
    line per `log_every` steps (default: the logger).

    Batches are cut from a pool of `sort_pool` batches sorted by length (then visited in random
    order), so rows of a batch have similar lengths and little padding; lengths are rounded up to
    a multiple of `bucket`, which bounds the number of compiled step shapes. `logprob_chunk`:
    the loss's logits made that many columns at a time (less memory; the model's own remat
    setting decides whether its layers are recomputed in the backward pass).
    """
    say = progress or log.info
    rng = np.random.default_rng([seed, 17])
    if callable(examples):
        draw = lambda n: examples(rng, n)  # noqa: E731
    else:
        if not len(examples):
            raise ValueError("train_sft needs at least one example")
        pool = list(examples)
        draw = lambda n: [pool[i] for i in rng.integers(len(pool), size=n)]  # noqa: E731
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(lr, warmup=warmup, weight_decay=weight_decay, clip=clip,
                               schedule=schedule, steps=steps)
    opt_state = optimizer.init(params)
    train_step = make_train_step(graphdef, optimizer, chunk=logprob_chunk)
    losses: list[float] = []
    evals: list[tuple[int, dict]] = []
    stopped = False
    t0 = time.perf_counter()
    done = 0
    queue: list[list[Pair]] = []
    for i in range(1, steps + 1):
        if not queue:
            pool = sorted(draw(batch_size * max(sort_pool, 1)), key=lambda e: len(e[0]) + len(e[1]))
            queue = [pool[j:j + batch_size] for j in range(0, len(pool), batch_size)]
            queue = [queue[j] for j in rng.permutation(len(queue))]
        tokens, mask = make_batch(queue.pop(), pad_id=pad_id, bucket=bucket, max_len=max_len)
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(tokens),
                                             jnp.asarray(mask))
        losses.append(float(loss))
        done = i
        if log_every and (i % log_every == 0 or i == 1):
            dt = time.perf_counter() - t0
            say(f"sft step {i}/{steps} loss {np.mean(losses[-log_every:]):.4f} ({dt:.0f}s)")
        if eval_fn is not None and eval_every and i % eval_every == 0:
            nnx.update(model, params)
            metrics = eval_fn(model)
            if not metrics:  # the evaluator chose to skip this step
                continue
            evals.append((i, metrics))
            say(f"sft eval @{i}: " + " ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                                               if isinstance(v, (int, float))))
            if stop_fn is not None and stop_fn(metrics):
                stopped = True
                break
    nnx.update(model, params)
    result = SFTResult(losses=losses, evals=evals, steps=done,
                       seconds=time.perf_counter() - t0, stopped_early=stopped)
    return model, result
