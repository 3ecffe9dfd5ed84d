"""``S3Tier``: the last tier, an S3-compatible bucket shared by every engine of a namespace.

One machine's cache helps only that machine; a bucket (AWS S3, MinIO, Ceph RGW, R2) is shared by
every instance that uses the same namespace, so a system prompt computed behind one load balancer
slot is loaded, not recomputed, behind all the others.

Storage contract:

* **Layout.** A chunk is one object, ``<prefix>/<namespace id hex>/<chunk key hex>`` (16 + 32 hex
  digits), holding exactly the blob the stack put: the chunk format of every tier
  (``radixkv.core.format``).  The tier does not decode it; ``TierStack`` verifies every blob it reads
  and deletes one that does not verify, so an object overwritten with garbage or truncated is a
  miss, counted and removed, never KV.  ``drop_namespace`` lists ``<prefix>/<ns>/`` and deletes
  it in batches of 1000.
* **Shared, unbounded, last writer wins.**  Any instance may write any key at any time; since a
  key names a chunk and everything before it, concurrent writers write equal chunks.  The tier
  keeps no budget (``capacity_bytes`` is ``None``, ``used_bytes`` is 0: the bucket's size would
  take a listing); the bucket's lifecycle rule bounds it (below).
* **Lookups cost round trips.**  ``contains_prefix`` sends ``HEAD`` requests for the keys, up to
  ``max_concurrency`` at once, in windows, and stops at the first window with a miss: a request
  costs about ``ceil(hits / max_concurrency) + 1`` round trips, whatever the bucket holds.  A
  listing would answer a whole request in one page only while the namespace has at most ~1000
  objects: keys are hashes, spread evenly over the key space, so in a large namespace a page of
  1000 names covers a slice of it.  Measured on moto (``benchmarks/results/s3_cpu.txt``): 32 keys
  by HEADs take ~86 ms in any namespace; one page takes 9 ms in a namespace of just those keys,
  but 212 ms with 2000 more objects, and then answers 22 of the 32.
  ``get_many``/``put_many`` run up to ``max_concurrency`` requests at once on the tier's pool.
* **Large objects.**  A put of ``multipart_threshold`` bytes or more goes through boto3's transfer
  manager (multipart, ``multipart_chunksize`` parts, ``max_concurrency`` at once); a get asks for
  the first ``multipart_threshold`` bytes and, when the object is larger, fetches the rest in
  ``multipart_chunksize`` ranges concurrently, each pinned to the first response's ETag
  (``IfMatch``), so an object overwritten during the read is a miss, never a mix of two writes.
  The default threshold (64 MiB) keeps a typical chunk (32 MiB for 256 tokens of a 7B model in
  fp16) to one request; on real S3 a lower one buys bandwidth with parallel requests.
* **Deadlines.**  Every call is bounded by a total deadline, not only per socket read: the
  caller's (``radixkv.backends.bounded``, which ``TierStack`` sets from its ``lookup``/``load``
  deadline), else ``timeout_s`` from the call per round of ``max_concurrency`` requests.  Requests
  run on the tier's pool and the caller stops waiting at the deadline (``DeadlineExceeded``, with
  what arrived in ``partial``); a body is read one socket read at a time, each bounded by what is
  left, so a body trickling in under ``read_timeout_s`` still ends at the deadline.  A request
  abandoned while the server has not even sent its headers keeps its thread until its socket read
  times out or the answer completes; the pool then retires those threads and later requests run
  on fresh ones (``BoundedPool``: at most ``max_concurrency`` stuck threads), so a fault that ended
  leaves none in their way.  An object's size is read from its headers first: one over the bound
  (``max_object_bytes``, or the stack's expected chunk size) is a miss (``oversize``) whose body is
  never read and which drives no allocation.
* **Credentials in the endpoint URL** (``http://AK:SECRET@host``) are taken out of it and given to
  boto3 as the session's credentials, so no message or log line of boto3's ever holds them.
* **Faults.**  Timeouts and retries are explicit: ``connect_timeout_s``, ``read_timeout_s`` (per
  socket read, not per transfer) and ``max_attempts`` (the first request included: botocore's
  ``total_max_attempts``, "standard" mode), so a request to a hung endpoint gives up after about
  ``max_attempts * (connect_timeout_s + read_timeout_s)``, or at its deadline if that is sooner.  A
  request that still fails raises (``TierStack`` turns it into a miss) and feeds a
  ``CircuitBreaker``: after ``failure_threshold`` failures in a row (concurrent requests fail
  together; a request past its deadline is a failure too, recorded when the caller gives up on it)
  the tier is skipped — lookups answer "miss" and puts ``False`` at once, on the caller's thread,
  without touching the pool or the network — until a background probe (one ``HEAD`` of the
  bucket, bounded by ``min(2 s, connect_timeout_s + read_timeout_s)``) finds the endpoint
  answering.  Probes start after ``backoff_s`` (default 1 s), doubling on each failed one up to
  ``max_backoff_s`` (default ``max(5 s, backoff_s)``), jittered by +-20%: a probe costs requests
  nothing, so the tier is back within about 5 s of a fault's end.  Once open, a dead, hung or
  trickling endpoint costs the engine nothing per request.  Failed writes are counted
  (``put_errors``) and never retried beyond ``max_attempts``.
* **TTL.**  With ``ttl_s`` (every namespace) or ``namespace_ttl_s`` (``{namespace id: seconds}``)
  an object whose ``LastModified`` is older than that is a miss (counted as ``expired``).  Reads
  only hide old objects; a lifecycle rule deletes them for good, e.g. for 7 days under ``kv/``::

      aws s3api put-bucket-lifecycle-configuration --bucket my-bucket --lifecycle-configuration \\
        '{"Rules": [{"ID": "radixkv-ttl", "Status": "Enabled", "Filter": {"Prefix": "kv/"},
                     "Expiration": {"Days": 7},
                     "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}}]}'

  (per namespace: one rule per ``kv/<namespace id hex>/`` prefix).  A rule counts whole days and
  runs about once a day, so set ``ttl_s`` to at most its ``Days * 86400``: the tier hides what the
  rule has not deleted yet.  ``LastModified`` is the server's clock (and what the rule uses), so a
  client clock off by seconds matters only for TTLs of seconds.
* **Credentials** come from boto3's usual chain (environment, config files, instance roles) and
  are never logged; logs name the endpoint and bucket only.
* **Construction checks the bucket** with one ``HEAD``: a missing bucket is a ``ValueError``
  naming it, a refusal a ``PermissionError``, an unreachable endpoint a ``ConnectionError`` — at
  construction, not at the first request.  With ``lazy=True`` (an engine that must start while
  the store is down) construction never raises for any of these: the ``HEAD`` is waited for at
  most ``connect_timeout_s + read_timeout_s``, and if it fails one warning (the endpoint redacted) says that the
  tier starts as misses with its breaker open; the background probe takes it into use once the
  bucket answers, without a restart.
* Thread-safe: one boto3 client (thread-safe) and one worker pool per tier.  Safe to use after
  ``fork()`` only if built after it (the client's connection pool is not fork-safe).

Configuration reads a URL: ``S3Tier.from_url("s3://my-bucket/kv", endpoint_url=...)``.
"""

from __future__ import annotations

import datetime as _dt
import io
import logging
import re
import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar
from urllib.parse import unquote, urlsplit

from radixkv.core._checks import check_int
from radixkv.backends import (Blob, BoundedPool, DeadlineExceeded, Entry, OversizeBlob, Tier, blob_view, bounded, check_key,
                              check_namespace_id, current_deadline, current_max_blob_bytes, redact, report_oversize)
from radixkv.backends.remote import (PROBE_BOUND_S, CircuitBreaker, Skipped, SKIPPING, call_deadline, skip_all,
                                     within)

__all__ = ["CircuitBreaker", "S3Tier", "call_deadline", "parse_remote_url"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_CHANGED = {"412", "PreconditionFailed", "InvalidRange", "416"}  # overwritten or emptied mid-read
_DELETE_BATCH = 1000  # S3's limit for DeleteObjects
_CHUNK_NAME = re.compile(r"[0-9a-f]{32}")  # an object name's last segment: a 16-byte chunk key
_NAMESPACE_NAME = re.compile(r"[0-9a-f]{16}")  # the segment before it: an 8-byte namespace id


def _redacted(url: str) -> str:
    """``url`` with any user-info (credentials someone put in a URL) replaced by ``***``."""
    return redact(url) if isinstance(url, str) else repr(url)


def _split_credentials(endpoint_url: str | None) -> tuple[str | None, dict[str, str]]:
    """An endpoint URL without its user-info, and that user-info as boto3 session credentials
    (``http://AK:SECRET@host`` is a common way to write them): boto3 then never sees (or logs, or
    puts in an error message) a URL holding a secret."""
    if not isinstance(endpoint_url, str) or "@" not in endpoint_url:
        return endpoint_url, {}
    parts = urlsplit(endpoint_url)
    if parts.username is None:
        return endpoint_url, {}
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    credentials = {"aws_access_key_id": unquote(parts.username)}
    if parts.password is not None:
        credentials["aws_secret_access_key"] = unquote(parts.password)
    return parts._replace(netloc=netloc).geturl(), credentials


def _redact_error(e: Exception) -> Exception:
    """``e`` itself when its message holds no URL credentials, else an exception of the same
    kind of fault (``ConnectionError``/``OSError``) whose message is redacted."""
    text = str(e)
    clean = redact(text)
    if clean == text:
        return e
    return (ConnectionError if isinstance(e, ConnectionError) else OSError)(f"{type(e).__name__}: {clean}")


def parse_remote_url(url: str) -> tuple[str, str]:
    """``"s3://bucket/some/prefix"`` -> ``("bucket", "some/prefix")``; ``ValueError`` otherwise.

    The prefix loses leading and trailing slashes (``""`` for none).  A bucket name must follow
    S3's rules (3-63 lowercase letters, digits, dots, hyphens); credentials, ports, queries and
    fragments are refused (credentials come from boto3's chain, and are never echoed in the
    error).  O(len(url)); thread-safe (pure function).

    >>> parse_remote_url("s3://my-bucket/kv/")
    ('my-bucket', 'kv')
    >>> parse_remote_url("s3://my-bucket")
    ('my-bucket', '')
    """
    if not isinstance(url, str):
        raise TypeError(f"remote_url must be a str like 's3://bucket/prefix', got {type(url).__name__}")
    shown = _redacted(url)
    parts = urlsplit(url)
    if parts.scheme != "s3":
        raise ValueError(f"remote_url must start with 's3://' (s3://bucket/prefix), got {shown!r}")
    if "@" in parts.netloc or ":" in parts.netloc:
        raise ValueError(f"remote_url must not hold credentials or a port (use endpoint_url and "
                         f"boto3's credential chain), got {shown!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"remote_url must not have a query or fragment, got {shown!r}")
    bucket = parts.netloc
    if not _BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ValueError(f"remote_url: {bucket!r} is not a valid S3 bucket name "
                         f"(3-63 lowercase letters, digits, '.', '-'), in {shown!r}")
    prefix = parts.path.strip("/")
    if "//" in prefix:
        raise ValueError(f"remote_url: the prefix must not contain empty path segments, got {shown!r}")
    return bucket, prefix




class S3Tier(Tier):
    """Chunks as objects in an S3-compatible bucket; see the module docstring for the contract.

    ``client`` (a boto3 S3 client) replaces ``endpoint_url``, ``region`` and the timeout and retry
    settings, which are then the client's own.  ``breaker`` defaults to
    ``CircuitBreaker(failure_threshold, backoff_s, max_backoff_s)`` (``backoff_s=1``,
    ``max_backoff_s=max(5, backoff_s)``: see ``CircuitBreaker`` for why); a breaker given without
    a probe gets the tier's (a ``HEAD`` of the bucket).  Construction costs one ``HEAD`` of the
    bucket (with ``lazy``, waited for at most ``connect_timeout_s + read_timeout_s``).
    """

    name = "s3"
    local = False     # every read is a round trip: the stack never reads it for bookkeeping

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 region: str | None = None, client: Any = None, *,
                 connect_timeout_s: float = 1.0, read_timeout_s: float = 5.0, max_attempts: int = 2,
                 max_concurrency: int = 16, multipart_threshold: int = 64 << 20,
                 multipart_chunksize: int = 16 << 20,
                 failure_threshold: int = 3, backoff_s: float = 1.0, max_backoff_s: float | None = None,
                 breaker: CircuitBreaker | None = None,
                 ttl_s: float | None = None, namespace_ttl_s: Mapping[bytes, float | None] | None = None,
                 clock: Callable[[], float] = time.time, lazy: bool = False,
                 timeout_s: float = 10.0, max_object_bytes: int = 1 << 30) -> None:
        if not isinstance(bucket, str) or not _BUCKET_NAME.match(bucket):
            raise ValueError(f"bucket: {bucket!r} is not a valid S3 bucket name")
        if not isinstance(prefix, str) or "//" in prefix.strip("/"):
            raise ValueError(f"prefix must be a str without empty path segments, got {prefix!r}")
        for name, value in (("connect_timeout_s", connect_timeout_s), ("read_timeout_s", read_timeout_s),
                            ("timeout_s", timeout_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name, value, low in (("max_attempts", max_attempts, 1), ("max_concurrency", max_concurrency, 1),
                                 ("multipart_threshold", multipart_threshold, 5 << 20),
                                 ("multipart_chunksize", multipart_chunksize, 5 << 20),
                                 ("max_object_bytes", max_object_bytes, 1)):
            check_int(value, name, low)
        endpoint_url, url_credentials = _split_credentials(endpoint_url)
        if url_credentials and client is not None:
            raise ValueError("endpoint_url: credentials in the URL, but a client was given (it has its own)")
        self._ttl = _check_ttl(ttl_s, "ttl_s")
        self._ns_ttl = {check_namespace_id(ns): _check_ttl(s, "namespace_ttl_s")
                        for ns, s in (namespace_ttl_s or {}).items()}
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self._where = _redacted(endpoint_url) if endpoint_url else "AWS S3"  # for messages and logs
        self.max_concurrency = max_concurrency
        self.connect_timeout_s = float(connect_timeout_s)
        self.read_timeout_s = float(read_timeout_s)
        self.timeout_s = float(timeout_s)
        self.max_object_bytes = max_object_bytes
        self.max_attempts = max_attempts
        self._root = f"{self.prefix}/" if self.prefix else ""
        self._clock = clock
        self.breaker = breaker or CircuitBreaker(failure_threshold, backoff_s, max_backoff_s,
                                                 name=f"S3 bucket {bucket!r} at {self._where}")
        if not self.breaker.has_probe:
            self.breaker.set_probe(self._probe, min(PROBE_BOUND_S, self.connect_timeout_s + self.read_timeout_s))
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError as e:  # pragma: no cover - the s3 extra is installed in tests
            raise ImportError("S3Tier needs boto3: pip install 'radixkv[s3]'") from e
        if client is None:
            config = Config(connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                            retries={"total_max_attempts": max_attempts, "mode": "standard"},
                            max_pool_connections=max_concurrency,
                            s3={"addressing_style": "path" if endpoint_url else "auto"})
            session = boto3.session.Session(**url_credentials)
            client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        elif endpoint_url is not None or region is not None:
            raise ValueError("pass either client or endpoint_url/region, not both (the client has its own)")
        self._client = client
        self._threshold, self._chunk = multipart_threshold, multipart_chunksize
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                        multipart_chunksize=multipart_chunksize,
                                        max_concurrency=max_concurrency, use_threads=True)
        self._pool = BoundedPool(max_concurrency, "radixkv-s3")
        self._pool.warm()
        self._ranges = BoundedPool(max_concurrency, "radixkv-s3-ranges")  # large objects' other ranges
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter(dict.fromkeys(
            ("gets", "hits", "misses", "expired", "skipped", "get_errors",
             "puts", "stored", "skipped_puts", "put_errors", "deletes", "bytes_read", "bytes_written",
             "timeouts", "oversize"), 0))
        self._closed = False
        if not lazy:
            self._check_bucket()
        else:
            # Bounded by a request's socket timeouts, not the connect timeout alone: a busy endpoint (or
            # machine) that answers in a few seconds must not start the tier as down.  A refused
            # connection fails at once; only a hung endpoint makes start-up wait that long.
            error = within(lambda: self._check_bucket(hint=""), self.connect_timeout_s + self.read_timeout_s,
                           "radixkv-s3-check")
            if error is not None:
                self.breaker.trip()
                if isinstance(error, TimeoutError):
                    error = TimeoutError(f"S3 bucket {bucket!r} at {self._where} did not answer within "
                                         f"{self.connect_timeout_s:g} s")
                log.warning("%s; the tier starts as misses and is taken into use when it answers (probed in "
                            "the background)", redact(str(error)))

    @classmethod
    def from_url(cls, url: str, endpoint_url: str | None = None, **kwargs: Any) -> S3Tier:
        """The tier for a config's ``remote_url = "s3://bucket/prefix"`` (see ``parse_remote_url``),
        with ``endpoint_url`` for stores other than AWS and any other ``S3Tier`` keyword."""
        bucket, prefix = parse_remote_url(url)
        return cls(bucket, prefix, endpoint_url=endpoint_url, **kwargs)

    def _check_bucket(self, hint: str = "; pass lazy=True to start without it") -> None:
        """One ``HEAD`` of the bucket: ``ValueError`` if it does not exist, ``PermissionError`` if
        refused, ``ConnectionError`` (ending with ``hint``) if the endpoint does not answer."""
        from botocore.exceptions import ClientError

        where = f"S3 bucket {self.bucket!r} at {self._where}"
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = _error_code(e)
            if code in _NOT_FOUND or code == "NoSuchBucket":
                raise ValueError(f"{where} does not exist; create it first") from None
            raise PermissionError(f"{where}: HEAD answered {code}; check the credentials and the "
                                  "bucket policy") from None
        except Exception as e:
            raise ConnectionError(f"{where} is unreachable ({type(e).__name__}){hint}") from None

    def _probe(self) -> None:
        """The breaker's background probe: one ``HEAD`` of the bucket, which must answer 200 (a
        missing or refused bucket keeps the tier skipped).  Raises otherwise."""
        if self._closed:
            raise RuntimeError("S3Tier is closed")
        self._client.head_bucket(Bucket=self.bucket)

    # ---------------------------------------------------------------- requests

    def object_key(self, key: bytes) -> str:
        """The object name of a 24-byte tier key: ``<prefix>/<ns hex>/<key hex>``.  O(1)."""
        check_key(key)
        return f"{self._root}{key[:8].hex()}/{key[8:].hex()}"

    def namespace_prefix(self, ns_id: bytes) -> str:
        """The object-name prefix holding every chunk of a namespace.  O(1)."""
        return f"{self._root}{check_namespace_id(ns_id).hex()}/"

    def _deadline(self, calls: int = 1) -> float:
        return call_deadline(self.timeout_s, calls, self.max_concurrency)

    def _abandoned(self, epoch: int) -> Callable[[int], None]:
        """What to do with ``n`` requests still running at their deadline: count timeouts, and
        tell the breaker now (not when their sockets finally give up), so that a slow endpoint
        opens it like a dead one — unless it opened or closed since they were sent (``epoch``)."""
        def abandoned(n: int) -> None:
            self._count(timeouts=n)
            self.breaker.record_failures(n, epoch)
        return abandoned

    def _bounded(self, fn: Callable[..., T], items: Sequence[Any]) -> list[T]:
        """``fn(item)`` for each item on the tier's pool, all at once (up to ``max_concurrency``),
        waiting until the deadline: ``DeadlineExceeded`` (with the results that arrived) past it,
        else the first fault once every call finished.  Inline when called from the pool, and on
        the caller's thread, without a request, while the breaker is not closed (each ``fn``
        answers its "skipped")."""
        if self._closed:
            raise RuntimeError("S3Tier is closed")
        if self._pool.on_worker():
            return _wait_all([self._pool.submit(fn, item) for item in items])
        epoch = self.breaker.epoch
        if not self.breaker.allow():  # (the tier's breaker always has a probe: no request is one)
            return skip_all(fn, items)
        deadline = self._deadline(len(items))
        with bounded(deadline):
            futures = [self._pool.submit(fn, item) for item in items]
        return self._pool.gather(futures, deadline, self._abandoned(epoch))

    def _request(self, op: Callable[..., T], **kwargs: Any) -> T:
        """One guarded request: ``Skipped`` when the breaker is open; a not-found answer is
        success for the breaker (raised as ``KeyError``); any other fault, and an answer that came
        after the deadline, is recorded and raised."""
        if self._closed:
            raise RuntimeError("S3Tier is closed")
        if SKIPPING.get():
            raise Skipped
        deadline = self._deadline()
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"S3 bucket {self.bucket!r}: the deadline passed before the request was sent")
        epoch = self.breaker.epoch
        if not self.breaker.allow():
            raise Skipped
        ok = False
        try:
            result = op(Bucket=self.bucket, **kwargs)
            if time.monotonic() > deadline:
                self._count(timeouts=1)
                raise DeadlineExceeded(f"S3 bucket {self.bucket!r} at {self._where} answered after the deadline")
            ok = True
            return result
        except DeadlineExceeded:
            raise
        except Exception as e:
            code = _error_code(e)
            if code in _NOT_FOUND or code in _CHANGED:
                ok = True
                raise KeyError(code) from None
            if isinstance(e, OversizeBlob):
                ok = True  # the endpoint answered; the object is bad
                raise
            raise _redact_error(e) from None
        finally:
            self.breaker.record(ok, epoch)

    def _read_object(self, key: bytes | None, **kwargs: Any) -> tuple[Mapping[str, Any], bytearray | None]:
        """One GET and its body, as one guarded request (a body that does not arrive by the
        deadline feeds the breaker too); the body is ``None`` when ``key``'s TTL says the object
        expired.  An object over the size bound is refused from its headers (``OversizeBlob``),
        before a byte of its body is read."""
        limit = current_max_blob_bytes()
        limit = self.max_object_bytes if limit is None else min(limit, self.max_object_bytes)

        def op(**kw: Any) -> tuple[Mapping[str, Any], bytearray | None]:
            resp = self._client.get_object(**kw)
            body = resp["Body"]
            if key is not None and self._expired(key, resp.get("LastModified")):
                body.close()
                return resp, None
            length = resp.get("ContentLength")
            total = _total_size(resp, length if isinstance(length, int) else 0)
            if not isinstance(length, int) or length > limit or total > limit:
                body.close()
                raise OversizeBlob(f"S3 object of {total} bytes is over the {limit}-byte bound; not read")
            return resp, self._read_body(body, length)

        return self._request(op, **kwargs)

    def _read_body(self, body: Any, length: int) -> bytearray:
        """``length`` bytes of a response body, read as they come (one socket read at a time, each
        bounded by what is left of the deadline), so that a body trickling in under the per-read
        timeout still ends at the deadline."""
        deadline = self._deadline()
        raw = getattr(body, "_raw_stream", None)
        out = bytearray(length)
        view, got = memoryview(out), 0
        try:
            while got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._count(timeouts=1)
                    raise DeadlineExceeded(f"S3 bucket {self.bucket!r}: an object body did not arrive by the deadline")
                body.set_socket_timeout(min(self.read_timeout_s, left))
                piece = raw.read1(min(length - got, 1 << 20)) if raw is not None else body.read(length - got)
                if not piece:
                    raise ConnectionError(f"S3 bucket {self.bucket!r}: an object body ended after {got} of "
                                          f"{length} bytes")
                view[got:got + len(piece)] = piece
                got += len(piece)
        except BaseException:
            body.close()
            raise
        if raw is not None:
            raw.release_conn()
        return out

    def _expired(self, key: bytes, last_modified: Any) -> bool:
        ttl = self._ns_ttl.get(key[:8], self._ttl)
        if ttl is None or not isinstance(last_modified, _dt.datetime):
            return False
        return self._clock() - last_modified.timestamp() > ttl

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    # ---------------------------------------------------------------- the Tier protocol

    def get(self, key: bytes) -> Blob | None:
        """The object's bytes, or ``None`` if absent, expired, overwritten mid-read or the breaker
        is open.  One GET for objects under ``multipart_threshold``; larger ones get their other
        ``multipart_chunksize`` ranges concurrently (into a ``bytearray``).  Bounded by the deadline
        (``DeadlineExceeded``); an object over the size bound (``max_object_bytes``, or the caller's
        through ``bounded``) is a miss decided from its headers, counted in ``oversize`` and told
        to the caller (``report_oversize``), and deleted when the bound is the caller's.  Raises on
        a fault.  Thread-safe."""
        check_key(key)
        return self._bounded(self._get, [key])[0]

    def _get(self, key: bytes) -> Blob | None:
        name = self.object_key(key)
        outcome = "get_errors"
        try:
            try:
                resp, first = self._read_object(key, Key=name, Range=f"bytes=0-{self._threshold - 1}")
            except KeyError as e:
                if e.args and e.args[0] in ("InvalidRange", "416"):  # an empty object: no byte 0
                    resp, first = self._read_object(key, Key=name)
                else:
                    raise
            if first is None:
                outcome = "expired"
                return None
            total = _total_size(resp, len(first))
            data = first if total == len(first) else self._get_rest(name, first, total, resp["ETag"])
            outcome = "hits"
            self._count(bytes_read=len(data))
            return data
        except Skipped:
            outcome = "skipped"
            return None
        except KeyError:
            outcome = "misses"
            return None
        except OversizeBlob:
            # Larger than the caller's chunk: a bad object that would answer lookups forever and
            # block the rewrite of the good chunk, so it goes (when the bound is the caller's).
            outcome = "oversize"
            if current_max_blob_bytes() is not None:
                try:
                    self._delete(name)
                except Exception:  # noqa: BLE001 - best effort: the object stays a miss either way
                    pass
            report_oversize(key)
            return None
        finally:
            self._count(gets=1, **{outcome: 1})

    def _get_rest(self, name: str, first: bytearray, total: int, etag: str) -> bytearray:
        """The ranges after ``first`` (``total`` is already within the size bound), fetched
        concurrently and pinned to ``etag``."""
        out = bytearray(total)
        out[:len(first)] = first
        starts = range(len(first), total, self._chunk)

        def fetch(start: int) -> None:
            end = min(start + self._chunk, total)
            _, part = self._read_object(None, Key=name, Range=f"bytes={start}-{end - 1}", IfMatch=etag)
            if part is None or len(part) != end - start:
                raise KeyError("short range")  # the object changed size under us: a miss
            out[start:end] = part

        # On a pool of their own: the caller is usually one of the main pool's workers, and range
        # requests start nothing further, so they cannot deadlock.
        self._ranges.gather([self._ranges.submit(fetch, start) for start in starts], self._deadline(),
                            self._abandoned(self.breaker.epoch))
        return out

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        """``[get(k) for k in keys]``, all at once (up to ``max_concurrency``), within one
        deadline: ``DeadlineExceeded`` carries in ``partial`` the blobs that arrived.  Raises the
        first fault once every request has finished.  Thread-safe."""
        for key in keys:
            check_key(key)
        return self._bounded(self._get, keys)

    def put(self, key: bytes, blob: Blob) -> bool:
        """Upload ``blob`` as the object of ``key`` (multipart from ``multipart_threshold`` bytes).

        ``False`` (counted as ``skipped_puts``) while the breaker is open.  A failed upload is
        counted as ``put_errors`` and raises; it is not retried beyond ``max_attempts``.  Cost: one
        PUT, or a multipart upload, within the deadline.  Thread-safe.
        """
        check_key(key)
        blob_view(blob)
        return self._bounded(self._put, [(key, blob)])[0]

    def _put(self, item: tuple[bytes, Blob]) -> bool:
        key, blob = item
        name = self.object_key(key)
        outcome = "put_errors"
        try:
            if SKIPPING.get():
                raise Skipped  # before the copy below
            body = blob if type(blob) is bytes else blob_view(blob).tobytes()
            if len(body) >= self._threshold:
                self._request(lambda **kw: self._client.upload_fileobj(
                    io.BytesIO(body), kw["Bucket"], name, Config=self._transfer))
            else:
                self._request(self._client.put_object, Key=name, Body=body)
            outcome = "stored"
            self._count(bytes_written=len(body))
            return True
        except Skipped:
            outcome = "skipped_puts"
            return False
        finally:
            self._count(puts=1, **{outcome: 1})

    def put_many(self, items: Iterable[tuple[bytes, Blob]]) -> int:
        """``put`` each item, all at once (up to ``max_concurrency``; a repeated key sends only its
        last blob) within one deadline; the number stored.  Failed puts are counted (``put_errors``)
        and the first fault is raised once every put has finished.  Thread-safe."""
        pairs = list(items)
        last: dict[bytes, Blob] = {}
        for key, blob in pairs:
            check_key(key)
            blob_view(blob)
            last[key] = blob  # concurrent puts of one key could land in any order: keep the last
        if not last:
            return 0
        stored = dict(zip(last, self._bounded(self._put, list(last.items()))))
        return sum(stored[key] for key, _ in pairs)

    def _holds(self, key: bytes) -> bool:
        try:
            resp = self._request(self._client.head_object, Key=self.object_key(key))
        except (KeyError, Skipped):  # a key the breaker skips counts as absent
            return False
        return not self._expired(key, resp.get("LastModified"))

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys the bucket holds (unexpired): ``HEAD``s, ``max_concurrency`` at once, in
        windows, stopping at the first window with a miss; ``ceil(hits / max_concurrency) + 1``
        round trips, all within one deadline (``DeadlineExceeded`` carries the leading keys
        confirmed by then in ``partial``).  0 at once while the breaker is open.  Raises on a
        fault.  Does not modify the bucket.  Thread-safe."""
        for key in keys:
            check_key(key)
        n = 0
        with bounded(self._deadline()):
            while n < len(keys):
                window = keys[n:n + self.max_concurrency]
                try:
                    lead = _leading_true(self._bounded(self._holds, window))
                except DeadlineExceeded as e:
                    raise DeadlineExceeded(str(e), partial=n + _leading_true(e.partial or [])) from None
                n += lead
                if lead < len(window):
                    return n
        return n

    def delete(self, key: bytes) -> bool:
        """Delete the object of ``key``; ``True`` if it existed.  Two requests (HEAD, DELETE) since
        S3's DELETE does not say, within one deadline.  Raises on a fault or while the breaker is
        open.  Thread-safe."""
        return self._bounded(self._delete, [self.object_key(key)])[0]

    def _delete(self, name: str) -> bool:
        try:
            self._request(self._client.head_object, Key=name)
            self._request(self._client.delete_object, Key=name)
        except KeyError:
            return False
        except Skipped:
            raise ConnectionError(f"S3 endpoint of bucket {self.bucket!r} is failing; delete skipped") from None
        self._count(deletes=1)
        return True

    def drop_namespace(self, ns_id: bytes) -> int:
        """Delete every chunk object of the namespace; how many.  Exactly one namespace: only
        objects named ``<prefix>/<ns hex>/<32 hex digits>`` go, so a tier configured with a
        longer prefix inside this one (``prefix="kv/<ns hex>"``) keeps its objects.  One LIST
        (with a ``/`` delimiter) and one DeleteObjects per 1000 objects, each request within
        ``timeout_s`` (or the caller's deadline).  Raises on a fault.  Thread-safe, but objects
        written concurrently may survive."""
        return self._bounded(self._drop, [self.namespace_prefix(ns_id)])[0]

    def _drop(self, prefix: str) -> int:
        dropped = 0
        try:
            token: dict[str, str] = {}
            while True:
                page = self._request(self._client.list_objects_v2, Prefix=prefix, Delimiter="/",
                                     MaxKeys=_DELETE_BATCH, **token)
                names = [{"Key": obj["Key"]} for obj in page.get("Contents", ())
                         if _CHUNK_NAME.fullmatch(obj["Key"][len(prefix):])]
                if names:
                    resp = self._request(self._client.delete_objects, Delete={"Objects": names, "Quiet": True})
                    if resp.get("Errors"):
                        raise OSError(f"S3 refused to delete {len(resp['Errors'])} objects under {prefix!r}: "
                                      f"{resp['Errors'][0].get('Code')}")
                    dropped += len(names)
                if not page.get("IsTruncated"):
                    break
                token = {"ContinuationToken": page["NextContinuationToken"]}
        except Skipped:
            raise ConnectionError(f"S3 endpoint of bucket {self.bucket!r} is failing; drop skipped") from None
        except KeyError:  # the bucket itself is gone
            pass
        self._count(deletes=dropped)
        return dropped

    def entries(self, ns_id: bytes | None = None) -> Iterator[Entry]:
        """The chunk objects under the prefix (of ``ns_id``): their size and last-modified time
        (the write; S3 keeps no access time), listed 1000 at a time, each request within
        ``timeout_s``.  Objects of other names are not chunks and are left out.  Raises on a fault.
        O(objects)."""
        root = self._root if ns_id is None else self.namespace_prefix(ns_id)
        token: dict[str, str] = {}
        while True:
            try:
                page = self._request(self._client.list_objects_v2, Prefix=root, MaxKeys=_DELETE_BATCH, **token)
            except Skipped:
                raise ConnectionError(f"S3 endpoint of bucket {self.bucket!r} is failing; listing skipped") from None
            except KeyError:         # the bucket itself is gone
                return
            for obj in page.get("Contents", ()):
                ns_hex, _, key_hex = obj["Key"][len(self._root):].partition("/")
                if _NAMESPACE_NAME.fullmatch(ns_hex) and _CHUNK_NAME.fullmatch(key_hex):
                    yield Entry(bytes.fromhex(ns_hex + key_hex), int(obj["Size"]), obj["LastModified"].timestamp())
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    @property
    def used_bytes(self) -> int:
        """0: the bucket is shared and has no budget, and its size would take a listing.  What
        this instance moved is in ``stats()`` (``bytes_written``, ``bytes_read``).  O(1)."""
        return 0

    def stats(self) -> dict[str, int | float]:
        """Request counters, the breaker's state (``breaker_open``: 1 while skipping), how many
        times it opened and probed, and the calls still stuck on threads the pools retired
        (``stuck_calls``).  O(1)."""
        with self._lock:
            counts = dict(self._counts)
        return {**counts, "used_bytes": 0,
                "breaker_open": int(self.breaker.state != "closed"), "breaker_opened": self.breaker.opened,
                "breaker_probes": self.breaker.probes, "stuck_calls": self._pool.stuck + self._ranges.stuck}

    def close(self) -> None:
        """Refuse further requests and stop the pool: queued requests are cancelled, running ones
        end on their own (bounded by their socket timeouts; never waited for, so a hung endpoint
        cannot hang a close).  Idempotent; the bucket keeps its objects."""
        with self._lock:
            self._closed = True
        self._pool.close()
        self._ranges.close()

    def check(self) -> None:
        """The counters add up (every get and put ended in exactly one outcome), the breaker and the
        pools are consistent and object names map back to keys.  O(1)."""
        super().check()
        self.breaker.check()
        self._pool.check()
        self._ranges.check()
        with self._lock:
            c = dict(self._counts)
        assert all(v >= 0 for v in c.values()), f"negative counter in {c}"
        got = c["hits"] + c["misses"] + c["expired"] + c["skipped"] + c["get_errors"] + c["oversize"]
        put = c["stored"] + c["skipped_puts"] + c["put_errors"]
        assert got == c["gets"] and put == c["puts"], f"outcomes != requests in {c}"  # counted together
        assert c["hits"] <= c["gets"] and c["bytes_read"] >= 0 and c["bytes_written"] >= 0
        probe = bytes(range(24))
        name = self.object_key(probe)
        assert name.startswith(self._root) and bytes.fromhex(name[len(self._root):].replace("/", "")) == probe

    def __repr__(self) -> str:
        return (f"S3Tier(s3://{self.bucket}/{self.prefix}, endpoint={self._where}, "
                f"breaker={self.breaker.state})")


def _check_ttl(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def _error_code(e: BaseException) -> str:
    """The S3 error code of a botocore ``ClientError`` (``"404"``, ``"NoSuchKey"``, ...), else ``""``."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def _total_size(resp: Mapping[str, Any], got: int) -> int:
    """The object's full size from a (possibly ranged) GET response."""
    content_range = resp.get("ContentRange")
    if content_range and "/" in content_range:
        return int(content_range.rsplit("/", 1)[1])
    return got


def _wait_all(futures: Sequence[Future[T]]) -> list[T]:
    """Results of every future, in order; the first exception is raised after all finished."""
    error: BaseException | None = None
    results: list[Any] = []
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others finished
            error = error or e
            results.append(None)
    if error is not None:
        raise error
    return results


def _leading_true(values: Sequence[Any]) -> int:
    n = 0
    while n < len(values) and values[n]:
        n += 1
    return n
