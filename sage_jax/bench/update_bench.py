"""`python -m sage_jax.bench update --workload small [--json]`: one GRPO update step.

Times `update.TrainStep` on the workload's model: forward + backward + AdamW over
num_prompts * samples_per_prompt rows of prompt_len + max_new_tokens tokens, one optimiser step
(minibatches=1), old log-probs given (computed once beforehand, not timed). Uses the workload's
prompts, the quiet-machine wait, warm-up and median timing (`protocol.time_calls`) and the JSON
record (`protocol.emit`, peer "sage_jax-update"); tokens_per_s counts prompt + answer tokens, as the
tunix GRPO-step peer does. Also reports the step's model FLOP/s next to a plain matmul's, and
tokens/s per core this process got (`cpu_during_timed.own_cores`), for contended machines.

On the `real` workload (`bench.real`: SmolLM2-135M-Instruct, GSM8K chat prompts) the rows are
the sampler's own greedy answers to the prompts (sampled once, untimed), each prompt + answer,
right-padded to a `packing.length_bucket` as the trainer's batches are, then packed end to end
(`rl.padding_free`, the default) unless SAGE_JAX_BENCH_PADDING_FREE=0; tokens_per_s counts real
(prompt + answer) tokens, "padding_share" is the share of the token slots the update computes
that are padding, "padded_share" that of the right-padded batch.

Settings (environment): SAGE_JAX_BENCH_MICRO rows per micro-batch (16; 4 on the real workloads,
whose packed 16-row micro-batch asked for 27 GB on the 24 GiB machine), SAGE_JAX_BENCH_CHUNK
sequence columns per logits chunk (64), SAGE_JAX_BENCH_REMAT_LOGITS recompute chunk logits in the
backward pass (1, the library default), SAGE_JAX_BENCH_REMAT recompute each layer in the backward
pass (`model.remat`; 0), SAGE_JAX_BENCH_PADDING_FREE pack the rows (1).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax import config as config_lib, models
from sage_jax.infra import parallel
from sage_jax.bench import protocol, random_model, real, workloads
from sage_jax.engine.sampler import sampling
from sage_jax.engine.trainer import packing, update

MICRO_BATCH = os.environ.get("SAGE_JAX_BENCH_MICRO")  # rows per micro-batch (None: by workload)
CHUNK = int(os.environ.get("SAGE_JAX_BENCH_CHUNK", "64"))  # sequence columns per logits chunk
REMAT = os.environ.get("SAGE_JAX_BENCH_REMAT_LOGITS", "1") == "1"  # recompute chunk logits
PADDING_FREE = os.environ.get("SAGE_JAX_BENCH_PADDING_FREE", "1") == "1"  # pack the rows
REMAT_LAYERS = os.environ.get("SAGE_JAX_BENCH_REMAT", "0") == "1"  # model.remat


def model_flops(dims: dict, lengths) -> float:
    """Training FLOPs of one step by the usual MFU count: 6 * matmul params * tokens plus
    12 * layers * heads * head_dim * length for attention, summed over each row's tokens
    (embedding lookup excluded; `dims` holds the DecoderConfig's sizes, `lengths` each row's
    real tokens)."""
    d, f, h, k, hd = (dims["hidden_size"], dims["intermediate_size"], dims["num_heads"],
                      dims["num_kv_heads"], dims["head_dim"])
    per_layer = d * hd * (h + 2 * k) + h * hd * d + 3 * d * f
    params = dims["num_layers"] * per_layer + d * dims["vocab_size"]
    lengths = np.asarray(lengths, np.float64)
    return float(6.0 * params * lengths.sum()
                 + 12.0 * dims["num_layers"] * h * hd * (lengths ** 2).sum())


def matmul_flops_per_s(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a plain float32 [n, n] @ [n, n] on this machine (median of `repeats`)."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(times)


def _synthetic_rows(w, data_dir=None):
    """(model, tokens_NxL, mask_NxL, loss_mask_NxL): random prompts and answers, no padding."""
    s = w["sampling"]
    g, p, t = s["samples_per_prompt"], s["prompt_len"], s["max_new_tokens"]
    rng = np.random.default_rng(w["timing"].get("seed", 0))
    prompts = np.repeat(workloads.make_prompts(w), g, axis=0)
    answers = rng.integers(1, w["model"]["vocab_size"], (len(prompts), t))
    tokens = np.concatenate([prompts, answers], axis=1).astype(np.int32)
    loss_mask = np.arange(p + t)[None].repeat(len(tokens), 0) >= p
    return random_model.build_model(w), tokens, np.ones(tokens.shape, bool), loss_mask


def _real_rows(w, data_dir=None):
    """The same from the sampler's greedy answers to the real workload's prompts."""
    model, prompts, eos = real.load(w, data_dir)
    s = w["sampling"]
    graphdef, params = models.split(model)
    tok, mask = sampling.left_pad(prompts, max(map(len, prompts)), eos)
    out = sampling.sample(graphdef, params, tok, mask, key=jax.random.PRNGKey(0),
                          num_samples=1, max_new_tokens=s["max_new_tokens"], temperature=0.0,
                          eos_ids=(eos,), pad_id=eos)
    answers = [out.tokens[i, 0, :n].tolist() for i, n in enumerate(out.lengths[:, 0])]
    width = packing.length_bucket(max(len(p) + len(a) for p, a in zip(prompts, answers)))
    tokens = np.full((len(prompts), width), eos, np.int32)
    mask = np.zeros(tokens.shape, bool)
    loss_mask = np.zeros(tokens.shape, bool)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        tokens[i, :len(p) + len(a)] = p + a
        mask[i, :len(p) + len(a)] = True
        loss_mask[i, len(p):len(p) + len(a)] = True
    return model, tokens, mask, loss_mask


def run(args) -> None:
    w = workloads.load_workload(args.workload)
    s = w["sampling"]
    is_real = workloads.is_real(w)
    model, tokens, mask, loss_mask = (_real_rows if is_real else _synthetic_rows)(
        w, args.data_dir)
    model.remat = REMAT_LAYERS  # Decoder's flag: each layer recomputed in the backward pass
    (rows, seq), t = tokens.shape, s["max_new_tokens"]
    micro = min(int(MICRO_BATCH) if MICRO_BATCH else 4 if is_real else 16, rows)
    group = max(2, s["samples_per_prompt"])  # (the step itself takes the advantages as given)
    cfg = config_lib.Config(
        model=config_lib.ModelConfig(dtype="float32", compute_dtype="float32",
                                     remat=REMAT_LAYERS),
        rl=config_lib.RLConfig(method="grpo", prompts_per_step=rows // group, group_size=group,
                               max_new_tokens=t, minibatches=1, micro_batch_size=micro,
                               padding_free=PADDING_FREE),
        data=config_lib.DataConfig(max_prompt_tokens=max(seq - t, 1)),  # packed width: seq
        mesh=config_lib.MeshConfig(data=-1))
    mesh, settings = parallel.make_mesh(cfg.mesh), update.UpdateSettings.of(cfg)
    graphdef, state = update.init_train_state(model, settings, mesh)
    rng = np.random.default_rng(w["timing"].get("seed", 0))
    old = update.make_logprob_fn(graphdef, mesh, micro_batch_size=micro, chunk=CHUNK)(
        state.params, tokens, mask, loss_mask)
    batch = dict(tokens_NxL=tokens, mask_NxL=mask, loss_mask_NxL=loss_mask,
                 old_logp_NxL=np.asarray(old),
                 advantages_N=rng.standard_normal(rows).astype(np.float32))
    batch = (update.pack_batch(batch, settings) if cfg.rl.padding_free
             else packing.as_packed(batch))  # the update takes the packed form
    slots = loss_mask.size
    if cfg.rl.padding_free:  # the micro-batches the update computes (the others are skipped)
        m, u, r = update.batch_split(rows, settings)
        used = batch["loss_mask_ZxL"].reshape(r, m * u, -1).any(axis=(0, 2))
        slots = int(used.sum()) * r * batch["loss_mask_ZxL"].shape[1]
    batch = parallel.shard_batch(batch, mesh)
    real_tokens = int(mask.sum())
    step = update.TrainStep(graphdef, settings, mesh, chunk=CHUNK, remat_logits=REMAT)
    losses = []

    def call(i):
        nonlocal state
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        losses.append(float(metrics["loss"]))
        if not np.isfinite(losses[-1]) or not np.isfinite(float(metrics["grad_norm"])):
            raise RuntimeError(f"non-finite loss or grad norm: {metrics}")

    timing = protocol.time_calls(call, w)
    dims = dataclasses.asdict(model.cfg) if is_real else w["model"]
    flops = model_flops(dims, mask.sum(axis=1))
    mm = matmul_flops_per_s()
    med = timing.median_s
    extra = {
        "metric": "real (prompt+answer) tokens per second of one jitted GRPO update step "
                  "(fwd+bwd+AdamW, old log-probs given)",
        "answer_tokens_per_s": round(int(loss_mask.sum()) / med, 2),
        "seq_len": seq, "rows": rows, "real_tokens": real_tokens,
        "padding_free": cfg.rl.padding_free, "sequences": slots // seq,
        "padding_share": round(1 - real_tokens / slots, 4),
        "padded_share": round(1 - real_tokens / (rows * seq), 4),
        "micro_batch_size": micro, "logits_chunk": CHUNK, "remat_logits": REMAT,
        "remat_layers": REMAT_LAYERS,
        "devices": len(jax.devices()), "matmul_flops_per_s": round(mm, 1),
        "tokens_per_s_per_own_core": round(
            real_tokens / med / max(timing.cpu.get("own_cores") or 1.0, 0.01), 1),
        "losses": [round(x, 6) for x in losses],
        "versions": {"jax": jax.__version__},
    }
    extra.update(model_flops_per_step=flops, model_flops_per_s=round(flops / med, 1),
                 model_flops_vs_matmul=round(flops / med / mm, 3))
    rec = protocol.emit("sage_jax-update", args.workload, w, timing, extra=extra,
                  tokens_per_call=real_tokens) if args.json else None
    if not args.json:
        protocol.log(f"update {args.workload}: {real_tokens / med:,.0f} real tokens/s, median "
               f"{med:.3f}s, padding {1 - real_tokens / slots:.1%}, peak RSS "
               f"{protocol.peak_rss_mb():,.0f} MB, model {flops / med / 1e9:.1f} GFLOP/s against a "
               f"matmul's {mm / 1e9:.1f} ({flops / med / mm:.0%})")
    return rec
