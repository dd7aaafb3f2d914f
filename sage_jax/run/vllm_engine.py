"""`rollout.engine=vllm`: vLLM as the run's `RolloutEngine` (an optional extra,
`pip install 'sage_jax[vllm]'` or `pip install -r requirements-vllm.txt`).

`check` runs before a run starts: without vLLM installed the key fails in one line naming the
extra. `VllmEngine` runs vLLM's engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`),
built from the run's Hugging Face model folder, and samples a call's answers with one seed per
prompt (from the call's key and the prompt's id). `sync` gives it the policy's weights: the
export's tensors (`sync_tensors`: `models.hf_tensors`, the names of model.safetensors; a LoRA
policy's adapters folded into the kernels at each sync), handed over through DLPack (no host
copy on a GPU) to vLLM's in-place reload. Its log-probs are of the raw logits,
as the native sampler's; the update's old log-probs stay JAX's, and `logprob_gap` compares the
two. docs/running.md, "Rollouts with vLLM", says what is tested and measured.
"""

from __future__ import annotations

import importlib.util
import os
import zlib
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from sage_jax import models
from sage_jax.config import Config, ConfigError
from sage_jax.core import grpo
from sage_jax.rl import batching
from sage_jax.rl.types import Rollout, Samples

INSTALL = "pip install 'sage_jax[vllm]' (or pip install -r requirements-vllm.txt)"


def installed() -> bool:
    """Whether the `vllm` package can be imported here (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def check(cfg: Config) -> None:
    """Raises a one-line `ConfigError` when `cfg.rollout.engine` cannot sample in this process:
    vLLM not installed, or not one process on a Hugging Face model (model.path)."""
    if cfg.rollout.engine != "vllm":
        return
    if not installed():
        raise ConfigError(f"rollout.engine=vllm needs vLLM, which is not installed: {INSTALL}",
                          key="rollout.engine")
    if not cfg.model.path or jax.process_count() > 1:
        raise ConfigError("rollout.engine=vllm runs in one process on a Hugging Face model "
                          "(model.path); use rollout.engine=native here", key="rollout.engine")


def logprob_gap(graphdef, params, ro: Rollout, pad_id: int, *, every_row: bool = False
                ) -> dict[str, float]:
    """The engine's log-probs of the sampled answer tokens against JAX's under `params` (the
    weights it sampled with): mean and max absolute difference over each prompt's first answer
    (a weight-sync bug shows in any row; one answer in G costs a G-th of a forward pass), or
    over every answer with `every_row`."""
    b = batching.train_batch(ro, pad_id=pad_id, sampler_logprobs=True)
    g = 1 if every_row else ro.samples.lengths.shape[1]
    b = {k: v[::g] for k, v in b.items() if k.endswith("_NxL")}  # row n: answer (n // G, n % G)
    ours = np.asarray(_token_logprobs(graphdef, params, b["tokens_NxL"], b["mask_NxL"],
                                      b["loss_mask_NxL"]))
    diff = np.abs(ours - b["old_logp_NxL"])[b["loss_mask_NxL"]]
    return {"rollout/logprob_diff_mean": float(diff.mean()) if diff.size else 0.0,
            "rollout/logprob_diff_max": float(diff.max()) if diff.size else 0.0}


@jax.jit(static_argnums=0)
def _token_logprobs(graphdef, params, tokens_NxL, mask_NxL, need_NxL):
    return grpo.token_logprobs(graphdef, params, tokens_NxL, mask_NxL, need_NxL=need_NxL)


_merged_params = jax.jit(models.merged_params, static_argnums=0)


def sync_tensors(dims: models.DecoderConfig, graphdef, params: Any) -> dict[str, jax.Array]:
    """{HF tensor name: array} that vLLM loads for the policy `params` of `graphdef` (a
    `Decoder` of `dims`): `models.hf_tensors`, with a LoRA policy's adapters folded into the
    kernels first (`models.merged_params`, on the params' devices; vLLM runs the merged
    weights, as it would a full fine-tune's)."""
    if jax.tree.leaves(nnx.filter_state(params, nnx.LoRAParam)):
        if graphdef is None:
            raise ValueError("the parameters hold LoRA adapters: folding them in for vLLM needs "
                             "the policy's graphdef (VllmEngine(..., graphdef))")
        params = _merged_params(graphdef, params)
    return models.hf_tensors(dims, params)


def row_seed(key: jax.Array, prompt_id: int) -> int:
    """The seed of one prompt's answers in one sampling call, from the call's key (a rerun
    draws the same ones)."""
    bits = np.asarray(jax.random.key_data(key)).tobytes()
    return zlib.crc32(bits + int(prompt_id).to_bytes(8, "little", signed=True)) & 0x7FFFFFFF


def _as_torch(t: jax.Array):
    """`t` as a torch tensor over the same buffer (DLPack): on a GPU the weights reach vLLM
    without a host copy. A sharded array is gathered onto one device first."""
    import torch  # vLLM's own dependency: its weight loaders take torch tensors

    if len(t.devices()) > 1:
        t = jax.device_put(t, jax.local_devices()[0])
    return torch.from_dlpack(t)


def _repack_vocab_layers(model) -> int:
    """Re-runs the embedding's and the LM head's post-load processing: on CPU it packs their
    weights for oneDNN once at start-up and keeps the weight too, so the in-place reload leaves
    the old packed copy in use (measured: log-probs off by 0.14 after a 1 % update, 2.6e-5 with
    this). A no-op elsewhere. Returns the layers processed."""
    import vllm  # pyright: ignore[reportMissingImports]  # the optional extra, only here

    vocab = vllm.model_executor.layers.vocab_parallel_embedding  # loaded with the model

    layers = [m for m in model.modules() if isinstance(m, vocab.VocabParallelEmbedding)]
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)
    return len(layers)


class VllmEngine:
    """The run's `RolloutEngine` on vLLM's engine, in this process.

    `model_dir`: the Hugging Face folder the engine starts from (its tokenizer is not used: the
    prompts are token ids); `graphdef` the trainer's model definition of `dims` (for
    `logprob_gap`); `dtype` the engine's weights' dtype; `memory` the share of the
    accelerator's memory vLLM may take (`rollout.vllm_memory`; on CPU,
    `VLLM_CPU_KVCACHE_SPACE` GiB apply); `max_len` the longest prompt + answer."""

    name = "vllm"
    trainer_logprobs = False  # another engine's numerics: the old log-probs stay JAX's

    def __init__(self, model_dir: str | Path, dims: models.DecoderConfig, graphdef=None, *,
                 dtype: str, memory: float, max_len: int, eos_ids: Sequence[int], pad_id: int,
                 seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm  # pyright: ignore[reportMissingImports]  # the optional extra, only here

        self._vllm = vllm
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, seed=seed,
                            gpu_memory_utilization=memory, max_model_len=max_len,
                            enable_prefix_caching=False, skip_tokenizer_init=True)
        self.dims, self.graphdef, self.params = dims, graphdef, None
        self.eos_ids, self.pad_id = tuple(int(e) for e in eos_ids), int(pad_id)

    def sync(self, params: Any) -> dict[str, float]:
        """Gives the engine the policy's weights (the `nnx.State` of `graphdef`, a `Decoder` of
        `dims`; a LoRA policy's adapters folded in, `sync_tensors`)."""
        weights = [(name, _as_torch(t))
                   for name, t in sync_tensors(self.dims, self.graphdef, params).items()]
        # vLLM's in-place reload: checkpoint-format tensors through each layer's weight loader,
        # then its post-load processing again (on CPU the linear weights are repacked for
        # oneDNN, which a bare `model.load_weights` after start-up cannot reach).
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                          "is_checkpoint_format": True})
        self.llm.apply_model(_repack_vocab_layers)
        self.params = params
        return {}

    def sample(self, prompts, *, key, prompt_ids, num_samples, max_new_tokens, temperature,
               top_p, top_k) -> Samples:
        vllm = self._vllm
        knobs = [vllm.SamplingParams(
            n=num_samples, temperature=temperature, top_p=top_p, top_k=top_k or -1,
            max_tokens=max_new_tokens, seed=row_seed(key, int(pid)), logprobs=0,
            stop_token_ids=list(self.eos_ids), detokenize=False) for pid in prompt_ids]
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts],
                                 knobs, use_tqdm=False)
        b, g = len(prompts), num_samples
        tokens = np.full((b, g, max_new_tokens), self.pad_id, np.int32)
        lengths = np.zeros((b, g), np.int32)
        logprobs = np.zeros((b, g, max_new_tokens), np.float32)
        for i, out in enumerate(outs):
            for j, c in enumerate(out.outputs):
                ids = list(c.token_ids)[:max_new_tokens]
                tokens[i, j, :len(ids)] = ids
                lengths[i, j] = len(ids)
                logprobs[i, j, :len(ids)] = [step[t].logprob for step, t in zip(c.logprobs, ids)]
        return Samples(tokens, lengths, logprobs)

    def logprob_gap(self, ro: Rollout) -> dict[str, float]:
        """`logprob_gap` of `ro` under the synced weights."""
        if self.graphdef is None or self.params is None:
            return {}
        return logprob_gap(self.graphdef, self.params, ro, self.pad_id)

    def close(self) -> None:
        pass

    def sequence_logprobs(self, tokens: Sequence[int]) -> np.ndarray:
        """log p(tokens[t] | tokens[<t]) for t >= 1 under the engine's weights (0 at t = 0)."""
        knobs = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": [int(t) for t in tokens]}], knobs,
                                use_tqdm=False)[0]
        logp = np.zeros(len(tokens), np.float32)
        for t, step in enumerate(out.prompt_logprobs or []):
            if step:
                logp[t] = step[int(tokens[t])].logprob
        return logp
