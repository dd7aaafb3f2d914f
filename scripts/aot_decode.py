"""The decode programs of compile-only runs (`python -m sage_jax.aot --json` records), with and
without the decode-attention kernels' live reads:

    python -m sage_jax.aot --config paper_qwen2.5-7b --topology v5p-16 --preset qwen2.5-7b \
        --only rollout,hint --json > docs/aot/paper_qwen2.5-7b_v5p-16_rollout.json
    python scripts/aot_decode.py docs/aot/*_rollout.json

prints `table(records)`: for each record's decode programs that run (the largest cache size,
every decode step booked on it), the kernel calls compiled in, the share of the generated-token
caches a step reads, and the roofline of all its steps when every cache slot is read and when
only the live ones are (`compile_check._decode_calls`); then the record's largest program and
the HBM left free.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 1024 ** 3


def _roofline(rec: dict, q: dict, bytes_per_call: float) -> float:
    chip = rec["chip"]
    per_call = max(q["flops"] / rec["devices"] / chip["peak_flops"],
                   bytes_per_call / chip["hbm_bandwidth"])
    return per_call * q["calls"]


def rows(rec: dict) -> list[dict]:
    """The record's decode programs that run, with both rooflines."""
    out = []
    for q in rec["programs"]:
        if "/decode@" not in q["name"] or not q["calls"]:
            continue
        whole = _roofline(rec, q, q["whole_bytes_per_call"] or q["bytes_per_call"])
        out.append({"program": q["name"], "kernels": q["kernels"], "steps": q["calls"],
                    "read_share": q["read_share"], "whole_s": whole,
                    "live_s": q["roofline_s"], "total_gib": q["total"] / GIB})
    return out


def table(records: list[dict]) -> str:
    lines = ["| config | hardware | program | kernel calls | steps | generated cache read | "
             "roofline s, every slot | live slots | change | GiB per chip | largest program, "
             "free |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec in records:
        config = rec["argv"][rec["argv"].index("--config") + 1]
        big = max(rec["programs"], key=lambda q: q["total"])
        free = 1 - big["total"] / rec["hbm_bytes"]
        for r in rows(rec):
            lines.append(
                f"| {config} | {rec['topology']} | {r['program']} | {r['kernels']} | "
                f"{r['steps']:.0f} | {r['read_share']:.0%} | {r['whole_s']:.1f} | "
                f"{r['live_s']:.1f} | {r['live_s'] / r['whole_s'] - 1:+.0%} | "
                f"{r['total_gib']:.2f} | {big['name']}, {free:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="`python -m sage_jax.aot --json` outputs")
    args = ap.parse_args(argv)
    text = table([json.loads(Path(f).read_text()) for f in args.records])
    print(text)
    return text


if __name__ == "__main__":
    main()
