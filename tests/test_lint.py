"""The code base stays clean under the project's ruff settings (pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the test extra")
def test_ruff_passes():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "visppo", "envs", "tests", "tools"],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]
