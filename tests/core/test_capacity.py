"""More capacity never fewer hits, as a property of the default configuration.

Hypothesis draws a workload from radixkv's own generators (chat with 1-32 system prompts of
256-4,096 tokens, RAG over 10-500 documents, few-shot with 1-16 tasks; 200-600 requests) and two
neighbouring pool sizes from the smallest that holds its longest request up to 64K tokens; over a
16K-token CPU tier, exclusive LRU (the default), either write policy: the hit rate is at most one
point below the pool alone's, and falls by at most one point when the pool doubles.  Each example
costs three replays, so CI runs a few (a tenth of the profile's examples, at least 4);
``HYPOTHESIS_PROFILE=thorough`` runs a hundred, and ``python -m radixkv.bench capacity`` searches
every documented mode (the modes that can fail, and why, are in its docstring and the README).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.bench.capacity import DEFAULT_MODES, TOLERANCE, Workload, check_case, pools_for

pytestmark = pytest.mark.slow      # a replay per drawn workload and capacity: `pytest -m "not slow"` leaves it out

_PROFILE = settings()
EXAMPLES = max(4, _PROFILE.max_examples // 10)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Workload, int, str]:
    kind = draw(st.sampled_from(["chat", "rag", "few-shot"]))
    requests, seed = draw(st.integers(200, 600)), draw(st.integers(0, 10_000))
    if kind == "chat":
        workload = Workload(kind, requests, seed, prompts=draw(st.integers(1, 32)),
                            prompt_tokens=draw(st.sampled_from([256, 512, 1024, 2048, 4096])),
                            turns=draw(st.integers(2, 60)))
    else:
        workload = Workload(kind, requests, seed,
                            prompts=draw(st.integers(10, 500) if kind == "rag" else st.integers(1, 16)))
    return workload, draw(st.integers(0, 5)), draw(st.sampled_from(DEFAULT_MODES))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_cpu_tier_never_costs_hits_and_a_bigger_pool_never_loses_them(case: tuple[Workload, int, str]) -> None:
    workload, pick, mode = case
    requests = workload.make()
    pools = pools_for(requests)
    if len(pools) < 2:
        return
    i = pick % (len(pools) - 1)
    result = check_case(requests, pools[i], pools[i + 1], mode)
    assert result.below <= TOLERANCE, f"{workload} {mode}: {result}: the CPU tier costs hits"
    assert result.fall <= TOLERANCE, f"{workload} {mode}: {result}: a bigger pool loses hits"
