"""Chained chunk keys: golden vectors, determinism across processes, input validation."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import radixkv as rk
from radixkv.core import _ext, hashing
from radixkv.core.hashing import as_token_bytes

NS = rk.Namespace(model="golden/model", revision="r1")

# Pinned: changing the key format must be a deliberate act that updates these vectors.
GOLDEN_ROOT = "24e56192ac315fbf553be9b4701936c2"
GOLDEN_KEYS = ["d042f410f3b0ae170f4877740d0808f7", "b7deddda0fe21f0f80781c1ab047f312"]
GOLDEN_BOUND_ROOT = "f2a79f5bc5fdf97218c3a413df47538f"
GOLDEN_SALTED_ROOT = "99825d0ddf4572011eacb18ef837edd9"


def test_golden_vectors():
    assert NS.root.hex() == GOLDEN_ROOT
    assert NS.id == NS.root[:8]
    assert [k.hex() for k in rk.chunk_keys(list(range(10)), 4, NS)] == GOLDEN_KEYS
    layout = rk.KVLayout(2, 4, 8, torch.float16, 16)
    assert NS.bind(layout).root.hex() == GOLDEN_BOUND_ROOT
    assert rk.Namespace(model="golden/model", revision="r1", salt=b"tenant-a").root.hex() == GOLDEN_SALTED_ROOT


def test_chain_definition():
    tokens = np.arange(12, dtype=np.int32)
    k0 = xxhash.xxh3_128_digest(NS.root + tokens[:4].tobytes())
    k1 = xxhash.xxh3_128_digest(k0 + tokens[4:8].tobytes())
    k2 = xxhash.xxh3_128_digest(k1 + tokens[8:12].tobytes())
    assert rk.chunk_keys(tokens, 4, NS) == [k0, k1, k2]


@given(st.lists(st.integers(0, 2**31 - 1), max_size=40), st.integers(1, 8))
def test_every_input_form_gives_the_same_keys(tokens, chunk):
    keys = rk.chunk_keys(tokens, chunk, NS)
    assert len(keys) == len(tokens) // chunk
    for form in (tuple(tokens), np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.uint32),
                 torch.tensor(tokens, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int32)):
        assert rk.chunk_keys(form, chunk, NS) == keys
    # a key names its chunk and everything before it
    assert rk.chunk_keys(tokens[: len(keys) * chunk] + [0] * (chunk - 1), chunk, NS) == keys


def test_namespaces_separate_keys():
    tokens = list(range(64))
    roots = {rk.chunk_keys(tokens, 16, ns)[0] for ns in (
        NS, rk.Namespace(model="golden/model", revision="r2"), rk.Namespace(model="other"),
        rk.Namespace(model="golden/model", revision="r1", salt=b"t"),
        rk.Namespace(model="golden/model", revision="r1", lora_id="a"),
        rk.Namespace(model="golden/model", revision="r1", tp_rank=1, tp_size=2))}
    assert len(roots) == 6


@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
def test_deterministic_across_processes_and_hash_seeds():
    code = ("import radixkv as rk; ns = rk.Namespace(model='golden/model', revision='r1'); "
            "print(','.join(k.hex() for k in rk.chunk_keys(list(range(10)), 4, ns)))")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {",".join(GOLDEN_KEYS)}


@pytest.mark.parametrize("tokens, error", [
    ([1.0, 2.0], TypeError),
    ([1, 2.5], TypeError),
    ([True, False], TypeError),
    ([1, True], TypeError),
    (np.array([1.0]), TypeError),
    (np.array([True]), TypeError),
    (torch.tensor([1.0]), TypeError),
    (torch.tensor([True]), TypeError),
    ("abc", TypeError),
    ([-1, 2], ValueError),
    ([2**31], ValueError),
    ([2**70], ValueError),
    (np.array([[1, 2]]), ValueError),
    (np.array([-5], dtype=np.int64), ValueError),
])
def test_bad_tokens_are_rejected_naming_the_argument(tokens, error):
    with pytest.raises(error, match="tokens"):
        rk.chunk_keys(tokens, 4, NS)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.0, True])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        rk.chunk_keys([1, 2, 3, 4], chunk_size, NS)


def test_namespace_validation():
    with pytest.raises(ValueError, match="model"):
        rk.Namespace(model="")
    with pytest.raises(TypeError, match="salt"):
        rk.Namespace(model="m", salt="text")
    with pytest.raises(ValueError, match="tp_rank"):
        rk.Namespace(model="m", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="num_layers"):
        rk.Namespace(model="m", num_layers=3).bind(rk.KVLayout(2, 1, 1))


def test_token_bytes_are_little_endian_int32():
    assert as_token_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


# ------------------------------------------------------------------ the native list conversion

def _python_path(tokens):
    """``as_token_bytes`` without the extension's converter: the bytes, or the exception's type."""
    saved = hashing.native_tokens
    hashing.native_tokens = lambda: None
    try:
        return as_token_bytes(tokens)
    except (TypeError, ValueError) as exc:
        return type(exc)
    finally:
        hashing.native_tokens = saved


def _either(tokens):
    try:
        return as_token_bytes(tokens)
    except (TypeError, ValueError) as exc:
        return type(exc)


def test_the_native_converter_is_loaded_where_the_extension_is_built():
    # `make test` builds the extension first; an explicit RADIXKV_EXT=off turns the converter off.
    if os.environ.get("RADIXKV_EXT", "auto").lower() == "off":
        assert _ext.native_tokens() is None
        return
    try:
        _ext.load()
    except _ext.BuildMissing:
        pytest.skip("the extension is not built here (python -m radixkv build-ext)")
    assert _ext.native_tokens() is not None, "the built extension should provide token_bytes"


_EDGE_IDS = st.sampled_from([0, 1, 2, 2**15, 2**30 - 1, 2**30, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, -1, -(2**30),
                             -(2**31), -(2**64)])
_ELEMENTS = st.one_of(st.integers(0, 2**31 - 1), st.integers(-(2**70), 2**70), _EDGE_IDS, st.booleans(),
                      st.floats(allow_nan=False, width=32), st.builds(np.int64, st.integers(0, 2**31 - 1)),
                      st.builds(np.int32, st.integers(0, 2**31 - 1)))


@given(st.lists(st.one_of(st.integers(0, 2**31 - 1), _EDGE_IDS), max_size=64) | st.lists(_ELEMENTS, max_size=12),
       st.booleans())
def test_native_conversion_agrees_with_the_python_path(tokens, as_tuple):
    native = _ext.native_tokens()
    if native is None:
        pytest.skip("the extension is not built here")
    seq = tuple(tokens) if as_tuple else tokens
    out = native(seq)
    exact = all(type(t) is int and 0 <= t < 2**31 for t in tokens)
    if exact:
        assert out == np.array(tokens, dtype="<i4").tobytes()
    else:
        assert out is None          # anything unusual goes to the exact checks of the Python path
    assert _either(seq) == _python_path(seq)


def test_native_conversion_refuses_other_containers_and_subclasses():
    native = _ext.native_tokens()
    if native is None:
        pytest.skip("the extension is not built here")

    class Ids(list):
        pass

    for other in (np.array([1, 2]), torch.tensor([1, 2]), range(3), Ids([1, 2]), "ab", b"ab", 7):
        assert native(other) is None
    assert as_token_bytes(Ids([1, 2])) == as_token_bytes([1, 2])
    assert native([]) == b"" and as_token_bytes([]) == b""
