"""The codecs (``radixkv.core.codec``) and coded chunks (``radixkv.core.format``).

* the lossless codec is bit-exact, the lossy ones within their documented bound, as properties
  over shapes, dtypes and value ranges (outliers, constant channels, tiny and huge values);
* a coded chunk is decoded by any reader whatever its own codec, and a truncated, bit-flipped or
  header-forged one is a ``ChunkFormatError`` (a miss), never another exception;
* through a stack and a cache: lossy chunks are counted apart, never promoted or stored down
  as exact, and the pages they fill mark the requests that reuse them.

The S3 and Redis round trips are in ``test_codec_remote.py`` (they start servers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, example, given, settings, strategies as st

pytest.importorskip("zstandard")

from radixkv import PrefixCache  # noqa: E402
from radixkv.backends import CpuTier, LmdbTier  # noqa: E402
from radixkv.core.codec import CODECS, Codec, get_codec, layer_bits  # noqa: E402
from radixkv.core.format import (ChunkFormatError, Seal, chunk_codec, decode_chunk, encode_chunk,  # noqa: E402
                                 verify_chunk)
from radixkv.core.hashing import Namespace  # noqa: E402
from radixkv.core.pool import KVLayout  # noqa: E402
from radixkv.core.stack import TierStack  # noqa: E402
from radixkv.core.tier import MemoryTier  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Relative rounding of one value to each dtype (half an ulp), and its smallest spacing.
HALF_ULP = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
#: The smallest spacing of each dtype, and float32's smallest normal value: the float32 arithmetic
#: of a decode may flush a subnormal to zero.
FLUSH = 2.0 ** -125
TINY = {torch.float16: 2.0 ** -25, torch.bfloat16: FLUSH, torch.float32: FLUSH}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def kv_tensors(draw: st.DrawFn, max_tokens: int = 40) -> torch.Tensor:
    """A KV chunk ``[layers, sides, tokens, heads, dim]`` of a dtype, at a scale, with (maybe)
    outlier channels, constant channels and outlier tokens."""
    shape = (draw(st.integers(1, 4)), draw(st.sampled_from([1, 2])), draw(st.integers(1, max_tokens)),
             draw(st.integers(1, 3)), draw(st.integers(1, 24)))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** draw(st.integers(-3, 3))
    x = torch.randn(shape, generator=g) * scale + draw(st.floats(-2, 2)) * scale
    if draw(st.booleans()):                                   # an outlier channel
        x[..., draw(st.integers(0, shape[4] - 1))] *= 50
    if draw(st.booleans()):                                   # a constant channel
        x[..., :, :, 0] = draw(st.floats(-100, 100))
    if draw(st.booleans()) and shape[2] > 1:                  # an outlier token
        x[:, :, draw(st.integers(0, shape[2] - 1))] *= 30
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


def bound(kv: torch.Tensor, codec: Codec) -> torch.Tensor:
    """The documented per-value error bound of a lossy codec (``radixkv.core.codec``), broadcast
    to ``kv``'s shape: half a step of the channel's range, plus the dtype's rounding of the
    result and float32 arithmetic."""
    x = kv.float()
    lo, hi = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
    span = hi - lo
    if codec.name == "int8":
        half_step = span / 510
    else:
        bits = torch.tensor(layer_bits(codec.bits, kv.shape[0]), dtype=torch.float32)  # type: ignore[attr-defined]
        qmax = (2 ** (bits - 1) - 1).reshape(-1, 1, 1, 1, 1)
        half_step = span * (1 + 1 / 510) / (2 * qmax)
    magnitude = torch.maximum(lo.abs(), hi.abs())
    rounding = (magnitude + half_step) * HALF_ULP[kv.dtype] + TINY[kv.dtype]
    return half_step + rounding + magnitude * 2e-6


@SETTINGS
@given(kv_tensors())
def test_the_lossless_codec_is_bit_exact(kv: torch.Tensor) -> None:
    codec = CODECS["zstd"]
    param, payload = codec.encode(kv)  # type: ignore[misc]
    out = codec.decode(memoryview(payload), param, kv.dtype, tuple(kv.shape), None)
    assert out.dtype == kv.dtype and torch.equal(out.view(torch.uint8 if kv.element_size() == 1 else
                                                          {2: torch.int16, 4: torch.int32}[kv.element_size()]),
                                                 kv.view({2: torch.int16, 4: torch.int32}[kv.element_size()]))


@SETTINGS
@given(kv_tensors(), st.sampled_from(["int8", "cachegen", "cachegen:2", "cachegen:4"]), st.booleans())
def test_lossy_codecs_stay_within_their_bound(kv: torch.Tensor, name: str, into_out: bool) -> None:
    codec = get_codec(name)
    param, payload = codec.encode(kv)  # type: ignore[misc]
    out = torch.full_like(kv, float("nan")) if into_out else None
    got = codec.decode(memoryview(payload), param, kv.dtype, tuple(kv.shape), out)
    assert got.dtype == kv.dtype and tuple(got.shape) == tuple(kv.shape)
    if out is not None:
        assert got is out
    err = (got.float() - kv.float()).abs()
    limit = bound(kv, codec)
    assert bool((err <= limit).all()), f"error {float((err - limit).max()):.3g} past the bound ({name}, {kv.dtype})"
    constant = (kv.float().amax(dim=2) == kv.float().amin(dim=2)) & (kv.float().amax(dim=2).abs() >= FLUSH)
    assert torch.equal(got.float().amax(dim=2)[constant], kv.float().amax(dim=2)[constant]), \
        "a constant channel is not exact"


@pytest.mark.parametrize("name", ["int8", "cachegen"])
def test_non_finite_kv_and_non_float_dtypes_are_left_raw(name: str) -> None:
    codec = get_codec(name)
    kv = torch.randn(1, 2, 64, 1, 8)
    kv[0, 0, 3, 0, 1] = float("inf")
    assert codec.encode(kv) is None and codec.encode(torch.zeros(1, 2, 4, 1, 8, dtype=torch.int8)) is None
    blob = encode_chunk(bytes(8), bytes(16), bytes(16), bytes(256), kv, codec=codec)
    assert chunk_codec(blob) == 0                     # stored raw, exactly
    got = decode_chunk(blob, namespace_id=bytes(8), key=bytes(16), parent_key=bytes(16), tokens=bytes(256),
                       dtype=kv.dtype, shape=kv.shape)
    assert torch.equal(got, kv)


def test_codec_names_and_cachegen_bits() -> None:
    assert get_codec("cachegen:4").bits == 4 and get_codec("cachegen").bits == 3  # type: ignore[attr-defined]
    assert layer_bits(3, 1) == (5,) and layer_bits(4, 3) == (6, 5, 4)
    for bad in ("lz4", "cachegen:5", "cachegen:x", "int8:3"):
        with pytest.raises(ValueError, match="codec"):
            get_codec(bad)
    with pytest.raises(TypeError, match="codec"):
        get_codec(3)  # type: ignore[arg-type]


# -- coded chunks ------------------------------------------------------------------------------

NS, KEY, PARENT = b"n" * 8, b"k" * 16, b"p" * 16
SEALS = [None, Seal(b"a-secret-of-16-bytes"), Seal(b"a-secret-of-16-bytes", encrypt=True)]


def chunk(kv: torch.Tensor) -> tuple[bytes, dict[str, Any]]:
    tokens = np.arange(kv.shape[2], dtype="<i4").tobytes()
    return tokens, dict(namespace_id=NS, key=KEY, parent_key=PARENT, tokens=tokens, dtype=kv.dtype,
                        shape=tuple(kv.shape))


@settings(max_examples=40, deadline=None)
@given(kv_tensors(max_tokens=64), st.sampled_from(sorted(CODECS)), st.sampled_from(range(len(SEALS))))
def test_a_coded_chunk_decodes_for_any_reader_and_its_header_names_the_codec(kv: torch.Tensor, name: str,
                                                                             s: int) -> None:
    tokens, expect = chunk(kv)
    seal = SEALS[s]
    blob = encode_chunk(NS, KEY, PARENT, tokens, kv, seal=seal, codec=name)
    raw = encode_chunk(NS, KEY, PARENT, tokens, kv, seal=seal)
    code = chunk_codec(blob)
    assert code in (0, get_codec(name).code) and len(blob) <= len(raw)
    assert (code == 0) == (len(blob) == len(raw))    # coded only when smaller
    got = decode_chunk(blob, **expect, seal=seal)
    if code == 0 or not get_codec(name).lossy:
        assert torch.equal(got.float().nan_to_num(), kv.float().nan_to_num())
    if s == 0:    # inspect --verify's reader: it finds tokens and parent in the header
        key = xxhash.xxh3_128_digest(PARENT + tokens)
        blob = encode_chunk(NS, key, PARENT, tokens, kv, codec=name)
        found = verify_chunk(blob, namespace_id=NS, key=key)
        assert found.tokens == tokens and torch.equal(found.kv, decode_chunk(blob, **{**expect, "key": key}))


def coded_blob(seal_index: int = 0, name: str = "cachegen") -> tuple[bytes, dict[str, Any]]:
    kv = torch.randn(3, 2, 48, 2, 16, generator=torch.Generator().manual_seed(1)).half()
    tokens, expect = chunk(kv)
    blob = encode_chunk(NS, KEY, PARENT, tokens, kv, seal=SEALS[seal_index], codec=name)
    assert chunk_codec(blob) == get_codec(name).code
    return blob, expect


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["zstd", "int8", "cachegen"]), st.sampled_from(range(len(SEALS))), st.data())
def test_a_truncated_or_bit_flipped_coded_chunk_is_a_format_error(name: str, s: int, data: st.DataObject) -> None:
    blob, expect = coded_blob(s, name)
    out = torch.full(expect["shape"], 7.0, dtype=expect["dtype"])
    if data.draw(st.booleans(), label="truncate"):
        bad = blob[:data.draw(st.integers(0, len(blob) - 1), label="length")]
    else:
        at = data.draw(st.integers(0, len(blob) - 1), label="byte")
        bad = blob[:at] + bytes([blob[at] ^ (1 << data.draw(st.integers(0, 7), label="bit"))]) + blob[at + 1:]
    with pytest.raises(ChunkFormatError):
        decode_chunk(bad, **expect, out=out, seal=SEALS[s])
    assert bool((out == 7).all()), "a refused chunk wrote into out"


def reseal(blob: bytes, payload: bytes | None = None, codec: int | None = None, param: int | None = None) -> bytes:
    """A forger's checksum-sealed blob: header bytes changed, payload replaced, checksum redone."""
    head = bytearray(blob[:128])
    offset = int.from_bytes(head[8:12], "little")
    body = bytearray(blob[128:offset]) + bytearray(blob[offset:] if payload is None else payload)
    if codec is not None:
        head[85] = codec
    if param is not None:
        head[86] = param
    head[76:84] = (len(body) - (offset - 128)).to_bytes(8, "little")
    digest = xxhash.xxh3_64()
    digest.update(bytes(head[:96]))
    digest.update(bytes(body))
    head[96:104] = digest.digest()
    return bytes(head) + bytes(body)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["zstd", "int8", "cachegen"]), st.data())
@example("cachegen", None).via("an unknown codec")  # type: ignore[arg-type]
def test_a_forged_header_or_payload_under_a_valid_checksum_never_raises_anything_else(name: str,
                                                                                      data: Any) -> None:
    blob, expect = coded_blob(0, name)
    offset = int.from_bytes(blob[8:12], "little")
    payload = blob[offset:]
    if data is None:
        forged = reseal(blob, codec=9)
    else:
        codec = data.draw(st.sampled_from([None, 0, 1, 2, 3, 4, 200]), label="codec")
        param = data.draw(st.sampled_from([None, 0, 1, 2, 3, 6, 7, 8, 255]), label="param")
        how = data.draw(st.sampled_from(["keep", "random", "cut", "flip"]), label="payload")
        if how == "random":
            payload = data.draw(st.binary(min_size=1, max_size=len(payload) + 8), label="bytes")
        elif how == "cut":
            payload = payload[:data.draw(st.integers(1, len(payload)), label="length")]
        elif how == "flip":
            at = data.draw(st.integers(0, len(payload) - 1), label="byte")
            payload = payload[:at] + bytes([payload[at] ^ 0xFF]) + payload[at + 1:]
        forged = reseal(blob, payload, codec, param)
    try:
        got = decode_chunk(forged, **expect)
    except ChunkFormatError:
        return
    assert got.dtype == expect["dtype"] and tuple(got.shape) == expect["shape"]   # a forger's KV, well formed


# -- through a stack and a cache ---------------------------------------------------------------

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float16, page_size=4)
CHUNK = 16


def stack_of(tiers: list[Any], codecs: list[Any] | None, **kw: Any) -> TierStack:
    return TierStack(tiers, namespace=Namespace(model="codec-test"), layout=LAYOUT, chunk_size=CHUNK,
                     codecs=codecs, **kw)


def test_the_cpu_tier_and_peers_stay_raw_and_codecs_are_one_per_tier() -> None:
    with pytest.raises(ValueError, match="CPU tier"):
        stack_of([CpuTier(1 << 20)], ["int8"])
    with pytest.raises(ValueError, match="one codec per tier"):
        stack_of([MemoryTier()], ["int8", "int8"])
    with pytest.raises(ValueError, match="one codec per tier"):
        stack_of([MemoryTier()], "int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="codec must be one of"):
        stack_of([MemoryTier()], ["gzip"])


@pytest.mark.parametrize("name", ["zstd", "int8", "cachegen"])
def test_a_chunk_coded_by_one_instance_is_read_by_another_with_any_setting(name: str, tmp_path: Any) -> None:
    kv = [torch.randn(LAYOUT.chunk_shape(CHUNK)).half() for _ in range(3)]
    writer = stack_of([LmdbTier(str(tmp_path), 1 << 24)], [name])
    refs = writer.refs(list(range(3 * CHUNK)))
    writer.store(list(zip(refs, kv)))
    writer.flush()
    writer.close()
    for own in ("none", "zstd", "int8", "cachegen"):
        reader = stack_of([LmdbTier(str(tmp_path), 1 << 24)], [own])
        got = reader.load(refs)
        assert len(got) == 3
        lossy = get_codec(name).lossy
        for g, k in zip(got, kv):
            assert reader.approximate(g) == lossy
            assert lossy or torch.equal(g, k)
            assert bool(((g.float() - k.float()).abs() <= bound(k, get_codec(name) if lossy else CODECS["int8"])).all())
        assert reader.stats()["lossy_loaded"] == [3 if lossy else 0]
        reader.check()
        reader.close()


def test_lossy_chunks_are_promoted_only_as_the_same_blob_and_exact_ones_are_re_encoded(tmp_path: Any) -> None:
    kv = [torch.randn(LAYOUT.chunk_shape(CHUNK)).half() for _ in range(2)]
    for below, above, expect_promoted in (("cachegen", "cachegen", True), ("cachegen", "none", False),
                                          ("int8", "cachegen", False), ("zstd", "none", True),
                                          ("none", "int8", True)):
        top, bottom = MemoryTier(), MemoryTier()
        stack = stack_of([top, bottom], [above, below])
        refs = stack.refs(list(range(2 * CHUNK)))
        stack.store(list(zip(refs, kv)), tiers=[1])
        stack.flush()
        got = stack.load(refs, where=[1, 1])
        stack.flush()
        assert len(got) == 2
        held = top.contains_prefix([stack.namespace.id + r.key for r in refs])
        assert held == (2 if expect_promoted else 0), (below, above)
        if expect_promoted:            # from the top tier now, written with its own codec
            again = stack.load(refs)
            assert stack.stats()["hits"][0] == 2
            assert [stack.approximate(g) for g in again] == [get_codec(above).lossy] * 2
        stack.check()
        stack.close()


@pytest.mark.parametrize("written, own, above, promoted_as", [
    ("int8", "none", "none", None),          # lossy, foreign to a raw tier: never stored above as exact
    ("int8", "none", "int8", 2),             # lossy, the codec above writes: the same blob goes up
    ("cachegen", "cachegen:4", "cachegen:4", None),   # another bit depth: not the blob the tier writes
    ("cachegen:4", "none", "cachegen:4", 3),
    ("zstd", "none", "none", 0),             # exact: re-encoded for the raw tier above
    ("none", "int8", "none", 0),             # a raw blob in a coded tier: the same blob goes up
])
def test_promotion_follows_the_codec_a_blob_was_written_with_not_the_tier_setting(
        written: str, own: str, above: str, promoted_as: int | None) -> None:
    """A tier holds what any writer put there (a shared tier, a peer that codes on request): a
    chunk goes up as the same blob only into a tier that writes that codec, lossy KV never into
    another, and exact KV is re-encoded for the tier above."""
    kv = [torch.randn(LAYOUT.chunk_shape(CHUNK)).half() for _ in range(2)]
    top, bottom = MemoryTier(), MemoryTier()
    writer = stack_of([bottom], [written])
    refs = writer.refs(list(range(2 * CHUNK)))
    writer.store(list(zip(refs, kv)))
    writer.flush()
    reader = stack_of([top, bottom], [above, own])
    got = reader.load(refs, where=[1, 1])
    reader.flush()
    assert len(got) == 2
    assert all(reader.approximate(g) == get_codec(written).lossy for g in got)
    keys = [reader.namespace.id + r.key for r in refs]
    if promoted_as is None:
        assert top.contains_prefix(keys) == 0
    else:
        assert top.contains_prefix(keys) == 2
        assert {chunk_codec(top.get(k)) for k in keys} == {promoted_as}
    reader.check()
    reader.close()
    writer.close()


def fill(cache: PrefixCache, tokens: list[int], seed: int = 0) -> torch.Tensor:
    pages = cache.alloc(len(tokens) // LAYOUT.page_size)
    kv = torch.randn(cache.pool.kv[:, :, pages].shape, generator=torch.Generator().manual_seed(seed)).half()
    cache.pool.kv[:, :, pages] = kv
    cache.insert(tokens, pages)
    return kv


@pytest.mark.parametrize("evict_flush", [True, False])
def test_a_request_served_from_lossy_chunks_is_counted_apart_and_its_pages_are_never_stored_as_exact(
        tmp_path: Any, evict_flush: bool) -> None:
    tokens = list(range(4 * CHUNK))
    cache = PrefixCache(LAYOUT, num_pages=64, tiers=[CpuTier(1 << 22), LmdbTier(str(tmp_path), 1 << 24)],
                        chunk_size=CHUNK, codecs=[None, "cachegen"])       # exclusive CPU tier (the default)
    exact = fill(cache, tokens)
    cache.flush()
    cache.evict(64)
    cache.flush()
    for key in [cache.stack.namespace.id + r.key for r in cache.stack.refs(tokens)]:  # type: ignore[union-attr]
        cache.stack.tiers[0].delete(key)                                  # type: ignore[union-attr]
    req = cache.open(tokens + [1], load="wait")
    assert req.num_cached == len(tokens) and req.approximate
    got = cache.pool.kv[:, :, torch.from_numpy(req.page_ids.copy())]
    as_chunk = (LAYOUT.num_layers, 2, len(tokens), LAYOUT.num_kv_heads, LAYOUT.head_dim)
    err = (got.float() - exact.float()).abs().reshape(as_chunk)
    assert 0 < err.max() and bool((err <= bound(exact.reshape(as_chunk), get_codec("cachegen"))).all())
    req.release()
    stats = cache.stats()
    assert stats["requests_approximate"] == 1 and stats["stack"]["lossy_loaded"] == [0, 4]
    again = cache.open(tokens + [2])                                       # a pool hit on the same pages
    assert again.approximate and again.pool_tokens == len(tokens)
    again.release()
    assert cache.stats()["requests_approximate"] == 2
    cache.evict(64)                       # the exclusive CPU tier would take them: not as exact KV
    if evict_flush:
        cache.flush()
    assert cache.stats()["approximate_not_stored"] == 4
    assert cache.stack.tiers[0].contains_prefix(                           # type: ignore[union-attr]
        [cache.stack.namespace.id + cache.stack.refs(tokens)[0].key]) == 0  # type: ignore[union-attr]
    third = cache.open(tokens + [3], load="wait")           # straight after the eviction: from LMDB, lossy
    assert third.num_cached == len(tokens) and third.approximate
    third.release()
    fresh = list(range(1000, 1000 + 2 * CHUNK))
    fill(cache, fresh, seed=1)                                             # computed here: exact
    plain = cache.open(fresh + [1])
    assert not plain.approximate
    plain.release()
    assert cache.stats()["requests_approximate"] == 3
    cache.check()
    cache.close()


def test_a_cache_with_a_lossless_codec_serves_exact_kv(tmp_path: Any) -> None:
    tokens = list(range(3 * CHUNK))
    cache = PrefixCache(LAYOUT, num_pages=64, tiers=[LmdbTier(str(tmp_path), 1 << 24)], chunk_size=CHUNK,
                        codecs=["zstd"])
    exact = fill(cache, tokens)
    cache.flush()
    cache.evict(64)
    req = cache.open(tokens + [1], load="wait")
    assert req.num_cached == len(tokens) and not req.approximate
    assert torch.equal(cache.pool.kv[:, :, torch.from_numpy(req.page_ids.copy())], exact)
    req.release()
    assert cache.stats()["requests_approximate"] == 0
    cache.check()
    cache.close()



# -- the extension's one-pass decode -------------------------------------------------------------

@pytest.fixture(scope="module")
def cpp() -> None:
    """The C++ extension (``cuda_ext/dequantize.cpp``), built or found built once for this module."""
    import shutil

    from radixkv.core import ops

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH: only the numpy/torch decode can run here")
    assert ops.build() in ("cpp", "cuda+cpp")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(kv=kv_tensors(max_tokens=70), name=st.sampled_from(["int8", "cachegen", "cachegen:2", "cachegen:4"]))
def test_the_extensions_decode_equals_the_python_one_bit_for_bit(cpp: None, kv: torch.Tensor, name: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.core import codec as codec_module

    codec = get_codec(name)
    param, payload = codec.encode(kv)  # type: ignore[misc]
    assert codec_module._native() is not None
    native = codec.decode(memoryview(payload), param, kv.dtype, tuple(kv.shape), None)
    with monkeypatch.context() as m:
        m.setattr(codec_module, "_native", lambda: None)
        python = codec.decode(memoryview(payload), param, kv.dtype, tuple(kv.shape), None)
    assert torch.equal(native.view(torch.uint8), python.view(torch.uint8)) if kv.element_size() == 1 else \
        torch.equal(native.view({2: torch.int16, 4: torch.int32}[kv.element_size()]),
                    python.view({2: torch.int16, 4: torch.int32}[kv.element_size()]))


@pytest.mark.parametrize("layout", [
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16, page_size=4),            # GQA
    KVLayout(num_layers=2, num_kv_heads=1, head_dim=48, v_head_dim=32, dtype=torch.float16, page_size=4),  # MLA-like
    KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float16, page_size=4, windows=(0, 8, 0)),
], ids=["gqa-bf16", "packed-kv", "sliding"])
@pytest.mark.parametrize("name", ["zstd", "cachegen"])
def test_every_layout_round_trips_through_a_coded_tier(layout: KVLayout, name: str, tmp_path: Any) -> None:
    """Full attention with GQA, packed K/V of different sizes (MLA-style) and sliding-window groups
    (a stack per group): evicted, reloaded from the coded disk tier, exact for ``zstd`` and within
    the bound and counted for ``cachegen``."""
    tokens = list(range(4 * CHUNK))
    cache = PrefixCache(layout, num_pages=64, tiers=[LmdbTier(str(tmp_path), 1 << 25)], chunk_size=CHUNK,
                        codecs=[name])
    pools = [cache.pool] if cache.groups is None else [cache.groups.pool_of(g) if g.sliding else cache.pool
                                                       for g in layout.groups]
    pages = cache.alloc(len(tokens) // layout.page_size).numpy()
    gen = torch.Generator().manual_seed(3)
    for pool in pools:
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(pool.kv.dtype))
    exact = cache.pool.kv[:, :, torch.from_numpy(pages.copy())].clone()
    cache.insert(tokens, pages)
    cache.flush()
    cache.evict(64)
    cache.flush()
    req = cache.open(tokens + [1], load="wait")
    assert req.num_cached == len(tokens), (name, req.num_cached)
    assert req.approximate == get_codec(name).lossy
    got = cache.pool.kv[:, :, torch.from_numpy(req.page_ids.copy())]
    if not get_codec(name).lossy:
        assert torch.equal(got, exact)
    else:
        shape = (got.shape[0], got.shape[1], len(tokens), got.shape[4], got.shape[5])
        assert bool(((got.float() - exact.float()).abs().reshape(shape)
                     <= bound(exact.reshape(shape), get_codec(name))).all())
    req.release()
    assert all(st.stats()["lossy_loaded"][0] == (4 if get_codec(name).lossy else 0) for st in cache.stacks[:1])
    cache.check()
    cache.close()
