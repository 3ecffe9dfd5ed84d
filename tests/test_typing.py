"""The package type-checks (mypy, as configured in setup.cfg)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow      # mypy over the package: `pytest -m "not slow"` leaves it out

pytest.importorskip("mypy")
ROOT = Path(__file__).resolve().parent.parent


def test_mypy_is_clean():
    out = subprocess.run([sys.executable, "-m", "mypy", "radixkv", "backends"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
