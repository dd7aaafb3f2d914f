"""Rollout engines: what samples a run's answers (the RL passes, validation, evaluation and the
toy gate), behind one interface (`types.RolloutEngine`): `NativeEngine`, the jit sampler of
`engine.sampling` on the trainer's own weights (the TPU path, the default), here; vLLM's
(`run.vllm_engine.VllmEngine`), an optional extra. `run.build.rollout_engine` picks one from
`rollout.engine`. `StepSampler` is the rollout's `GroupSampler` on any engine.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from sage_jax.engine import programs, sampling, sampling_plan
from sage_jax.rl.types import Rollout, RolloutEngine, Samples


class NativeEngine:
    """The jit sampler on the policy's weights where they are (the trainer's, on its mesh: no
    host round trip, nothing copied at a sync).

    `mesh`: the mesh the weights live on; prompt rows and KV caches are placed on it (see
    `sampling`); None: no placement (one device). `max_rows`: at most this many answer rows
    decode at once (`rollout.micro_batch_size`; None: all at once): a call samples its prompts
    in chunks of whole groups, or with `continuous` (`rollout.continuous_batching`) in one
    `sampling.sample` call that refills finished rows' slots. `programs_kept`: compiled sampler
    programs kept at each sync (`rollout.programs_kept`; None: keep all)."""

    name = "native"
    trainer_logprobs = True  # its log-probs are the trainer's model's: they may be old log-probs

    def __init__(self, graphdef, params, *, eos_ids: Sequence[int], pad_id: int, mesh=None,
                 max_rows: int | None = None, continuous: bool = False,
                 programs_kept: int | None = None):
        self.graphdef, self.params, self.mesh = graphdef, params, mesh
        self.max_rows, self.continuous, self.programs_kept = max_rows, continuous, programs_kept
        self.eos_ids, self.pad_id = tuple(int(e) for e in eos_ids), int(pad_id)

    def sync(self, params: Any) -> dict[str, float]:
        """Samples with `params` from now on; frees compiled programs beyond `programs_kept`.
        Returns {"programs/held", "programs/dropped"}."""
        self.params = params
        held = programs.compiled()  # new prompt lengths compile more of them
        dropped = 0 if self.programs_kept is None else programs.drop(self.programs_kept)
        return {"programs/held": held, "programs/dropped": int(dropped)}

    def sample(self, prompts: Sequence[Sequence[int]], *, key, prompt_ids, num_samples: int,
               max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> Samples:
        per_call = len(prompts)
        if self.max_rows is not None and not self.continuous:
            per_call = max(1, self.max_rows // num_samples)
        rows = None if self.max_rows is None else max(self.max_rows, num_samples)
        ids = np.asarray(prompt_ids, np.int32)
        parts = []
        for i in range(0, len(prompts), per_call):
            chunk = prompts[i:i + per_call]
            tok, mask = sampling.left_pad(
                chunk, sampling_plan.prompt_bucket(max(len(p) for p in chunk)), self.pad_id)
            out = sampling.sample(
                self.graphdef, self.params, tok, mask, key=key, num_samples=num_samples,
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                top_k=top_k, eos_ids=self.eos_ids, prompt_ids_B=ids[i:i + per_call],
                pad_id=self.pad_id, mesh=self.mesh, max_rows=rows)
            parts.append(Samples(out.tokens, out.lengths, out.logprobs))
        return parts[0] if len(parts) == 1 else Samples(*(np.concatenate(x) for x in zip(*parts)))

    def logprob_gap(self, ro: Rollout) -> dict[str, float]:
        """{}: the trainer's own model sampled."""
        return {}

    def close(self) -> None:
        pass


class StepSampler:
    """The rollout's `GroupSampler` on an engine: a call with `salt` samples with
    fold_in(key, salt) (the loop's key is fold_in(run key, step)); counts the tokens it drew."""

    def __init__(self, engine: RolloutEngine, key):
        self.engine, self.key = engine, key
        self.generated_tokens = 0

    def __call__(self, prompts, *, prompt_ids, salt, num_samples, max_new_tokens, temperature,
                 top_p, top_k) -> Samples:
        out = self.engine.sample(prompts, key=jax.random.fold_in(self.key, salt),
                                 prompt_ids=prompt_ids, num_samples=num_samples,
                                 max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k)
        self.generated_tokens += int(np.sum(out.lengths))  # host arrays, every process's rows
        return out
