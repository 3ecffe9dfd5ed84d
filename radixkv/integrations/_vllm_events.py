"""The vLLM connector's KV events: what radixkv's tiers hold, in vLLM's own event stream.

With ``--kv-events-config`` (``enable_kv_cache_events``) vLLM publishes what its GPU prefix cache
stores and drops; the connector adds what radixkv's tiers below it hold, through vLLM's hooks:

* **Names.**  A chunk's events name the vLLM blocks it covers with the hashes vLLM itself gave
  them (``request.block_hashes``, in vLLM's external form: ``maybe_convert_block_hash``), so they
  match vLLM's GPU events whatever the hash algorithm, seed, cache salt, LoRA or multimodal
  input.  The scheduler side sends them down with each store (``Store.names``/``parent``); the
  worker remembers them per chunk key (``radixkv.fleet.publish.Names``) to name later removals.
* **Events.**  The worker's tier stack tells the observer seam what each tier now holds or dropped
  (stores it accepted, evictions the CPU tier and LMDB made, bad entries deleted); a
  ``radixkv.fleet.publish.KVEvents`` listener turns that into ``BlockStored``/``BlockRemoved``
  with ``medium`` ``"CPU"`` (the CPU tier) or ``"STORAGE"`` (LMDB).  Remote tiers are not told
  (shared by every instance: see ``radixkv.fleet.publish``).
* **Way up.**  Each step the worker hands its events to vLLM
  (``get_kv_connector_kv_cache_events``, a ``RadixKVEvents``); vLLM gathers the workers' into the
  scheduler's connector (``update_connector_output``), whose ``take_events`` vLLM publishes in the
  same batch as its own.  With tensor parallelism every rank stores its own shard of the same
  chunks: only the events every rank reported go out (vLLM's ``KVEventAggregator``, as LMCache's
  connector does), so a block is told stored once all its shards are.

Everything here runs only when vLLM's KV events are on; otherwise nothing is named or buffered.
Events of a stack's writer thread wait in a buffer (at most ``MAX_BUFFERED``; past that the
oldest are dropped and counted in ``dropped_events``) until the next step takes them.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections import deque
from typing import Any, Callable, Iterable

from radixkv.fleet.publish import KVEvents

__all__ = ["MAX_BUFFERED", "RadixKVEvents", "WorkerEvents", "events_enabled", "make_events", "take_from_output"]

log = logging.getLogger(__name__)

#: Events a worker keeps for vLLM's next step at most.
MAX_BUFFERED = 100_000


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def block_hash_converter() -> Callable[[Any], Any]:
    """vLLM's conversion of a block hash to the form its events carry."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash


try:  # vLLM's names, looked up at run time (the module imports without vLLM)
    _kv: Any = importlib.import_module("vllm.distributed.kv_events")
    _EventsBase: Any = _kv.KVConnectorKVEvents
except ImportError:  # pragma: no cover - exercised where vLLM is not installed
    _kv, _EventsBase = None, object


def make_events(events: Iterable[Any], num_workers: int = 1) -> RadixKVEvents:
    """A ``RadixKVEvents`` holding ``events`` (vLLM's structs) from ``num_workers`` workers."""
    out = RadixKVEvents(num_workers)
    out.add_events(list(events))
    return out


class RadixKVEvents(_EventsBase):  # type: ignore[misc]
    """radixkv's tier events of one step (vLLM's ``KVConnectorKVEvents``), from one or more
    workers; ``aggregate`` keeps those every worker reported (vLLM's ``KVEventAggregator``).
    Pickled across vLLM's processes (a module-level class for that)."""

    def __init__(self, num_workers: int) -> None:
        self._aggregator = _kv.KVEventAggregator(num_workers)

    def add_events(self, events: list[Any]) -> None:
        """Add ``events`` (vLLM's structs) as one or more workers reported them.  vLLM's
        ``KVOutputAggregator`` calls it to gather every worker's events into the first worker's, and the
        scheduler side (``take_from_output``) to add each step's to those it holds.  O(len(events))."""
        self._aggregator.add_events(events)

    def aggregate(self) -> RadixKVEvents:
        """Keep only the events every worker reported, each once, and count one worker again: with tensor
        parallelism a block is told stored once every rank stored its shard.  Returns ``self``.  The
        connector's ``take_events`` calls it before it hands the events to vLLM.  O(distinct events)."""
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        """Count ``count`` more workers (``ValueError`` unless positive); ``aggregate`` keeps an event only
        when that many reported it.  vLLM's ``KVOutputAggregator`` calls it with 1 for each worker whose
        events it adds, ``take_from_output`` with the workers of each step's events.  O(1)."""
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        """Every event held, once per worker that reported it (once each after ``aggregate``).  vLLM's
        ``KVOutputAggregator`` calls it to move a worker's events into the first worker's, and the
        connector's ``take_events`` to hand them to vLLM.  O(events)."""
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        """How many workers these events came from (1 after ``aggregate`` or ``clear_events``).
        ``take_from_output`` calls it to add a step's workers to those it holds.  O(1)."""
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        """Drop every event and count one worker again (vLLM's ``KVConnectorKVEvents`` interface; the
        connector lets a taken batch go instead of clearing it).  O(distinct events)."""
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


class WorkerEvents:
    """A worker's tier events for vLLM (see the module docstring): attach to the worker's stack,
    ``name`` each chunk before it is stored, ``take`` the step's events.  Thread-safe."""

    def __init__(self, stack: Any, *, block_size: int) -> None:
        self._kv = _kv
        self._buffer: deque[Any] = deque()
        self._lock = threading.Lock()
        self.dropped_events = 0
        self._failed = False
        self.listener = KVEvents(self._sink, namespace=None, chunk_size=stack.chunk_size, names=None,
                                 block_size=block_size)
        stack.observers.add(self.listener)

    def name(self, key: bytes, hashes: Any, parent: Any) -> None:
        """Chunk ``key`` covers the vLLM blocks ``hashes`` (after ``parent``).  O(1)."""
        self.listener.names.add(key, hashes, parent)

    def _sink(self, events: list[Any]) -> None:
        import msgspec

        kv = self._kv
        converted = [getattr(kv, type(e).__name__)(**msgspec.structs.asdict(e)) for e in events]
        with self._lock:
            self._buffer.extend(converted)
            while len(self._buffer) > MAX_BUFFERED:
                self._buffer.popleft()
                self.dropped_events += 1

    def take(self) -> RadixKVEvents | None:
        """The events since the last call as a ``RadixKVEvents``, or ``None`` if there are none
        (or after a fault, logged once: events are never worth a step of the engine)."""
        with self._lock:
            if not self._buffer:
                return None
            events, self._buffer = list(self._buffer), deque()
        try:
            return make_events(events)
        except Exception:  # noqa: BLE001 - never into the engine
            if not self._failed:
                self._failed = True
                log.exception("radixkv: the tiers' KV events could not be handed to vLLM; dropped")
            self.dropped_events += len(events)
            return None


def take_from_output(held: Any, kv_cache_events: Any) -> Any:
    """The scheduler side's ``update_connector_output``: ``kv_cache_events`` (the workers',
    gathered by vLLM) added to ``held`` (the events not yet taken, or ``None``); returns what to
    hold now."""
    if kv_cache_events is None or not hasattr(kv_cache_events, "get_all_events"):
        return held
    if held is None:
        return kv_cache_events
    held.add_events(kv_cache_events.get_all_events())
    held.increment_workers(kv_cache_events.get_number_of_workers())
    return held
