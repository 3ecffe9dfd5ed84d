"""The chunk format: round trips, every field verified, and a decoder no bytes can crash."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.core.format import ChunkFormatError, decode_chunk, encode_chunk, encoded_size
from radixkv.core.hashing import as_token_bytes

NS, KEY, PARENT = b"n" * 8, b"k" * 16, b"p" * 16
TOKENS = as_token_bytes([3, 1, 4])
SHAPE = (2, 2, 3, 1, 4)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))]


def kv_of(dtype: torch.dtype, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    values = torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 100
    return values.to(dtype)


def decode(blob: bytes | bytearray | memoryview, **overrides: object) -> torch.Tensor:
    args: dict = dict(namespace_id=NS, key=KEY, parent_key=PARENT, tokens=TOKENS, dtype=torch.float16,
                      shape=SHAPE)
    args.update(overrides)
    return decode_chunk(blob, **args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype: torch.dtype) -> None:
    kv = kv_of(dtype)
    blob = encode_chunk(NS, KEY, PARENT, TOKENS, kv)
    assert len(blob) == encoded_size(SHAPE, dtype)
    got = decode(blob, dtype=dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))


def test_encode_accepts_a_non_contiguous_tensor() -> None:
    kv = kv_of(torch.float32, (2, 2, 1, 3, 4)).transpose(2, 3)  # [2, 2, 3, 1, 4], not contiguous
    got = decode(encode_chunk(NS, KEY, PARENT, TOKENS, kv), dtype=torch.float32)
    assert torch.equal(got, kv)


def test_decode_into_out_copies_once_into_it() -> None:
    kv = kv_of(torch.float16)
    out = torch.full(SHAPE, -1.0, dtype=torch.float16)
    ptr = out.data_ptr()
    for blob in (encode_chunk(NS, KEY, PARENT, TOKENS, kv), bytearray(encode_chunk(NS, KEY, PARENT, TOKENS, kv))):
        got = decode(memoryview(blob), out=out)
        assert got is out and out.data_ptr() == ptr and torch.equal(out, kv)


def test_payload_starts_aligned() -> None:
    blob = encode_chunk(NS, KEY, PARENT, TOKENS, kv_of(torch.float32))
    assert (len(blob) - kv_of(torch.float32).numel() * 4) % 64 == 0


@pytest.mark.parametrize("field, value", [
    ("namespace_id", b"N" * 8), ("key", b"K" * 16), ("parent_key", b"P" * 16),
    ("tokens", as_token_bytes([3, 1, 5])), ("dtype", torch.bfloat16), ("shape", (2, 2, 3, 2, 2)),
    ("shape", (1, 2, 3, 1, 4))])
def test_every_field_is_verified(field: str, value: object) -> None:
    blob = encode_chunk(NS, KEY, PARENT, TOKENS, kv_of(torch.float16))
    out_shape: Any = value if field == "shape" else SHAPE
    out_dtype: Any = value if field == "dtype" else torch.float16
    out = torch.zeros(out_shape, dtype=out_dtype)
    with pytest.raises(ChunkFormatError):
        decode(blob, **{field: value, "out": out})
    assert not out.any(), "a rejected blob wrote into out"


def test_corrupt_payload_leaves_out_untouched() -> None:
    blob = bytearray(encode_chunk(NS, KEY, PARENT, TOKENS, kv_of(torch.float16)))
    blob[-1] ^= 1
    out = torch.zeros(SHAPE, dtype=torch.float16)
    with pytest.raises(ChunkFormatError, match="checksum"):
        decode(blob, out=out)
    assert not out.any()


def test_bad_arguments_are_the_callers_error_not_the_blobs() -> None:
    blob = encode_chunk(NS, KEY, PARENT, TOKENS, kv_of(torch.float16))
    with pytest.raises(ValueError, match="key must be 16 bytes") as info:
        decode(blob, key=b"short")
    assert not isinstance(info.value, ChunkFormatError)
    with pytest.raises(ValueError, match="shape must be"):
        decode(blob, shape=(2, 2, 4, 1, 4))
    with pytest.raises(ValueError, match="out must be"):
        decode(blob, out=torch.zeros(SHAPE, dtype=torch.float32))
    with pytest.raises(TypeError, match="cannot be stored"):
        encode_chunk(NS, KEY, PARENT, TOKENS, kv_of(torch.float32).to(torch.float64))
    with pytest.raises(ValueError, match="3 tokens"):
        encode_chunk(NS, KEY, PARENT, TOKENS, kv_of(torch.float16, (2, 2, 4, 1, 4)))


# -- fuzzing: every malformed blob is rejected cleanly ----------------------------------------

VALID = encode_chunk(NS, KEY, PARENT, TOKENS, kv_of(torch.float16))
HEADER = "<4sHBBI8s16s16sI5IQB3x8s32s"  # the v2 header, spelled out: the format is a contract


def _rejects(blob: bytes | bytearray) -> None:
    try:
        decode(blob)
    except ChunkFormatError:
        return
    raise AssertionError("a malformed blob was accepted")


@pytest.mark.slow                 # a fuzzer of 2000 examples: `make test` runs it
@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=2 * len(VALID)))
def test_fuzz_random_bytes_are_rejected(blob: bytes) -> None:
    _rejects(blob)


@pytest.mark.slow                 # a fuzzer of 2000 examples: `make test` runs it
@settings(max_examples=2000, deadline=None)
@given(st.lists(st.integers(0, 8 * len(VALID) - 1), min_size=1, max_size=4, unique=True))
def test_fuzz_bit_flips_are_rejected(bits: list[int]) -> None:
    blob = bytearray(VALID)
    for bit in bits:
        blob[bit // 8] ^= 1 << (bit % 8)
    _rejects(blob)


@settings(max_examples=1000, deadline=None)
@given(st.integers(0, len(VALID) - 1), st.binary(max_size=64), st.booleans())
def test_fuzz_truncated_extended_and_spliced_blobs_are_rejected(cut: int, junk: bytes, splice: bool) -> None:
    _rejects(VALID[:cut] + junk if splice else VALID[:cut])
    if junk:
        _rejects(VALID + junk)


@pytest.mark.slow                 # 1000 headers rewritten, checksums fixed up (seconds): `make test` runs it
@settings(max_examples=1000, deadline=None)
@given(st.data())
def test_fuzz_header_fields_rewritten_are_rejected(data: st.DataObject) -> None:
    # Lengths, offsets and shapes set to anything, with the checksum fixed up to match: the
    # decoder must still refuse because they disagree with the caller and the blob size.
    import struct

    import xxhash

    fields = list(struct.unpack_from(HEADER, VALID))
    index = data.draw(st.sampled_from([1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15]), label="field")
    old = fields[index]
    fields[index] = data.draw(st.integers(0, 2**16 - 1 if index == 1 else 255 if index in (2, 3, 15)
                                          else 2**64 - 1 if index == 14 else 2**32 - 1).filter(lambda v: v != old))
    header = struct.pack(HEADER, *fields)
    rest = VALID[len(header):]
    digest = xxhash.xxh3_64(header[:96])
    digest.update(rest)
    _rejects(header[:96] + digest.digest() + bytes(24) + rest)


def test_no_unsafe_deserialisation_on_any_read_path() -> None:
    root = Path(__file__).resolve().parents[2]
    sources = [*sorted((root / "radixkv" / "core").glob("*.py")), *sorted((root / "radixkv" / "p2p").glob("*.py")),
               *sorted((root / "backends").glob("*.py"))]
    unsafe_modules = {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib"}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            assert not names & unsafe_modules, f"{path.name} imports {names & unsafe_modules}"
            assert not (isinstance(node, ast.Name) and node.id in {"eval", "exec"}), f"{path.name} uses {node.id}"
            assert not (isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name)
                        and node.value.id == "torch"), f"{path.name} uses torch.load"


# -- seals: keyed MAC and AEAD ----------------------------------------------------------------

from radixkv.core.format import ChunkAuthError, Seal  # noqa: E402

SECRET = b"format-test-secret-0123456789"
SEALS = {"mac": Seal(SECRET, namespace_id=NS), "aead": Seal(SECRET, namespace_id=NS, encrypt=True)}
SEALED = {name: encode_chunk(NS, KEY, PARENT, TOKENS, kv_of(torch.float16), seal=seal) for name, seal in SEALS.items()}


@pytest.mark.parametrize("name", SEALS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sealed_round_trip_every_dtype(name: str, dtype: torch.dtype) -> None:
    seal = SEALS[name]
    kv = kv_of(dtype)
    blob = encode_chunk(NS, KEY, PARENT, TOKENS, kv, seal=seal)
    assert len(blob) == encoded_size(SHAPE, dtype, seal)
    got = decode(blob, dtype=dtype, seal=seal)
    assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    if name == "aead":
        assert kv.view(torch.uint8).numpy().tobytes() not in blob
        odd = as_token_bytes([0x7A5B3C1D, 0x1F2E3D4C, 0x6B5A4938])  # tokens no header field spells
        assert odd not in encode_chunk(NS, KEY, PARENT, odd, kv, seal=seal)


@pytest.mark.parametrize("name", SEALS)
def test_a_keyed_reader_accepts_only_its_secrets(name: str) -> None:
    with pytest.raises(ChunkAuthError, match="no MAC"):
        decode(VALID, seal=SEALS[name])
    other = Seal(b"another-secret-0123456789", namespace_id=NS)
    with pytest.raises(ChunkAuthError, match="unknown key id"):
        decode(SEALED[name], seal=other)
    rotated = Seal(b"another-secret-0123456789", SECRET, namespace_id=NS)
    assert torch.equal(decode(SEALED[name], seal=rotated), kv_of(torch.float16))
    with pytest.raises(ChunkAuthError, match="has none"):
        decode(SEALED[name])
    # Keys are per namespace: the same secret for another namespace does not verify it.
    with pytest.raises(ChunkFormatError):
        decode(SEALED[name], namespace_id=b"N" * 8, seal=Seal(SECRET, namespace_id=b"N" * 8))


@pytest.mark.parametrize("name", SEALS)
@settings(max_examples=300, deadline=None)
@given(bits=st.lists(st.integers(0, 8 * 700 - 1), min_size=1, max_size=3, unique=True))
def test_fuzz_bit_flips_in_sealed_blobs_are_rejected(name: str, bits: list[int]) -> None:
    blob = bytearray(SEALED[name])
    for bit in bits:
        blob[(bit // 8) % len(blob)] ^= 1 << (bit % 8)
    if blob == SEALED[name]:
        return
    out = torch.zeros(SHAPE, dtype=torch.float16)
    with pytest.raises(ChunkFormatError):
        decode(blob, seal=SEALS[name], out=out)
    assert not out.any()
