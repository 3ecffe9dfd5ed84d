"""A real ``redis-server`` on 127.0.0.1 in a subprocess, for tests and benchmarks (no mocks).

The binary is Debian's ``redis-server`` package (``apt-get install redis-server``; Valkey's
``valkey-server`` is used when that is what is installed)::

    with RedisServer(maxmemory=2 << 20) as server:
        tier = RedisTier(server.url)

Nothing is persisted (``--save ''``, no AOF); the server logs only warnings, to a file removed by
``__exit__``.  ``kill()`` ends it with SIGKILL (a crash); ``start()`` again on the same port brings
it back, empty.  Not thread-safe.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from radixkv.tools.s3server import free_port, stop_process

__all__ = ["RedisServer", "redis_server_binary"]


def redis_server_binary() -> str | None:
    """The path of ``redis-server`` (or ``valkey-server``), or ``None`` if neither is installed."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


class RedisServer:
    """``redis-server`` on 127.0.0.1:``port`` (free by default), with ``maxmemory`` bytes and
    ``policy`` as its eviction policy when given.  ``url`` is ``redis://127.0.0.1:<port>/0``."""

    def __init__(self, port: int | None = None, maxmemory: int | None = None, policy: str = "allkeys-lru") -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.maxmemory = maxmemory
        self.policy = policy
        self.dir = tempfile.mkdtemp(prefix="radixkv-redis-")
        self.log_path = os.path.join(self.dir, "redis.log")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> RedisServer:
        """Start the server (same port as before) and wait until it answers ``PING``."""
        if self.process is not None:
            raise RuntimeError("the server is already running")
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--logfile", self.log_path, "--loglevel", "warning", "--daemonize", "no"]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = open(self.log_path, errors="replace").read()[-2000:] if os.path.exists(self.log_path) else ""
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")
            time.sleep(0.05)
        return self

    def ping(self) -> bool:
        """Whether the server answers ``PING`` within a second."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """End the server with SIGKILL, as a crash would (its data is lost)."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        """End the server (SIGTERM, SIGKILL after 5 s) and wait for it.  Idempotent."""
        proc, self.process = self.process, None
        if proc is not None:
            stop_process(proc)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
