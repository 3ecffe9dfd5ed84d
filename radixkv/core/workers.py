"""The pool of worker threads a remote tier waits on, with a wait that ends at a deadline.

``BoundedPool`` runs each call in a copy of the caller's context (so the bounds of
``radixkv.core.deadline`` hold on the worker), and ``gather`` returns at the deadline with what
finished; a worker stuck past it is retired, not waited for.
"""

from __future__ import annotations

import contextvars
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait_futures
from typing import Any, Callable, Sequence, TypeVar

from radixkv.core.deadline import DeadlineExceeded

__all__ = ["BoundedPool"]

T = TypeVar("T")


class BoundedPool:
    """The worker threads of a remote tier (made on first use, ``size`` of them), and a wait on
    them that ends at a deadline.

    ``submit`` runs each call in a copy of the caller's context (so ``current_deadline`` holds in
    the worker), or on the calling thread when that is one of the pool's own (a task that waited
    on tasks queued behind it could deadlock the pool).  ``gather`` waits for the futures until
    the deadline; what did not finish by then is abandoned — cancelled if it had not started, else
    left to end on its own (its socket timeouts bound it, but a trickling answer keeps every read
    short and can hold it for as long as it trickles) — and counted through ``on_abandon``.

    **Abandoned calls do not clog the pool.**  When a running call is abandoned, the pool retires
    its executor (shut down without waiting: its threads end as their calls do, and what was queued
    on it still runs there or is cancelled by its own caller) and later calls get a fresh one, so
    that a fault that ended leaves no stuck thread between the next request and the endpoint.  One
    retired executor at a time: while one still has unfinished calls (``stuck``), the pool keeps
    its executor, and later calls may wait behind abandoned ones (their own deadline still bounds
    them; a tier's breaker keeps requests away meanwhile).  So a pool never has more than
    ``2 * size`` threads, and at most ``size`` of them stuck.  Thread-safe.
    """

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._closed = False
        # Calls submitted and not yet finished (or cancelled), per executor: the current one's, and
        # the retired one's until they are all done.
        self._unfinished: dict[ThreadPoolExecutor, int] = {}
        self.retired = 0  # executors retired because abandoned calls held their threads (for stats)

    def _executor(self) -> ThreadPoolExecutor:
        # Lock held.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.size, thread_name_prefix=self.name,
                                            initializer=setattr, initargs=(self._local, "active", True))
        return self._pool

    def warm(self) -> None:
        """Start every worker thread now, from a background thread, so that the first calls do not
        pay for thread starts (slow on a loaded machine) out of their deadline.  Returns at once."""
        def start_all() -> None:
            with self._lock:
                if self._closed or self._pool is not None:
                    return
                pool = self._executor()
            gate = threading.Barrier(self.size)  # each start task holds its thread until all started

            def hold() -> None:
                try:
                    gate.wait(timeout=1.0)
                except threading.BrokenBarrierError:
                    pass

            for _ in range(self.size):
                try:
                    pool.submit(hold)
                except RuntimeError:  # closed or retired meanwhile
                    gate.abort()
                    return

        threading.Thread(target=start_all, name=f"{self.name}-warm", daemon=True).start()

    def on_worker(self) -> bool:
        """Whether the calling thread is one of the pool's workers."""
        return bool(getattr(self._local, "active", False))

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on a worker (inline on a worker's own thread), in the caller's context."""
        if self.on_worker():
            done: Future[T] = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                done.set_exception(e)
            return done
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            pool = self._executor()
            future = pool.submit(contextvars.copy_context().run, fn, *args)
            self._unfinished[pool] = self._unfinished.get(pool, 0) + 1
        future._radixkv_executor = pool  # type: ignore[attr-defined]  # which executor a late call holds
        future.add_done_callback(lambda _: self._finished(pool))  # runs at once if already done
        return future

    def _finished(self, pool: ThreadPoolExecutor) -> None:
        with self._lock:
            left = self._unfinished.get(pool, 0) - 1
            if left > 0 or pool is self._pool:
                self._unfinished[pool] = max(0, left)
            else:
                self._unfinished.pop(pool, None)

    @property
    def stuck(self) -> int:
        """Calls not finished on retired executors (abandoned ones, and any queued behind them
        until their callers cancel them).  O(1)."""
        with self._lock:
            return sum(n for pool, n in self._unfinished.items() if pool is not self._pool)

    def gather(self, futures: Sequence[Future[T]], deadline: float,
               on_abandon: Callable[[int], None] | None = None) -> list[T]:
        """Every future's result, in order, waiting at most until ``deadline``.

        A fault raises (the first, once the others finished or the deadline passed).  At the
        deadline, ``DeadlineExceeded`` with ``partial`` = the results (``None`` where a call did
        not finish or failed), after ``on_abandon(number abandoned)``; a running call abandoned on
        the current executor retires it (see the class).  O(len(futures))."""
        _wait_futures(futures, timeout=max(0.0, deadline - time.monotonic()))
        results: list[Any] = []
        error: BaseException | None = None
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is None:
                results.append(f.result())
                continue
            results.append(None)
            if f.done() and not f.cancelled():
                error = error or f.exception()
        late = [f for f in futures if not f.done()]
        if late:
            running = [f for f in late if not f.cancel()]
            self._retire({getattr(f, "_radixkv_executor", None) for f in running})
            if on_abandon is not None:
                on_abandon(len(late))
            raise DeadlineExceeded(f"{self.name}: {len(late)} of {len(futures)} requests did not finish "
                                   "by the deadline", partial=results)
        if error is not None:
            raise error
        return results

    def _retire(self, holding: set[Any]) -> None:
        """Retire the current executor if abandoned calls hold its threads and no retired one has
        unfinished calls left; start the fresh one's threads."""
        with self._lock:
            pool = self._pool
            if self._closed or pool is None or pool not in holding:
                return
            if any(n for other, n in self._unfinished.items() if other is not pool):
                return  # one retired executor at a time: at most ``size`` stuck threads
            self._pool = None
            self.retired += 1
        pool.shutdown(wait=False)
        self.warm()

    def check(self) -> None:
        """Assert the bound on retired executors: at most one has unfinished calls, none counts
        below zero.  O(1)."""
        with self._lock:
            retired = [n for pool, n in self._unfinished.items() if pool is not self._pool and n]
            assert len(retired) <= 1 or self._closed, \
                f"{self.name}: {len(retired)} retired executors still running calls"
            assert all(n >= 0 for n in self._unfinished.values()), f"{self.name}: negative call count"
            assert self._pool is None or not self._closed, f"{self.name}: an executor after close"

    def close(self) -> None:
        """Refuse new calls, cancel queued ones and let running ones end on their own (never waits
        on a hung request).  Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
