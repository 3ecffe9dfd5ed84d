"""KV groups through the tiers: sliding-window and MLA models served exactly from the CPU tier
after the pool is emptied, and from LMDB in a restarted process.

Each sliding group's chunks are stored under keys of its own namespace (``Namespace.bind(layout,
group)``) and only inside windows; a tier load finds the longest chunk boundary whose windows the
pool or the tiers hold.  Logits are checked at every computed position against one plain forward
(fp32, <= 1e-4); page size 4, chunk 8, window 8, so that every edge is a few tokens away.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from radixkv import PrefixCache  # noqa: E402
from radixkv.backends import CpuTier, MemoryTier  # noqa: E402
from radixkv.integrations.transformers import PrefixCachedLM, layout_for, namespace_for, random_model  # noqa: E402
from hf_cases import TOL, assert_tolerance_catches_wrong_kv, rel_diff  # noqa: E402
PAGE, CHUNK, WINDOW, VOCAB = 4, 8, 8, 256
FAMILIES = ("gemma2", "gemma3", "mistral", "cohere2", "qwen2", "deepseek_v3")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]   # slow: Hugging Face models through LMDB, restarted processes


def build(family: str) -> Any:
    window = None if family == "deepseek_v3" else WINDOW
    return random_model(family, seed=0, num_layers=4, num_kv_heads=2, vocab_size=VOCAB, sliding_window=window)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> Any:
    return build(request.param)


def make_cache(model: Any, tiers: Any) -> PrefixCache:
    return PrefixCache(layout_for(model, page_size=PAGE), num_pages=128, chunk_size=CHUNK,
                       namespace=namespace_for(model), tiers=tiers)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def diff(model: Any, result: Any, ids: np.ndarray) -> float:
    with torch.no_grad():
        full = model(input_ids=torch.from_numpy(ids).long()[None]).logits[0]
    return rel_diff(result.logits, full[result.match_tokens:])


def test_the_tolerance_tells_right_kv_from_wrong(model: Any) -> None:
    """The control of ``TOL`` (sliding families and MLA): wrong KV for the prefix moves the logits
    after it by over 100x ``TOL``."""
    assert_tolerance_catches_wrong_kv(PrefixCachedLM(model, make_cache(model, ())), tokens(45, seed=40), 32,
                                      page=PAGE)


def test_from_the_cpu_tier_after_the_pool_is_emptied(model: Any) -> None:
    cache = make_cache(model, [CpuTier(max_bytes=1 << 22)])
    lm = PrefixCachedLM(model, cache)
    prompt = tokens(37, seed=1)                    # ends mid-page and mid-chunk
    lm.prefill(prompt)
    cache.check()
    cache.evict(10**6)                             # the pool is empty: the chunks went to the CPU tier
    cache.flush()
    assert cache.stats()["pages_cached"] == 0
    follow = np.concatenate([prompt, tokens(6, seed=2)])
    result = lm.prefill(follow, logits_to_keep=0)
    cache.check()
    assert result.match_tokens == 32 and result.levels == {"cpu": 32}
    assert diff(model, result, follow) <= TOL
    cache.close()


def test_a_branch_point_is_served_from_the_tiers(model: Any) -> None:
    """Two requests share a system prompt and diverge: the branch keeps the system prompt's window,
    which is stored; after the pool is emptied a third request loads the system prompt's chunks.
    (The prompt ends on a chunk boundary: a branch inside a chunk is served from the tiers only
    where the pool still held the chunk's window pages when the branch appeared.)"""
    cache = make_cache(model, [MemoryTier()])
    lm = PrefixCachedLM(model, cache)
    system = tokens(40, seed=3)
    for seed in (4, 5):
        lm.prefill(np.concatenate([system, tokens(9, seed=seed)]))
        cache.check()
    cache.evict(10**6)
    cache.flush()
    third = np.concatenate([system, tokens(9, seed=6)])
    result = lm.prefill(third, logits_to_keep=0)
    cache.check()
    assert result.match_tokens == 40 and result.tier_tokens == 40
    assert diff(model, result, third) <= TOL
    cache.close()


def test_every_chunk_of_every_group_is_stored_under_its_groups_keys_and_the_pool_keeps_a_window() -> None:
    """A sliding page that leaves every window is stored before the pool lets it go: the tier has
    every chunk of both groups, while the sliding pool holds only the window's pages."""
    model = build("gemma3")
    tier = MemoryTier()
    cache = make_cache(model, [tier])
    lm = PrefixCachedLM(model, cache)
    prompt = tokens(200, seed=7)                   # 25 chunks; the window is one chunk
    lm.prefill(prompt)
    cache.flush()
    full_stack, sliding_stack = cache.stacks
    assert full_stack.namespace.id != sliding_stack.namespace.id
    assert sliding_stack.namespace.kv_group == "w=8;layers=0,1,2"
    stored = tier.stats()["entries"]
    assert stored == 25 + 25       # every chunk of each group
    assert cache.groups is not None and cache.groups.held_pages() == [sum(cache.groups.keep)]
    cache.check()
    cache.close()


SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np, torch
    torch.set_num_threads(1)
    from radixkv import PrefixCache
    from radixkv.backends.lmdb import LmdbTier
    from radixkv.integrations.transformers import PrefixCachedLM, layout_for, namespace_for, random_model
    root, phase, families = sys.argv[1], sys.argv[2], sys.argv[3:]
    results = {}
    for family in families:
        window = None if family == "deepseek_v3" else 8
        model = random_model(family, seed=0, num_layers=4, num_kv_heads=2, vocab_size=256, sliding_window=window)
        cache = PrefixCache(layout_for(model, page_size=4), num_pages=128, chunk_size=8, namespace=namespace_for(model),
                            tiers=[LmdbTier(os.path.join(root, family), max_bytes=1 << 26)])
        lm = PrefixCachedLM(model, cache)
        prompt = np.random.default_rng(8).integers(0, 256, 45)
        ids = prompt if phase == "write" else np.concatenate([prompt, np.random.default_rng(9).integers(0, 256, 5)])
        result = lm.prefill(ids, logits_to_keep=0)
        cache.check()
        with torch.no_grad():
            full = model(input_ids=torch.from_numpy(ids).long()[None]).logits[0]
        cache.close()
        results[family] = {"match": result.match_tokens, "levels": result.levels,
                           "diff": float((result.logits - full[result.match_tokens:]).abs().max())
                                   / float(full[result.match_tokens:].abs().max())}   # as hf_cases.rel_diff
    print(json.dumps(results))
""")

RESTART_FAMILIES = ("gemma3", "mistral", "deepseek_v3")


def run_phase(script: str, tmp_path: Path, phase: str, families: tuple[str, ...]) -> dict[str, Any]:
    """Run ``script`` (a phase of a test in a process of its own: a restart) with ``tmp_path``, the
    phase name and the families; the JSON it prints last."""
    path = tmp_path / "phase.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path), str(tmp_path), phase, *families],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])   # type: ignore[no-any-return]


def test_from_lmdb_in_a_restarted_process(tmp_path: Path) -> None:
    """Gemma-3 (hybrid), Mistral (every layer sliding) and DeepSeek-V3 (MLA): one process caches a
    45-token prompt in LMDB and exits; a new process serves its 40 tokens of whole chunks, exactly."""
    pytest.importorskip("lmdb")
    wrote = run_phase(SCRIPT, tmp_path, "write", RESTART_FAMILIES)
    read = run_phase(SCRIPT, tmp_path, "read", RESTART_FAMILIES)
    for family in RESTART_FAMILIES:
        assert wrote[family]["match"] == 0 and wrote[family]["diff"] <= TOL, (family, wrote[family])
        assert read[family]["match"] == 40 and read[family]["levels"] == {"lmdb": 40}, (family, read[family])
        assert read[family]["diff"] <= TOL, (family, read[family])


def test_from_s3_in_a_second_cache() -> None:
    """Gemma-3's groups through a real S3 server (moto's, on loopback): one cache stores, a second
    cache on the same bucket (another instance) serves the prefix exactly, each group's chunks
    under its own keys."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    from radixkv.backends.s3 import S3Tier
    from radixkv.tools.s3server import CREDENTIALS, MotoServer

    model = build("gemma3")
    prompt = tokens(45, seed=10)
    follow = np.concatenate([prompt, tokens(5, seed=11)])
    with pytest.MonkeyPatch.context() as mp:
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        with MotoServer() as server:
            server.client().create_bucket(Bucket="radixkv-hybrid")
            with make_cache(model, [S3Tier("radixkv-hybrid", "kv", endpoint_url=server.endpoint_url)]) as cache:
                PrefixCachedLM(model, cache).prefill(prompt)
                cache.flush()
            with make_cache(model, [S3Tier("radixkv-hybrid", "kv", endpoint_url=server.endpoint_url)]) as cache:
                result = PrefixCachedLM(model, cache).prefill(follow, logits_to_keep=0)
                cache.check()
    assert result.match_tokens == 40 and result.levels == {"s3": 40}
    assert diff(model, result, follow) <= TOL


BRANCH_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np, torch
    torch.set_num_threads(1)
    from radixkv import PrefixCache
    from radixkv.backends import CpuTier
    from radixkv.backends.lmdb import LmdbTier
    from radixkv.integrations.transformers import PrefixCachedLM, layout_for, namespace_for, random_model
    root, phase, families = sys.argv[1], sys.argv[2], sys.argv[3:]
    prefix = np.random.default_rng(20).integers(0, 256, 176)     # not a chunk multiple
    def ask(seed):
        return np.concatenate([prefix, np.random.default_rng(seed).integers(0, 256, 20)])
    out = {}
    for family in families:
        model = random_model(family, seed=0, num_layers=4, num_kv_heads=2, vocab_size=256,
                             sliding_window=None if family == "deepseek_v3" else 48)
        tiers = [LmdbTier(os.path.join(root, family), max_bytes=1 << 27)]
        if phase == "write":
            tiers.insert(0, CpuTier(1 << 26))
        cache = PrefixCache(layout_for(model, page_size=16), num_pages=64, chunk_size=32,
                            namespace=namespace_for(model), tiers=tiers)
        lm = PrefixCachedLM(model, cache)
        rows = []
        steps = [1, 2, "empty", 3] if phase == "write" else [4]
        for step in steps:
            if step == "empty":           # the whole pool goes; the tiers keep what it let go
                cache.flush(); cache.evict(cache.pool.num_pages); cache.flush()
                continue
            ids = ask(step)
            r = lm.prefill(ids, logits_to_keep=0)
            with torch.no_grad():
                full = model(input_ids=torch.from_numpy(ids).long()[None]).logits[0, r.match_tokens:]
            rows.append({"match": r.match_tokens, "levels": r.levels,
                         "diff": float((r.logits - full).abs().max()) / float(full.abs().max())})
            cache.check()
        cache.close()
        out[family] = rows
    print(json.dumps(out))
""")

BRANCH_FAMILIES = ("mistral", "gemma2", "gemma3", "qwen2", "cohere2", "deepseek_v3")


def test_a_branch_point_found_late_is_served_from_the_cpu_tier_and_from_lmdb_after_a_restart(tmp_path: Path) -> None:
    """The prefix becomes a reuse point only with the second request, after the first one's window
    moved past it; a sliding page leaving every window went to the tiers first, so after the pool
    is emptied the third request gets the prefix's whole chunks (160 tokens) from the CPU tier, and
    a restarted process from LMDB, exactly, in every sliding family (and MLA)."""
    pytest.importorskip("lmdb")
    wrote = run_phase(BRANCH_SCRIPT, tmp_path, "write", BRANCH_FAMILIES)
    read = run_phase(BRANCH_SCRIPT, tmp_path, "read", BRANCH_FAMILIES)
    for family in BRANCH_FAMILIES:
        first, second, third = wrote[family]
        assert first["match"] == 0 and second["match"] == 176, (family, wrote[family])
        assert third["match"] >= 160 and third["levels"].get("cpu", 0) >= 160, (family, third)
        (restarted,) = read[family]
        assert restarted["match"] == 160 and restarted["levels"] == {"lmdb": 160}, (family, restarted)
        assert all(row["diff"] <= TOL for row in [*wrote[family], restarted]), (family, wrote[family], restarted)
