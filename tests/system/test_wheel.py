"""The package works installed from a wheel into a fresh venv with `pip install <wheel>` alone,
away from the checkout: its dependencies are declared, its configs, the toy warm start and the
benchmark workloads ship inside it, so `python -m sage_jax.train` runs the default job to its
summary and plot, and `python -m sage_jax.bench` times the sampler, from any folder (no
../shared)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _sources(dst: Path) -> Path:
    """A copy of the package's sources (what git tracks), so the build writes nothing here."""
    files = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "sage_jax"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dst / f)
    return dst


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv where `pip install <wheel>` installed sage_jax and the
    dependencies it declares, from the package index; a folder outside the checkout)."""
    base = tmp_path_factory.mktemp("wheel")
    src = _sources(base / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(base / "dist"), str(src)], check=True)
    wheel = next((base / "dist").glob("sage_jax-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "sage_jax/configs/toy.yaml" in names
    assert "sage_jax/tasks/toy/toy_sft/model.safetensors" in names
    assert "sage_jax/tasks/toy/toy_tail_sft/model.safetensors" in names
    assert "sage_jax/engine/sampler/cpu_attention.cc" in names  # built on first use, from the wheel
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True)
    work = base / "elsewhere"
    work.mkdir()
    return python, work


def _run(installed, *args, timeout=600, **env_vars):
    python, work = installed
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as a user has
    env.update(env_vars)
    return subprocess.run([str(python), "-m", *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_the_installed_package_is_the_wheel(installed):
    got = _run(installed, "sage_jax.train", "--help")
    assert got.returncode == 0, got.stderr
    assert "python -m sage_jax.train" in got.stdout
    where = subprocess.run([str(installed[0]), "-c", "import sage_jax; print(sage_jax.__file__)"],
                           cwd=installed[1], capture_output=True, text=True, check=True)
    assert str(REPO) not in where.stdout and "site-packages" in where.stdout


def test_the_default_job_runs_to_its_summary_from_an_installed_wheel(installed):
    """The default job (gate, RL, no-hint evaluation, summary and plot), shrunk to 2 steps."""
    got = _run(installed, "sage_jax.train", "--workdir", "run", "train.steps=2",
               "task.toy.calibrate_per_length=1", "task.toy.eval_per_length=1",
               "task.toy.eval_samples=1", "rl.prompts_per_step=2", "rl.group_size=2",
               "eval.every=0", "train.samples_every=0",
               SAGE_JAX_KERNEL_CACHE=str(installed[1].parent / "kernels"))
    assert got.returncode == 0, got.stderr[-3000:]
    assert "warm start: the shipped SFT model" in got.stdout
    assert "CPU decode attention: C++ kernel" in got.stdout  # built from the wheel's source
    assert list((installed[1].parent / "kernels").glob("cpu_attention-*.so"))
    run = installed[1] / "run"
    assert (run / "checkpoints" / "2").is_dir()
    assert (run / "metrics.jsonl").read_text().count("\n") == 2
    assert "hint source:" in (run / "summary.md").read_text()
    assert (run / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sampler_benchmark_runs_from_an_installed_wheel(installed):
    assert not (installed[1].parent / "shared").exists()
    got = _run(installed, "sage_jax.bench", "sampler", "--workload", "tiny", "--json",
               PEERS_QUIET_WAIT_S="0", PEERS_MAX_RETRIES="0")
    assert got.returncode == 0, got.stderr[-3000:]
    rec = json.loads(got.stdout.strip().splitlines()[-1])
    assert rec["peer"] == "sage_jax" and rec["workload"] == "tiny" and rec["batch"] == 128
    assert rec["tokens_per_s"] > 0 and rec["host_syncs"] >= 1
