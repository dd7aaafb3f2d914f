"""Rollout engines: what samples a run's answers (the RL passes, validation, evaluation and the
toy gate), behind one interface (`types.RolloutEngine`): `NativeEngine`, the jit sampler of
`engine.sampler.sampling` on the trainer's own weights (the TPU path, the default), here; vLLM's
(`run.vllm_engine.VllmEngine`), an optional extra. `run.build.rollout_engine` picks one from
`rollout.engine`. `StepSampler` is the rollout's `GroupSampler` on any engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from sage_jax.engine.sampler import programs, sampling, sampling_plan
from sage_jax.config import Config
from sage_jax.rl.types import Rollout, RolloutEngine, Samples


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """The native sampler's settings of a run (`rollout.*`), built once (`of`).

    `max_rows`: at most this many answer rows decode at once (`rollout.micro_batch_size`;
    None: all at once): a call samples its prompts in chunks of whole groups, or with
    `continuous` (`rollout.continuous_batching`) in one `sampling.sample` call that refills
    finished rows' slots. `programs_kept`: compiled sampler programs kept at each sync
    (`rollout.programs_kept`, by default `programs.budget` of the model's layers; None: keep
    all)."""

    max_rows: int | None = None
    continuous: bool = False
    programs_kept: int | None = None

    @classmethod
    def of(cls, cfg: Config, num_layers: int) -> "SamplerSettings":
        kept = cfg.rollout.programs_kept
        return cls(max_rows=cfg.rollout.micro_batch_size,
                   continuous=cfg.rollout.continuous_batching,
                   programs_kept=programs.budget(num_layers) if kept is None else kept)


class NativeEngine:
    """The jit sampler on the policy's weights where they are (the trainer's, on its mesh: no
    host round trip, nothing copied at a sync).

    `eos_ids`, `pad_id`: the task's. `mesh`: the mesh the weights live on; prompt rows and KV
    caches are placed on it (see `sampling`); None: no placement (one device). `settings`: the
    run's `SamplerSettings` (default: every row at once, every program kept)."""

    name = "native"
    trainer_logprobs = True  # its log-probs are the trainer's model's: they may be old log-probs

    def __init__(self, graphdef, params, *, eos_ids: Sequence[int], pad_id: int, mesh=None,
                 settings: SamplerSettings = SamplerSettings()):
        self.graphdef, self.params, self.mesh, self.settings = graphdef, params, mesh, settings
        self.eos_ids, self.pad_id = tuple(int(e) for e in eos_ids), int(pad_id)

    def sync(self, params: Any) -> dict[str, float]:
        """Samples with `params` from now on; frees compiled programs beyond `programs_kept`.
        Returns {"programs/held", "programs/dropped"}."""
        self.params = params
        held = programs.compiled()  # new prompt lengths compile more of them
        kept = self.settings.programs_kept
        dropped = 0 if kept is None else programs.drop(kept)
        return {"programs/held": held, "programs/dropped": int(dropped)}

    def sample(self, prompts: Sequence[Sequence[int]], *, key, prompt_ids, num_samples: int,
               max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> Samples:
        per_call, most = len(prompts), self.settings.max_rows
        if most is not None and not self.settings.continuous:
            per_call = max(1, most // num_samples)
        rows = None if most is None else max(most, num_samples)
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
