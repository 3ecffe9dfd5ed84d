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
from radixkv.hashing import as_token_bytes

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
