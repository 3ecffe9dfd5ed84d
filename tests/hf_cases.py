"""Shared checks of the Hugging Face adapter's tests (``tests/test_transformers.py``,
``tests/test_hybrid.py``): a reused prefix must give the logits of one plain forward."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixkv.integrations.transformers import PrefixCachedLM, Result

TOL = 1e-4      # fp32: max |logits with reused KV - one plain forward|


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
    diff = (result.logits - reference).abs().max().item()
    assert diff <= TOL, f"max |logits - full forward| = {diff} with {result.match_tokens} tokens reused"
    lm.cache.check()
    return result
