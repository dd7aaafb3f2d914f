"""The type checker (pyright, pinned in requirements-test.txt, configured by pyproject.toml's
[tool.pyright]) reports no error on the layers below the run: core/, engine/, rl/, run/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_pyright_reports_no_error_on_the_typed_layers():
    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if pyright is None:
        pytest.skip("pyright is not installed (pip install -r requirements-test.txt)")
    got = subprocess.run([pyright, "--pythonpath", sys.executable], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert got.returncode == 0 and "0 errors" in got.stdout, got.stdout[-6000:]
