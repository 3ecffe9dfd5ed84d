"""``python -m radixkv.bench fleet``'s arguments, its workload's reuse bound, and a SIGTERM's cleanup
(with stand-in servers: the runs themselves start vLLM, they are the committed benchmark, not a test)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.bench import fleet


def test_routers_and_seeds_parse_and_bad_items_are_named() -> None:
    args = fleet._parser().parse_args(["--routers", "radixkv:cost,sglang:cache_aware_low,sglang:round_robin,"
                                       "radixkv:cost+rebalance", "--seed", "0,1,2"])
    assert [r.name for r in args.routers] == ["radixkv:cost", "sglang:cache_aware_low", "sglang:round_robin",
                                              "radixkv:cost+rebalance"]
    assert args.seed == [0, 1, 2]
    plain = fleet._parser().parse_args([])
    assert plain.routers is None and plain.seed == [0] and plain.policies == ",".join(fleet.POLICIES)
    for bad in ("cost", "sglang:cost", "radixkv:cache_aware_low", "vllm:round_robin", "sglang:cache_aware+rebalance",
                "radixkv:cost+other", "radixkv:+rebalance"):
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


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 9), st.integers(0, 9),
                         st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=4))
def test_a_row_counts_each_instances_counters_over_the_run_alone(deltas: list[tuple[int, ...]]) -> None:
    """The row's hit rate, preemptions and requests served are each counter's change between the
    snapshots, summed over the instances (not the counters since the instance started)."""
    def metrics(queries: int, hits: int, preempted: int, served: int, aborted: int) -> str:
        return "\n".join([
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}.0',
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}.0',
            f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preempted}.0',
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} {served}.0',
            f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="m"}} {aborted}.0'])

    before, after = {}, {}
    for i, (q0, dq, p0, dp, s0, ds) in enumerate(deltas):
        url = f"http://127.0.0.1:{8000 + i}"
        before[url] = metrics(q0 + 7, q0, p0 + 100, s0, 3)
        after[url] = metrics(q0 + 7 + dq, q0 + dq // 2, p0 + 100 + dp, s0 + ds, 3 + ds)
    results = [{"outcome": "served", "ttft": 0.01 * (k + 1), "_wall": 2.0} for k in range(4)]
    row = fleet._row("cost", results, before, after, routed="")
    queries = sum(d[1] for d in deltas)
    assert row["preempted"] == sum(d[3] for d in deltas)
    assert row["served_by"] == [d[5] for d in deltas], "aborted requests are not served"
    assert row["gpu_hit"] == pytest.approx(sum(d[1] // 2 for d in deltas) / queries if queries else 0.0)
    assert row["outcomes"] == {"served": 4, "error": 0, "lost": 0}


@given(st.lists(st.integers(0, 255), min_size=1, max_size=64, unique=True), st.integers(1, 8),
       st.sampled_from(("auto", "on", "off")))
def test_pinning_gives_each_instance_cores_of_its_own(available: list[int], instances: int, pin: str) -> None:
    if pin == "on" and len(available) < instances:
        with pytest.raises(ValueError, match="--pin on"):
            fleet.cores(instances, pin, available)
        return
    got = fleet.cores(instances, pin, available)
    if pin == "off" or len(available) < instances:
        assert got is None
        return
    assert got is not None and len(got) == instances
    flat = [c for each in got for c in each]
    assert len(flat) == len(set(flat)), "a core given twice"
    assert set(flat) <= set(available) and all(len(each) == len(available) // instances for each in got)


def test_pin_on_with_too_few_cores_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    import os

    assert fleet.main(["--pin", "on", "--instances", str(len(os.sched_getaffinity(0)) + 1)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--pin on" in err and "\n" not in err


def test_a_pinned_server_runs_under_a_pinned_python_and_bad_cores_are_refused() -> None:
    from radixkv.testing.vllm_server import VllmServer

    cmd = VllmServer("model", cpus=[1, 0, 1]).command()
    assert cmd[1] == "-c" and "sched_setaffinity(0, {0, 1})" in cmd[2] and "vllm.entrypoints.openai.api_server" in cmd
    assert "-c" not in VllmServer("model").command()[:2]
    for bad in ([], [-1], [True], ["0"]):
        with pytest.raises(ValueError, match="cpus"):
            VllmServer("model", cpus=bad)


async def _drive_against(completions: Any, work: list, max_tokens: int, **kw: Any) -> list[dict]:
    """``fleet._drive`` against a server on 127.0.0.1 whose ``/v1/completions`` is ``completions``."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        return await fleet._drive(f"http://127.0.0.1:{port}", "m", work, max_tokens, None, None, **kw)
    finally:
        await runner.cleanup()


def test_ttft_is_timed_to_the_first_data_event_not_the_first_bytes() -> None:
    """A server that sends a keep-alive comment at once and its first token 0.3 s later: the
    bench's TTFT is the token's, and the request counts as served."""
    import asyncio
    import json

    aiohttp_web = pytest.importorskip("aiohttp.web")

    async def main() -> list[dict]:
        async def completions(request: "aiohttp_web.Request") -> "aiohttp_web.StreamResponse":
            await request.json()
            resp = aiohttp_web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b": keep-alive\n\n")
            await asyncio.sleep(0.3)
            event = {"choices": [{"index": 0, "text": " a"}], "usage": {"prompt_tokens": 2}}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp

        return await _drive_against(completions, [(0.0, [1, 2])], 1)

    [res] = asyncio.run(main())
    assert res["outcome"] == "served" and res["ttft"] >= 0.3, res


@pytest.mark.parametrize("argv, says", [
    (["--burst", "0"], "--burst"), (["--requests", "0"], "--requests"), (["--instances", "0"], "--instances"),
    (["--policies", "cost,fastest"], "--policies"), (["--rate", "0"], "--rate"), (["--rate", "nan"], "--rate"),
    (["--cpu-tier-mb", "-1"], "--cpu-tier-mb"), (["--balance-abs", "-1"], "--balance-abs"),
    (["--balance-rel", "0.5"], "--balance-rel"), (["--affinity", "0.9"], "--affinity"),
    (["--system-tokens", "4000", "--question-tokens", "96"], "context"), (["--seed", "-1"], "--seed"),
    (["--out", "/no/such/folder/t.txt"], "--out"), (["--requests", "x"], "--requests"),
    (["--routers", "vllm:cost"], "--routers"), (["--no-such-flag"], "--no-such-flag"),
    (["--trace", "/no/such/trace.jsonl"], "--trace"), (["--pool-blocks", "32"], "--pool-blocks"),
    (["--turns", "0"], "--turns"), (["--turns", "2", "--trace", "/no/such/trace.jsonl"], "--turns"),
    (["--turns", "3", "--max-tokens", "900"], "context"), (["--repeat", "2"], "--repeat"),
    (["--routers", "radixkv:cost", "--repeat", "0"], "--repeat"),
])
def test_a_bad_flag_is_one_line_and_exit_2_before_any_server_starts(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_server(*args: object, **kwargs: object) -> None:
        raise AssertionError("a server was started for a refused run")

    monkeypatch.setattr(fleet, "_servers", no_server)
    monkeypatch.setattr(fleet, "_start_all", no_server)
    assert fleet.main(argv) == 2
    out = capsys.readouterr()
    assert says in out.err and out.err.count("\n") == 1 and not out.out, (argv, out)


def _trace(path: Path, rows: list[dict]) -> str:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("extra, says", [
    (["--burst", "6"], "--burst"), (["--trace-tokens", "0"], "--trace-tokens"), (["--trace-block", "0"], "--trace-block"),
    (["--trace-tokens", "4096"], "context"),
])
def test_a_trace_run_refuses_flags_it_cannot_use_in_one_line(
        tmp_path: Path, extra: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    good = _trace(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600}\n')
    for argv, word in ((["--trace", good, *extra], says), (["--trace", str(bad)], "hash_ids")):
        assert fleet.main(argv) == 2
        out = capsys.readouterr()
        assert word in out.err and out.err.count("\n") == 1 and not out.out, (argv, out)


_rows = st.lists(st.fixed_dictionaries({
    "timestamp": st.integers(0, 10_000), "input_length": st.integers(1, 3_000), "output_length": st.integers(0, 50),
    "hash_ids": st.lists(st.integers(0, 6), min_size=1, max_size=8)}), min_size=1, max_size=25)


@given(rows=_rows, tokens=st.sampled_from([16, 64, 128]), trace_block=st.sampled_from([None, 512, 100]),
       rate=st.floats(0.1, 50), limit=st.integers(64, 4096), seed=st.integers(0, 3))
def test_a_traces_rows_become_prompts_that_share_what_their_ids_share_at_its_rate(
        tmp_path_factory: pytest.TempPathFactory, rows: list[dict], tokens: int, trace_block: int | None,
        rate: float, limit: int, seed: int) -> None:
    from radixkv.bench.fleet_sim import trace_block as read_block, workload

    path = _trace(tmp_path_factory.mktemp("trace") / "t.jsonl", rows)
    work, cut = fleet.trace_workload(path, 10, seed, rate, tokens, trace_block, limit=limit)
    assert (work, cut) == fleet.trace_workload(path, 10, seed, rate, tokens, trace_block, limit=limit)   # deterministic
    window, bt = workload("mooncake", 10, seed, path, trace_block)        # the simulator's window of rows
    assert bt == (trace_block or read_block(rows)) and len(work) == len(window)
    want = [max(1, round(r.tokens * tokens / bt)) for r in window]
    assert [len(p) for _, p in work] == [min(n, limit) for n in want] and cut == sum(n > limit for n in want)
    assert all(0 < t < fleet.WARM_ID for _, p in work for t in p)          # never the warm-up's id
    for (_, p), r in zip(work, window):
        for (_, q), o in zip(work, window):
            k = next((j for j, (a, b) in enumerate(zip(r.blocks, o.blocks)) if a != b), min(len(r.blocks), len(o.blocks)))
            end = min(k * tokens, len(p), len(q))      # the ids they share, as far as both prompts reach
            assert p[:end] == q[:end]
    arrivals = [t for t, _ in work]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    if arrivals[-1] > 0:                                # the rows average `rate` arrivals a second
        assert (len(work) - 1) / arrivals[-1] == pytest.approx(rate)


def test_a_trace_block_is_drawn_from_its_id_alone(tmp_path: Path) -> None:
    path = _trace(tmp_path / "t.jsonl", [{"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": [i, 7]}
                                         for i in range(20)])
    work, _ = fleet.trace_workload(path, 20, 0, 1.0, 128, 512)
    assert [len(p) for _, p in work] == [256] * 20
    assert len({tuple(p[:128]) for _, p in work}) == 20 and len({tuple(p[128:]) for _, p in work}) == 1


def test_the_defaults_pass_the_check() -> None:
    fleet.refuse(fleet._parser().parse_args([]))
    fleet.refuse(fleet._parser().parse_args(["--burst", "6", "--requests", "288", "--seed", "0,1"]))


#: A stand-in for ``vllm serve``: answers ``GET /health``, records its pid when the bench's warm-up
#: request comes, and then holds that request as a slow first prefill would.
STANDIN = """
import http.server, os, sys, time
port, marks = int(sys.argv[1]), sys.argv[2]
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(600)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

#: ``python -m radixkv.bench fleet`` with ``VllmServer``'s command replaced by the stand-in.
DRIVER = """
import sys
from radixkv.testing.vllm_server import VllmServer
VllmServer.command = lambda self: [sys.executable, sys.argv[1], str(self.port), sys.argv[2]]
from radixkv.bench import fleet
sys.exit(fleet.main(["--instances", "2", "--requests", "4", "--no-kill", "--pin", "off", "--policies", "cost"]))
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_sigterm_stops_every_server_the_bench_started(tmp_path: Path) -> None:
    """A SIGTERM (a timeout, a CI cancel) while the servers warm up: the bench exits 143 within a
    bound, and no server it started is left running."""
    standin, marks = tmp_path / "standin.py", tmp_path / "marks"
    standin.write_text(STANDIN)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(standin), str(marks)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if marks.exists() and len(marks.read_text().split()) == 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
        pids = [int(p) for p in marks.read_text().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
        assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "a server outlived the bench"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in [int(p) for p in marks.read_text().split()] if marks.exists() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@given(low=st.integers(1024, 65535), width=st.integers(0, 40000))
def test_an_events_port_is_free_and_outside_the_source_ports(low: int, width: int) -> None:
    """The events endpoint is bound by the router after vLLM has started connecting to it: a port
    from the OS's source-port range can be taken first (the bench once failed so), so none is."""
    import socket
    from unittest import mock

    from radixkv.tools import s3server

    high = min(65535, low + width)
    with mock.patch.object(s3server, "_ephemeral_range", return_value=(low, high)):
        if low - 1 - 1024 < 1000 and high >= 65535:
            with pytest.raises(RuntimeError, match="no free port"):
                s3server.listen_port(tries=3)
            return
        port = s3server.listen_port()
    assert 1024 <= port <= 65535 and not low <= port <= high
    with socket.socket() as s:              # free: it binds
        s.bind(("127.0.0.1", port))


#: A stand-in for ``vllm serve`` that fails to start as vLLM does when its pool cannot hold the
#: model's context: the engine's exception logged with its prefix, then the API server's wrapper.
FAILING = """
import sys
print("(APIServer pid=1) WARNING 12-05 19:09:16 [x.py:1] like `OSError: [Errno 24] Too many open files`")
print("(EngineCore pid=2) ERROR 12-05 19:09:32 [core.py:1510] ValueError: To serve at least one request (4096)")
print("Traceback (most recent call last):")
print("RuntimeError: Engine core initialization failed. See root cause above.")
sys.exit(1)
"""


def test_a_server_that_fails_to_start_is_one_line_naming_its_cause_and_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """No traceback: one line with the first exception the server raised (not the wrapper, not a
    warning's example) and where its log is, exit status 1."""
    from radixkv.testing.vllm_server import VllmServer

    failing = tmp_path / "failing.py"
    failing.write_text(FAILING)
    monkeypatch.setattr(VllmServer, "command", lambda self: [sys.executable, str(failing)])
    assert fleet.main(["--instances", "2", "--requests", "4", "--no-kill", "--pin", "off", "--policies", "cost"]) == 1
    *before, last = capsys.readouterr().err.splitlines()
    assert all("Writing model shards" in line for line in before if line.strip()), before   # a save bar, then one line
    assert "vllm serve exited (1): ValueError: To serve at least one request (4096)" in last, last
    log = last.split("(its log: ")[1].split(")")[0]
    assert "Engine core initialization failed" in Path(log).read_text()


def test_a_conversations_next_turn_is_its_last_prompt_its_answer_and_a_question_sent_once_answered() -> None:
    """``--turns 3`` against a server that answers each prompt with 4 token ids after 0.1 s: each
    conversation sends 3 turns, each next prompt the last one, the ids it generated and the turn's
    question, sent after the last answer ended, asking for the ids, greedy, every max_tokens; the
    results list the first turns, then the later ones; a conversation whose turn failed (answered
    500, or an error event after its answer) ends."""
    import asyncio
    import json

    aiohttp_web = pytest.importorskip("aiohttp.web")
    seen: list[tuple[float, dict]] = []
    ended: dict[tuple[int, ...], float] = {}

    async def main() -> list[dict]:
        loop = asyncio.get_running_loop()

        async def completions(request: "aiohttp_web.Request") -> "aiohttp_web.StreamResponse":
            body = await request.json()
            seen.append((loop.time(), body))
            if body["prompt"][0] == 99:                 # a conversation the server fails
                return aiohttp_web.Response(status=500)
            resp = aiohttp_web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(0.1)
            answer = [len(body["prompt"]) % 997 + k for k in range(4)]
            for t in answer:
                await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [t]}]}).encode() + b"\n\n")
            if body["prompt"][0] == 98:                 # a whole answer, then an error
                await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
            usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"])}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
            ended[tuple(body["prompt"])] = loop.time()
            await resp.write_eof()
            return resp

        return await _drive_against(completions, [(0.0, [1, 2]), (0.05, [5]), (0.06, [99]), (0.07, [98])], 4, turns=3,
                                    question=lambda i, turn: [500 + 10 * i + turn])

    results = asyncio.run(main())
    assert [r.get("turn", 0) for r in results] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [r["outcome"] for r in results] == ["served", "served", "error", "error"] + ["served"] * 4
    bodies = {tuple(b["prompt"]): (at, b) for at, b in seen}
    assert len(bodies) == 8
    for i, first in ((0, [1, 2]), (1, [5])):
        prompt = first
        for turn in (1, 2):
            answer = [len(prompt) % 997 + k for k in range(4)]
            nxt = prompt + answer + [500 + 10 * i + turn]
            at, body = bodies[tuple(nxt)]
            assert at >= ended[tuple(prompt)], "sent before the last answer ended"
            assert body["return_token_ids"] and body["ignore_eos"] and body["temperature"] == 0.0
            prompt = nxt
    assert fleet.reuse_bound([(r["arrival"], r["_prompt"]) for r in results if "_prompt" in r], block=2,
                             answers=[r.get("_answer", []) for r in results if "_prompt" in r]) > \
        fleet.reuse_bound([(r["arrival"], r["_prompt"]) for r in results if "_prompt" in r], block=2)


def test_a_conversation_through_a_text_router_sends_its_answers_as_words_and_ends_at_an_unknown_word() -> None:
    """``--turns`` with ``--routers`` (text prompts): the next prompt is the words of the last one,
    its answer's ids and the question; the answer may not use id 0 (``logit_bias``), and one that
    does (the word tokenizer's unknown word, which no prompt can say) ends its conversation."""
    import asyncio
    import json

    aiohttp_web = pytest.importorskip("aiohttp.web")
    prompts: list[list[int]] = []

    async def completions(request: "aiohttp_web.Request") -> "aiohttp_web.StreamResponse":
        body = await request.json()
        ids = [int(w[1:]) for w in body["prompt"].split()]
        prompts.append(ids)
        assert body["logit_bias"] == {"0": -100} and body["return_token_ids"]
        resp = aiohttp_web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        answer = [0, 7] if ids[0] == 9 else [len(ids), 3]
        event = {"choices": [{"index": 0, "text": "", "token_ids": answer}], "usage": {"prompt_tokens": len(ids)}}
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    results = asyncio.run(_drive_against(completions, [(0.0, [1, 2]), (0.01, [9])], 2, as_text=True, turns=3,
                                         question=lambda i, turn: [40 + turn]))
    assert [p for p in prompts if p[0] == 1] == [[1, 2], [1, 2, 2, 3, 41], [1, 2, 2, 3, 41, 5, 3, 42]]
    assert [p for p in prompts if p[0] == 9] == [[9]]
    assert [r["outcome"] for r in results] == ["served"] * 4
    fleet._check_prompt_tokens(results)


def test_repeat_runs_the_routers_in_turn_and_gives_every_run_the_means_and_the_paired_differences(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--repeat N`` with ``--routers``: per seed the routers run in turn N times (A, B, A, B),
    each on fresh instances; the table has every run, the means (compared as single runs are), and
    each router's hit rate less the first's, round by round; ``--dump`` names each run's file."""
    import radixkv.integrations.transformers as transformers
    import radixkv.testing.word_tokenizer as word_tokenizer

    hits = {"radixkv:cost": [0.80, 0.84], "sglang:cache_aware": [0.82, 0.83]}
    calls: list[tuple[int, str, int | None, int]] = []

    def measure(args: argparse.Namespace, model: str, servers: Any, events: Any, spec: fleet.RouterSpec,
                work: Any, log: str, kill: bool = False, text: bool = False, seed: int = 0,
                run: int | None = None) -> dict[str, Any]:
        calls.append((seed, spec.name, run, len(servers)))
        assert run is not None and text
        hit = hits[spec.name][run - 1]
        return {"name": spec.name, "gpu_hit": hit, "all_hit": hit, "p50": 0.1 * run, "p95": 0.2, "p99": 0.3,
                "rps": 2.0, "preempted": run, "outcomes": {"served": 4, "error": 0, "lost": 0},
                "served_by": [3, 1] if run == 1 else [1, 3],     # fresh instances: the order means nothing
                "reasons": {"cost": 4.0} if spec.kind == "radixkv" else {}, "partial": False,
                "moved": {"fit": run} if spec.kind == "radixkv" else None}

    class Model:
        def save_pretrained(self, path: str) -> None:
            os.makedirs(path)

    monkeypatch.setattr(transformers, "random_model", lambda *a, **k: Model())
    monkeypatch.setattr(word_tokenizer, "save_word_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(fleet, "_servers", lambda *a, **k: ["a", "b"])
    monkeypatch.setattr(fleet, "_start_all", lambda *a, **k: 1.0)
    monkeypatch.setattr(fleet, "_stop_all", lambda servers: None)
    monkeypatch.setattr(fleet, "_measure", measure)
    out = tmp_path / "t.txt"
    assert fleet.main(["--routers", "radixkv:cost,sglang:cache_aware", "--repeat", "2", "--seed", "0,3",
                       "--requests", "4", "--pin", "off", "--out", str(out)]) == 0
    assert calls == [(seed, name, run, 2) for seed in (0, 3) for run in (1, 2)
                     for name in ("radixkv:cost", "sglang:cache_aware")]
    text = out.read_text()
    for name in hits:
        for run in (1, 2):
            assert f"{name} (run {run})" in text
    assert text.count("means over 2 runs") == 2
    mean_rows = [line for line in text.splitlines() if line.startswith(("radixkv:cost  ", "sglang:cache_aware  "))]
    assert len(mean_rows) == 4 and all(" 8/0/0  6/2 " in line for line in mean_rows)
    # the later turns moved, by reason: each run's behind radixkv's router, summed in the means
    assert all(line.endswith("moved 3 (fit 3)") for line in mean_rows if line.startswith("radixkv"))
    assert not any("moved" in line for line in mean_rows if line.startswith("sglang"))
    assert sum("moved 2 (fit 2)" in line for line in text.splitlines()) == 2      # run 2 of each seed
    assert "radixkv:cost vs sglang:cache_aware: GPU hit rate 82.0% vs 82.5% (0.99x)" in text
    assert ("radixkv:cost - sglang:cache_aware, GPU hit rate run by run: -2.0 / +1.0 points "
            "(mean -0.5, -2.0 to +1.0)") in text


@settings(max_examples=50, deadline=None)
@given(k=st.integers(0, 500), turn=st.one_of(st.none(), st.integers(1, 5)),
       outcome=st.sampled_from(["served", "error", "lost"]),
       usage=st.one_of(st.none(), st.just({}), st.just({"prompt_tokens_details": None}),
                       st.builds(lambda c: {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": c}},
                                 st.one_of(st.integers(0, 1 << 20), st.none(), st.just("7")))),
       why=st.one_of(st.none(), st.sampled_from(["cost", "copy", "fit", "retry"])))
def test_a_dumped_request_names_its_conversation_turn_and_the_tokens_its_instance_served_from_cache(
        k: int, turn: int | None, outcome: str, usage: Any, why: str | None) -> None:
    """``--dump``'s line of a request: what ``_drive`` recorded (``why``: the router's reason,
    ``None`` behind a router that gives none), its conversation (its own index when it opened one)
    and turn, and ``cached`` as the instance reported it in its usage, or ``None`` where it did not
    say (no answer, no details, not a count)."""
    res: dict[str, Any] = {"arrival": 1.5, "tokens": 9, "outcome": outcome, "ttft": 0.1, "instance": "0"}
    if why is not None:
        res["why"] = why
    if usage is not None:
        res["usage"] = usage
    if turn is not None:
        res.update(turn=turn, conversation=k // 2)
    line = fleet.dump_record(res, k)
    json.dumps(line)                                    # a JSON line
    reported = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    assert line == {"arrival": 1.5, "tokens": 9, "outcome": outcome, "ttft": 0.1, "instance": "0", "why": why,
                    "turn": turn or 0, "conversation": k if turn is None else k // 2,
                    "cached": reported if isinstance(reported, int) else None}


@settings(max_examples=100, deadline=None)
@given(convs=st.lists(st.lists(st.tuples(st.sampled_from(["0", "1", None]),
                                         st.sampled_from(["cost", "idle", "copy", "fit", "retry", None])),
                               min_size=1, max_size=5), max_size=8),
       shuffle=st.randoms(use_true_random=False))
def test_moved_turns_counts_the_later_turns_sent_elsewhere_by_the_routers_reason(convs: list[Any], shuffle: Any) -> None:
    """A conversation's later turn that went to another instance than the turn before it is counted
    under the reason the router gave (``unknown`` where none); turns whose instance or whose
    previous turn's instance is unknown are not; ``None`` when no such pair is known (another
    router names no instance), whatever order the results come in."""
    results: list[dict[str, Any]] = []
    for c, turns in enumerate(convs):
        for t, (inst, why) in enumerate(turns):
            res: dict[str, Any] = {"instance": inst, "why": why}
            if t:
                res.update(turn=t, conversation=c)
            results.append(res)
    # the first turns first, each its own conversation's index, as _drive orders them
    firsts = [r for r in results if "turn" not in r]
    later = [r for r in results if "turn" in r]
    shuffle.shuffle(later)
    ordered = firsts + later                # conversation c opened by result c
    expected: dict[str, int] = {}
    known = 0
    for turns in convs:
        for (before, _), (inst, why) in zip(turns, turns[1:]):
            if before is not None and inst is not None:
                known += 1
                if inst != before:
                    expected[why or "unknown"] = expected.get(why or "unknown", 0) + 1
    assert fleet.moved_turns(ordered) == (expected if known else None)
