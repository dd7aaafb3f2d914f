"""Per-device memory of a training run, estimated without allocating anything.

Shapes (the README's alphabet): B prompts per step, G answers each, N = B*G rows, R rows per
micro-batch, L columns of a training row (prompt bucket + max_new_tokens), D hidden, Q query
heads, K kv heads, H head dim, F MLP width, V vocab, C log-prob chunk. "/tp" means split over
the mesh's tensor axis when that divides the dimension (else whole, as `parallel.spec_for`
does); rows are split over data*fsdp.

The state's bytes are exact: the real `TrainState` (params, AdamW state) is built abstractly with
`nnx.eval_shape`/`jax.eval_shape` (`update.new_state`) and every leaf is sized by the real
partition rules (`parallel.spec_for`). With LoRA (`model.lora.rank` > 0) the state holds the
frozen base in the model dtype and the adapters; only the adapters have masters, gradients and
AdamW moments. The sampler's KV cache is exact for the shapes `sampling.sample` allocates
(its batch and prompt buckets). Activations are a model of what the update step keeps for the
backward pass (see `activation_terms`); the tests check it against XLA's buffer assignment.

Sampling and the update never run at the same time, so the peak per device is
    total = params + master + optimizer
            + max(sampler_weights + kv_cache + sampler_work, grads + activations).
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
from flax import nnx

from sage_jax import models
from sage_jax.models.decoder import causal_blocks
from sage_jax.infra import parallel
from sage_jax.engine.sampler import decode, placement
from sage_jax.engine.trainer import update
from sage_jax.engine.sampler.sampling_plan import Knobs, SamplingPlan, prompt_bucket
from sage_jax.engine.trainer.packing import length_bucket
from sage_jax.config import Config, LoraConfig, ModelConfig
from sage_jax.engine.trainer.state import TrainState, trainable_split

GIB = 1024 ** 3
F32 = 4  # bytes of a float32
LOGIT_COPIES = 3  # [R, C, V] float32 buffers live in a log-prob chunk's backward: logits,
#                   softmax, d(logits)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per device. `activations` is the sum of the named `terms` (see `activation_terms`).

    params: the weights in the model dtype (`param_dtype`), LoRA adapters included.
    master: the extra bytes of float32 masters (`master_fp32` with a 16-bit model dtype) of the
      trained params (all, or with LoRA the adapters). The train state keeps ONE float32 tree
      of them (it is both the weights and the masters; weights are cast to the compute dtype
      per matmul), so params + master = the state's params' bytes.
    optimizer: the optimiser state (AdamW mu and nu of the trained params, in their state
      dtype and sharding, plus step counters).
    grads: the gradient accumulator of `update._accumulate` (the trained params, in their
      state dtype and sharding).
    sampler_weights: the weights as the sampler's programs hold them
      (`placement.sampler_params`): the state's params, matrices cast to the compute dtype,
      regathered over fsdp, still split over tensor (`placement.SAMPLER_RULES`); with fsdp = 1
      only the cast copies (the rest is read in place: 0 when nothing is cast; with LoRA and
      float32 masters, the adapters' compute-dtype copies).
    kv_cache: the sampler's prompt cache [B', P', K/tp, H] and generated-token cache
      [B', K/tp, G, H, S] per layer (k and v), in the model dtype, B' = batch bucket of B prompts
      split over data*fsdp, P' = prompt bucket, S = max_new_tokens - 1 rounded up to 8 (the
      size the cache grows to while rows keep running).
    sampler_work: the largest transient of a sampling call: the decode start's [B'*G, V]
      float32 logits, the prefill's chunk of attention scores, one layer's half-size cache
      alive while that layer's cache doubles to S, or one layer of fewer rows (one per group,
      prompt copied) built while the old one lives (regrouping goes layer by layer, each old
      layer freed once read), whichever is largest.
    activations: what one micro-batch of the update keeps for and uses in its backward pass.
    """

    params: int
    master: int
    optimizer: int
    grads: int
    sampler_weights: int
    kv_cache: int
    sampler_work: int
    activations: int
    terms: dict = dataclasses.field(default_factory=dict)
    mesh_shape: dict = dataclasses.field(default_factory=dict)

    @property
    def state(self) -> int:
        """Bytes that live through the whole run: params + master + optimizer."""
        return self.params + self.master + self.optimizer

    @property
    def sampling_peak(self) -> int:
        return self.state + self.sampler_weights + self.kv_cache + self.sampler_work

    @property
    def update_peak(self) -> int:
        return self.state + self.grads + self.activations

    @property
    def total(self) -> int:
        """Peak bytes per device: the larger of the sampling and the update phase."""
        return max(self.sampling_peak, self.update_peak)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(state=self.state, sampling_peak=self.sampling_peak,
                   update_peak=self.update_peak, total=self.total)
        return out


def fake_mesh(mesh_shape: dict) -> types.SimpleNamespace:
    """A stand-in for a `Mesh` with axis sizes only (all `spec_for` reads): any device count."""
    unknown = set(mesh_shape) - set(parallel.AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; valid: {parallel.AXES}")
    return types.SimpleNamespace(shape={a: int(mesh_shape.get(a, 1)) for a in parallel.AXES})


def _split(n: int, ways: int) -> int:
    """n / ways when it divides, else n (a dimension an axis can't split stays whole)."""
    return n // ways if n % ways == 0 else n


def _row_shards(mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def abstract_state(model_cfg: models.DecoderConfig, *, param_dtype, compute_dtype,
                   master_fp32: bool, optimizer: str = "adamw",
                   lora: LoraConfig = LoraConfig()) -> TrainState:
    """The `TrainState` that `update.init_train_state` builds, as ShapeDtypeStructs: of the
    model with `lora`'s adapters when `lora.rank` > 0 (masters and AdamW for them alone)."""
    if optimizer != "adamw":
        raise ValueError(f"optimizer {optimizer!r}: only 'adamw' (the trainer's) is modelled")
    model = nnx.eval_shape(lambda: models.Decoder(
        model_cfg, dtype=jnp.dtype(param_dtype), compute_dtype=jnp.dtype(compute_dtype),
        rngs=nnx.Rngs(0), lora=models.LoraSpec.of(lora)))
    _, params = models.split(model)
    settings = update.UpdateSettings.of(Config(model=ModelConfig(master_fp32=master_fp32,
                                                                 lora=lora)))
    return jax.eval_shape(lambda p: update.new_state(p, settings), params)


def trained_params(state: TrainState, lora: LoraConfig = LoraConfig()):
    """The part of `state.params` the optimiser updates: all, or with `lora.rank` > 0 the
    adapters (`state.trainable_split`)."""
    return trainable_split(state.params)[0] if lora.rank else state.params


def shard_elems(path: str, shape, mesh, rules=parallel.PARTITION_RULES) -> int:
    """Elements of one leaf held by each device under the partition `rules`."""
    spec = parallel.spec_for(path, shape, mesh, rules)
    n = 1
    for i, dim in enumerate(shape):
        axes = spec[i] if i < len(spec) else None
        axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        n *= dim // math.prod(mesh.shape[a] for a in axes)
    return n


def tree_bytes(tree, mesh, itemsize: int | None = None, rules=parallel.PARTITION_RULES) -> int:
    """Per-device bytes of an (abstract) pytree sharded by the partition `rules`; `itemsize`
    overrides the leaves' own dtype sizes."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        size = itemsize or _itemsize(leaf.dtype)
        total += shard_elems(parallel.path_str(path), leaf.shape, mesh, rules) * size
    return total


def kv_cache_bytes(cfg: models.DecoderConfig, mesh, *, prompts: int, group_size: int,
                   prompt_len: int, max_new_tokens: int, dtype,
                   continuous: bool = False) -> tuple[int, int]:
    """(cache bytes, largest transient) of `sampling.sample` for `prompts` prompts (the sizes of
    its `SamplingPlan`, EOS ids on); see `Estimate.kv_cache` and `Estimate.sampler_work`.
    `continuous`: a call of more rows that batches continuously in `prompts` * `group_size`
    slots, each row with its prompt's copy."""
    knobs = Knobs(num_samples=group_size, max_new_tokens=max_new_tokens, temperature=1.0,
                  top_p=1.0, top_k=0, eos_ids=tuple(cfg.eos_ids) or (0,), pad_id=0)
    shards = _row_shards(mesh)
    plan = SamplingPlan.of_chunk(knobs, prompts, prompt_len, num_params=cfg.num_params(),
                                 shards=shards, continuous=continuous)
    p, s = plan.prompt_cols, max(plan.schedule)
    rows = _split(plan.first_rows, shards)  # decode rows on a device
    groups = rows if plan.continuous else _split(plan.batch, shards)  # prompt copies
    k = _split(cfg.num_kv_heads, mesh.shape["tensor"])
    kv_row = 2 * k * cfg.head_dim * _itemsize(dtype)  # k and v of one slot, one layer
    cache = cfg.num_layers * (groups * p + rows * s) * kv_row + groups * p  # + mask
    logits = LOGIT_COPIES * rows * cfg.vocab_size * F32  # rows split, V whole
    chunk = decode.prefill_rows(cfg, plan.prefill_prompts, p)  # prompts per prefill chunk
    scores = (2 * _split(chunk, shards) * _split(cfg.num_heads, mesh.shape["tensor"])
              * p * p * F32)  # float32 scores and softmax of one chunk, one layer
    # The cache grows by doubling, layer by layer: the last growth holds one layer's half-size
    # cache next to its full one.
    grow = rows * (plan.grow[0] if plan.grow else 0) * kv_row
    # Dropping finished rows builds, layer by layer, the layer of fewer rows (one per group, its
    # prompt copied) while the old one lives.
    regroup = _split(plan.drop_rows or 0, shards) * (p + s) * kv_row
    return cache, max(logits, scores, grow, regroup)


def _keys_per_query(seq_len: int) -> float:
    """Key slots a query's scores span, on average, in the causal query blocks of a row of
    `seq_len` tokens (`decoder.causal_blocks`: the whole row when it is one block)."""
    return sum((e - a) * e for a, e in causal_blocks(seq_len)) / seq_len


def _layer_saved_per_token(cfg, c: int, tp: int, seq_len: int) -> int:
    """Bytes one layer keeps per token for its backward pass (no remat), c = compute itemsize,
    in rows of `seq_len` tokens: float32 normalised inputs and their casts (2 norms), q and
    k after RoPE, v, float32 softmax and compute-dtype probabilities over the key slots of
    each query block, the blocks' copies of keys and values, the attention output, and the
    MLP's gate, up and their product."""
    n, k = _split(cfg.num_heads, tp), _split(cfg.num_kv_heads, tp)
    f, h, d = _split(cfg.intermediate_size, tp), cfg.head_dim, cfg.hidden_size
    blocks = causal_blocks(seq_len)
    norms = 2 * (F32 + c) * d
    qkv = c * (n + 2 * k) * h + (F32 * (n + k) * h if cfg.qk_norm else 0)
    sliced = 2 * c * k * h * sum(e for _, e in blocks[:-1]) / seq_len
    core = (F32 + c) * n * _keys_per_query(seq_len) + c * n * h
    return int(norms + qkv + sliced + core + 3 * c * f)


def _layer_backward_per_token(cfg, c: int, tp: int, seq_len: int) -> int:
    """Bytes per token of the gradients alive while one layer is back-propagated: d(scores)
    in float32 and d(probs) over each query block's key slots, and the MLP's two d(hidden) of
    width F."""
    n, f = _split(cfg.num_heads, tp), _split(cfg.intermediate_size, tp)
    return int((F32 + c) * n * _keys_per_query(seq_len) + 2 * c * f)


def _layer_weight_elems(cfg) -> int:
    return (cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (
        1 if cfg.tie_word_embeddings else 2) - cfg.hidden_size) // cfg.num_layers


def activation_terms(cfg: models.DecoderConfig, mesh, *, rows_per_step: int,
                     micro_batch_rows: int, seq_len: int, compute_dtype, state_itemsize: int,
                     remat: bool, logprob_chunk: int | None,
                     trained_layer_elems: int | None = None) -> dict:
    """Bytes per device of the update step beyond the state and the gradient accumulator:

    saved: what the forward pass keeps for the backward: with remat every layer's input
      [R, L, D]; without, every layer's intermediates (`_layer_saved_per_token`).
    layer_recompute: remat only: one layer's intermediates, recomputed for its backward pass.
    layer_backward: the gradients of one layer's intermediates (both cases).
    attn_mask: the [R, L, L] bool mask every layer attends with (one array, shared).
    head: final norm (float32 and cast), hidden states, their shifted copy and chunks.
    logprobs: `LOGIT_COPIES` [R, C, V/tp] float32 buffers of one chunk (C = L without chunking;
      `update` recomputes chunk logits in the backward, so no [R, L, V] array is kept).
    weights: with fsdp > 1, one layer's weights gathered (compute dtype) and the gradients of
      its `trained_layer_elems` (None: all its weights; LoRA: its adapters) before the
      reduce-scatter (state dtype), both /tp.
    batch: the step's rows on this device (tokens, masks, old log-probs, advantages, twice:
      as given and split into micro-batches).
    """
    shards, tp = _row_shards(mesh), mesh.shape["tensor"]
    if micro_batch_rows % shards or rows_per_step % micro_batch_rows:
        raise ValueError(f"micro-batch of {micro_batch_rows} rows must split over data*fsdp = "
                         f"{shards} devices and divide the step's {rows_per_step} rows")
    r, c, d = micro_batch_rows // shards, _itemsize(compute_dtype), cfg.hidden_size
    tokens = r * seq_len
    saved = tokens * _layer_saved_per_token(cfg, c, tp, seq_len)
    chunk = seq_len if logprob_chunk is None else min(logprob_chunk, seq_len)
    gathered = 0
    if mesh.shape["fsdp"] > 1:
        layer = _layer_weight_elems(cfg)
        trained = layer if trained_layer_elems is None else trained_layer_elems
        gathered = layer // tp * c + trained // tp * state_itemsize
    return {
        "saved": cfg.num_layers * (tokens * c * d if remat else saved),
        "layer_recompute": saved if remat else 0,
        "layer_backward": tokens * _layer_backward_per_token(cfg, c, tp, seq_len),
        "attn_mask": r * seq_len * seq_len,
        "head": tokens * (F32 + 3 * c) * d,
        "logprobs": LOGIT_COPIES * r * chunk * _split(cfg.vocab_size, tp) * F32,
        "weights": gathered,
        "batch": 2 * rows_per_step // shards * seq_len * (4 + 1 + 1 + F32) + 8 * rows_per_step,
    }


def estimate(model_cfg: models.DecoderConfig, *, mesh_shape: dict, rows_per_step: int,
             micro_batch_rows: int | None, prompt_len: int, max_new_tokens: int,
             group_size: int = 8, minibatches: int = 2, param_dtype="bfloat16",
             compute_dtype="bfloat16", master_fp32: bool = True, remat: bool = True,
             optimizer: str = "adamw", logprob_chunk: int | None = update.DEFAULT_CHUNK,
             sample_prompts: int | None = None, continuous: bool = False,
             lora: LoraConfig = LoraConfig()) -> Estimate:
    """Per-device bytes of a run (see `Estimate`): `rows_per_step` = prompts * group_size
    answers per step, `micro_batch_rows` rows per gradient-accumulation pass (None = a whole
    mini-batch, rows_per_step / minibatches), prompts of up to `prompt_len` tokens (the
    sampler rounds them up to `prompt_bucket`, the update its rows of prompt + answer to a
    `length_bucket`), answers of `max_new_tokens`; `sample_prompts` prompts per
    sampling call (None = all the step's prompts at once, as `rollout.run` samples them);
    `continuous`: with fewer than all, the calls batch continuously (`rollout.continuous_batching`).
    `lora`: the run's `model.lora` (rank > 0: adapters trained, the base frozen).
    `mesh_shape` maps "data", "fsdp", "tensor" to sizes."""
    mesh = fake_mesh(mesh_shape)
    state = abstract_state(model_cfg, param_dtype=param_dtype, compute_dtype=compute_dtype,
                           master_fp32=master_fp32, optimizer=optimizer, lora=lora)
    trained = trained_params(state, lora)
    state_params = tree_bytes(state.params, mesh)
    params = tree_bytes(state.params, mesh, itemsize=_itemsize(param_dtype))
    kv, work = kv_cache_bytes(model_cfg, mesh,
                              prompts=sample_prompts or rows_per_step // group_size,
                              group_size=group_size, prompt_len=prompt_len,
                              max_new_tokens=max_new_tokens, dtype=param_dtype,
                              continuous=continuous and bool(sample_prompts)
                              and sample_prompts < rows_per_step // group_size)
    terms = activation_terms(
        model_cfg, mesh, rows_per_step=rows_per_step,
        micro_batch_rows=micro_batch_rows or rows_per_step // minibatches,
        seq_len=length_bucket(prompt_bucket(prompt_len) + max_new_tokens),
        compute_dtype=compute_dtype,
        state_itemsize=jax.tree.leaves(trained)[0].dtype.itemsize, remat=remat,
        logprob_chunk=logprob_chunk,
        trained_layer_elems=(sum(x.size for x in jax.tree.leaves(trained))
                             // model_cfg.num_layers if lora.rank else None))
    read = jax.eval_shape(lambda p: placement.sampler_params(p, None, compute_dtype),
                          state.params)  # matrices cast to the compute dtype
    if mesh.shape["fsdp"] == 1:  # read in place, but for the cast copies
        read = jax.tree.map(lambda r, x: r if r.dtype != x.dtype else None, read, state.params)
    return Estimate(params=params, master=state_params - params,
                    optimizer=tree_bytes(state.opt_state, mesh),
                    grads=tree_bytes(trained, mesh),
                    sampler_weights=tree_bytes(read, mesh, rules=placement.SAMPLER_RULES),
                    kv_cache=kv, sampler_work=work,
                    activations=sum(terms.values()), terms=terms, mesh_shape=dict(mesh.shape))
