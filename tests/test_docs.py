"""The docs gate can fail: ``make docs``'s own mkdocs command, read from the Makefile, refuses a page
with a link to an anchor that does not exist (``--strict`` counts a warning only when it is
logged: with ``-q`` mkdocs 1.6 builds such a page and exits 0), and passes the pages as they are."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = Path(sys.executable).parent / "mkdocs"


def docs_command(config: Path, site: Path) -> list[str]:
    """The Makefile's ``docs`` recipe as argv, its config and site directory replaced."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("docs:"))
    recipe = next(line for line in lines[start + 1:] if "mkdocs" in line)
    args = shlex.split(recipe.split("mkdocs", 1)[1])
    for flag, value in (("-f", config), ("-d", site)):
        args[args.index(flag) + 1] = str(value)
    return [str(MKDOCS), *args]


@pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed beside this Python")
def test_make_docs_fails_on_a_broken_anchor_and_passes_the_pages(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("site"))
    ok = subprocess.run(docs_command(docs / "mkdocs.yml", tmp_path / "site"), capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    page = docs / "pages" / "index.md"
    page.write_text(page.read_text() + "\nSee [the router](fleet.md#no-such-section).\n")
    broken = subprocess.run(docs_command(docs / "mkdocs.yml", tmp_path / "site2"), capture_output=True, text=True,
                            timeout=300)
    assert broken.returncode != 0
    assert "no-such-section" in broken.stderr + broken.stdout
