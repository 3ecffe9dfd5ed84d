"""Following a fleet's event streams into one ``Index``: the loop between ``Subscriber`` and ``Index``.

``Follower`` subscribes to each instance's KV-event stream (vLLM's or radixkv's,
``radixkv.fleet.events``), applies every batch to a shared ``radixkv.fleet.Index`` on one
background thread, and answers lookups from any thread.

Contract:

* **Streams.**  ``add(instance, endpoint, replay_endpoint=..., bind=...)`` follows one more
  instance (``bind``: see ``Subscriber``; a vLLM instance given an endpoint without a wildcard
  connects to it, so its follower binds); ``remove(instance)`` stops and forgets it (its holdings
  leave the index).  Instances may come and go while the thread runs.
* **Gaps.**  ``Subscriber`` asks the replay socket for what a gap hides; what it cannot get leaves
  the instance *stale* in the index (its batches past the gap wait).  A stale instance that stays
  so for ``gap_timeout_s`` is reset (``Index.skip_gap``: its holdings dropped, so the index holds
  a subset of the truth: misses, never false hits) and goes on.  A restarted publisher (sequence
  numbers from 0 again) is a restart in the index, counted per instance (``restarts``).
* **Threads and waits.**  One thread polls every subscriber (``poll_s`` at most per round, so
  ``close`` waits at most about that, bounded by ``timeout``); the index is guarded by one lock,
  which ``lookup`` takes for O(matched blocks + instances).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Hashable, Iterable

from radixkv.fleet.events import Subscriber
from radixkv.fleet.index import Index, Match

__all__ = ["Follower"]

log = logging.getLogger(__name__)


class Follower:
    """Keeps ``index`` (a new ``Index`` by default) up to date with the streams of the instances
    ``add``ed (see the module docstring).  Counters: ``batches`` applied, ``gaps_skipped``."""

    def __init__(self, index: Index | None = None, *, gap_timeout_s: float = 2.0, poll_s: float = 0.05) -> None:
        for name, value in (("gap_timeout_s", gap_timeout_s), ("poll_s", poll_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.index = index if index is not None else Index()
        self.gap_timeout_s, self.poll_s = float(gap_timeout_s), float(poll_s)
        self.lock = threading.Lock()
        self._subs: dict[str, Subscriber] = {}
        self._stale_since: dict[str, float] = {}
        self._closing: list[Subscriber] = []
        self.batches = self.gaps_skipped = 0
        self._running = False
        self._thread: threading.Thread | None = None

    def add(self, instance: str, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
            bind: bool = False) -> None:
        """Follow ``instance``'s stream at ``endpoint`` (replacing an older subscription of it).
        Raises what ``Subscriber`` raises for a bad endpoint.  O(1)."""
        if not isinstance(instance, str) or not instance:
            raise TypeError(f"instance must be a non-empty str, got {instance!r}")
        sub = Subscriber(endpoint, replay_endpoint=replay_endpoint, topic=topic, bind=bind)
        with self.lock:
            old = self._subs.pop(instance, None)
            if old is not None:
                self._closing.append(old)
            self._subs[instance] = sub

    def remove(self, instance: str) -> None:
        """Stop following ``instance`` and drop its holdings from the index.  O(blocks it held)."""
        with self.lock:
            sub = self._subs.pop(instance, None)
            if sub is not None:
                self._closing.append(sub)
            if instance in self.index.instances():
                self.index.remove(instance)
            self._stale_since.pop(instance, None)

    def restarts(self, instance: str) -> int:
        """How many times ``instance``'s publisher was seen to restart (its sequence numbers from
        0 again: the engine came back) on its current subscription; 0 for an instance not
        followed.  The router reads its pool again when this changes.  O(1)."""
        with self.lock:
            sub = self._subs.get(instance)
            return 0 if sub is None else int(sub.restarts)

    def lookup(self, block_hashes: Iterable[Hashable]) -> dict[str, Match]:
        """``Index.lookup`` under the lock (stale instances left out).  O(matched blocks + instances)."""
        hashes = list(block_hashes)
        with self.lock:
            return self.index.lookup(hashes)

    def lookup_spread(self, block_hashes: Iterable[Hashable]) -> dict[str, Any]:
        """``Index.lookup_spread`` under the lock (stale instances left out).  O(matched blocks x
        instances)."""
        hashes = list(block_hashes)
        with self.lock:
            return self.index.lookup_spread(hashes)

    def poll(self, timeout: float = 0.0) -> int:
        """Apply what every stream has now (waiting up to ``timeout`` seconds in all for the first
        message); the number of batches applied.  What the thread does each round; call it
        directly instead of ``start`` to drive the index from one's own loop."""
        with self.lock:
            self._close_replaced()
            subs = list(self._subs.items())
        applied = 0
        per = timeout / max(len(subs), 1)
        for instance, sub in subs:
            try:
                got = sub.recv(timeout=per)
                while got:
                    with self.lock:
                        if self._subs.get(instance) is not sub:
                            break
                        for seq, batch in got:
                            self.index.apply(instance, seq, batch)
                    applied += len(got)
                    got = sub.recv(timeout=0)
            except Exception:  # noqa: BLE001 - one bad stream must not stop the others
                log.exception("radixkv: following %s failed; its stream is skipped this round", instance)
            self._check_gap(instance)
        self.batches += applied
        return applied

    def _check_gap(self, instance: str) -> None:
        now = time.monotonic()
        with self.lock:
            if instance not in self.index.instances() or not self.index.stale(instance):
                self._stale_since.pop(instance, None)
                return
            since = self._stale_since.setdefault(instance, now)
            if now - since >= self.gap_timeout_s:
                self.index.skip_gap(instance)
                self._stale_since.pop(instance, None)
                self.gaps_skipped += 1
                log.warning("radixkv: %s's KV events had a gap no replay filled; its holdings were reset", instance)

    def _close_replaced(self) -> None:
        for sub in self._closing:
            sub.close()
        self._closing.clear()

    def start(self) -> Follower:
        """Run ``poll`` on a daemon thread until ``close``; returns self."""
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._run, name="radixkv-follower", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while self._running:
            self.poll(self.poll_s)
            if not self._subs:
                time.sleep(self.poll_s)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread (waiting at most ``timeout``) and close every subscription."""
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self.lock:
            self._closing.extend(self._subs.values())
            self._subs.clear()
            self._close_replaced()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def check(self) -> None:
        """``Index.check`` under the lock, and that every followed instance has a subscription."""
        with self.lock:
            self.index.check()
            assert set(self._stale_since) <= set(self._subs), "a gap timer for an instance not followed"
