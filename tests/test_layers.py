"""The house's floors hold: the import-linter contracts of ``setup.cfg`` pass on the package as it
installs (``make lint`` runs the same in CI), a wrong-way import hidden in a function breaks them,
and no module is named like a standard-library module."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (the test extra)")


def _build(where: Path) -> Path:
    """The package as it installs (``backends/`` inside ``radixkv/``), assembled by build_py."""
    subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py", "-d", str(where)],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    return where


def _lint(where: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), str(ROOT / "setup.cfg")], cwd=where, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(where), "PATH": "/usr/bin:/bin"})


def test_the_contracts_hold_and_catch_a_wrong_way_import_in_a_function(tmp_path: Path) -> None:
    built = _build(tmp_path / "pkg")
    out = _lint(built)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "broken" in out.stdout and " 0 broken" in out.stdout, out.stdout
    # The same package with one lazy import from the core up into the factory above it.
    broken = tmp_path / "broken"
    shutil.copytree(built, broken)
    with open(broken / "radixkv" / "core" / "loads.py", "a") as f:
        f.write("\n\ndef _up() -> None:\n    from radixkv.config import load_config  # noqa: F401\n")
    out = _lint(broken)
    assert out.returncode != 0 and "radixkv.core.loads -> radixkv.config" in out.stdout, out.stdout


def test_the_contracts_hold_on_the_source_tree_too() -> None:
    """``lint-imports`` as a contributor runs it, in the repository root."""
    out = subprocess.run([str(LINT)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and " 0 broken" in out.stdout, out.stdout + out.stderr


def test_no_module_is_named_like_a_standard_library_module() -> None:
    names = {p.stem for p in (ROOT / "radixkv").rglob("*.py")} | {p.stem for p in (ROOT / "backends").glob("*.py")}
    clash = sorted(n for n in names if n in sys.stdlib_module_names and not n.startswith("_"))
    assert not clash, f"modules named like standard-library ones: {clash}"
