"""Configuration: one flat mapping (a dict, a YAML or JSON file, or the file ``RADIXKV_CONFIG`` names)
that builds a ``PrefixCache`` with its tier stack.  The keys follow LMCache's where they mean the same:

.. code-block:: yaml

    chunk_size: 256              # tokens per stored chunk (a multiple of page_size)
    page_size: 16
    num_pages: 50000             # the pool, in pages (or pool_tokens: token slots)
    device: cuda
    local_cpu: true              # a CpuTier (pinned memory where an accelerator exists) ...
    max_local_cpu_size: 5.0      # ... of this many GB
    cache_policy: lru            # the CPU tier's policy: lru, s3fifo (scan-resistant) or second_hit
    exclusive: true              # the CPU tier holds only what the pool evicted (false: copies too)
    local_disk: /nvme/radixkv    # an LmdbTier at this path (file:// allowed) ...
    max_local_disk_size: 200     # ... of this many GB
    local_disk_ttl: 86400        # seconds, optional
    local_disk_admission: second_hit   # store a chunk on disk only the second time it comes (or none)
    remote_url: s3://bucket/kv   # an S3Tier, shared by every instance of the namespace ...
    remote_endpoint: http://127.0.0.1:9000   # optional (MinIO, Ceph, a test server)
    # remote_url: redis://cache-host:6379/0  # ... or a RedisTier (redis:// or rediss:// for TLS)
    remote_timeout: 2.0          # seconds: the bound of a request's lookup and load on every remote tier and peer
    max_write_queue_size: 1.0    # GB of KV waiting to be written down the tiers (more is dropped, counted)
    remote_required: false       # true: refuse to start while the remote tier is unreachable
    local_disk_required: false   # true: refuse to start when local_disk cannot be opened
    secret: ...                  # deployment secret: every chunk carries a MAC (prefer RADIXKV_SECRET)
    previous_secret: ...         # the secret before a rotation, still accepted on read
    encrypt: false               # AES-GCM for the remote tier's chunks (needs secret)
    codec: none                  # how the disk and remote tiers write chunks: none, zstd (lossless),
                                 # int8 or cachegen (lossy, opt-in, counted apart); the CPU tier stays raw
    local_disk_codec: cachegen   # per tier, overriding codec (remote_codec likewise)
    p2p_enabled: false           # true: read other instances' CPU tiers, and serve ours (radixkv.p2p.node) ...
    p2p_controller: tcp://10.0.0.2:5600   # ... the controller (python -m radixkv controller); needs secret
    p2p_address: tcp://10.0.0.5:5601      # this instance's request channel (bound; port 0: any); none: serve nothing
    p2p_instance: engine-a       # this instance's id (default: host name and process id)
    p2p_transport: nixl          # nixl (one READ per batch) or zmq (the bytes in the answer); nixl falls back to zmq
    peer_codec: int8             # ask peers to code what they send (their CPU time for fewer bytes; none: raw, the default)
    write_policy: write_through  # or write_back
    promote: true                # copy lower-tier hits into the tiers above
    namespace: {model: meta-llama/Llama-2-7b-hf, revision: main, salt: tenant-a}

The cache is an accelerator, never a dependency: by default an engine starts whatever its tiers
do.  A remote endpoint (S3 or Redis) that does not answer at start-up is logged once, serves every
lookup as a miss, and is taken into use when it answers (its circuit breaker probes it in the
background); a ``local_disk`` that cannot be opened (read-only, a missing parent) is left out, with
a warning.  ``remote_required`` / ``local_disk_required`` turn either into an error at start-up.

Sizes are in GB (10**9 bytes), as in LMCache.  ``secret`` and ``previous_secret`` are never shown
in the config's ``repr``; without them the ``RADIXKV_SECRET`` / ``RADIXKV_PREVIOUS_SECRET``
environment variables are used (the better place for a secret than a file).  Unknown keys and contradictions (a size without its
tier, ``local_cpu: false`` with a CPU size) are a ``ValueError`` naming the key.  The KV layout comes
from the model, so it is an argument, or a ``layout`` mapping (num_layers, num_kv_heads, head_dim,
dtype) in the file.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from radixkv.core._checks import check_int
from radixkv.core.hashing import Namespace
from radixkv.core.pool import KVLayout

if TYPE_CHECKING:
    from radixkv.core.tier import Tier
    from radixkv.core.cache import PrefixCache
    from radixkv.core.stack import TierStack

__all__ = ["CacheConfig", "load_config", "read_mapping"]

log = logging.getLogger(__name__)
ENV_VAR = "RADIXKV_CONFIG"
_GB = 10**9
_NAMESPACE_KEYS = {"model", "revision", "tp_rank", "tp_size", "lora_id", "salt"}
_LAYOUT_KEYS = {"num_layers", "num_kv_heads", "head_dim", "dtype", "v_head_dim", "windows"}


@dataclass(frozen=True)
class CacheConfig:
    """A validated configuration (see the module docstring for the keys)."""

    chunk_size: int = 256
    page_size: int = 16
    num_pages: int | None = None
    pool_tokens: int | None = None
    device: str = "cpu"
    local_cpu: bool = False
    max_local_cpu_size: float | None = None
    local_disk: str | None = None
    max_local_disk_size: float | None = None
    local_disk_ttl: float | None = None
    remote_url: str | None = None
    remote_endpoint: str | None = None
    remote_timeout: float = 2.0
    max_write_queue_size: float = 1.0
    remote_required: bool = False
    local_disk_required: bool = False
    secret: str | None = field(default=None, repr=False)
    previous_secret: str | None = field(default=None, repr=False)
    encrypt: bool = False
    write_policy: str = "write_through"
    promote: bool = True
    exclusive: bool = True
    cache_policy: str = "lru"
    local_disk_admission: str = "none"
    namespace: Mapping[str, Any] = field(default_factory=dict)
    layout: Mapping[str, Any] | None = None
    p2p_enabled: bool = False
    p2p_controller: str | None = None
    p2p_address: str | None = None
    p2p_instance: str | None = None
    p2p_transport: str = "nixl"
    codec: str = "none"
    local_disk_codec: str | None = None
    remote_codec: str | None = None
    peer_codec: str | None = None

    def __post_init__(self) -> None:
        for name in ("chunk_size", "page_size"):
            _positive_int(name, getattr(self, name))
        if self.chunk_size % self.page_size:
            raise ValueError(f"chunk_size: {self.chunk_size} is not a multiple of page_size {self.page_size}")
        if (self.num_pages is None) == (self.pool_tokens is None):
            raise ValueError("num_pages / pool_tokens: give exactly one of them (the pool's size)")
        for name in ("num_pages", "pool_tokens"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.pool_tokens is not None and self.pool_tokens < self.page_size:
            raise ValueError(f"pool_tokens: {self.pool_tokens} is less than one page")
        from radixkv.core.policy import POLICY_NAMES

        if self.cache_policy not in POLICY_NAMES:
            raise ValueError(f"cache_policy must be one of {sorted(POLICY_NAMES)}, got {self.cache_policy!r}")
        if self.local_disk_admission not in ("none", "second_hit"):
            raise ValueError(f"local_disk_admission must be 'none' or 'second_hit', got {self.local_disk_admission!r}")
        for name in ("local_cpu", "promote", "encrypt", "exclusive", "remote_required", "local_disk_required"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("max_local_cpu_size", "max_local_disk_size", "local_disk_ttl", "remote_timeout",
                     "max_write_queue_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.local_cpu and self.max_local_cpu_size is None:
            raise ValueError("max_local_cpu_size: required when local_cpu is true (GB)")
        if not self.local_cpu and self.max_local_cpu_size is not None:
            raise ValueError("max_local_cpu_size: set, but local_cpu is not true")
        if self.local_disk is not None and (not isinstance(self.local_disk, str) or not self.local_disk):
            raise ValueError(f"local_disk must be a path, got {self.local_disk!r}")
        if self.local_disk and self.max_local_disk_size is None:
            raise ValueError("max_local_disk_size: required when local_disk is set (GB)")
        if self.local_disk and os.path.isfile(self.local_disk.removeprefix("file://")):
            raise ValueError(f"local_disk: {self.local_disk!r} is a file; it must name a directory (LMDB keeps "
                             f"its data.mdb and lock.mdb there)")
        if not self.local_disk and (self.max_local_disk_size is not None or self.local_disk_ttl is not None
                                    or self.local_disk_admission != "none"):
            raise ValueError("max_local_disk_size / local_disk_ttl / local_disk_admission: set, but local_disk is not")
        if self.remote_endpoint is not None and self.remote_url is None:
            raise ValueError("remote_endpoint: set, but remote_url is not")
        if self.remote_url is not None:
            if _is_redis(self.remote_url):
                from radixkv.backends.redis import parse_redis_url

                parse_redis_url(self.remote_url)   # a malformed URL fails here, naming remote_url
                if self.remote_endpoint is not None:
                    raise ValueError("remote_endpoint: only for s3:// URLs (a redis:// URL names its server)")
            else:
                from radixkv.backends.s3 import parse_remote_url

                parse_remote_url(self.remote_url)
        for name in ("secret", "previous_secret"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value.encode()) < 16):
                # The message never echoes the value.
                raise ValueError(f"{name} must be a string of at least 16 bytes (a random deployment secret)")
        if self.previous_secret is not None and self.secret is None and not os.environ.get("RADIXKV_SECRET"):
            raise ValueError("previous_secret: set, but secret is not (nor RADIXKV_SECRET)")
        if self.encrypt and self.secret is None and not os.environ.get("RADIXKV_SECRET"):
            raise ValueError("encrypt: needs secret (or RADIXKV_SECRET): the key is derived from it")
        self._check_p2p()
        self._check_codecs()
        if self.write_policy not in ("write_through", "write_back"):
            raise ValueError(f"write_policy must be write_through or write_back, got {self.write_policy!r}")
        if not isinstance(self.namespace, Mapping) or set(self.namespace) - _NAMESPACE_KEYS:
            bad = sorted(set(self.namespace) - _NAMESPACE_KEYS) if isinstance(self.namespace, Mapping) else []
            raise ValueError(f"namespace: unknown keys {bad}; allowed: {sorted(_NAMESPACE_KEYS)}")
        if "model" not in self.namespace:
            raise ValueError("namespace.model: required (the model id that keys are bound to)")
        if self.layout is not None and (not isinstance(self.layout, Mapping) or set(self.layout) - _LAYOUT_KEYS):
            raise ValueError(f"layout: a mapping of {sorted(_LAYOUT_KEYS)}, got {self.layout!r}")

    def _check_p2p(self) -> None:
        if not isinstance(self.p2p_enabled, bool):
            raise ValueError(f"p2p_enabled must be true or false, got {self.p2p_enabled!r}")
        named = [k for k in ("p2p_controller", "p2p_address", "p2p_instance", "peer_codec") if getattr(self, k) is not None]
        if not self.p2p_enabled:
            if named or self.p2p_transport != "nixl":
                raise ValueError(f"{(named or ['p2p_transport'])[0]}: set, but p2p_enabled is not true")
            return
        from radixkv.p2p.wire import check_endpoint

        if self.p2p_controller is None:
            raise ValueError("p2p_controller: required when p2p_enabled is true (tcp://HOST:PORT)")
        check_endpoint(self.p2p_controller, "p2p_controller")
        if self.p2p_address is not None:
            check_endpoint(self.p2p_address, "p2p_address")
        if self.p2p_instance is not None and (not isinstance(self.p2p_instance, str) or not self.p2p_instance):
            raise ValueError(f"p2p_instance must be a non-empty string, got {self.p2p_instance!r}")
        if self.p2p_transport not in ("nixl", "zmq"):
            raise ValueError(f"p2p_transport must be nixl or zmq, got {self.p2p_transport!r}")
        if self.secret is None and not os.environ.get("RADIXKV_SECRET"):
            raise ValueError("p2p_enabled: needs secret (or RADIXKV_SECRET): peers and the controller "
                             "authenticate every message with it")

    def _check_codecs(self) -> None:
        from radixkv.core.codec import get_codec

        for name in ("codec", "local_disk_codec", "remote_codec", "peer_codec"):
            value = getattr(self, name)
            if value is None and name != "codec":
                continue
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a codec name, got {value!r}")
            try:
                get_codec(value)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if self.local_disk_codec is not None and not self.local_disk:
            raise ValueError("local_disk_codec: set, but local_disk is not")
        if self.remote_codec is not None and not self.remote_url:
            raise ValueError("remote_codec: set, but remote_url is not")

    def codec_of(self, tier: Tier) -> str:
        """The codec ``tier`` (one of ``make_tiers``' or the peer tier) writes with: raw for the
        CPU tier and peers, ``local_disk_codec`` or ``codec`` for the disk, ``remote_codec`` or
        ``codec`` for the remote tier.  O(1)."""
        if tier.victim or tier.peer:
            return "none"
        own = self.local_disk_codec if tier.local else self.remote_codec
        return own if own is not None else self.codec

    def without_p2p(self) -> CacheConfig:
        """This config with peer-to-peer sharing off (its ``p2p_*`` keys cleared): for tools that
        read the configured tiers offline (``python -m radixkv warm``) and must not join the fleet.
        O(1)."""
        return replace(self, p2p_enabled=False, p2p_controller=None, p2p_address=None, p2p_instance=None,
                       p2p_transport="nixl")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> CacheConfig:
        """Validate a mapping of config keys.  Unknown keys raise ``ValueError`` naming them."""
        if not isinstance(mapping, Mapping):
            raise TypeError(f"config must be a mapping, got {type(mapping).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**mapping)

    def make_namespace(self) -> Namespace:
        """The ``Namespace`` of ``namespace`` (``salt`` as text is UTF-8 encoded)."""
        ns = dict(self.namespace)
        if isinstance(ns.get("salt"), str):
            ns["salt"] = ns["salt"].encode()
        return Namespace(**ns)

    def make_layout(self, layout: KVLayout | None) -> KVLayout:
        """The layout argument, or the one in the file; ``page_size`` from this config either way."""
        if layout is not None:
            if layout.page_size != self.page_size:
                raise ValueError(f"page_size: the config says {self.page_size}, the layout {layout.page_size}")
            return layout
        if self.layout is None:
            raise ValueError("layout: pass a KVLayout, or give layout: {num_layers, num_kv_heads, head_dim, dtype}")
        spec = dict(self.layout)
        dtype = spec.pop("dtype", "float16")
        if not isinstance(dtype, torch.dtype):
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise ValueError(f"layout.dtype: unknown dtype {dtype!r}")
            dtype = getattr(torch, str(dtype))
        if isinstance(spec.get("windows"), list):        # YAML and JSON give lists
            spec["windows"] = tuple(spec["windows"])
        return KVLayout(dtype=dtype, page_size=self.page_size, **spec)

    def make_tiers(self, layout: KVLayout) -> list[Tier]:
        """The tiers this config describes for chunks of ``layout`` KV, fastest first (none when no
        tier key is set).  Used by ``build`` and by integrations whose engine owns the pool."""
        from radixkv.backends import CpuTier, LmdbTier
        from radixkv.core.format import encoded_size

        tiers: list[Tier] = []
        if self.local_cpu:
            assert self.max_local_cpu_size is not None
            tiers.append(CpuTier(int(self.max_local_cpu_size * _GB), policy=self.cache_policy,
                                 slot_bytes=encoded_size(layout.chunk_shape(self.chunk_size), layout.dtype)))
        if self.local_disk:
            assert self.max_local_disk_size is not None
            path = self.local_disk.removeprefix("file://")
            try:
                tiers.append(LmdbTier(path, int(self.max_local_disk_size * _GB), ttl=self.local_disk_ttl,
                                      admission=None if self.local_disk_admission == "none" else "second_hit"))
            except (ValueError, TypeError):
                raise
            except Exception as e:  # noqa: BLE001 - any fault of the disk: start without the tier
                if self.local_disk_required:
                    raise ValueError(f"local_disk: {path!r} cannot be opened ({type(e).__name__}: {e})") from e
                log.warning("radixkv: local_disk %r cannot be opened (%s: %s); starting without the disk "
                            "tier (set local_disk_required: true to refuse to start instead)",
                            path, type(e).__name__, e)
        # An unreachable endpoint is a warning and misses until it answers, unless remote_required.
        lazy = not self.remote_required
        if self.remote_url and _is_redis(self.remote_url):
            from radixkv.backends.redis import RedisTier

            tiers.append(RedisTier.from_url(self.remote_url, lazy=lazy))
        elif self.remote_url:
            from radixkv.backends.s3 import S3Tier

            tiers.append(S3Tier.from_url(self.remote_url, endpoint_url=self.remote_endpoint, lazy=lazy))
        return tiers

    def make_stack(self, layout: KVLayout, namespace: Namespace | None = None, *, queue_size: int | None = None,
                   exclusive: bool | None = None) -> TierStack | None:
        """The ``TierStack`` of this config's tiers for ``layout`` KV (``None`` without tiers), with
        its secrets, encryption and remote timeout; ``namespace`` defaults to ``make_namespace()``
        bound to ``layout``; ``exclusive`` defaults to the config's (an integration whose engine owns
        the pool, and tells radixkv nothing of its evictions, passes ``False``).  Used by ``build``
        and by such integrations."""
        from radixkv.core.stack import TierStack

        tiers = self.make_tiers(layout)
        ns = namespace if namespace is not None else self.make_namespace().bind(layout)
        node = None
        if self.p2p_enabled:             # the peer tier, and this instance's node serving its CPU tier
            from radixkv.p2p.node import join

            assert self.p2p_controller is not None     # __post_init__ requires it with p2p_enabled
            tiers, node = join(tiers, ns, controller=self.p2p_controller, secret=self.secret,
                               instance=self.p2p_instance, address=self.p2p_address,
                               transport=self.p2p_transport, timeout_s=self.remote_timeout, codec=self.peer_codec)
        if not tiers:
            return None
        stack = TierStack(tiers, namespace=ns, layout=layout, chunk_size=self.chunk_size, promote=self.promote,
                          timeout_s=self.remote_timeout, secret=self.secret, previous_secret=self.previous_secret,
                          encrypt=self.encrypt, queue_size=queue_size,
                          queue_bytes=int(self.max_write_queue_size * _GB),
                          exclusive=self.exclusive if exclusive is None else exclusive,
                          codecs=[self.codec_of(tier) for tier in tiers])
        if node is not None:
            node.watch(stack)
            node.start()
        return stack

    def build(self, layout: KVLayout | None = None) -> PrefixCache:
        """The ``PrefixCache`` this config describes, tiers included (fastest first)."""
        from radixkv.core.cache import PrefixCache

        layout = self.make_layout(layout)
        num_pages = self.num_pages if self.num_pages is not None else self.pool_tokens // self.page_size  # type: ignore[operator]
        namespace = self.make_namespace()
        stack = self.make_stack(layout, namespace.bind(layout))
        # One deadline: a request's whole tier lookup and load ends remote_timeout after it opens.
        return PrefixCache(layout, num_pages=num_pages, device=self.device, namespace=namespace,
                           tiers=() if stack is None else stack, chunk_size=self.chunk_size,
                           write_policy=self.write_policy, promote=self.promote, load_timeout=self.remote_timeout,
                           write_queue_bytes=int(self.max_write_queue_size * _GB))


def load_config(source: Mapping[str, Any] | str | os.PathLike[str] | None = None) -> CacheConfig:
    """A ``CacheConfig`` from a mapping, a ``.yaml``/``.yml``/``.json`` file, or (``None``) the file
    named by ``RADIXKV_CONFIG``.  YAML needs ``pyyaml`` (the ``yaml`` extra).  Cost: one file read."""
    if source is None:
        named = os.environ.get(ENV_VAR)
        if not named:
            raise ValueError(f"config: none given and {ENV_VAR} is not set")
        source = named
    if isinstance(source, Mapping):
        return CacheConfig.from_mapping(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"config must be a mapping or the path of a .yaml, .yml or .json file, "
                        f"got {type(source).__name__}")
    return CacheConfig.from_mapping(read_mapping(source))


def from_config(config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
                layout: KVLayout | None = None) -> PrefixCache:
    """Build a cache and its tiers from a dict, a YAML/JSON file, or (``None``) the file named by
    ``RADIXKV_CONFIG``; see ``CacheConfig`` for the keys.  ``layout`` comes from the model (or a
    ``layout`` mapping in the configuration).  A bad or unknown key raises ``ValueError`` naming
    it.  Cost: reading the file, plus opening each configured tier (``CacheConfig.build``)."""
    return load_config(config).build(layout)


def read_mapping(source: str | os.PathLike[str], name: str = "config") -> dict[str, Any]:
    """The mapping in a ``.yaml``/``.yml``/``.json`` file, not yet validated.  ``ValueError`` naming
    ``name`` and the file for a missing or unreadable file, another suffix, a syntax error (with its
    line and column) or a file that holds no mapping; YAML is read with ``safe_load``, so a tag
    such as ``!!python/object`` is a syntax error, never code that runs.  YAML needs ``pyyaml``.
    Cost: one file read."""
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"{name} must be the path of a .yaml, .yml or .json file, got {type(source).__name__}")
    path = Path(source)
    if path.exists() and not path.is_file():
        raise ValueError(f"{name}: {str(path)!r} is not a file")
    if not path.is_file():
        raise ValueError(f"{name}: no such file {str(path)!r}")
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"{name}: {str(path)!r} is neither .yaml, .yml nor .json")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name}: cannot read {str(path)!r}: {exc}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: {str(path)!r}, line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ImportError("YAML configs need pyyaml: pip install 'radixkv[yaml]'") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"{name}: {str(path)!r}{where}: {problem}") from None
        data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{name}: {str(path)!r} holds a {type(data).__name__}, not a mapping of keys")
    return data


def _is_redis(url: Any) -> bool:
    return isinstance(url, str) and url.split("://", 1)[0] in ("redis", "rediss")


def _positive_int(name: str, value: Any) -> None:
    check_int(value, name, 1)
