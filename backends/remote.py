"""What the remote tiers (``S3Tier``, ``RedisTier``) share: the circuit breaker, probes off the
request path, and call deadlines.

* ``CircuitBreaker``: closed -> open after failures in a row -> probed in the background -> closed
  (see its docstring); requests never pay for a probe.
* ``within``: run a call on a thread of its own and wait for it at most so long (a probe's bound).
* ``call_deadline``: a call's deadline, the caller's (``radixkv.backends.bounded``) or the tier's own.
* ``skip_all`` / ``SKIPPING`` / ``Skipped``: while the breaker is not closed a tier answers a call on
  its caller's thread with every request of it skipped (a miss, a put not made), without touching
  its worker pool or the network: ``skip_all`` runs the call that way, a request that sees
  ``SKIPPING`` set raises ``Skipped``, which the tier turns into its "skipped" answer.
"""

from __future__ import annotations

import contextvars
import logging
import random
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from radixkv.core._checks import check_int
from radixkv.backends import current_deadline

__all__ = ["PROBE_BOUND_S", "PROBE_CALLS", "SKIPPING", "CircuitBreaker", "Skipped", "call_deadline", "skip_all",
           "within"]

log = logging.getLogger(__name__)
T = TypeVar("T")

PROBE_CALLS = 3  # probe calls a breaker lets run at once (the ones past their bound, still stuck, and one)
_JITTER = 0.2     # each back-off is drawn from +-20% around its nominal value (then capped)


def within(fn: Callable[[], Any], timeout_s: float, name: str,
            on_timeout: Callable[[], Any] | None = None) -> BaseException | None:
    """Run ``fn()`` on a daemon thread of its own and wait at most ``timeout_s`` for it: ``None``
    if it returned, the exception it raised, or ``TimeoutError`` if it had not ended by then (then
    ``on_timeout()`` is called, to end it if it can, and it is left to end on its own).  Costs one
    thread start."""
    done = threading.Event()
    outcome: list[BaseException | None] = [TimeoutError(f"no answer within {timeout_s:g} s")]

    def run() -> None:
        try:
            fn()
            outcome[0] = None
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome[0] = e
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if done.wait(timeout_s):
        return outcome[0]
    if on_timeout is not None:
        try:
            on_timeout()
        except Exception:  # noqa: BLE001 - best effort: the call ends on its own otherwise
            pass
    return TimeoutError(f"no answer within {timeout_s:g} s")


class CircuitBreaker:
    """Closed -> open after ``failure_threshold`` failures in a row -> probed in the background
    after a back-off -> closed on a successful probe, or open again for a longer back-off.

    **Requests never pay for a probe.**  While the breaker is not closed, ``allow()`` answers
    ``False`` at once, on the caller's thread (the tier answers "skipped": a miss, a put not
    made), whatever the endpoint does.  Once the back-off has passed, the first ``allow()`` starts
    one probe on a background thread and still answers ``False``: ``probe`` (a callable that raises
    unless the endpoint answers: the S3 tier's ``HEAD`` of its bucket, the Redis tier's ``PING``),
    bounded by ``probe_timeout_s``.  One probe at a time (``"half_open"`` while it runs); a probe
    call still running past its bound is ended by ``cancel`` when one is given (the Redis tier
    closes the probe's connection), else left to end on its own, and a probe round finds at most
    ``PROBE_CALLS`` (3) of them running, else fails without a call, so a trickling endpoint cannot
    pile up threads.  A success closes the breaker; a failure (or no answer within the bound) opens
    it again with the back-off doubled, up to ``max_backoff_s``.  Each back-off is jittered (drawn
    within +-20% of its nominal value, and never over ``max_backoff_s``), so that instances sharing
    an endpoint do not probe it in step.  Without a ``probe`` (``set_probe``), the first request
    after the back-off is let through as the probe instead (``allow()`` is ``True`` once).

    **Defaults: ``backoff_s=1``, ``max_backoff_s=max(5, backoff_s)``.**  A probe is one cheap
    request made off the request path, so probing often costs requests nothing, and a short cap
    means the tier is used again within about 5 s (plus one probe) after a fault ends; while the
    fault lasts, an instance sends about one probe per 5 s.

    ``record(ok)`` reports a request the breaker allowed: failures count while it is closed, and
    outcomes are ignored otherwise (requests that were in flight when it opened), as are outcomes
    reported with an older ``epoch`` (it changes whenever the breaker opens or closes: a request
    that began before a fault and ends after it says nothing about the endpoint now).  Opening and
    closing are logged (a warning naming ``name``; a failed probe only at debug level).  All methods
    are O(1) (``allow`` may start a thread) and thread-safe; ``clock`` (monotonic seconds) is
    injectable for tests, and ``wait_probe`` waits for a background probe to end.

    >>> t, up = [0.0], threading.Event()
    >>> def ping() -> None:
    ...     if not up.is_set():
    ...         raise ConnectionError("no answer")
    >>> b = CircuitBreaker(failure_threshold=2, backoff_s=10, clock=lambda: t[0], probe=ping)
    >>> b.allow(), b.record(False), b.allow(), b.record(False), b.state
    (True, None, True, None, 'open')
    >>> b.allow()                       # skipped at once: no request, no timeout
    False
    >>> t[0] = 13.0; b.allow()          # the back-off passed: a probe starts, the request still skips
    False
    >>> b.wait_probe(10), b.state, b.opened     # it failed: open again, for about twice as long
    (True, 'open', 2)
    >>> up.set(); t[0] = 100.0; b.allow(), b.wait_probe(10), b.state
    (False, True, 'closed')
    >>> b.allow()
    True
    """

    def __init__(self, failure_threshold: int = 3, backoff_s: float = 1.0, max_backoff_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "S3 endpoint", *,
                 probe: Callable[[], Any] | None = None, probe_timeout_s: float = 2.0,
                 cancel: Callable[[], Any] | None = None) -> None:
        check_int(failure_threshold, "failure_threshold", 1)
        if not (isinstance(backoff_s, (int, float)) and backoff_s > 0):
            raise ValueError(f"backoff_s must be a positive number, got {backoff_s!r}")
        if max_backoff_s is None:
            max_backoff_s = max(5.0, backoff_s)
        if not (isinstance(max_backoff_s, (int, float)) and max_backoff_s >= backoff_s):
            raise ValueError(f"max_backoff_s must be a number >= backoff_s, got {max_backoff_s!r}")
        self.name = name  # for logs
        self.failure_threshold = failure_threshold
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self._clock = clock
        self._random = random.Random()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a background probe ends
        self._state = "closed"
        self._epoch = 0             # changes whenever the breaker opens or closes
        self._failures = 0          # consecutive, while closed
        self._backoff = self.backoff_s
        self._retry_at = 0.0        # while open: when the next probe may go
        self._probe: Callable[[], Any] | None = None
        self._cancel: Callable[[], Any] | None = None
        self.probe_timeout_s = 2.0
        self._probing = False       # a background probe round is running
        self._calls = 0             # probe calls running (a round's, and any past their bound)
        self.opened = 0             # times the breaker opened (for stats)
        self.probes = 0             # background probe rounds (for stats)
        if probe is not None:
            self.set_probe(probe, probe_timeout_s, cancel)

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"`` (a probe is in flight).  O(1)."""
        return self._state

    @property
    def epoch(self) -> int:
        """A number that changes whenever the breaker opens or closes (see ``record``).  O(1)."""
        return self._epoch

    @property
    def has_probe(self) -> bool:
        """Whether the breaker probes in the background (``set_probe``).  O(1)."""
        return self._probe is not None

    def set_probe(self, probe: Callable[[], Any], timeout_s: float, cancel: Callable[[], Any] | None = None) -> None:
        """Probe the endpoint with ``probe()`` (raises unless it answers), waiting at most
        ``timeout_s`` for it, then calling ``cancel()`` (if given) to end it.  A tier sets its own
        on a breaker it was given without one."""
        if not callable(probe):
            raise TypeError(f"probe must be callable, got {type(probe).__name__}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"probe timeout must be a positive number of seconds, got {timeout_s!r}")
        with self._lock:
            self._probe, self.probe_timeout_s, self._cancel = probe, float(timeout_s), cancel

    def allow(self) -> bool:
        """Whether a request may be sent now: only while closed (never waits).  Once the back-off
        has passed, starts the background probe.  ``True`` obliges the caller to ``record``."""
        with self._lock:
            if self._state == "closed":
                return True
            if self._state != "open" or self._clock() < self._retry_at:
                return False
            self._state = "half_open"
            if self._probe is None:
                return True  # no probe: this request is the probe
            self._probing = True
            self.probes += 1
        try:
            threading.Thread(target=self._probe_round, name="radixkv-probe", daemon=True).start()
        except RuntimeError:  # no thread (interpreter exit, limits): the probe failed; retried later
            self._probed(False)
        return False

    def _probe_round(self) -> None:
        """One background probe: ``probe()`` within ``probe_timeout_s``, unless too many earlier
        probe calls are still running."""
        ok = False
        try:
            with self._lock:
                probe, timeout_s, cancel = self._probe, self.probe_timeout_s, self._cancel
                start = probe is not None and self._calls < PROBE_CALLS
                if start:
                    self._calls += 1
            if start:
                assert probe is not None

                def call() -> None:
                    try:
                        probe()
                    finally:
                        with self._lock:
                            self._calls -= 1

                error = within(call, timeout_s, "radixkv-probe-call", cancel)
                ok = error is None
                if error is not None:
                    log.debug("%s: probe failed: %s", self.name, type(error).__name__)
        finally:
            self._probed(ok)

    def _probed(self, ok: bool) -> None:
        with self._lock:
            self._probing = False
            if self._state == "half_open":
                self._after_probe(ok)
            self._idle.notify_all()

    def _after_probe(self, ok: bool) -> None:
        # Lock held; half open.
        if ok:
            log.warning("%s answers again; back in use", self.name)
            self._state, self._failures, self._backoff = "closed", 0, self.backoff_s
            self._epoch += 1
        else:
            self._backoff = min(2 * self._backoff, self.max_backoff_s)
            self._open(quiet=True)

    def wait_probe(self, timeout: float | None = None) -> bool:
        """Wait until no background probe is running; whether none is (``False``: ``timeout``
        seconds passed first).  For tests and shutdown."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._probing, timeout)

    def record(self, ok: bool, epoch: int | None = None) -> None:
        """The outcome of an allowed request: ``ok`` when the endpoint answered (a 404 included).
        ``epoch``: the breaker's ``epoch`` when the request was allowed; outcomes of an older one
        are ignored."""
        with self._lock:
            if epoch is not None and epoch != self._epoch:
                return
            if self._state == "half_open" and not self._probing:  # a request stood in for the probe
                self._after_probe(ok)
            elif self._state == "closed":
                if ok:
                    self._failures = 0
                else:
                    self._failures += 1
                    if self._failures >= self.failure_threshold:
                        self._open()
            # open, or a background probe running: a request that was in flight when it opened.

    def record_failures(self, n: int, epoch: int | None = None) -> None:
        """``record(False, epoch)`` ``n`` times: requests given up on at their deadline."""
        for _ in range(n):
            self.record(False, epoch)

    def trip(self) -> None:
        """Open now, whatever the state (a tier that starts while its endpoint is not usable: its
        caller logs why): requests are skipped, and probed for after the back-off.  O(1)."""
        with self._lock:
            if self._state == "closed":
                self._open(quiet=True, why="not usable")

    def _open(self, quiet: bool = False, why: str = "still failing") -> None:
        # Lock held.
        was_closed = self._state == "closed"
        self._state, self._failures = "open", 0
        if was_closed:
            self._epoch += 1
        # +-20% around the nominal back-off, within the cap: at the cap, 80-100% of it (never in step)
        high = min(self.max_backoff_s, self._backoff * (1 + _JITTER))
        wait = self._random.uniform(self._backoff * (1 - _JITTER), high)
        self._retry_at = self._clock() + wait
        self.opened += 1
        if quiet:
            log.debug("%s %s; probed in %.1f s", self.name, why, wait)
        else:
            log.warning("%s failing; skipped (misses at once) and probed in the background, first in "
                        "%.1f s", self.name, wait)

    def check(self) -> None:
        """Assert the breaker's invariants.  O(1)."""
        with self._lock:
            assert self._state in ("closed", "open", "half_open"), f"unknown breaker state {self._state!r}"
            assert 0 <= self._failures < self.failure_threshold, f"{self._failures} failures while closed"
            assert self._state == "closed" or self._failures == 0, "failures counted while not closed"
            assert self.backoff_s <= self._backoff <= self.max_backoff_s, f"back-off {self._backoff} out of range"
            assert not self._probing or self._state == "half_open", "a background probe while not half open"
            assert 0 <= self._calls <= PROBE_CALLS, f"{self._calls} probe calls running"
            assert self.probes <= self.opened, "more probe rounds than times opened"


def call_deadline(timeout_s: float, calls: int = 1, concurrency: int = 1) -> float:
    """The deadline of a remote tier's call: the caller's (``radixkv.backends.bounded``), else
    ``timeout_s`` from now for each round of ``concurrency`` of its ``calls`` requests (a large
    batch gets its time).  O(1)."""
    deadline = current_deadline()
    rounds = -(-max(1, calls) // concurrency)
    return time.monotonic() + timeout_s * rounds if deadline is None else deadline


class Skipped(Exception):
    """The breaker refused the request: answer a miss without touching the network."""


# Set while a call runs on its caller's thread because the breaker is not closed: every request of
# it is skipped at once (the breaker is not asked again: it may close meanwhile, and a request made
# on the caller's thread would not be bounded by the pool's wait).
SKIPPING: contextvars.ContextVar[bool] = contextvars.ContextVar("radixkv_remote_skip", default=False)
PROBE_BOUND_S = 2.0  # a probe's bound at most: an endpoint slower than a request's default deadline is no use


def skip_all(fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
    """``fn(item)`` for each item on the caller's thread with ``SKIPPING`` set: every request of it
    raises ``Skipped`` at once (the breaker is not asked again: it may close meanwhile, and a
    request made on the caller's thread would not be bounded by the pool's wait).  O(items)."""
    token = SKIPPING.set(True)
    try:
        return [fn(item) for item in items]
    finally:
        SKIPPING.reset(token)
