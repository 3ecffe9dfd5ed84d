"""``RedisTier``: a shared remote tier in a Redis or Valkey server (``redis://`` / ``rediss://``).

A Redis server is the remote most LMCache deployments already run: one round trip per request,
memory-speed, shared by every engine instance that uses the namespace.

Storage contract:

* **Layout.** A chunk is one string value, key ``<prefix>:<namespace id hex>:<chunk key hex>``
  (``prefix`` defaults to ``radixkv``), holding exactly the blob the stack put (the chunk format,
  ``radixkv.core.format``).  The tier does not decode it; ``TierStack`` verifies every blob it reads
  (and, with a secret, its MAC), so a value overwritten by anyone is a miss, never KV.
* **Shared, bounded by the server.**  Any instance may write any key; the server's ``maxmemory``
  and its eviction policy (``allkeys-lru`` is the one to use) bound the memory, so the tier keeps
  no budget of its own (``used_bytes`` is 0, ``capacity_bytes`` ``None``).  A key the server
  evicted is a miss.  With ``ttl_s`` every value is written with that expiry (``SET ... PX``): the
  server deletes it, for every reader.
* **Round trips.**  ``contains_prefix`` is one pipeline of ``EXISTS`` (one round trip, however
  many keys).  ``get_many`` sends a pipeline of ``GETRANGE 0 <bound>`` per 8 keys, up to
  ``max_concurrency`` of them at once on their own connections (a ``MULTI`` of ``EXISTS`` and
  ``GETRANGE`` follows only for empty answers: an empty value or none); a value larger than the
  size bound (``max_object_bytes``, or the stack's
  expected chunk size) is never sent in full — one byte past the bound shows it; it is a miss, counted in
  ``oversize``, and deleted when the bound is the stack's (no chunk of the namespace has that size).  ``put_many`` is one pipeline of ``SET``.
* **Faults.**  Every call is bounded by a total deadline (the stack's, through
  ``radixkv.backends.bounded``, else ``timeout_s``), not only per socket read: a server that
  answers slowly or trickles its answer is abandoned at the deadline — its connections are
  closed, which ends the blocked reads — and the call raises ``DeadlineExceeded``.  Every failed
  or late request feeds a ``CircuitBreaker`` (the S3 tier's): after ``failure_threshold`` in a
  row, the server is skipped (lookups answer "miss" and puts ``False`` at once, on the caller's
  thread, without touching the pool or the network) until a background probe — one ``PING`` with
  a 1 KiB message, on a connection of its own that is closed at the probe's bound of
  ``min(2 s, connect_timeout_s + read_timeout_s)`` — finds it answering (the message makes a
  server that trickles its answers fail the probe as it fails requests).  Probes start after
  ``backoff_s`` (default 1 s), doubling on each failed one up to ``max_backoff_s`` (default
  ``max(5 s, backoff_s)``), jittered by +-20%: a probe costs requests nothing, so the tier is back
  within about 5 s of a fault's end.  redis-py's own retries are limited to ``max_attempts``.
* **Construction** sends one ``PING``: an unreachable server is a ``ConnectionError``.  With
  ``lazy=True`` (an engine that must start while the server is down) it never raises: the ``PING``
  is waited for at most ``connect_timeout_s + read_timeout_s``, and if it fails one warning (the URL redacted) says
  that the tier starts as misses with its breaker open; the background probe takes it into use
  once the server answers, without a restart.
* **Credentials** come from the URL (``redis://user:password@host``) or the ``password``
  argument; they are never logged or shown in a ``repr`` (logs name the redacted URL).
* Thread-safe (one redis-py client and connection pool per tier).  Build it after ``fork()``.

``drop_namespace`` scans ``<prefix>:<ns hex>:`` followed by exactly 32 characters (``SCAN MATCH``)
and unlinks them in batches, so it removes exactly one namespace, whatever other tiers' prefixes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

from radixkv.core._checks import check_int
from radixkv.backends import (Blob, BoundedPool, DeadlineExceeded, Entry, Tier, blob_view, bounded, check_key,
                              check_namespace_id, current_max_blob_bytes, redact, report_oversize)
from radixkv.backends.remote import (PROBE_BOUND_S, SKIPPING, CircuitBreaker, Skipped, call_deadline, skip_all,
                                     within)

__all__ = ["RedisTier", "parse_redis_url"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_SCAN_BATCH = 1000
_GROUP = 8  # keys per pipelined GET round trip; groups go out concurrently
_PROBE_MESSAGE = b"radixkv-probe:" + b"x" * 1010  # 1 KiB: what a breaker's PING asks back


def parse_redis_url(url: str) -> dict[str, Any]:
    """``redis://[user:password@]host[:port][/db][?prefix=name]`` (``rediss://`` for TLS) as
    connection settings: ``host``, ``port``, ``db``, ``ssl``, ``username``, ``password``, ``prefix``.
    ``ValueError`` (with the URL's credentials redacted) for anything else.  O(len(url)).

    >>> sorted(parse_redis_url("redis://cache:6380/2?prefix=kv").items())[:4]
    [('db', 2), ('host', 'cache'), ('password', None), ('port', 6380)]
    """
    if not isinstance(url, str):
        raise TypeError(f"remote_url must be a str like 'redis://host:6379/0', got {type(url).__name__}")
    shown = redact(url)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"remote_url must start with redis:// or rediss://, got {shown!r}")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"remote_url: the port is not a number, in {shown!r}") from None
    if not parts.hostname:
        raise ValueError(f"remote_url: no host, in {shown!r}")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"remote_url: the path must be a database number (/0), got {shown!r}")
    query = parse_qs(parts.query, keep_blank_values=True)
    if set(query) - {"prefix"} or parts.fragment or len(query.get("prefix", [""])) != 1:
        raise ValueError(f"remote_url: the only query parameter is prefix=..., got {shown!r}")
    prefix = query.get("prefix", ["radixkv"])[0]
    if not prefix or any(c in prefix for c in "*?[]\\ "):
        raise ValueError(f"remote_url: prefix must be non-empty, without glob characters or spaces, in {shown!r}")
    return {"host": parts.hostname, "port": port, "db": int(path or 0), "ssl": parts.scheme == "rediss",
            "username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password else None, "prefix": prefix}


class RedisTier(Tier):
    """Chunks as values in a Redis/Valkey server; see the module docstring for the contract.

    ``url`` names the server (``parse_redis_url``); ``client`` (a ``redis.Redis``) replaces it and
    the timeout settings.  ``breaker`` defaults to ``CircuitBreaker(failure_threshold, backoff_s,
    max_backoff_s)`` (``backoff_s=1``, ``max_backoff_s=max(5, backoff_s)``: see ``CircuitBreaker``
    for why); a breaker given without a probe gets the tier's (a ``PING``).  Construction costs one
    ``PING`` (with ``lazy``, waited for at most ``connect_timeout_s + read_timeout_s``).
    """

    name = "redis"
    local = False

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, client: Any = None, prefix: str | None = None,
                 ttl_s: float | None = None, connect_timeout_s: float = 1.0, read_timeout_s: float = 2.0,
                 timeout_s: float = 10.0, max_attempts: int = 1, max_concurrency: int = 8,
                 max_object_bytes: int = 1 << 30, failure_threshold: int = 3, backoff_s: float = 1.0,
                 max_backoff_s: float | None = None, breaker: CircuitBreaker | None = None,
                 lazy: bool = False) -> None:
        settings = parse_redis_url(url)
        if prefix is not None:
            settings["prefix"] = parse_redis_url(f"redis://h/?prefix={prefix}")["prefix"]
        for name, value in (("connect_timeout_s", connect_timeout_s), ("read_timeout_s", read_timeout_s),
                            ("timeout_s", timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")
        for name, value in (("max_attempts", max_attempts), ("max_concurrency", max_concurrency),
                            ("max_object_bytes", max_object_bytes)):
            check_int(value, name, 1)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ImportError("RedisTier needs redis-py: pip install 'radixkv[redis]'") from None
        self._redis_errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.prefix = settings["prefix"]
        self.url = redact(url)  # what logs and messages show
        self.ttl_s = None if ttl_s is None else float(ttl_s)
        self.timeout_s = float(timeout_s)
        self.max_object_bytes = max_object_bytes
        self.max_concurrency = max_concurrency
        self.breaker = breaker or CircuitBreaker(failure_threshold, backoff_s, max_backoff_s,
                                                 name=f"Redis server {self.url}")
        self._probe_timeout_s = min(PROBE_BOUND_S, float(connect_timeout_s) + float(read_timeout_s))
        self._probe_conns: set[Any] = set()  # the probes' own connections, closed by _cancel_probes
        if not self.breaker.has_probe:
            self.breaker.set_probe(self._probe, self._probe_timeout_s, self._cancel_probes)
        if client is None:
            client = redis.Redis(host=settings["host"], port=settings["port"], db=settings["db"],
                                 username=settings["username"], password=settings["password"], ssl=settings["ssl"],
                                 socket_connect_timeout=connect_timeout_s, socket_timeout=read_timeout_s,
                                 retry=Retry(NoBackoff(), max_attempts - 1), health_check_interval=0,
                                 max_connections=4 * max_concurrency)
        self._client = client
        self._pool = BoundedPool(max_concurrency, "radixkv-redis")
        self._pool.warm()
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter(dict.fromkeys(
            ("gets", "hits", "misses", "skipped", "get_errors", "puts", "stored", "skipped_puts", "put_errors",
             "deletes", "bytes_read", "bytes_written", "timeouts", "oversize"), 0))
        self._closed = False
        if not lazy:
            try:
                self._client.ping()
            except self._redis_errors as e:
                raise ConnectionError(f"Redis server {self.url} is unreachable ({type(e).__name__}); pass "
                                      "lazy=True to start without it") from None
        else:
            # Bounded by a request's socket timeouts: a busy server (or machine) must not start the
            # tier as down; a refused connection fails at once.
            bound = float(connect_timeout_s) + float(read_timeout_s)
            error = within(lambda: self._probe(bound), bound, "radixkv-redis-check", self._cancel_probes)
            if error is not None:
                self.breaker.trip()
                log.warning("Redis server %s is not usable now (%s); the tier starts as misses and is taken "
                            "into use when it answers (probed in the background)", self.url, type(error).__name__)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisTier:
        """The tier for a config's ``remote_url = "redis://host:6379/0"``, with any other keyword."""
        return cls(url, **kwargs)

    def redis_key(self, key: bytes) -> bytes:
        """The server key of a 24-byte tier key: ``<prefix>:<ns hex>:<key hex>``.  O(1)."""
        check_key(key)
        return f"{self.prefix}:{key[:8].hex()}:{key[8:].hex()}".encode()

    # ---------------------------------------------------------------- requests

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def _deadline(self, calls: int = 1) -> float:
        return call_deadline(self.timeout_s, calls, self.max_concurrency)

    def _probe(self, timeout_s: float | None = None) -> None:
        """The breaker's background probe: one ``PING`` with a 1 KiB message (answered in full only
        by a server that answers at a useful rate) on a connection of its own (so that the pool's
        connections, maybe blocked on a trickle, are not in its way), each socket wait bounded by
        the probe's bound; the connection is closed after (or by ``_cancel_probes``).  Raises
        unless the message comes back."""
        if self._closed:
            raise RuntimeError("RedisTier is closed")
        bound = self._probe_timeout_s if timeout_s is None else timeout_s
        pool = self._client.connection_pool
        try:
            conn = pool.connection_class(**{**pool.connection_kwargs, "socket_timeout": bound,
                                            "socket_connect_timeout": bound})
        except TypeError:  # a connection class without these settings: the client's own
            self._client.ping()
            return
        with self._lock:
            self._probe_conns.add(conn)
        try:
            conn.send_command("PING", _PROBE_MESSAGE)
            answer = conn.read_response()
            if answer not in (_PROBE_MESSAGE, _PROBE_MESSAGE.decode()):
                raise ConnectionError(f"Redis server {self.url} answered PING with something else")
        finally:
            with self._lock:
                self._probe_conns.discard(conn)
            conn.disconnect()

    def _cancel_probes(self) -> None:
        """Close the connections of running probes: a probe past its bound ends at once."""
        with self._lock:
            conns = list(self._probe_conns)
        for conn in conns:
            conn.disconnect()

    def _abandoned(self, epoch: int) -> Callable[[int], None]:
        """What to do with ``n`` requests still running at their deadline: count them, tell the
        breaker now, and close the connections they block on (the blocked reads then end at once) —
        unless the breaker opened or closed since they were sent (``epoch``: the connections in use
        then belong to other requests)."""
        def abandoned(n: int) -> None:
            self._count(timeouts=n)
            if self.breaker.epoch != epoch:
                return
            self.breaker.record_failures(n, epoch)
            try:
                self._client.connection_pool.disconnect(inuse_connections=True)
            except Exception:  # noqa: BLE001 - best effort: the reads end by their socket timeout anyway
                pass
        return abandoned

    def _request(self, fn: Callable[[], T]) -> T:
        """One guarded round trip: ``Skipped`` while the breaker is open; a fault, or an answer
        after the deadline, is recorded and raised (credentials redacted)."""
        if self._closed:
            raise RuntimeError("RedisTier is closed")
        if SKIPPING.get():
            raise Skipped
        deadline = self._deadline()
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"Redis server {self.url}: the deadline passed before the request was sent")
        epoch = self.breaker.epoch
        if not self.breaker.allow():
            raise Skipped
        ok = False
        try:
            result = fn()
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"Redis server {self.url} answered after the deadline")
            ok = True
            return result
        except self._redis_errors as e:
            raise ConnectionError(f"Redis server {self.url}: {type(e).__name__}: {redact(str(e))}") from None
        finally:
            self.breaker.record(ok, epoch)

    def _bounded(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """``fn(item)`` for each item on the tier's pool at once, until the deadline (as S3's);
        on the caller's thread, without a request, while the breaker is not closed (each ``fn``
        answers its "skipped")."""
        if self._closed:
            raise RuntimeError("RedisTier is closed")
        epoch = self.breaker.epoch
        if not self.breaker.allow():  # (the tier's breaker always has a probe: no request is one)
            return skip_all(fn, items)
        deadline = self._deadline(len(items))
        with bounded(deadline):
            futures = [self._pool.submit(fn, item) for item in items]
        return self._pool.gather(futures, deadline, self._abandoned(epoch))

    # ---------------------------------------------------------------- the Tier protocol

    def get(self, key: bytes) -> Blob | None:
        """The value, or ``None`` if absent, evicted, expired, over the size bound (unread, counted
        in ``oversize`` and told to the caller through ``report_oversize``; deleted when the bound
        is the caller's) or the breaker is open.  One round trip, within the deadline."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        """The values of ``keys``, 8 per pipelined round trip, up to ``max_concurrency`` round trips
        at once, within one deadline (``DeadlineExceeded`` carries what arrived in
        ``partial``).  Raises the first fault once all finished."""
        names = [self.redis_key(k) for k in keys]
        if not names:
            return []
        limit = current_max_blob_bytes()
        limit = self.max_object_bytes if limit is None else min(limit, self.max_object_bytes)
        groups = [names[i:i + _GROUP] for i in range(0, len(names), _GROUP)]
        tier_keys = [list(keys[i:i + _GROUP]) for i in range(0, len(names), _GROUP)]
        try:
            results = self._bounded(lambda i: self._get_group(groups[i], tier_keys[i], limit), range(len(groups)))
        except DeadlineExceeded as e:
            partial = [blob for group, got in zip(groups, e.partial or [None] * len(groups))
                       for blob in (got if got is not None else [None] * len(group))]
            raise DeadlineExceeded(str(e), partial=partial) from None
        return [blob for group in results for blob in group]

    def _get_group(self, names: list[bytes], keys: list[bytes], limit: int) -> list[Blob | None]:
        outcome: Counter[str] = Counter(gets=len(names))
        try:
            def fetch() -> list[Any]:
                # GETRANGE up to one byte past the bound: a value within it comes whole, a larger
                # one shows itself by that byte, and no more than the bound + 1 is ever sent.
                pipe = self._client.pipeline(transaction=False)
                for name in names:
                    pipe.getrange(name, 0, limit)
                values: list[Any] = list(pipe.execute())
                empty = [i for i, value in enumerate(values) if not value]
                if empty:  # an empty value, or none: EXISTS and the value again, atomically (rare)
                    pipe = self._client.pipeline(transaction=True)
                    for i in empty:
                        pipe.exists(names[i])
                        pipe.getrange(names[i], 0, limit)
                    again = pipe.execute()
                    for j, i in enumerate(empty):
                        values[i] = again[2 * j + 1] if again[2 * j] else None
                return values

            try:
                values = self._request(fetch)
            except Skipped:
                outcome["skipped"] += len(names)
                return [None] * len(names)
            except BaseException:
                outcome["get_errors"] += len(names)
                raise
            blobs: list[Blob | None] = []
            oversize = []
            for name, key, value in zip(names, keys, values):
                if value is None:
                    outcome["misses"] += 1
                    blobs.append(None)
                elif len(value) > limit:
                    oversize.append(name)
                    report_oversize(key)
                    blobs.append(None)
                else:
                    outcome["hits"] += 1
                    outcome["bytes_read"] += len(value)
                    blobs.append(value)
            outcome["oversize"] += len(oversize)
            if oversize and current_max_blob_bytes() is not None:
                # Larger than the caller's chunk: a bad value (never readable by it), which would
                # otherwise answer lookups forever and block the rewrite of the good chunk.
                try:
                    self._count(deletes=int(self._request(lambda: self._client.delete(*oversize))))
                except Exception:  # noqa: BLE001 - best effort: the value stays a miss either way
                    pass
            return blobs
        finally:
            self._count(**outcome)

    def put(self, key: bytes, blob: Blob) -> bool:
        """``SET`` the value (with the TTL as ``PX``); ``False`` while the breaker is open.  One
        round trip within the deadline; raises on a fault."""
        return self.put_many([(key, blob)]) == 1

    def put_many(self, items: Iterable[tuple[bytes, Blob]]) -> int:
        """One pipeline of ``SET`` (the last blob of a repeated key wins, as it would in order);
        the number stored (0 while the breaker is open).  Raises on a fault."""
        pairs = [(self.redis_key(key), blob if type(blob) is bytes else blob_view(blob).tobytes())
                 for key, blob in items]
        if not pairs:
            return 0
        px = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))

        def store(batch: list[tuple[bytes, bytes]]) -> int:
            outcome = "put_errors"
            try:
                def send() -> None:
                    pipe = self._client.pipeline(transaction=False)
                    for name, value in batch:
                        pipe.set(name, value, px=px)
                    pipe.execute()

                self._request(send)
                outcome = "stored"
                self._count(bytes_written=sum(len(v) for _, v in batch))
                return len(batch)
            except Skipped:
                outcome = "skipped_puts"
                return 0
            finally:
                self._count(puts=len(batch), **{outcome: len(batch)})

        return self._bounded(store, [pairs])[0]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys the server holds: one pipeline of ``EXISTS``, one round trip, within the
        deadline.  0 at once while the breaker is open.  Raises on a fault."""
        names = [self.redis_key(k) for k in keys]
        if not names:
            return 0

        def probe(_: Any) -> int:
            def ask() -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for name in names:
                    pipe.exists(name)
                return list(pipe.execute())

            try:
                found = self._request(ask)
            except Skipped:
                return 0
            n = 0
            while n < len(found) and found[n]:
                n += 1
            return n

        try:
            return self._bounded(probe, [None])[0]
        except DeadlineExceeded as e:
            raise DeadlineExceeded(str(e), partial=0) from None

    def delete(self, key: bytes) -> bool:
        """``DEL`` the key; ``True`` if it was there.  One round trip; raises on a fault or while
        the breaker is open."""
        name = self.redis_key(key)

        def drop(_: Any) -> bool:
            try:
                gone = bool(self._request(lambda: self._client.delete(name)))
            except Skipped:
                raise ConnectionError(f"Redis server {self.url} is failing; delete skipped") from None
            self._count(deletes=int(gone))
            return gone

        return self._bounded(drop, [None])[0]

    def drop_namespace(self, ns_id: bytes) -> int:
        """Unlink every chunk value of the namespace — keys ``<prefix>:<ns hex>:`` and exactly 32
        more characters — found by ``SCAN``; how many.  A scan of the server's keyspace, each
        round trip within ``timeout_s``.  Raises on a fault."""
        pattern = f"{self.prefix}:{check_namespace_id(ns_id).hex()}:{'?' * 32}".encode()

        def drop(_: Any) -> int:
            dropped, cursor = 0, 0
            try:
                while True:
                    cursor, names = self._request(lambda: self._client.scan(cursor, match=pattern, count=_SCAN_BATCH))
                    if names:
                        dropped += int(self._request(lambda: self._client.unlink(*names)))
                    if not cursor:
                        break
            except Skipped:
                raise ConnectionError(f"Redis server {self.url} is failing; drop skipped") from None
            self._count(deletes=dropped)
            return dropped

        return self._bounded(drop, [None])[0]

    def entries(self, ns_id: bytes | None = None) -> Iterator[Entry]:
        """The chunk values (of ``ns_id``) found by ``SCAN``, with their size (``STRLEN``) and the
        time of their last access (now minus ``OBJECT IDLETIME``), a pipelined round trip per
        scanned batch, each within ``timeout_s``.  Raises on a fault.  O(keys of the server)."""
        ns = "?" * 16 if ns_id is None else check_namespace_id(ns_id).hex()
        pattern = f"{self.prefix}:{ns}:{'?' * 32}".encode()
        start = len(self.prefix) + 1
        cursor = 0
        while True:
            try:
                cursor, names = self._request(lambda: self._client.scan(cursor, match=pattern, count=_SCAN_BATCH))
                if names:
                    pipe = self._client.pipeline(transaction=False)
                    for name in names:
                        pipe.strlen(name)
                        pipe.object("idletime", name)
                    answers = self._request(pipe.execute)
            except Skipped:
                raise ConnectionError(f"Redis server {self.url} is failing; listing skipped") from None
            now = time.time()
            for i, name in enumerate(names):
                size, idle = answers[2 * i], answers[2 * i + 1]
                if size and idle is not None:          # gone since the scan: left out
                    text = bytes(name)[start:].decode()
                    yield Entry(bytes.fromhex(text.replace(":", "")), int(size), now - float(idle))
            if not cursor:
                return

    @property
    def used_bytes(self) -> int:
        """0: the server is shared and bounds its own memory (``maxmemory``).  O(1)."""
        return 0

    def stats(self) -> dict[str, int | float]:
        """Request counters, the breaker's state (``breaker_open``), how often it opened and probed,
        and the calls still stuck on threads the pool retired (``stuck_calls``).  O(1)."""
        with self._lock:
            counts = dict(self._counts)
        return {**counts, "used_bytes": 0, "breaker_open": int(self.breaker.state != "closed"),
                "breaker_opened": self.breaker.opened, "breaker_probes": self.breaker.probes,
                "stuck_calls": self._pool.stuck}

    def close(self) -> None:
        """Refuse further requests, stop the pool (never waiting on a hung request) and close the
        connections.  Idempotent; the server keeps its values."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.close()
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a connection to a dead server may fail; nothing to do
            pass

    def check(self) -> None:
        """Counters add up (every get and put ended in one outcome), the breaker and the pool are
        consistent, key names map back to keys.  O(1)."""
        super().check()
        self.breaker.check()
        self._pool.check()
        with self._lock:
            c = dict(self._counts)
        assert all(v >= 0 for v in c.values()), f"negative counter in {c}"
        got = c["hits"] + c["misses"] + c["skipped"] + c["get_errors"] + c["oversize"]
        assert got == c["gets"], f"get outcomes != gets in {c}"
        assert c["stored"] + c["skipped_puts"] + c["put_errors"] == c["puts"], f"put outcomes != puts in {c}"
        probe = bytes(range(24))
        name = self.redis_key(probe).decode()
        assert bytes.fromhex(name[len(self.prefix) + 1:].replace(":", "")) == probe

    def __repr__(self) -> str:
        return f"RedisTier({self.url}, prefix={self.prefix!r}, breaker={self.breaker.state})"
