"""The reference paged engine loop: every logit it produces equals a full recompute's.

``PagedEngine`` keeps the KV of several requests in pool pages and decodes from them.  Each test
runs it on a tiny random-weight model (two layers, hidden 64, page size 4, chunk size 8) and
compares the last-token logits of every step — prefill and each decode step — with one plain
Hugging Face forward over the same tokens (fp32, max abs difference <= 1e-4): for requests in
flight that share a system prompt, a request whose prefix is loaded from a tier (CPU, LMDB) while
the others decode, a second turn that reuses generated tokens, and a pool too small for all
requests at once (preemption).  ``engine.check()`` runs after every step; injected failures
leave every page where it was.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from radixkv import PoolExhausted, PrefixCache  # noqa: E402
from radixkv.integrations.paged import EngineRequest, PagedEngine  # noqa: E402
from radixkv.integrations.paged_model import Chunk, PagedLlama  # noqa: E402
from radixkv.integrations.transformers import layout_for, namespace_for, random_model  # noqa: E402

TOL = 1e-4
PAGE, CHUNK, VOCAB = 4, 8, 128
COUNTS = ("pages_free", "pages_cached", "pages_engine", "live_matches", "locked_tokens", "cached_tokens")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama() -> Any:
    return random_model("llama", seed=0, num_kv_heads=2, vocab_size=VOCAB)


def make_cache(model: Any, tiers: Any = (), num_pages: int = 128) -> PrefixCache:
    return PrefixCache(layout_for(model, page_size=PAGE), num_pages=num_pages, chunk_size=CHUNK,
                       namespace=namespace_for(model), tiers=tiers)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def full_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0]


def assert_exact(model: Any, r: EngineRequest) -> None:
    """Every step's logits of ``r`` equal a full forward's at the same position."""
    assert r.state == "finished" and len(r.logits) == len(r.output) == r.max_new_tokens
    reference = full_logits(model, r.tokens[:-1])[r.prompt_len - 1:]     # the one that chose output[i]
    diff = (torch.stack(r.logits) - reference).abs().max().item()
    assert diff <= TOL, f"request {r.id}: max |logits - full recompute| = {diff}"
    assert r.output == reference.argmax(-1).tolist()


def run(engine: PagedEngine, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not engine.busy:
            return
        engine.step()
        engine.check()
    raise AssertionError("the engine did not finish")


def counts(cache: PrefixCache) -> dict[str, int]:
    stats = cache.stats()
    return {k: stats[k] for k in COUNTS}


# -- the model's forward over pages ---------------------------------------------------------------

def mistral() -> Any:
    import transformers

    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).train(False)


@pytest.mark.parametrize("family,kv_heads", [("llama", 1), ("llama", 2), ("llama", 4), ("qwen2", 2), ("mistral", 2)])
def test_attention_through_a_scrambled_block_table_is_the_full_forward(family: str, kv_heads: int) -> None:
    """Multi-query (1 KV head for 4 query heads), grouped and multi-head attention."""
    from radixkv.integrations.transformers import layer_kv

    model = mistral() if family == "mistral" else random_model(family, seed=1, num_kv_heads=kv_heads,
                                                               vocab_size=VOCAB)
    cache = PrefixCache(layout_for(model, page_size=PAGE), num_pages=16, namespace=namespace_for(model, name="t"))
    paged = PagedLlama(model, cache.pool)
    ids = torch.tensor(tokens(23, seed=1))
    table = cache.alloc(6)[torch.randperm(6, generator=torch.Generator().manual_seed(0))]
    other = cache.alloc(1)
    first = paged.forward([Chunk(ids[:10], 0, table)])
    rest = paged.forward([Chunk(ids[10:], 10, table), Chunk(ids[:3], 0, other)])   # a varlen batch of two
    full = full_logits(model, ids.tolist())
    assert (first[0] - full[9]).abs().max().item() <= TOL
    assert (rest[0] - full[22]).abs().max().item() <= TOL
    assert (rest[1] - full_logits(model, ids[:3].tolist())[2]).abs().max().item() <= TOL
    kv = cache.pool.kv[:, :, table].reshape(2, 2, -1, kv_heads, 16)[:, :, :23]       # the K/V are in the pages
    with torch.no_grad():
        keys, values = layer_kv(model(ids[None], use_cache=True).past_key_values, 1)
    assert (kv[1, 0] - keys[0].transpose(0, 1)).abs().max().item() <= TOL
    assert (kv[1, 1] - values[0].transpose(0, 1)).abs().max().item() <= TOL


def test_a_pool_of_another_dtype(llama: Any) -> None:
    """K/V are converted into the pool's dtype and back: a bfloat16 pool under a float32 model
    costs only bfloat16's rounding of the K/V."""
    layout = layout_for(llama, page_size=PAGE, dtype=torch.bfloat16)
    engine = PagedEngine(llama, PrefixCache(layout, num_pages=32, namespace=namespace_for(llama)), keep_logits=True)
    r = engine.add(tokens(11, seed=19), max_new_tokens=6)
    run(engine)
    reference = full_logits(llama, r.tokens[:-1])[r.prompt_len - 1:]
    diff = (torch.stack(r.logits) - reference).abs().max().item()
    assert 0 < diff <= 1e-2


# -- requests in flight ---------------------------------------------------------------------------

def test_one_request_prefill_and_decode_are_exact(llama: Any) -> None:
    engine = PagedEngine(llama, make_cache(llama), keep_logits=True)
    r = engine.add(tokens(13, seed=2), max_new_tokens=9)
    run(engine)
    assert_exact(llama, r)
    assert r.cached_at_start == [0] and engine.steps == 9
    assert engine.cache.stats()["cached_tokens"] == 20       # every full page of the 21 computed tokens


def test_requests_in_flight_sharing_a_system_prompt_read_its_pages(llama: Any) -> None:
    engine = PagedEngine(llama, make_cache(llama), keep_logits=True)
    system = tokens(21, seed=3)                              # 5 full pages and one token
    first = engine.add(system + tokens(3, seed=4), max_new_tokens=8)
    engine.step()                                            # its prefill caches the system prompt
    others = [engine.add(system + tokens(2 + i, seed=5 + i), max_new_tokens=6 + i) for i in range(3)]
    shared: set[tuple[int, ...]] = set()
    while engine.busy:
        engine.step()
        engine.check()
        shared |= {tuple(r.held[:5].tolist()) for r in engine.running if len(r.held) >= 5}
    assert len(shared) == 1                                  # one set of pages backs the system prompt
    for r in (first, *others):
        assert_exact(llama, r)
    assert [r.cached_at_start for r in others] == [[20]] * 3


def test_two_requests_that_prefill_the_same_prompt_at_once_end_on_the_same_pages(llama: Any) -> None:
    engine = PagedEngine(llama, make_cache(llama), keep_logits=True)
    prompt = tokens(18, seed=9)
    a, b = engine.add(prompt, max_new_tokens=5), engine.add(prompt, max_new_tokens=7)
    engine.step()                                            # both computed the prompt: b's pages were duplicates
    engine.check()
    assert np.array_equal(a.held, b.held) and len(a.held) == 4
    assert engine.cache.stats()["duplicate_pages"] == 4
    run(engine)
    assert_exact(llama, a)
    assert_exact(llama, b)
    assert a.output == b.output[:5]


def test_a_second_turn_reuses_the_generated_tokens(llama: Any) -> None:
    engine = PagedEngine(llama, make_cache(llama), keep_logits=True)
    turn1 = engine.add(tokens(13, seed=10), max_new_tokens=10)
    run(engine)
    assert_exact(llama, turn1)
    turn2 = engine.add(turn1.tokens + tokens(5, seed=11), max_new_tokens=6)
    run(engine)
    assert_exact(llama, turn2)
    assert turn2.cached_at_start == [20]                     # past the 13 prompt tokens: generated ones too


def test_decoding_reads_the_pool_pages_themselves(llama: Any) -> None:
    """Overwrite a held page's KV in ``cache.pool.kv`` mid-decode: the next logits change, so the
    engine reads the pool, not a copy of its own."""
    engine = PagedEngine(llama, make_cache(llama), keep_logits=True)
    r = engine.add(tokens(13, seed=18), max_new_tokens=4)
    engine.step()
    engine.step()
    engine.cache.pool.kv[:, :, int(r.held[1])] = 0.0           # tokens 4..7 of the prompt
    engine.step()
    reference = full_logits(llama, r.tokens[:-1])
    assert (r.logits[1] - reference[-2]).abs().max().item() <= TOL
    assert (r.logits[2] - reference[-1]).abs().max().item() > 100 * TOL


# -- a tier load while the others decode ------------------------------------------------------------

def gated(cls: type, *args: Any, **kwargs: Any) -> Any:
    """A tier of class ``cls`` whose reads wait for ``tier.gate`` (set: open)."""

    class Gated(cls):  # type: ignore[misc, valid-type]
        gate = threading.Event()

        def get(self, key: bytes) -> Any:
            assert self.gate.wait(30)
            return super().get(key)

        def read(self, key: bytes, consume: Any) -> Any:
            assert self.gate.wait(30)
            return super().read(key, consume)

    tier = Gated(*args, **kwargs)
    tier.gate.set()
    return tier


def serve_into_the_tier(engine: PagedEngine, prompt: list[int]) -> EngineRequest:
    """Serve ``prompt`` to the end, then empty the pool: its full chunks are in the tier only."""
    r = engine.add(prompt, max_new_tokens=3)
    run(engine)
    assert engine.cache.flush(30)
    engine.cache.evict(engine.cache.pool.num_pages)
    assert engine.cache.flush(30)                # an exclusive CPU tier gets the evicted chunks now
    assert engine.cache.stats()["cached_tokens"] == 0
    return r


@pytest.mark.parametrize("backend", ["cpu", "lmdb"])
def test_a_request_loads_its_prefix_from_a_tier_while_others_decode(llama: Any, backend: str, tmp_path: Any) -> None:
    from radixkv.backends import CpuTier

    if backend == "lmdb":
        pytest.importorskip("lmdb")
        from radixkv.backends import LmdbTier
        tier = gated(LmdbTier, tmp_path / "kv", max_bytes=1 << 22)
    else:
        tier = gated(CpuTier, max_bytes=1 << 20)
    with make_cache(llama, tiers=[tier]) as cache:
        engine = PagedEngine(llama, cache, keep_logits=True, deadline_s=30.0)
        document = tokens(41, seed=12)                       # 5 chunks, written through
        warm = serve_into_the_tier(engine, document + tokens(2, seed=13))
        busy = [engine.add(tokens(9 + i, seed=14 + i), max_new_tokens=12) for i in range(2)]
        for _ in range(200):                                 # their own lookups done: both decoding
            engine.step()
            if all(r.output for r in busy):
                break
        assert all(r.output for r in busy)
        tier.gate.clear()                                    # the load will wait in the tier
        late = engine.add(document + tokens(3, seed=16), max_new_tokens=5)
        for _ in range(4):
            before = [len(r.output) for r in busy]
            engine.step()
            engine.check()
            assert late.state == "loading" and late.request is not None and late.request.pending
            assert [len(r.output) for r in busy] == [n + 1 for n in before]    # the others kept decoding
        tier.gate.set()
        run(engine)
        assert late.tier_tokens == 40 and late.cached_at_start == [40]
        for r in (warm, *busy, late):
            assert_exact(llama, r)


@pytest.mark.parametrize("load,served", [("wait", 32), ("none", 0)])
def test_the_other_load_behaviours(llama: Any, load: str, served: int) -> None:
    """``load="wait"``: admission waits for the tier; ``"none"``: the pool only."""
    from radixkv.backends import CpuTier

    with make_cache(llama, tiers=[CpuTier(max_bytes=1 << 20)]) as cache:
        engine = PagedEngine(llama, cache, keep_logits=True, load=load)
        document = tokens(33, seed=17)
        serve_into_the_tier(engine, document)
        r = engine.add(document + tokens(2, seed=18), max_new_tokens=3)
        engine.step()
        assert r.state == "running" and r.tier_tokens == served and r.cached_at_start == [served]
        run(engine)
        assert_exact(llama, r)


# -- pool pressure ----------------------------------------------------------------------------------

def test_a_short_pool_preempts_the_newest_and_every_answer_stays_exact(llama: Any) -> None:
    prompts = [tokens(10 + 3 * i, seed=20 + i) for i in range(3)]
    alone = []
    for p in prompts:                                        # each request served alone, with room
        engine = PagedEngine(llama, make_cache(llama))
        alone.append(engine.add(p, max_new_tokens=10))
        run(engine)
    engine = PagedEngine(llama, make_cache(llama, num_pages=12), keep_logits=True)   # 6 pages each at the end
    rs = [engine.add(p, max_new_tokens=10) for p in prompts]
    run(engine)
    assert sum(r.preemptions for r in rs) > 0 and rs[0].preemptions == 0
    for r, ref in zip(rs, alone):
        assert_exact(llama, r)
        assert r.output == ref.output
    stats = engine.cache.stats()
    assert (stats["pages_engine"], stats["live_matches"], stats["locked_tokens"]) == (0, 0, 0)


def test_a_request_the_pool_cannot_hold_raises_pool_exhausted_and_holds_nothing(llama: Any) -> None:
    engine = PagedEngine(llama, make_cache(llama, num_pages=4))
    before = counts(engine.cache)
    r = engine.add(tokens(20, seed=30), max_new_tokens=2)
    with pytest.raises(PoolExhausted):
        engine.step()
    engine.check()
    engine.abort(r)
    assert r.state == "aborted" and counts(engine.cache) == before


# -- failures leak nothing ----------------------------------------------------------------------------

class Injected(RuntimeError):
    pass


def in_flight(model: Any) -> tuple[PagedEngine, list[EngineRequest]]:
    """An engine with three requests decoding, two of them sharing pages with the first."""
    engine = PagedEngine(model, make_cache(model), keep_logits=True)
    system = tokens(11, seed=31)
    rs = [engine.add(system + tokens(3, seed=32), max_new_tokens=8)]
    engine.step()
    rs += [engine.add(system + tokens(4 + i, seed=33 + i), max_new_tokens=6) for i in range(2)]
    engine.step()
    return engine, rs


@pytest.mark.parametrize("where", ["forward", "alloc", "open"])
def test_a_failure_inside_a_step_leaves_every_page_where_it_was(llama: Any, where: str) -> None:
    engine, rs = in_flight(llama)
    if where == "open":                                     # a newcomer whose open fails
        rs.append(engine.add(tokens(6, seed=40), max_new_tokens=4))
    before, outputs = counts(engine.cache), [r.output for r in rs]

    def fail(*_: Any, **__: Any) -> None:
        raise Injected(where)
    with pytest.MonkeyPatch.context() as mp:
        handle = None
        if where == "forward":                              # a raising hook: the model fails mid-forward
            handle = llama.model.layers[1].mlp.register_forward_hook(fail)
        else:
            mp.setattr(engine.cache, where, fail)
        try:
            for _ in range(3):
                with pytest.raises(Injected):
                    engine.step()
                engine.check()
                assert counts(engine.cache) == before and [r.output for r in rs] == outputs
        finally:
            if handle is not None:
                handle.remove()
    run(engine)                                             # retried: every answer is still exact
    for r in rs:
        assert_exact(llama, r)


def test_a_load_that_fails_to_land_leaves_every_page_where_it_was(llama: Any) -> None:
    from radixkv import ops
    from radixkv.backends import CpuTier

    with make_cache(llama, tiers=[gated(CpuTier, max_bytes=1 << 20)]) as cache:
        tier = cache.stack.tiers[0]                          # type: ignore[union-attr]
        engine = PagedEngine(llama, cache, keep_logits=True, deadline_s=30.0)
        document = tokens(33, seed=41)
        serve_into_the_tier(engine, document)
        busy = engine.add(tokens(7, seed=42), max_new_tokens=40)
        engine.step()
        tier.gate.clear()
        late = engine.add(document + tokens(2, seed=43), max_new_tokens=3)
        engine.step()
        with pytest.MonkeyPatch.context() as mp:
            def fail(*_: Any, **__: Any) -> None:
                raise Injected("scatter")
            mp.setattr(ops, "scatter_pages", fail)           # landing the chunks in the pool fails
            tier.gate.set()
            for _ in range(400):                             # step until the load arrives and fails to land
                before = counts(cache)
                try:
                    engine.step()
                except Injected:
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("the load never landed")
            engine.check()
            assert counts(cache) == before and late.state == "loading"
        run(engine)                                          # the load is a miss: computed instead, exactly
        assert late.tier_tokens == 0
        for r in (busy, late):
            assert_exact(llama, r)


def test_a_failing_extend_is_retried_at_the_next_step(llama: Any) -> None:
    from radixkv.core.request import Request

    engine, rs = in_flight(llama)
    filled = 0
    with pytest.MonkeyPatch.context() as mp:
        def fail(*_: Any, **__: Any) -> None:
            raise Injected("extend")
        mp.setattr(Request, "extend", fail)
        while not filled:                                   # step until some request fills a page
            try:
                engine.step()
            except Injected:
                filled += 1
            engine.check()                                  # the page stays the engine's, counted as such
    run(engine)
    for r in rs:
        assert_exact(llama, r)
    assert engine.cache.stats()["pages_engine"] == 0


def test_close_releases_everything(llama: Any) -> None:
    engine = PagedEngine(llama, make_cache(llama))
    before = counts(engine.cache)
    for i in range(3):
        engine.add(tokens(9, seed=50 + i), max_new_tokens=20)
    engine.step()
    engine.step()
    engine.close()
    engine.check()
    stats = engine.cache.stats()
    assert (stats["pages_engine"], stats["live_matches"], stats["locked_tokens"]) == (0, 0, 0)
    assert stats["pages_free"] + stats["pages_cached"] == before["pages_free"]
    assert not engine.busy


def test_bad_inputs_are_refused(llama: Any) -> None:
    engine = PagedEngine(llama, make_cache(llama))
    with pytest.raises(ValueError, match="must not be empty"):
        engine.add([], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add([1, 2], 0)
    with pytest.raises(TypeError, match="integer token ids"):
        engine.add([1.5], 2)
    with pytest.raises((TypeError, ValueError), match="eos_token_id"):
        engine.add([1, 2], 2, eos_token_id=-1)
    with pytest.raises(TypeError, match="keep_logits"):
        PagedEngine(llama, make_cache(llama), keep_logits="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_running"):
        PagedEngine(llama, make_cache(llama), max_running=0)
    with pytest.raises(TypeError, match="integer token ids"):
        engine.model.forward([Chunk(torch.tensor([1.0]), 0, torch.tensor([0]))])
    with pytest.raises(ValueError, match="a table of 1 pages for 5 tokens"):
        engine.model.forward([Chunk(torch.tensor([1, 2]), 3, torch.tensor([0]))])
    with pytest.raises(ValueError, match="load"):
        PagedEngine(llama, make_cache(llama), load="later")
    neox = random_model("gpt_neox", seed=0, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="PagedLlama runs"):
        PagedEngine(neox, make_cache(neox))
    other = random_model("llama", seed=0, num_layers=3, num_kv_heads=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="3 x 2 x 16"):
        PagedEngine(other, make_cache(llama))
    with pytest.raises(TypeError, match="cache"):
        PagedEngine(llama, object())  # type: ignore[arg-type]
    assert not engine.busy and engine.cache.stats()["pages_engine"] == 0


# -- more edges ---------------------------------------------------------------------------------------

def test_a_load_past_its_deadline_is_a_miss_and_the_request_computes_its_prefix(llama: Any) -> None:
    from radixkv.backends import CpuTier

    tier = gated(CpuTier, max_bytes=1 << 20)
    with make_cache(llama, tiers=[tier]) as cache:
        engine = PagedEngine(llama, cache, keep_logits=True, deadline_s=0.2)
        document = tokens(33, seed=60)
        serve_into_the_tier(engine, document)
        tier.gate.clear()
        try:
            late = engine.add(document + tokens(2, seed=61), max_new_tokens=4)
            engine.step()
            assert late.state == "loading"
            run(engine)                      # an idle step waits for the load, at most to its deadline
        finally:
            tier.gate.set()
        assert late.tier_tokens == 0 and late.cached_at_start == [0]
        assert_exact(llama, late)
        assert cache.stats()["late_loads"] == 1


def test_generation_stops_after_the_eos_token(llama: Any) -> None:
    engine = PagedEngine(llama, make_cache(llama))
    prompt = tokens(10, seed=62)
    free_run = engine.add(prompt, max_new_tokens=6)
    run(engine)
    eos = free_run.output[2]
    stopped = engine.add(prompt, max_new_tokens=6, eos_token_id=eos)
    run(engine)
    assert stopped.output == free_run.output[:free_run.output.index(eos) + 1]


@pytest.mark.parametrize("tiered", [False, True])
def test_random_arrivals_aborts_and_a_short_pool(llama: Any, tiered: bool) -> None:
    """Continuous batching under churn: arrivals each step, aborts, a pool of a few requests'
    pages and (``tiered``) a CPU tier under it that the pool is emptied into now and then, so that
    loads land while others decode.  After every step ``check()`` holds, and every page a request
    held before the step it still holds, with the same KV; every finished answer is exact."""
    from hypothesis import example, given, settings, strategies as st

    from radixkv.backends import CpuTier

    systems = [tokens(9, seed=70), tokens(14, seed=71)]
    request = st.tuples(st.integers(0, 2), st.integers(1, 6), st.integers(4, 10), st.integers(0, 4),
                        st.integers(0, 2**16), st.booleans())

    @settings(max_examples=12, deadline=None, database=None)
    # Two examples that always run: three requests that cannot all fit in 8 pages (preemption), and
    # a request on the system prompt of a finished one after the pool was emptied (a tier load).
    @example([(2, 6, 10, 0, 1, False), (2, 6, 10, 0, 2, False), (2, 6, 10, 0, 3, False)], 8, 3, set())
    @example([(1, 1, 4, 0, 4, False), (1, 2, 4, 6, 5, False)], 12, 2, {5})
    @given(st.lists(request, min_size=3, max_size=6), st.integers(8, 12), st.integers(2, 4),
           st.sets(st.integers(1, 12), max_size=4))
    def churn(requests: list[tuple[int, int, int, int, int, bool]], num_pages: int, max_running: int,
              evictions: set[int]) -> None:
        tiers = [CpuTier(max_bytes=1 << 20)] if tiered else []
        with make_cache(llama, tiers=tiers, num_pages=num_pages) as cache:
            engine = PagedEngine(llama, cache, max_running=max_running, keep_logits=True, deadline_s=30.0)
            added: list[tuple[EngineRequest, bool]] = []
            for step in range(200):
                for system, n, new, arrival, seed, abort in requests:
                    if arrival == step:
                        prompt = (systems[system] if system < 2 else []) + tokens(n, seed)
                        added.append((engine.add(prompt, max_new_tokens=new), abort))
                for r, abort in added:
                    if abort and r.state in ("waiting", "loading", "running") and r.kv_len and step % 2:
                        engine.abort(r)
                if tiered and step in evictions:
                    cache.evict(num_pages)                   # what no request holds goes to the tier only
                if not engine.busy and step > 6:
                    break
                held = {r: (r.preemptions, r.held.copy(), cache.pool.kv[:, :, r.held].clone())
                        for r in engine.running}
                engine.step()
                engine.check()
                for r, (preemptions, pages, kv) in held.items():   # what a request held, it still holds,
                    if r.state in ("loading", "running") and r.preemptions == preemptions:   # unchanged
                        assert np.array_equal(r.held[:len(pages)], pages)
                        assert torch.equal(cache.pool.kv[:, :, pages], kv)
            stats = cache.stats()
            assert (stats["pages_engine"], stats["live_matches"], stats["locked_tokens"]) == (0, 0, 0)
            for r, _ in added:
                assert r.state in ("finished", "aborted")
                if r.state == "finished":
                    assert_exact(llama, r)
            preempted.append(sum(r.preemptions for r, _ in added))
            loaded.append(sum(r.tier_tokens for r, _ in added))

    preempted: list[int] = []
    loaded: list[int] = []
    churn()
    assert sum(preempted) > 0                                # the short pools did bite
    assert sum(loaded) > 0 or not tiered                     # and tier loads landed


# -- a sliding-window model: KV groups -------------------------------------------------------------

@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_sliding_window_model_decodes_from_its_groups_pages_exactly(family: str) -> None:
    """Mistral (every layer sliding) and Qwen2 (the upper half sliding), window 6: requests that
    share a system prompt, decode past the window and start a second turn are exact, while each
    sliding group holds only the pages inside the windows (``cache.groups``)."""
    model = random_model(family, seed=0, num_layers=2, num_kv_heads=2, vocab_size=VOCAB, sliding_window=6)
    layout = layout_for(model, page_size=PAGE)
    assert layout.grouped
    cache = PrefixCache(layout, num_pages=128, chunk_size=CHUNK, namespace=namespace_for(model))
    engine = PagedEngine(model, cache, keep_logits=True)
    system = tokens(21, seed=20)
    first = engine.add(system + tokens(3, seed=21), max_new_tokens=12)
    run(engine)
    others = [engine.add(system + tokens(2 + i, seed=22 + i), max_new_tokens=10) for i in range(2)]
    run(engine)                             # two at once: neither finds the system prompt's window
    last = engine.add(system + tokens(5, seed=25), max_new_tokens=10)
    run(engine)
    for r in (first, *others, last):
        assert_exact(model, r)
    # The second request diverged after the system prompt: the branch made there is a reuse
    # point whose window its own pages filled, so the last request reuses the system prompt.
    assert others[0].cached_at_start == [0] and last.cached_at_start == [20]
    held = cache.stats()["window_pages_held"]
    nodes = cache.tree.nodes()
    reuse_points = sum(len(n.children) != 1 for n in nodes)     # leaves and branch points
    assert all(n <= reuse_points * k for n, k in zip(held, cache.groups.keep))  # their windows, not every page
    assert cache.stats()["pages_cached"] > max(held)
    turn2 = engine.add(first.tokens + tokens(4, seed=30), max_new_tokens=5)
    run(engine)
    assert_exact(model, turn2)
    assert turn2.cached_at_start[0] >= len(first.tokens) // PAGE * PAGE - PAGE
    cache.check()
