"""A prefix-aware router in front of N ``vllm serve`` instances: ``python -m radixkv route``.

An OpenAI-compatible HTTP proxy (aiohttp: one well-kept package for the server and the streaming
client, already in vLLM's dependencies) that sends each request to the instance holding the
longest cached prefix of its prompt, as the fleet's KV events tell it (``radixkv.fleet.Follower``
over every instance's stream, vLLM's own events and the radixkv connector's tier events in it).

Contract:

* **Endpoints.**  ``POST /v1/completions`` (token-id prompts; text prompts with ``--tokenizer``)
  and ``POST /v1/chat/completions`` (with ``--tokenizer``: its chat template gives the tokens),
  streaming (server-sent events passed through as they come) or not; ``GET /v1/models``;
  ``GET /health`` (200 while an instance is up, else 503); ``GET /metrics`` (Prometheus text:
  requests per instance and outcome, routing decisions, retries, in-flight and health gauges, each
  instance's pool as read from its metrics, the prefix tokens the index promised).  The request
  body goes to the instance unchanged.
* **Policies** (``radixkv.fleet.routing``, the same code the fleet simulator runs): ``cost``
  (the default): the instance where the request's expected time to first token is least, from
  the queue of prefill the router sent it and the request's own prefill there (what it holds,
  on which medium, or a peer holds with ``--p2p``, loaded at the ``--cost-profile``'s cost; the
  rest computed); a prompt the router just sent somewhere counts as held there until the
  instance's events can confirm it, so a burst follows its first request; a prompt that does not
  fit in an instance's KV pool beside its requests in flight (their prompts' blocks, and the pages
  their outputs take as their ``max_tokens`` say: ``output_tokens``) goes to one where it does
  (each pool read from the instance's ``GET /metrics``, vLLM's ``vllm:cache_config_info``, when it
  first passes a health check).  ``prefix``: the
  longest prefix, imbalance first (``balance_abs``/``balance_rel`` requests in flight), no match
  to the idlest.  ``cache_aware``: sglang-router's rule; ``dynamo``: Dynamo's KV-router cost;
  ``least_loaded``, ``round_robin`` and ``random`` for comparison.  The prompt's block names are
  vLLM's block hashes of ``--block-size`` tokens (``--hash-algo``; a ``cache_salt`` in the body
  names block 0 as vLLM does; a request whose ``model`` is a LoRA adapter of ``--lora-modules``
  has vLLM's LoRA key in every block, so LoRA requests route by prefix too).
* **Failures.**  Instances that fail a health check (``GET /health`` every
  ``health_interval_s``, ``health_timeout_s``) or a connection are left out until a check
  passes.  A request whose instance cannot be reached, or fails before the router sent the client
  a byte, is retried on the next candidate (each instance once); when none is left the client gets
  a 503 with a JSON error.  A stream cut after bytes went out ends with an SSE ``error`` event and
  ``[DONE]``.  No request is lost silently: each is answered, and counted under its outcome.
  An instance's answer carries ``X-Radixkv-Instance``: the instance's position in the list, and
  ``X-Radixkv-Route``: why it went there (the decision's reason, ``retry``, or ``rebalance``).
* **Rebalancing** (``--rebalance``, the cost policy's rule 9, ``Chooser.rebalance``).  When a first
  token or an end comes back, an instance with nothing waiting may take the request sent last to
  an instance where two or more wait for their first token.  The router drops that upstream
  request (vLLM aborts a request whose connection closes) and sends it on; the client's response
  starts only with an instance's first byte, so it has been sent nothing.  The dropped attempt is
  counted under the outcome ``rebalanced``, the decision under the reason ``rebalance``.
* **Validation.**  A request an instance would choke on is answered 400 by the router and never
  forwarded: a body that is not a JSON object, a token-id prompt that is not a list of ints, an id
  outside the model's vocabulary, a prompt (or prompt and ``max_tokens``) longer than its context
  (``vocab_size`` / ``max_model_len``, from the model's ``config.json``).  Every request is
  counted under its real outcome: ``ok`` (2xx/3xx), ``http_<status>`` (an instance's 4xx or 5xx,
  and the router's own 400s under the backend ``none``), ``retried``, ``cut``, ``unavailable``
  (and an attempt dropped for another instance, ``rebalanced``).
* **Bounds.**  Connecting to an instance waits ``connect_timeout_s``; a whole request
  ``request_timeout_s``.  Naming a prompt costs one hash per block (microseconds each); the index
  lookup O(matched blocks + instances).

Requires ``pip install 'radixkv[router]'`` (aiohttp, pyzmq, msgspec, prometheus-client; transformers
for ``--tokenizer``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import time
from typing import Any, Callable, Sequence

from radixkv.core._checks import check_int
from radixkv.fleet.hashing import ALGOS, request_extra_keys, vllm_block_hashes
from radixkv.fleet.routing import (BALANCE_ABS, BALANCE_REL, POLICIES, PROFILES, Backend, Chooser, Move,
                                   vllm_usable_blocks)

__all__ = ["INSTANCE_HEADER", "ROUTE_HEADER", "Backend", "Router", "add_arguments", "main", "model_limits",
           "output_tokens", "pool_blocks"]

log = logging.getLogger(__name__)

#: The response header that names the instance that answered (its position in ``--backend``'s
#: list, not its address): what a client or a benchmark reads to see where a request went.
INSTANCE_HEADER = "X-Radixkv-Instance"

#: The response header that says why the router sent the request there: the routing decision's
#: reason as ``radixkv_router_routed_total`` counts it (``cost``, ``idle``, ``copy``, ``fit``,
#: ``prefix``, ``no_match``, ``balance``, ...), or ``retry`` when the instance chosen first failed
#: and a later one answered.
ROUTE_HEADER = "X-Radixkv-Route"


class Router:
    """Chooses an instance per request and proxies it (see the module docstring).

    ``backends``: base URLs (``http://127.0.0.1:8000``); ``follower``: a started
    ``radixkv.fleet.Follower`` following their streams under the backends' URLs as instance names
    (``None``: no index, every prompt a miss); ``names``: the prompt's block names for the index
    (default: vLLM's block hashes of ``block_size`` tokens; a request on a LoRA adapter of
    ``lora_modules``, name -> path, is always named so); ``tokenize``: ``(body, chat) ->
    token ids`` for text and chat prompts (``None``: token-id prompts only);
    ``max_num_batched_tokens``: the prompt tokens an instance's engine step computes (vLLM's flag of
    that name; the cost policy counts by it the decode steps a prefill waits through).
    """

    def __init__(self, backends: Sequence[str], *, follower: Any = None, policy: str = "cost",
                 block_size: int = 16, hash_algo: str = "sha256", hash_seed: str | None = None,
                 names: Callable[[list[int], str | None], list[Any]] | None = None,
                 tokenize: Callable[[dict[str, Any], bool], list[int]] | None = None,
                 balance_abs: int = BALANCE_ABS, balance_rel: float = BALANCE_REL, health_interval_s: float = 2.0,
                 health_timeout_s: float = 2.0, connect_timeout_s: float = 5.0,
                 request_timeout_s: float = 600.0, seed: int = 0, vocab_size: int | None = None,
                 max_model_len: int | None = None, profile: str = "h100-8b", affinity: float | None = None,
                 p2p: bool = False, lora_modules: dict[str, str] | None = None,
                 max_num_batched_tokens: int = 2048, clock: Callable[[], float] = time.monotonic,
                 rebalance: bool = False) -> None:
        if not backends:
            raise ValueError("backends: give at least one instance URL")
        for url in backends:
            scheme, sep, rest = str(url).partition("://")
            if not sep or scheme not in ("http", "https") or not rest.split("/")[0]:
                raise ValueError(f"backends: {url!r} is not an http:// or https:// URL of an instance")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if hash_algo not in ALGOS:
            raise ValueError(f"hash_algo must be one of {', '.join(ALGOS)} (vLLM's --prefix-caching-hash-algo), "
                             f"got {hash_algo!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        max_num_batched_tokens = check_int(max_num_batched_tokens, "max_num_batched_tokens", 1)
        for name, value in (("vocab_size", vocab_size), ("max_model_len", max_model_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        #: What the instances' model accepts: token ids below ``vocab_size``, prompts (and the
        #: tokens they ask for) within ``max_model_len``.  A request past either is answered 400
        #: here: an instance started with --skip-tokenizer-init does not check ids, and one bad
        #: request must not take it down.
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.backends = [Backend(url.rstrip("/"), url.rstrip("/")) for url in backends]
        if len({b.url for b in self.backends}) != len(self.backends):
            raise ValueError("backends: the same URL is given twice")
        self.follower, self.policy = follower, policy
        self.block_size, self.hash_algo, self.hash_seed = block_size, hash_algo, hash_seed
        self.names = names or self._vllm_names
        self.tokenize = tokenize
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.connect_timeout_s, self.request_timeout_s = connect_timeout_s, request_timeout_s
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
        self.clock = clock
        #: The LoRA adapters the instances serve (``--lora-modules NAME=PATH``, as vLLM was started):
        #: a request naming one as its ``model`` has vLLM's LoRA key in every block's hash.
        self.lora_modules = dict(lora_modules or {})
        self.chooser = Chooser(policy, block_size=block_size,
                               lookup=None if follower is None else follower.lookup,
                               spread=getattr(follower, "lookup_spread", None), model=PROFILES[profile],
                               affinity=affinity, p2p=p2p, balance_abs=balance_abs, balance_rel=balance_rel,
                               budget=max_num_batched_tokens, seed=seed, rebalance=rebalance)
        self._session: Any = None
        self._health_task: asyncio.Task[None] | None = None
        self._metrics = _Metrics([b.name for b in self.backends])
        #: Each request waiting for its first token (by its key for ``Chooser.sent``): the future
        #: ``_rebalance`` sets when an instance that fell free takes it.
        self._moves: dict[Any, asyncio.Future[Any]] = {}
        self._keys = itertools.count()
        #: Instances whose ``GET /metrics`` answered since they last came up: an answer without a
        #: pool (an engine that is not vLLM, a 404) is not asked again until the instance has been
        #: down or its KV events restarted; a request that failed or a 5xx is asked again at the
        #: next health check.
        self._pool_asked: set[str] = set()
        #: Each instance's publisher restarts as the follower last counted them: a change means
        #: the engine came back, maybe with another pool, between two health checks.
        self._restarts_seen: dict[str, int] = {}

    # -- choosing ------------------------------------------------------------------------------

    def _vllm_names(self, tokens: list[int], salt: str | None, lora: tuple[str, str] | None = None) -> list[Any]:
        """vLLM's block hashes of ``tokens`` for a request with ``cache_salt`` ``salt`` on the LoRA
        adapter ``lora`` (name, path).  O(tokens)."""
        extra = request_extra_keys(len(tokens) // self.block_size, salt, lora)
        return vllm_block_hashes(tokens, self.block_size, extra_keys=extra,  # type: ignore[call-overload]
                                 algo=self.hash_algo, seed=self.hash_seed, as_int=True)

    def choose(self, tokens: list[int] | None, salt: str | None = None, model: str | None = None,
               output: int | None = None) -> tuple[list[Backend], str, int]:
        """The healthy instances in the order to try them, why the first was chosen (``"cost"``,
        ``"idle"``, ``"copy"``, ``"fit"``, ``"prefix"``, ``"balance"``, ``"no_match"``, ``"dynamo"``,
        ``"least_loaded"``, ``"round_robin"``, ``"random"``) and the prefix tokens the first holds,
        as the router believes; ``output``: the tokens the request may generate
        (``output_tokens``), ``None`` when unknown.  O(instances + prompt blocks) plus the lookup."""
        choice = self._choice(tokens, salt, model, output)
        return choice.order, choice.why, choice.promised

    def _choice(self, tokens: list[int] | None, salt: str | None, model: str | None = None,
                output: int | None = None) -> Any:
        names: list[Any] = []
        if tokens and self.policy not in ("round_robin", "random"):
            lora = (model, self.lora_modules[model]) if model in self.lora_modules else None
            names = self.names(tokens, salt) if lora is None else self._vllm_names(tokens, salt, lora)
        return self.chooser.choose(self.backends, len(tokens or ()), names, self.clock(), output=output)

    def check(self) -> None:
        """Assert the router's invariants: instances named once, no negative in-flight count,
        a known policy, a pool known only where one was read; and the follower's, when there is one.  O(instances) plus the index's."""
        self.chooser.check(self.backends)
        assert self.policy in POLICIES, f"unknown policy {self.policy!r}"
        for b in self.backends:
            assert b.pool_blocks is None or b.name in self._pool_asked, f"{b.name}'s pool was never read"
        assert self._pool_asked <= {b.name for b in self.backends}, "an unknown instance was asked"
        assert set(self._restarts_seen) <= {b.name for b in self.backends}, "restarts of an unknown instance"
        if self.follower is not None and hasattr(self.follower, "check"):
            self.follower.check()

    # -- serving -------------------------------------------------------------------------------

    def app(self) -> Any:
        """The aiohttp ``web.Application`` (its start-up makes the client session and starts the
        health checks; its clean-up stops them)."""
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics_page)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: Any) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=self.request_timeout_s, sock_connect=self.connect_timeout_s))
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def _stop(self, app: Any) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._session is not None:
            await self._session.close()

    async def check_health(self) -> None:
        """``GET /health`` of every instance at once, bounded by ``health_timeout_s``."""
        import aiohttp

        async def one(b: Backend) -> None:
            try:
                async with self._session.get(f"{b.url}/health",
                                             timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as r:
                    ok = r.status == 200
            except Exception:  # noqa: BLE001 - any failure is "down"
                ok = False
            if ok != b.healthy:
                log.warning("radixkv router: %s is %s", b.url, "up" if ok else "down")
            b.healthy = ok
            self._metrics.healthy(b.name, ok)
            if not ok or self._restarted(b.name):
                b.pool_blocks = None            # it may come back with another pool
                self._pool_asked.discard(b.name)
            if ok and b.pool_blocks is None and b.name not in self._pool_asked:
                b.pool_blocks, answered = await self._pool_of(b)
                if answered:
                    self._pool_asked.add(b.name)
            self._metrics.pool(b.name, b.pool_blocks)

        await asyncio.gather(*(one(b) for b in self.backends))

    def _restarted(self, name: str) -> bool:
        """Whether the follower counted a restart of ``name``'s KV-event publisher since the last
        health check (the engine came back between two checks, which a check that passes does not
        show).  False without a follower that counts them.  O(1)."""
        count = getattr(self.follower, "restarts", None)
        if count is None:
            return False
        now = count(name)
        before = self._restarts_seen.get(name, now)
        self._restarts_seen[name] = now
        return now != before

    async def _pool_of(self, b: Backend) -> tuple[int | None, bool]:
        """``b``'s KV pool in the router's blocks, from its ``GET /metrics`` (``pool_blocks``),
        ``None`` when it cannot say, and whether the instance answered (any status below 500).
        One GET bounded by ``health_timeout_s``."""
        import aiohttp

        try:
            async with self._session.get(f"{b.url}/metrics",
                                         timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as r:
                text = await r.text() if r.status == 200 else ""
                answered = r.status < 500
        except Exception:  # noqa: BLE001 - no metrics: the pool stays unknown
            text, answered = "", False
        pool = pool_blocks(text, self.block_size)
        if pool is not None:
            log.info("radixkv router: %s has a pool of %d blocks", b.url, pool)
        return pool, answered

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def _completions(self, request: Any) -> Any:
        return await self._route(request, "/v1/completions", chat=False)

    async def _chat(self, request: Any) -> Any:
        return await self._route(request, "/v1/chat/completions", chat=True)

    def _tokens(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's token ids, or ``None`` when they cannot be known (no tokenizer)."""
        if not chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
                return prompt[0]
        if self.tokenize is None:
            return None
        return self.tokenize(body, chat)

    async def _route(self, request: Any, path: str, chat: bool) -> Any:
        from aiohttp import web

        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._refuse(web, "the request body is not JSON")
        if not isinstance(body, dict):
            return self._refuse(web, "the request body must be a JSON object")
        try:
            tokens = self._tokens(body, chat)
        except Exception as exc:  # noqa: BLE001 - a prompt the tokenizer refuses is the client's error
            return self._refuse(web, f"cannot tokenize the prompt: {exc}")
        problem = self.invalid(body, tokens)
        if problem is not None:
            return self._refuse(web, problem)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        model = body.get("model") if isinstance(body.get("model"), str) else None
        output = output_tokens(body, chat)
        choice = self._choice(tokens, salt, model, output)
        self._metrics.routed(choice.why, choice.promised)
        stream = bool(body.get("stream"))
        length = len(tokens or ())
        key = next(self._keys)
        for attempt, backend in enumerate(choice.order):
            if attempt:
                self._metrics.retry()
            sent_at = self.clock()
            charge = self.chooser.sent(backend, length, choice.promised if attempt == 0 else 0, choice.names, sent_at,
                                       output, key=key)
            self._metrics.in_flight(backend.name, backend.in_flight)
            why = "retry" if attempt else choice.why
            while True:
                first = [False]
                moved = self._moves[key] = asyncio.get_running_loop().create_future()

                def prefilled(backend: Backend = backend, charge: int = charge, first: list[bool] = first,
                              sent_at: float = sent_at) -> None:
                    if not first[0]:
                        first[0] = True
                        self._moves.pop(key, None)
                        self.chooser.prefilled(backend, charge, choice.names, self.clock(), sent_at, length, output,
                                               key=key)
                        self._rebalance()

                result: Any = None
                try:
                    result = await self._forward(request, backend, path, body, stream, prefilled, why, moved)
                finally:
                    self._moves.pop(key, None)
                    if not isinstance(result, Move):
                        # a stream's first token came before its end: the time between shows the
                        # decode steps; a response read whole shows neither
                        streamed = first[0]
                        prefilled()
                        self.chooser.ended(backend, length, choice.names, output, self.clock() if streamed else None)
                        self._metrics.in_flight(backend.name, backend.in_flight)
                        self._rebalance()
                if not isinstance(result, Move):
                    break
                # taken by an instance that fell free (the router's counts already moved it)
                self._metrics.request(backend.name, "rebalanced")
                self._metrics.in_flight(backend.name, backend.in_flight)
                backend, charge, sent_at, why = result.target, result.charge, result.sent_at, "rebalance"
                self._metrics.in_flight(backend.name, backend.in_flight)
            if result is not None:
                return result
        self._metrics.request("none", "unavailable")
        return _error(web, 503, "no instance could serve the request", "unavailable")

    def _rebalance(self) -> None:
        """Rule 9 of the cost policy (``Chooser.rebalance``): each request an instance that fell
        free takes is told to move (its ``_forward`` drops the upstream request, which vLLM
        aborts, and it is sent on).  Called when the router hears a first token or an end.
        O(instances ** 2 x a choice) at most."""
        for move in self.chooser.rebalance(self.backends, self.clock(),
                                           lambda key: key in self._moves and not self._moves[key].done()):
            self._metrics.routed("rebalance", 0)
            self._moves[move.key].set_result(move)

    def invalid(self, body: dict[str, Any], tokens: list[int] | None) -> str | None:
        """Why the router refuses ``body`` (its prompt ``tokens`` when known), or ``None``: a
        token-id prompt that is not a non-empty list of ints, an id outside ``[0, vocab_size)``, a
        prompt longer than ``max_model_len`` or one whose ``max_tokens`` cannot fit after it, a
        ``max_tokens`` that is not a positive int.  O(prompt tokens)."""
        prompt = body.get("prompt")
        if "messages" not in body and isinstance(prompt, list):
            flat = prompt[0] if len(prompt) == 1 and isinstance(prompt[0], list) else prompt
            ids = flat and all(isinstance(t, int) and not isinstance(t, bool) for t in flat)
            texts = flat and all(isinstance(t, str) for t in flat)      # a batch of text prompts
            if not (ids or texts):
                return "prompt: a list must be a non-empty list of token ids (ints) or of strings"
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            return f"max_tokens must be a positive int, got {max_tokens!r}"
        if tokens is None:
            return None
        if self.vocab_size is not None:
            bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, int)
                        or not 0 <= t < self.vocab_size), None)
            if bad is not None:
                return f"prompt: token id {bad!r} is outside the model's vocabulary [0, {self.vocab_size})"
        if self.max_model_len is not None:
            if len(tokens) >= self.max_model_len:
                return f"prompt: {len(tokens)} tokens, the model's context is {self.max_model_len}"
            if max_tokens is not None and len(tokens) + max_tokens > self.max_model_len:
                return (f"max_tokens: {max_tokens} after a {len(tokens)}-token prompt exceeds the model's context "
                        f"of {self.max_model_len}")
        return None

    def _refuse(self, web: Any, message: str) -> Any:
        """Answer 400 and count the request (it reached no instance)."""
        self._metrics.request("none", "http_400")
        return _error(web, 400, message)

    async def _forward(self, request: Any, backend: Backend, path: str, body: dict[str, Any],
                       stream: bool, prefilled: Callable[[], None], why: str, moved: asyncio.Future[Any]) -> Any:
        """Proxy to ``backend``; the response, ``None`` when it failed before a byte went to the
        client (the caller tries the next instance), or the ``Move`` that ``moved`` gave before
        the instance answered (its upstream request dropped: vLLM aborts it).  ``prefilled()`` is
        called at the first byte of a stream (its first token); ``why``: the reason the
        response's ``ROUTE_HEADER`` gives.  The client's response starts only with the instance's
        first byte, so a request that moves has sent the client nothing."""
        import aiohttp
        from aiohttp import web

        out: Any = None
        named = {INSTANCE_HEADER: str(self.backends.index(backend)), ROUTE_HEADER: why}

        async def answer() -> tuple[Any, bytes | None, Any, bytes]:
            """The upstream response and either its whole body or its stream's first piece; once
            either is here, the request can no longer move (unless it already did)."""
            r = await self._session.post(f"{backend.url}{path}", json=body)
            try:
                if not stream or r.status != 200:
                    data, pieces, piece = await r.read(), None, b""
                else:
                    data, pieces = None, r.content.iter_any().__aiter__()
                    piece = await anext(pieces, b"")
            except BaseException:
                r.close()
                raise
            if not moved.done():
                moved.cancel()          # here first: it stays, whatever the router does next
                if data is None:
                    prefilled()         # a stream's first token (a whole answer's comes at its end)
            return r, data, pieces, piece

        upstream = asyncio.ensure_future(answer())
        r: Any = None
        try:
            await asyncio.wait({upstream, moved}, return_when=asyncio.FIRST_COMPLETED)
            if moved.done() and not moved.cancelled():      # moved: whatever the instance said is dropped
                upstream.cancel()
                with contextlib.suppress(BaseException):
                    got = await upstream
                    got[0].close()
                return moved.result()
            r, data, pieces, piece = await upstream
            try:
                if data is not None:
                    self._metrics.request(backend.name, "ok" if r.status < 400 else f"http_{r.status}")
                    if r.status >= 500:
                        return None if r.status in (502, 503) else web.Response(
                            status=r.status, body=data, content_type=r.content_type)
                    return web.Response(status=r.status, body=data, content_type=r.content_type, headers=named)
                out = web.StreamResponse(status=200, headers={"Content-Type": r.headers.get(
                    "Content-Type", "text/event-stream"), "Cache-Control": "no-cache", **named})
                await out.prepare(request)
                if piece:
                    await out.write(piece)
                    async for piece in pieces:
                        prefilled()
                        await out.write(piece)
                await out.write_eof()
                self._metrics.request(backend.name, "ok")
                return out
            finally:
                r.release()
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            backend.healthy = False
            self._metrics.healthy(backend.name, False)
            log.warning("radixkv router: %s failed (%s)", backend.url, type(exc).__name__)
            if out is None:
                self._metrics.request(backend.name, "retried")
                return None
            self._metrics.request(backend.name, "cut")
            err = {"error": {"message": f"the instance failed mid-stream: {type(exc).__name__}",
                             "type": "upstream_error"}}
            try:
                await out.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
                await out.write_eof()
            except (ConnectionError, RuntimeError):
                pass
            return out
        finally:
            if not upstream.done():     # the client went away: so does the upstream request
                upstream.cancel()

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        for b in sorted(self.backends, key=lambda b: not b.healthy):
            try:
                async with self._session.get(f"{b.url}/v1/models") as r:
                    return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
            except Exception:  # noqa: BLE001 - the next instance may answer
                continue
        return _error(web, 503, "no instance answered", "unavailable")

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        up = [b.url for b in self.backends if b.healthy]
        return web.json_response({"healthy": up, "down": [b.url for b in self.backends if not b.healthy]},
                                 status=200 if up else 503)

    async def _metrics_page(self, request: Any) -> Any:
        from aiohttp import web

        body, content_type = self._metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})


def _error(web: Any, status: int, message: str, kind: str = "invalid_request_error") -> Any:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class _Metrics:
    """The router's Prometheus series, in a registry of their own."""

    def __init__(self, backends: list[str]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self._requests = Counter("radixkv_router_requests_total", "Requests by instance and outcome "
                                 "(ok, http_<status>, retried, cut, unavailable, rebalanced)", ["backend", "outcome"],
                                 registry=self.registry)
        self._routed = Counter("radixkv_router_routed_total", "Routing decisions by reason", ["reason"],
                               registry=self.registry)
        self._promised = Counter("radixkv_router_prefix_tokens_total", "Prompt tokens the index said the "
                                 "chosen instance held", registry=self.registry)
        self._retries = Counter("radixkv_router_retries_total", "Requests tried on another instance",
                                registry=self.registry)
        self._in_flight = Gauge("radixkv_router_in_flight", "Requests in flight per instance", ["backend"],
                                registry=self.registry)
        self._healthy = Gauge("radixkv_router_backend_up", "1 while an instance passes its health checks",
                              ["backend"], registry=self.registry)
        self._pool = Gauge("radixkv_router_pool_blocks", "An instance's KV pool in the router's blocks, as read "
                           "from its metrics (0 while unknown: the fit rule is off for it)", ["backend"],
                           registry=self.registry)
        for b in backends:
            self._in_flight.labels(b).set(0)
            self._healthy.labels(b).set(1)
            self._pool.labels(b).set(0)

    def request(self, backend: str, outcome: str) -> None:
        self._requests.labels(backend, outcome).inc()

    def routed(self, reason: str, promised: int) -> None:
        self._routed.labels(reason).inc()
        self._promised.inc(promised)

    def retry(self) -> None:
        self._retries.inc()

    def in_flight(self, backend: str, n: int) -> None:
        self._in_flight.labels(backend).set(n)

    def healthy(self, backend: str, ok: bool) -> None:
        self._healthy.labels(backend).set(1 if ok else 0)

    def pool(self, backend: str, blocks: int | None) -> None:
        self._pool.labels(backend).set(blocks or 0)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# -- the command -------------------------------------------------------------------------------

def _port(text: str) -> int:
    """``--port``: an int from 0 to 65535 (``argparse.ArgumentTypeError`` names it otherwise)."""
    try:
        return check_int(int(text), "a port", 0, 65535)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a port from 0 to 65535, got {text!r}") from None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m radixkv route``."""
    ap.add_argument("--backend", action="append", required=True, metavar="URL",
                    help="an instance's base URL (repeat for each), e.g. http://127.0.0.1:8000")
    ap.add_argument("--events", action="append", default=[], metavar="ENDPOINT",
                    help="the KV-event endpoint of each --backend, in the same order. tcp://127.0.0.1:PORT "
                         "is bound by the router (give vLLM the same endpoint: it connects to one without a "
                         "wildcard); connect:tcp://HOST:PORT connects (vLLM bound tcp://*:PORT, or a "
                         "radixkv publish())")
    ap.add_argument("--replay", action="append", default=[], metavar="ENDPOINT",
                    help="the replay endpoint of each --backend, in order (vLLM's replay_endpoint)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=_port, default=8080, help="0 for any free port")
    ap.add_argument("--policy", choices=POLICIES, default="cost",
                    help="how to choose an instance (default cost: the least expected time to first token)")
    ap.add_argument("--cost-profile", choices=sorted(PROFILES), default="h100-8b",
                    help="the prefill and load costs the cost policy weighs (h100-8b: an 8B model on an H100; "
                         "vllm-cpu: vLLM's CPU build serving a 2-layer model of hidden 512; vllm-cpu-fleet: the same "
                         "build serving bench fleet's model, hidden 256)")
    ap.add_argument("--affinity", type=float, default=None,
                    help="the cost policy's weight (>= 1) of the work a choice adds over the queue it waits in "
                         "(default: by load, from 1 on an idle fleet to 4 when every instance has a queue)")
    ap.add_argument("--p2p", action="store_true",
                    help="the instances share KV peer to peer: a prefix one holds is a load for every other")
    ap.add_argument("--block-size", type=int, default=16, help="the instances' --block-size (vLLM's default 16)")
    ap.add_argument("--hash-algo", default="sha256", help="the instances' --prefix-caching-hash-algo")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer path, for text and chat prompts")
    ap.add_argument("--model-config", default=None, metavar="PATH",
                    help="the model's config.json (or its directory): token ids past its vocab_size and prompts "
                         "past its max_position_embeddings are answered 400 (default: the --tokenizer "
                         "directory's config.json, when there is one)")
    ap.add_argument("--vocab-size", type=int, default=None, help="overrides --model-config's vocab_size")
    ap.add_argument("--max-model-len", type=int, default=None, help="overrides the model's context length")
    ap.add_argument("--lora-modules", action="append", default=[], metavar="NAME=PATH",
                    help="a LoRA adapter the instances serve, as given to vllm serve --lora-modules (repeat for each): "
                         "a request whose model is NAME is routed by the block hashes vLLM gives it")
    ap.add_argument("--balance-abs", type=int, default=BALANCE_ABS)
    ap.add_argument("--balance-rel", type=float, default=BALANCE_REL)
    ap.add_argument("--rebalance", action="store_true",
                    help="cost policy: a request still waiting for its first token on one instance moves to an "
                         "instance that fell free when it would be sooner there (the upstream request is dropped, "
                         "which vLLM aborts; the client has been sent nothing)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                    help="the prompt tokens an instance's engine step computes, as its vllm serve "
                         "--max-num-batched-tokens (default 2048, vLLM's on CPU; 8192 on an H100 or H200): the "
                         "cost policy counts the decode steps a prefill waits through by it")


def build(args: argparse.Namespace) -> Router:
    """The ``Router`` (and its started ``Follower``) that ``args`` describe."""
    from radixkv.fleet.follow import Follower

    if args.events and len(args.events) != len(args.backend):
        raise ValueError(f"--events: give one per --backend ({len(args.backend)}), got {len(args.events)}")
    if args.replay and len(args.replay) != len(args.backend):
        raise ValueError(f"--replay: give one per --backend ({len(args.backend)}), got {len(args.replay)}")
    tokenize = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--tokenizer: cannot load a tokenizer from {args.tokenizer!r} "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None

        def tokenize(body: dict[str, Any], chat: bool) -> list[int]:
            if chat:       # as vLLM does: the template rendered to text, then no special tokens added
                text = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
                return list(tok(text, add_special_tokens=False).input_ids)
            return list(tok(body["prompt"]).input_ids)

    vocab, context = model_limits(args.model_config or args.tokenizer, required=args.model_config is not None)
    lora = {}
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: give NAME=PATH, got {item!r}")
        lora[name] = path
    follower = None
    try:        # a refused argument leaves nothing running: the follower's sockets are closed
        if args.events:
            follower = Follower()
            for i, (url, endpoint) in enumerate(zip(args.backend, args.events)):
                bind = not endpoint.startswith("connect:")
                try:
                    follower.add(url.rstrip("/"), endpoint.removeprefix("connect:"), bind=bind,
                                 replay_endpoint=args.replay[i] if args.replay else None)
                except Exception as exc:    # zmq's errors are their own type: named here as the flag's
                    raise ValueError(f"--events: cannot {'bind' if bind else 'connect to'} {endpoint!r} "
                                     f"({' '.join(str(exc).split()) or type(exc).__name__})") from None
            follower.start()
        return Router(args.backend, follower=follower, policy=args.policy, block_size=args.block_size,
                      hash_algo=args.hash_algo, tokenize=tokenize, balance_abs=args.balance_abs,
                      balance_rel=args.balance_rel,
                      vocab_size=args.vocab_size if args.vocab_size is not None else vocab,
                      max_model_len=args.max_model_len if args.max_model_len is not None else context,
                      profile=args.cost_profile, affinity=args.affinity, p2p=args.p2p, lora_modules=lora,
                      max_num_batched_tokens=args.max_num_batched_tokens, rebalance=args.rebalance)
    except (TypeError, ValueError, OSError):
        if follower is not None:
            follower.close()
        raise


#: vLLM's ``max_tokens`` for a completion that names none (as OpenAI's API): a chat completion
#: without one may run to the end of the model's context, which says nothing of how long it runs.
COMPLETION_MAX_TOKENS = 16


def output_tokens(body: dict[str, Any], chat: bool) -> int | None:
    """The tokens a request (a body ``invalid`` passed) may generate, as the instance will take
    them: its ``max_tokens`` (``max_completion_tokens``), for a completion that names neither vLLM's
    default (``COMPLETION_MAX_TOKENS``), ``None`` (unknown) for a chat completion that names
    neither or a request that sets one to null (vLLM then runs to the end of the context).  The
    cost policy's fit rule counts their pages.  One sequence a request (``n`` and ``best_of`` are
    not counted).  O(1)."""
    value = body.get("max_tokens", body.get("max_completion_tokens"))
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if chat or "max_tokens" in body or "max_completion_tokens" in body:
        return None
    return COMPLETION_MAX_TOKENS


def pool_blocks(metrics: str, block_size: int) -> int | None:
    """An instance's KV pool in blocks of ``block_size`` tokens, read from its Prometheus text
    (vLLM's ``vllm:cache_config_info``, labels ``num_gpu_blocks`` and ``block_size``; with several
    engines the smallest pool, since a request runs on one), or ``None`` when the text does not say
    or cannot be parsed.  The pool requests can use: ``num_gpu_blocks`` less vLLM's null block
    (``vllm_usable_blocks``).  O(text)."""
    from prometheus_client.parser import text_string_to_metric_families

    pools = []
    try:
        for family in text_string_to_metric_families(metrics):
            for sample in family.samples:
                if not sample.name.startswith("vllm:cache_config_info"):
                    continue
                blocks, size = sample.labels.get("num_gpu_blocks", ""), sample.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit() and vllm_usable_blocks(int(blocks)) > 0 and int(size) > 0:
                    pools.append(vllm_usable_blocks(int(blocks)) * int(size) // block_size)
    except ValueError:                    # not Prometheus text (an error page, another server)
        return None
    return min(pools) if pools else None


def model_limits(path: str | None, required: bool = False) -> tuple[int | None, int | None]:
    """``(vocab_size, max_position_embeddings)`` from a model's ``config.json`` (``path`` is the
    file or its directory; the text config of a multimodal one); ``(None, None)`` without one,
    unless ``required`` (then ``ValueError`` naming the file).  One file read."""
    import os

    if path is None:
        return None, None
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        if required:
            raise ValueError(f"--model-config: no such file {file!r}")
        return None, None
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model-config: cannot read {file!r}: {exc}") from None
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    vocab, context = text.get("vocab_size"), text.get("max_position_embeddings")
    return (vocab if isinstance(vocab, int) else None), (context if isinstance(context, int) else None)


def main(args: argparse.Namespace) -> int:
    """``python -m radixkv route``: serve until interrupted."""
    from aiohttp import web

    router = build(args)
    print(f"radixkv router on http://{args.host}:{args.port} -> {', '.join(args.backend)} "
          f"(policy {args.policy}{', following KV events' if router.follower else ''})", flush=True)
    try:
        web.run_app(router.app(), host=args.host, port=args.port, print=None, access_log=None)
    finally:
        if router.follower is not None:
            router.follower.close()
    return 0
