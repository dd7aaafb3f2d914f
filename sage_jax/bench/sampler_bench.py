"""Sampler throughput on a workload: `python -m sage_jax.bench sampler --workload small`.

Times one `sampling.sample` call over the workload's prompts (`protocol.time_calls`: quiet-machine
wait, warm-up calls, median of the timed calls) and prints the JSON line (`protocol.emit`, peer
"sage_jax") with tokens/s and the process's peak RSS. The
warm-up call includes compilation; compile time is reported separately as "compile_s".

* Synthetic workloads (`small`, `tiny`): num_prompts x samples_per_prompt rows of random
  prompt ids, exactly max_new_tokens new tokens (no EOS id is given, so no row stops early).
* `real`: SmolLM2-135M-Instruct on GSM8K chat prompts, greedy, stopping at EOS
  (`bench.real`); `real_rl`: 8 sampled answers a prompt, at most `slots` rows at once
  (continuous batching, `sample(max_rows=...)`); tokens/s counts useful tokens (each row's tokens up to and including its EOS),
  `lengths_sha1` identifies the outputs (the peers print the same), and `decode_waste` is the
  share of the decode programs' row-steps spent on padding or finished rows.

Every workload also reports `host_syncs`: how often one call waited for the device's results.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from sage_jax import models
from sage_jax.bench import protocol, random_model, real, update_bench, workloads
from sage_jax.engine.sampler import sampling, sampling_plan


def _synthetic(w, seed):
    """(model, prompts_BxP, mask_BxP, eos ids, check) of a random-model workload."""
    prompts = workloads.make_prompts(w).astype(np.int32)  # [num_prompts, prompt_len], ids >= 1
    new = w["sampling"]["max_new_tokens"]

    def check(out):
        if (out.lengths != new).any():
            raise RuntimeError(f"unequal work: generated lengths {sorted(set(out.lengths.flat))}")

    return random_model.build_model(w, seed=seed), prompts, np.ones(prompts.shape, bool), (), check, {}


def _real(w, data_dir):
    """The same for the `real` workload, plus the lengths hash and the decode waste."""
    model, prompts, eos = real.load(w, data_dir)
    width = max(map(len, prompts))
    tok, mask = sampling.left_pad(prompts, width, eos)
    extra = {}

    def check(out):
        lengths = out.lengths.reshape(-1)
        useful = int(lengths.sum())
        decoded = useful - lengths.size  # each row's first token comes from the prefill
        extra.update(useful_tokens=useful, lengths_sha1=workloads.lengths_sha1(lengths.tolist()),
                     max_len=int(lengths.max()), mean_len=useful / lengths.size,
                     decode_row_steps=out.decode_row_steps,
                     decode_waste=round(1 - decoded / max(out.decode_row_steps, 1), 4))

    return model, tok, mask, (eos,), check, extra


def run(args):
    w = workloads.load_workload(args.workload)
    s, seed = w["sampling"], w["timing"].get("seed", 0)
    t0 = time.perf_counter()
    model, prompts, mask, eos, check, extra = (
        _real(w, args.data_dir) if workloads.is_real(w) else _synthetic(w, seed))
    graphdef, params = models.split(model)
    build_s = time.perf_counter() - t0
    g, new = s["samples_per_prompt"], s["max_new_tokens"]
    knobs = dict(temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                 top_k=int(s.get("top_k") or 0))

    def call(i):
        out = sampling.sample(graphdef, params, prompts, mask, key=jax.random.PRNGKey(i),
                              num_samples=g, max_new_tokens=new, eos_ids=eos, pad_id=0,
                              max_rows=s.get("slots"), **knobs)
        check(out)
        extra["host_syncs"] = out.host_syncs
        return out

    t0 = time.perf_counter()
    call(-1)  # compile (untimed; the peers' own warm-up call follows)
    compile_s = time.perf_counter() - t0
    protocol.log(f"sage_jax jax {jax.__version__} devices={jax.devices()} build {build_s:.2f}s "
                 f"compile+first call {compile_s:.2f}s")
    timing = protocol.time_calls(call, w)
    # Matmul work: 2 FLOPs per weight per token, prompts once (no LM head: only their last
    # position's logits), generated tokens each with the LM head; attention not counted.
    c = model.cfg
    body = c.num_params() - c.vocab_size * c.hidden_size
    generated = extra.get("useful_tokens") or prompts.shape[0] * g * new
    flops = 2.0 * (body * int(mask.sum()) + c.num_params() * generated)
    matmul = update_bench.matmul_flops_per_s()
    extra.update(model_flops_per_s=round(flops / timing.median_s, 1),
                 matmul_flops_per_s=round(matmul, 1),
                 model_flops_vs_matmul=round(flops / timing.median_s / matmul, 3))
    rec = protocol.emit(
        "sage_jax", args.workload, w, timing, tokens_per_call=extra.get("useful_tokens"),
        extra={"build_s": round(build_s, 3), "compile_s": round(compile_s, 3),
               "versions": {"jax": jax.__version__}, "backend": jax.default_backend(),
               "prompt_bucket": sampling_plan.prompt_bucket(prompts.shape[1]),
               "batch_bucket": sampling_plan.batch_bucket(prompts.shape[0]), **extra})
    if not args.json:
        protocol.log(f"sage_jax sampler on {args.workload!r}: {rec['tokens_per_s']:,.0f} "
                     f"tokens/s (median of {len(timing.times_s)}), peak RSS {rec['peak_rss_mb']:.0f} MB")
    return rec
