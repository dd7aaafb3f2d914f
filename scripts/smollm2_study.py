"""The registered SmolLM2 word-problem study: the arms and seeds of its design file on
SmolLM2-135M-Instruct, every run from the same warm start on the same prompts per seed, analysed
as pre-registered in docs/smollm2_study/registration.md.

    PYTHONPATH=. python scripts/smollm2_study.py --out OUT [--pin SHA] [--model DIR]
        [--until ISO_TIME] [--max-runs N] [--partial] [section.key=value ...]

The design (`--design`, default docs/smollm2_study/design.json) names the config, the arms, the
seeds, the evaluation size and how busy the other processes may be for a run to count as timed.
Each run trains the config (plus the overrides) with its arm's method and hint source and
`train.seed=<seed>`, then evaluates the trained policy without hints on the held-out problems
(the same problems and sampling key for every run).

- A result, OUT/results/<arm>-s<seed>.json, is written only for a run that completed
  `train.steps`, with its provenance (commit, seed, resolved config), the sha256 of the
  warm-start weights it started from, and whether it had the machine to itself (the cores other
  processes used meanwhile, from /proc/stat). Re-running the command skips finished runs and
  resumes a cut-off one from its checkpoint (it then counts as untimed).
- SIGINT/SIGTERM ends the runner: the run in progress saves a checkpoint and is not recorded
  (unless it had already completed its steps), and no further run starts.
- `--until` starts a run only when its arm's expected time fits before that moment.
- The report (OUT/claims.md from `study_claims.py`, OUT/README.md, OUT/results.json) is written
  only when every registered run's result exists, all at one commit and one warm start; until
  then the command prints progress, labelled as such, and no accuracy. `--partial` prints that
  progress and runs nothing.
- A warm start retrained on another machine whose weights differ from the study's is refused.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reproduce_toy  # noqa: E402
import smollm2_words as words  # noqa: E402
import study_claims  # noqa: E402
from sage_jax import config as config_lib  # noqa: E402
from sage_jax.bench.protocol import CpuShare  # noqa: E402
from sage_jax.infra import metrics as metrics_lib, provenance  # noqa: E402
from sage_jax.run import build, loop, restore  # noqa: E402
from sage_jax.tasks import registry  # noqa: E402
from sage_jax.tasks.words import hf_warm_start  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARMS = {"grpo": ["rl.method=grpo"], "resample": ["rl.method=resample"],
        "sage-online": ["rl.method=sage", "hint.source=online"],
        "sage-ref": ["rl.method=sage", "hint.source=reference"]}
ARM_KEYS = (("rl", "method"), ("hint", "source"), ("train", "seed"))  # what differs between runs
PRIMARY = ("sage-online", "resample")  # registered: held-out no-hint accuracy, paired over seeds
REGISTRATION = "docs/smollm2_study/registration.md"
DESIGN = "docs/smollm2_study/design.json"


class StudyError(SystemExit):
    """A study that cannot go on as registered (the message says why); exit status 2."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")
        self.code = 2


class StopFlag:
    """SIGINT/SIGTERM: no new run starts; a second signal stops at once. `loop.train` passes
    the signal on to this handler after arranging its own checkpoint."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"study: signal {signum}: no further run starts", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def load_design(path: str | Path) -> dict:
    design = json.loads(Path(path).read_text())
    need = {"config", "arms", "seeds", "eval", "contended_cores", "expected_minutes"}
    if need - set(design):
        raise StudyError(f"design {path}: missing {sorted(need - set(design))}")
    if [a for a in design["arms"] if a not in ARMS]:
        raise StudyError(f"design {path}: arms {design['arms']}: choose from {list(ARMS)}")
    return design


def registered(design: dict) -> list[tuple[str, int]]:
    """(arm, seed) of every registered run, in the order they are run: seed by seed."""
    return [(a, s) for s in design["seeds"] for a in design["arms"]]


def name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def result_path(out: Path, arm: str, seed: int) -> Path:
    return out / "results" / f"{name(arm, seed)}.json"


def _lengths(rates: dict[str, np.ndarray]) -> dict[int, float]:
    return {int(n.split("-")[1]): float(v.mean()) for n, v in rates.items()}


def _write_json(path: Path, value) -> None:
    """Written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1, default=float))
    os.replace(tmp, path)


def is_contended(other_cores: float | None, limit: float) -> bool:
    """Whether other processes used more than `limit` cores on average (unknown: contended)."""
    return other_cores is None or other_cores > limit


def run_one(arm: str, seed: int, out: Path, design: dict, base: list[str],
            warm: dict) -> dict | None:
    """Trains and evaluates one run; its result, or None when training stopped before
    `train.steps` (nothing is recorded; the checkpoint stays for a resume)."""
    cfg = registry.load_config(design["config"], [*base, *ARMS[arm], f"train.seed={seed}"])
    wd = out / "runs" / name(arm, seed)
    resumed = bool(wd.is_dir() and metrics_lib.read_metrics(wd))
    with CpuShare() as share:
        t0 = time.perf_counter()
        loop.train(cfg, wd)
        train_s = time.perf_counter() - t0
        _, trained, step = restore.restore_policy(wd)
        if step < cfg.train.steps:
            return None
        rates = words.pass_rates(trained, cfg, **design["eval"])
        wall_s = time.perf_counter() - t0
    rows = metrics_lib.read_metrics(wd)
    other = share.cores.get("other_cores")
    contended = is_contended(other, design["contended_cores"])
    res = {"arm": arm, "seed": seed, "accuracy": _lengths(rates),
           "per_problem": {k: v.tolist() for k, v in rates.items()},
           "rl": words.rl_summary(wd), "train_s": train_s, "wall_s": wall_s,
           "median_step_s": float(np.nanmedian([r.get("time/step_s") for r in rows[1:]]
                                               or [np.nan])),
           "tokens": float(np.nansum([r.get("tokens/sampled", 0.0) for r in rows])),
           **reproduce_toy.visit_numbers(reproduce_toy.read_groups(wd), rows),
           "warm_start_sha256": warm["weights_sha256"],
           "machine": {**share.cores, "contended_above": design["contended_cores"],
                       "contended": contended, "resumed": resumed},
           "timed": not contended and not resumed,
           "provenance": provenance.record(config_lib.to_dict(cfg), seed)}
    res = json.loads(json.dumps(res, default=float))  # as a later session reads it back
    _write_json(result_path(out, arm, seed), res)
    why = "resumed" if resumed else f"contended ({other} other cores)" if contended else "timed"
    print(f"study: {name(arm, seed)} finished in {wall_s / 60:.1f} min ({why})", flush=True)
    return res


def warm_start(out: Path, design: dict, base: list[str]) -> dict:
    """The study's warm start: OUT/warm_start.json (weights sha256, no-hint accuracy), written the
    first time; later, the warm start on this machine must have the same weights."""
    cfg = registry.load_config(design["config"], base)
    path = hf_warm_start.warm_start_folder(cfg)
    record_file = out / "warm_start.json"
    if record_file.is_file():
        warm = json.loads(record_file.read_text())
        if not (path / "config.json").is_file():
            hf_warm_start.warm_started_model(cfg)  # trains it (a new machine)
        sha = hf_warm_start.weights_sha256(path)
        if sha != warm["weights_sha256"]:
            raise StudyError(
                f"the warm start on this machine ({path}, weights sha256 {sha[:12]}) differs from "
                f"the study's ({warm['weights_sha256'][:12]}, {record_file}): its runs would not "
                "start from the same weights. Restore the study's warm start into that folder, "
                "or re-run every recorded run from this one (move OUT/results and "
                "OUT/warm_start.json aside).")
        return warm
    model = build.load_model(cfg)  # trains and caches the warm start when it is missing
    rates = words.pass_rates(model, cfg, **design["eval"])
    warm = {**words.accuracy_summary(rates), "per_problem": {k: v.tolist()
                                                             for k, v in rates.items()},
            "weights_sha256": hf_warm_start.weights_sha256(path), "cache": path.name,
            "settings": hf_warm_start.warm_start_settings(cfg),
            "provenance": provenance.record(config_lib.to_dict(cfg), None)}
    _write_json(record_file, warm)
    return warm


def finished(out: Path, design: dict) -> list[dict]:
    return [json.loads(result_path(out, a, s).read_text()) for a, s in registered(design)
            if result_path(out, a, s).is_file()]


def progress(out: Path, design: dict) -> str:
    """Which registered runs exist, how long they took and whether they were timed; no
    accuracy (the contrasts are read only when every run exists)."""
    runs = {name(r["arm"], r["seed"]): r for r in finished(out, design)}
    todo = registered(design)
    lines = [f"PARTIAL PROGRESS (not a result): {len(runs)} of {len(todo)} registered runs "
             "finished; the contrasts are read only when all exist.", "",
             "| run | minutes | timed | commit | warm start |", "|---|---|---|---|---|"]
    for arm, seed in todo:
        r = runs.get(name(arm, seed))
        lines.append(f"| {name(arm, seed)} | " + (
            f"{r['wall_s'] / 60:.1f} | {'yes' if r['timed'] else 'no'} | "
            f"{r['provenance']['commit'][:12]} | {r['warm_start_sha256'][:12]} |" if r
            else "- | - | - | - |"))
    return "\n".join(lines)


def check_consistent(runs: list[dict], warm: dict, *, allow_dirty: bool = False) -> None:
    """Every run at one clean commit (`allow_dirty`: or one commit with changes), from the
    study's warm start, with one config apart from its arm and seed."""
    commits = {r["provenance"]["commit"] for r in runs}
    if len(commits) != 1 or any((c.endswith("+dirty") and not allow_dirty)
                                or c == provenance.NO_CHECKOUT for c in commits):
        raise StudyError(f"the runs were made at {sorted(commits)}: a study's runs share one "
                         "clean commit")
    bad = [name(r["arm"], r["seed"]) for r in runs
           if r["warm_start_sha256"] != warm["weights_sha256"]]
    if bad:
        raise StudyError(f"runs {bad} started from another warm start than the study's")

    def shared(cfg: dict) -> dict:
        cfg = json.loads(json.dumps(cfg))
        for section, key in ARM_KEYS:
            cfg.get(section, {}).pop(key, None)
        return cfg
    first = shared(runs[0]["provenance"]["config"])
    bad = [name(r["arm"], r["seed"]) for r in runs if shared(r["provenance"]["config"]) != first]
    if bad:
        raise StudyError(f"runs {bad} ran another config than {name(runs[0]['arm'], runs[0]['seed'])}")


def over_problems(runs: list[dict], a: str, b: str) -> dict:
    """Arm a − arm b per held-out problem, averaged over the seeds both ran: mean, SE and 95 %
    interval over problems."""
    of = {arm: {r["seed"]: np.concatenate([np.asarray(v) for v in r["per_problem"].values()])
                for r in runs if r["arm"] == arm} for arm in (a, b)}
    seeds = sorted(set(of[a]) & set(of[b]))
    if not seeds:
        return {}
    d = np.mean([of[a][s] - of[b][s] for s in seeds], axis=0)
    m, se = float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))
    return {"diff": m, "se": se, "ci95": [m - 1.96 * se, m + 1.96 * se], "problems": len(d),
            "seeds": seeds}


def per_arm(runs: list[dict]) -> list[str]:
    """Per arm: never solved, rescue per level, hint correctness, cost (timed runs)."""
    lines = ["| arm | runs | never solved (any / bare) | rescue L1 / L2 / L3 | hints right L1 / L2 "
             "/ L3 | median step | wall per run | sampled tokens |", "|---" * 8 + "|"]
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        mean = lambda xs: float(np.nanmean(xs)) if len(xs) else float("nan")  # noqa: E731
        tried = np.sum([r["rescue"]["tried"] for r in rs], axis=0)
        solved = np.sum([[r["rescue"]["rate"][str(lvl)] * r["rescue"]["tried"][lvl - 1]
                          if r["rescue"]["tried"][lvl - 1] else 0 for lvl in (1, 2, 3)]
                         for r in rs], axis=0)
        rescue = " / ".join(f"{s / t:.2f}" if t else "-" for s, t in zip(solved, tried))
        right = " / ".join(f"{mean([r['rl'][f'hint_right_level_{lvl}'] for r in rs]):.2f}"
                           for lvl in (1, 2, 3)) if arm == "sage-online" else "-"
        timed = [r for r in rs if r["timed"]]
        lines.append(
            f"| {arm} | {len(rs)} | {mean([r['never_solved']['any'] for r in rs]):.3f} / "
            f"{mean([r['never_solved']['unhinted'] for r in rs]):.3f} | {rescue} | {right} | "
            f"{mean([r['median_step_s'] for r in timed]):.1f} s ({len(timed)}) | "
            f"{mean([r['wall_s'] for r in timed]) / 60:.1f} min | "
            f"{mean([r['tokens'] for r in rs]) / 1e6:.2f} M |")
    return lines


def report(runs: list[dict], before: dict, out: Path, command: str) -> str:
    """OUT/results.json, OUT/claims.md and OUT/README.md from every registered run."""
    _write_json(out / "results.json", {"warm_start": before, "runs": runs})
    study_claims.write(out, "SmolLM2-135M-Instruct on word problems (docs/smollm2_study)",
                       registered=REGISTRATION)
    p = over_problems(runs, *PRIMARY)
    lines = ["# SmolLM2-135M-Instruct word-problem study", "",
             f"Registered: [{Path(REGISTRATION).name}]({Path(REGISTRATION).name}). Command: "
             f"`{command}`. Runs: {len(runs)}, at commit "
             f"{runs[0]['provenance']['commit']}. Claims, paired over seeds: "
             "[claims.md](claims.md).", "",
             f"Warm start (weights sha256 {before['weights_sha256'][:12]}): held-out no-hint "
             f"accuracy {before['overall']:.3f} ± {before['se']:.3f} (SE over problems).", ""]
    if p:
        lines += [f"Primary contrast over problems ({PRIMARY[0]} − {PRIMARY[1]}, each problem's "
                  f"difference averaged over seeds {p['seeds']}, {p['problems']} problems): "
                  f"{p['diff']:+.3f} (SE {p['se']:.3f}; 95 % CI {p['ci95'][0]:+.3f}, "
                  f"{p['ci95'][1]:+.3f}). The interval over seeds (claims.md) decides.", ""]
    lines += ["## Per arm (exploratory; means over seeds, rescue pooled over seeds; time from "
              "the timed runs, their count in brackets)", "", *per_arm(runs), ""]
    text = "\n".join(lines)
    (out / "README.md").write_text(text)
    return text


def power(*, pilot_se: float, pilot_samples: int, seed_sd: float, seeds: int, samples: int,
          power_level: float = 0.8) -> dict:
    """The primary contrast's precision at a design: the per-seed SD of the contrast from the
    evaluation (the pilot's paired SE over the same problems at `pilot_samples`, scaled to
    `samples`; it is sampling noise) and from training (`seed_sd`, assumed), the expected 95 %
    half-width over `seeds` and the minimum detectable effect (two-sided 5 %, `power_level`)."""
    eval_sd = pilot_se * np.sqrt(pilot_samples / samples)
    sd = float(np.hypot(eval_sd, seed_sd))
    t = stats.t.ppf(0.975, seeds - 1)
    return {"eval_sd": float(eval_sd), "sd": sd, "t": float(t),
            "half_width": float(t * sd / np.sqrt(seeds)),
            "mde": float((t + stats.t.ppf(power_level, seeds - 1)) * sd / np.sqrt(seeds))}


def _deadline(until: str | None) -> float | None:
    if until is None:
        return None
    return datetime.datetime.fromisoformat(until).timestamp()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="outside the checkout's tracked files")
    ap.add_argument("--design", default=str(REPO / DESIGN))
    ap.add_argument("--model", default="~/models/smollm2-135m-instruct")
    ap.add_argument("--pin", help="the registered commit: refuse to run at any other")
    ap.add_argument("--until", help="ISO time: start a run only if it can finish before it")
    ap.add_argument("--max-runs", type=int, help="start at most this many runs")
    ap.add_argument("--partial", action="store_true", help="print progress, run nothing")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="report results made with uncommitted changes (trying the runner; "
                         "never the registered study)")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args(argv)
    design, out = load_design(args.design), Path(args.out)
    if args.partial:
        print(progress(out, design), flush=True)
        return 0
    if provenance.SOURCE != REPO:
        raise StudyError(f"this script is in {REPO} but imports sage_jax from "
                         f"{provenance.SOURCE}: run it with PYTHONPATH={REPO}")
    if args.pin and provenance.commit() != args.pin:
        raise StudyError(f"the study is pinned to {args.pin}; this checkout is at "
                         f"{provenance.commit()}")
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model).expanduser()
    words.convert(model_dir)
    base = [f"model.path={model_dir}", *design.get("overrides", []), *args.overrides]
    deadline, started = _deadline(args.until), 0
    with StopFlag() as stop:
        warm = warm_start(out, design, base)
        for arm, seed in registered(design):
            if result_path(out, arm, seed).is_file():
                continue
            if stop.requested or (args.max_runs is not None and started >= args.max_runs):
                break
            need = 60 * design["expected_minutes"][arm]
            if deadline is not None and time.time() + need > deadline:
                print(f"study: {name(arm, seed)} needs about {need / 60:.0f} min; not started "
                      f"before {args.until}", flush=True)
                break
            started += 1
            if run_one(arm, seed, out, design, base, warm) is None:
                print(f"study: {name(arm, seed)} stopped before its last step: not recorded; "
                      "re-run the command to resume it", flush=True)
                return 130
        stopped = stop.requested
    runs = finished(out, design)
    if len(runs) < len(registered(design)):
        print(progress(out, design), flush=True)
        return 130 if stopped else 0
    check_consistent(runs, warm, allow_dirty=args.allow_dirty)
    command = " ".join(["python scripts/smollm2_study.py", *(argv if argv is not None
                                                              else sys.argv[1:])])
    print(report(runs, warm, out, command), flush=True)
    return 130 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
