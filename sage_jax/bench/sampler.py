"""Sampler throughput on a peer workload: `python -m sage_jax.bench sampler --workload small`.

Times one `sampling.sample` call over the workload's prompts (num_prompts x samples_per_prompt
rows, prompt_len tokens each, exactly max_new_tokens new tokens: no EOS id is given, so no row
stops early) with the peers' protocol (`_common.time_calls`: quiet-machine wait, warm-up calls,
median of the timed calls) and prints their JSON line (`_common.emit`, peer "sage_jax") with
generated tokens/s and the process's peak RSS. The warm-up call includes compilation; compile
time is reported separately as "compile_s".
"""

from __future__ import annotations

import time

import jax
import numpy as np

from sage_jax import models
from sage_jax.engine import sampling
from sage_jax.bench.common import build_model, peers_module


def run(args):
    peers = peers_module(args.peers_dir)
    w = peers.load_workload(args.workload)
    s, seed = w["sampling"], w["timing"].get("seed", 0)
    t0 = time.perf_counter()
    graphdef, params = models.split(build_model(w, seed=seed))
    build_s = time.perf_counter() - t0

    prompts = peers.make_prompts(w).astype(np.int32)  # [num_prompts, prompt_len], ids >= 1
    mask = np.ones(prompts.shape, bool)
    g, new = s["samples_per_prompt"], s["max_new_tokens"]
    knobs = dict(temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                 top_k=int(s.get("top_k") or 0))

    def call(i):
        out = sampling.sample(graphdef, params, prompts, mask, key=jax.random.PRNGKey(i),
                              num_samples=g, max_new_tokens=new, eos_ids=(), pad_id=0, **knobs)
        lengths = np.asarray(jax.block_until_ready(out).lengths)
        if lengths.shape != (len(prompts), g) or (lengths != new).any():
            raise RuntimeError(f"unequal work: generated lengths {sorted(set(lengths.flat))}")
        return out

    t0 = time.perf_counter()
    call(-1)  # compile (untimed; the peers' own warm-up call follows)
    compile_s = time.perf_counter() - t0
    peers.log(f"sage_jax jax {jax.__version__} devices={jax.devices()} build {build_s:.2f}s "
              f"compile+first call {compile_s:.2f}s")
    warm, times = peers.time_calls(call, w)
    rec = peers.emit(
        "sage_jax", args.workload, w, warm, times,
        extra={"build_s": round(build_s, 3), "compile_s": round(compile_s, 3),
               "versions": {"jax": jax.__version__}, "backend": jax.default_backend(),
               "prompt_bucket": sampling.prompt_bucket(prompts.shape[1]),
               "batch_bucket": sampling.batch_bucket(prompts.shape[0])})
    if not args.json:
        peers.log(f"sage_jax sampler on {args.workload!r}: {rec['tokens_per_s']:,.0f} generated "
                  f"tokens/s (median of {len(times)}), peak RSS {rec['peak_rss_mb']:.0f} MB")
    return rec
