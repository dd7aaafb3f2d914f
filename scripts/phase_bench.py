"""Where a step's time goes, per arm, in one sitting:

    python scripts/phase_bench.py --out runs/phases --steps 8 \
        --arm grpo:rl.method=grpo --arm sage-online:rl.method=sage,hint.source=online \
        [--config configs/toy_tail.yaml] [section.key=value ...]

trains each arm for --steps steps from the same start (`loop.train`, no evaluation around it),
then writes OUT/phases.json and OUT/phases.md: the median of each phase of `infra.phases` over
steps 3 on, and each arm's median step over the first arm's. The overrides apply to every arm
(the toy configs also need `task.toy.calibrate=false`, and then `hint.source: auto` means
`reference`: name the source). Timings from a machine shared with other work are contended.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from sage_jax.infra import provenance
from sage_jax.infra.metrics import read_metrics
from sage_jax.infra.phases import STEP, phase_medians, phase_table
from sage_jax.run import loop
from sage_jax.tasks import registry


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="configs/toy_tail.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--arm", action="append", required=True,
                    help="NAME:key=value,key=value (overrides of this arm only)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cols, wall = {}, {}
    for spec in args.arm:
        name, _, extra = spec.partition(":")
        wd = out / name
        shutil.rmtree(wd, ignore_errors=True)
        cfg = registry.load_config(args.config, [*args.overrides, f"train.steps={args.steps}",
                                                 "checkpoint.every=0",
                                                 *[x for x in extra.split(",") if x]])
        t0 = time.perf_counter()
        loop.train(cfg, wd)
        wall[name] = time.perf_counter() - t0
        cols[name] = phase_medians(read_metrics(wd))
        print(name, json.dumps(cols[name]), flush=True)
    first = next(iter(cols))
    ratios = {n: m[STEP] / cols[first][STEP] for n, m in cols.items()}
    text = "\n".join([phase_table(cols), "", "median step / " + first + ": " + ", ".join(
        f"{n} {r:.2f}x" for n, r in ratios.items())]) + "\n"
    (out / "phases.md").write_text(text)
    (out / "phases.json").write_text(json.dumps(
        {"commit": provenance.commit(), "config": args.config, "steps": args.steps,
         "arms": args.arm,
         "overrides": args.overrides, "phases": cols, "ratio": ratios, "wall_s": wall},
        indent=1))
    print(text, flush=True)
    return cols


if __name__ == "__main__":
    main()
