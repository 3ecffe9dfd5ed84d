"""vLLM's block hashes, computed by radixkv.fleet.hashing, equal vLLM's own ``hash_block_tokens``
chain for every hash algorithm, with and without extra keys, and in the 64-bit form KV events carry."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, strategies as st

from radixkv.fleet.hashing import ALGOS, DEFAULT_SEED, external_hash, none_hash, vllm_block_hashes

SEED = "12345"


@pytest.fixture(scope="module")
def vllm_hash(monkeypatch_module: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """vLLM's hash_block_tokens with NONE_HASH for ``algo`` under PYTHONHASHSEED=SEED."""
    kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import get_hash_fn_by_name
    monkeypatch_module.setenv("PYTHONHASHSEED", SEED)

    def chain(algo: str, tokens: list[int], block_size: int, extra: list | None) -> list[bytes]:
        fn = get_hash_fn_by_name(algo)
        kcu.init_none_hash(fn)
        out, parent = [], None
        for i in range(len(tokens) // block_size):
            parent = kcu.hash_block_tokens(fn, parent, tokens[i * block_size:(i + 1) * block_size],
                                           None if extra is None else extra[i])
            out.append(parent)
        return out

    def external(h: bytes) -> int:
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
        return kcu.maybe_convert_block_hash(h)
    chain.external = external  # type: ignore[attr-defined]
    return chain


@pytest.fixture(scope="module")
def monkeypatch_module():  # type: ignore[no-untyped-def]
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=80)
extra_st = st.one_of(st.none(), st.tuples(st.just("cache_salt"), st.text(max_size=4)),
                     st.tuples(st.just("lora"), st.text(max_size=4), st.text(max_size=4)))


@given(tokens=tokens_st, block_size=st.sampled_from([1, 4, 16]), algo=st.sampled_from(ALGOS),
       data=st.data())
def test_equal_to_vllm(vllm_hash, tokens: list[int], block_size: int, algo: str, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    n = len(tokens) // block_size
    extra = data.draw(st.one_of(st.none(), st.lists(extra_st, min_size=n, max_size=n)))
    extra_keys = None if extra is None else [e if e is None else (e,) for e in extra]
    theirs = vllm_hash(algo, tokens, block_size, extra_keys)
    ours = vllm_block_hashes(tokens, block_size, extra_keys=extra_keys, algo=algo, seed=SEED)  # type: ignore[arg-type]
    assert ours == theirs
    assert vllm_block_hashes(tokens, block_size, extra_keys=extra_keys, algo=algo, seed=SEED,  # type: ignore[arg-type]
                             as_int=True) == [vllm_hash.external(h) for h in theirs]
    if n >= 2:      # chaining from a parent continues the same chain
        assert vllm_block_hashes(tokens[block_size:], block_size, parent=ours[0],
                                 extra_keys=None if extra_keys is None else extra_keys[1:],
                                 algo=algo) == ours[1:]  # type: ignore[arg-type]


def test_default_seed_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash() == none_hash(seed=DEFAULT_SEED)
    with pytest.raises(ValueError, match="seed"):
        none_hash("xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert none_hash("xxhash") == none_hash("xxhash", seed="7")
    assert vllm_block_hashes(list(range(32)), 16) == vllm_block_hashes(list(range(32)), 16, seed="7")


def test_partial_block_has_no_hash() -> None:
    assert vllm_block_hashes(list(range(15)), 16) == []
    assert len(vllm_block_hashes(list(range(33)), 16)) == 2


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="block_size"):
        vllm_block_hashes([1], 0)
    with pytest.raises(TypeError, match="block_size"):
        vllm_block_hashes([1], 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tokens"):
        vllm_block_hashes([1.5], 1)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="tokens"):
        vllm_block_hashes([True], 1)
    with pytest.raises(TypeError, match="parent"):
        vllm_block_hashes([1], 1, parent=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extra_keys"):
        vllm_block_hashes([1, 2], 1, extra_keys=[None])
    with pytest.raises(ValueError, match="algo"):
        vllm_block_hashes([1], 1, algo="md5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="block_hash"):
        external_hash(5)  # type: ignore[arg-type]


@given(n=st.integers(0, 5), salt=st.one_of(st.none(), st.text(max_size=4)),
       lora=st.one_of(st.none(), st.tuples(st.text(min_size=1, max_size=4), st.text(min_size=1, max_size=6))))
def test_request_extra_keys_are_vllms(n: int, salt: str | None, lora: tuple[str, str] | None) -> None:
    """The extra keys of a text request equal vLLM's ``generate_block_hash_extra_keys`` block by
    block (a LoRA request's adapter in every block, the salt in block 0)."""
    from types import SimpleNamespace

    kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from radixkv.fleet.hashing import request_extra_keys

    req = SimpleNamespace(mm_features=[], prompt_embeds=None, cache_salt=salt,
                          lora_request=None if lora is None else SimpleNamespace(lora_name=lora[0], lora_path=lora[1]))
    theirs = [kcu.generate_block_hash_extra_keys(req, i * 16, (i + 1) * 16, 0)[0] for i in range(n)]
    ours = request_extra_keys(n, salt, lora)
    assert (ours or [None] * n) == theirs
