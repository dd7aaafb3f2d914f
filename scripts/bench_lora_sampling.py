"""The native sampler with LoRA adapters in place against the same adapters merged into the
kernels (`rollout.lora_merged`), beside the plain model, on the `real` workload:

    python scripts/bench_lora_sampling.py [--rank 16] [--repeats 2] [--json out.json]

SmolLM2-135M-Instruct ($SMOL_HF) on GSM8K chat prompts, greedy, up to 384 new tokens, through
`engines.NativeEngine` three ways: `plain` (no adapters), `in_place` (rank-`--rank` adapters on
all seven projections, B drawn N(0, 0.01^2) so they change the function, run at every projection)
and `merged` (the same adapters folded into a copy of the kernels at `sync`; the merge is timed
with the call). Each call is one `sync` and one `sample` of every prompt. The modes alternate:
one warm-up call each (compiles), then `--repeats` rounds of one timed call each. It prints each
mode's useful tokens/s (tokens up to and including EOS, per second; median over the rounds) and
the ratios, and reads /proc/stat around the timed rounds: a sitting where other processes used
more than PEERS_OTHER_CORES_LIMIT (0.15) cores is marked contended.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax import models
from sage_jax.bench import protocol, real, workloads
from sage_jax.infra import provenance
from sage_jax.rl import engines

MODES = ("plain", "in_place", "merged")


def adapted(model: models.Decoder, rank: int, seed: int = 0) -> models.Decoder:
    """`model` with rank-`rank` adapters on all seven projections whose B is N(0, 0.01^2)."""
    lora = models.with_lora(model, models.LoraSpec(rank, float(rank), seed=seed))
    adapters = nnx.state(lora, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), len(jax.tree.leaves(adapters))))

    def fill(path, x):
        is_b = any(getattr(p, "key", None) == "lora_b" for p in path)
        return 0.01 * jax.random.normal(next(keys), x.shape, x.dtype) if is_b else x

    nnx.update(lora, jax.tree.map_with_path(fill, adapters))
    return lora


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=None,
                    help="the first N prompts only (default: the workload's 32; for a smoke run)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the workload's")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--json", default=None, help="write the record here")
    args = ap.parse_args(argv)
    w = workloads.load_workload("real")
    s = w["sampling"]
    s["max_new_tokens"] = args.max_new_tokens or s["max_new_tokens"]
    base, prompts, eos = real.load(w, args.data_dir)
    prompts = prompts[:args.prompts]
    lora = adapted(base, args.rank)
    sides = {"plain": models.split(base), "in_place": models.split(lora),
             "merged": models.split(lora)}
    made = {m: engines.NativeEngine(*sides[m], eos_ids=(eos,), pad_id=eos,
                                    merge_lora=m == "merged") for m in MODES}
    ids = np.arange(len(prompts))

    def call(mode: str) -> tuple[float, int, str]:
        t0 = time.perf_counter()
        made[mode].sync(sides[mode][1])
        out = made[mode].sample(prompts, key=jax.random.PRNGKey(0), prompt_ids=ids,
                                num_samples=1, max_new_tokens=s["max_new_tokens"],
                                temperature=0.0, top_p=1.0, top_k=0)
        jax.block_until_ready(jnp.asarray(out.lengths))
        seconds = time.perf_counter() - t0
        lengths = np.asarray(out.lengths).reshape(-1).tolist()
        return seconds, int(sum(lengths)), workloads.lengths_sha1(lengths)

    warm = {m: call(m) for m in MODES}
    for m in MODES:
        protocol.log(f"  warm-up {m}: {warm[m][0]:.1f} s, {warm[m][1]} tokens")
    runs: dict[str, list] = {m: [] for m in MODES}
    with protocol.CpuShare() as share:
        for r in range(args.repeats):
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                runs[m].append(call(m))
                protocol.log(f"  round {r} {m}: {runs[m][-1][0]:.1f} s")
    rec = {"workload": "real", "prompts": len(prompts), "max_new_tokens": s["max_new_tokens"],
           "rank": args.rank, "alpha": float(args.rank),
           "commit": provenance.commit(), "date": time.strftime("%Y-%m-%d"),
           "cpu": share.cores,
           "contended": share.cores.get("other_cores", 0.0) > float(
               os.environ.get("PEERS_OTHER_CORES_LIMIT", 0.15)),
           "peak_rss_mb": round(protocol.peak_rss_mb(), 1), "modes": {}}
    for m in MODES:
        secs = [x[0] for x in runs[m]]
        rec["modes"][m] = {"seconds": [round(x, 3) for x in secs],
                           "useful_tokens": [x[1] for x in runs[m]],
                           "lengths_sha1": sorted({x[2] for x in runs[m]}),
                           "tokens_per_s": round(statistics.median(
                               x[1] / x[0] for x in runs[m]), 1)}
    tps = {m: rec["modes"][m]["tokens_per_s"] for m in MODES}
    rec["merged_over_in_place"] = round(tps["merged"] / tps["in_place"], 3)
    rec["in_place_over_plain"] = round(tps["in_place"] / tps["plain"], 3)
    rec["merged_over_plain"] = round(tps["merged"] / tps["plain"], 3)
    print(json.dumps(rec, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
    return rec


if __name__ == "__main__":
    main()
