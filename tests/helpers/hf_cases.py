"""Shared checks of the Hugging Face adapter's tests (``tests/integrations/test_transformers.py``,
``tests/integrations/test_hybrid.py``): a reused prefix must give the logits of one plain forward."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixkv.integrations.transformers import PrefixCachedLM, Result

# fp32: max |logits with reused KV - one plain forward|, relative to the forward's largest |logit|
# (a random Cohere2's logits are ~0.04, a Llama's ~0.6: rounding error scales with them).  Reused
# KV and a plain forward run kernels of other shapes, which round differently on other CPUs, so
# this is a tolerance, never bit equality; the control tests (``assert_tolerance_catches_wrong_kv``)
# show that wrong KV is at least 100x past it.
TOL = 1e-4


def rel_diff(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Max |logits - reference| relative to max |reference| (the scale of ``TOL``)."""
    scale = max(float(reference.abs().max()), 1e-30)
    return float((logits - reference).abs().max()) / scale


def full_logits(model: Any, ids: np.ndarray) -> torch.Tensor:
    """The logits of one plain forward over ``ids``, ``[len(ids), vocab]``."""
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids).long()[None]).logits[0]


def prefill_exact(lm: PrefixCachedLM, ids: np.ndarray) -> Result:
    """``lm.prefill(ids)``, asserting that its logits equal one plain forward's at every computed
    position and that the cache's invariants hold."""
    result = lm.prefill(ids, logits_to_keep=0)
    reference = full_logits(lm.model, ids)[result.match_tokens:]
    assert result.logits.shape == reference.shape
    diff = rel_diff(result.logits, reference)
    assert diff <= TOL, f"max |logits - full forward| = {diff} with {result.match_tokens} tokens reused"
    lm.cache.check()
    return result


# The control of TOL: KV made wrong on purpose, as a bug in the cache would make it.
WRONG_KV = ("another prefix", "shifted by a page", "layer 0 zeroed")


def wrong_kv_diff(lm: PrefixCachedLM, ids: np.ndarray, n: int, mode: str, page: int = 4) -> float:
    """``rel_diff`` of the logits of ``ids[n:]`` over wrong KV for ``ids[:n]`` and one plain forward's, where the
    wrong KV is: ``"another prefix"`` (the KV of other tokens of the same length), ``"shifted by a
    page"`` (the right KV, each page of it read from the page before, as a block table off by one
    reads it: the first page twice, the last one lost; a rotation of every token would not do, since
    attention over all of them does not depend on their order), or ``"layer 0 zeroed"``.  A check with tolerance ``TOL`` tells right KV from wrong only if this
    is far above it (the control tests require 100x)."""
    from radixkv.integrations.transformers import layer_kv

    ids = np.asarray(ids)
    prefix = ids[:n]
    if mode == "another prefix":
        prefix = (prefix + 1) % int(lm.model.config.vocab_size)
    model_cache = lm.new_model_cache()
    lm.forward(torch.as_tensor(prefix).long(), model_cache, start=0)
    for layer in range(int(lm.cache.layout.num_layers)):
        for side in layer_kv(model_cache, layer):
            if mode == "shifted by a page":
                side[..., page:, :] = side[..., :-page, :].clone()
            elif mode == "layer 0 zeroed" and layer == 0:
                side.zero_()
    logits = lm.forward(torch.as_tensor(ids[n:]).long(), model_cache, start=n, logits_to_keep=0)
    return rel_diff(logits, full_logits(lm.model, ids)[n:])


def assert_tolerance_catches_wrong_kv(lm: PrefixCachedLM, ids: np.ndarray, n: int, page: int = 4) -> None:
    """Every kind of wrong KV moves the logits by at least 100x ``TOL``."""
    for mode in WRONG_KV:
        diff = wrong_kv_diff(lm, ids, n, mode, page)
        assert diff >= 100 * TOL, f"{mode}: wrong KV moved the logits by only {diff:.2e} (TOL {TOL})"
