"""Demo training data for the SmolLM2 recipe, from GSM8K's test split in ../shared/data.

    python scripts/make_gsm8k_demo.py --out ~/data/gsm8k_demo.jsonl [--rows 256]

Writes JSONL rows {problem, answer, solution}: the question, the number after `####`, and the
worked solution before it (calculator annotations `<<...>>` removed), from the *last* `--rows`
rows of the file, so that `python -m sage_jax.evaluate --benchmarks gsm8k --limit K` (the first K
rows) stays held out while K + rows <= 1319. This is a demo: GSM8K's test split is not training
data for a real study.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "gsm8k" / "test.jsonl"
_CALC = re.compile(r"<<[^>]*>>")


def to_row(raw: dict) -> dict:
    worked, _, answer = raw["answer"].rpartition("####")
    return {"problem": raw["question"].strip(), "answer": answer.strip().replace(",", ""),
            "solution": _CALC.sub("", worked).strip()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--source", default=str(SOURCE), help="GSM8K test.jsonl (Qwen-eval layout)")
    args = ap.parse_args(argv)
    lines = [json.loads(x) for x in Path(args.source).read_text().splitlines() if x.strip()]
    rows = [to_row(r) for r in lines[-args.rows:]]
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows (GSM8K test rows {len(lines) - len(rows)}..{len(lines) - 1}) "
          f"to {out}; evaluate --limit up to {len(lines) - len(rows)} is held out")


if __name__ == "__main__":
    main()
