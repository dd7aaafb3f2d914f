"""The contract of one RL step on the host: what the sampler returns (`Samples`), the sampler,
rollout-engine and scorer interfaces, the per-prompt SAGE tables, and a step's groups
(`Rollout`). Rollout, batching and the trainer all use these; the first-pass status codes are
`core.sage.COLLAPSE_*`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol, Sequence

import flax.struct
import jax
import numpy as np

from sage_jax.core import sage
from sage_jax.engine.trainer.state import SageArrays


class Samples(NamedTuple):
    """Host arrays from the sampler: tokens [B, G, T], lengths [B, G], logprobs [B, G, T]."""

    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray


class GroupSampler(Protocol):
    def __call__(self, prompts: Sequence[Sequence[int]], *, prompt_ids: np.ndarray, salt: int,
                 num_samples: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int) -> Samples:
        """G answers per prompt. Randomness derives from (step, prompt_ids[b], sample, salt)."""
        ...


class RolloutEngine(Protocol):
    """What samples a run's answers (`rl.engines`: the native jit sampler; `run.vllm_engine`:
    vLLM), built once per run from `rollout.engine`."""

    name: str  # its `rollout.engine` value
    trainer_logprobs: bool  # its log-probs are the trainer's model's (they may be old log-probs)

    def sync(self, params) -> dict[str, float]:
        """Samples with `params` (the policy's `nnx.State`) from now on; returns metrics."""
        ...

    def sample(self, prompts: Sequence[Sequence[int]], *, key: jax.Array, prompt_ids,
               num_samples: int, max_new_tokens: int, temperature: float, top_p: float,
               top_k: int) -> Samples:
        """G answers per prompt; the answers of a prompt depend only on (key, its prompt id)."""
        ...

    def logprob_gap(self, ro: "Rollout") -> dict[str, float]:
        """Metrics of how far the engine's log-probs of `ro`'s answers are from the trainer's
        under the synced weights ({} where they are the trainer's own)."""
        ...

    def close(self) -> None:
        ...


@flax.struct.dataclass
class SageTables:
    """Per-dataset-prompt SAGE arrays, all indexed by [E] (E training examples): kept in
    `TrainState.sage` by name (`arrays`) and checkpointed with it; the trainer updates host
    copies (`from_arrays`) in place."""

    hint_level: np.ndarray  # int8: sage_light level used the last time the prompt was seen
    last_accuracy: np.ndarray  # float32
    seen: np.ndarray  # bool
    ever_solved: np.ndarray  # bool
    hint_cache: np.ndarray  # uint8 [E, 3, W]: last good payload per level (UTF-8, 0-padded)
    hint_step: np.ndarray  # int32: step the cached payload was written (-1: none)

    @classmethod
    def empty(cls, num_prompts: int, hint_width: int = 2048) -> "SageTables":
        m = num_prompts
        return cls(hint_level=np.zeros(m, np.int8), last_accuracy=np.zeros(m, np.float32),
                   seen=np.zeros(m, bool), ever_solved=np.zeros(m, bool),
                   hint_cache=np.zeros((m, 3, hint_width), np.uint8),
                   hint_step=np.full(m, -1, np.int32))

    @classmethod
    def from_arrays(cls, arrays: SageArrays) -> "SageTables":
        """Writable host copies of the tables `TrainState.sage` holds (e.g. a restored one's)."""
        return cls(**arrays).host_copy()

    def arrays(self) -> SageArrays:
        """The tables as `TrainState.sage` holds (and checkpoints) them: {field name: array}."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def host_copy(self) -> "SageTables":
        """Writable numpy copies of the arrays (e.g. of a restored state's tables)."""
        return jax.tree.map(np.array, self)

    def cached_hints(self, i: int) -> dict[int, str]:
        out = {lvl: sage.decode_hint(self.hint_cache[i, lvl - 1]) for lvl in sage.LEVELS}
        return {k: v for k, v in out.items() if v}

    def store_hints(self, i: int, hints: dict[int, str], step: int) -> None:
        width = self.hint_cache.shape[-1]
        for lvl in sage.LEVELS:
            self.hint_cache[i, lvl - 1] = sage.encode_hint(hints.get(lvl), width)
        self.hint_step[i] = step


@dataclasses.dataclass
class Rollout:
    """One step's groups. `prompts[b]` is the context the answers were sampled with."""

    prompts: list[list[int]]  # hinted prompt for hinted groups
    plain_prompts: list[list[int]]  # the bare answer prompt of every row
    samples: Samples
    rewards: np.ndarray  # float32 [B, G]
    level: np.ndarray  # int8 [B]: hint level of the group (0: no hint)
    collapse: np.ndarray  # int8 [B]: first-pass status, sage.COLLAPSE_*
    round: np.ndarray  # int8 [B]: 0 first pass, k = k-th re-sample
    hints: list[str | None]
    texts: list[list[str]]  # decoded answers [B][G]
    metrics: dict[str, float]
    # What the policy wrote when asked for a hint payload this step (online/offline sources;
    # None where it was not asked), whether or not it parsed.
    hint_written: list[str | None] = dataclasses.field(default_factory=list)
