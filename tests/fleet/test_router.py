"""The router: its choice follows the policy for any loads and holdings (a property), and over HTTP
it proxies streaming and plain requests, retries an instance it cannot reach, answers 503 when
none is left, ends a cut stream with an error event, and counts every request; the follower feeds
it from real event streams (a radixkv cache's) and resets an instance whose gap no replay fills."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
pytest.importorskip("msgspec")

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from radixkv.fleet.events import BlockStored, EventBatch
from radixkv.fleet.follow import Follower
from radixkv.fleet.index import MEDIA, Match
from radixkv.fleet.router import Router, pool_blocks


class FakeFollower:
    def __init__(self, matches: dict[str, Match]) -> None:
        self.matches = matches

    def lookup(self, names: Any) -> dict[str, Match]:
        return dict(self.matches)


URLS = ["http://a", "http://b", "http://c"]


@settings(max_examples=300, deadline=None)
@given(loads=st.lists(st.integers(0, 40), min_size=3, max_size=3),
       held=st.lists(st.one_of(st.none(), st.tuples(st.integers(1, 8), st.sampled_from(MEDIA))), min_size=3, max_size=3),
       healthy=st.lists(st.booleans(), min_size=3, max_size=3))
def test_prefix_policy_picks_what_its_rules_say(loads: list[int], held: list[Any], healthy: list[bool]) -> None:
    matches = {u: Match(*h) for u, h in zip(URLS, held) if h is not None}
    router = Router(URLS, follower=FakeFollower(matches), policy="prefix", balance_abs=16, balance_rel=1.5)
    for b, n, ok in zip(router.backends, loads, healthy):
        b.in_flight, b.healthy = n, ok
    order, why, promised = router.choose(list(range(64)))
    up = [b for b in router.backends if b.healthy] or router.backends
    assert sorted(b.url for b in order) == sorted(b.url for b in up), "every healthy instance, each once"
    first = order[0]
    lo, hi = min(b.in_flight for b in up), max(b.in_flight for b in up)
    if hi - lo > 16 and hi > 1.5 * lo:
        assert why == "balance" and first.in_flight == lo
    elif not any(b.url in matches for b in up):
        assert why == "no_match" and first.in_flight == lo and promised == 0
    else:
        assert why == "prefix"
        best = max(matches[b.url].blocks for b in up if b.url in matches)
        assert matches[first.url].blocks == best and promised == min(best * router.block_size, 64)   # never past the prompt
        ties = [b for b in up if b.url in matches and matches[b.url].blocks == best]
        fastest = min(MEDIA.index(matches[b.url].medium) for b in ties)
        assert MEDIA.index(matches[first.url].medium) == fastest
        assert first.in_flight == min(b.in_flight for b in ties if MEDIA.index(matches[b.url].medium) == fastest)
    assert [b.in_flight for b in order[1:]] == sorted(b.in_flight for b in order[1:]), "then by load"
    router.check()


def test_the_router_runs_the_chooser_of_its_policy_with_its_index() -> None:
    """``Router.choose`` is ``radixkv.fleet.routing.Chooser.choose`` over the router's backends and
    follower (the rules themselves: tests/fleet/test_routing.py)."""
    matches = {URLS[1]: Match(4, "CPU")}
    router = Router(URLS, follower=FakeFollower(matches), profile="vllm-cpu")
    assert router.policy == "cost" and router.chooser.lookup is not None
    order, why, promised = router.choose(list(range(64)))
    assert why == "cost" and order[0].url == URLS[1] and promised == 64
    router.backends[1].queued_tokens, router.backends[1].in_flight = 100_000, 1
    assert router.choose(list(range(64)))[0][0].url != URLS[1], "a long queue outweighs a 64-token prefix"
    with pytest.raises(ValueError, match="profile"):
        Router(URLS, profile="tpu")


def test_a_lora_request_is_named_with_its_adapter_and_routes_by_its_own_prefix() -> None:
    """A request whose model is a served LoRA adapter gets vLLM's LoRA key in every block: its
    names differ from the base model's and are what an instance serving it publishes."""
    from radixkv.fleet.hashing import request_extra_keys, vllm_block_hashes

    seen: list[list[Any]] = []

    class Recording(FakeFollower):
        def lookup(self, names: Any) -> dict[str, Match]:
            seen.append(list(names))
            return {}

    router = Router(URLS, follower=Recording({}), lora_modules={"sql": "/adapters/sql"})
    tokens = list(range(64))
    router.choose(tokens, model="base-model")
    router.choose(tokens, model="sql")
    base, lora = seen
    assert base == router.names(tokens, None) and lora != base
    assert lora == vllm_block_hashes(tokens, 16, extra_keys=request_extra_keys(4, None, ("sql", "/adapters/sql")),
                                     algo="sha256", as_int=True)


def test_round_robin_and_random_cover_every_instance() -> None:
    rr = Router(URLS, policy="round_robin")
    assert [rr.choose([1])[0][0].url for _ in range(6)] == URLS * 2
    rnd = Router(URLS, policy="random", seed=1)
    assert {rnd.choose([1])[0][0].url for _ in range(50)} == set(URLS)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="backends"):
        Router([])
    with pytest.raises(ValueError, match="policy"):
        Router(URLS, policy="fastest")
    with pytest.raises(ValueError, match="block_size"):
        Router(URLS, block_size=0)
    with pytest.raises(ValueError, match="twice"):
        Router(["http://a", "http://a/"])
    for url in ("a:8000", "ftp://a", "http://", "127.0.0.1"):
        with pytest.raises(ValueError, match="backends"):
            Router([url])
    with pytest.raises(ValueError, match="hash_algo"):
        Router(URLS, hash_algo="md5")
    for abs_, rel in ((-1, 1.5), (2, 0.5), (2, float("nan")), (2, float("inf")), (True, 1.5)):
        with pytest.raises(ValueError, match="balance_"):
            Router(URLS, balance_abs=abs_, balance_rel=rel)  # type: ignore[arg-type]
    for step in (0, -1, True, 2048.0, "2048"):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            Router(URLS, max_num_batched_tokens=step)  # type: ignore[arg-type]


def test_the_engine_step_given_is_the_one_the_cost_policy_counts_decode_steps_by() -> None:
    """``--max-num-batched-tokens`` reaches the chooser, and decides: both instances have 16,384
    prompt tokens queued; ``a`` holds the 32-token prompt but decodes 94 sequences, ``b`` 71.  With
    2,048-token steps the queue takes 8 steps on ``a`` and 9 on ``b``, each of ``a``'s 3.9 ms
    longer: ``b`` gives the first token sooner despite computing the prompt.  With 8,192-token steps
    it takes 2 and 3, and ``a`` does."""
    from radixkv.fleet.router import add_arguments, build

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert build(ap.parse_args(["--backend", URLS[0]])).chooser.budget == 2048
    firsts = []
    for step in (2048, 8192):
        router = build(ap.parse_args(["--backend", "http://a", "--backend", "http://b", "--cost-profile", "vllm-cpu",
                                      "--affinity", "1", "--max-num-batched-tokens", str(step)]))
        assert router.chooser.budget == step
        router.chooser.lookup = FakeFollower({"http://a": Match(2, "GPU")}).lookup
        for b, in_flight in zip(router.backends, (95, 72)):
            b.in_flight, b.waiting, b.queued_tokens, b.active_tokens = in_flight, 1, 16384, 16384
        order, why, _ = router.choose(list(range(32)))
        assert why == "cost"
        firsts.append(order[0].url)
    assert firsts == ["http://b", "http://a"]


def test_a_refused_command_line_leaves_no_follower_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """``radixkv route`` with KV events and a bad value: the follower it had started is closed, and
    a 0 given for the vocabulary or the context is refused, not read as "not given"."""
    import radixkv.fleet.follow as follow
    from radixkv.fleet.router import add_arguments, build

    made: list[Any] = []

    class Follower:
        def __init__(self) -> None:
            self.closed = False
            made.append(self)

        def add(self, *args: Any, **kwargs: Any) -> None:
            pass

        def start(self) -> None:
            pass

        def lookup(self, names: Any) -> dict[str, Any]:
            return {}

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(follow, "Follower", Follower)
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    for bad, says in ((["--hash-algo", "md5"], "hash_algo"), (["--vocab-size", "0"], "vocab_size"),
                      (["--max-model-len", "0"], "max_model_len"), (["--balance-rel", "0"], "balance_rel"),
                      (["--max-num-batched-tokens", "0"], "max_num_batched_tokens")):
        args = ap.parse_args(["--backend", URLS[0], "--events", "tcp://127.0.0.1:5999", *bad])
        with pytest.raises(ValueError, match=says):
            build(args)
        assert made[-1].closed, bad


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def fake_backend(name: str, *, cut: bool = False, drop: bool = False, delay_s: float = 0.0,
                 metrics: str | None = None, up: dict[str, bool] | None = None,
                 asked: Counter[str] | None = None, gap_s: float = 0.0) -> web.Application:
    """An OpenAI-like instance: answers with its name (after ``delay_s``); a stream of three events
    ``gap_s`` apart (``cut``: the connection drops after the first; ``drop``: it drops before answering, health
    checks pass); ``metrics``: its ``GET /metrics`` text; ``up[name]`` false: its health check
    answers 503; ``asked[path]`` counts the GETs of each path."""
    app = web.Application()

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        if asked is not None and request.method == "GET":
            asked[request.path] += 1
        return await handler(request)

    app.middlewares.append(count)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(delay_s)
        if drop:
            request.transport.close()          # type: ignore[union-attr]
            raise ConnectionResetError
        if not body.get("stream"):
            return web.json_response({"backend": name, "choices": [{"text": "x"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(3):
            if i:
                await asyncio.sleep(gap_s)
            await out.write(f"data: {json.dumps({'backend': name, 'i': i})}\n\n".encode())
            if cut:
                request.transport.close()      # type: ignore[union-attr]
                return out
        await out.write(b"data: [DONE]\n\n")
        return out

    async def health(request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if (up or {}).get(name, True) else 503)

    async def metrics_page(request: web.Request) -> web.Response:
        return web.Response(text=metrics or "")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": name}]})

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    if metrics is not None:
        app.router.add_get("/metrics", metrics_page)
    return app


async def _with_router(backends: dict[str, web.Application | None], body: Any, **kw: Any) -> Any:
    servers = {}
    for name, app in backends.items():
        if app is not None:
            servers[name] = TestServer(app, host="127.0.0.1")
            await servers[name].start_server()
    urls = [str(servers[n].make_url("")) if n in servers else dead_url() for n in backends]
    kw.setdefault("policy", "round_robin")
    router = Router(urls, health_interval_s=60, **kw)
    client = TestClient(TestServer(router.app(), host="127.0.0.1"))
    await client.start_server()
    try:
        out = await body(client, router, urls)
        assert all(b.in_flight == 0 and b.queued_tokens == 0 for b in router.backends), "every request ended"
        router.check()
        return out
    finally:
        await client.close()
        for s in servers.values():
            await s.close()


def test_plain_and_streaming_requests_are_proxied_and_counted() -> None:
    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert r.status == 200 and (await r.json())["backend"] == "a"
        assert r.headers["X-Radixkv-Instance"] == "0", "the answer names its instance by position"
        assert r.headers["X-Radixkv-Route"] == "round_robin", "and why it went there"
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "stream": True})
        text = await r.text()
        assert r.status == 200 and text.count("data:") == 4 and '"backend": "b"' in text and text.endswith("[DONE]\n\n")
        assert r.headers["X-Radixkv-Instance"] == "1" and r.headers["X-Radixkv-Route"] == "round_robin"
        r = await client.post("/v1/chat/completions", json={"messages": [], "stream": False})
        assert (await r.json())["backend"] == "a"
        assert (await client.get("/v1/models")).status == 200
        health = await client.get("/health")
        assert health.status == 200 and len((await health.json())["healthy"]) == 2
        metrics = await (await client.get("/metrics")).text()
        assert f'radixkv_router_requests_total{{backend="{urls[0]}",outcome="ok"}} 2.0' in metrics
        assert 'radixkv_router_routed_total{reason="round_robin"} 3.0' in metrics
        r = await client.post("/v1/completions", data=b"not json")
        assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]

    asyncio.run(_with_router({"a": fake_backend("a"), "b": fake_backend("b")}, body))


def test_the_cost_policy_counts_the_queued_tokens_of_requests_in_flight() -> None:
    """A long prompt in flight on one instance: its tokens are queued there, so a short prompt
    goes to the other; every count is back to 0 when both ended."""
    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        long = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": list(range(100))}))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if router.backends[0].in_flight:
                break
        assert [(b.in_flight, b.queued_tokens) for b in router.backends] == [(1, 100), (0, 0)]
        router.check()
        short = await client.post("/v1/completions", json={"prompt": list(range(10))})
        assert (await short.json())["backend"] == "b"
        assert (await (await long).json())["backend"] == "a"

    asyncio.run(_with_router({"a": fake_backend("a", delay_s=0.5), "b": fake_backend("b", delay_s=0.5)}, body,
                             policy="cost"))


def test_a_request_waiting_on_a_busy_instance_moves_to_one_that_fell_free() -> None:
    """Three cold prompts wait on a slow instance while the other is down (more than a step's
    budget, 2,048 tokens, ahead of the last); it comes back, serves a short request, and as that
    ends the router moves the last of the three there (rule 9): the
    client gets that instance's answer, routed ``rebalance``, and nothing of the first; the first
    of the three never moves (it is not the last of two or more), and every count is back to 0."""
    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        a, b = router.backends
        b.healthy = False
        sent = [asyncio.ensure_future(client.post("/v1/completions", json={
            "prompt": list(range(2000 * k, 2000 * k + 1100)), "stream": k % 2 == 0})) for k in range(3)]
        for _ in range(200):
            await asyncio.sleep(0.01)
            if a.waiting == 3:
                break
        assert (a.waiting, b.waiting) == (3, 0)
        b.healthy = True
        short = await client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert (await short.json())["backend"] == "b"
        answers = [await r for r in sent]
        served = [(await r.text(), r.headers["X-Radixkv-Route"]) for r in answers]
        assert all(r.status == 200 for r in answers)
        assert '"backend": "a"' in served[0][0] and served[0][1] == "cost", "the first never moves"
        assert '"backend": "b"' in served[2][0] and served[2][1] == "rebalance", "the last moved"
        assert '"backend": "a"' not in served[2][0], "nothing of the first instance's reached the client"
        moved = sum(1 for _, why in served if why == "rebalance")
        metrics = await (await client.get("/metrics")).text()
        assert f'radixkv_router_requests_total{{backend="{urls[0]}",outcome="rebalanced"}} {moved}.0' in metrics
        assert f'radixkv_router_routed_total{{reason="rebalance"}} {moved}.0' in metrics

    asyncio.run(_with_router({"a": fake_backend("a", delay_s=1.0), "b": fake_backend("b", delay_s=0.05)}, body,
                             policy="cost", rebalance=True))


absent = object()


@settings(max_examples=100, deadline=None)
@given(max_tokens=st.just(absent) | st.none() | st.integers(1, 10**6),
       other=st.just(absent) | st.none() | st.integers(1, 10**6), chat=st.booleans())
def test_a_requests_output_is_its_max_tokens_or_vllms_default(max_tokens: Any, other: Any, chat: bool) -> None:
    """The output the fit rule counts: ``max_tokens``, else ``max_completion_tokens``; a
    completion that names neither, vLLM's 16; a chat completion that names neither, or a request
    that sets one to null, unknown (vLLM then runs to the end of the context)."""
    from radixkv.fleet.router import COMPLETION_MAX_TOKENS, output_tokens

    body: dict[str, Any] = {}
    if max_tokens is not absent:
        body["max_tokens"] = max_tokens
    if other is not absent:
        body["max_completion_tokens"] = other
    named = [v for v in (max_tokens, other) if v is not absent]
    if "max_tokens" in body and isinstance(max_tokens, int):
        want: int | None = max_tokens
    elif "max_tokens" not in body and isinstance(other, int):
        want = other
    elif named or chat:
        want = None
    else:
        want = COMPLETION_MAX_TOKENS
    assert output_tokens(body, chat) == want


def test_a_request_in_flight_holds_the_pages_of_its_max_tokens_in_the_fit_rule() -> None:
    """While a completion of a 100-token prompt and ``max_tokens`` 500 is in flight, the cost
    policy counts the pages it holds alone (its partial last block and its output: 38 of 16
    tokens); a chat completion without ``max_tokens`` counts none; nothing is left when they end."""
    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        for path, request, pages in (("/v1/completions", {"prompt": list(range(100)), "max_tokens": 500}, 38 - 6),
                                     ("/v1/completions", {"prompt": list(range(100))}, 8 - 6),
                                     ("/v1/chat/completions", {"prompt": list(range(100)), "messages": []}, 0)):
            sent = asyncio.ensure_future(client.post(path, json=request))
            for _ in range(100):
                await asyncio.sleep(0.02)
                if router.backends[0].in_flight:
                    break
            assert router.backends[0].in_flight == 1
            assert router.chooser._private.get(router.backends[0].name, 0) == pages, path
            assert (await sent).status == 200
            assert router.chooser._private.get(router.backends[0].name, 0) == 0

    asyncio.run(_with_router({"a": fake_backend("a", delay_s=0.3)}, body, policy="cost", block_size=16))


def test_a_stream_past_its_first_token_is_expected_to_end_and_its_end_shows_the_decode_step() -> None:
    """A streamed completion with ``max_tokens`` 3, past its first token, is among the requests the
    router expects to end (``page_wait``); at its end the time from its first token over its 2
    decode steps is the instance's seconds a step.  A response read whole shows no first token
    before its end, and teaches no step."""
    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        b, chooser = router.backends[0], router.chooser
        sent = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": list(range(40)),
                                                                         "max_tokens": 3, "stream": True}))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if b.in_flight and not b.waiting:
                break
        assert b.decoding == 1 and len(chooser._decodes[b.name]) == 1
        r = await sent
        assert r.status == 200 and "[DONE]" in await r.text()
        assert not chooser._decodes[b.name] and 0.4 / 2 <= chooser._step_s[b.name] <= 5.0 / 2
        del chooser._step_s[b.name]
        r = await client.post("/v1/completions", json={"prompt": list(range(40)), "max_tokens": 3})
        assert r.status == 200 and b.name not in chooser._step_s and not chooser._decodes[b.name]
        chooser.check(router.backends)

    asyncio.run(_with_router({"a": fake_backend("a", gap_s=0.3)}, body, policy="cost", block_size=16))


def test_an_unreachable_instance_is_retried_elsewhere_and_none_left_is_a_503() -> None:
    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        whys = []
        for _ in range(4):            # round robin puts the dead one first every other time
            r = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
            assert r.status == 200 and '"backend": "b"' in await r.text()
            whys.append(r.headers["X-Radixkv-Route"])
        assert whys.count("retry") == 1, f"the answer after a retry says so: {whys}"
        assert router.backends[0].healthy is False
        metrics = await (await client.get("/metrics")).text()
        assert "radixkv_router_retries_total 1.0" in metrics and f'backend="{urls[0]}",outcome="retried"' in metrics
        assert all(b.in_flight == 0 for b in router.backends)
        router.check()

    # health checks pass, the connection drops on the request: retried on b, then left out
    asyncio.run(_with_router({"drops": fake_backend("a", drop=True), "b": fake_backend("b")}, body))

    async def dead_port(client: TestClient, router: Router, urls: list[str]) -> None:
        assert router.backends[0].healthy is False         # the first health check found nothing there
        for _ in range(3):
            r = await client.post("/v1/completions", json={"prompt": [1]})
            assert (await r.json())["backend"] == "b"

    asyncio.run(_with_router({"dead": None, "b": fake_backend("b")}, dead_port))

    async def none_left(client: TestClient, router: Router, urls: list[str]) -> None:
        r = await client.post("/v1/completions", json={"prompt": [1]})
        assert r.status == 503 and (await r.json())["error"]["type"] == "unavailable"
        assert (await client.get("/health")).status == 503

    asyncio.run(_with_router({"x": None, "y": None}, none_left, connect_timeout_s=1.0))


def test_a_stream_cut_after_bytes_went_out_ends_with_an_error_event() -> None:
    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        r = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
        text = await r.text()
        assert '"i": 0' in text and '"type": "upstream_error"' in text and text.endswith("data: [DONE]\n\n")
        metrics = await (await client.get("/metrics")).text()
        assert f'backend="{urls[0]}",outcome="cut"' in metrics

    asyncio.run(_with_router({"a": fake_backend("a", cut=True)}, body))


def stored(hashes: list[int], medium: str = "GPU") -> EventBatch:
    return EventBatch(ts=0.0, events=[BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                                  block_size=16, lora_id=None, medium=medium, lora_name=None)])


class ScriptedSub:
    """A subscription that returns the given (seq, batch) lists, one per recv."""

    def __init__(self, script: list[list[tuple[int, EventBatch]]]) -> None:
        self.script = script

    def recv(self, timeout: float = 0.0) -> list[tuple[int, EventBatch]]:
        return self.script.pop(0) if self.script else []

    def close(self) -> None:
        pass


def test_the_follower_resets_an_instance_whose_gap_no_replay_fills() -> None:
    f = Follower(gap_timeout_s=0.05)
    f._subs["a"] = ScriptedSub([[(0, stored([1, 2]))], [], [(2, stored([3]))]])   # type: ignore[assignment]
    f.poll()
    assert f.lookup([1, 2]) == {"a": Match(2, "GPU")}
    f.poll()                                   # seq 2 after 0: a gap, the instance is stale
    assert f.lookup([1, 2]) == {} and f.index.stale("a")
    import time

    time.sleep(0.06)
    f.poll()
    assert f.gaps_skipped == 1 and not f.index.stale("a")
    assert f.lookup([1, 2]) == {} and f.lookup([3]) == {"a": Match(1, "GPU")}, "a subset of the truth"
    f.check()
    f.remove("a")
    assert f.index.instances() == []
    f.close()


def test_the_follower_counts_each_instances_publisher_restarts() -> None:
    """``Follower.restarts`` is the count its subscription keeps (``Subscriber.restarts``: a
    sequence number below the next expected one; tested in ``test_events.py``), 0 for an
    instance it does not follow; what the router compares between health checks."""
    f = Follower()
    assert f.restarts("a") == 0
    sub = ScriptedSub([[(5, stored([1]))], [(0, stored([2]))]])
    sub.restarts = 0                                         # type: ignore[attr-defined]
    f._subs["a"] = sub                                       # type: ignore[assignment]
    f.poll()
    sub.restarts = 1                                         # type: ignore[attr-defined]  # as its subscriber counts 0 after 5
    f.poll()
    assert f.restarts("a") == 1 and f.lookup([2]) == {"a": Match(1, "GPU")} and f.lookup([1]) == {}
    f.remove("a")
    assert f.restarts("a") == 0
    f.close()


def test_the_follower_follows_two_caches_publishing_over_zmq() -> None:
    import time

    import numpy as np
    import torch

    import radixkv as rk
    from radixkv.fleet.hashing import external_hash
    from radixkv.fleet.publish import publish
    from radixkv.core.hashing import keys_from_token_bytes
    from radixkv.tools.workloads import replay

    layout = rk.KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=2)
    caches = [rk.PrefixCache(layout, num_pages=64, chunk_size=4) for _ in range(2)]
    pubs = [publish(c, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") for c in caches]
    with Follower() as f:
        for name, p in zip("ab", pubs):
            f.add(name, p.publisher.endpoint, replay_endpoint=p.publisher.replay_endpoint)
        f.start()
        time.sleep(0.3)
        replay(caches[0], [list(range(1, 13))])
        replay(caches[1], [list(range(1, 9))])
        names = [external_hash(k) for k in keys_from_token_bytes(np.arange(1, 13, dtype="<i4").tobytes(), 4,
                                                                   caches[0].namespace.root)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and f.lookup(names) != {"a": Match(3, "GPU"), "b": Match(2, "GPU")}:
            time.sleep(0.05)
        assert f.lookup(names) == {"a": Match(3, "GPU"), "b": Match(2, "GPU")}
        f.check()
    for p, c in zip(pubs, caches):
        p.close()
        c.close()


def test_text_and_chat_prompts_are_routed_by_the_tokens_of_the_given_tokenizer(tmp_path: Any) -> None:
    """``--tokenizer``: a completion's text and a chat's messages (through the chat template) are
    tokenized as the instances would, and those tokens are what the index is asked about."""
    import argparse

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from radixkv.fleet import router as route_cmd

    words = ["[UNK]", "<s>", "hello", "world", "user", "assistant", ":", "hi"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"
    fast.save_pretrained(str(tmp_path / "tok"))
    ap = argparse.ArgumentParser()
    route_cmd.add_arguments(ap)
    router = route_cmd.build(ap.parse_args(["--backend", "http://a", "--tokenizer", str(tmp_path / "tok")]))
    assert router._tokens({"prompt": "hello world hi"}, chat=False) == [2, 3, 7]
    assert router._tokens({"prompt": [5, 6]}, chat=False) == [5, 6]
    assert router._tokens({"messages": [{"role": "user", "content": "hi"}]}, chat=True) == [4, 6, 7, 5, 6]
    plain = route_cmd.build(ap.parse_args(["--backend", "http://a"]))
    assert plain._tokens({"prompt": "hello"}, chat=False) is None, "no tokenizer: text is routed as a miss"
    with pytest.raises(ValueError, match="--events"):
        route_cmd.build(ap.parse_args(["--backend", "http://a", "--backend", "http://b", "--events", "tcp://x:1"]))


@given(st.lists(st.one_of(st.integers(-5, 40), st.booleans(), st.floats(allow_nan=False), st.text(max_size=2)),
                max_size=40),
       st.one_of(st.none(), st.integers(-2, 40), st.booleans()))
def test_the_router_refuses_what_an_instance_would_choke_on(prompt: list[Any], max_tokens: Any) -> None:
    """A property: a token-id prompt is forwarded exactly when it is a non-empty list of ints in
    ``[0, vocab_size)``, shorter than the context with room for ``max_tokens``; anything else is
    the router's 400 (or, for a list of strings, the instance's to tokenize)."""
    router = Router(URLS, vocab_size=32, max_model_len=24)
    body: dict[str, Any] = {"prompt": prompt}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    tokens = router._tokens(body, chat=False) if prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt) else None
    problem = router.invalid(body, tokens)
    ints = bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    texts = bool(prompt) and all(isinstance(t, str) for t in prompt)
    good_max = max_tokens is None or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0)
    fits = ints and all(0 <= t < 32 for t in prompt) and len(prompt) < 24 and (
        max_tokens is None or not good_max or len(prompt) + max_tokens <= 24)
    assert (problem is None) == ((ints and fits or texts) and good_max), (prompt, max_tokens, problem)


def test_bad_requests_are_400_and_every_request_is_counted_under_its_outcome() -> None:
    """Out-of-vocabulary ids, an overlong prompt and malformed bodies never reach an instance; an
    instance's 4xx is counted as such, not as ``ok``."""
    app = fake_backend("a")

    async def teapot(request: web.Request) -> web.Response:
        return web.json_response({"error": "no"}, status=418)

    app.router.add_post("/v1/embeddings", teapot)

    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        for bad in ({"prompt": [1, 2, 99]}, {"prompt": [1, -1]}, {"prompt": list(range(30))},
                    {"prompt": [1, 2], "max_tokens": 30}, {"prompt": [1.5]}, {"prompt": []}, [1, 2]):
            r = await client.post("/v1/completions", json=bad)
            assert r.status == 400, (bad, await r.text())
        r = await client.post("/v1/completions", data=b"{not json")
        assert r.status == 400
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status == 200
        router.backends[0].url = urls[0] + "/v1/embeddings#"       # the instance answers 418 from now on
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status == 418
        metrics = await (await client.get("/metrics")).text()
        assert 'radixkv_router_requests_total{backend="none",outcome="http_400"} 8.0' in metrics, metrics
        assert f'radixkv_router_requests_total{{backend="{urls[0]}",outcome="ok"}} 1.0' in metrics, metrics
        assert f'radixkv_router_requests_total{{backend="{urls[0]}",outcome="http_418"}} 1.0' in metrics, metrics

    asyncio.run(_with_router({"a": app}, body, vocab_size=32, max_model_len=24))


def test_the_model_limits_come_from_its_config(tmp_path: Any) -> None:
    from radixkv.fleet.router import model_limits

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512, "max_position_embeddings": 2048}))
    assert model_limits(str(tmp_path)) == (512, 2048)
    assert model_limits(str(tmp_path / "config.json")) == (512, 2048)
    assert model_limits(None) == (None, None) and model_limits(str(tmp_path / "nothing")) == (None, None)
    with pytest.raises(ValueError, match="--model-config"):
        model_limits(str(tmp_path / "nothing"), required=True)
    with pytest.raises(ValueError, match="vocab_size"):
        Router(URLS, vocab_size=0)


@pytest.mark.parametrize("bad, says", [(["--port", "99999"], "--port"), (["--port", "x"], "--port"),
                                       (["--events", "foo"], "--events"), (["--events", "connect:bogus"], "--events"),
                                       (["--hash-algo", "md5"], "hash_algo"), (["--balance-abs", "-1"], "balance_abs")])
def test_radixkv_route_refuses_a_bad_value_in_one_line(bad: list[str], says: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A port out of range and an event endpoint zmq cannot use were tracebacks."""
    from radixkv.tools.cli import main

    assert main(["route", "--backend", URLS[0], *bad]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def vllm_metrics(engines: list[tuple[int, int]]) -> str:
    """vLLM's ``/metrics`` text with one ``vllm:cache_config_info`` sample an engine (pool blocks,
    block size), among other families."""
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{engine="0"} 0.0',
             "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
             "# TYPE vllm:cache_config_info gauge"]
    lines += [f'vllm:cache_config_info{{block_size="{size}",cache_dtype="auto",engine="{i}",'
              f'num_gpu_blocks="{blocks}",num_gpu_blocks_override="None"}} 1.0' for i, (blocks, size) in enumerate(engines)]
    return "\n".join(lines) + "\n"


@settings(max_examples=200, deadline=None)
@given(engines=st.lists(st.tuples(st.integers(1, 1 << 20), st.sampled_from([16, 32, 64, 128, 256])), max_size=4),
       block=st.sampled_from([16, 32, 64, 128, 256]))
def test_an_instance_pool_is_read_from_its_metrics_in_the_routers_blocks(engines: list[tuple[int, int]],
                                                                          block: int) -> None:
    """The smallest engine's pool less vLLM's null block, in the router's blocks (a request runs on
    one engine); no ``cache_config_info`` or a text that is not Prometheus's: unknown."""
    expected = min(((n - 1) * s // block for n, s in engines if n > 1), default=None)
    assert pool_blocks(vllm_metrics(engines), block) == expected
    assert pool_blocks("<html>not found</html>", block) is None
    assert pool_blocks('vllm:cache_config_info{block_size="x",num_gpu_blocks="y"} 1.0\n', block) is None


@settings(max_examples=20, deadline=None)
@given(blocks=st.integers(2, 4096))
def test_the_pool_read_is_what_vllms_block_pool_can_give_requests(blocks: int) -> None:
    """vLLM's own block pool of ``num_gpu_blocks`` has one block fewer free than it was given (its
    null block): the pool the router reads from the metrics is that many, not ``num_gpu_blocks``."""
    from radixkv.fleet.routing import vllm_usable_blocks

    vllm_pool = pytest.importorskip("vllm.v1.core.block_pool")
    pool = vllm_pool.BlockPool(num_gpu_blocks=blocks, enable_caching=True, hash_block_size=16)
    assert pool_blocks(vllm_metrics([(blocks, 16)]), 16) == pool.get_num_free_blocks() == vllm_usable_blocks(blocks)
    assert vllm_usable_blocks(blocks) == blocks - 1


def test_the_router_reads_each_pool_at_its_health_check_and_forgets_it_when_the_instance_goes_down() -> None:
    up = {"a": True}

    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        a, b, c = router.backends
        assert (a.pool_blocks, b.pool_blocks, c.pool_blocks) == (71 * 128 // 16, None, None)
        up["a"] = False
        await router.check_health()
        assert not a.healthy and a.pool_blocks is None, "a pool is forgotten when its instance goes down"
        up["a"] = True
        await router.check_health()
        assert a.healthy and a.pool_blocks == 71 * 128 // 16, "and read again when it is back"
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert r.status == 200
        metrics = await (await client.get("/metrics")).text()
        assert f'radixkv_router_pool_blocks{{backend="{a.name}"}} {71 * 128 // 16}.0' in metrics
        assert f'radixkv_router_pool_blocks{{backend="{b.name}"}} 0.0' in metrics, "unknown: 0"

    asyncio.run(_with_router({"a": fake_backend("a", metrics=vllm_metrics([(72, 128), (80, 128)]), up=up),
                              "b": fake_backend("b"), "c": fake_backend("c", metrics="<html>")}, body, policy="cost"))


def test_an_instance_whose_kv_events_restarted_has_its_pool_read_again() -> None:
    """An engine that came back between two health checks passes both, but its KV-event publisher
    counts from 0 again (the follower's ``restarts``): at the next health check the router
    forgets its pool and reads it again, once; an instance whose events did not restart is not
    asked again."""
    asked: dict[str, Counter[str]] = {n: Counter() for n in "ab"}

    class Follower:
        """What the router asks of a follower: lookups (nothing held) and restarts counted."""

        def __init__(self) -> None:
            self.count: dict[str, int] = {}         # instance (its URL) -> restarts

        def lookup(self, names: Any) -> dict[str, Any]:
            return {}

        def restarts(self, instance: str) -> int:
            return self.count.get(instance, 0)

    follower = Follower()

    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        a = router.backends[0].name
        for _ in range(2):
            await router.check_health()
        assert {n: c["/metrics"] for n, c in asked.items()} == {"a": 1, "b": 1}
        follower.count[a] = 1                          # a came back between two checks
        await router.check_health()
        await router.check_health()
        assert {n: c["/metrics"] for n, c in asked.items()} == {"a": 2, "b": 1}, "a read again, once"
        assert [b.pool_blocks for b in router.backends] == [71 * 128 // 16] * 2
        router.check()

    asyncio.run(_with_router({"a": fake_backend("a", metrics=vllm_metrics([(72, 128)]), asked=asked["a"]),
                              "b": fake_backend("b", metrics=vllm_metrics([(72, 128)]), asked=asked["b"])},
                             body, policy="cost", follower=follower))


def test_an_instance_that_answers_without_a_pool_is_not_asked_again_until_it_has_been_down() -> None:
    """A pool is read once an up-period: an instance that answered ``GET /metrics`` without one
    (a 404, a page that is not vLLM's) is asked again only after it has been down; one whose
    metrics failed (a 5xx) is asked at every health check; one whose pool is known is not."""
    up = {"b": True}
    asked: dict[str, Counter[str]] = {n: Counter() for n in "abcd"}
    failing = fake_backend("d", asked=asked["d"])

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="engine error")

    failing.router.add_get("/metrics", broken)

    async def body(client: TestClient, router: Router, urls: list[str]) -> None:
        for _ in range(3):
            await router.check_health()
        assert {n: c["/metrics"] for n, c in asked.items()} == {"a": 1, "b": 1, "c": 1, "d": 4}
        assert [b.pool_blocks for b in router.backends] == [71 * 128 // 16, None, None, None]
        up["b"] = False
        await router.check_health()
        up["b"] = True
        await router.check_health()
        await router.check_health()
        assert {n: c["/metrics"] for n, c in asked.items()} == {"a": 1, "b": 2, "c": 1, "d": 7}, \
            "b asked again once it is back, and once"
        router.check()

    asyncio.run(_with_router({"a": fake_backend("a", metrics=vllm_metrics([(72, 128)]), asked=asked["a"]),
                              "b": fake_backend("b", up=up, asked=asked["b"]),
                              "c": fake_backend("c", metrics="<html>", asked=asked["c"]), "d": failing},
                             body, policy="cost"))
