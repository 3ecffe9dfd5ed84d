"""No leaks: a failure anywhere in the Hugging Face adapter leaves every page where it was.

An exception is injected at each step of ``PrefixCachedLM.prefill`` (the open, the gather of the
cached prefix, the model's forward through a raising forward hook, the alloc, the copy out of the
model's cache object, the scatter into the pool, the extend), of ``generate`` (a decode step, the
caching of a page it filled) and of ``cache_sequence``.  After each: ``cache.check()`` holds, no
page is engine-held or locked, and the page counts are those before the call (or, for
``generate``, those a plain ``prefill`` of the prompt leaves: what happened before the failure
stays cached).  Then the same call succeeds with
exact logits, so nothing the failure left behind is wrong either.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from radixkv import PrefixCache, Request, ops  # noqa: E402
from radixkv.integrations import transformers as hf  # noqa: E402
from radixkv.integrations.transformers import PrefixCachedLM, layout_for, namespace_for, random_model  # noqa: E402
from hf_cases import TOL, assert_tolerance_catches_wrong_kv, rel_diff  # noqa: E402

PAGE, CHUNK, VOCAB = 4, 8, 128
COUNTS = ("pages_free", "pages_cached", "pages_engine", "live_matches", "locked_tokens", "cached_tokens", "nodes")


class Injected(RuntimeError):
    """The failure the tests inject."""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Any:
    return random_model("llama", seed=5, num_kv_heads=2, vocab_size=VOCAB)


def make_cache(model: Any, tiers: Any = (), num_pages: int = 64) -> PrefixCache:
    return PrefixCache(layout_for(model, page_size=PAGE), num_pages=num_pages, chunk_size=CHUNK,
                       namespace=namespace_for(model), tiers=tiers)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def counts(cache: PrefixCache) -> dict[str, int]:
    stats = cache.stats()
    return {k: stats[k] for k in COUNTS}


def exact(lm: PrefixCachedLM, ids: np.ndarray) -> None:
    result = lm.prefill(ids, logits_to_keep=0)
    with torch.no_grad():
        reference = lm.model(torch.as_tensor(ids).long()[None]).logits[0, result.match_tokens:]
    assert rel_diff(result.logits, reference) <= TOL
    lm.cache.check()


def failing(call: Callable[..., Any], nth: int, exc: BaseException) -> Callable[..., Any]:
    """``call``, except that its ``nth`` call (1-based) raises ``exc``."""
    seen = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        if seen[0] == nth:
            raise exc
        return call(*args, **kwargs)
    return wrapper


class Inject:
    """Installs one failure at a named step of the adapter; ``remove()`` takes it away."""

    def __init__(self, mp: pytest.MonkeyPatch, lm: PrefixCachedLM, step: str, nth: int = 1,
                 exc: BaseException | None = None) -> None:
        exc = exc or Injected(step)
        self.hook = None
        if step == "forward":            # a raising forward hook: the model fails inside its forward
            seen = [0]

            def hook(*_: Any) -> None:
                seen[0] += 1
                if seen[0] == nth:
                    raise exc
            self.hook = lm.model.model.layers[-1].register_forward_hook(hook)
        elif step in ("open", "alloc"):
            mp.setattr(lm.cache, step, failing(getattr(lm.cache, step), nth, exc))
        elif step == "extend":                     # a request's verb: on the Request
            mp.setattr(Request, "extend", failing(Request.extend, nth, exc))
        elif step in ("gather_pages", "scatter_pages"):
            mp.setattr(ops, step, failing(getattr(ops, step), nth, exc))
        elif step == "layer_kv":
            mp.setattr(hf, "layer_kv", failing(hf.layer_kv, nth, exc))
        else:
            raise AssertionError(step)
        self.mp = mp

    def remove(self) -> None:
        if self.hook is not None:
            self.hook.remove()
        self.mp.undo()


@pytest.fixture
def mp() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


PREFILL_STEPS = ["open", "gather_pages", "forward", "alloc", "layer_kv", "scatter_pages", "extend"]


def test_the_tolerance_tells_right_kv_from_wrong(model: Any) -> None:
    """The control of ``TOL``, with which ``exact`` checks what a failure left behind."""
    assert_tolerance_catches_wrong_kv(PrefixCachedLM(model, make_cache(model)), tokens(24, seed=41), 16, page=PAGE)


@pytest.mark.parametrize("step", PREFILL_STEPS)
def test_a_failing_prefill_leaves_every_page_where_it_was(model: Any, mp: pytest.MonkeyPatch, step: str) -> None:
    lm = PrefixCachedLM(model, make_cache(model))
    prompt = tokens(22, seed=1)
    lm.prefill(prompt)                                       # 5 pages cached: the next prefill gathers them
    longer = np.concatenate([prompt, tokens(13, seed=2)])    # and caches 3 more
    before = counts(lm.cache)
    for _ in range(3):                                        # repeated failures accumulate nothing
        inject = Inject(mp, lm, step)
        with pytest.raises(Injected):
            lm.prefill(longer)
        inject.remove()
        lm.cache.check()
        assert counts(lm.cache) == before
    exact(lm, longer)                                        # and the same prefill then works, exactly
    assert lm.cache.stats()["cached_tokens"] == 32


@pytest.mark.parametrize("step", ["forward", "alloc", "extend"])
def test_a_failing_cold_prefill_or_an_interrupt_leaves_nothing(model: Any, mp: pytest.MonkeyPatch, step: str) -> None:
    lm = PrefixCachedLM(model, make_cache(model))
    before = counts(lm.cache)
    inject = Inject(mp, lm, step, exc=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        lm.prefill(tokens(17, seed=3))
    inject.remove()
    lm.cache.check()
    assert counts(lm.cache) == before


def test_a_failing_prefill_after_a_tier_load_keeps_the_loaded_pages_cached_and_unlocked(
        model: Any, mp: pytest.MonkeyPatch) -> None:
    from radixkv.backends import CpuTier

    with make_cache(model, tiers=[CpuTier(max_bytes=1 << 20)]) as cache:
        lm = PrefixCachedLM(model, cache)
        prompt = tokens(33, seed=4)
        lm.prefill(prompt)
        assert cache.flush(30)
        cache.evict(cache.pool.num_pages)
        assert cache.flush(30)                   # an exclusive CPU tier gets the evicted chunks now
        inject = Inject(mp, lm, "forward")
        with pytest.raises(Injected):
            lm.prefill(np.concatenate([prompt, tokens(3, seed=5)]))
        inject.remove()
        cache.check()
        stats = cache.stats()   # the load itself succeeded: its pages are cached (not leaked, not locked)
        assert (stats["pages_engine"], stats["live_matches"], stats["locked_tokens"]) == (0, 0, 0)
        assert stats["cached_tokens"] == 32 and stats["pages_cached"] == 8
        exact(lm, np.concatenate([prompt, tokens(3, seed=5)]))


# forward: the prompt's forward is call 1, the decode steps 2, 3, ...; the others fail when the
# generated tokens fill the prompt's tail page (the second alloc, extend, scatter; layer_kv per layer).
GENERATE_STEPS = [("forward", 3), ("alloc", 2), ("layer_kv", 3), ("scatter_pages", 2), ("extend", 2)]


@pytest.mark.parametrize("step,nth", GENERATE_STEPS)
def test_a_failing_generate_keeps_only_what_the_prompt_cached(model: Any, mp: pytest.MonkeyPatch,
                                                              step: str, nth: int) -> None:
    prompt = tokens(14, seed=6)
    reference = PrefixCachedLM(model, make_cache(model))
    reference.prefill(prompt)
    expected = counts(reference.cache)                        # the prompt's 3 full pages, nothing held

    lm = PrefixCachedLM(model, make_cache(model))
    inject = Inject(mp, lm, step, nth)
    with pytest.raises(Injected):
        lm.generate(prompt, 8)
    inject.remove()
    lm.cache.check()
    assert counts(lm.cache) == expected
    out = lm.generate(prompt, 8)                               # works afterwards; the answer is cached too
    assert lm.cache.stats()["cached_tokens"] == (len(prompt) + len(out) - 1) // PAGE * PAGE
    exact(lm, np.concatenate([prompt, out, tokens(2, seed=7)]))


@pytest.mark.parametrize("step", ["open", "alloc", "layer_kv", "scatter_pages", "extend"])
def test_a_failing_cache_sequence_leaves_every_page_where_it_was(model: Any, mp: pytest.MonkeyPatch, step: str) -> None:
    lm = PrefixCachedLM(model, make_cache(model))
    ids = tokens(21, seed=8)
    result = lm.prefill(ids[:6])
    lm.forward(torch.as_tensor(ids[6:]), result.model_cache, start=6)
    before = counts(lm.cache)
    inject = Inject(mp, lm, step)
    with pytest.raises(Injected):
        lm.cache_sequence(ids, result.model_cache)
    inject.remove()
    lm.cache.check()
    assert counts(lm.cache) == before
    assert lm.cache_sequence(ids, result.model_cache) == 16
    exact(lm, np.concatenate([ids, tokens(2, seed=9)]))
