"""Prometheus metrics for radixkv, fed by the observer seam (``radixkv.core.observe``).

Three ways in:

* **Any engine**: ``server = radixkv.fleet.metrics.serve(9400, cache)`` starts an HTTP server whose
  ``/metrics`` a Prometheus server scrapes (``server.close()`` stops it); several caches share
  one with ``server.exporter.attach(other_cache, instance="gpu1")``.
* **vLLM**: ``RadixKVConnector.build_prom_metrics`` puts the same series (minus the pool's, which
  is vLLM's) into ``vllm serve``'s own ``/metrics`` (``radixkv.integrations._vllm_metrics``).
* **Any HTTP server** (the fleet router's ``/metrics``): ``exposition(registry)`` renders a
  registry's text; ``Exporter(registry)`` puts the series on a registry of the caller's.

An ``Exporter`` owns the series on one ``prometheus_client.CollectorRegistry``.  ``attach(cache)``
adds a ``CacheMetrics`` listener to the cache's observers: counters and latency histograms move as
events happen (each event O(1), a few dict operations and a lock, on the thread that reports it),
while occupancy, capacity, breaker state, queue depth and the tiers' own counters are read at scrape
time by a collector (``cache.stats()`` once per scrape: O(num_pages), plus one ``stats()`` per
tier).  Every series carries the labels ``namespace`` (the model id: bounded, never the salt, so a
tenant per salt does not grow the label set) and ``instance`` (default: ``host:pid``); a Prometheus
server that scrapes it should ``honor_labels: true`` to keep ``instance`` as given.  ``SERIES`` lists
every series, its labels and what it means (the README's table is made from it).

Needs ``prometheus-client`` (``pip install 'radixkv[metrics]'``); importing this module does not.
"""

from __future__ import annotations

import bisect
import os
import socket
import threading
from typing import TYPE_CHECKING, Any, Iterator, Mapping, NamedTuple, Sequence

from radixkv.core.observe import Listener

if TYPE_CHECKING:
    from radixkv.core.cache import PrefixCache
    from radixkv.core.stack import TierStack

__all__ = ["LATENCY_BUCKETS", "SERIES", "CacheMetrics", "Exporter", "MetricsServer", "Series", "Tally", "exposition",
           "serve", "snapshot"]

#: Histogram buckets of the lookup, load and store latencies (seconds): 50 µs (a CPU-tier read)
#: to 10 s (a remote deadline).
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
#: The labels every series carries.
BASE_LABELS = ("namespace", "instance")
FAULTS = ("corrupt", "forged", "timeout", "error")


class Series(NamedTuple):
    """One metric family: its exposed ``name`` (with ``_total`` for counters), ``kind``
    (``counter``, ``gauge`` or ``histogram``), its labels beyond ``BASE_LABELS``, what it means,
    ``scrape`` (read at scrape time from ``stats()``, rather than moved by events) and ``pool``
    (about the pool: a level radixkv has only where it owns the pool, not under vLLM)."""

    name: str
    kind: str
    labels: tuple[str, ...]
    doc: str
    scrape: bool = False
    pool: bool = False

    @property
    def base(self) -> str:
        """The name without ``_total`` (what ``prometheus_client`` takes for a counter)."""
        return self.name.removesuffix("_total")


SERIES: tuple[Series, ...] = (
    Series("radixkv_requests_total", "counter", (), "Requests looked up (matches and opens).", pool=True),
    Series("radixkv_query_tokens_total", "counter", (), "Prompt tokens of those requests.", pool=True),
    Series("radixkv_hit_tokens_total", "counter", ("level",),
           "Prompt tokens served from each level: the pool, then each tier (loaded into the pool).", pool=True),
    Series("radixkv_miss_tokens_total", "counter", ("level",),
           "Prompt tokens that reached a level and were not found there (the pool is asked for "
           "every token, each tier for what the levels above did not have).", pool=True),
    Series("radixkv_saved_tokens_total", "counter", (),
           "Prompt tokens the engine did not compute: the hits of every level.", pool=True),
    Series("radixkv_hit_chunks_total", "counter", ("tier",), "Chunks a tier delivered intact to a load."),
    Series("radixkv_miss_chunks_total", "counter", ("tier",),
           "Chunk keys a lookup asked a tier for that it did not hold."),
    Series("radixkv_read_bytes_total", "counter", ("tier",), "KV bytes loaded (decoded) from a tier."),
    Series("radixkv_written_bytes_total", "counter", ("tier",), "Blob bytes a tier accepted in stores."),
    Series("radixkv_stored_chunks_total", "counter", ("tier",), "Chunks a tier accepted in stores."),
    Series("radixkv_faults_total", "counter", ("tier", "kind"),
           "Reads and writes that failed, by kind: corrupt (a blob that did not verify; deleted), forged "
           "(a blob without a valid MAC under the secret; deleted), timeout (past the request's "
           "deadline), error (any other fault of the tier). Each is a miss, never an error in the engine."),
    Series("radixkv_lookup_seconds", "histogram", ("tier",), "Time of one lookup round trip to a tier."),
    Series("radixkv_load_seconds", "histogram", ("tier",),
           "Time of one load: a remote fetch of a window of chunks, or a local tier's read of one chunk."),
    Series("radixkv_store_seconds", "histogram", ("tier",), "Time of one batched write to a tier."),
    Series("radixkv_evicted_pages_total", "counter", ("level",),
           "Pages the pool let go: LRU evictions (level pool) and sliding-window pages leaving "
           "every window (level pool:sliding).", pool=True),
    Series("radixkv_evicted_chunks_total", "counter", ("tier",),
           "Chunks a tier evicted to make room (its own count).", scrape=True),
    Series("radixkv_oversize_total", "counter", ("tier",),
           "Stored objects a remote tier refused to download for being larger than a chunk (bad entries).",
           scrape=True),
    Series("radixkv_dropped_writes_total", "counter", (),
           "Writes (stores, promotions, refreshes) dropped because the write queue was full.", scrape=True),
    Series("radixkv_write_queue_depth", "gauge", (), "Bytes of KV waiting in the write queue now.", scrape=True),
    Series("radixkv_write_queue_capacity", "gauge", (), "The write queue's bound, in bytes.", scrape=True),
    Series("radixkv_used_bytes", "gauge", ("level",),
           "Bytes a level holds now: the pool's cached pages, a tier's entries by its own accounting "
           "(0 for a shared S3 bucket or Redis server).", scrape=True),
    Series("radixkv_capacity_bytes", "gauge", ("level",),
           "A level's byte budget (absent for unbounded tiers).", scrape=True),
    Series("radixkv_entries", "gauge", ("tier",), "Chunks a tier holds now (tiers that count them).", scrape=True),
    Series("radixkv_pool_pages", "gauge", ("state",),
           "Pool pages by state: free, cached (held by the tree) or engine (allocated, not cached).",
           scrape=True, pool=True),
    Series("radixkv_breaker_open", "gauge", ("tier",),
           "1 while a remote tier's circuit breaker skips requests (open or probing), else 0.", scrape=True),
    Series("radixkv_approximate_requests_total", "counter", (),
           "Requests whose cached KV a lossy codec approximated (a load from a tier with codec int8 or "
           "cachegen, or pool pages such a load filled); the others' KV is exact.", scrape=True, pool=True),
    Series("radixkv_lossy_chunks_total", "counter", ("tier",),
           "Chunks a tier delivered coded by a lossy codec (approximate KV).", scrape=True),
    Series("radixkv_hit_rate", "gauge", (),
           "Hit tokens over query tokens since start (prefer rate(hit)/rate(query) in queries).",
           scrape=True, pool=True),
)
_BY_NAME = {s.name: s for s in SERIES}


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ImportError("radixkv.fleet.metrics needs prometheus-client: pip install 'radixkv[metrics]'") from None
    return prometheus_client


def default_instance() -> str:
    """``host:pid``: what tells one engine process from another.  O(1)."""
    return f"{socket.gethostname()}:{os.getpid()}"


class CacheMetrics(Listener):
    """The listener ``Exporter.attach`` adds to one cache's (or tier stack's) observers: it moves
    the event-fed series of ``SERIES`` under its own ``namespace``/``instance`` labels.  Each event
    O(levels).  Thread-safe (events come from the engine's, the writer's and load workers' threads).
    """

    def __init__(self, exporter: _Watcher, target: Any, namespace: str, instance: str,
                 levels: Sequence[str]) -> None:
        self.exporter = exporter
        self.target = target
        self.labels = (namespace, instance)
        #: The levels in lookup order (``"pool"`` first where the cache owns it, then the tiers).
        self.levels = tuple(levels)
        self._lock = threading.Lock()
        self.requests = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        m = exporter._families
        ns = self.labels
        self._requests = m["radixkv_requests_total"].labels(*ns)
        self._query = m["radixkv_query_tokens_total"].labels(*ns)
        self._saved = m["radixkv_saved_tokens_total"].labels(*ns)
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, name: str, *values: str) -> Any:
        key = (name, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.exporter._families[name].labels(*self.labels, *values)
        return child

    def pages(self, level: str, held: int, dropped: int) -> None:
        """Count the ``dropped`` pages in ``radixkv_evicted_pages_total`` (pages held are not a
        counter).  O(1)."""
        if dropped:
            self._child("radixkv_evicted_pages_total", level).inc(dropped)

    def chunks(self, level: str, namespace: bytes, held: Sequence[bytes], dropped: Sequence[bytes]) -> None:
        """Count the chunks stored at ``level`` in ``radixkv_stored_chunks_total``, every namespace
        together.  O(1)."""
        if held:
            self._child("radixkv_stored_chunks_total", level).inc(len(held))

    def io(self, level: str, op: str, seconds: float, nbytes: int, items: int, outcome: str) -> None:
        """A fault counts in ``radixkv_faults_total`` by outcome (a failed lookup's time still in
        ``radixkv_lookup_seconds``); else a lookup's time, a miss's chunks, a load's chunks, bytes and
        time, or a store's time and bytes go to their families.  O(1)."""
        if outcome != "ok":
            self._child("radixkv_faults_total", level, outcome).inc()
            if op == "lookup":
                self._child("radixkv_lookup_seconds", level).observe(seconds)
            return
        if op == "lookup":
            self._child("radixkv_lookup_seconds", level).observe(seconds)
        elif op == "miss":
            self._child("radixkv_miss_chunks_total", level).inc(items)
        elif op == "load":
            if nbytes:                              # a chunk delivered (local: with its read time)
                self._child("radixkv_hit_chunks_total", level).inc(items)
                self._child("radixkv_read_bytes_total", level).inc(nbytes)
            if seconds > 0:                          # a remote fetch, or a local read
                self._child("radixkv_load_seconds", level).observe(seconds)
        elif op == "store":
            self._child("radixkv_store_seconds", level).observe(seconds)
            self._child("radixkv_written_bytes_total", level).inc(nbytes)

    def served(self, query_tokens: int, by_level: Mapping[str, int]) -> None:
        """Count one request, its query tokens and the tokens found cached at every level together.
        O(levels)."""
        hits = sum(by_level.values())
        with self._lock:
            self.requests += 1
            self.query_tokens += query_tokens
            self.hit_tokens += hits
        self._requests.inc()
        self._query.inc(query_tokens)
        self._saved.inc(hits)
        asked = query_tokens
        for level in self.levels:
            hit = by_level.get(level, 0)
            if hit:
                self._child("radixkv_hit_tokens_total", level).inc(hit)
            if asked > hit:
                self._child("radixkv_miss_tokens_total", level).inc(asked - hit)
            asked -= hit
        for level, hit in by_level.items():
            if level not in self.levels and hit:
                self._child("radixkv_hit_tokens_total", level).inc(hit)

    def hit_rate(self) -> float:
        """Hit tokens over query tokens since attached (0 before any request).  O(1)."""
        with self._lock:
            return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def check(self) -> None:
        """Assert the listener's own counters are consistent.  O(1)."""
        with self._lock:
            assert 0 <= self.hit_tokens <= self.query_tokens, "more hit tokens than query tokens"
            assert self.requests >= 0


class _Watcher:
    """What ``Exporter`` and ``Tally`` share: the event-fed families (``_families``: name ->
    an object whose ``labels(*values)`` has ``inc``/``observe``) and the attached listeners."""

    _families: dict[str, Any]

    def __init__(self) -> None:
        self._attached: list[CacheMetrics] = []
        self._lock = threading.Lock()

    def attach(self, target: PrefixCache | TierStack, *, instance: str | None = None,
               namespace: str | None = None) -> CacheMetrics:
        """Watch ``target`` (a ``PrefixCache``, or a ``TierStack`` of an engine that owns its pool):
        add a ``CacheMetrics`` to its observers and read its gauges at each scrape.  ``namespace``
        defaults to its namespace's model, ``instance`` to ``host:pid``.  Returns the listener.
        ``ValueError`` if it is attached already under the same labels.  O(1)."""
        from radixkv.core.cache import PrefixCache
        from radixkv.core.stack import TierStack

        if isinstance(target, PrefixCache):
            levels = ["pool", *(t.name for t in (target.stack.tiers if target.stack else ()))]
        elif isinstance(target, TierStack):
            levels = [t.name for t in target.tiers]
        else:
            raise TypeError(f"target must be a PrefixCache or a TierStack, got {type(target).__name__}")
        for name, value in (("instance", instance), ("namespace", namespace)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        listener = CacheMetrics(self, target, target.namespace.model if namespace is None else namespace,
                                default_instance() if instance is None else instance, levels)
        with self._lock:
            if any(other.labels == listener.labels for other in self._attached):
                raise ValueError(f"instance: a cache with labels {listener.labels} is attached already")
            self._attached.append(listener)
        target.observers.add(listener)
        return listener

    def detach(self, listener: CacheMetrics) -> bool:
        """Stop watching what ``listener`` watches (its series stay, frozen); whether it was
        attached.  O(attached)."""
        with self._lock:
            if listener not in self._attached:
                return False
            self._attached.remove(listener)
        listener.target.observers.remove(listener)
        return True

    @property
    def attached(self) -> tuple[CacheMetrics, ...]:
        """The listeners attached now."""
        with self._lock:
            return tuple(self._attached)

    def check(self) -> None:
        """Assert every attached listener is consistent and still on its target's observers.  O(attached)."""
        for listener in self.attached:
            listener.check()
            assert listener in list(listener.target.observers), f"{listener.labels}: detached from its target"


class _TallyChild:
    """One labelled series of a ``Tally``: a number, or histogram bucket counts and a sum."""

    def __init__(self, bounds: tuple[float, ...] | None) -> None:
        self.value = 0.0
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1) if bounds is not None else []
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def observe(self, seconds: float) -> None:
        assert self.bounds is not None
        with self._lock:
            self.value += seconds
            self.counts[bisect.bisect_left(self.bounds, seconds)] += 1


class _TallyFamily:
    def __init__(self, bounds: tuple[float, ...] | None) -> None:
        self.bounds = bounds
        self.children: dict[tuple[str, ...], _TallyChild] = {}
        self._lock = threading.Lock()

    def labels(self, *values: str) -> _TallyChild:
        with self._lock:
            child = self.children.get(values)
            if child is None:
                child = self.children[values] = _TallyChild(self.bounds)
            return child


class Tally(_Watcher):
    """The series as plain numbers, without prometheus-client objects: for a process that ships
    them to another (a vLLM worker: under vLLM's multiprocess metrics mode every prometheus-client
    object of a process would land in the shared metric files).  ``samples()`` gives them in
    ``snapshot``'s form.  Each event O(1)."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__()
        self.buckets = tuple(float(b) for b in buckets)
        self._families = {s.name: _TallyFamily(self.buckets if s.kind == "histogram" else None)
                          for s in SERIES if not s.scrape}

    def samples(self, *, labelled: bool = True) -> dict[str, float]:
        """Every sample, ``{"name|label=value,...": value}`` (labels sorted), event-fed and
        scraped; ``labelled`` false leaves ``namespace``/``instance`` out.  O(series) plus a scrape."""
        out: dict[str, float] = {}

        def put(name: str, labels: dict[str, str], value: float) -> None:
            keep = {k: v for k, v in labels.items() if labelled or k not in BASE_LABELS}
            out[f"{name}|{','.join(f'{k}={v}' for k, v in sorted(keep.items()))}"] = float(value)

        for s in SERIES:
            if s.scrape:
                continue
            for values, child in list(self._families[s.name].children.items()):
                labels = dict(zip((*BASE_LABELS, *s.labels), values))
                if s.kind == "counter":
                    put(s.name, labels, child.value)
                    continue
                running = 0
                for le, n in zip((*[repr(b) for b in self.buckets], "+Inf"), child.counts):
                    running += n
                    put(f"{s.name}_bucket", {**labels, "le": le}, running)
                put(f"{s.name}_sum", labels, child.value)
                put(f"{s.name}_count", labels, running)
        by_name = {s.name: s for s in SERIES}
        for listener in self.attached:
            for name, values, value in scraped(listener.target, listener):
                put(name, dict(zip((*BASE_LABELS, *by_name[name].labels), (*listener.labels, *values))), value)
        return out


class Exporter(_Watcher):
    """The radixkv series (``SERIES``) on one registry (default: a new ``CollectorRegistry``, so
    that several exporters in one process never clash), for any number of attached caches.

    >>> import torch
    >>> from radixkv import KVLayout, PrefixCache
    >>> cache = PrefixCache(KVLayout(1, 1, 2, torch.float32, page_size=2), num_pages=8)
    >>> exporter = Exporter()
    >>> _ = exporter.attach(cache, instance="doc")
    >>> m = cache.match([1, 2, 3]); cache.release(m)
    >>> b'radixkv_query_tokens_total{instance="doc",namespace="unnamed"} 3.0' in exporter.render()
    True
    """

    def __init__(self, registry: Any = None, *, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        prom = _client()
        if registry is not None and not isinstance(registry, prom.CollectorRegistry):
            raise TypeError(f"registry must be a prometheus_client.CollectorRegistry, got {type(registry).__name__}")
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] <= 0:
            raise ValueError(f"buckets must be increasing positive seconds, got {buckets!r}")
        self.registry = prom.CollectorRegistry() if registry is None else registry
        self.buckets = tuple(float(b) for b in buckets)
        self._families: dict[str, Any] = {}
        for s in SERIES:
            if s.scrape:
                continue
            labels = (*BASE_LABELS, *s.labels)
            if s.kind == "counter":
                self._families[s.name] = prom.Counter(s.base, s.doc, labels, registry=self.registry)
            else:
                self._families[s.name] = prom.Histogram(s.base, s.doc, labels, registry=self.registry,
                                                        buckets=self.buckets)
        super().__init__()
        self.registry.register(_Collector(self))

    def render(self) -> bytes:
        """The exposition text of the registry (what ``/metrics`` serves).  A scrape: see the
        module docstring for its cost."""
        return exposition(self.registry)[0]



class _Collector:
    """The series read at scrape time (``Series.scrape``) from each attached target's stats."""

    def __init__(self, exporter: Exporter) -> None:
        self.exporter = exporter

    def describe(self) -> list[Any]:
        return []          # nothing to check at registration: the names are radixkv's own

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        for s in SERIES:
            if s.scrape:
                cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                families[s.name] = cls(s.base, s.doc, labels=(*BASE_LABELS, *s.labels))
        for listener in self.exporter.attached:
            for name, values, value in scraped(listener.target, listener):
                families[name].add_metric((*listener.labels, *values), value)
        yield from families.values()


def scraped(target: Any, listener: CacheMetrics | None = None) -> Iterator[tuple[str, tuple[str, ...], float]]:
    """The ``(series name, label values, value)`` of the scrape-time series of a ``PrefixCache``
    or a ``TierStack``: one ``stats()`` call (O(num_pages) for a cache) and one per tier."""
    from radixkv.core.cache import PrefixCache

    if isinstance(target, PrefixCache):
        s = target.stats()
        page_bytes = target.layout.token_bytes * target.page_size
        yield "radixkv_used_bytes", ("pool",), s["pages_cached"] * page_bytes
        yield "radixkv_capacity_bytes", ("pool",), s["pages_total"] * page_bytes
        for state in ("free", "cached", "engine"):
            yield "radixkv_pool_pages", (state,), s[f"pages_{state}"]
        if listener is not None:
            yield "radixkv_hit_rate", (), listener.hit_rate()
        yield "radixkv_approximate_requests_total", (), s["requests_approximate"]
        stacks = target.stacks
    else:
        stacks = [target]
    if not stacks:
        return
    counts = [st.stats() for st in stacks]
    yield "radixkv_dropped_writes_total", (), sum(c["dropped_writes"] for c in counts)
    yield "radixkv_write_queue_depth", (), sum(c["queued_bytes"] for c in counts)
    yield "radixkv_write_queue_capacity", (), sum(st.queue_bytes for st in stacks)
    stack = stacks[0]                        # the tiers are the same objects in every stack
    for i, (tier, own) in enumerate(zip(stack.tiers, stack.tier_stats())):
        name = (tier.name,)
        yield "radixkv_lossy_chunks_total", name, sum(c["lossy_loaded"][i] for c in counts)
        yield "radixkv_used_bytes", name, own.get("used_bytes", 0)
        if own.get("capacity_bytes") is not None:
            yield "radixkv_capacity_bytes", name, own["capacity_bytes"]
        if "entries" in own:
            yield "radixkv_entries", name, own["entries"]
        yield "radixkv_evicted_chunks_total", name, own.get("evictions", 0)
        if "oversize" in own:
            yield "radixkv_oversize_total", name, own["oversize"]
        breaker = getattr(tier, "breaker", None)
        if breaker is not None:
            yield "radixkv_breaker_open", name, float(breaker.state != "closed")


def exposition(registry: Any = None) -> tuple[bytes, str]:
    """The text a ``/metrics`` endpoint serves for ``registry`` (default: ``prometheus_client``'s
    global one) and its ``Content-Type``: for any HTTP server that exposes radixkv's series
    (the fleet router's).  Runs every collector of the registry."""
    prom = _client()
    return prom.generate_latest(prom.REGISTRY if registry is None else registry), prom.CONTENT_TYPE_LATEST


def snapshot(registry: Any) -> dict[str, float]:
    """Every sample of ``registry`` as ``{"name|label=value,...": value}`` (labels sorted;
    ``_created`` samples left out): numbers another process can add up and turn back into series
    (the vLLM connector ships its workers' series this way).  Runs every collector."""
    out: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}|{labels}"] = float(sample.value)
    return out


class MetricsServer:
    """An HTTP server of one ``Exporter``'s ``/metrics`` on a daemon thread (``serve``)."""

    def __init__(self, exporter: Exporter, server: Any, thread: threading.Thread) -> None:
        self.exporter = exporter
        self._server = server
        self._thread = thread
        self.host, self.port = server.server_address[:2]

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and detach every listener.  Idempotent."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.shutdown()
        server.server_close()
        for listener in self.exporter.attached:
            self.exporter.detach(listener)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(port: int, cache: PrefixCache | TierStack, host: str = "127.0.0.1", *, instance: str | None = None,
          registry: Any = None) -> MetricsServer:
    """Serve ``cache``'s series on ``http://host:port/metrics`` (``port=0``: any free port, see
    ``.port``) from a daemon thread; ``registry`` (default: a new one) and ``instance`` as in
    ``Exporter``/``attach``.  Loopback by default: the series name models and tiers, so expose
    them further on purpose.  Returns the server (``close()`` stops it).  Cost: a thread; each
    scrape as ``Exporter.render``."""
    from radixkv.core._checks import check_int

    check_int(port, "port", 0, 65535)
    if not isinstance(host, str) or not host:
        raise TypeError(f"host must be a non-empty str, got {host!r}")
    exporter = Exporter(registry)
    exporter.attach(cache, instance=instance)
    server, thread = _client().start_http_server(port, addr=host, registry=exporter.registry)
    return MetricsServer(exporter, server, thread)
