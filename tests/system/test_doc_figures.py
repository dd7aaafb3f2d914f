"""Every measured figure in the docs comes from a committed record: a number with a unit or a
decimal point, outside a generated block, must be a number of a record its page cites (or of a
JSON file beside the page). Generated blocks are checked by their own tests, history.md is the
dated history page, and the SmolLM2 pilot's sections are labelled as the pilot."""

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
HISTORY = REPO / "docs" / "history.md"
# Pages a script writes from its records, each checked by a test of its own.
RENDERED = "test_study_report.py::test_the_committed_toy_reports_are_their_results_rendered"
GENERATED = {f"docs/{study}/{page}": test for study in ("toy_study", "toy_tail") for page, test in (
    ("README.md", RENDERED),
    ("claims.md", "test_claims.py::test_claims_table_is_generated_from_the_results"),
    ("reading.md", "test_claims.py::test_readme_readings_and_job_numbers_come_from_results_files"))}
UNIT = r"(?:\s?(?:%|×|x\b|s\b|ms\b|min\b|h\b|GiB|MiB|KiB|GB|MB|tokens/s|tok/s))"
FIGURE = re.compile(r"(?<![\w.\-/@#:])[+\-−]?(\d{1,3}(?:,\d{3})+|\d+\.\d+(?:e-\d+)?|\d+(?=" + UNIT
                    + r"))(?![\w.]*\d)(?!-\d)")
BLOCK = re.compile(r"<!-- ([\w-]+)(?::[^>]*)? -->\n.*?<!-- /[\w-]+ -->", re.S)
CITED = re.compile(r"[\w./*-]+\.(?:jsonl|json|txt|md)\b")
# Figures that are not measurements: capacities, defaults, rules, the paper's own numbers,
# versions. Each with the page it is on.
NOT_MEASURED = {
    "README.md": {"2602.03143": "the paper's arXiv id", "0.87": "the toy model's size (M params)",
                  "2.3": "the paper's figure", "40": "the paper's figure",
                  "95": "the interval's level", "100": "a threshold"},
    "aot.md": {"80": "an A100's memory", "10": "the headroom rule", "1,024": "a step's answers"},
    "architecture.md": {"3": "the slow-marker rule"},
    "scale_out.md": {"60": "a default timeout"},
    "toy_job.md": {"50": "the gate's threshold"},
    "running.md": {"494,032,768": "the preset's parameters (tests/models/test_presets.py)",
                   "16": "a v5e chip's memory", "10": "the headroom rule", "0.32": "vLLM's version",
                   "1.16": "TRL's version"},
    "benchmarks.md": {"0.32": "vLLM's version", "2,000": "the issue's target", "10": "the rule",
                      "2.5": "the issue's target"},
    "design.md": {"40": "the paper's figure", "20": "a criterion", "25": "a criterion"},
}
# A pre-registration is frozen when committed: its figures are the design's inputs, and it may not
# be edited after its runs start.
FROZEN = {"docs/smollm2_study/registration.md"}


def figures(text: str) -> list[str]:
    """The figures of `text` outside generated blocks, as written (no sign, no unit)."""
    return [m.group(1) for m in FIGURE.finditer(BLOCK.sub("", text))]


def sections(text: str) -> tuple[str, str]:
    """`text` without its pilot sections (a heading that names the pilot, to the next heading),
    and the pilot sections."""
    parts = re.split(r"(?m)^(?=#{1,3} )", text)
    pilot = [p for p in parts if re.match(r"#{1,3} .*\bpilot\b", p, re.I)]
    return "".join(p for p in parts if p not in pilot), "".join(pilot)


def cited(page: Path) -> set[Path]:
    """The files `page` names (relative to itself, the repository or docs/; globs expanded)."""
    found = set()
    for name in CITED.findall(page.read_text()):
        for base in (page.parent, REPO, REPO / "docs"):
            found |= {p for p in base.glob(name) if p.is_file()} if "*" in name else (
                {base / name} if (base / name).is_file() else set())
    return found - {page, HISTORY}


def sources(page: Path) -> str:
    """What `page`'s figures may quote: the records it cites and the JSON files beside it, its own
    generated blocks, and of the pages it cites the generated ones whole, of the others their
    generated blocks and pilot sections."""
    text = [page.read_text()]
    beside = set(page.parent.glob("*.json")) | set(page.parent.glob("results/*.json"))
    for p in cited(page) | beside:
        if p.suffix != ".md":
            text.append(p.read_text())
        elif str(p.relative_to(REPO)) in GENERATED:
            text.append(p.read_text())
        else:
            whole = p.read_text()
            text += [sections(whole)[1], *(m.group(0) for m in BLOCK.finditer(whole))]
    return " ".join(text[1:] + [m.group(0) for m in BLOCK.finditer(text[0])])


def numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", text)] + [
        float(n.replace(",", "")) for n in re.findall(r"\d{1,3}(?:,\d{3})+", text)]


def sourced(figure: str, pool: list[float]) -> bool:
    """`figure` is a pool number at its precision (a percent may be a fraction, GiB and MiB
    may be bytes)."""
    value = float(figure.replace(",", ""))
    mantissa, _, exponent = figure.partition("e")
    places = len(mantissa.split(".")[1]) if "." in mantissa else 0
    half = 0.5 * 10 ** (int(exponent or 0) - places) * (1 + 1e-9)
    return any(abs(v * scale - value) <= half for v in pool for scale in (1, 100, 2**-30, 2**-20))


def unsourced(page: Path) -> list[str]:
    allowed = NOT_MEASURED.get(page.name, {})
    pool = numbers(sources(page))
    return [f for f in figures(sections(page.read_text())[0])
            if f not in allowed and not sourced(f, pool)]


@pytest.mark.parametrize("page", [p for p in PAGES if p != HISTORY and
                                  str(p.relative_to(REPO)) not in {*GENERATED, *FROZEN}],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_measured_figure_is_in_a_record_the_page_cites(page):
    assert unsourced(page) == []


def test_every_generated_block_and_page_of_the_docs_is_checked_by_a_test():
    tests = " ".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    for test in GENERATED.values():
        file, name = test.split("::")
        assert f"def {name}(" in (REPO / "tests" / "system" / file).read_text(), test
    names = {m.group(1) for p in PAGES for m in BLOCK.finditer(p.read_text())}
    unchecked = {n for n in names if f"<!-- {n}" not in tests and f'"{n}"' not in tests}
    assert names and unchecked == set()


def test_a_typed_figure_without_a_record_is_caught(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"step_s": 2.764, "rss_mb": 2054}))
    page = tmp_path / "page.md"
    page.write_text("A step took 2.76 s ([run.json](run.json)), 2,054 MB at its peak, "
                    "and 3.1 s in another sitting.\n<!-- t -->\n| 9.99 s |\n<!-- /t -->\n")
    assert figures(page.read_text()) == ["2.76", "2,054", "3.1"]
    assert unsourced(page) == ["3.1"]
