"""Rollout engines: what samples a run's answers (the RL passes, validation, evaluation and the
toy gate), behind one interface (`types.RolloutEngine`): `NativeEngine`, the jit sampler of
`engine.sampler.sampling` on the trainer's own weights (the TPU path, the default), here; vLLM's
(`run.vllm_engine.VllmEngine`), an optional extra. `run.build.rollout_engine` picks one from
`rollout.engine`. `LoraFolder` folds a LoRA policy's adapters into its kernels for the native
engine (`rollout.lora_merged`). `StepSampler` is the rollout's `GroupSampler` on any engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from sage_jax import models
from sage_jax.engine.sampler import programs, sampling, sampling_plan
from sage_jax.config import Config
from sage_jax.infra import parallel
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


def has_adapters(params: Any) -> bool:
    """Whether the policy's `params` hold LoRA adapters (`nnx.LoRAParam`)."""
    return bool(jax.tree.leaves(nnx.filter_state(params, nnx.LoRAParam)))


def _named(tree: Any) -> dict[str, Any]:
    """{"layers/0/self_attn/q_proj/kernel": leaf, ...}: `tree`'s leaves by name."""
    return {parallel.path_str(k): x for k, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


class LoraFolder:
    """A LoRA policy's adapters folded into its kernels: a call maps the params of `graphdef`
    (a LoRA `Decoder`) to those of the plain `Decoder` of the same config (`self.graphdef`).
    Each adapted kernel becomes kernel + A @ B * alpha / r (`models.merged_params`, jitted),
    computed where it lies and placed with its sharding (on the trainer's mesh: no host round
    trip); every other leaf is the policy's own array, shared, not copied."""

    def __init__(self, graphdef, params):
        self.graphdef, shapes = nnx.split(nnx.eval_shape(
            lambda p: models.merge_lora(models.merge(graphdef, p)), params))
        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(shapes)
        self._names = [parallel.path_str(k) for k, _ in leaves]
        named = _named(params)
        folded = [n for n in self._names
                  if n.endswith("/kernel") and n.removesuffix("kernel") + "lora_a" in named]
        self._folded = folded

        def fold(p):
            merged = _named(models.merged_params(graphdef, p))
            return [merged[n] for n in folded]  # only these: the rest is not copied

        self._fold = jax.jit(fold, out_shardings=[named[n].sharding for n in folded])

    def __call__(self, params: Any) -> Any:
        named = _named(params)
        named.update(zip(self._folded, self._fold(params)))
        return jax.tree_util.tree_unflatten(self._treedef, [named[n] for n in self._names])


class NativeEngine:
    """The jit sampler on the policy's weights where they are (the trainer's, on its mesh: no
    host round trip, nothing copied at a sync but `merge_lora`'s merged kernels).

    `eos_ids`, `pad_id`: the task's. `mesh`: the mesh the weights live on; prompt rows and KV
    caches are placed on it (see `sampling`); None: no placement (one device). `settings`: the
    run's `SamplerSettings` (default: every row at once, every program kept). `merge_lora`
    (`rollout.lora_merged`), for a policy whose params hold LoRA adapters: at construction and
    at every sync they are folded into a copy of the adapted kernels (`LoraFolder`; the other
    weights shared), and the plain model of those samples (no adapter dots while decoding, one
    merged copy of those kernels held); without it, or without adapters, the policy samples as
    it is (a LoRA one runs its adapters at every projection)."""

    name = "native"
    trainer_logprobs = True  # its log-probs are the trainer's model's: they may be old log-probs

    def __init__(self, graphdef, params, *, eos_ids: Sequence[int], pad_id: int, mesh=None,
                 settings: SamplerSettings = SamplerSettings(), merge_lora: bool = False):
        self.folder = LoraFolder(graphdef, params) if merge_lora and has_adapters(
            params) else None
        self.graphdef = graphdef if self.folder is None else self.folder.graphdef
        self.params = self._sampled(params)
        self.mesh, self.settings = mesh, settings
        self.eos_ids, self.pad_id = tuple(int(e) for e in eos_ids), int(pad_id)

    def _sampled(self, params: Any) -> Any:
        """What the sampler runs for the policy's `params`: they, or their merged form."""
        return params if self.folder is None else self.folder(params)

    def sync(self, params: Any) -> dict[str, float]:
        """Samples with `params` from now on (merged into a new copy with `merge_lora`, the
        previous copy freed first); frees compiled programs beyond `programs_kept`. Returns
        {"programs/held", "programs/dropped"}."""
        self.params = None
        self.params = self._sampled(params)
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
