"""A real model served through the cache: logits with reused KV equal a full prefill's.

Every hit level is checked the same way: the suffix logits of ``PrefixCachedLM.prefill`` against
those of one plain forward over the whole prompt (fp32, max abs difference <= 1e-4), for KV from
the pool, the CPU tier, LMDB (reopened), S3 (moto's server on loopback), for prefixes ending
mid-chunk and mid-page, and for requests that share a prefix and then diverge.  Tiny random models
(two layers, hidden 64), page size 4 and chunk size 8, so that every edge is a few tokens away.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from radixkv import KVLayout, Namespace, PrefixCache  # noqa: E402
from radixkv.backends import MemoryTier  # noqa: E402
from hf_cases import TOL, assert_tolerance_catches_wrong_kv, full_logits, prefill_exact, rel_diff  # noqa: E402
from radixkv.integrations.transformers import (  # noqa: E402
    PrefixCachedLM,
    Result,
    layout_for,
    namespace_for,
    random_model,
)

PAGE, CHUNK = 4, 8
VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gpt_neox"])
def model(request: pytest.FixtureRequest) -> Any:
    kv_heads = None if request.param == "gpt_neox" else 2
    return random_model(request.param, seed=0, num_kv_heads=kv_heads, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def llama() -> Any:
    return random_model("llama", seed=0, num_kv_heads=2, vocab_size=VOCAB)


def make_cache(model: Any, tiers: Any = (), num_pages: int = 256, namespace: Namespace | None = None) -> PrefixCache:
    return PrefixCache(layout_for(model, page_size=PAGE), num_pages=num_pages, chunk_size=CHUNK,
                       namespace=namespace or namespace_for(model), tiers=tiers)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def evict_all(cache: PrefixCache) -> None:
    """Empty the pool, so that the next match has to load from the tiers (queued writes done first,
    and then the writes of what the pool let go: an exclusive CPU tier gets its chunks then)."""
    assert cache.stack is not None
    assert cache.flush(30)
    cache.evict(cache.pool.num_pages)
    assert cache.flush(30)
    assert cache.stats()["cached_tokens"] == 0


# -- level 0: the pool ---------------------------------------------------------------------------

def test_a_pool_hit_gives_the_logits_of_a_full_prefill(model: Any) -> None:
    lm = PrefixCachedLM(model, make_cache(model))
    prompt = tokens(30, seed=1)
    cold = prefill_exact(lm, prompt)
    assert (cold.match_tokens, cold.levels, cold.inserted_tokens) == (0, {}, 28)
    warm = prefill_exact(lm, np.concatenate([prompt, tokens(9, seed=2)]))
    assert (warm.match_tokens, warm.tier_tokens, warm.levels) == (28, 0, {"pool": 28})
    again = prefill_exact(lm, prompt)          # the whole prompt is cached: only its last token runs
    assert again.match_tokens == 28 and again.logits.shape[0] == 2


def test_two_requests_share_a_prefix_then_diverge_mid_page_and_mid_chunk(model: Any) -> None:
    lm = PrefixCachedLM(model, make_cache(model))
    shared = tokens(22, seed=3)                 # 5 full pages + 2 tokens; 22 is mid-chunk too
    a = np.concatenate([shared, tokens(11, seed=4)])
    b = np.concatenate([shared, tokens(7, seed=5)])
    assert prefill_exact(lm, a).match_tokens == 0
    rb = prefill_exact(lm, b)
    assert rb.match_tokens == 20 and 20 % CHUNK                  # ends mid-chunk, before the divergence
    assert prefill_exact(lm, a).match_tokens == 32                # both branches stay intact
    assert prefill_exact(lm, b).match_tokens == 28
    for ids in (a, b):
        assert lm.prefill(ids).next_token == int(full_logits(model, ids)[-1].argmax())


def test_the_tolerance_tells_right_kv_from_wrong(model: Any) -> None:
    """The exactness check is not vacuous: KV of another prefix of the same length, the prefix's
    KV shifted by a page, or one layer zeroed, each is over 100x ``TOL`` off."""
    assert_tolerance_catches_wrong_kv(PrefixCachedLM(model, make_cache(model)), tokens(24, seed=6), 16, page=PAGE)


def test_qwen2_is_served_exactly_too() -> None:
    model = random_model("qwen2", seed=1, num_kv_heads=2, vocab_size=VOCAB)
    lm = PrefixCachedLM(model, make_cache(model))
    prompt = tokens(26, seed=8)
    prefill_exact(lm, prompt)
    assert prefill_exact(lm, np.concatenate([prompt, tokens(5, seed=9)])).match_tokens == 24


# -- the tiers ----------------------------------------------------------------------------------

def test_a_cpu_tier_hit_gives_the_logits_of_a_full_prefill(model: Any) -> None:
    from radixkv.backends import CpuTier

    with make_cache(model, tiers=[CpuTier(max_bytes=1 << 20)]) as cache:
        lm = PrefixCachedLM(model, cache)
        prompt = tokens(41, seed=10)                     # 10 full pages: 5 chunks written through
        prefill_exact(lm, prompt)
        evict_all(cache)
        hit = prefill_exact(lm, np.concatenate([prompt, tokens(6, seed=11)]))
        assert (hit.match_tokens, hit.tier_tokens, hit.levels) == (40, 40, {"cpu": 40})


def test_a_tier_load_after_a_pool_match_that_ends_mid_chunk(model: Any) -> None:
    """The pool holds one page of chunk 0; the tier load scatters only the pages past it."""
    from radixkv.backends import CpuTier

    with make_cache(model, tiers=[CpuTier(max_bytes=1 << 20)]) as cache:
        lm = PrefixCachedLM(model, cache)
        prompt = tokens(41, seed=12)
        prefill_exact(lm, prompt)
        evict_all(cache)
        prefill_exact(lm, np.concatenate([prompt[:6], tokens(1, seed=13)]))   # the pool: prompt[:4]
        hit = prefill_exact(lm, np.concatenate([prompt, tokens(3, seed=14)]))
        assert (hit.match_tokens, hit.tier_tokens, hit.levels) == (40, 36, {"pool": 4, "cpu": 36})


def test_an_lmdb_hit_after_reopening_gives_the_logits_of_a_full_prefill(model: Any, tmp_path: Any) -> None:
    pytest.importorskip("lmdb")
    from radixkv.backends import LmdbTier

    prompt = tokens(41, seed=15)
    with make_cache(model, tiers=[LmdbTier(tmp_path / "kv", max_bytes=1 << 22)]) as cache:
        prefill_exact(PrefixCachedLM(model, cache), prompt)          # closing flushes the writes
    with make_cache(model, tiers=[LmdbTier(tmp_path / "kv", max_bytes=1 << 22)]) as cache:
        hit = prefill_exact(PrefixCachedLM(model, cache), np.concatenate([prompt, tokens(5, seed=16)]))
        assert hit.levels == {"lmdb": 40}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[tuple[str, str]]:
    """(endpoint URL, bucket) of moto's S3 server on loopback, shared by this module's S3 tests."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    from radixkv.tools.s3server import CREDENTIALS, MotoServer

    bucket = "radixkv-hf-test"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        with MotoServer() as server:
            server.client().create_bucket(Bucket=bucket)
            yield server.endpoint_url, bucket


def test_an_s3_hit_gives_the_logits_of_a_full_prefill(llama: Any, s3_endpoint: tuple[str, str]) -> None:
    from radixkv.backends.s3 import S3Tier

    endpoint, bucket = s3_endpoint
    prefix = f"hf/{uuid.uuid4().hex[:12]}"
    prompt = tokens(41, seed=17)
    with make_cache(llama, tiers=[S3Tier(bucket, prefix, endpoint_url=endpoint)]) as cache:
        prefill_exact(PrefixCachedLM(llama, cache), prompt)
    with make_cache(llama, tiers=[S3Tier(bucket, prefix, endpoint_url=endpoint)]) as cache:
        hit = prefill_exact(PrefixCachedLM(llama, cache), np.concatenate([prompt, tokens(5, seed=18)]))
        assert hit.levels == {"s3": 40}


@pytest.mark.parametrize("other", [dict(revision="v2"), dict(salt=b"tenant-b")])
def test_another_revision_or_salt_gets_no_hit(llama: Any, other: dict[str, Any]) -> None:
    shared = MemoryTier()                                     # one store, three namespaces on it
    prompt = tokens(41, seed=19)
    with make_cache(llama, tiers=[shared]) as cache:
        prefill_exact(PrefixCachedLM(llama, cache), prompt)
    with make_cache(llama, tiers=[shared], namespace=namespace_for(llama, **other)) as cache:
        assert prefill_exact(PrefixCachedLM(llama, cache), prompt).match_tokens == 0
    with make_cache(llama, tiers=[shared]) as cache:          # the first namespace still hits
        assert prefill_exact(PrefixCachedLM(llama, cache), prompt).levels == {"memory": 40}


# -- generation ---------------------------------------------------------------------------------

def greedy_without_cache(model: Any, ids: np.ndarray, n: int) -> list[int]:
    """Greedy tokens from full forwards over the growing sequence: no KV reuse of any kind."""
    seq, out = list(ids), []
    for _ in range(n):
        out.append(int(full_logits(model, np.array(seq))[-1].argmax()))
        seq.append(out[-1])
    return out


def test_greedy_generation_gives_the_same_tokens_with_and_without_the_cache(model: Any) -> None:
    lm = PrefixCachedLM(model, make_cache(model))
    prompt = tokens(19, seed=20)
    expected = greedy_without_cache(model, prompt, 9)
    assert lm.generate(prompt, 9) == expected                  # cold
    assert lm.generate(prompt, 9) == expected                  # prompt and answer cached
    # The next turn reuses the KV of the generated tokens too (all but the last were cached).
    turn = np.concatenate([prompt, expected, tokens(6, seed=21)])
    assert prefill_exact(lm, turn).match_tokens == (len(prompt) + 8) // PAGE * PAGE
    assert lm.generate(prompt, 0) == []


def test_generate_holds_its_pages_while_decoding_and_caches_each_filled_page(llama: Any) -> None:
    """An eviction in the middle of every forward (a hook) frees nothing the request holds."""
    lm = PrefixCachedLM(llama, make_cache(llama))
    prompt = tokens(19, seed=25)
    locked: list[int] = []

    def evict_everything(*_: Any) -> None:
        lm.cache.evict(lm.cache.pool.num_pages)
        locked.append(lm.cache.stats()["locked_tokens"])
    handle = llama.model.layers[0].register_forward_hook(evict_everything)
    try:
        out = lm.generate(prompt, 9)
    finally:
        handle.remove()
    assert out == greedy_without_cache(llama, prompt, 9)
    assert locked == [0, 16, 20, 20, 20, 20, 24, 24, 24]      # the prompt's pages, then each filled one
    stats = lm.cache.stats()
    assert (stats["locked_tokens"], stats["live_matches"], stats["cached_tokens"]) == (0, 0, 24)
    assert prefill_exact(lm, np.concatenate([prompt, out, tokens(3, seed=26)])).match_tokens == 24


# -- limits and errors --------------------------------------------------------------------------

def test_a_full_pool_still_answers_exactly_and_caches_nothing(llama: Any) -> None:
    lm = PrefixCachedLM(llama, make_cache(llama, num_pages=3))
    result = prefill_exact(lm, tokens(30, seed=22))
    assert result.inserted_tokens == 0 and lm.cache.stats()["cached_tokens"] == 0


def test_bad_inputs_are_refused(llama: Any) -> None:
    import transformers

    lm = PrefixCachedLM(llama, make_cache(llama))
    with pytest.raises(ValueError, match="must not be empty"):
        lm.prefill([])
    with pytest.raises(TypeError, match="integer token ids"):
        lm.prefill([1.5, 2.0])
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate([1, 2], -1)
    other = random_model("llama", seed=0, num_layers=3)
    with pytest.raises(ValueError, match="3 x 1 x 16"):
        PrefixCachedLM(other, make_cache(llama))
    with pytest.raises(ValueError, match="family"):
        random_model("bert")
    with pytest.raises(ValueError, match="multi-head"):
        random_model("gpt_neox", num_kv_heads=1)
    config = transformers.MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    mistral = transformers.AutoModelForCausalLM.from_config(config).eval()
    flat = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32, page_size=PAGE)
    with pytest.raises(ValueError, match="windows"):      # a sliding model needs its windows in the layout
        PrefixCachedLM(mistral, PrefixCache(flat, num_pages=8))
    PrefixCachedLM(mistral, PrefixCache(layout_for(mistral, page_size=PAGE), num_pages=8))


def test_random_models_are_reproducible_and_named_apart() -> None:
    state = torch.random.get_rng_state()
    a, b = random_model("llama", seed=3), random_model("llama", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)             # the caller's RNG is untouched
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = random_model("llama", seed=4)
    assert namespace_for(a) == namespace_for(b) != namespace_for(c)


# -- the TTFT benchmark, end to end at toy sizes (its timings are printed, never asserted) ---------

@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
def test_the_ttft_benchmark_runs_and_checks_logits_at_every_level(tmp_path: Any) -> None:
    pytest.importorskip("tqdm")
    pytest.importorskip("lmdb")
    from radixkv.bench.ttft import main

    out = tmp_path / "ttft.txt"
    assert main(["--prefixes", "32,64", "--question", "16", "--repeat", "1", "--layers", "1", "--hidden", "64",
                 "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", str(VOCAB),
                 "--page-size", "4", "--chunk-size", "16", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# python -m radixkv.bench ttft --prefixes 32,64")
    for level in ("no cache", "compute-only", "pool", "cpu tier", "lmdb (restart)"):
        assert f"   64 {level}" in text
    assert "PASS  P=32: last-token logits" in text and "PASS  P=64: last-token logits" in text


# -- namespace safety -----------------------------------------------------------------------------

def bare_llama(seed: int) -> Any:
    """A Llama built from a bare config, as a user would without ``random_model``: no name_or_path."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config).train(False)


def test_a_model_without_a_name_needs_a_name_or_a_fingerprint() -> None:
    import copy

    a, b = bare_llama(0), bare_llama(1)
    assert a.config.name_or_path == ""
    with pytest.raises(ValueError, match="name=... or fingerprint=True"):
        namespace_for(a)
    with pytest.raises(ValueError, match="name"):
        namespace_for(a, name="")
    with pytest.raises(TypeError, match="fingerprint"):
        namespace_for(a, fingerprint=1)  # type: ignore[arg-type]
    assert namespace_for(a, name="mine").model == "mine"
    fa, fb = namespace_for(a, fingerprint=True), namespace_for(b, fingerprint=True)
    assert fa != fb and fa.model.startswith("llama@weights:")
    assert namespace_for(copy.deepcopy(a), fingerprint=True) == fa            # a pure function of the weights
    named = random_model("llama", seed=0)
    assert namespace_for(named, fingerprint=True).model.startswith(named.config.name_or_path + "@weights:")
    changed = copy.deepcopy(named)                                             # same name, weights changed
    with torch.no_grad():
        changed.lm_head.weight[0, 0] += 1
    assert namespace_for(changed) == namespace_for(named)
    assert namespace_for(changed, fingerprint=True) != namespace_for(named, fingerprint=True)


@pytest.mark.parametrize("naming", ["fingerprint", "random_model names"])
def test_two_models_on_one_lmdb_tier_never_serve_each_others_kv(tmp_path: Any, naming: str) -> None:
    pytest.importorskip("lmdb")
    from radixkv.backends import LmdbTier

    if naming == "fingerprint":
        models = [bare_llama(0), bare_llama(1)]
        spaces = [namespace_for(m, fingerprint=True) for m in models]
    else:
        models = [random_model("llama", seed=s, num_kv_heads=2, vocab_size=VOCAB) for s in (0, 1)]
        spaces = [namespace_for(m) for m in models]
    prompt = tokens(41, seed=23)

    def serve(i: int, ns: Namespace) -> Result:
        with make_cache(models[i], tiers=[LmdbTier(tmp_path / "kv", max_bytes=1 << 22)], namespace=ns) as cache:
            return prefill_exact(PrefixCachedLM(models[i], cache), prompt)   # its own full recompute

    assert serve(0, spaces[0]).match_tokens == 0
    assert serve(1, spaces[1]).match_tokens == 0          # the same tokens, the other model: a miss
    assert serve(0, spaces[0]).levels == {"lmdb": 40}      # each still finds its own
    assert serve(1, spaces[1]).levels == {"lmdb": 40}


def test_one_namespace_for_two_models_would_serve_wrong_kv(tmp_path: Any) -> None:
    """Why the namespace matters: given the same name, the second model gets the first's KV, far off."""
    pytest.importorskip("lmdb")
    from radixkv.backends import LmdbTier

    a, b = bare_llama(0), bare_llama(1)
    ns = namespace_for(a, name="same")
    prompt = tokens(41, seed=24)
    with make_cache(a, tiers=[LmdbTier(tmp_path / "kv", max_bytes=1 << 22)], namespace=ns) as cache:
        PrefixCachedLM(a, cache).prefill(prompt)
    with make_cache(b, tiers=[LmdbTier(tmp_path / "kv", max_bytes=1 << 22)], namespace=ns) as cache:
        result = PrefixCachedLM(b, cache).prefill(prompt)
    assert result.levels == {"lmdb": 40}
    assert rel_diff(result.logits[-1], full_logits(b, prompt)[-1]) > 100 * TOL
