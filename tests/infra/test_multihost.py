"""Multi-host: two JAX processes on this machine (a local coordinator, 4 CPU devices each, gloo
collectives) train two steps as one 8-device run and write one checkpoint that a single process
restores; a SIGTERM on one of them stops both at one step and the rerun resumes exactly; plus
the environment rules of `distributed.initialize_from_env`."""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from sage_jax.run import restore
from sage_jax.infra import distributed
from sage_jax.infra.metrics import read_metrics

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[1] / "multihost_worker.py"
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_workers(workdir: Path, reports: list[Path], *extra: str, **env_extra: str):
    """Starts the worker script as processes 0 and 1 of one JAX cluster (4 CPU devices each);
    returns (processes, their open log files)."""
    port = _free_port()
    procs, logs = [], []
    for i, report in enumerate(reports):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1", **env_extra)
        log = open(report.with_suffix(".log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(workdir), str(report),
                                       *extra], env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs, logs


def _run_workers(workdir: Path, reports: list[Path], *extra: str) -> None:
    """Runs the worker script as processes 0 and 1 of one JAX cluster (4 CPU devices each)."""
    procs, logs = _start_workers(workdir, reports, *extra)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break  # a hang, or one worker failed (the other would wait for it)
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    out = []
    for i, log in enumerate(logs):
        log.seek(0)
        out.append(f"---- worker {i} (exit {codes[i]}) ----\n{log.read()[-6000:]}")
        log.close()
    if codes != [0, 0]:
        pytest.fail("multi-host workers failed:\n" + "\n".join(out))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(workdir, [report of process 0, of process 1]) of one two-process run."""
    tmp = tmp_path_factory.mktemp("multihost")
    workdir, reports = tmp / "run", [tmp / f"process{i}.json" for i in range(2)]
    _run_workers(workdir, reports)
    return workdir, [json.loads(r.read_text()) for r in reports]


def test_two_processes_train_and_a_single_process_restores(cluster):
    workdir, (r0, r1) = cluster
    for i, r in enumerate((r0, r1)):
        assert (r["process_index"], r["process_count"]) == (i, 2)
        assert (r["devices"], r["local_devices"]) == (8, 4)
        assert r["restored_step"] == 2 and np.isfinite(r["loss"])
    assert r0["params"] == r1["params"]  # one SPMD program: identical state on both hosts

    # Only process 0 wrote run files: one metrics line per step, one config.
    rows = read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["loss"] == pytest.approx(r0["loss"])
    assert rows[-1]["reward/mean"] == pytest.approx(r0["reward"])
    samples = (workdir / "samples.jsonl").read_text().splitlines()
    assert sorted({json.loads(x)["step"] for x in samples}) == [1, 2] and len(samples) == 8
    assert (workdir / "config.yaml").is_file()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]

    # One process (8 local devices) restores the two-process checkpoint.
    _, model, step = restore.restore_policy(workdir)
    assert step == 2
    flat = {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert set(flat) == set(r0["params"])
    for k, v in flat.items():
        assert np.all(np.isfinite(v)), k
        assert hashlib.sha256(v.tobytes()).hexdigest() == r0["params"][k], k


def test_sigterm_on_one_process_stops_both_at_one_step_and_the_rerun_resumes_exactly(
        cluster, tmp_path):
    """A preempted host: process 1 alone gets SIGTERM as step 1 starts. Both processes finish
    step 1, save checkpoint 1 once and exit 0; the same command again resumes from it on both
    and ends bit-identical to the uninterrupted run (`cluster`), its metrics step for step."""
    straight, (s0, _) = cluster
    workdir = tmp_path / "run"
    term = [tmp_path / f"term{i}.json" for i in range(2)]
    _run_workers(workdir, term, "term", "1")
    stopped = [json.loads(r.read_text()) for r in term]
    for r in stopped:
        assert (r["steps_run"], r["saves"], r["restored_step"]) == ([1], [1], 1)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]
    log0, log1 = (r.with_suffix(".log").read_text() for r in term)
    assert "signal 15: saving a checkpoint after this step" in log1
    assert "signal 15" not in log0 and "stopped at step 1" in log0  # told by process 1

    again = [tmp_path / f"again{i}.json" for i in range(2)]
    _run_workers(workdir, again)
    resumed = [json.loads(r.read_text()) for r in again]
    for r in resumed:
        assert (r["steps_run"], r["saves"], r["restored_step"]) == ([2], [2], 2)
        assert r["params"] == s0["params"]  # sha256 of every parameter
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
    rows, want = read_metrics(workdir / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for got, expected in zip(rows, want):
        np.testing.assert_equal(drop(got), drop(expected))


LOST_HOST_LIMIT_S = 120


def test_a_lost_process_never_hangs_the_others(tmp_path):
    """Process 1 dies (SIGKILL) right after its first step, while process 0 goes on into the
    second: process 0 exits non-zero within the bound, saying that a task died, instead of
    waiting in a collective forever."""
    reports = [tmp_path / f"process{i}.json" for i in range(2)]
    procs, logs = _start_workers(tmp_path / "run", reports, "kill", "1",
                                 SAGE_JAX_HEARTBEAT_TIMEOUT_S="20",
                                 SAGE_JAX_SHUTDOWN_TIMEOUT_S="20")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert procs[1].returncode == -9, "process 1 should have killed itself"
        lost_at = time.monotonic()
        while procs[0].poll() is None and time.monotonic() < lost_at + LOST_HOST_LIMIT_S:
            time.sleep(0.5)
        waited = time.monotonic() - lost_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs[0].seek(0)
    log0 = logs[0].read()
    for log in logs:
        log.close()
    print(f"process 0 exited {procs[0].returncode} {waited:.0f} s after process 1 was lost")
    assert procs[0].returncode not in (None, 0), f"process 0 still ran or exited 0:\n{log0[-3000:]}"
    assert waited < LOST_HOST_LIMIT_S
    named = [line for line in log0.splitlines() if re.search(r"task:1|heartbeat|task died", line,
                                                             re.I)]
    assert named, log0[-3000:]
    print("process 0 said:", named[0][:300])
    assert not reports[0].exists()


def test_two_processes_helpers(cluster):
    """Rewards scored where the text is and gathered, flags, consistency check, batch rows."""
    for i, r in enumerate(h["helpers"] for h in cluster[1]):
        assert r["process_index"] == i
        assert r["scores"] == list(range(7)) and r["stats"] == {"n": 7}
        assert r["empty"] == [] and r["any"] is True
        assert "disagree on workdir:" in r["mismatch"]  # only the entry that differs
        assert r["local_rows"] == [8 * i, 8 * i + 8]  # process i's 4 devices hold 8 rows
        assert r["batch_ok"] and r["batch_sharded"] and r["replicated"] == 7


def test_environment_rules():
    rules = distributed.cluster_from_env
    assert rules({}) is None
    explicit = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
                "JAX_PROCESS_ID": "3"}
    assert rules(explicit) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                               "process_id": 3}
    assert rules({**explicit, "SAGE_JAX_DISTRIBUTED": "0"}) is None
    assert rules({**explicit, "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) is None
    with pytest.raises(distributed.DistributedError, match="JAX_PROCESS_ID"):
        rules({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(distributed.DistributedError, match="0 .. JAX_NUM_PROCESSES-1"):
        rules({**explicit, "JAX_PROCESS_ID": "4"})
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    assert rules(slurm) == {}  # JAX auto-detects the rest
    assert rules({**slurm, "SLURM_NTASKS": "1"}) is None
    assert rules({"SAGE_JAX_DISTRIBUTED": "1"}) == {}
    assert distributed.initialize_from_env({}) is False  # single process: a no-op
    # Host-side row split and gathers, single-process forms.
    assert [distributed.process_rows(10, p, 3) for p in range(3)] == [
        slice(0, 4), slice(4, 8), slice(8, 10)]
    assert distributed.process_rows(1, 2, 3) == slice(1, 1)
    np.testing.assert_array_equal(distributed.gather_rows(np.arange(5), 5), np.arange(5))
    assert distributed.any_process(True) and not distributed.any_process(False)
