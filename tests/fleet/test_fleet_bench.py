"""``python -m radixkv.bench fleet``'s arguments and its workload's reuse bound (the runs themselves
start vLLM: they are the committed benchmark, not a test)."""

from __future__ import annotations

import argparse

import pytest

from radixkv.bench import fleet


def test_routers_and_seeds_parse_and_bad_items_are_named() -> None:
    args = fleet._parser().parse_args(["--routers", "radixkv:cost,sglang:cache_aware_low,sglang:round_robin",
                                       "--seed", "0,1,2"])
    assert [r.name for r in args.routers] == ["radixkv:cost", "sglang:cache_aware_low", "sglang:round_robin"]
    assert args.seed == [0, 1, 2]
    plain = fleet._parser().parse_args([])
    assert plain.routers is None and plain.seed == [0] and plain.policies == ",".join(fleet.POLICIES)
    for bad in ("cost", "sglang:cost", "radixkv:cache_aware_low", "vllm:round_robin"):
        with pytest.raises(argparse.ArgumentTypeError, match="KIND:POLICY"):
            fleet.parse_routers(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="--seed"):
        fleet.parse_seeds("0,x")


def test_the_reuse_bound_counts_whole_shared_blocks_once_seen() -> None:
    a, b = list(range(1, 9)), list(range(11, 19))
    work = [(0.0, a + [100]), (0.1, a + [101]), (0.2, b), (0.3, a[:4] + [102])]
    # blocks of 4: the second prompt shares 8 tokens, the third none, the fourth 4
    assert fleet.reuse_bound(work, block=4) == pytest.approx((8 + 0 + 4) / (9 + 9 + 8 + 5))
    assert fleet.reuse_bound([(0.0, a), (0.1, a)], block=4) == pytest.approx(4 / 16), "never the last block"
