"""One deadline from the configuration: ``remote_timeout`` bounds a request's lookup and load on
every remote tier, whoever builds the cache.  An S3 or Redis server that is alive but stopped
(SIGSTOP: its socket accepts, nothing answers) costs a request at most ``remote_timeout`` through
``radixkv.from_config``, and at most that per lookup through the stack the vLLM connector builds
from its ``kv_connector_extra_config`` (whose request wait, ``radixkv_timeout_s``, is longer): the
old behaviour was the cache's own 5 s load timeout.  The bound is the point of the feature, so it
is asserted, with a wide margin for a loaded machine."""

from __future__ import annotations

import os
import signal
import time
import uuid
from contextlib import ExitStack
from typing import Any

import pytest
import torch

import radixkv as rk
from radixkv.tools.s3server import CREDENTIALS, MotoServer

pytestmark = pytest.mark.slow      # S3 and Redis servers, stopped: `pytest -m "not slow"` leaves it out

REMOTE_TIMEOUT = 0.6
MARGIN = 2.5          # far below the 5 s a request waited before; far above scheduling noise
LAYOUT = rk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=16)
TOKENS = list(range(1, 16 * 8 + 2))     # 8 pages, 4 chunks of 32 tokens, and one token to compute


def _redis_available() -> bool:
    from radixkv.tools.redisserver import redis_server_binary

    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return redis_server_binary() is not None


@pytest.fixture(params=["s3", "redis"])
def stopped(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """(configuration keys of a remote tier, a function that stops its server)."""
    with ExitStack() as stack:
        if request.param == "s3":
            for k, v in CREDENTIALS.items():
                monkeypatch.setenv(k, v)
            server: Any = stack.enter_context(MotoServer())
            bucket = f"deadline-{uuid.uuid4().hex[:8]}"
            server.client().create_bucket(Bucket=bucket)
            keys = {"remote_url": f"s3://{bucket}/kv", "remote_endpoint": server.endpoint_url}
        else:
            if not _redis_available():
                pytest.skip("redis-py or redis-server is not installed")
            from radixkv.tools.redisserver import RedisServer

            server = stack.enter_context(RedisServer())
            keys = {"remote_url": server.url}
        paused: list[bool] = []

        def stop() -> None:
            os.kill(server.process.pid, signal.SIGSTOP)
            paused.append(True)

        try:
            yield keys, stop
        finally:
            if paused:
                os.kill(server.process.pid, signal.SIGCONT)


def _config(remote: dict[str, Any]) -> dict[str, Any]:
    return {"chunk_size": 32, "page_size": 16, "num_pages": 64, "namespace": {"model": "deadline"},
            "remote_timeout": REMOTE_TIMEOUT, **remote}


def test_a_stopped_remote_tier_costs_a_request_at_most_remote_timeout(stopped: Any) -> None:
    remote, stop = stopped
    with rk.from_config(_config(remote), LAYOUT) as cache:
        req = cache.open(TOKENS)
        new = cache.alloc(9 - len(req.page_ids))
        req.extend(TOKENS, new[:8 - len(req.page_ids)])        # write_through: the chunks go to the remote tier
        req.release()
        cache.free(new[8:])
        assert cache.flush(30)
        cache.evict(cache.pool.num_pages)
        req = cache.open(TOKENS)                                  # served by the remote tier while it answers
        assert req.tier_tokens == 128, req
        req.release()
        cache.evict(cache.pool.num_pages)
        stop()
        t0 = time.monotonic()
        req = cache.open(TOKENS)                                  # waits for the stopped server ...
        took = time.monotonic() - t0
        req.release()
        assert req.tier_tokens == 0                               # ... a miss ...
        assert took < REMOTE_TIMEOUT + MARGIN, f"a stopped remote tier held a request {took:.2f} s"   # ... soon
        cache.check()


def test_the_vllm_connectors_stack_bounds_each_lookup_by_remote_timeout(stopped: Any) -> None:
    from radixkv.integrations.vllm import connector_config

    remote, stop = stopped
    keys = {k: v for k, v in _config(remote).items() if k not in ("page_size", "num_pages")}   # vLLM's pool
    cfg, wait_s = connector_config({"radixkv_config": keys, "radixkv_timeout_s": 10.0}, block_size=16,
                                   model="deadline")
    assert wait_s == 10.0 and cfg.remote_timeout == REMOTE_TIMEOUT
    stack = cfg.make_stack(LAYOUT, cfg.make_namespace().bind(LAYOUT), exclusive=False)   # as the connector does
    assert stack is not None
    try:
        refs = stack.refs(TOKENS[:128])
        assert stack.store([(r, torch.ones(stack.shape, dtype=LAYOUT.dtype)) for r in refs]) == 4
        assert stack.flush(30)
        assert len(stack.lookup([r.key for r in refs], deadline=time.monotonic() + wait_s)) == 4
        stop()
        t0 = time.monotonic()
        found = stack.lookup([r.key for r in refs], deadline=time.monotonic() + wait_s)   # the worker's deadline
        loaded = stack.load(refs, deadline=time.monotonic() + wait_s)
        took = time.monotonic() - t0
        assert found == [] and loaded == []
        assert took < 2 * REMOTE_TIMEOUT + MARGIN, f"a stopped remote tier held the connector {took:.2f} s"
    finally:
        stack.close(1)
