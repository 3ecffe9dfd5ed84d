"""radixkv's series in ``vllm serve``'s own ``/metrics``: the connector's ``build_prom_metrics`` hook.

vLLM's stat logger (in its API server's process) builds one ``KVConnectorPromMetrics`` per
connector class, with vLLM's metric classes (``metric_types``: prometheus-client's, or Ray's) and
its labels (``model_name``, ``engine``), and calls ``observe`` with what the workers' and the
scheduler's ``get_kv_connector_stats`` sent since the last step.  So the series cross processes as
numbers:

* in each worker, a ``Tally`` (``radixkv.fleet.metrics``: the series as plain numbers) watches the
  worker's ``TierStack``; the connector's ``stats()`` carries its samples (``worker_series``) under
  ``"metrics"``, and ``get_kv_connector_stats`` sends their change since the last step (vLLM sums
  the workers' changes: tensor-parallel ranks add up);
* ``RadixKVPromMetrics.observe`` moves vLLM-typed series by those changes: counters by their
  increase, gauges to the running sum, histograms bucket by bucket (exactly, through the child's
  buckets where the class is prometheus-client's; else one observation at each bucket's upper
  bound, so counts and buckets are exact and only the sum is rounded up).

The series are those of ``radixkv.fleet.metrics.SERIES`` that a stack has (not the pool's: the pool is
vLLM's, and its own ``vllm:prefix_cache_*`` series cover it), with vLLM's labels in place of
``namespace``/``instance`` and the series' own (``tier``, ``kind``) after them.  **Multiprocess
mode** (``PROMETHEUS_MULTIPROC_DIR``, which vLLM sets with several API servers): only metric
objects of vLLM's classes are used, no custom collector (a multiprocess registry reads only the
metric files), and gauges are ``mostrecent`` as vLLM's own; ``tests/integrations/test_vllm_metrics.py`` renders
them through prometheus-client's ``MultiProcessCollector``.
"""

from __future__ import annotations

import importlib
import weakref
from typing import TYPE_CHECKING, Any

from radixkv.fleet.metrics import SERIES, Series, Tally

if TYPE_CHECKING:
    from radixkv.core.stack import TierStack

__all__ = ["RadixKVPromMetrics", "build_prom_metrics", "worker_series"]

_WORKER_TALLIES: weakref.WeakKeyDictionary[Any, Tally] = weakref.WeakKeyDictionary()
_PREFIX = "metrics."          # where the series' keys live in the connector's flat stats


def worker_series(stack: TierStack) -> dict[str, float]:
    """The samples of ``stack``'s series as ``{"name|label=value,...": value}`` without
    ``namespace``/``instance``, from a ``Tally`` (plain numbers: nothing in the worker's process
    lands in vLLM's multiprocess metric files).  The first call attaches it to the stack: call it
    when the stack is built, so that no event is missed.  O(series) plus the stack's scrape."""
    tally = _WORKER_TALLIES.get(stack)
    if tally is None:
        tally = _WORKER_TALLIES[stack] = Tally()
        tally.attach(stack, instance="")
    return tally.samples(labelled=False)


def is_series_key(name: str) -> bool:
    """Whether a flat stats key is one of the series (left out of vLLM's log line).  O(1)."""
    return name.startswith(_PREFIX)


_CONNECTOR_SERIES = tuple(s for s in SERIES if not s.pool)


def _family(sample_name: str) -> tuple[Series, str] | None:
    """The series a sample belongs to, and the sample's suffix (``""``, ``_bucket``, ``_sum``, ``_count``)."""
    for s in _CONNECTOR_SERIES:
        if sample_name == s.name:
            return s, ""
        if s.kind == "histogram" and sample_name.startswith(s.name + "_"):
            return s, sample_name[len(s.name):]
    return None


def _unregister_ours() -> None:
    """Drop radixkv's series from prometheus-client's global registry: vLLM rebuilds its stat
    logger (and so this) in one process, e.g. in tests; its own are dropped by name likewise."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # pragma: no cover - vLLM depends on prometheus-client
        return
    for collector, names in list(REGISTRY._collector_to_names.items()):
        if any(n.startswith("radixkv_") for n in names):
            REGISTRY.unregister(collector)


_base: Any = None
try:
    _base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics").KVConnectorPromMetrics
except ImportError:  # pragma: no cover - exercised where vLLM is not installed
    _base = object


class RadixKVPromMetrics(_base):  # type: ignore[misc,valid-type]
    """The series on vLLM's metric classes; see the module docstring.  ``observe`` is O(samples)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_ours()
        self._metrics: dict[str, Any] = {}
        self._buckets: dict[str, tuple[float, ...]] = {}
        from radixkv.fleet.metrics import LATENCY_BUCKETS

        for s in _CONNECTOR_SERIES:
            labels = [*labelnames, *s.labels]
            if s.kind == "counter":
                self._metrics[s.name] = self._counter_cls(name=s.base, documentation=s.doc, labelnames=labels)
            elif s.kind == "gauge":
                self._metrics[s.name] = self._gauge_cls(name=s.name, documentation=s.doc, labelnames=labels,
                                                        multiprocess_mode="mostrecent")
            else:
                self._metrics[s.name] = self._histogram_cls(name=s.name, documentation=s.doc, labelnames=labels,
                                                            buckets=list(LATENCY_BUCKETS))
                self._buckets[s.name] = LATENCY_BUCKETS
        self._gauges: dict[tuple[int, str], float] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Move the series by the changes in ``transfer_stats_data`` (keys ``metrics.<sample>|<labels>``;
        other keys are the connector's own counters, for the log line)."""
        engine = list(self.per_engine_labelvalues[engine_idx])
        hist: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
        for key, delta in transfer_stats_data.items():
            if not is_series_key(key) or not isinstance(delta, (int, float)):
                continue
            sample, _, text = key[len(_PREFIX):].partition("|")
            found = _family(sample)
            if found is None:
                continue
            series, suffix = found
            labels = dict(part.split("=", 1) for part in text.split(",") if part)
            values = [labels.get(name, "") for name in series.labels]
            if series.kind == "counter":
                if delta > 0:
                    self._metrics[series.name].labels(*engine, *values).inc(delta)
            elif series.kind == "gauge":
                total = self._gauges[(engine_idx, key)] = self._gauges.get((engine_idx, key), 0.0) + delta
                self._metrics[series.name].labels(*engine, *values).set(total)
            else:
                entry = hist.setdefault((series.name, tuple(values)), {"buckets": {}, "sum": 0.0})
                if suffix == "_bucket":
                    entry["buckets"][float(labels["le"])] = delta
                elif suffix == "_sum":
                    entry["sum"] = delta
        for (name, label_values), entry in hist.items():
            self._observe_buckets(self._metrics[name].labels(*engine, *label_values), self._buckets[name],
                                  entry["buckets"], entry["sum"])

    @staticmethod
    def _observe_buckets(child: Any, bounds: tuple[float, ...], cumulative: dict[float, float], total: float) -> None:
        """Add to a histogram child the observations whose cumulative bucket counts grew by
        ``cumulative`` (``le`` -> increase) and whose sum grew by ``total``."""
        counts, below = [], 0.0
        for le in (*bounds, float("inf")):
            up_to = cumulative.get(le, below)
            counts.append(max(0.0, up_to - below))
            below = max(below, up_to)
        if not any(counts):
            return
        buckets, sum_value = getattr(child, "_buckets", None), getattr(child, "_sum", None)
        if buckets is not None and sum_value is not None and len(buckets) == len(counts):
            for bucket, n in zip(buckets, counts):
                if n:
                    bucket.inc(n)
            sum_value.inc(max(0.0, total))
            return
        for le, n in zip((*bounds, 2 * bounds[-1]), counts):     # past the last bound: in +Inf
            for _ in range(int(n)):
                child.observe(le)


def build_prom_metrics(vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> RadixKVPromMetrics:
    """What ``RadixKVConnector.build_prom_metrics`` returns.  O(series)."""
    return RadixKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
