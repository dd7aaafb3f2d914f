"""docs/benchmarks.md quotes its sittings' results files (docs/bench/*.jsonl), not typed numbers."""

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_real_sitting_of_2026_12_06_is_quoted_from_its_results_file():
    recs = [json.loads(line) for line in (DOCS / "bench" / "real_2026-12-06.jsonl").open()]
    text = " ".join((DOCS / "benchmarks.md").read_text().split())
    before, after = recs
    assert before["commit"] == "070a7aa" and before["lengths_sha1"] == after["lengths_sha1"]
    quoted = (f"before {before['tokens_per_s']:.1f} and after {after['tokens_per_s']:.1f} useful "
              f"tokens/s (median of two calls, {before['median_s']:.1f} s and "
              f"{after['median_s']:.1f} s;")
    assert quoted in text, quoted  # fails when the doc and the file differ
    assert f"`lengths_sha1` {after['lengths_sha1']}, {after['host_syncs']} host syncs" in text
    assert f"decode waste {after['decode_waste']:.3f} in both" in text
    assert before["decode_waste"] == after["decode_waste"]
    assert not before["contended"] and not after["contended"]
