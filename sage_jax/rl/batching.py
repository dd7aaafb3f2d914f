"""From token lists to arrays: left-padded prompts, the policy sampler adapter, the train batch.

Shapes: B prompts, G answers each, N = B*G rows (prompt-major: row b*G + g), P prompt columns
(a `sampling.prompt_bucket` size), T answer columns (rl.max_new_tokens), L train-row columns
(a `sampling.length_bucket` of the longest prompt + answer: the same few sizes at every step,
each one update program).
"""

from __future__ import annotations


import jax
import numpy as np

from sage_jax.core import grpo
from sage_jax.engine import sampling
from sage_jax.rl.types import Rollout, Samples


class PolicySampler:
    """The rollout's `GroupSampler` on the current policy: keys fold in (step, salt).

    `params` are used where they are (the trainer's, on its mesh: no host round trip); `mesh`,
    the mesh they live on, places prompt rows and KV caches on it (see `sampling`); None: no
    placement (one device). `max_rows`: at most this many answer rows decode at once
    (`rl.rollout_micro_batch_size`; continuous batching, see `sampling.sample`; None: all at
    once)."""

    def __init__(self, graphdef, params, *, key, step: int, eos_ids, pad_id: int, mesh=None,
                 max_rows: int | None = None):
        self.graphdef, self.params, self.mesh, self.max_rows = graphdef, params, mesh, max_rows
        self.key = jax.random.fold_in(key, step)
        self.eos_ids, self.pad_id = tuple(eos_ids), pad_id
        self.generated_tokens = 0

    def __call__(self, prompts, *, prompt_ids, salt, num_samples, max_new_tokens, temperature,
                 top_p, top_k) -> Samples:
        length = sampling.prompt_bucket(max(len(p) for p in prompts))
        tok, mask = sampling.left_pad(prompts, length, self.pad_id)
        out = sampling.sample(
            self.graphdef, self.params, tok, mask, key=jax.random.fold_in(self.key, salt),
            num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, eos_ids=self.eos_ids,
            prompt_ids_B=np.asarray(prompt_ids, np.int32), pad_id=self.pad_id, mesh=self.mesh,
            max_rows=self.max_rows)
        self.generated_tokens += int(np.sum(out.lengths))  # host arrays, every process's rows
        return Samples(out.tokens, out.lengths, out.logprobs)


def train_batch(ro: Rollout, *, loss_context: str = "hinted", adv_scale: str = "group",
                pad_id: int = 0, sampler_logprobs: bool = False) -> dict[str, np.ndarray]:
    """The update's batch (see `update.py`) from a rollout, rows prompt-major, each row its
    prompt then its answer from column 0, right-padded to L (positions count valid tokens, so
    this equals a left-padded prompt; it only drops the padding between prompt and answer).

    `loss_context`: "hinted" trains on log pi(answer | prompt + hint) for hinted groups (the
    published setting); "plain" on log pi(answer | bare prompt) (the off-policy ablation).
    `sampler_logprobs`: the sampler's log-probs of the answers become the batch's old log-probs
    (`rl.old_logprobs=sampler`; only in the context they were sampled in, "hinted").
    """
    if loss_context not in ("hinted", "plain"):
        raise ValueError(f"loss_context must be 'hinted' or 'plain', got {loss_context!r}")
    if sampler_logprobs and loss_context != "hinted":
        raise ValueError("the sampler's log-probs are of the hinted context: they cannot be the "
                         "old log-probs of loss_context='plain'")
    prompts = ro.prompts if loss_context == "hinted" else ro.plain_prompts
    tokens_BxGxT, lengths_BxG = ro.samples.tokens, ro.samples.lengths
    b, g, _ = tokens_BxGxT.shape
    plen_B = np.asarray([len(x) for x in prompts])
    rows_BxG = plen_B[:, None] + lengths_BxG  # each row: its prompt, then its answer, packed
    width = sampling.length_bucket(int(rows_BxG.max()))
    tokens = np.full((b, g, width), pad_id, np.int32)
    loss_mask = np.zeros((b, g, width), bool)
    old_logp = np.zeros((b, g, width) if sampler_logprobs else (b, g, 0), np.float32)
    for i, p in enumerate(prompts):
        tokens[i, :, :len(p)] = p
        for j in range(g):
            n = int(lengths_BxG[i, j])
            tokens[i, j, len(p):len(p) + n] = tokens_BxGxT[i, j, :n]
            loss_mask[i, j, len(p):len(p) + n] = True
            if sampler_logprobs:
                old_logp[i, j, len(p):len(p) + n] = ro.samples.logprobs[i, j, :n]
    mask = np.arange(width)[None, None, :] < rows_BxG[:, :, None]
    adv = np.asarray(grpo.group_advantages(ro.rewards, scale=adv_scale), np.float32)
    batch = {"tokens_NxL": tokens.reshape(b * g, width),
             "mask_NxL": mask.reshape(b * g, width),
             "loss_mask_NxL": loss_mask.reshape(b * g, width),
             "advantages_N": adv.reshape(b * g),
             "level_N": np.repeat(ro.level, g).astype(np.int8),
             "collapse_N": np.repeat(ro.collapse, g).astype(np.int8)}
    if sampler_logprobs:
        batch["old_logp_NxL"] = old_logp.reshape(b * g, width)
    return batch
