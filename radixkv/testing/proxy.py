"""A loopback TCP proxy that makes a healthy server slow or trickling, on demand: the faults a
deadline must bound (a per-read socket timeout does not: a trickle of bytes keeps every read short).

    with FaultyProxy(("127.0.0.1", server_port)) as proxy:
        tier = S3Tier(..., endpoint_url=proxy.url)     # or RedisTier(f"redis://127.0.0.1:{proxy.port}")
        proxy.mode = "slow"       # every piece of an answer (as the server sends it, up to 64 KiB)
                                  # waits ``delay_s`` before it is forwarded
        proxy.mode = "trickle"    # answers are forwarded ``trickle_bytes`` every ``trickle_interval_s``
        proxy.mode = "throttle"   # answers share a link of ``rate_bytes_s`` bytes a second (all
                                  # connections together), as behind a slower network
        proxy.mode = "pass"       # back to normal (for new data; what is already trickling goes on)

Requests go to the server unchanged; only the answers are delayed.  Binds 127.0.0.1 only; every
thread is a daemon and ``close()`` ends the listener and every connection.
``timed_requests`` runs a request's lookup and load under one deadline, as an engine does, and
says how long the slowest took: what a test of a deadline asserts on.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Sequence

__all__ = ["FaultyProxy", "timed_requests"]

_MODES = ("pass", "slow", "trickle", "throttle")
_PIECE = 16384        # bytes a throttled answer is sent in
_SLACK_S = 0.005      # how far behind its schedule a throttled link may catch up (a burst of 5 ms)


class FaultyProxy:
    """Forward connections on 127.0.0.1:``port`` to ``target``, answers shaped by ``mode``."""

    def __init__(self, target: tuple[str, int], *, mode: str = "pass", delay_s: float = 0.4,
                 trickle_bytes: int = 16, trickle_interval_s: float = 0.7, rate_bytes_s: float = 100e6) -> None:
        self.target = target
        self.rate_bytes_s = rate_bytes_s
        self._link_free_at = 0.0          # throttle: when the shared link has sent what it was given
        self.mode = mode
        self.delay_s = delay_s
        self.trickle_bytes = trickle_bytes
        self.trickle_interval_s = trickle_interval_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="radixkv-proxy", daemon=True).start()

    @property
    def mode(self) -> str:
        """``"pass"``, ``"slow"`` or ``"trickle"``; may change at any time."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {value!r}")
        self._mode = value

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5.0)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while not self._closed:
                data = src.recv(65536)
                if not data:
                    break
                if answers and self._mode == "slow":
                    time.sleep(self.delay_s)
                if answers and self._mode == "throttle":
                    for i in range(0, len(data), _PIECE):
                        piece = data[i:i + _PIECE]
                        with self._lock:      # each piece takes its turn on the one link
                            now = time.monotonic()
                            # the link's own schedule, caught up by at most _SLACK_S when this thread
                            # ran late (a sleep's wake-up, the copy): the rate holds on average
                            self._link_free_at = (max(now - _SLACK_S, self._link_free_at)
                                                  + len(piece) / self.rate_bytes_s)
                            wait = self._link_free_at - now
                        if wait > 0:
                            time.sleep(wait)
                        dst.sendall(piece)
                    continue
                if answers and self._mode == "trickle":
                    for i in range(0, len(data), self.trickle_bytes):
                        if self._closed:
                            return
                        dst.sendall(data[i:i + self.trickle_bytes])
                        time.sleep(self.trickle_interval_s)
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop listening and close every connection.  Idempotent."""
        self._closed = True
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> FaultyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def timed_requests(stack: Any, refs: Sequence[Any], deadline_s: float, rounds: int = 3) -> list[float]:
    """Seconds each of ``rounds`` requests took: ``stack.lookup`` of ``refs``' keys, then
    ``stack.load`` of what it found, both under one deadline ``deadline_s`` from the start (a
    ``radixkv.TierStack``, or anything with its ``lookup``/``load``)."""
    times = []
    for _ in range(rounds):
        t0 = time.monotonic()
        deadline = t0 + deadline_s
        where = stack.lookup([r.key for r in refs], deadline=deadline)
        stack.load(list(refs)[:len(where)], where=where, deadline=deadline)
        times.append(time.monotonic() - t0)
    return times
