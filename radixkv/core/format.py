"""The chunk format: one chunk of KV as self-describing, self-verifying bytes, optionally
authenticated (a keyed MAC) and encrypted (AEAD) with a deployment secret.

A stored chunk is a fixed 128-byte header, the chunk's token ids, zero padding up to a 64-byte
boundary, and the raw KV payload (``[num_layers, 2, chunk_tokens, num_kv_heads, head_dim]``,
C-contiguous, little-endian), so that the payload can be viewed or copied without any parsing::

    offset size  field
         0    4  magic b"RKVC"
         4    2  format version (2)
         6    1  dtype code (a fixed table of names, below)
         7    1  ndim (5)
         8    4  payload offset (header + tokens + padding; a multiple of 64)
        12    8  namespace id
        20   16  key
        36   16  parent key
        52    4  number of tokens
        56   20  shape, five uint32
        76    8  payload length in bytes (of the plaintext)
        84    1  seal: 0 checksum, 1 keyed MAC, 2 AEAD (encrypted)
        85    1  codec (0: raw; see radixkv.core.codec)
        86    1  the codec's parameter (0 for raw)
        87    1  zero
        88    8  key id (seals 1 and 2: which secret sealed it; 0 for seal 0)
        96   32  seal 0: xxh3-64 (8 bytes, then zeros); seal 1: HMAC-SHA256; seal 2: 12-byte nonce, zeros
       128  4*n  token ids, little-endian int32 (seal 2: ciphertext)
             ...  zero padding, then the payload (seal 2: ciphertext, then the 16-byte GCM tag)

What each seal protects against:

* **0, checksum** (no secret): xxh3-64 over header bytes 0-95, tokens, padding and payload.
  Protection against *accidents only* (bit rot, truncation, a stray overwrite): anyone who can write
  to the store can write a blob that verifies, and anyone who can read it sees the token ids.
* **1, keyed MAC** (``Seal(secret)``): HMAC-SHA256 over the same bytes with a key derived from the
  secret for this namespace.  A blob written without the secret does not verify (``ChunkAuthError``):
  a writer to a shared bucket cannot forge KV.  Token ids are still readable.
* **2, AEAD** (``Seal(secret, encrypt=True)``): AES-256-GCM, a random 96-bit nonce per blob, over
  tokens, padding and payload, with header bytes 0-95 as associated data; the key is derived from
  the secret for this namespace.  Nothing stored reveals the tokens or the KV, and a forged or
  altered blob does not verify.  The blob is 16 bytes longer (the tag).

Keys: ``HKDF-SHA256(secret, salt="radixkv chunk v2", info=purpose + namespace id)`` (RFC 5869), so
each namespace has its own MAC and AEAD keys; the key id is the first 8 bytes of
``HMAC(mac key, "key id")`` — it tells a reader which of its secrets to use (a ``Seal`` holds the
current one and, for rotation, a previous one), never anything about the key.

**Codecs.**  A chunk's payload is raw (codec 0) or coded (``radixkv.core.codec``: lossless
``zstd``, lossy ``int8`` and ``cachegen``); the codec and its parameter are header bytes 85 and 86,
under the seal, and the payload length field is then the coded length, below the raw one.  A
reader decodes whatever codec the blob names, whatever its own tier writes; a codec it does not
know is a ``ChunkFormatError`` (a miss).  ``chunk_codec`` tells which codec a verified blob used.

Decoding trusts nothing in the blob: every field is checked against what the caller expects (the
key it asked for, its parent, the tokens, dtype and shape), every length against the blob's size,
and the checksum or MAC over all of it, before a single payload byte is copied.  Any mismatch
raises ``ChunkFormatError`` (``ChunkAuthError`` when the blob is not sealed by a secret the reader
holds); no ``pickle``, ``torch.load`` or ``eval`` is involved, so a shared store cannot be used to
run code or to serve KV under the wrong prefix.  Blobs of format version 1 (before seals) are of
another version: a miss, deleted and rewritten by the stack like any other unreadable blob.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import sys
from typing import Any, NamedTuple, Union

import numpy as np
import torch
import xxhash

from radixkv.core.codec import Codec, codec_by_code, get_codec

__all__ = ["FORMAT_VERSION", "MAGIC", "SEAL_AEAD", "SEAL_CHECKSUM", "SEAL_MAC", "ChunkAuthError",
           "ChunkFormatError", "Seal", "VerifiedChunk", "chunk_codec", "chunk_codec_param", "decode_chunk", "encode_chunk", "encoded_size",
           "hkdf_sha256", "verify_chunk"]

MAGIC = b"RKVC"
FORMAT_VERSION = 2
SEAL_CHECKSUM, SEAL_MAC, SEAL_AEAD = 0, 1, 2
_HEADER = struct.Struct("<4sHBBI8s16s16sI5IQBBBx8s32s")
_SEALED_AT = 96  # header bytes [0, 96) are covered by the checksum / MAC, or are the AEAD's associated data
_TAG_AT = 96
_GCM_TAG = 16
_NONCE = 12
_ALIGN = 64
_NDIM = 5
_MIN_SECRET = 16

# Codes are part of the format: never renumber, only append.
_DTYPE_NAMES = {1: "float32", 2: "float16", 3: "bfloat16", 4: "int8", 5: "uint8",
                6: "float8_e4m3fn", 7: "float8_e5m2"}
_DTYPES = {code: getattr(torch, name) for code, name in _DTYPE_NAMES.items() if hasattr(torch, name)}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

Blob = Union[bytes, bytearray, memoryview]

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("radixkv.core.format stores raw little-endian payloads; this machine is big-endian")


class ChunkFormatError(ValueError):
    """A blob is not a valid chunk, or not the chunk the caller asked for (truncated, corrupt,
    another version, key, parent, tokens, dtype or shape)."""


class ChunkAuthError(ChunkFormatError):
    """A blob that is not sealed by a secret the reader holds: no MAC or AEAD where the reader has
    a secret (written without the key: forged), a MAC or tag that does not verify, an unknown key
    id, or a sealed blob read without any secret."""


def hkdf_sha256(secret: bytes, info: bytes, length: int = 32, salt: bytes = b"radixkv chunk v2") -> bytes:
    """RFC 5869 HKDF with SHA-256 (extract, then expand to ``length`` bytes).  O(length).

    >>> hkdf_sha256(b"s" * 16, b"mac").hex()[:16]
    '247a7cf38ff7ce0f'
    """
    prk = hmac.digest(salt, secret, "sha256")
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.digest(prk, block + info + bytes([counter]), "sha256")
        out += block
        counter += 1
    return out[:length]


def _secret_bytes(value: Any, name: str) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{name} must be bytes or str, got {type(value).__name__}")
    if len(value) < _MIN_SECRET:
        raise ValueError(f"{name} must be at least {_MIN_SECRET} bytes (a random deployment secret), "
                         f"got {len(value)}")
    return bytes(value)


class _Keys:
    """The keys one secret gives one namespace (never shown in a repr)."""

    __slots__ = ("aead", "key_id", "mac")

    def __init__(self, secret: bytes, namespace_id: bytes) -> None:
        self.mac = hkdf_sha256(secret, b"mac" + namespace_id)
        self.aead = hkdf_sha256(secret, b"aead" + namespace_id)
        self.key_id = hmac.digest(self.mac, b"key id", "sha256")[:8]

    def __repr__(self) -> str:
        return f"_Keys(id={self.key_id.hex()})"


class Seal:
    """How one namespace's chunks are sealed on write and verified on read: the strategy object
    ``encode_chunk`` and ``decode_chunk`` take.

    ``Seal()`` (no secret): the checksum seal — protection against accidents only.
    ``Seal(secret, namespace_id=...)``: every blob written carries an HMAC-SHA256 under the
    secret's key for that namespace; a blob read must carry a valid MAC (or AEAD tag) under
    ``secret`` or ``previous`` (rotation: accepted on read, never used to write).
    ``encrypt=True`` writes AEAD blobs instead (needs the ``cryptography`` package).  Secrets are
    bytes or str of at least 16 bytes; they are never stored in the object's repr or any message.
    Construction costs a few HMACs; the object is immutable and thread-safe.

    >>> Seal().mode, Seal(b"0123456789abcdef", namespace_id=bytes(8)).mode
    (0, 1)
    """

    __slots__ = ("_accept", "_aead", "_write", "mode")

    def __init__(self, secret: bytes | str | None = None, previous: bytes | str | None = None, *,
                 namespace_id: bytes = bytes(8), encrypt: bool = False) -> None:
        if not isinstance(namespace_id, bytes) or len(namespace_id) != 8:
            raise ValueError(f"namespace_id must be 8 bytes, got {namespace_id!r}")
        if not isinstance(encrypt, bool):
            raise TypeError(f"encrypt must be a bool, got {type(encrypt).__name__}")
        if secret is None:
            if previous is not None:
                raise ValueError("previous_secret: set, but secret is not (rotation needs a current secret)")
            if encrypt:
                raise ValueError("encrypt: needs a secret (the key is derived from it)")
            self.mode = SEAL_CHECKSUM
            self._write: _Keys | None = None
            self._accept: dict[bytes, _Keys] = {}
        else:
            self._write = _Keys(_secret_bytes(secret, "secret"), namespace_id)
            self._accept = {self._write.key_id: self._write}
            if previous is not None:
                old = _Keys(_secret_bytes(previous, "previous_secret"), namespace_id)
                self._accept.setdefault(old.key_id, old)
            self.mode = SEAL_AEAD if encrypt else SEAL_MAC
        self._aead: Any = None
        if encrypt:
            _aesgcm()  # fail at construction, naming the extra, not at the first write

    @property
    def keyed(self) -> bool:
        """Whether blobs are authenticated (seal 1 or 2)."""
        return self.mode != SEAL_CHECKSUM

    @property
    def key_id(self) -> bytes:
        """The 8-byte id written into blobs (zeros without a secret)."""
        return bytes(8) if self._write is None else self._write.key_id

    def overhead(self) -> int:
        """Bytes a blob sealed by this object has beyond the plain format (the GCM tag)."""
        return _GCM_TAG if self.mode == SEAL_AEAD else 0

    def __repr__(self) -> str:
        names = {SEAL_CHECKSUM: "checksum", SEAL_MAC: "mac", SEAL_AEAD: "aead"}
        if self._write is None:
            return "Seal(checksum)"
        return f"Seal({names[self.mode]}, key_id={self.key_id.hex()}, accepted={len(self._accept)})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Seal) and self.mode == other.mode
                and sorted(self._accept) == sorted(other._accept) and self.key_id == other.key_id)

    def __hash__(self) -> int:
        return hash((self.mode, self.key_id))


_CHECKSUM_SEAL = Seal()


def _aesgcm() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ImportError("encryption needs the cryptography package: pip install 'radixkv[crypto]'") from None
    return AESGCM


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
        raise ValueError("tokens must be little-endian int32 bytes (see radixkv.core.hashing.as_token_bytes)")


def _check_seal(seal: Any) -> Seal:
    if seal is None:
        return _CHECKSUM_SEAL
    if not isinstance(seal, Seal):
        raise TypeError(f"seal must be a radixkv.core.format.Seal or None, got {type(seal).__name__}")
    return seal


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return _CODES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored; supported: "
                        f"{', '.join(str(d) for d in _CODES)}") from None


def encoded_size(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, seal: Seal | None = None) -> int:
    """Size in bytes of the encoded chunk of a ``shape``/``dtype`` KV tensor under ``seal``
    (``None``: unencrypted, the size of seals 0 and 1).  O(1).

    Useful to size fixed slots (``CpuTier(slot_bytes=...)``) and to refuse a stored object of
    another size before reading it.

    >>> encoded_size((2, 2, 4, 1, 8), torch.float16)
    448
    """
    if len(shape) != _NDIM:
        raise ValueError(f"shape must be [num_layers, 2, chunk_tokens, num_kv_heads, head_dim], got {tuple(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (_payload_offset(int(shape[2])) + int(np.prod(shape, dtype=np.int64)) * itemsize
            + _check_seal(seal).overhead())


def encode_chunk(namespace_id: bytes, key: bytes, parent_key: bytes, tokens: bytes, kv: torch.Tensor,
                 seal: Seal | None = None, codec: Codec | str | None = None) -> bytes:
    """Encode one chunk's KV (``[num_layers, 2, chunk_tokens, num_kv_heads, head_dim]``) to bytes,
    sealed by ``seal`` (``None``: the checksum seal), its payload coded by ``codec`` (a name or a
    ``radixkv.core.codec.Codec``; ``None``: raw).  A codec that does not apply to ``kv``, or whose
    payload would not be smaller than the raw one, leaves it raw.

    ``tokens`` are the chunk's token ids as little-endian int32 bytes (``as_token_bytes``), one per
    position of ``kv``'s third axis.  The tensor may live on any device; it is copied to the CPU
    once.  Cost: O(size) — one device-to-host copy (if needed), one hash or MAC pass and one join
    (AEAD: one more copy and the cipher pass).  Thread-safe (pure function).

    >>> kv = torch.zeros(1, 2, 2, 1, 4)
    >>> blob = encode_chunk(b"n" * 8, b"k" * 16, b"p" * 16, bytes(8), kv)
    >>> len(blob), blob[:4]
    (256, b'RKVC')
    """
    _check_args(namespace_id, key, parent_key, tokens)
    seal = _check_seal(seal)
    codec = get_codec(codec)
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    code = _dtype_code(kv.dtype)
    num_tokens = len(tokens) // 4
    if kv.dim() != _NDIM or kv.shape[1] not in (1, 2) or kv.shape[2] != num_tokens:
        raise ValueError(f"kv must be [num_layers, sides (2, or 1 packed), {num_tokens}, num_kv_heads, head_dim] for "
                         f"{num_tokens} tokens, got {tuple(kv.shape)}")
    if any(d >= 2**32 for d in kv.shape):
        raise ValueError(f"kv dimensions must be below 2**32, got {tuple(kv.shape)}")
    flat = kv.detach().to("cpu").contiguous().reshape(-1)
    payload: Any = (flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)).data
    codec_code, param = 0, 0
    coded = codec.encode(kv) if codec.code else None
    if coded is not None and len(coded[1]) < payload.nbytes:
        codec_code, (param, payload) = codec.code, coded
        payload = memoryview(payload)
    offset = _payload_offset(num_tokens)
    covered = _HEADER.pack(MAGIC, FORMAT_VERSION, code, _NDIM, offset, namespace_id, key, parent_key,
                           num_tokens, *kv.shape, payload.nbytes, seal.mode, codec_code, param, seal.key_id,
                           bytes(32))[:_SEALED_AT]
    padding = bytes(offset - _HEADER.size - len(tokens))
    if seal.mode == SEAL_AEAD:
        assert seal._write is not None
        nonce = os.urandom(_NONCE)
        body = b"".join((tokens, padding, payload))
        sealed = _aesgcm()(seal._write.aead).encrypt(nonce, body, covered)  # ciphertext, then the tag
        return b"".join((covered, nonce, bytes(32 - _NONCE), sealed))
    if seal.mode == SEAL_MAC:
        assert seal._write is not None
        digest: Any = hmac.new(seal._write.mac, digestmod=hashlib.sha256)
    else:
        digest = xxhash.xxh3_64()
    for part in (covered, tokens, padding, payload):
        digest.update(part)
    tag = digest.digest()
    return b"".join((covered, tag, bytes(32 - len(tag)), tokens, padding, payload))


def decode_chunk(blob: Blob, *, namespace_id: bytes, key: bytes, parent_key: bytes, tokens: bytes,
                 dtype: torch.dtype, shape: tuple[int, ...] | torch.Size,
                 out: torch.Tensor | None = None, seal: Seal | None = None) -> torch.Tensor:
    """Verify ``blob`` is exactly the chunk asked for, sealed as ``seal`` requires, and return its
    KV (in ``out`` if given).

    ``seal`` ``None`` (or ``Seal()``) accepts only checksum-sealed blobs; a keyed ``Seal`` accepts
    only blobs whose MAC or AEAD tag verifies under one of its secrets (MAC and AEAD blobs alike,
    whatever ``encrypt`` says).  Raises ``ChunkAuthError`` for a blob not sealed by a secret the
    reader holds, ``ChunkFormatError`` on any other mismatch, truncated or corrupt blob — and then
    ``out`` is left untouched, because everything is verified before the payload is copied.  Raises
    ``ValueError``/``TypeError`` for bad arguments (the caller's bug, not the blob's).

    ``out`` (contiguous, ``dtype``, ``shape``, any device) receives the payload by one copy from
    the blob; without it a new CPU tensor is allocated and filled by one copy.  ``blob`` is only
    read during the call, so a buffer valid only inside a transaction is fine.  Cost: O(size) — one
    hash or MAC pass and one copy (AEAD: the cipher pass into a scratch buffer, then the copy).
    Thread-safe (pure function, apart from writing ``out``).
    """
    _check_args(namespace_id, key, parent_key, tokens)
    seal = _check_seal(seal)
    code = _dtype_code(dtype)
    shape = tuple(int(d) for d in shape)
    num_tokens = len(tokens) // 4
    if len(shape) != _NDIM or shape[1] not in (1, 2) or shape[2] != num_tokens:
        raise ValueError(f"shape must be [num_layers, sides (2, or 1 packed), {num_tokens}, num_kv_heads, "
                         f"head_dim], got {shape}")
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
    if bytes(view[:4]) != MAGIC or bytes(view[4:6]) != FORMAT_VERSION.to_bytes(2, "little"):
        raise ChunkFormatError(f"chunk magic/format version mismatch: blob starts {bytes(view[:6])!r}, "
                               f"expected {MAGIC!r} version {FORMAT_VERSION}")
    (_, _, got_code, ndim, got_offset, got_ns, got_key, got_parent, got_tokens,
     *rest) = _HEADER.unpack_from(view)
    got_shape, got_len, got_seal, got_codec, param, key_id, tag = tuple(rest[:_NDIM]), *rest[_NDIM:]
    overhead = _GCM_TAG if got_seal == SEAL_AEAD else 0
    if got_codec:                      # a coded payload: any length below the raw one
        try:
            codec = codec_by_code(got_codec)
        except ValueError as exc:
            raise ChunkFormatError(str(exc)) from None
        if not 0 < got_len < payload_len:
            raise ChunkFormatError(f"chunk coded payload length {got_len} is not below the raw {payload_len}")
        payload_len = got_len
    elif param:
        raise ChunkFormatError(f"chunk raw payload with a codec parameter {param}")
    expected = (("namespace id", got_ns, namespace_id), ("key", got_key, key),
                ("parent key", got_parent, parent_key), ("number of tokens", got_tokens, num_tokens),
                ("dtype", _DTYPE_NAMES.get(got_code, got_code), _DTYPE_NAMES[code]),
                ("ndim", ndim, _NDIM), ("shape", got_shape, shape),
                ("payload offset", got_offset, offset), ("payload length", got_len, payload_len),
                ("blob length", len(view), offset + payload_len + overhead))
    for name, got, want in expected:
        if got != want:
            raise ChunkFormatError(f"chunk {name} mismatch: blob has {got!r}, expected {want!r}")
    if view[87]:
        raise ChunkFormatError("chunk reserved header byte is not zero")
    covered = view[:_SEALED_AT]
    if got_seal not in (SEAL_CHECKSUM, SEAL_MAC, SEAL_AEAD):
        raise ChunkFormatError(f"chunk seal {got_seal} unknown")
    if not seal.keyed:
        if got_seal != SEAL_CHECKSUM:
            raise ChunkAuthError("chunk is sealed with a secret and this reader has none")
        if key_id != bytes(8) or tag[8:] != bytes(24):
            raise ChunkFormatError("chunk checksum seal with a key id or stray tag bytes")
        if view[_HEADER.size:_HEADER.size + len(tokens)] != tokens:
            raise ChunkFormatError("chunk tokens mismatch: the blob holds KV of other tokens")
        digest = xxhash.xxh3_64()
        digest.update(covered)
        digest.update(view[_HEADER.size:])
        if digest.digest() != tag[:8]:
            raise ChunkFormatError("chunk checksum mismatch: the blob is corrupt")
        return _payload(view[offset:], got_codec, param, dtype, shape, out)
    if got_seal == SEAL_CHECKSUM:
        raise ChunkAuthError("chunk has no MAC: written without the deployment secret (forged or foreign)")
    keys = seal._accept.get(bytes(key_id))
    if keys is None:
        raise ChunkAuthError(f"chunk sealed by an unknown key id {bytes(key_id).hex()}")
    if got_seal == SEAL_MAC:
        mac = hmac.new(keys.mac, covered, hashlib.sha256)
        mac.update(view[_HEADER.size:])
        if not hmac.compare_digest(mac.digest(), tag):
            raise ChunkAuthError("chunk MAC mismatch: the blob was forged or altered")
        if view[_HEADER.size:_HEADER.size + len(tokens)] != tokens:
            raise ChunkFormatError("chunk tokens mismatch: the blob holds KV of other tokens")
        return _payload(view[offset:], got_codec, param, dtype, shape, out)
    if tag[_NONCE:] != bytes(32 - _NONCE):
        raise ChunkFormatError("chunk AEAD seal with stray tag bytes")
    from cryptography.exceptions import InvalidTag

    plain = bytearray(len(view) - _HEADER.size - _GCM_TAG)
    try:
        _aesgcm()(keys.aead).decrypt_into(bytes(tag[:_NONCE]), view[_HEADER.size:], covered, plain)
    except InvalidTag:
        raise ChunkAuthError("chunk AEAD tag mismatch: the blob was forged or altered") from None
    body = memoryview(plain)
    if body[:len(tokens)] != tokens:
        raise ChunkFormatError("chunk tokens mismatch: the blob holds KV of other tokens")
    return _payload(body[offset - _HEADER.size:], got_codec, param, dtype, shape, out)


class VerifiedChunk(NamedTuple):
    """What ``verify_chunk`` found in a blob that verifies: its parent key, its token ids (int32
    bytes) and its KV (a new CPU tensor)."""

    parent: bytes
    tokens: bytes
    kv: torch.Tensor


def verify_chunk(blob: Blob, *, namespace_id: bytes, key: bytes, seal: Seal | None = None) -> VerifiedChunk:
    """Verify a stored blob found under ``key`` without knowing its tokens (what ``python -m
    radixkv inspect --verify`` does with every entry of a tier): the header's own parent key,
    tokens, dtype and shape must make a blob that ``decode_chunk`` accepts under ``seal``, and
    ``key`` must be the digest of that parent and those tokens (the chain ``chunk_keys`` and
    ``tail_key`` make).  Returns them and the KV (``VerifiedChunk``).  Raises ``ChunkAuthError`` for a
    blob not sealed by a secret ``seal`` holds, ``ChunkFormatError`` for anything else wrong.
    Cost: O(size), one hash or MAC pass and one copy (AEAD: decrypted twice).

    >>> kv = torch.zeros(1, 2, 2, 1, 2)
    >>> tokens = bytes(np.array([5, 6], dtype="<i4"))
    >>> key = xxhash.xxh3_128_digest(bytes(16) + tokens)
    >>> blob = encode_chunk(bytes(8), key, bytes(16), tokens, kv)
    >>> found = verify_chunk(blob, namespace_id=bytes(8), key=key)
    >>> found.parent == bytes(16), found.tokens == tokens, tuple(found.kv.shape)
    (True, True, (1, 2, 2, 1, 2))
    """
    seal = _check_seal(seal)
    view = memoryview(blob).cast("B")
    if len(view) < _HEADER.size or bytes(view[:4]) != MAGIC:
        raise ChunkFormatError("not a radixkv chunk (no magic)")
    (_, _, code, _, _, _, _, parent, num_tokens, *rest) = _HEADER.unpack_from(view)
    shape, got_seal, key_id, tag = tuple(rest[:_NDIM]), rest[_NDIM + 1], rest[_NDIM + 4], rest[_NDIM + 5]
    if code not in _DTYPES or len(view) < _HEADER.size + 4 * num_tokens:
        raise ChunkFormatError(f"chunk dtype code {code} or token count {num_tokens} does not fit the blob")
    if got_seal == SEAL_AEAD and seal.keyed:
        keys = seal._accept.get(bytes(key_id))
        if keys is None:
            raise ChunkAuthError(f"chunk sealed by an unknown key id {bytes(key_id).hex()}")
        from cryptography.exceptions import InvalidTag

        try:
            plain = _aesgcm()(keys.aead).decrypt(bytes(tag[:_NONCE]), bytes(view[_HEADER.size:]),
                                                 bytes(view[:_SEALED_AT]))
        except InvalidTag:
            raise ChunkAuthError("chunk AEAD tag mismatch: the blob was forged or altered") from None
        tokens = plain[:4 * num_tokens]
    else:
        tokens = bytes(view[_HEADER.size:_HEADER.size + 4 * num_tokens])
    try:
        kv = decode_chunk(view, namespace_id=namespace_id, key=key, parent_key=parent, tokens=tokens,
                     dtype=_DTYPES[code], shape=shape, seal=seal)
    except ChunkFormatError:
        raise
    except (ValueError, TypeError) as exc:       # a header that names an impossible shape
        raise ChunkFormatError(f"chunk header does not describe a chunk: {exc}") from None
    if xxhash.xxh3_128_digest(parent + tokens) != key:
        raise ChunkFormatError("chunk key mismatch: the key is not the digest of the blob's parent and tokens")
    return VerifiedChunk(parent, tokens, kv)


def chunk_codec(blob: Blob) -> int:
    """The codec code a blob's header names (``radixkv.core.codec``; 0: raw), read without
    verifying anything: ask it of a blob ``decode_chunk`` accepted.  O(1).

    >>> kv = torch.randn(1, 2, 64, 1, 8)
    >>> chunk_codec(encode_chunk(bytes(8), bytes(16), bytes(16), bytes(256), kv, codec="int8"))
    2
    >>> chunk_codec(encode_chunk(bytes(8), bytes(16), bytes(16), bytes(4), kv[:, :, :1], codec="int8"))  # no smaller
    0
    """
    view = memoryview(blob).cast("B")
    return view[85] if len(view) > 85 else 0


def chunk_codec_param(blob: Blob) -> tuple[int, int]:
    """The codec code and parameter a blob's header names (``(0, 0)``: raw), read without
    verifying anything, as ``chunk_codec``.  O(1)."""
    view = memoryview(blob).cast("B")
    return (view[85], view[86]) if len(view) > 86 else (0, 0)


def _payload(payload: memoryview, codec: int, param: int, dtype: torch.dtype, shape: tuple[int, ...],
             out: torch.Tensor | None) -> torch.Tensor:
    """The verified payload's KV: a copy of a raw one, the decode of a coded one (a payload its
    codec refuses is a ``ChunkFormatError``)."""
    if not codec:
        return _copy_payload(payload, dtype, shape, out)
    try:
        return codec_by_code(codec).decode(payload, param, dtype, shape, out)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ChunkFormatError(f"chunk coded payload does not decode: {exc}") from None


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
