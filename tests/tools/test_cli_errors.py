"""Every ``python -m radixkv`` command answers bad input with one line on stderr naming the problem
and a non-zero exit status, never a traceback: a missing, unreadable or malformed configuration,
an unknown key, a tier that cannot be opened, a wrong flag or value.  Each command is driven with
each kind of bad input it can be given through ``radixkv.tools.cli.main``, the function the entry
point calls (an exception escaping it is what a user would see as a traceback; a log record of
warning or above is a line a user's stderr would show, as no handler is configured); and each
command once in a process of its own, as a user runs it (an interpreter importing torch costs
about 2.5 s here, which every case paid when each had its own)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from radixkv.tools.cli import main

pytestmark = pytest.mark.slow      # every command with every bad input: `pytest -m "not slow"` leaves it out

LAYOUT = "layout: {num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype: float16}\n"
GOOD = "chunk_size: 64\npage_size: 16\nnum_pages: 64\nnamespace: {model: m}\n" + LAYOUT


def _files(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (configuration path, a word the error line must contain)."""
    garbage = tmp / "garbage-lmdb"
    garbage.mkdir()
    (garbage / "data.mdb").write_bytes(b"not an LMDB environment" * 100)
    cases = {
        "missing": (str(tmp / "absent.yaml"), "no such file"),
        "a directory": (str(tmp), "not a file"),
        "YAML syntax": ("bad.yaml", "line 2"),
        "JSON syntax": ("bad.json", "line 1"),
        "a python tag": ("tag.yaml", "python"),
        "a list": ("list.yaml", "not a mapping"),
        "an unknown key": ("unknown.yaml", "chunk_sise"),
        "a wrong suffix": ("config.txt", ".yaml"),
        "an LMDB tier that cannot be opened": ("lmdb.yaml", "local_disk"),
        "a local_disk that is a file": ("file.yaml", "is a file"),
    }
    texts = {
        "bad.yaml": "chunk_size: [64\nlocal_cpu: true\n",
        "bad.json": '{"chunk_size": 64,}',
        "tag.yaml": "!!python/object/apply:os.system ['echo owned']\n",
        "list.yaml": "- 1\n- 2\n",
        "unknown.yaml": GOOD + "chunk_sise: 64\n",
        "config.txt": GOOD,
        "lmdb.yaml": GOOD + f"local_disk: {garbage}\nmax_local_disk_size: 0.01\n"
                     "remote_url: s3://radixkv-cli/kv\nremote_endpoint: http://127.0.0.1:9\n",
        "file.yaml": GOOD + f"local_disk: {garbage / 'data.mdb'}\nmax_local_disk_size: 0.01\n",
    }
    for name, text in texts.items():
        (tmp / name).write_text(text)
    return {k: (p if p.startswith("/") else str(tmp / p), word) for k, (p, word) in cases.items()}


def _process(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m radixkv ARGS`` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "radixkv", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``python -m radixkv ARGS`` as the entry point runs it, in this process: its status, its
    stdout, and its stderr with a line for each record logged at warning or above."""
    def call(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            status = main(list(args))
        out = capsys.readouterr()
        logged = "".join(f"{r.levelname}: {r.getMessage()}\n" for r in caplog.records if r.levelno >= logging.WARNING)
        return subprocess.CompletedProcess(list(args), status, out.out, out.err + logged)
    return call


def _one_line(out: subprocess.CompletedProcess[str], word: str) -> None:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0, (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert word.lower() in lines[0].lower(), (word, lines[0])


@pytest.mark.parametrize("command", ["inspect", "warm", "controller"])
@pytest.mark.parametrize("case", ["missing", "a directory", "YAML syntax", "JSON syntax", "a python tag", "a list",
                                  "an unknown key", "a wrong suffix", "an LMDB tier that cannot be opened",
                                  "a local_disk that is a file"])
def test_each_command_names_what_is_wrong_with_its_configuration(tmp_path: Path, command: str, case: str,
                                                                 run: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    path, word = _files(tmp_path)[case]
    if command == "controller":
        if case in ("an unknown key", "an LMDB tier that cannot be opened", "a local_disk that is a file"):
            pytest.skip("the controller reads only the secret of the file: its other keys are the engines'")
        out = run("controller", "--bind", "tcp://127.0.0.1:0", "--config", path)
    else:
        out = run(command, "--config", path)
    _one_line(out, word)
    assert "owned" not in out.stdout            # a YAML tag never runs code


@pytest.mark.parametrize("args,word", [
    (["nosuch"], "invalid choice"),
    (["inspect"], "--config"),
    (["inspect", "--config"], "expected one argument"),
    (["warm", "--config", "x.yaml", "--max-bytes", "lots"], "--max-bytes"),
    (["replay", "--requests", "many"], "--requests"),
    (["replay", "--requests", "5", "--seed", "-1"], "seed"),
    (["route", "--backend", "http://127.0.0.1:9", "--port", "99999"], "--port"),
    (["route", "--policy", "best"], "--policy"),
    (["route", "--backend", "http://127.0.0.1:9", "--events", "tcp://127.0.0.1:0", "--events", "tcp://127.0.0.1:0"],
     "--events"),
    (["controller"], "--bind"),
    (["build-ext", "--lock-timeout", "soon"], "--lock-timeout"),
    (["demo", "--system-tokens", "lots"], "--system-tokens"),
])
def test_each_command_names_a_wrong_flag_or_value(args: list[str], word: str,
                                                  run: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    _one_line(run(*args), word)


@pytest.mark.parametrize("args,case,word", [
    (["inspect"], "YAML syntax", None),
    (["warm"], "an LMDB tier that cannot be opened", None),
    (["controller", "--bind", "tcp://127.0.0.1:0"], "a python tag", None),
    (["route", "--policy", "best"], None, "--policy"),
    (["nosuch"], None, "invalid choice"),
])
def test_in_a_process_of_its_own_each_command_prints_one_line_and_exits_non_zero(
        tmp_path: Path, args: list[str], case: str | None, word: str | None) -> None:
    """What the in-process cases stand for: the interpreter's own stderr (the entry point, import
    time, the log records no test handler catches) holds the one line, and the status is not 0.
    ``case``: a configuration of ``_files`` given as ``--config`` (its word then names the
    problem); else ``word``."""
    if case is not None:
        path, word = _files(tmp_path)[case]
        args = [*args, "--config", path]
    assert word is not None
    out = _process(*args)
    _one_line(out, word)
    assert "owned" not in out.stdout


def test_warm_names_a_malformed_prompts_file(tmp_path: Path, run: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    _files(tmp_path)
    cfg = tmp_path / "warm.yaml"
    cfg.write_text(GOOD + f"local_disk: {tmp_path / 'disk'}\nmax_local_disk_size: 0.01\n"
                   "remote_url: s3://radixkv-cli/kv\nremote_endpoint: http://127.0.0.1:9\nremote_timeout: 0.5\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2, 3]\n{not json\n")
    _one_line(run("warm", "--config", str(cfg), "--prompts", str(prompts), "--no-progress"), "prompts")
