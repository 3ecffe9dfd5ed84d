"""Every ``python -m radixkv.bench NAME`` answers a bad flag, or an ``--out`` with no folder to write
in, with one line naming it and exit status 2: never a usage block, never a traceback, never a run
that fails at its end (in process: each command's parser, nothing run)."""

from __future__ import annotations

import importlib

import pytest

from radixkv.bench.__main__ import _MODULES, BENCHMARKS, main


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_bad_flag_is_one_line_and_exit_2(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        importlib.import_module(f"radixkv.bench.{_MODULES.get(name, name)}")
    except ImportError as exc:              # an optional dependency this install lacks
        pytest.skip(f"radixkv.bench.{name}: {exc}")
    assert main([name, "--no-such-flag"]) == 2
    out = capsys.readouterr()
    assert "--no-such-flag" in out.err and out.err.count("\n") == 1 and not out.out, out
    # a report with nowhere to go is refused before the run, not after it (radixkv.bench.out_file)
    assert main([name, "--out", "/no/such/folder/report.txt"]) == 2
    out = capsys.readouterr()
    assert "--out" in out.err and out.err.count("\n") == 1 and not out.out, out


def test_an_unknown_benchmark_is_named_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert "fleet_sim" in capsys.readouterr().out


def test_the_blend_task_run_as_a_script_answers_a_bad_flag_in_one_line() -> None:
    """``python -m radixkv.bench.blend_task`` is run directly (it trains the blend model), not
    through the dispatcher above."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "radixkv.bench.blend_task", "--no-such-flag"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--no-such-flag" in out.stderr and out.stderr.count("\n") == 1, out
