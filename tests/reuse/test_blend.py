"""CacheBlend: segments keyed by their tokens in every tier, exact positional recovery, selective
recomputation between naive reuse (ratio 0) and a full prefill (ratio 1), and the engine's
opt-in, approximate-marked blending (``radixkv.reuse.segments``, ``radixkv.reuse.blend``, ``radixkv.integrations.paged``)."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Iterator

import pytest
import torch
from hypothesis import given, settings, strategies as st

import radixkv as rk
from radixkv.backends import CpuTier, MemoryTier
from radixkv.backends.lmdb import LmdbTier
from radixkv.reuse.blend import Blend, kv_deviation, layer_ratios, recover_positions, select_tokens
from radixkv.core.format import encode_chunk, encoded_size
from radixkv.core.hashing import Namespace, as_token_bytes, chunk_keys
from radixkv.integrations.paged import PagedEngine
from radixkv.integrations.paged_blend import blend_prefill, segment_kv
from radixkv.integrations.paged_model import Chunk, PagedLlama
from radixkv.integrations.transformers import layout_for, namespace_for, random_model
from radixkv.core.pool import KVLayout
from radixkv.reuse.segments import SegmentCache, check_spans, segment_refs
from radixkv.core.stack import TierStack

from hf_cases import TOL, rel_diff

pytestmark = pytest.mark.usefixtures("one_thread")

SECRET = "a-deployment-secret-for-segments"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=2)
CHUNK = 4
MODELS: dict[str, Any] = {}


def model_of(family: str = "llama", layers: int = 2) -> Any:
    key = f"{family}-{layers}"
    if key not in MODELS:
        MODELS[key] = random_model(family, seed=3, num_layers=layers, hidden_size=32, num_heads=4, num_kv_heads=2,
                                   initializer_range=0.2)
    return MODELS[key]


def tokens_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


# -- segments: keys, tiers, seals ----------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40), st.integers(1, 8))
def test_segment_keys_are_their_own_domain(tokens: list[int], chunk: int) -> None:
    ns = Namespace(model="m")
    refs = segment_refs(as_token_bytes(tokens), chunk, ns.root)
    prefix = set(chunk_keys(tokens, chunk, ns))
    assert not prefix & {r.key for r in refs}, "a segment key is a prefix chunk key"
    assert b"".join(r.tokens for r in refs) == as_token_bytes(tokens)
    assert all(0 < len(r.tokens) <= 4 * chunk for r in refs)
    other = segment_refs(as_token_bytes(tokens), chunk, Namespace(model="m", salt=b"t").root)
    assert not {r.key for r in refs} & {r.key for r in other}, "two namespaces share a segment key"


def stack_of(tier: Any, **kw: Any) -> TierStack:
    return TierStack([tier], namespace=Namespace(model="m").bind(LAYOUT), layout=LAYOUT, chunk_size=CHUNK, **kw)


def segment_data(n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tokens_of(n, seed), torch.randn(LAYOUT.chunk_shape(n), generator=g)


def test_a_segment_is_not_a_prefix_and_a_prefix_is_not_a_segment() -> None:
    with stack_of(MemoryTier()) as stack:
        segments = SegmentCache(stack)
        doc, kv = segment_data(8, 0)
        segments.store(doc, kv)
        stack.flush()
        assert stack.lookup([r.key for r in stack.refs(doc)]) == [], "a segment served as a prefix"
        stack.store([(ref, torch.zeros(LAYOUT.chunk_shape(CHUNK))) for ref in stack.refs(doc[::-1])])
        stack.flush()
        assert segments.find(doc[::-1], [(0, 8)]) == [False], "a prefix served as a segment"
        segments.check()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str | None]:
    try:
        from radixkv.tools.s3server import moto_with_bucket
    except ImportError:
        yield None
        return
    with moto_with_bucket("radixkv-segments") as server:
        yield server.endpoint_url


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str | None]:
    from radixkv.tools.redisserver import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise RuntimeError("redis-server is not installed, and CI must run the Redis tests")
        yield None
        return
    with RedisServer() as server:
        yield server.url


def make_tier(kind: str, tmp_path: Any, s3: str | None, redis: str | None, ttl_clock: list[float] | None = None) -> Any:
    if kind == "cpu":
        return CpuTier(1 << 20, slot_bytes=encoded_size(LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype))
    if kind == "lmdb":
        extra = {} if ttl_clock is None else {"ttl": 10.0, "clock": lambda: ttl_clock[0]}
        return LmdbTier(tmp_path / "lmdb", 4 << 20, **extra)
    if kind == "s3":
        if s3 is None:
            pytest.skip("boto3/moto are not installed")
        from radixkv.backends.s3 import S3Tier

        return S3Tier("radixkv-segments", f"t/{uuid.uuid4().hex[:10]}", endpoint_url=s3)
    if redis is None:
        pytest.skip("redis-server is not installed")
    from radixkv.backends.redis import RedisTier

    return RedisTier(redis, prefix=f"t{uuid.uuid4().hex[:10]}")


@pytest.mark.parametrize("kind", ["cpu", "lmdb", "s3", "redis"])
def test_segments_through_every_tier_sealed_and_never_forged(kind: str, tmp_path: Any, s3_endpoint: str | None,
                                                             redis_url: str | None) -> None:
    tier = make_tier(kind, tmp_path, s3_endpoint, redis_url)
    doc, kv = segment_data(11, 1)                       # two full pieces and a tail of 3
    prompt = tokens_of(5, 9) + doc + tokens_of(3, 8)
    with stack_of(tier, secret=SECRET, timeout_s=30.0) as stack:   # generous: a loaded machine, a remote tier
        segments = SegmentCache(stack)
        assert segments.find(prompt, [(5, 16)]) == [False] and segments.load(doc) is None
        assert segments.store(doc, kv) == 3
        stack.flush()
        assert segments.find(prompt, [(5, 16)]) == [True]
        assert torch.equal(segments.load(doc), kv), "the segment came back other than stored"
        # A writer without the secret forges the first piece: never served, counted, deleted.
        first = segment_refs(as_token_bytes(doc), CHUNK, stack.namespace.root)[0]
        name = stack.namespace.id + first.key
        tier.delete(name)
        tier.put(name, encode_chunk(stack.namespace.id, first.key, first.parent, first.tokens,
                                    torch.full(LAYOUT.chunk_shape(CHUNK), 7.0)))       # unkeyed: no secret
        assert segments.load(doc) is None, "a forged segment piece was served"
        assert stack.stats()["forged"] == [1]
        stack.flush()
        segments.store(doc, kv)
        stack.flush()
        assert torch.equal(segments.load(doc), kv)
        segments.check()
    if kind in ("cpu", "lmdb"):
        tier.close()


@pytest.mark.parametrize("kind", ["cpu", "lmdb"])
def test_a_corrupt_segment_piece_is_a_miss_and_is_deleted(kind: str, tmp_path: Any) -> None:
    tier = make_tier(kind, tmp_path, None, None)
    doc, kv = segment_data(6, 2)
    with stack_of(tier) as stack:
        segments = SegmentCache(stack)
        segments.store(doc, kv)
        stack.flush()
        tail = segment_refs(as_token_bytes(doc), CHUNK, stack.namespace.root)[-1]
        name = stack.namespace.id + tail.key
        blob = bytearray(tier.get(name))
        blob[-1] ^= 0xFF
        tier.delete(name)
        tier.put(name, bytes(blob))
        assert segments.load(doc) is None, "a corrupt segment piece was served"
        assert stack.stats()["corrupt"] == [1] and tier.get(name) is None
        assert segments.stats()["load_misses"] == 1
    tier.close()


def test_segments_expire_with_the_tier_ttl(tmp_path: Any) -> None:
    clock = [1000.0]
    tier = make_tier("lmdb", tmp_path, None, None, ttl_clock=clock)
    doc, kv = segment_data(5, 4)
    with stack_of(tier) as stack:
        segments = SegmentCache(stack)
        segments.store(doc, kv)
        stack.flush()
        assert segments.load(doc) is not None
        clock[0] += 11.0
        assert segments.load(doc) is None, "a segment outlived its TTL"


def test_segment_reads_end_by_their_deadline() -> None:
    with stack_of(MemoryTier()) as stack:
        segments = SegmentCache(stack)
        doc, kv = segment_data(6, 5)
        segments.store(doc, kv)
        stack.flush()
        assert segments.load(doc, deadline=time.monotonic() + 5) is not None
        with pytest.raises(TypeError, match="deadline"):
            segments.load(doc, deadline="soon")


def test_segment_bad_input_names_the_argument() -> None:
    with stack_of(MemoryTier()) as stack:
        segments = SegmentCache(stack)
        with pytest.raises(ValueError, match="tokens"):
            segments.store([], torch.zeros(LAYOUT.chunk_shape(0)))
        with pytest.raises(ValueError, match="kv"):
            segments.store([1, 2, 3], torch.zeros(LAYOUT.chunk_shape(2)))
        with pytest.raises(TypeError, match="tokens"):
            segments.load([1.5, 2.0])
        with pytest.raises(ValueError, match="spans"):
            segments.find([1, 2, 3], [(2, 1)])
        with pytest.raises(ValueError, match="overlap"):
            check_spans([(0, 2), (1, 3)], 4)
        with pytest.raises(TypeError, match="spans"):
            check_spans(5, 4)
    with pytest.raises(TypeError, match="stack"):
        SegmentCache(MemoryTier())  # type: ignore[arg-type]


# -- positional recovery -------------------------------------------------------------------------

@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["llama", "qwen2"]), st.integers(1, 24), st.integers(0, 400), st.integers(0, 10**6))
def test_positional_recovery_is_exact(family: str, n: int, delta: int, seed: int) -> None:
    """The KV of a document computed at offset 0, rotated by delta, is the KV computed at offset
    delta with nothing before it (RoPE attention depends only on relative positions)."""
    from radixkv.integrations.transformers import layer_kv

    model = model_of(family)
    doc = tokens_of(n, seed)
    at_zero = segment_kv(model, doc, torch.float32)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(doc)[None], position_ids=torch.arange(delta, delta + n)[None],
                    use_cache=True)
    at_delta = torch.stack([torch.stack([s[0].transpose(0, 1) for s in layer_kv(out.past_key_values, i)])
                            for i in range(model.config.num_hidden_layers)])
    moved = recover_positions(at_zero, delta, model.model.rotary_emb.inv_freq)
    assert rel_diff(moved, at_delta) <= TOL
    if delta:
        assert rel_diff(at_zero, at_delta) > 100 * TOL, "the control: unrotated keys are far off"


# -- blending in the paged engine ----------------------------------------------------------------

def rag_prompt(doc_sizes: list[int], seed: int, system: int = 8, question: int = 5) -> tuple[list[int], list[tuple[int, int]]]:
    docs = [tokens_of(n, seed + i) for i, n in enumerate(doc_sizes)]
    prompt, spans = tokens_of(system, 1000 + seed), []
    for d in docs:
        spans.append((len(prompt), len(prompt) + len(d)))
        prompt += d
    return prompt + tokens_of(question, 2000 + seed), spans


def make_cache(model: Any, **kw: Any) -> rk.PrefixCache:
    return rk.PrefixCache(layout_for(model, page_size=4), num_pages=128, namespace=namespace_for(model),
                          chunk_size=8, **kw)


def full_prefill(model: Any, prompt: list[int], new: int = 1) -> Any:
    engine = PagedEngine(model, make_cache(model), keep_logits=True)
    req = engine.add(prompt, new)
    engine.run()
    return req


def blended(model: Any, prompt: list[int], spans: list[tuple[int, int]], ratio: float, new: int = 1,
            warm: bool = True) -> tuple[Any, PagedEngine]:
    cache = make_cache(model, tiers=[MemoryTier()])
    engine = PagedEngine(model, cache, keep_logits=True, blend=Blend(ratio=ratio))
    if warm:                                  # each document's KV computed on its own, stored
        for s, e in spans:
            engine.segments.store(prompt[s:e], segment_kv(model, prompt[s:e], torch.float32))
        cache.flush()
    req = engine.add(prompt, new, segments=spans)
    engine.run()
    engine.check()
    return req, engine


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=2, max_size=4), st.integers(0, 1000), st.sampled_from(["llama", "qwen2"]))
def test_ratio_one_is_a_full_prefill(sizes: list[int], seed: int, family: str) -> None:
    model = model_of(family)
    prompt, spans = rag_prompt(sizes, seed)
    exact = full_prefill(model, prompt, new=3)
    req, engine = blended(model, prompt, spans, 1.0, new=3)
    assert rel_diff(req.logits[0], exact.logits[0]) <= TOL
    assert req.output == exact.output
    assert req.blend is not None and req.blend.computed == (len(prompt),) * 2


def naive_reuse_logits(model: Any, prompt: list[int], spans: list[tuple[int, int]]) -> torch.Tensor:
    """The reference of ratio 0, by the plain paged forward: the system prompt computed, each
    document's own KV moved to its place in the pages, the question computed over them all."""
    cache = make_cache(model)
    paged = PagedLlama(model, cache)
    pages = cache.alloc(-(-len(prompt) // 4))
    paged.forward([Chunk(torch.tensor(prompt[:spans[0][0]]), 0, pages)])
    flat = cache.pool.kv.view(*cache.pool.kv.shape[:2], -1, *cache.pool.kv.shape[-2:])
    for s, e in spans:
        kv = recover_positions(segment_kv(model, prompt[s:e], torch.float32), s, model.model.rotary_emb.inv_freq)
        slots = torch.tensor([int(pages[p // 4]) * 4 + p % 4 for p in range(s, e)])
        flat[:, :, slots] = kv
    end = spans[-1][1]
    return paged.forward([Chunk(torch.tensor(prompt[end:]), end, pages)])[0]


def test_ratio_zero_is_naive_reuse() -> None:
    model = model_of("llama")
    prompt, spans = rag_prompt([7, 12, 5], 11)
    req, _ = blended(model, prompt, spans, 0.0)
    reference = naive_reuse_logits(model, prompt, spans)
    assert rel_diff(req.logits[0], reference) <= TOL
    assert rel_diff(req.logits[0], full_prefill(model, prompt).logits[0]) > 100 * TOL, \
        "the control: naive reuse differs from a full prefill"
    fresh = len(prompt) - 24
    assert req.blend is not None and req.blend.computed == (fresh, fresh) and req.blend.reused == 24


def test_selection_picks_the_highest_deviation_tokens() -> None:
    """Cached KV equal to a full prefill's except at tokens X of layer 1, perturbed (layer 0's KV
    never deviates: it depends on no context).  Layer 1 measures its candidates' deviation and
    must recompute exactly X, so the result is the full prefill's; with a small extra deviation
    at one more token, that token is not recomputed and keeps its cached KV."""
    model = model_of("llama")
    prompt, spans = rag_prompt([10, 10], 21, system=4, question=4)
    cache = make_cache(model)
    paged = PagedLlama(model, cache)
    pages = cache.alloc(-(-len(prompt) // 4))
    exact = paged.forward([Chunk(torch.tensor(prompt), 0, pages)])[0]

    def pool_kv() -> torch.Tensor:
        return cache.pool.kv[:, :, pages.long()].reshape(2, 2, -1, 2, 8)[:, :, :len(prompt)].clone()

    kv = pool_kv()
    start, total = 4, len(prompt) - 4
    reused = torch.zeros(total, dtype=torch.bool)
    reused[:20] = True
    chosen = torch.tensor([2, 9, 15])
    g = torch.Generator().manual_seed(0)
    perturbed = kv[:, :, start:].clone()
    for rank, t in enumerate(chosen.tolist()):
        perturbed[1, :, t] += (3.0 - rank) * torch.randn(perturbed[1, :, t].shape, generator=g)
    ratio = len(chosen) / 20
    for small in (False, True):
        cached = perturbed.clone()
        if small:
            cached[1, :, 3] += 1e-3                 # a small deviation: not among the largest
        logits, info = blend_prefill(paged, torch.tensor(prompt[start:]), start, pages, cached, reused, ratio)
        assert info.computed == (total, total - 20 + len(chosen))
        after = pool_kv()[1, :, start:]
        assert torch.allclose(after[:, chosen], kv[1, :, start + chosen], atol=1e-5), "X was not recomputed"
        if small:
            assert torch.equal(after[:, 3], cached[1, :, 3]), "the small deviation was recomputed"
        else:
            assert rel_diff(logits, exact) <= TOL, "layer 1 did not recompute the perturbed tokens"
    deviation = kv_deviation(perturbed[1, 0, :20], perturbed[1, 1, :20], kv[1, 0, start:start + 20],
                             kv[1, 1, start:start + 20])
    assert select_tokens(deviation, 3).tolist() == chosen.tolist()
    assert select_tokens(torch.tensor([1.0, 5.0, 5.0, 0.0]), 1).tolist() == [1]


@given(st.integers(0, 10**6), st.integers(1, 30), st.integers(0, 8), st.floats(0.0, 1.0),
       st.sampled_from(["llama", "qwen2"]))
def test_exact_cached_kv_blends_to_a_full_prefill_at_every_ratio(seed: int, count: int, start: int, ratio: float,
                                                                  family: str) -> None:
    """When the cached KV is what a full prefill computes, which rows a layer recomputes cannot
    matter: any ratio and any reused rows give the full prefill's logits and KV; and each layer
    computes the rows the ratio says (every fresh row, the share of the reused, within the
    candidates)."""
    import math
    import random

    model = model_of(family)
    rng = random.Random(seed)
    prompt = tokens_of(start + count, seed)
    cache = make_cache(model)
    paged = PagedLlama(model, cache)
    pages = cache.alloc(-(-len(prompt) // 4))
    exact = paged.forward([Chunk(torch.tensor(prompt), 0, pages)])[0]
    kv = cache.pool.kv[:, :, pages.long()].reshape(2, 2, -1, 2, 8)[:, :, :len(prompt)].clone()
    reused = torch.tensor([rng.random() < 0.7 for _ in range(count - 1)] + [False])
    cached = kv[:, :, start:].clone()
    cached[:, :, ~reused] = float("nan")         # never read: the rows not reused are computed
    logits, info = blend_prefill(paged, torch.tensor(prompt[start:]), start, pages, cached, reused, ratio)
    assert rel_diff(logits, exact) <= TOL
    after = cache.pool.kv[:, :, pages.long()].reshape(2, 2, -1, 2, 8)[:, :, :len(prompt)]
    assert torch.allclose(after, kv, atol=1e-5)
    num_reused, fresh = int(reused.sum()), count - int(reused.sum())
    candidates = count if ratio > 0 else fresh
    for share, rows in zip(layer_ratios(ratio, 2), info.computed):
        kept = min(candidates - fresh, math.ceil(round(share * num_reused, 9)))
        assert rows == fresh + kept
        candidates = rows


def test_layer_ratios_average_the_ratio() -> None:
    for ratio in (0.05, 0.15, 0.3, 0.6, 1.0):
        shares = layer_ratios(ratio, 9)
        assert shares[0] == 1.0 and all(0 <= s <= 1 for s in shares)
        assert sum(shares[1:]) / 8 == pytest.approx(ratio)
        assert list(shares[1:]) == sorted(shares[1:], reverse=True)


def test_blending_is_opt_in_marked_approximate_and_caches_only_its_exact_prefix() -> None:
    model = model_of("llama")
    prompt, spans = rag_prompt([9, 11, 6], 31)
    cache = make_cache(model, tiers=[MemoryTier()])
    plain = PagedEngine(model, cache)
    req = plain.add(prompt, 2, segments=spans)      # no blend: spans are ignored, the prefill is exact
    plain.run()
    assert not req.approximate and plain.stats()["requests_exact"] == 1 and plain.segments is None
    other = make_cache(model, tiers=[MemoryTier()])
    engine = PagedEngine(model, other, blend=Blend())
    first = engine.add(prompt, 2, segments=spans)   # missing documents: computed on their own, stored
    engine.run()
    other.flush()
    order = [spans[2], spans[0], spans[1]]
    shuffled = prompt[:8] + [t for s, e in order for t in prompt[s:e]] + prompt[spans[-1][1]:]
    at, moved = 8, []
    for s, e in order:
        moved.append((at, at + e - s))
        at += e - s
    second = engine.add(shuffled, 2, segments=moved)
    engine.run()
    engine.check()
    stats = engine.stats()
    assert first.approximate and second.approximate and second.blend is not None
    assert stats["requests_blended"] == 2 and stats["requests_exact"] == 0
    assert stats["segments_computed"] == 3 and stats["segments_reused"] == 3
    assert stats["segments"]["loaded"] == 3
    # Only the exact prefix before the first document (the system prompt: its KV depends on no
    # reused KV) went into the tree, nothing of the blended KV; the next blended request takes that
    # prefix from the tree, and a plain match finds nothing past it.
    assert other.tree.total_size == 8
    assert first.cached_at_start == [0] and second.cached_at_start == [8]
    third = engine.add(shuffled, 2, segments=moved)
    engine.run()
    assert third.cached_at_start == [8] and third.approximate
    m = other.match(prompt)
    assert m.num_tokens == 8
    other.release(m)
    exact = PagedEngine(model, other, keep_logits=True)     # the cached prefix is exact: as a full prefill's
    fresh = PagedEngine(model, make_cache(model), keep_logits=True)
    a, b = exact.add(prompt[:12], 1), fresh.add(prompt[:12], 1)
    exact.run()
    fresh.run()
    assert a.cached_at_start == [8] and b.cached_at_start == [0]
    assert rel_diff(a.logits[0], b.logits[0]) < TOL


def test_blending_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="sliding"):
        mistral = random_model("mistral", seed=0, num_layers=2, hidden_size=32, num_heads=4)
        PagedEngine(mistral, rk.PrefixCache(layout_for(mistral, page_size=4), num_pages=32, tiers=[MemoryTier()],
                                            namespace=namespace_for(mistral), chunk_size=8), blend=Blend())
    mla = random_model("deepseek_v3", seed=0, num_layers=2, hidden_size=32, num_heads=4)
    with pytest.raises(ValueError, match="MLA"):
        PagedEngine(mla, make_cache(model_of("llama")), blend=Blend())
    model = model_of("llama")
    with pytest.raises(ValueError, match="segments"):
        PagedEngine(model, make_cache(model), blend=Blend())          # no tiers, no SegmentCache
    with pytest.raises(ValueError, match="ratio"):
        Blend(ratio=1.5)
    with pytest.raises(TypeError, match="ratio"):
        Blend(ratio="0.1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="blend"):
        PagedEngine(model, make_cache(model), blend=0.15)  # type: ignore[arg-type]
    engine = PagedEngine(model, make_cache(model, tiers=[MemoryTier()]), blend=Blend())
    with pytest.raises(ValueError, match="segments"):
        engine.add([1, 2, 3, 4], 1, segments=[(2, 9)])
    with pytest.raises(TypeError, match="delta"):
        recover_positions(torch.zeros(1, 2, 1, 1, 4), 1.5, torch.ones(2))  # type: ignore[arg-type]


@given(st.integers(0, 10**6), st.integers(2, 6), st.booleans())
def test_the_trained_task_asks_what_it_says(seed: int, k: int, conflicting: bool) -> None:
    """The benchmark's task: the answer is the value of the first document that states the key; a
    conflicting question's key is stated with two values, a single one's with one; spans are the
    documents."""
    import random

    from radixkv.bench import blend_task as task

    prompt = task.Corpus(24, seed).question(random.Random(seed), k, conflicting)
    assert prompt.conflicting == conflicting and len(prompt.spans) == k
    assert prompt.tokens[-2] == task.Q and prompt.tokens[:len(task.SYSTEM)] == task.SYSTEM
    key = prompt.tokens[-1] - task.KEY0
    stated = []
    for s, e in prompt.spans:
        assert prompt.tokens[s] == task.DOC and e - s == task.FACTS + 1
        facts = [divmod(t - task.FACT0, task.NUM_VALUES) for t in prompt.tokens[s + 1:e]]
        assert len({f[0] for f in facts}) == task.FACTS
        stated += [value for fact_key, value in facts if fact_key == key]
    assert stated and prompt.answer == task.VALUE0 + stated[0]
    assert (len(set(stated)) > 1) == conflicting
