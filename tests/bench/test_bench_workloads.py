"""The benchmark package (`sage_jax.bench`) defines its own workloads and timing protocol; they
agree with the peer scripts' in ../shared/bench/peers/ (when that folder is there), and one
sampler sitting on the tiny workload prints the peers' JSON record."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sage_jax.bench import protocol, workloads

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO.parent / "shared" / "bench" / "peers"
needs_peers = pytest.mark.skipif(not (PEERS / "workloads.json").is_file(),
                                 reason="the peer scripts (../shared/bench/peers) are not here")


def _peers_common():
    spec = importlib.util.spec_from_file_location("_peers_common", PEERS / "_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_peers
@pytest.mark.parametrize("name", sorted(workloads.WORKLOADS))
def test_our_workloads_are_the_peers(name):
    theirs = json.loads((PEERS / "workloads.json").read_text())[name]
    ours = workloads.load_workload(name)
    for part in ("model", "sampling", "timing"):
        assert ours[part] == {k: v for k, v in theirs[part].items() if not k.startswith("_")}


@needs_peers
def test_our_prompts_and_length_hash_are_the_peers():
    common = _peers_common()
    for name in ("small", "tiny"):
        w = workloads.load_workload(name)
        np.testing.assert_array_equal(workloads.make_prompts(w),
                                      common.make_prompts(common.load_workload(name)))
    spec = importlib.util.spec_from_file_location("_peers_real", PEERS / "hf_real_generate.py")
    script = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(PEERS))
    try:
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(PEERS))
    lengths = [384, 17, 250, 3]
    assert workloads.lengths_sha1(lengths) == script.lengths_sha1(lengths)


def test_an_unknown_workload_and_missing_real_inputs_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"unknown workload 'huge'; known: \['real', 'real_rl', 'small'"):
        workloads.load_workload("huge")
    w = workloads.load_workload("real")
    with pytest.raises(FileNotFoundError, match=r"eval/gsm8k/test.jsonl.*--data-dir"):
        workloads.questions(w, tmp_path)
    monkeypatch.setenv("SMOL_HF", str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match=r"SmolLM2-135M-Instruct.*get_smollm2.py"):
        workloads.model_dir(w)


def test_the_real_questions_are_the_first_rows_of_the_data(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(40)]
    file = tmp_path / "eval" / "gsm8k" / "test.jsonl"
    file.parent.mkdir(parents=True)
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert workloads.questions(workloads.load_workload("real"), tmp_path) == [
        f"q{i}" for i in range(32)]


def test_a_contended_sitting_is_retimed_and_flagged(monkeypatch):
    """time_calls re-times while other processes take the cores, then flags the record."""
    shares = iter([{"other_cores": 1.5}, {"other_cores": 1.2}])
    monkeypatch.setenv("PEERS_QUIET_WAIT_S", "0")
    monkeypatch.setenv("PEERS_MAX_RETRIES", "1")

    class Fake(protocol.CpuShare):
        def __exit__(self, *exc):
            self.cores = next(shares)
            return False

    monkeypatch.setattr(protocol, "CpuShare", Fake)
    calls = []
    timing = protocol.time_calls(calls.append, {"timing": {"warmup_calls": 1, "timed_calls": 2}})
    assert calls == [0, 1000, 1001, 1000, 1001]
    assert timing.retries == 1 and timing.contended and len(timing.times_s) == 2


def _bench_record(tmp_path, what: str) -> dict:
    """The JSON record of `python -m sage_jax.bench <what> --workload tiny --json`."""
    env = dict(os.environ, PEERS_QUIET_WAIT_S="0", PEERS_MAX_RETRIES="0")
    env.pop("XLA_FLAGS", None)
    got = subprocess.run([sys.executable, "-m", "sage_jax.bench", what, "--workload", "tiny",
                          "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_sampler_benchmark_prints_one_json_record(tmp_path):
    rec = _bench_record(tmp_path, "sampler")
    assert rec["peer"] == "sage_jax" and rec["workload"] == "tiny"
    assert rec["batch"] == 16 * 8 and rec["new_tokens_per_seq"] == 128
    assert rec["tokens_per_s"] == pytest.approx(128 * 128 / rec["median_s"], rel=1e-3)
    assert len(rec["times_s"]) == 3 and rec["host_syncs"] >= 1 and rec["peak_rss_mb"] > 0


@pytest.mark.slow
def test_the_update_benchmark_prints_one_json_record(tmp_path):
    rec = _bench_record(tmp_path, "update")
    assert rec["peer"] == "sage_jax-update" and rec["workload"] == "tiny" and rec["padding_free"]
    assert rec["real_tokens"] > 0 and 0 <= rec["padding_share"] < 1
    assert rec["tokens_per_s"] > 0 and rec["peak_rss_mb"] > 0
