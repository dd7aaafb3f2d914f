"""MetricsLogger / read_metrics / Timer: JSONL content, resume truncation, samples, progress bar."""

import io
import json
import math
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.infra.metrics import MetricsLogger, Timer, read_metrics, to_json_value


def test_jsonl_content_and_conversions(tmp_path):
    stream = io.StringIO()  # not a TTY
    with MetricsLogger(tmp_path, total_steps=3, tensorboard=False, stream=stream) as ml:
        ml.log(1, {
            "reward/mean": jnp.float32(0.25),
            "collapse/frac_all_zero": np.float64(0.5),
            "throughput/tokens_per_s": jnp.array([1234.5]),  # 1-element array
            "loss": float("nan"),
            "grad_norm": jnp.float32(jnp.inf),
            "count": jnp.int32(7),
            "ok": np.bool_(True),
            "method": "sage",
        })
        ml.log(2, {"reward/mean": 0.5, "loss": jnp.bfloat16(1.5)})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])  # standard JSON: no NaN/Infinity tokens
    assert "NaN" not in lines[0] and "Infinity" not in lines[0]
    assert first == {
        "step": 1, "reward/mean": 0.25, "collapse/frac_all_zero": 0.5,
        "throughput/tokens_per_s": 1234.5, "loss": None, "grad_norm": None,
        "count": 7, "ok": True, "method": "sage",
    }
    assert isinstance(first["count"], int)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert math.isnan(rows[0]["loss"]) and rows[1]["loss"] == 1.5
    out = stream.getvalue()  # the bar rendered to a non-TTY stream without crashing
    assert "reward=0.500" in out and "2/3" in out


def test_bad_metric_values_are_named():
    with pytest.raises(ValueError, match="'acc' must be a scalar.*shape \\(2,\\)"):
        to_json_value(np.zeros(2), name="acc")
    with pytest.raises(ValueError, match="'obj': unsupported type"):
        to_json_value(object(), name="obj")


def test_resume_truncates_to_resume_step(tmp_path):
    with MetricsLogger(tmp_path, total_steps=10, tensorboard=False, progress=False) as ml:
        for s in range(1, 7):
            ml.log(s, {"x": s})
            ml.log_samples(s, [{"text": f"s{s}", "reward": 1.0}])
    # A crash can tear the last line.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "x"')
    with MetricsLogger(tmp_path, total_steps=10, tensorboard=False, progress=False, resume_step=4) as ml:
        for s in range(5, 9):
            ml.log(s, {"x": 10 * s})
        ml.log_samples(5, [{"text": "new"}])
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["x"] for r in rows] == [1, 2, 3, 4, 50, 60, 70, 80]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["text"]) for r in samples] == [(1, "s1"), (2, "s2"), (3, "s3"), (4, "s4"), (5, "new")]


def test_samples_file(tmp_path):
    with MetricsLogger(tmp_path, total_steps=1, tensorboard=False, progress=False) as ml:
        ml.log_samples(3, [
            {"prompt": "1+1", "answer": "\\boxed{2}", "reward": np.float32(1.0), "level": jnp.int8(2),
             "tokens": [1, 2, 3]},
            {"prompt": "2+2", "answer": "5", "reward": 0.0, "level": 0, "tokens": []},
        ])
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 3, "prompt": "1+1", "answer": "\\boxed{2}", "reward": 1.0, "level": 2, "tokens": [1, 2, 3]},
        {"step": 3, "prompt": "2+2", "answer": "5", "reward": 0.0, "level": 0, "tokens": []},
    ]


def test_non_main_process_writes_nothing(tmp_path):
    ml = MetricsLogger(tmp_path / "run", total_steps=5, is_main=False)
    ml.log(1, {"reward/mean": 1.0})
    ml.log_samples(1, [{"a": 1}])
    ml.close()
    assert not (tmp_path / "run").exists() and ml.tb is None and ml.bar is None


def test_tensorboard_when_available(tmp_path, monkeypatch):
    calls = []

    class FakeWriter:
        def __init__(self, logdir):
            calls.append(("init", logdir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=FakeWriter))
    ml = MetricsLogger(tmp_path, total_steps=2, progress=False)
    assert isinstance(ml.tb, FakeWriter)
    ml.log(1, {"reward/mean": 0.5, "method": "grpo", "loss": float("nan")})
    ml.close()
    assert calls == [("init", str(tmp_path / "tb")), ("reward/mean", 0.5, 1), ("close",)]
    # Disabled on request.
    assert MetricsLogger(tmp_path, total_steps=2, progress=False, tensorboard=False).tb is None


def test_progress_bar_console_line_without_tty(tmp_path, capsys):
    ml = MetricsLogger(tmp_path, total_steps=4, tensorboard=False, console_every=2)
    for s in range(1, 5):  # past total_steps is harmless too
        ml.log(s, {"reward/mean": 0.1 * s, "collapse/frac_all_zero": 0.5, "throughput/tokens_per_s": 100.0})
    ml.log(5, {})
    ml.close()
    err = capsys.readouterr().err
    assert "step 2/4 reward=0.200 collapse=0.50 tok/s=100" in err
    assert "step 4/4" in err


def test_timer():
    timer = Timer()
    with timer("sample"):
        pass
    with timer("sample"):
        pass
    with pytest.raises(RuntimeError):
        with timer("update"):
            raise RuntimeError("boom")  # still recorded
    m = timer.metrics()
    assert set(m) == {"time/sample_s", "time/update_s"} and all(v >= 0 for v in m.values())
    assert timer.metrics() == {}
