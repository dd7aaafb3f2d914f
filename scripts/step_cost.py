"""A SAGE step's cost over a GRPO step, over seed pairs, from `scripts/phase_bench.py` sittings:

    python scripts/step_cost.py --out docs/bench/sage_step_cost_<date>.json \
        runs/s0/phases.json runs/s1/phases.json ... [--before runs/before/phases.json]

Each file's arms are filed under its seed (its `train.seed=` override, else 0); a later file
replaces an earlier one's arm of the same seed (a rerun of a contended arm: name both files,
the rerun last; the replaced one is kept under "replaced"). `--before` files are the same
measurement at an earlier commit. Writes the record (every file's commit, config, steps and
phase medians) and prints `table(record)`, which the docs quote.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from sage_jax.infra.phases import STEP, phase_table

BASE = "grpo"


def _seed(rec: dict) -> int:
    for o in rec.get("overrides", []):
        if o.startswith("train.seed="):
            return int(o.split("=", 1)[1])
    return 0


def _commit(rec: dict, path: str, arm: str) -> str | None:
    """The file's commit, else its arm's run's (`provenance.json` beside it)."""
    prov = Path(path).parent / arm / "provenance.json"
    if rec.get("commit") or not prov.is_file():
        return rec.get("commit")
    return json.loads(prov.read_text()).get("commit")


def collect(paths: list[str], before: list[str]) -> dict:
    """The record: per seed, each arm's phase medians and the file and commit it came from."""
    seeds: dict[str, dict] = {}
    replaced = []
    for path in paths:
        rec = json.loads(Path(path).read_text())
        for arm, phases in rec["phases"].items():
            cell = seeds.setdefault(str(_seed(rec)), {})
            if arm in cell:
                replaced.append(dict(cell[arm], seed=_seed(rec), arm=arm))
            cell[arm] = {"phases": phases, "file": str(path), "config": rec["config"],
                         "commit": _commit(rec, path, arm), "steps": rec["steps"]}
    earlier = []
    for path in before:
        rec = json.loads(Path(path).read_text())
        for arm, phases in rec["phases"].items():
            earlier.append({"seed": _seed(rec), "arm": arm, "phases": phases, "file": str(path),
                            "commit": _commit(rec, path, arm), "steps": rec["steps"]})
    return {"seeds": seeds, "replaced": replaced, "before": earlier}


def ratios(record: dict, arm: str) -> dict[str, float]:
    """Per seed with both arms: `arm`'s median step over GRPO's."""
    return {s: c[arm]["phases"][STEP] / c[BASE]["phases"][STEP]
            for s, c in sorted(record["seeds"].items()) if arm in c and BASE in c}


def table(record: dict) -> str:
    """Markdown: each seed's median steps and ratios, the median ratio per arm, and the phase
    medians (median over seeds) per arm; then the `before` measurements against the same
    seed's GRPO step."""
    arms = [a for a in dict.fromkeys(a for c in record["seeds"].values() for a in c) if a != BASE]
    lines = ["| seed | grpo step | " + " | ".join(f"{a} step (/ grpo)" for a in arms) + " |",
             "|---" * (len(arms) + 2) + "|"]
    for s, c in sorted(record["seeds"].items()):
        base = c[BASE]["phases"][STEP]
        cells = [f"{c[a]['phases'][STEP]:.2f} s ({c[a]['phases'][STEP] / base:.2f}×)"
                 if a in c else "-" for a in arms]
        lines.append(f"| {s} | {base:.2f} s | " + " | ".join(cells) + " |")
    med = [f"{statistics.median(r.values()):.2f}× over {len(r)}"
           for r in (ratios(record, a) for a in arms)]
    lines.append("| median ratio | | " + " | ".join(med) + " |")
    cols = {}
    for a in [BASE, *arms]:
        per = [c[a]["phases"] for c in record["seeds"].values() if a in c]
        cols[a] = {k: statistics.median(p[k] for p in per) for k in per[0]}
    out = "\n".join(lines) + "\n\nPhase medians (s; median over seeds):\n\n" + phase_table(cols)
    for r in record["replaced"]:
        out += (f"\n\nReplaced by a rerun (contended): seed {r['seed']} {r['arm']} "
                f"{r['phases'][STEP]:.2f} s a step")
    for b in record["before"]:
        base = record["seeds"][str(b["seed"])][BASE]["phases"][STEP]
        out += (f"\n\nBefore (commit {b['commit'] or 'unrecorded'}, seed {b['seed']}): {b['arm']} "
                f"{b['phases'][STEP]:.2f} s a step ({b['phases'][STEP] / base:.2f}× the same "
                f"seed's grpo step above)")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--before", action="append", default=[])
    ap.add_argument("phases", nargs="+")
    args = ap.parse_args(argv)
    record = collect(args.phases, args.before)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))
    return record


if __name__ == "__main__":
    main()
