"""One workload at two commits, side by side in one sitting: A, B, A, B, ... in one venv.

    python scripts/ab.py --a 0eca93d --b main --workload toy_grpo --repeats 3 \
        [--config-from own|a|b] [--python PY] [--work DIR] [--json OUT.json] [--model DIR]

A side is a commit (checked out once into a worktree under --work) or the path of a checkout
(used as it is; its uncommitted changes are recorded as `+dirty`). Every child process runs in
its side's tree, with PYTHONPATH there, PYTHONSAFEPATH set and a compilation cache of its own. A
probe first proves that the side imports that tree (`sage_jax.__file__`, and
`provenance.commit()` where the commit has it), and each run is checked after it ends: the
commit in its run folder's provenance.json, or in its bench record, must be the side's (where
the commit records one).

Workloads (`WORKLOADS`): training runs (`python -m sage_jax.train` for `steps` steps; the
samples are `time/step_s` of every step from the `skip`-th on, and the phases of
`infra.phases`) and the benches of `python -m sage_jax.bench` (the samples are its timed calls).
`--config-from own` gives each side its own commit's config file; `a` or `b` gives both sides
that side's file (the other side's loader must accept it). Which one ran is printed and kept.

Printed and kept in --json: per side the median sample, the phases' medians and the peak RSS;
the ratio B/A of the medians with a 95 % bootstrap interval (runs resampled within each side,
then samples within each run: the spread between runs counts), and each pair's ratio. Each
child's /proc/stat reading says how many cores other processes used while it ran; a pair with a
contended child is left out of the ratio (and listed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_trl import run_child  # noqa: E402
from sage_jax.infra.phases import PHASES, STEP  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OTHER_CORES_LIMIT = 0.15  # the bench protocol's PEERS_OTHER_CORES_LIMIT


@dataclasses.dataclass(frozen=True)
class Workload:
    """A training run (`config` for `steps` steps, samples from step `skip` on) or a bench
    (`bench`: the arguments after `python -m sage_jax.bench`)."""
    config: str = ""
    overrides: tuple[str, ...] = ()
    steps: int = 0
    skip: int = 2
    bench: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # what the command line must give: model, data


TOY = ("task.toy.calibrate=false", "task.toy.report=false", "checkpoint.every=0",
       "train.samples_every=0", "eval.every=0")
GSM8K = ("checkpoint.every=0", "train.samples_every=0", "eval.every=0")
WORKLOADS = {
    "toy_grpo": Workload("toy_tail", ("rl.method=grpo", *TOY), steps=10),
    "toy_sage_online": Workload("toy_tail", ("rl.method=sage", "hint.source=online", *TOY),
                                steps=10),
    # 17 measured steps a side: at a ±15-20 % spread per step, enough to see 10 %
    "gsm8k_grpo": Workload("smollm2_gsm8k", ("rl.method=grpo", *GSM8K), steps=19,
                           needs=("model", "data")),
    "update_real": Workload(bench=("update", "--workload", "real", "--json"), needs=("model",)),
    "sampler_real": Workload(bench=("sampler", "--workload", "real", "--json"),
                             needs=("model",)),
}


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def checkout(side: str, work: Path) -> tuple[Path, str]:
    """(tree, commit) of a side: an existing checkout's path, or a commit checked out once into
    a worktree under `work`."""
    if Path(side).is_dir():
        tree = Path(side).resolve()
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no", cwd=tree))
        return tree, _git("rev-parse", "HEAD", cwd=tree) + ("+dirty" if dirty else "")
    sha = _git("rev-parse", "--verify", f"{side}^{{commit}}")
    tree = work / f"wt-{sha[:12]}"
    if not (tree / "sage_jax").is_dir():
        _git("worktree", "add", "--detach", str(tree), sha)
    return tree.resolve(), sha


PROBE = ("import sage_jax, pathlib; print(pathlib.Path(sage_jax.__file__).resolve().parents[1])\n"
         "try:\n    from sage_jax.infra import provenance; print(provenance.commit())\n"
         "except ImportError:\n    print('-')")


def side_env(tree: Path, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    data = REPO.parent / "shared" / "data"  # a worktree under --work has no ../shared beside it
    return {**env, "PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1", "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(work / f"jax-cache-{tree.name}"),
            **({"SAGE_JAX_DATA_DIR": str(data)} if data.is_dir() and
               "SAGE_JAX_DATA_DIR" not in env else {})}


def check_side(python: str, tree: Path, commit: str, work: Path) -> str:
    """The child's own report of the tree it imports; an error when it is another tree."""
    out = subprocess.run([python, "-c", PROBE], env=side_env(tree, work), capture_output=True,
                         text=True, cwd=tree)
    lines = out.stdout.split()
    if out.returncode != 0 or not lines or Path(lines[0]) != tree:
        raise SystemExit(f"error: the side at {tree} imports sage_jax from "
                         f"{lines[0] if lines else '?'} ({out.stderr[-500:]})")
    if lines[1:] and lines[1] != "-" and lines[1] != commit:
        raise SystemExit(f"error: the side at {tree} reports commit {lines[1]}, not {commit}")
    return lines[1] if lines[1:] else "-"


def config_file(tree: Path, name: str) -> Path:
    return tree / "sage_jax" / "configs" / f"{name}.yaml"


def command(w: Workload, python: str, config: Path | None, workdir: Path,
            args: argparse.Namespace) -> list[str]:
    if w.bench:
        return [python, "-m", "sage_jax.bench", *w.bench]
    extra = [f"model.path={args.model}"] if "model" in w.needs else []
    extra += [f"data.train_files=[{args.data}]"] if "data" in w.needs else []
    return [python, "-m", "sage_jax.train", "--config", str(config), "--workdir", str(workdir),
            *w.overrides, *extra, f"train.steps={w.steps}"]


def child_commit(w: Workload, workdir: Path, log: Path) -> str | None:
    """The commit a finished child reported: its bench record's, or its run folder's
    provenance.json's (None where that side's code records none)."""
    if w.bench:
        rec = json.loads([ln for ln in log.read_text().splitlines() if ln.startswith("{")][-1])
        return rec.get("commit")
    prov = workdir / "provenance.json"
    return json.loads(prov.read_text()).get("commit") if prov.is_file() else None


def run_side(w: Workload, cmd: list[str], tree: Path, commit: str, workdir: Path,
             env: dict) -> dict:
    """One child in `tree`: its samples, phases and run_child's reading; an error when the
    child reports another commit than its side's."""
    child = run_child(cmd, workdir / "log.txt", env=env, cwd=tree)
    got = child_commit(w, workdir, workdir / "log.txt")
    if got is not None and got != commit:
        raise SystemExit(f"error: the run in {workdir} reports commit {got}, not its side's "
                         f"{commit} (tree {tree})")
    samples_s, phases = samples(w, workdir, workdir / "log.txt")
    return {"samples_s": samples_s, "median_s": float(np.median(samples_s)), "phases": phases,
            "reported_commit": got, **child}


def samples(w: Workload, workdir: Path, log: Path) -> tuple[list[float], dict[str, float]]:
    """(the timed samples, each phase's median) of one finished child."""
    if w.bench:
        rec = json.loads([ln for ln in log.read_text().splitlines() if ln.startswith("{")][-1])
        return [float(x) for x in rec["times_s"]], {}
    rows = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows[w.skip:] if STEP in r]
    return ([r[STEP] for r in rows],
            {k: float(np.median([r.get(k, 0.0) for r in rows])) for k, _ in (*PHASES, (STEP, ""))})


def ratio_interval(a: list[list[float]], b: list[list[float]], *, draws: int = 4000,
                   seed: int = 0) -> dict:
    """B/A of the medians of the pooled samples, with a 95 % bootstrap interval that resamples
    a side's runs, then each drawn run's samples (two levels: a step's spread between runs
    counts, not only within one); `a` and `b` hold one list per run."""
    rng = np.random.default_rng(seed)
    med = lambda runs: float(np.median(np.concatenate(runs)))  # noqa: E731

    def draw(runs):
        picked = rng.integers(len(runs), size=len(runs))
        return np.median(np.concatenate([rng.choice(runs[i], size=len(runs[i]))
                                         for i in picked]))
    boot = np.asarray([draw(b) / draw(a) for _ in range(draws)])
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"a_median": med(a), "b_median": med(b), "ratio": med(b) / med(a),
            "ci95": [float(lo), float(hi)]}


def headline(rec: dict) -> str:
    """One sentence of a sitting's record: the two medians, B/A with its interval, the pairs."""
    r, a, b = rec["result"], rec["a"]["commit"][:7], rec["b"]["commit"][:7]
    kept = len(rec["pair_ratios"])
    return (f"`{rec['workload']}`, {b} against {a}: median step {r['b_median']:.3f} s against "
            f"{r['a_median']:.3f} s, B/A **{r['ratio']:.3f}** (95 % {r['ci95'][0]:.3f}-"
            f"{r['ci95'][1]:.3f}) over {kept} uncontended pair{'s' * (kept != 1)} (pair "
            "ratios " + ", ".join(f"{x:.3f}" for x in rec["pair_ratios"]) + ")")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="commit or checkout path")
    ap.add_argument("--b", required=True, help="commit or checkout path")
    ap.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=3, help="A/B pairs, alternating")
    ap.add_argument("--config-from", default="own", choices=("own", "a", "b"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--work", default="/tmp/sage_ab")
    ap.add_argument("--model", default=str(Path("~/models/smollm2-135m-instruct").expanduser()))
    ap.add_argument("--data", default=str(Path("~/data/gsm8k_demo.jsonl").expanduser()))
    ap.add_argument("--steps", type=int, help="training steps a run (default: the workload's)")
    ap.add_argument("--json", help="write the sitting's record here")
    args = ap.parse_args(argv)
    w = WORKLOADS[args.workload]
    if args.steps:
        w = dataclasses.replace(w, steps=args.steps)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sides = {s: checkout(getattr(args, s), work) for s in ("a", "b")}
    reported = {s: check_side(args.python, tree, commit, work)
                for s, (tree, commit) in sides.items()}
    configs = {s: None if w.bench else config_file(
        sides[s if args.config_from == "own" else args.config_from][0], w.config) for s in sides}
    print(f"A: {sides['a'][1]} ({sides['a'][0]}), B: {sides['b'][1]} ({sides['b'][0]}); "
          f"workload {args.workload}; config: " + (
              "each side its own" if args.config_from == "own" else
              f"both sides {args.config_from.upper()}'s") + ("" if w.bench else
                                                           f" {w.config}.yaml"), flush=True)
    runs = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for rep in range(args.repeats):
        for s in ("a", "b"):
            tree, commit = sides[s]
            wd = work / "runs" / f"{stamp}-{s}{rep}"
            wd.mkdir(parents=True, exist_ok=True)
            env = side_env(tree, work)
            if "model" in w.needs:
                env["SMOL_HF"] = args.model
            run = run_side(w, command(w, args.python, configs[s], wd, args), tree,
                           commit, wd, env)
            runs.append({"side": s, "repeat": rep, **run,
                         "contended": run["other_cores"] > OTHER_CORES_LIMIT})
            print(f"{s.upper()}{rep}: median {np.median(run['samples_s']):.3f} s over "
                  f"{len(run['samples_s'])} (other cores {run['other_cores']}, peak RSS "
                  f"{run['peak_rss_mib']:.0f} MiB)", flush=True)
    bad = sorted({r["repeat"] for r in runs if r["contended"]})
    kept = [r for r in runs if r["repeat"] not in bad]
    of = lambda s: [r["samples_s"] for r in kept if r["side"] == s]  # noqa: E731
    result = ratio_interval(of("a"), of("b")) if kept else {}
    pairs = [float(np.median(b["samples_s"]) / np.median(a["samples_s"]))
             for a, b in zip(kept[0::2], kept[1::2])]
    phases = {s: {k: float(np.median([r["phases"][k] for r in kept if r["side"] == s]))
                  for k, _ in (*PHASES, (STEP, ""))} for s in sides if not w.bench and kept}
    record = {"workload": args.workload, "definition": dataclasses.asdict(w),
              "a": {"side": args.a, "commit": sides["a"][1], "reported": reported["a"]},
              "b": {"side": args.b, "commit": sides["b"][1], "reported": reported["b"]},
              "config_from": args.config_from, "python": args.python,
              "repeats": args.repeats, "contended_pairs": bad, "runs": runs,
              "result": result, "pair_ratios": pairs, "phases": phases,
              "peak_rss_mib": {s: max((r["peak_rss_mib"] for r in runs if r["side"] == s),
                                      default=None) for s in sides},
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if result:
        print(f"median A {result['a_median']:.3f} s, B {result['b_median']:.3f} s; B/A "
              f"{result['ratio']:.3f} (95 % {result['ci95'][0]:.3f}-{result['ci95'][1]:.3f}); "
              f"pairs {', '.join(f'{p:.3f}' for p in pairs)}"
              + (f"; contended pairs left out: {bad}" if bad else ""), flush=True)
    else:
        print(f"every pair was contended ({bad}): no ratio", flush=True)
    for s, ph in phases.items():
        print(f"{s.upper()} phases: " + ", ".join(f"{k.split('/')[1]} {v:.3f}"
                                                  for k, v in ph.items() if v), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
