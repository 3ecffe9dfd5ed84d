"""The storage backends below the GPU pool, one module each, and a registry that builds them by name.

Each backend implements ``radixkv.core.tier.Tier`` (re-exported here with the rest of the tier
interface, the deadline bounds of ``radixkv.core.deadline`` and the worker pool of
``radixkv.core.workers``, so a backend author imports one package).  Backends register by name and
load lazily, so ``import radixkv.backends`` needs no optional dependency::

    >>> from radixkv import backends
    >>> tier = backends.create("memory")
    >>> tier.put(bytes(24), b"blob"), bytes(tier.get(bytes(24)))
    (True, b'blob')

``CpuTier``, ``LmdbTier``, ``S3Tier`` and ``RedisTier`` are attributes of this package that import
their module (and its dependency) on first use.  The peer tier is part of the peer-to-peer feature
(``radixkv.p2p.tier``) and registers itself as ``"peer"`` when that package is imported.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from radixkv.core.deadline import (DeadlineExceeded, OversizeBlob, bounded, current_deadline, current_max_blob_bytes,
                                   report_oversize)
from radixkv.core.tier import (KEY_BYTES, NAMESPACE_BYTES, Blob, Entry, EvictionLog, MemoryTier, Tier, blob_view,
                               check_key, check_namespace_id, count_leading, redact)
from radixkv.core.workers import BoundedPool

__all__ = ["KEY_BYTES", "NAMESPACE_BYTES", "Blob", "BoundedPool", "DeadlineExceeded", "Entry", "EvictionLog",
           "MemoryTier", "OversizeBlob", "Tier", "available", "blob_view", "bounded", "check_key",
           "check_namespace_id", "count_leading", "create", "current_deadline", "current_max_blob_bytes", "redact",
           "register", "report_oversize"]


# name -> "module:attribute" (imported on first use) or a factory.
_REGISTRY: dict[str, str | Callable[..., Tier]] = {
    "memory": "radixkv.core.tier:MemoryTier",
    "cpu": "radixkv.backends.cpu:CpuTier",
    "lmdb": "radixkv.backends.lmdb:LmdbTier",
    "s3": "radixkv.backends.s3:S3Tier",
    "redis": "radixkv.backends.redis:RedisTier",
}
_LAZY_CLASSES = {"CpuTier": "radixkv.backends.cpu", "LmdbTier": "radixkv.backends.lmdb",
                 "S3Tier": "radixkv.backends.s3", "RedisTier": "radixkv.backends.redis"}


def register(name: str, factory: str | Callable[..., Tier]) -> None:
    """Make ``create(name, ...)`` build a tier with ``factory``: a callable, or ``"module:attr"``
    imported on first use (so registering costs no import).  Replaces an earlier registration."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if isinstance(factory, str) and ":" not in factory:
        raise ValueError(f"factory must be a callable or 'module:attribute', got {factory!r}")
    _REGISTRY[name] = factory


def available() -> list[str]:
    """Registered tier names (their dependencies may still be missing)."""
    return sorted(_REGISTRY)


def create(name: str, **kwargs: Any) -> Tier:
    """Build the tier registered as ``name`` with ``kwargs``; imports its backend on first use.

    >>> create("memory").used_bytes
    0
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no tier named {name!r}; registered: {', '.join(available())}") from None
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(**kwargs)


def __getattr__(name: str) -> Any:
    if name in _LAZY_CLASSES:
        value = getattr(importlib.import_module(_LAZY_CLASSES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixkv.backends' has no attribute {name!r}")
