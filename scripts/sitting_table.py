"""The table of a benchmark sitting's results file (engines side by side on the `real` and
`real_rl` workloads of `scripts/bench_vs_peers.sh`):

    python scripts/sitting_table.py docs/bench/real_sitting_2026-12-06.json

prints `table(record)`: per workload and engine, useful tokens/s (each row's tokens up to its
EOS, per second; median call), the mean answer length, the outputs' `lengths_sha1`, peak RSS,
the cores the engine used while timed, and its speed over vLLM's. A contended line is listed
and marked, not compared. Then, where the record has them, `profile_table(record)`: its
`scripts/profile_decode.py --json` line, a decode step's parts per row count; and
`update_table(record)`: its update-bench lines, one per remat and logits-chunk setting.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ENGINES = {"sage_jax": "this library", "vllm-cpu": "vLLM 0.32 CPU, one process",
           "hf-static": "transformers `generate` (static)",
           "hf-continuous": "transformers `generate_batch`"}


def table(rec: dict) -> str:
    lines = ["| workload | engine | useful tokens/s | / vLLM | mean length | lengths_sha1 | "
             "peak RSS | cores used |",
             "|---|---|---|---|---|---|---|---|"]
    for w in ("real", "real_rl"):
        vllm = next((r for r in rec[w] if r["peer"] == "vllm-cpu"), None)
        for r in rec[w]:
            ratio = (f"{r['tokens_per_s'] / vllm['tokens_per_s']:.2f}x"
                     if vllm and not r["contended"] and not vllm["contended"] else "-")
            name = ENGINES.get(r["peer"], r["peer"]) + (" (contended)" if r["contended"] else "")
            lines.append(f"| {w} | {name} | {r['tokens_per_s']:.1f} | {ratio} | "
                         f"{r['mean_len']:.1f} | {r['lengths_sha1']} | "
                         f"{r['peak_rss_mb']:,.0f} MB | {r['cpu_during_timed']['own_cores']:.2f} |")
    return "\n".join(lines)


def profile_table(rec: dict) -> str:
    prof = rec["profile"]
    lines = [f"| rows | step | 30 layers' matmuls | LM head + token choice | attention core "
             f"({prof['prompt']} prompt + {prof['slots']} generated slots) | attention share |",
             "|---|---|---|---|---|---|"]
    for r, t in prof["rows"].items():
        lines.append(f"| {r} | {t['step']:.1f} ms | {t['matmuls']:.1f} ms | {t['head']:.1f} ms | "
                     f"{t['attention']:.1f} ms | {t['attention'] / t['step']:.0%} |")
    return "\n".join(lines)


def update_table(rec: dict) -> str:
    """The record's `update` lines (`python -m sage_jax.bench update --workload real` under
    SAGE_JAX_BENCH_REMAT and SAGE_JAX_BENCH_CHUNK): one jitted GRPO update per setting."""
    lines = ["| layers recomputed (remat) | logits chunk | median update | real tokens/s | "
             "model FLOP/s / a matmul's | peak RSS |", "|---|---|---|---|---|---|"]
    for r in rec["update"]:
        name = ("yes" if r["remat_layers"] else "no") + (" (contended)" if r["contended"] else "")
        lines.append(f"| {name} | {r['logits_chunk']} | {r['median_s']:.2f} s | "
                     f"{r['tokens_per_s']:.0f} | {r['model_flops_per_s'] / 1e9:.1f} / "
                     f"{r['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s "
                     f"({r['model_flops_vs_matmul']:.0%}) | {r['peak_rss_mb']:,.0f} MB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", type=Path)
    rec = json.loads(ap.parse_args().record.read_text())
    print(table(rec))
    for part, render in (("profile", profile_table), ("update", update_table)):
        if part in rec:
            print()
            print(render(rec))


if __name__ == "__main__":
    main()
