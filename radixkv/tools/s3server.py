"""moto's S3 server on 127.0.0.1 in a subprocess: the real S3 endpoint that radixkv's tests,
benchmarks and demo talk to over HTTP (no mocks of boto3).  Needs ``moto[server]`` (the test extra).

    with MotoServer() as server:
        client = server.client()            # boto3, endpoint_url=server.endpoint_url, test credentials
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["CREDENTIALS", "MotoServer", "free_port", "listen_port", "moto_with_bucket", "stop_process"]

_LAUNCH = ("import logging, sys; logging.getLogger('werkzeug').setLevel(logging.ERROR); "
           "from moto.server import main; main(sys.argv[1:])")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "radixkv-moto-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    """The OS's range of source ports for outgoing connections (Linux's default where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def listen_port(tries: int = 200) -> int:
    """A TCP port free on 127.0.0.1 right now and outside the OS's range of source ports, for an
    endpoint that a server binds only after its clients have started connecting to it (vLLM's KV
    event publisher connects to the router's endpoint from the start).  A port the OS picks
    (``free_port``) is from that range, so a client's outgoing connection, or its own reconnects to
    the unbound port (a TCP self-connect), can take it first: the bind then fails.  Random within
    1,024 up to the range's start (or above its end when that is empty); ``RuntimeError`` after
    ``tries`` ports taken.  O(tries)."""
    low, high = _ephemeral_range()
    lo, hi = (1024, low - 1) if low - 1 >= 1024 + 1000 else (high + 1, 65535)
    rng = random.Random()
    for _ in range(tries if lo <= hi else 0):
        port = rng.randint(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 outside the source ports {low}-{high} ({tries} tried)")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """End a server process: SIGCONT (a paused one cannot handle SIGTERM), SIGTERM, SIGKILL after
    5 s; wait for it.  Nothing if it already ended."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class MotoServer:
    """moto's S3 server in a subprocess on 127.0.0.1, for tests and benchmarks.

    ``start()`` waits until it answers; ``stop()`` ends it by its process handle (its objects are
    lost: moto keeps them in memory); ``pause()``/``resume()`` freeze it with SIGSTOP/SIGCONT, so
    connections hang as with a dead host and nothing is lost.  Werkzeug's request log is silenced;
    errors go to ``log_path`` (removed by ``__exit__``).  Usable as a context manager.  Not
    thread-safe.
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tempfile.gettempdir(), f"radixkv-moto-{self.port}.log")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> MotoServer:
        """Start the server (same port as before) and wait until it answers HTTP."""
        if self.process is not None:
            raise RuntimeError("the server is already running")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.endpoint_url + "/", timeout=1.0):
                    return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    with open(self.log_path, errors="replace") as f:
                        tail = f.read()[-2000:]
                    os.unlink(self.log_path)
                    raise RuntimeError(f"moto server did not start on {self.endpoint_url}:\n{tail}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """End the server process (SIGTERM, then SIGKILL after 5 s) and wait for it; its log is kept
        while it runs (and on a failed start, in the error).  Idempotent."""
        proc, self.process = self.process, None
        if proc is not None:
            stop_process(proc)

    def pause(self) -> None:
        """Freeze the server: the kernel still accepts connections, nothing answers them."""
        assert self.process is not None, "the server is not running"
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo ``pause``."""
        assert self.process is not None, "the server is not running"
        self.process.send_signal(signal.SIGCONT)

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (test credentials, path-style), with botocore
        ``Config`` keywords ``config``."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session(
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        ).client("s3", endpoint_url=self.endpoint_url, config=Config(s3={"addressing_style": "path"}, **config))

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if os.path.exists(self.log_path):
            os.unlink(self.log_path)


@contextmanager
def moto_with_bucket(bucket: str) -> Iterator[MotoServer]:
    """A started ``MotoServer`` holding an empty ``bucket``, with boto3's credential chain (the
    ``AWS_*`` environment variables) pointed at the test credentials meanwhile, for a test session."""
    saved = {name: os.environ.get(name) for name in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        with MotoServer() as server:
            server.client().create_bucket(Bucket=bucket)
            yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
