"""The decode attention core alone at `real_rl`'s decode shapes: the XLA path beside the CPU kernel.

    SMOL_HF=<folder> python scripts/bench_cpu_attention.py [--rows 64] [--json OUT.json]

SmolLM2-135M-Instruct's attention shapes (30 layers, 3 KV heads of 3 query heads, head dim 64,
float32) for a continuous-batching decode state of `--rows` slots, one row per slot, as
`real_rl` runs it: P prompt columns (the bucket of the real_rl prompts), S generated slots
(`gen_slots` of its 384 new tokens). The live lengths: each row's prompt is one of the real_rl
prompts (chat-templated GSM8K questions, in order) and its generated position a uniform draw in
[0, S) (a slot holds a row at any point of its answer). One step = for each of the 30 layers,
the attention core and the write of the row's new key/value into its cache slot:
  xla     decode._attend (every column) + decode_attention.write_rows' scatter;
  kernel  cpu_attention.attend (live columns only, the write in place).
Each is 16 steps in one jitted loop (caches carried and donated), median of 7 runs, A and B
alternating; the record has both medians, their ratio and the cores other processes used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_jax.bench import workloads  # noqa: E402
from sage_jax.bench.protocol import CpuShare  # noqa: E402
from sage_jax.engine.sampler import cpu_attention, decode, decode_attention  # noqa: E402
from sage_jax.engine.sampler.sampling_plan import gen_slots, prompt_bucket  # noqa: E402
from sage_jax.infra import provenance  # noqa: E402

STEPS, REPEATS = 16, 7


def shapes(rows: int) -> dict:
    """The decode state's shapes and live lengths of a real_rl call at `rows` slots."""
    w = workloads.load_workload("real_rl")
    d = workloads.model_dir(w)
    cfg = json.loads((d / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(d)
    prompts = workloads.chat_prompts(w, tok)
    lens = [len(p) for p in prompts]
    s = w["sampling"]
    slots = gen_slots(s["max_new_tokens"])
    rng = np.random.default_rng(0)
    return {"layers": cfg["num_hidden_layers"], "kv_heads": cfg["num_key_value_heads"],
            "q_per_kv": cfg["num_attention_heads"] // cfg["num_key_value_heads"],
            "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"],
            "rows": rows, "prompt_cols": prompt_bucket(max(lens)), "slots": slots,
            "prompt_live": [lens[i % len(lens)] for i in range(rows)],
            "gen_live": rng.integers(0, slots, rows).tolist()}


def programs(sh: dict):
    """(xla step loop, kernel step loop, inputs): each loop runs STEPS steps of every layer."""
    r, k, q, h = sh["rows"], sh["kv_heads"], sh["q_per_kv"], sh["head_dim"]
    p, s, layers = sh["prompt_cols"], sh["slots"], sh["layers"]
    rng = np.random.default_rng(1)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.5)  # noqa: E731
    live = np.asarray(sh["prompt_live"])
    mask = jnp.asarray(np.arange(p)[None, :] >= (p - live)[:, None])
    lo = jnp.asarray(p - live, jnp.int32)
    at = jnp.asarray(sh["gen_live"], jnp.int32)
    prompt = tuple((f32(r, k, h, p), f32(r, k, p, h)) for _ in range(layers))
    gen = tuple((f32(r, k, 1, h, s), f32(r, k, 1, s, h)) for _ in range(layers))
    x0 = f32(r, k * q * h)
    attn = SimpleNamespace(k=k, h=h, n=k * q)
    valid = jnp.arange(s)[None, :] < at[:, None]

    def xla_step(x, gen):
        out = []
        for (pk, pv), (gk, gv) in zip(prompt, gen):
            new = x[:, :k * h].reshape(r, k, 1, h)
            a = decode._attend(attn, x, (pk, pv), mask, (gk, gv), valid, (new, new), 1)
            after = 0.0 * a[:, :1].reshape(r, 1, 1, 1)
            out.append(decode_attention.write_rows("xla", None, gk, gv, new + after,
                                                   new + after, at.reshape(r, 1)))
            x = x + 1e-3 * a
        return x, tuple(out)

    def kernel_step(x, gen):
        out = []
        for (pk, pv), (gk, gv) in zip(prompt, gen):
            new = x[:, :k * h].reshape(r, 1, k, h)
            a, gk, gv = cpu_attention.attend(None, x.reshape(r, 1, k, q * h), pk, pv, lo, gk, gv,
                                             new, new, at.reshape(r, 1))
            out.append((gk, gv))
            x = x + 1e-3 * a.reshape(r, -1)
        return x, tuple(out)

    def loop(step):
        return jax.jit(lambda x, gen: jax.lax.fori_loop(0, STEPS, lambda i, c: step(*c),
                                                        (x, gen)), donate_argnums=1)
    return loop(xla_step), loop(kernel_step), x0, gen


def timed(fn, x0, gen) -> tuple[list[float], tuple]:
    """(seconds per step of REPEATS runs, the caches after them: they are donated and carried
    from run to run)."""
    x, gen = fn(x0, gen)
    jax.block_until_ready(x)
    out = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        x, gen = fn(x0, gen)
        jax.block_until_ready(x)
        out.append((time.perf_counter() - t0) / STEPS)
    return out, gen


def summary(rec: dict, ab: dict) -> str:
    """docs/benchmarks.md's lines on the kernel, from its record (`rec`: the micro-benchmark and
    the `real` sampler lines) and the toy A/B sittings (`ab`)."""
    m, (k, x) = rec["micro"], rec["real"]
    sh = m["shapes"]

    def b_over_a(s: dict) -> str:
        res = s["result"]
        return f"{res['ratio']:.3f} ({res['ci95'][0]:.3f}-{res['ci95'][1]:.3f})"
    hand = ab["by_hand_kernel_on_off"]["runs"]
    widest = 100 * max(abs(s["result"]["ratio"] - 1) for s in ab["sittings"])
    return "\n".join([
        f"- The attention core alone (`scripts/bench_cpu_attention.py`), {sh['layers']} layers "
        f"at `real_rl`'s decode shapes ({sh['rows']} rows, {sh['prompt_cols']} prompt columns of "
        f"which {m['prompt_live_mean']:.0f} live on average, {sh['slots']} slots of which "
        f"{m['gen_live_mean']:.0f} live): XLA path {m['median_ms']['xla']:.1f} ms, kernel "
        f"{m['median_ms']['kernel']:.1f} ms a step, **{m['speedup']:.2f}x** (target 2.5x).",
        f"- The sampler on `real` (greedy): {k['tokens_per_s']:.1f} useful tokens/s with the "
        f"kernel against {x['tokens_per_s']:.1f} on the XLA path "
        f"({k['tokens_per_s'] / x['tokens_per_s']:.2f}x), the same outputs (`lengths_sha1` "
        f"{k['lengths_sha1']} both), {k['cpu_during_timed']['own_cores']:.2f} cores used against "
        f"{x['cpu_during_timed']['own_cores']:.2f}, peak RSS {k['peak_rss_mb']:,.0f} MB (a venv "
        "with the test requirements too). The XLA line comes from the sitting of the kernel's "
        "first version, 35 minutes earlier. vLLM was not run beside it.",
        f"- The {len(ab['sittings'])} `scripts/ab.py` sittings of the toy_tail GRPO step meant "
        "to set the kernel against the step before it ran one code on both sides (a bug of the "
        "tool then, fixed in a1c1ed9; the record says which code): they are A/A sittings of 2-3 "
        "pairs, B/A " + ", ".join(b_over_a(s) for s in ab["sittings"]) + ". Two runs of one "
        f"code differed by up to {widest:.0f} %, with intervals that left out 1: the tool's "
        "interval then counted only the spread within a run. At one commit, the kernel on and "
        "off by hand (two pairs): steps of " + ", ".join(f"{r['step_s']:.2f} s" for r in hand)
        + " (on, off, on, off)."])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args(argv)
    ok, why = cpu_attention.status()
    if not ok:
        raise SystemExit(f"error: no CPU kernel to time: {why}")
    sh = shapes(args.rows)
    xla, kernel, x0, gen = programs(sh)
    gen_x = jax.tree.map(jnp.copy, gen)
    times = {"xla": [], "kernel": []}
    with CpuShare() as share:
        for _ in range(2):  # A, B, A, B
            t, gen_x = timed(xla, x0, gen_x)
            times["xla"] += t
            t, gen = timed(kernel, x0, gen)
            times["kernel"] += t
    med = {k: statistics.median(v) for k, v in times.items()}
    rec = {"commit": provenance.commit(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "jax": jax.__version__, "shapes": sh, "steps_per_run": STEPS,
           "ms_per_step": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()},
           "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
           "speedup": round(med["xla"] / med["kernel"], 3), "cpu": share.cores,
           "prompt_live_mean": float(np.mean(sh["prompt_live"])),
           "gen_live_mean": float(np.mean(sh["gen_live"]))}
    print(f"R={sh['rows']} P={sh['prompt_cols']} S={sh['slots']} (live prompt "
          f"{rec['prompt_live_mean']:.0f}, generated {rec['gen_live_mean']:.0f}): xla "
          f"{rec['median_ms']['xla']:.2f} ms, kernel {rec['median_ms']['kernel']:.2f} ms a step "
          f"(30 layers): {rec['speedup']:.2f}x; other cores {share.cores.get('other_cores')}",
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1))
    return rec


if __name__ == "__main__":
    main()
