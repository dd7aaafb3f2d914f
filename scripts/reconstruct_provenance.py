"""Reconstructs from the git history the provenance of the toy studies' runs, which predate the
runner's recording of it: for each run, the commit whose results first hold it, the commit
before that (the newest code the run can have used), the study's command and the arm's
overrides as the runner defined them there (and the blob of the command's --config file).
Written to OUT/provenance.json, labelled as
reconstructed.

    python scripts/reconstruct_provenance.py docs/toy_study docs/toy_tail

A study's runs are read from OUT/results/<arm>-s<seed>.json when that folder exists (each run's
file, added once), else from the versions of OUT/results.json (a run's first version). Needs
the repository's history (a full clone).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNNER = "scripts/reproduce_toy.py"
LABEL = ("reconstructed from the git history: the runs did not record their commit or config. "
         "'landed_in' is the first commit whose results hold the run; 'code_no_later_than' is "
         "the commit before it, the newest code the run can have used (a run may have started "
         "earlier, and its working tree may have differed); 'overrides' are the arm's as the "
         "runner defined them at that commit, on top of the study's command and base config.")


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout


def arms_at(commit: str) -> dict:
    """The runner's ARMS (arm -> overrides) at `commit`."""
    tree = ast.parse(git("show", f"{commit}:{RUNNER}"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ARMS"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{RUNNER} at {commit} defines no ARMS")


def first_versions(study: Path) -> dict[str, str]:
    """{run name: the first commit whose results hold the run as it is now}."""
    rel = study.resolve().relative_to(REPO)
    found: dict[str, str] = {}
    if (study / "results").is_dir():
        for path in sorted((study / "results").glob("*.json")):
            now, name = json.loads(path.read_text()), str(rel / "results" / path.name)
            for commit in git("log", "--format=%H", "--reverse", "--", name).split():
                if json.loads(git("show", f"{commit}:{name}")) == now:
                    found[path.stem] = commit
                    break
        return found
    name = str(rel / "results.json")
    now = {f"{r['arm']}-s{r['seed']}": r for r in json.loads((study / "results.json").read_text())
           ["runs"]}
    for commit in git("log", "--format=%H", "--reverse", "--diff-filter=AM", "--",
                      name).split():  # the versions it had (not its deletions)
        for r in json.loads(git("show", f"{commit}:{name}"))["runs"]:
            run = f"{r.get('arm')}-s{r.get('seed')}"
            if run in now and run not in found and _same_run(r, now[run]):
                found[run] = commit
    return found


def _same_run(old: dict, now: dict) -> bool:
    """The same run: its accuracy and wall-clock unchanged (later versions add fields)."""
    return all(old.get(k) == now.get(k) for k in ("accuracy", "wall_s", "steps"))


def command_of(study: Path) -> str:
    """The study's command, as its README gives it."""
    m = re.search(r"Command: `([^`]+)`", (study / "README.md").read_text())
    if not m:
        raise ValueError(f"{study / 'README.md'} gives no 'Command: `...`'")
    return m.group(1)


def reconstruct(study: Path) -> dict:
    runs, command = {}, command_of(study)
    m = re.search(r"--config (\S+)", command)
    config = m.group(1) if m else None
    for name, commit in sorted(first_versions(study).items()):
        code = git("rev-parse", f"{commit}^").strip()
        arm = name.rsplit("-s", 1)[0]
        runs[name] = {
            "landed_in": commit,
            "landed_at": git("show", "-s", "--format=%aI", commit).strip(),
            "code_no_later_than": code,
            "overrides": arms_at(code).get(arm),
        }
        if config:
            runs[name]["base_config"] = {"path": config, "blob": git(
                "rev-parse", f"{code}:{config}").strip()}
    return {"reconstructed": True, "label": LABEL, "command": command, "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("studies", nargs="+", type=Path)
    args = ap.parse_args(argv)
    for study in args.studies:
        out = reconstruct(study)
        (study / "provenance.json").write_text(json.dumps(out, indent=1) + "\n")
        print(f"{study / 'provenance.json'}: {len(out['runs'])} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
