"""A study's claims table, generated from its per-run results: every contrast fixed here in code,
each labelled by the hint source of its two arms, with a paired 95 % t-interval over seeds on all
held-out problems, on the hard split and outside it.

    python scripts/study_claims.py docs/toy_tail [docs/toy_study ...]   # writes DIR/claims.md

reads DIR/results.json (`runs`: one dict per run with `arm`, `seed`, `accuracy` by difficulty,
optionally `split` {"hard", "rest"}, `never_solved`, `rescue`, `median_step_s`, `timed`;
`write_accuracy` of the warm start) and writes DIR/claims.md. The README, the studies' readings and
the toy job's summary quote or link this file only (tests/system/test_claims.py checks them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from toy_study_report import NO_RESCUE, interval, overall  # noqa: E402

CLAIMS_FILE = "claims.md"
SPLITS = (("all", "all held-out"), ("hard", "hard split"), ("rest", "outside the hard split"))


@dataclasses.dataclass(frozen=True)
class Contrast:
    """The claim `a > b` on held-out no-hint accuracy, paired by seed."""
    claim: str
    a: str
    b: str
    hints: str  # the hint source of a, then of b: self-written / reference / none
    primary: bool


HINTS = {"grpo": "none", "resample": "none", "sage-ref": "reference",
         "sage-ref-plain": "reference", "sage_light-ref": "reference"}
CONTRASTS = tuple(Contrast(claim, a, b, f"{HINTS.get(a, 'self-written')} vs "
                                        f"{HINTS.get(b, 'self-written')}", primary)
                  for claim, a, b, primary in (
    # primary: the paper's method against its controls (issue 50)
    ("self-written hints beat re-sampling without hints", "sage-online", "resample", True),
    ("SAGE with self-written hints beats GRPO", "sage-online", "grpo", True),
    ("reference hints beat re-sampling without hints", "sage-ref", "resample", True),
    ("SAGE with reference hints beats GRPO", "sage-ref", "grpo", True),
    ("re-sampling without hints beats GRPO", "resample", "grpo", True),
    # secondary
    ("online hints beat offline ones (written once)", "sage-online", "sage-offline", False),
    ("self-written hints beat reference hints", "sage-online", "sage-ref", False),
    ("SAGE with offline self-written hints beats GRPO", "sage-offline", "grpo", False),
    ("hinted context beats plain context", "sage-online", "sage-online-plain", False),
    ("hinted context beats plain context", "sage-ref", "sage-ref-plain", False),
    ("SAGE-light beats GRPO", "sage_light-online", "grpo", False),
    ("SAGE-light beats GRPO", "sage_light-ref", "grpo", False)))


def value(run: dict, split: str) -> float | None:
    """A run's held-out no-hint accuracy on `split` (all: the mean over difficulties)."""
    if split == "all":
        return overall(run["accuracy"])
    return run.get("split", {}).get(split)


def paired(runs: list[dict], a: str, b: str, split: str) -> list[float]:
    """Per seed, arm a's accuracy on `split` minus arm b's (seeds both arms ran)."""
    of = {arm: {r["seed"]: value(r, split) for r in runs if r["arm"] == arm} for arm in (a, b)}
    return [of[a][s] - of[b][s] for s in sorted(of[a]) if s in of[b]
            and of[a][s] is not None and of[b][s] is not None]


def verdict(values: list[float]) -> str:
    """`+m ± h (holds | reversed | not shown)`, or why there is no interval."""
    m, h = interval(values)
    if math.isnan(m):
        return "-"
    if math.isnan(h):
        return f"{m:+.3f} (one seed: no interval)"
    word = "holds" if m - h > 0 else "reversed" if m + h < 0 else "not shown"
    return f"{m:+.3f} ± {h:.3f} ({word})"


def escalates(arm: str) -> bool:
    """The arm re-samples all-zero groups level by level (its rescues are counted)."""
    return arm.startswith("sage-") or arm == "resample"


def rescued(runs: list[dict], arm: str) -> tuple[int, int]:
    """(re-sampled groups that came back mixed, first-pass all-zero groups) of an arm."""
    rs = [r for r in runs if r["arm"] == arm]
    return (sum(r["rescue"].get("mixed", 0) for r in rs),
            sum(r["rescue"]["all_zero"] for r in rs))


def untested(runs: list[dict], arm: str) -> str:
    """Why a self-written-hint arm tests nothing: its hints rescued (almost) no group."""
    mixed, zero = rescued(runs, arm)
    if HINTS.get(arm, "self-written") == "self-written" and escalates(arm) and zero \
            and mixed / zero < NO_RESCUE:
        return f"not a test of SAGE: {arm}'s hints rescued {mixed} of {zero} all-zero groups"
    return ""


def claims(runs: list[dict]) -> list[dict]:
    """One row per contrast whose two arms ran: the contrast, its values per split, and a note
    when a self-written-hint arm of it rescued nothing."""
    arms = {r["arm"] for r in runs}
    splits = [s for s, _ in SPLITS if any(value(r, s) is not None for r in runs)]
    return [{"contrast": c, "n": len(paired(runs, c.a, c.b, "all")),
             **{s: verdict(paired(runs, c.a, c.b, s)) for s in splits},
             "note": "; ".join(x for x in (untested(runs, c.a), untested(runs, c.b)) if x)}
            for c in CONTRASTS if c.a in arms and c.b in arms]


def _arm_rows(runs: list[dict]) -> list[str]:
    """Per arm: never-solved shares, rescued groups, step-time ratio vs GRPO (timed pairs)."""
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    grpo = {r["seed"]: r["median_step_s"] for r in runs
            if r["arm"] == "grpo" and r.get("timed", True)}
    rows = ["| arm | runs | never solved | never solved without a hint | rescued (mixed) / "
            "all-zero groups | median step vs grpo (timed seed pairs) |", "|---|---|---|---|---|---|"]
    for a in arms:
        rs = [r for r in runs if r["arm"] == a]
        ratio = [r["median_step_s"] / grpo[r["seed"]] for r in rs
                 if r["seed"] in grpo and r.get("timed", True)]
        mixed, zero = rescued(runs, a)
        never = [r["never_solved"]["any"] for r in rs]
        bare = [r["never_solved"]["unhinted"] for r in rs]
        rows.append(
            f"| {a} | {len(rs)} | {interval(never)[0]:.3f} | {interval(bare)[0]:.3f} | "
            + (f"{mixed / zero:.2f} ({mixed}/{zero})" if zero and escalates(a) else "-") + " | "
            + (f"{float(np.median(ratio)):.2f}× ({len(ratio)})" if ratio else "-") + " |")
    return rows


def markdown(results: dict, title: str, registered: str | None = None) -> str:
    """The claims table of one study's results.json; `registered`: the file that fixed its
    analysis before its runs (else the table says the contrasts came after them)."""
    runs = results["runs"]
    rows = claims(runs)
    splits = [(s, name) for s, name in SPLITS if rows and s in rows[0]]
    seeds = sorted({r["seed"] for r in runs})
    head = ["| contrast (a − b) | claim | hints (a vs b) | seeds | "
            + " | ".join(name for _, name in splits) + " | note |", "|---" * (5 + len(splits)) + "|"]

    def table(primary: bool) -> list[str]:
        return head + [f"| {r['contrast'].a} − {r['contrast'].b} | {r['contrast'].claim} | "
                       f"{r['contrast'].hints} | {r['n']} | "
                       + " | ".join(r[s] for s, _ in splits) + f" | {r['note']} |"
                       for r in rows if r["contrast"].primary == primary]
    lines = [f"# Claims: {title}", "",
             "Generated by `python scripts/study_claims.py` from `results.json` in this folder; "
             "do not edit. Held-out no-hint accuracy of arm a minus arm b, paired by seed: mean "
             "± half-width of the 95 % t-interval over seeds; \"holds\" when the interval is above "
             "0, \"reversed\" when below, \"not shown\" when it includes 0. Hints: who wrote the "
             "hints of each arm (self-written: the policy; reference: the task's rule on the "
             "reference solution; none: no hints).", "",
             "## Primary contrasts", "", *table(True), "", "## Secondary contrasts", "",
             *table(False), ""]
    write = results.get("write_accuracy")
    if write:
        lines += ["Hint writing of the warm start (greedy, exact match with the reference "
                  f"levels, {write['problems']} held-out problems): " + ", ".join(
                      f"L{k} {float(v):.0%}" for k, v in write["acc"].items())
                  + f"; parsed {float(write['parse_rate']):.0%}.", ""]
    timed = sum(1 for r in runs if r["arm"] == "grpo" and r.get("timed", True))
    lines += ["## Per arm", "", *_arm_rows(runs), "",
              "Step-time ratios are medians over the seed pairs whose two runs both had the "
              f"machine to themselves (GRPO: {timed} timed of "
              f"{sum(1 for r in runs if r['arm'] == 'grpo')} runs); the count is in brackets.",
              "", "## Caveats", "",
              f"- {len(rows) * len(splits)} intervals are reported ({len(rows)} contrasts × "
              f"{len(splits)} split{'s' if len(splits) > 1 else ''}), each at 95 % with no correction for multiple comparisons: "
              "about one in twenty intervals that exclude 0 could do so by chance; read the "
              "secondary ones as exploratory.",
              f"- Every seed ({', '.join(map(str, seeds))}) starts from the same warm start (one "
              "SFT checkpoint) and is evaluated on the same held-out problems: the intervals "
              "cover RL seeds (prompt order, sampling keys), not a different warm start or "
              "problem set.",
              (f"- Pre-registered in `{registered}` before any SAGE arm ran: the first primary "
               "contrast is the registered one; the rest are secondary." if registered else
               "- The contrasts were fixed in code (`scripts/study_claims.py`, issue 50) after "
               "these runs had finished."), ""]
    return "\n".join(lines)


def write(folder: Path, title: str | None = None, registered: str | None = None) -> Path:
    """DIR/claims.md from DIR/results.json."""
    folder = Path(folder)
    results = json.loads((folder / "results.json").read_text())
    path = folder / CLAIMS_FILE
    path.write_text(markdown(results, title or folder.name, registered))
    return path


TITLES = {"toy_tail": "the toy task's hard split (docs/toy_tail)",
          "toy_study": "the default toy task (docs/toy_study)"}


def main(argv=None) -> None:
    for folder in (argv if argv is not None else sys.argv[1:]):
        print(f"wrote {write(Path(folder), TITLES.get(Path(folder).name))}")


if __name__ == "__main__":
    main()
