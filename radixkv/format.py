"""The chunk format: one chunk of KV as self-describing, self-verifying bytes.

A stored chunk is a fixed header, the chunk's token ids, zero padding up to a 64-byte boundary, and
the raw KV payload (``[num_layers, 2, chunk_tokens, num_kv_heads, head_dim]``, C-contiguous,
little-endian), so that the payload can be viewed or copied without any parsing::

    offset size  field
         0    4  magic b"RKVC"
         4    2  format version (1)
         6    1  dtype code (a fixed table of names, below)
         7    1  ndim (5)
         8    4  payload offset (header + tokens + padding; a multiple of 64)
        12    8  namespace id
        20   16  key
        36   16  parent key
        52    4  number of tokens
        56   20  shape, five uint32
        76    8  payload length in bytes
        84    8  xxh3-64 of every other byte of the blob (header, tokens, padding, payload)
        92  4*n  token ids, little-endian int32
             ...  zero padding, then the payload

Decoding trusts nothing in the blob: every field is checked against what the caller expects (the
key it asked for, its parent, the tokens, dtype and shape), every length against the blob's size,
and the checksum over all of it, before a single payload byte is copied.  Any mismatch raises
``ChunkFormatError``; no ``pickle``, ``torch.load`` or ``eval`` is involved, so a shared store
cannot be used to run code or to serve KV under the wrong prefix.
"""

from __future__ import annotations

import struct
import sys
from typing import Union

import numpy as np
import torch
import xxhash

__all__ = ["FORMAT_VERSION", "MAGIC", "ChunkFormatError", "decode_chunk", "encode_chunk", "encoded_size"]

MAGIC = b"RKVC"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHBBI8s16s16sI5IQQ")
_CHECKSUM_AT = _HEADER.size - 8  # the checksum is the header's last field
_CHECKSUM = struct.Struct("<Q")
_ALIGN = 64
_NDIM = 5

# Codes are part of the format: never renumber, only append.
_DTYPE_NAMES = {1: "float32", 2: "float16", 3: "bfloat16", 4: "int8", 5: "uint8",
                6: "float8_e4m3fn", 7: "float8_e5m2"}
_DTYPES = {code: getattr(torch, name) for code, name in _DTYPE_NAMES.items() if hasattr(torch, name)}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

Blob = Union[bytes, bytearray, memoryview]

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("radixkv.format stores raw little-endian payloads; this machine is big-endian")


class ChunkFormatError(ValueError):
    """A blob is not a valid chunk, or not the chunk the caller asked for (truncated, corrupt,
    another version, key, parent, tokens, dtype or shape)."""


def _payload_offset(num_tokens: int) -> int:
    end = _HEADER.size + 4 * num_tokens
    return -(-end // _ALIGN) * _ALIGN


def _check_args(namespace_id: bytes, key: bytes, parent_key: bytes, tokens: bytes) -> None:
    for name, value, size in (("namespace_id", namespace_id, 8), ("key", key, 16),
                              ("parent_key", parent_key, 16)):
        if not isinstance(value, bytes) or len(value) != size:
            raise ValueError(f"{name} must be {size} bytes, got {type(value).__name__} of length "
                             f"{len(value) if isinstance(value, (bytes, bytearray)) else '?'}")
    if not isinstance(tokens, bytes) or len(tokens) % 4:
        raise ValueError("tokens must be little-endian int32 bytes (see radixkv.hashing.as_token_bytes)")


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return _CODES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored; supported: "
                        f"{', '.join(str(d) for d in _CODES)}") from None


def encoded_size(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    """Size in bytes of the encoded chunk of a ``shape``/``dtype`` KV tensor.  O(1).

    Useful to size fixed slots (``CpuTier(slot_bytes=...)``).

    >>> encoded_size((2, 2, 4, 1, 8), torch.float16)
    384
    """
    if len(shape) != _NDIM:
        raise ValueError(f"shape must be [num_layers, 2, chunk_tokens, num_kv_heads, head_dim], got {tuple(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return _payload_offset(int(shape[2])) + int(np.prod(shape, dtype=np.int64)) * itemsize


def encode_chunk(namespace_id: bytes, key: bytes, parent_key: bytes, tokens: bytes, kv: torch.Tensor) -> bytes:
    """Encode one chunk's KV (``[num_layers, 2, chunk_tokens, num_kv_heads, head_dim]``) to bytes.

    ``tokens`` are the chunk's token ids as little-endian int32 bytes (``as_token_bytes``), one per
    position of ``kv``'s third axis.  The tensor may live on any device; it is copied to the CPU
    once.  Cost: O(size) — one device-to-host copy (if needed), one hash pass, one join.
    Thread-safe (pure function).

    >>> kv = torch.zeros(1, 2, 2, 1, 4)
    >>> blob = encode_chunk(b"n" * 8, b"k" * 16, b"p" * 16, bytes(8), kv)
    >>> len(blob), blob[:4]
    (192, b'RKVC')
    """
    _check_args(namespace_id, key, parent_key, tokens)
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    code = _dtype_code(kv.dtype)
    num_tokens = len(tokens) // 4
    if kv.dim() != _NDIM or kv.shape[1] != 2 or kv.shape[2] != num_tokens:
        raise ValueError(f"kv must be [num_layers, 2, {num_tokens}, num_kv_heads, head_dim] for "
                         f"{num_tokens} tokens, got {tuple(kv.shape)}")
    if any(d >= 2**32 for d in kv.shape):
        raise ValueError(f"kv dimensions must be below 2**32, got {tuple(kv.shape)}")
    flat = kv.detach().to("cpu").contiguous().reshape(-1)
    payload = (flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)).data
    offset = _payload_offset(num_tokens)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, code, _NDIM, offset, namespace_id, key, parent_key,
                          num_tokens, *kv.shape, payload.nbytes, 0)
    padding = bytes(offset - len(header) - len(tokens))
    checksum = xxhash.xxh3_64()
    for part in (header[:_CHECKSUM_AT], tokens, padding, payload):
        checksum.update(part)
    return b"".join((header[:_CHECKSUM_AT], _CHECKSUM.pack(checksum.intdigest()), tokens, padding, payload))


def decode_chunk(blob: Blob, *, namespace_id: bytes, key: bytes, parent_key: bytes, tokens: bytes,
                 dtype: torch.dtype, shape: tuple[int, ...] | torch.Size,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Verify ``blob`` is exactly the chunk asked for, and return its KV (in ``out`` if given).

    Raises ``ChunkFormatError`` on any mismatch, truncated or corrupt blob — and then ``out`` is
    left untouched, because everything is verified before the payload is copied.  Raises
    ``ValueError``/``TypeError`` for bad arguments (the caller's bug, not the blob's).

    ``out`` (contiguous, ``dtype``, ``shape``, any device) receives the payload by one copy from
    the blob; without it a new CPU tensor is allocated and filled by one copy.  ``blob`` is only
    read during the call, so a buffer valid only inside a transaction is fine.  Cost: O(size) — one
    hash pass and one copy.  Thread-safe (pure function, apart from writing ``out``).
    """
    _check_args(namespace_id, key, parent_key, tokens)
    code = _dtype_code(dtype)
    shape = tuple(int(d) for d in shape)
    num_tokens = len(tokens) // 4
    if len(shape) != _NDIM or shape[1] != 2 or shape[2] != num_tokens:
        raise ValueError(f"shape must be [num_layers, 2, {num_tokens}, num_kv_heads, head_dim], got {shape}")
    if out is not None and (out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    try:
        view = memoryview(blob).cast("B")
    except TypeError:
        raise ChunkFormatError(f"blob must be a contiguous bytes-like object, got {type(blob).__name__}") from None
    offset = _payload_offset(num_tokens)
    payload_len = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if len(view) < _HEADER.size:
        raise ChunkFormatError(f"blob of {len(view)} bytes is shorter than the {_HEADER.size}-byte header")
    (magic, version, got_code, ndim, got_offset, got_ns, got_key, got_parent, got_tokens,
     *rest) = _HEADER.unpack_from(view)
    got_shape, got_len, checksum = tuple(rest[:_NDIM]), rest[_NDIM], rest[_NDIM + 1]
    expected = (("magic", magic, MAGIC), ("format version", version, FORMAT_VERSION),
                ("namespace id", got_ns, namespace_id), ("key", got_key, key),
                ("parent key", got_parent, parent_key), ("number of tokens", got_tokens, num_tokens),
                ("dtype", _DTYPE_NAMES.get(got_code, got_code), _DTYPE_NAMES[code]),
                ("ndim", ndim, _NDIM), ("shape", got_shape, shape),
                ("payload offset", got_offset, offset), ("payload length", got_len, payload_len),
                ("blob length", len(view), offset + payload_len))
    for name, got, want in expected:
        if got != want:
            raise ChunkFormatError(f"chunk {name} mismatch: blob has {got!r}, expected {want!r}")
    if view[_HEADER.size:_HEADER.size + len(tokens)] != tokens:
        raise ChunkFormatError("chunk tokens mismatch: the blob holds KV of other tokens")
    digest = xxhash.xxh3_64()
    digest.update(view[:_CHECKSUM_AT])
    digest.update(view[_HEADER.size:])
    if digest.intdigest() != checksum:
        raise ChunkFormatError("chunk checksum mismatch: the blob is corrupt")
    return _copy_payload(view[offset:], dtype, shape, out)


def _copy_payload(payload: memoryview, dtype: torch.dtype, shape: tuple[int, ...],
                  out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    if not len(payload):
        return out
    src = np.frombuffer(payload, dtype=np.uint8)
    if out.device.type == "cpu":
        np.copyto(out.reshape(-1).view(torch.uint8).numpy(), src)
    else:
        # torch.frombuffer shares writable memory (e.g. a pinned arena slot) without a copy; a
        # read-only buffer goes through one CPU staging copy first.
        staged = torch.frombuffer(payload, dtype=torch.uint8) if not payload.readonly else torch.from_numpy(src.copy())
        out.reshape(-1).view(torch.uint8).copy_(staged)
    return out
