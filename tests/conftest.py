"""Shared test fixtures: paths to ../shared/data and CPU-only JAX."""

import os
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
