"""Token validation, namespaces and chained chunk keys.

Every process on every machine must find the same prefix under the same keys, so keys are a pure
function of the namespace and the token ids — never Python's ``hash()``, which is salted per process:

    root = xxh3_128(canonical bytes of the Namespace)
    K0   = xxh3_128(root     || le_int32(tokens[0:C]))
    Ki   = xxh3_128(K(i-1)   || le_int32(tokens[i*C:(i+1)*C]))

A key therefore names a chunk *and everything before it*: equal keys mean equal prefixes.  The
partial tail chunk gets no key.  The golden vectors in ``tests/core/test_hashing.py`` pin this format.
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash
from radixkv.core._checks import check_int
from radixkv.core._ext import native_tokens

if TYPE_CHECKING:
    from radixkv.core.pool import KVGroup, KVLayout

__all__ = ["MAX_TOKEN_ID", "Namespace", "as_token_bytes", "chunk_keys", "keys_from_token_bytes"]

MAX_TOKEN_ID = 2**31 - 1
_FORMAT_TAG = b"radixkv/namespace/v1"
_LATER_FIELDS = frozenset({"v_head_dim", "kv_group"})


def as_token_bytes(tokens: Any, name: str = "tokens") -> bytes:
    """Validate token ids and return them as little-endian int32 bytes (4 bytes a token).

    Accepts a list, tuple, numpy array or torch tensor of integers.  Floats and bools raise
    ``TypeError``; negative ids, ids >= 2**31 and arrays that are not 1-D raise ``ValueError``;
    both name ``name``.  Cost: O(n) in C (numpy / array), no Python work per token for arrays and
    tensors; a list is one C pass, 1-2 ns a token with the built extension
    (``cuda_ext/tokens.cpp``), about 10 without it (``array.array`` and a few numpy checks).

    >>> as_token_bytes([1, 2]).hex()
    '0100000002000000'
    """
    if type(tokens) is list:                 # how engines hold them: straight to the C pass
        native = native_tokens()
        fast = native(tokens) if native is not None else None
        if fast is not None:
            return fast
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype == torch.bool or tokens.dtype.is_floating_point or tokens.is_complex():
            raise TypeError(f"{name} must hold integer token ids, got a {tokens.dtype} tensor")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
        if tokens.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() > MAX_TOKEN_ID):
            raise ValueError(f"{name} must be token ids in [0, 2**31), got min {tokens.min()}, max {tokens.max()}")
        return tokens.astype("<i4", copy=False).tobytes()
    if isinstance(tokens, (list, tuple)):
        native = native_tokens() if type(tokens) is tuple else None   # (a list has had its turn)
        fast = native(tokens) if native is not None else None
        if fast is None:
            fast = _list_token_bytes(tokens)
        if fast is not None:
            return fast
        if not set(map(type, tokens)) <= {int}:
            bad = next(t for t in tokens if type(t) is not int)
            if isinstance(bad, (bool, np.bool_)) or not isinstance(bad, (int, np.integer)):
                raise TypeError(f"{name} must hold integer token ids, got {type(bad).__name__} {bad!r}")
        try:
            arr = np.array(tokens, dtype=np.int64)
        except OverflowError:
            raise ValueError(f"{name} must be token ids in [0, 2**31), got one beyond int64") from None
        return as_token_bytes(arr, name)
    raise TypeError(f"{name} must be a list, tuple, numpy array or torch tensor of ints, "
                    f"got {type(tokens).__name__}")


_ARRAY_OK = array.array("I").itemsize == 4


def _list_token_bytes(tokens: list[Any] | tuple[Any, ...]) -> bytes | None:
    """The fast path of ``as_token_bytes`` for a list or tuple: one C loop (``array.array``) and
    a few vectorised checks, about 10 ns a token; ``None`` sends anything unusual (floats,
    negative or huge ids, bools) to the exact checks of the slow path.

    ``array('I')`` accepts every int in [0, 2**32), bools included; ids of 2**31 and more show up
    as negative int32, and a bool can only hide where the value is 0 or 1: those few positions
    have their type checked one by one.
    """
    if not _ARRAY_OK:
        return None
    try:
        arr = array.array("I", tokens)
    except (TypeError, OverflowError, ValueError):
        return None
    if sys.byteorder == "big":
        arr.byteswap()
    view = np.frombuffer(arr, dtype="<i4")
    if view.size:
        if view.min() < 0:
            return None
        small = np.flatnonzero(view <= 1)
        if small.size > 64:
            if not set(map(type, tokens)) <= {int}:
                return None
        elif any(type(tokens[i]) is not int for i in small.tolist()):
            return None
    return arr.tobytes()


@dataclass(frozen=True)
class Namespace:
    """What makes two caches compatible.  Everything here seeds the hash chain.

    A model update (``revision``), another KV dtype or layout, another tensor-parallel shard, a LoRA
    adapter or another tenant (``salt``) gives other keys, so it can never hit foreign KV.  The
    layout fields are usually filled from a ``KVLayout`` by ``bind``; ``PrefixCache`` does that.

    >>> ns = Namespace(model="m")
    >>> len(ns.root), len(ns.id), ns.id == ns.root[:8]
    (16, 8, True)
    """

    model: str
    revision: str = "main"
    kv_dtype: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    page_size: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    lora_id: str = ""
    salt: bytes = b""
    v_head_dim: int = 0     # MLA: V's head size where it differs from K's; 0: equal
    kv_group: str = ""      # a KV group's tag (``KVGroup.tag``) in a layout with sliding windows

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "str" and not isinstance(value, str):
                raise TypeError(f"Namespace.{f.name} must be a str, got {type(value).__name__}")
            if f.type == "int":
                check_int(value, f"Namespace.{f.name}")
        if not isinstance(self.salt, bytes):
            raise TypeError(f"Namespace.salt must be bytes, got {type(self.salt).__name__}")
        if not self.model:
            raise ValueError("Namespace.model must not be empty")
        if self.tp_size < 1 or self.tp_rank >= self.tp_size:
            raise ValueError(f"Namespace.tp_rank must be in [0, tp_size), got {self.tp_rank} of {self.tp_size}")
        # The digest is computed once (a frozen dataclass needs object.__setattr__ for that).
        object.__setattr__(self, "_root", xxhash.xxh3_128_digest(self._canonical()))

    def _canonical(self) -> bytes:
        # Length-prefixed fields in a fixed order: no separator can be forged by a field's content.
        parts = [_FORMAT_TAG]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _LATER_FIELDS and value == f.default:
                continue        # fields added after the first format leave the keys as they were
            raw = value if isinstance(value, bytes) else str(value).encode()
            parts.append(f.name.encode() + b"=" + len(raw).to_bytes(4, "little") + raw)
        return b"\0".join(parts)

    @property
    def root(self) -> bytes:
        """16-byte digest that seeds every chain of this namespace."""
        return self._root  # type: ignore[attr-defined,no-any-return]

    @property
    def id(self) -> bytes:
        """8-byte id that prefixes every stored key of this namespace (the first 8 bytes of ``root``)."""
        return self.root[:8]

    def bind(self, layout: KVLayout, group: KVGroup | None = None) -> Namespace:
        """This namespace with the layout fields filled from ``layout`` (of ``group``'s layers only,
        and named by its tag, when a group is given: each KV group's chunks have keys of their own).

        Fields already set must agree with the layout (``ValueError`` names the field otherwise).
        """
        sub = layout if group is None else layout.group_layout(group)
        v_dim = 0 if sub.v_head_dim is None or sub.v_head_dim == sub.head_dim else sub.v_head_dim
        wanted: dict[str, Any] = {"kv_dtype": str(sub.dtype).removeprefix("torch."), "num_layers": sub.num_layers,
                  "num_kv_heads": sub.num_kv_heads, "head_dim": sub.head_dim,
                  "page_size": sub.page_size, "v_head_dim": v_dim}
        if group is not None:
            wanted["kv_group"] = group.tag()
        for key, value in wanted.items():
            have = getattr(self, key)
            whole = key == "num_layers" and group is not None and have == layout.num_layers   # bound to the model
            if have not in ("", 0) and have != value and not whole:
                raise ValueError(f"namespace.{key} is {have!r} but the layout says {value!r}")
        return replace(self, **wanted)


def keys_from_token_bytes(data: bytes, chunk_size: int, root: bytes) -> list[bytes]:
    """Chained keys of the full chunks of validated int32 token bytes (see ``chunk_keys``).

    One xxh3-128 per chunk and no Python work per token: the 16-byte parent digest is written just
    in front of each chunk in one scratch buffer (over bytes of the previous chunk, which is already
    hashed), so each key is a single digest call over ``parent || chunk`` with no concatenation.
    """
    chunk_bytes = 4 * chunk_size
    n = len(data) // chunk_bytes
    if n == 0:
        return []
    buf = bytearray(16 + n * chunk_bytes)
    buf[16:] = memoryview(data)[:n * chunk_bytes]
    view = memoryview(buf)
    digest = xxhash.xxh3_128_digest
    keys = []
    key = root
    for start in range(0, n * chunk_bytes, chunk_bytes):
        view[start:start + 16] = key
        key = digest(view[start:start + 16 + chunk_bytes])
        keys.append(key)
    return keys


def tail_key(parent: bytes, data: bytes) -> bytes:
    """The key of a *tail*: fewer tokens than a chunk (``data``, validated int32 bytes) after the
    chunk whose key is ``parent`` — the digest full chunks are keyed by (``parent || tokens``), over
    a shorter run, so it never names a full chunk.  Tiers store tails for prefixes that end inside
    a chunk (``TierStack.find_tail``).  O(len(data)).

    >>> ns = Namespace(model="m")
    >>> data = as_token_bytes(list(range(6)))
    >>> tail_key(ns.root, data[:8]) != keys_from_token_bytes(data, 4, ns.root)[0]
    True
    """
    return xxhash.xxh3_128_digest(parent + data)


def chunk_keys(tokens: Any, chunk_size: int, namespace: Namespace) -> list[bytes]:
    """Chained 16-byte keys of every full ``chunk_size``-token chunk of ``tokens``.

    Deterministic across processes, machines and ``PYTHONHASHSEED``; the partial tail chunk gets no
    key.  Cost: O(len(tokens)) bytes hashed plus O(len(tokens) / chunk_size) Python steps.

    >>> ns = Namespace(model="m")
    >>> keys = chunk_keys(list(range(10)), 4, ns)
    >>> len(keys), len(keys[0])
    (2, 16)
    >>> chunk_keys(list(range(8)), 4, ns) == keys
    True
    """
    check_int(chunk_size, "chunk_size", 1)
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    return keys_from_token_bytes(as_token_bytes(tokens), chunk_size, namespace.root)
