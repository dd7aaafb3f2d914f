"""Kill soak: a toy run SIGKILLed at random moments, resumed each time, must end exactly like an
uninterrupted run (same parameters, same metrics, every step logged once).

    python scripts/kill_soak.py --out /tmp/soak --steps 40 --kills 6 [--seed 0]

Runs `python -m sage_jax.train` once uninterrupted (the reference), then again in another folder,
killing it (SIGKILL: no handler runs) after a random delay and re-running the same command,
`--kills` times, then once more to the end. A kill lands in start-up, sampling, the update or a
checkpoint save (a checkpoint every step, so saves are frequent); the step the run was in is read
from its progress output. Prints a table of the kills and the comparison, and exits non-zero when
anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flax import nnx  # noqa: E402

from sage_jax.infra.metrics import read_metrics  # noqa: E402
from sage_jax.run import restore  # noqa: E402

ARGS = ["rl.method=sage", "rl.prompts_per_step=4", "rl.group_size=4", "rl.minibatches=2",
        "rl.max_new_tokens=64", "hint.max_new_tokens=64", "checkpoint.every=1",
        "checkpoint.keep=2", "train.samples_every=5", "task.toy.calibrate=false",
        "task.toy.report=false"]
VOLATILE = ("time/", "throughput/")  # wall-clock metrics differ between any two runs


def _command(workdir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "sage_jax.train", "--workdir", str(workdir), *ARGS,
            f"train.steps={steps}"]


def _run(workdir: Path, steps: int, kill_after: float | None, log) -> tuple[int, float]:
    """(exit code, seconds run) of one start of the run, killed after `kill_after` seconds."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(_command(workdir, steps), cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return proc.returncode, time.monotonic() - t0


def _phase(log_path: Path) -> str:
    """What the killed run was doing, from the tail of its output."""
    tail = log_path.read_text(errors="replace")[-4000:]
    steps = re.findall(r"(\d+)/\d+ \[", tail)
    if "resumed from" not in tail and not steps:
        return "start-up"
    return f"after step {steps[-1]}" if steps else "start-up (resumed)"


def _params(workdir: Path) -> dict[str, np.ndarray]:
    _, model, _ = restore.restore_policy(workdir)
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the two runs and their logs")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-s", type=float, default=4.0, help="shortest time before a kill")
    ap.add_argument("--max-s", type=float, default=40.0, help="longest time before a kill")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ref, soak = out / "reference", out / "soak"
    rng = np.random.default_rng(args.seed)

    with open(out / "reference.log", "w") as log:
        code, seconds = _run(ref, args.steps, None, log)
    print(f"reference: exit {code}, {seconds:.0f} s")
    if code != 0:
        return 1
    kills = []
    for i in range(args.kills):
        delay = float(rng.uniform(args.min_s, args.max_s))
        log_path = out / f"soak-{i}.log"
        with open(log_path, "w") as log:
            code, seconds = _run(soak, args.steps, delay, log)
        kills.append({"kill": i + 1, "after_s": round(delay, 1), "exit": code,
                      "phase": _phase(log_path)})
        print(f"kill {i + 1}: after {delay:.1f} s, exit {code}, {kills[-1]['phase']}")
    with open(out / "soak-final.log", "w") as log:
        code, seconds = _run(soak, args.steps, None, log)
    print(f"final resume: exit {code}, {seconds:.0f} s")

    a, b = read_metrics(ref / "metrics.jsonl"), read_metrics(soak / "metrics.jsonl")
    steps_ok = [r["step"] for r in b] == list(range(1, args.steps + 1))
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(VOLATILE)}  # noqa: E731
    metric_diffs = [r["step"] for r, s in zip(a, b)
                    if json.dumps(drop(r), sort_keys=True) != json.dumps(drop(s), sort_keys=True)]
    pa, pb = _params(ref), _params(soak)
    param_diff = max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa)
    result = {"kills": kills, "final_exit": code, "steps_logged_once": steps_ok,
              "metric_rows_differing": metric_diffs, "max_param_diff": param_diff,
              "killed": sum(k["exit"] == -signal.SIGKILL for k in kills)}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "kills"}))
    ok = code == 0 and steps_ok and not metric_diffs and param_diff == 0.0
    print("kill soak:", "PASSED (bit-identical)" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
