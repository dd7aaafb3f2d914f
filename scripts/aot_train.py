"""The train steps of compile-only runs (`python -m sage_jax.aot --only train --json` records),
beside the largest rollout program of the same config and hardware (`*_rollout.json`):

    python -m sage_jax.aot --config paper_qwen2.5-7b --topology v5p-16 --preset qwen2.5-7b \
        --only train --json > docs/aot/paper_qwen2.5-7b_v5p-16_train.json
    python scripts/aot_train.py docs/aot

prints `table(pairs)` (docs/aot.md's table; `tests/bench/test_bench_docs.py` checks it): per
config and hardware, the train step's per-chip bytes as XLA assigns them, its matmul FLOPs and
roofline, its compile time and commit, and the step's largest program of both records with the
HBM it leaves free (with its record's commit).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 1024 ** 3
CONFIGS = ("paper_qwen2.5-7b", "paper_qwen3-4b", "paper_llama3.2-3b")
HARDWARE = ("v5p-16", "8xa100-80gb")


def pairs(folder: Path) -> list[tuple[dict, dict]]:
    """(train record, rollout record) of each paper config and hardware, in `folder`."""
    read = lambda name: json.loads((folder / name).read_text())  # noqa: E731
    return [(read(f"{c}_{h}_train.json"), read(f"{c}_{h}_rollout.json"))
            for c in CONFIGS for h in HARDWARE]


def table(recs: list[tuple[dict, dict]]) -> str:
    lines = ["| config | hardware | mesh | train step GiB: args / temp / peak | TFLOP | "
             "roofline s | compile s | commit | step's largest program, GiB per chip, free |",
             "|---|---|---|---|---|---|---|---|---|"]
    for train, roll in recs:
        config = train["argv"][train["argv"].index("--config") + 1]
        q = next(p for p in train["programs"] if p["name"] == "train_step")
        big, rec = max([(p, train) for p in train["programs"]]
                       + [(p, roll) for p in roll["programs"]], key=lambda x: x[0]["total"])
        mesh = " x ".join(f"{k} {v}" for k, v in train["mesh"].items() if v > 1)
        lines.append(
            f"| {config} | {train['topology']} | {mesh} | {q['argument'] / GIB:.2f} / "
            f"{q['temp'] / GIB:.2f} / {q['peak'] / GIB:.2f} | {q['flops'] / 1e12:,.0f} | "
            f"{q['roofline_s']:.1f} | {q['compile_s']:.0f} | "
            f"{train['provenance']['commit'][:7]} | {big['name']} "
            f"({rec['provenance']['commit'][:7]}), {big['total'] / GIB:.2f}, "
            f"{1 - big['total'] / train['hbm_bytes']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="the records' folder (docs/aot)")
    text = table(pairs(ap.parse_args(argv).folder))
    print(text)
    return text


if __name__ == "__main__":
    main()
