"""vLLM's prefix-cache block hashes, computed outside vLLM: the names its KV events give blocks.

A router that reads vLLM's KV events must name a prompt's blocks the way vLLM does, or no lookup
ever matches.  vLLM (v1, ``vllm/v1/core/kv_cache_utils.py``) chains one hash per *full* block:

    NONE_HASH = H(seed)
    B0        = H((NONE_HASH, tuple(tokens[0:bs]),       extra_keys[0]))
    Bi        = H((B(i-1),    tuple(tokens[i*bs:(i+1)*bs]), extra_keys[i]))

Contract:

* ``H`` is the engine's ``--prefix-caching-hash-algo``: ``"sha256"`` (vLLM's default: SHA-256
  over ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)``), ``"sha256_cbor"`` (SHA-256 over
  canonical CBOR; needs ``cbor2``), ``"xxhash"`` / ``"xxhash_cbor"`` (xxh3-128 over the same).
* The seed is ``$PYTHONHASHSEED`` when set, else ``"vllm-none-hash"`` for the SHA-256 algorithms.
  For the xxhash ones vLLM draws a random seed per process unless ``PYTHONHASHSEED`` is set, so
  their hashes are reproducible only with a seed: without one (argument or environment) this
  module raises ``ValueError`` instead of guessing.
* A trailing partial block gets no hash (vLLM caches full blocks only).
* KV events carry the *external* form: with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (vLLM's
  default) the low 64 bits of the hash read as a big-endian unsigned integer
  (``int.from_bytes(h, "big") & (2**64 - 1)``, vLLM's ``maybe_convert_block_hash``), else the
  hash bytes themselves.  ``as_int=True`` returns that integer form; chain further blocks from the
  bytes form (``parent=`` takes bytes: the integer form has lost the rest of the hash).
* Extra keys (LoRA, multimodal features, ``cache_salt``, prompt-embeds digests) are the tagged
  tuples vLLM's ``generate_block_hash_extra_keys`` returns, one entry (a tuple or ``None``) per full
  block; this module hashes what it is given and does not build them.

``tests/fleet/test_hashing.py`` checks every algorithm against vLLM's own ``hash_block_tokens`` on
random token lists.  Cost: one serialization and one hash per full block (a few microseconds a
block for SHA-256 over pickle).
"""

from __future__ import annotations

import hashlib
import operator
import os
import pickle
from typing import Any, Callable, Literal, Sequence, overload

import xxhash

__all__ = ["ALGOS", "DEFAULT_SEED", "external_hash", "none_hash", "request_extra_keys", "vllm_block_hashes"]

#: vLLM's ``--prefix-caching-hash-algo`` values, its default first.
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: vLLM's NONE_HASH seed for the SHA-256 algorithms when ``PYTHONHASHSEED`` is not set.
DEFAULT_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1

Algo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError as e:  # pragma: no cover - cbor2 comes with vLLM
        raise ImportError("the *_cbor block hashes need cbor2: pip install cbor2") from e
    return bytes(cbor2.dumps(obj, canonical=True))


def _hash_fn(algo: str) -> Callable[[Any], bytes]:
    if algo == "sha256":
        return lambda obj: hashlib.sha256(_pickle(obj)).digest()
    if algo == "sha256_cbor":
        return lambda obj: hashlib.sha256(_cbor(obj)).digest()
    if algo == "xxhash":
        return lambda obj: xxhash.xxh3_128_digest(_pickle(obj))
    if algo == "xxhash_cbor":
        return lambda obj: xxhash.xxh3_128_digest(_cbor(obj))
    raise ValueError(f"algo must be one of {', '.join(ALGOS)}, got {algo!r}")


def _seed(algo: str, seed: str | None) -> str:
    if seed is not None:
        if not isinstance(seed, str):
            raise TypeError(f"seed must be a str (vLLM's PYTHONHASHSEED), got {type(seed).__name__}")
        return seed
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    if algo.startswith("xxhash"):
        raise ValueError(f"seed: vLLM draws a random NONE_HASH seed for {algo!r} unless PYTHONHASHSEED "
                         "is set; pass the engine's PYTHONHASHSEED as seed=")
    return DEFAULT_SEED


def none_hash(algo: Algo = "sha256", seed: str | None = None) -> bytes:
    """vLLM's ``NONE_HASH``, the parent of every first block: ``H(seed)`` (see the module docstring).

    >>> none_hash(seed="vllm-none-hash").hex()[:16]
    '066b1e8987e02713'
    """
    return _hash_fn(algo)(_seed(algo, seed))


def external_hash(block_hash: bytes) -> int:
    """The integer KV events carry for ``block_hash``: its low 64 bits, read big-endian.  O(1).

    >>> external_hash(bytes(24) + (258).to_bytes(8, "big"))
    258
    """
    if not isinstance(block_hash, (bytes, bytearray)):
        raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    return int.from_bytes(block_hash, "big") & _MASK64


def request_extra_keys(num_blocks: int, cache_salt: str | None = None,
                       lora: tuple[str, str] | None = None) -> list[tuple[Any, ...] | None] | None:
    """The per-block extra keys vLLM hashes into a text request's blocks: a LoRA request's
    ``("lora", name, path)`` in every block, then the ``("cache_salt", salt)`` of block 0
    (vLLM's ``generate_block_hash_extra_keys``); ``None`` when there are none.  O(num_blocks).

    >>> request_extra_keys(2, "t", ("sql", "/a/sql"))
    [(('lora', 'sql', '/a/sql'), ('cache_salt', 't')), (('lora', 'sql', '/a/sql'),)]
    """
    if num_blocks <= 0 or not (cache_salt or lora):
        return None
    base: tuple[Any, ...] = (("lora", lora[0], lora[1]),) if lora else ()
    first = base + ((("cache_salt", cache_salt),) if cache_salt else ())
    return [first or None] + [base or None] * (num_blocks - 1)


@overload
def vllm_block_hashes(tokens: Sequence[int], block_size: int, parent: bytes | None = ...,
                      extra_keys: Sequence[tuple[Any, ...] | None] | None = ..., *,
                      algo: Algo = ..., seed: str | None = ..., as_int: Literal[False] = ...) -> list[bytes]: ...
@overload
def vllm_block_hashes(tokens: Sequence[int], block_size: int, parent: bytes | None = ...,
                      extra_keys: Sequence[tuple[Any, ...] | None] | None = ..., *,
                      algo: Algo = ..., seed: str | None = ..., as_int: Literal[True]) -> list[int]: ...


def vllm_block_hashes(tokens: Sequence[int], block_size: int, parent: bytes | None = None,
                      extra_keys: Sequence[tuple[Any, ...] | None] | None = None, *,
                      algo: Algo = "sha256", seed: str | None = None,
                      as_int: bool = False) -> list[bytes] | list[int]:
    """The chained block hashes vLLM gives the full blocks of ``tokens``.

    ``parent`` is the hash (bytes) of the block before ``tokens[0]`` (``None``: the prompt starts
    here); ``extra_keys`` one tuple or ``None`` per full block; ``as_int`` returns the 64-bit form
    of KV events.  Cost: O(len(tokens)) and one hash per full block.

    >>> h = vllm_block_hashes(list(range(40)), 16, seed="vllm-none-hash")
    >>> len(h), len(h[0])
    (2, 32)
    >>> vllm_block_hashes(list(range(16, 32)), 16, parent=h[0], seed="vllm-none-hash") == h[1:]
    True
    >>> vllm_block_hashes(list(range(40)), 16, seed="vllm-none-hash", as_int=True) == [external_hash(x) for x in h]
    True
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if parent is not None and not isinstance(parent, bytes):
        raise TypeError(f"parent must be bytes (a block hash) or None, got {type(parent).__name__}")
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError:
        raise TypeError("tokens must be a sequence of ints") from None
    if any(isinstance(t, bool) for t in tokens):
        raise TypeError("tokens must be a sequence of ints, not bools")
    n = len(ids) // block_size
    if extra_keys is not None and len(extra_keys) != n:
        raise ValueError(f"extra_keys must have one entry per full block ({n}), got {len(extra_keys)}")
    fn = _hash_fn(algo)
    prev = parent if parent else fn(_seed(algo, seed))
    out: list[bytes] = []
    for i in range(n):
        extra = None if extra_keys is None else extra_keys[i]
        prev = fn((prev, tuple(ids[i * block_size:(i + 1) * block_size]), extra))
        out.append(prev)
    if as_int:
        return [int.from_bytes(h, "big") & _MASK64 for h in out]
    return out
