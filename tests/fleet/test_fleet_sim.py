"""The fleet simulator (``python -m radixkv.bench fleet_sim``): deterministic per seed; with one
unbounded instance and no load it reuses exactly the trace's infinite-cache hits (a property over
random traces); with one instance every policy gives the same TTFTs; Poisson arrivals of equal
prefills wait as the M/D/1 formula says; its vLLM-CPU profile is the fit of the committed
measurements, within the error it states."""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, example, given, settings, strategies as st

pytest.importorskip("simpy")
pytest.importorskip("msgspec")

from radixkv.bench.fleet_sim import (Fleet, SimRequest, calibration_text, fit_vllm_cpu, fit_vllm_cpu_decode, ideal_hits,
                                     scale_to_load, simulate, workload)
from radixkv.fleet.routing import POLICIES, PROFILES, CostModel

ROOT = Path(__file__).resolve().parents[2]
MODEL = PROFILES["h100-8b"]


def run(reqs: list[SimRequest], bt: int, **kw: object) -> dict:
    args = dict(instances=1, policy="cost", model=MODEL, pool_tokens=1 << 22, cpu_tokens=0, budget=8192, check=True)
    args.update(kw)
    return simulate(reqs, bt, **args)  # type: ignore[arg-type]


@st.composite
def traces(draw: st.DrawFn) -> tuple[list[SimRequest], int]:
    """Requests whose prompts branch off a few shared roots, in Mooncake's shape (chained block
    ids; the last block maybe partial), far apart in time."""
    bt = draw(st.sampled_from([16, 64, 512]))
    roots = [[draw(st.integers(0, 10**6)) for _ in range(draw(st.integers(1, 6)))] for _ in range(draw(st.integers(1, 3)))]
    reqs = []
    for i in range(draw(st.integers(1, 25))):
        root = draw(st.sampled_from(roots))
        blocks = root[:draw(st.integers(0, len(root)))] + [draw(st.integers(0, 10**6)) for _ in range(draw(st.integers(0, 3)))]
        if not blocks:
            blocks = [draw(st.integers(0, 10**6))]
        tokens = len(blocks) * bt - draw(st.integers(0, bt - 1))
        reqs.append(SimRequest(i, 1000.0 * i, blocks, tokens, draw(st.integers(1, 4))))
    return reqs, bt


@settings(max_examples=40, deadline=None)
@given(trace=traces(), policy=st.sampled_from(POLICIES))
def test_one_unbounded_instance_without_load_reuses_the_infinite_cache_hits(trace: tuple, policy: str) -> None:
    reqs, bt = trace
    out = run(reqs, bt, policy=policy)
    hits = ideal_hits(reqs, bt)
    assert out["hit"] == sum(hits) / sum(r.tokens for r in reqs)
    # and each request alone: its TTFT is the idle engine's time for what it computes
    for r, h, ttft in zip(reqs, hits, out["ttft"]):
        steps = -(-(r.tokens - h) // 8192)
        assert ttft == pytest.approx(steps * MODEL.fixed_s + MODEL.prefill(r.tokens - h))


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    reqs, bt = workload("hot", 300, seed=3)
    scale_to_load(reqs, bt, MODEL, 4, 0.9)
    kw = dict(instances=4, pool_tokens=16_384, cpu_tokens=16_384, policy="cost", seed=3)
    a, b = run(reqs, bt, **kw), run(reqs, bt, **kw)
    assert a["ttft"] == b["ttft"] and a["served"] == b["served"] and a["hit"] == b["hit"]
    other, bt2 = workload("hot", 300, seed=4)
    scale_to_load(other, bt2, MODEL, 4, 0.9)
    assert run(other, bt2, **kw)["ttft"] != a["ttft"]


@pytest.mark.slow                 # a simulated fleet per policy (seconds): `make test` runs it
def test_with_one_instance_every_policy_gives_the_same_ttfts() -> None:
    reqs, bt = workload("tenants", 300, seed=1)
    scale_to_load(reqs, bt, MODEL, 1, 0.8)
    outs = {p: run(reqs, bt, policy=p, pool_tokens=16_384, cpu_tokens=8_192) for p in POLICIES}
    first = outs["cost"]
    for p, out in outs.items():
        assert out["ttft"] == first["ttft"] and out["hit"] == first["hit"], p


@pytest.mark.slow                 # 6000 simulated requests per load (seconds): `make test` runs it
@pytest.mark.parametrize("rho", [0.3, 0.6])
def test_poisson_arrivals_of_equal_prefills_wait_as_md1_says(rho: float) -> None:
    """One instance, unique prompts of L tokens (no hits), one token out, a step budget of L: the
    service is deterministic, D = fixed + prefill(L); the mean wait is rho D / (2 (1 - rho))."""
    bt, length, n = 64, 1024, 6000
    rng = random.Random(7)
    service = MODEL.fixed_s + MODEL.prefill(length)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rho / service)
        reqs.append(SimRequest(i, t, list(range(i * 100, i * 100 + length // bt)), length, 1))
    out = run(reqs, bt, budget=length, pool_tokens=8 * length)
    assert out["hit"] == 0
    wait = out["mean"] - service
    want = rho * service / (2 * (1 - rho))
    assert wait == pytest.approx(want, rel=0.08), (wait, want)


def test_the_vllm_cpu_profile_is_the_fit_of_the_committed_measurements() -> None:
    fit = fit_vllm_cpu(ROOT / "benchmarks" / "results" / "vllm_cpu.txt")
    profile = PROFILES["vllm-cpu"]
    assert profile.fixed_s == pytest.approx(fit["fixed_s"], rel=0.01)
    assert profile.prefill_s_per_token == pytest.approx(fit["prefill_s_per_token"], rel=0.01)
    for medium, per in fit["load_s_per_token"].items():
        assert profile.load_s_per_token[medium] == pytest.approx(per, rel=0.01), medium
    # the error the profile states (radixkv.fleet.routing) bounds every measured row
    assert fit["max_rel_error"] <= 0.44
    for label, n, measured, fitted in fit["rows"]:
        if label in ("no cache", "resident"):
            assert abs(fitted - measured) / measured <= 0.25, (label, n)
    text = calibration_text(str(ROOT / "benchmarks" / "results" / "vllm_cpu.txt"))
    assert "max relative error" in text


@settings(max_examples=60, deadline=None)
@given(fixed=st.floats(0.0, 0.05), per=st.floats(1e-5, 1e-3), square=st.floats(0.0, 1e-7),
       loads=st.lists(st.floats(0.0, 1e-4), min_size=3, max_size=3), noise=st.lists(st.floats(0.8, 1.25), min_size=15,
                                                                              max_size=15))
def test_the_ttft_fit_never_gives_a_negative_constant(tmp_path_factory: Any, fixed: float, per: float, square: float,
                                                     loads: list[float], noise: list[float]) -> None:
    """Any table of TTFTs (linear, or growing faster than linear as attention does, with noise):
    every fitted constant is >= 0, and a table that is exactly linear is fitted exactly."""
    lengths, q = (2048, 4096, 8192), 256

    def table(square: float, noise: list[float]) -> Any:
        def ttft(computed: int, loaded: int, medium: int | None) -> float:
            return (fixed + per * computed + square * computed ** 2
                    + (loads[medium] * loaded if medium is not None else 0))

        rows = {"no cache": [ttft(n + q, 0, None) for n in lengths],
                "vllm prefix cache (resident)": [ttft(q, 0, None)] * 3,
                "radixkv cpu tier": [ttft(q, n, 0) for n in lengths],
                "radixkv lmdb (restart)": [ttft(q, n, 1) for n in lengths],
                "radixkv s3 (second process)": [ttft(q, n, 2) for n in lengths]}
        it = iter(noise)
        path = tmp_path_factory.mktemp("fit") / "vllm.txt"
        path.write_text("TTFT, ms    2K + 256    4K + 256    8K + 256\n" + "".join(
            f"{label:40s}" + "".join(f"  {t * 1000 * next(it):14.8f} x 1.0" for t in times) + "\n"
            for label, times in rows.items()))
        return fit_vllm_cpu(path)

    fit = table(square, noise)
    assert fit["fixed_s"] >= 0 and fit["prefill_s_per_token"] >= 0 and min(fit["load_s_per_token"].values()) >= 0
    exact = table(0.0, [1.0] * 15)
    assert exact["max_rel_error"] < 1e-4
    assert exact["prefill_s_per_token"] == pytest.approx(per, rel=1e-3)


def test_the_fleet_models_profile_is_the_fit_of_its_committed_measurements() -> None:
    """``vllm-cpu-fleet``: the fit of ``bench vllm`` on the model ``bench fleet`` serves, within the
    error its comment states (17% on every row but the CPU tier's first load), and the committed
    calibration table is what ``--calibrate`` prints for it."""
    results = ROOT / "benchmarks" / "results"
    fit = fit_vllm_cpu(results / "vllm_cpu_fleet_model.txt")
    decode = fit_vllm_cpu_decode(results / "vllm_cpu_fleet_model_decode.txt")
    profile = PROFILES["vllm-cpu-fleet"]
    assert profile.fixed_s == pytest.approx(fit["fixed_s"], rel=0.01)
    assert profile.prefill_s_per_token == pytest.approx(fit["prefill_s_per_token"], rel=0.01)
    for medium, per in fit["load_s_per_token"].items():
        assert profile.load_s_per_token[medium] == pytest.approx(per, rel=0.01), medium
    assert profile.decode_step_s == pytest.approx(decode["decode_step_s"], rel=0.01)
    assert profile.decode_s_per_seq == pytest.approx(decode["decode_s_per_seq"], rel=0.01)
    worst = [(label, n) for label, n, measured, fitted in fit["rows"] if abs(fitted - measured) / measured > 0.17]
    assert worst == [("cpu", 1024)], worst
    assert decode["max_rel_error"] <= 0.013
    text = calibration_text(str(results / "vllm_cpu_fleet_model.txt"), str(results / "vllm_cpu_fleet_model_decode.txt"))
    committed = (results / "fleet_sim_calibration_fleet_model.txt").read_text()
    assert text.split("\n", 1)[1] == committed.split("\n", 1)[1].rstrip("\n")


def test_the_vllm_cpu_decode_costs_are_the_fit_of_the_committed_measurements() -> None:
    table = ROOT / "benchmarks" / "results" / "vllm_cpu_decode.txt"
    fit = fit_vllm_cpu_decode(table)
    profile = PROFILES["vllm-cpu"]
    assert profile.decode_step_s == pytest.approx(fit["decode_step_s"], rel=0.01)
    assert profile.decode_s_per_seq == pytest.approx(fit["decode_s_per_seq"], rel=0.01)
    assert [b for b, _, _ in fit["rows"]] == [1, 2, 4, 8]
    # the error the profile states (radixkv.fleet.routing) bounds every measured batch size
    assert fit["max_rel_error"] <= 0.07
    text = calibration_text(str(ROOT / "benchmarks" / "results" / "vllm_cpu.txt"), str(table))
    committed = (ROOT / "benchmarks" / "results" / "fleet_sim_calibration.txt").read_text()
    assert "decode step =" in text and text.split("\n", 1)[1] == committed.split("\n", 1)[1].rstrip("\n")


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="instances"):
        run([SimRequest(0, 0.0, [1], 10, 1)], 16, instances=0)
    with pytest.raises(ValueError, match="pool_tokens"):          # a prompt no pool could ever hold
        run([SimRequest(0, 0.0, list(range(10)), 640, 1)], 64, pool_tokens=128)
    with pytest.raises(ValueError, match="workload"):
        workload("zipf", 10, 0)
    with pytest.raises(ValueError, match="trace"):
        workload("mooncake", 10, 0)
    assert isinstance(MODEL, CostModel)


def test_the_index_the_router_reads_holds_what_the_pools_hold() -> None:
    """The instances' KV events reach the index under the names the router computes: after a run,
    for every prompt and instance, the index's run (any medium) covers what that pool holds."""
    from radixkv.bench.fleet_sim import Fleet

    reqs, bt = workload("tenants", 200, seed=2)
    scale_to_load(reqs, bt, MODEL, 3, 0.7)
    fleet = Fleet(3, "prefix", MODEL, bt, pool_tokens=8_192, cpu_tokens=4_096, budget=8192)
    fleet.run(reqs)
    fleet.check()
    seen = 0
    for r in reqs:
        spread = fleet.index.lookup_spread(fleet.names(r))
        for inst in fleet.instances:
            pool = inst.resident(r)
            assert spread.get(inst.name, (0,))[0] >= pool, (r.rid, inst.name)
            seen += pool
    assert seen > 0, "no pool held anything: the check checked nothing"


def test_the_goals_check_reads_the_table_and_names_each_miss() -> None:
    from radixkv.bench.fleet_sim import goals

    table = """workload     n  load seed policy           hit    p50 s    p95 s    p99 s  served min/max
tenants      4  0.50    0 cost           90.0%    0.100    0.300    0.400  10/12
tenants      4  0.50    0 prefix         80.0%    0.200    0.500    0.600  10/12
tenants      4  0.50    0 round_robin    50.0%    0.400    0.900    1.000  11/11
hot          8  0.95    0 cost           70.0%    0.500    0.800    0.900  10/12
hot          8  0.95    1 cost           70.0%    0.500    0.800    0.900  10/12
hot          8  0.95    0 prefix         90.0%    0.300    0.900    1.000  10/12
hot          8  0.95    1 prefix         90.0%    0.300    0.900    1.000  10/12""".splitlines()
    out = goals(table)
    assert out[-1].startswith("goals: 1 of 2")
    assert len(out) == 2 and out[0].startswith("MISSED hot n=8 load=0.95") and "p50 0.500 s > prefix's 0.300 s (worse on 2 of 2 seeds)" in out[0]
    assert "hit 70.0% < 90% of prefix's 90.0% (worse on 2 of 2 seeds)" in out[0]
    # a rerun's row replaces the same cell, seed and policy's (tables concatenated); a summary is skipped
    rerun = table + ["goals: 1 of 2 (workload, size, load) cells met by cost (means over seeds)",
                     "hot          8  0.95    1 cost          100.0%    0.500    0.800    0.900  10/12"]
    assert goals(rerun)[0] == "MISSED hot n=8 load=0.95: p50 0.500 s > prefix's 0.300 s (worse on 2 of 2 seeds)"
    # a miss made by one seed says so
    one = table[:4] + [table[4], table[5].replace("0.500", "0.250"), table[6], table[7]]
    assert "p50 0.375 s > prefix's 0.300 s (worse on 1 of 2 seeds)" in goals(one)[0]
    # two runs of other configurations (their "# profile" lines) in one table are checked apart:
    # the second run's rows do not replace the first's
    first = ["# profile h100-8b (x): prefill 1 us/token; pool 8192, budget 8192"] + table[:4]
    second = ["# profile h100-8b (x): prefill 1 us/token; pool 32768, budget 8192",
              "tenants      4  0.50    0 cost           90.0%    0.500    0.300    0.400  10/12",
              "tenants      4  0.50    0 prefix         80.0%    0.200    0.500    0.600  10/12"]
    out = goals(first + second)
    assert out[-1].startswith("goals: 1 of 2 (run, workload")
    assert out[0] == ("MISSED tenants n=4 load=0.50 [pool 32768, budget 8192]: p50 0.500 s > prefix's 0.200 s "
                      "(worse on 1 of 1 seeds)")
    # so are runs whose commands ask for other numbers of requests (inside --like-fleet too): the
    # same rate gives the same load
    cmd = "# python -m radixkv.bench fleet_sim '--like-fleet=--requests {} --rate 2' --policies cost,prefix"
    out = goals([cmd.format(96)] + first + [cmd.format(400)] + [first[0]] + second[1:])
    assert out[-1].startswith("goals: 1 of 2 (run, workload")
    assert out[0] == ("MISSED tenants n=4 load=0.50 [pool 8192, budget 8192, 400 requests]: p50 0.500 s > prefix's "
                      "0.200 s (worse on 1 of 1 seeds)")
    assert goals([cmd.format(96)] + first + [cmd.format(96)] + [first[0]] + second[1:])[-1].startswith("goals: 0 of 1")


@pytest.mark.parametrize("where", ["p2p", "shared"])
def test_a_prefix_another_instance_computed_is_loaded_not_recomputed(where: str) -> None:
    """Round-robin sends a repeated prompt to the other instance: with p2p (the other pool) or a
    shared tier it loads the prefix at that medium's cost; without, it recomputes it."""
    bt = 64
    reqs = [SimRequest(i, 100.0 * i, list(range(1, 33)), 32 * bt, 1) for i in range(2)]
    base = run(reqs, bt, instances=2, policy="round_robin")
    other = run(reqs, bt, instances=2, policy="round_robin", **{where: True})
    assert base["ttft"][1] == pytest.approx(MODEL.fixed_s + MODEL.prefill(32 * bt))
    medium = "PEER" if where == "p2p" else "SHARED"
    want = MODEL.fixed_s + MODEL.load(medium, 31 * bt) + MODEL.prefill(bt)
    assert other["ttft"][1] == pytest.approx(want) and other["hit"] == 31 / 64



@settings(max_examples=30, deadline=None)
@given(instances=st.integers(2, 6), same=st.integers(2, 8), prefix_blocks=st.integers(1, 40),
       policy=st.sampled_from(POLICIES), gap=st.sampled_from([0.0, 1e-4]))
def test_a_peer_loads_only_blocks_whose_step_has_ended(instances: int, same: int, prefix_blocks: int,
                                                       policy: str, gap: float) -> None:
    """A burst of one prefix into an idle fleet with p2p: every instance's first step starts before
    any step has ended, so no request of it loads from a peer, whatever the policy; an instance
    that is sent it computes the prefix itself.  (The blocks a step schedules are in its own pool
    for its later requests at once, but a peer cannot read KV that is still being computed.)"""
    bt = 16
    blocks = list(range(1, prefix_blocks + 1))
    reqs = [SimRequest(i, i * gap, blocks + [10_000 + i], (prefix_blocks + 1) * bt, 1) for i in range(same)]
    fleet = Fleet(instances, policy, MODEL, bt, pool_tokens=1 << 20, cpu_tokens=0, budget=1 << 20, p2p=True)
    fleet.run(reqs)
    fleet.check()
    first = {}
    for r in sorted(reqs, key=lambda r: r.arrival):
        first.setdefault(r.instance, r)
    for r in reqs:
        assert r.below_tokens == 0, f"request {r.rid} loaded {r.below_tokens} tokens a peer had not computed yet"
        want = 0 if first[r.instance] is r else prefix_blocks * bt
        assert r.hit_tokens == want
    # once a step has ended, a peer's blocks are a load: the same prompt again, later, elsewhere
    early = SimRequest(0, 0.0, blocks + [10_000], (prefix_blocks + 1) * bt, 1)
    late = SimRequest(1, 10.0, blocks + [20_000], (prefix_blocks + 1) * bt, 1)
    fleet2 = Fleet(2, "round_robin", MODEL, bt, pool_tokens=1 << 20, cpu_tokens=0, budget=1 << 20, p2p=True)
    fleet2.run([early, late])
    assert late.instance != early.instance and late.below_tokens == prefix_blocks * bt

@settings(max_examples=30, deadline=None)
@given(same=st.integers(2, 6), prefix_blocks=st.integers(1, 40), question=st.integers(1, 300),
       budget=st.sampled_from([512, 2048, 8192]))
def test_a_request_scheduled_after_another_reuses_the_blocks_that_step_computes(same: int, prefix_blocks: int,
                                                                               question: int, budget: int) -> None:
    """As vLLM's scheduler caches a request's blocks when it schedules their tokens, requests of
    one prefix arriving together on one instance compute it once: the first computes the prefix,
    every later one reuses it, in the same step or the next (the budget permitting)."""
    bt = 16
    blocks = list(range(1, prefix_blocks + 1))
    reqs = [SimRequest(i, 0.0, blocks + [10_000 + i] * (-(-question // bt)), prefix_blocks * bt + question, 1)
            for i in range(same)]
    out = run(reqs, bt, budget=budget)          # (simulate runs copies: its answer says what each reused)
    assert out["hit"] == pytest.approx((same - 1) * prefix_blocks * bt / sum(r.tokens for r in reqs))


@settings(max_examples=30, deadline=None)
@given(trace=traces(), as_text=st.booleans(), shuffle=st.randoms(use_true_random=False))
def test_a_trace_file_of_any_block_size_and_id_type_replays_its_infinite_cache_hits(
        tmp_path_factory: Any, trace: tuple, as_text: bool, shuffle: random.Random) -> None:
    """A Mooncake-format file (its ids as ints or strings, its lines in any order) reads back as the
    requests it was written from: the block size its lengths say, the infinite-cache hits."""
    import json

    from radixkv.bench.fleet_sim import TRACE_BLOCKS, read_trace, trace_block

    reqs, bt = trace
    lines = [json.dumps({"timestamp": r.arrival, "input_length": r.tokens, "output_length": r.output,
                         "hash_ids": [f"h{b}" if as_text else b for b in r.blocks]}) for r in reqs]
    shuffle.shuffle(lines)
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = read_trace(str(path))
    size = trace_block(rows)
    assert size in TRACE_BLOCKS and all(len(r["hash_ids"]) == -(-r["input_length"] // size) for r in rows)
    got, got_bt = workload("mooncake", len(reqs), 0, str(path), bt)
    assert got_bt == bt and [r.tokens for r in got] == [r.tokens for r in reqs]
    assert ideal_hits(got, bt) == ideal_hits(reqs, bt)


def test_without_workloads_it_runs_the_synthetic_ones_and_the_trace_when_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The trace is not shipped with the library: without ``--workloads`` the command runs
    ``tenants``, ``hot`` and ``fleetwide``, and ``mooncake`` first when ``--trace`` names one."""
    from radixkv.bench import fleet_sim

    small = ["--instances", "2", "--loads", "0.5", "--seeds", "0", "--requests", "12", "--policies", "round_robin",
             "--jobs", "1"]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"timestamp": {t}, "input_length": 1000, "output_length": 4, "hash_ids": [1, {t + 2}]}}\n'
                            for t in range(12)))
    for argv, kinds in ((small, ["tenants", "hot", "fleetwide"]),
                        ([*small, "--trace", str(path)], ["mooncake", "tenants", "hot", "fleetwide"])):
        assert fleet_sim.main(argv) == 0
        out = capsys.readouterr()
        rows = [line.split()[0] for line in out.out.splitlines() if line and not line.startswith(("#", "goals", "MISSED", "workload"))]
        assert rows == kinds and not out.err, out


def test_summarize_judges_any_policy_as_the_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--summarize TABLE --judge POLICY`` checks the goals for POLICY against the table's other
    policies, as ``goals(lines, default=POLICY)`` does; without ``--judge``, for ``cost``."""
    from radixkv.bench import fleet_sim

    table = tmp_path / "t.txt"
    policies = ["cost", "prefix", "round_robin"]
    assert fleet_sim.main(["--workloads", "hot", "--instances", "2", "--loads", "0.5,0.9", "--seeds", "0,1",
                           "--requests", "24", "--policies", ",".join(policies), "--out", str(table), "--jobs", "1"]) == 0
    capsys.readouterr()
    lines = table.read_text().splitlines()
    for judge in [None, *policies]:
        assert fleet_sim.main(["--summarize", str(table)] + (["--judge", judge] if judge else [])) == 0
        got = capsys.readouterr().out.splitlines()
        assert got == fleet_sim.goals(lines, judge or "cost") and f"met by {judge or 'cost'} " in got[-1]


def test_a_bad_trace_or_argument_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from radixkv.bench import fleet_sim

    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
    cases = {"not json": "is not JSON", "[1, 2]": "not a JSON object",
             '{"timestamp": 0, "input_length": 600, "output_length": 5}': "no 'hash_ids'",
             good.replace("600", "0"): "input_length 0", good.replace("[1, 2]", "[true]"): "hash_ids",
             good.replace('"timestamp": 0', '"timestamp": "x"'): "timestamp", "": "holds no requests"}
    for k, (text, says) in enumerate(cases.items()):
        path = tmp_path / f"t{k}.jsonl"
        path.write_text(good + "\n" + text + "\n" if text and k != 6 else text)
        assert fleet_sim.main(["--workloads", "mooncake", "--trace", str(path), "--instances", "2"]) == 2, text
        out = capsys.readouterr()
        assert says in out.err and out.err.count("\n") == 1 and not out.out, (text, out)
    for argv, says in ((["--trace", str(tmp_path / "none.jsonl"), "--workloads", "mooncake"], "cannot read"),
                       (["--instances", "2,x"], "--instances"), (["--loads", "0"], "--loads"),
                       (["--workloads", "zipf"], "--workloads"), (["--requests", "0"], "--requests"),
                       (["--trace-block", "0"], "--trace-block"), (["--budget", "0"], "--budget"),
                       (["--summarize", str(tmp_path / "none.txt")], "--summarize"),
                       (["--pool-tokens", "0"], "--pool-tokens"), (["--cpu-tokens", "-1"], "--cpu-tokens"),
                       (["--workloads", "tenants", "--policies", "cost,fastest"], "--policies"),
                       (["--calibrate", str(tmp_path / "t0.jsonl")], "--calibrate"),
                       (["--decode-table", str(tmp_path / "t0.jsonl")], "--decode-table"),
                       (["--out", str(tmp_path / "no" / "such" / "t.txt")], "--out"),
                       (["--requests", "x"], "--requests"), (["--no-such-flag"], "--no-such-flag"),
                       (["--judge", "prefix"], "--judge"),
                       (["--summarize", str(tmp_path / "t0.jsonl"), "--judge", "fastest"], "--judge")):
        assert fleet_sim.main(argv) == 2
        out = capsys.readouterr()
        assert says in out.err and out.err.count("\n") == 1 and not out.out, (argv, out)


@settings(max_examples=25, deadline=None)
@given(blocks=st.integers(1, 40), tail=st.integers(1, 15))
def test_a_steps_kv_events_reach_the_index_when_the_step_ends(blocks: int, tail: int) -> None:
    """As vLLM publishes a step's KV events after the model ran: halfway through the step that
    computes a prompt, its blocks are in the instance's pool (for its own later requests) but not
    in the fleet index the router reads; when the step has ended, they are."""
    bt = 16
    r = SimRequest(0, 0.0, list(range(1, blocks + 1)) + [10_000], blocks * bt + tail, 1)
    fleet = Fleet(1, "cost", MODEL, bt, pool_tokens=1 << 16, cpu_tokens=0, budget=1 << 20)
    step = MODEL.fixed_s + MODEL.prefill(r.tokens)
    seen: list[tuple[int, dict]] = []

    def probe() -> Any:
        for at in (step / 2, step * 1.5):
            yield fleet.env.timeout(at - fleet.env.now)
            seen.append((fleet.instances[0].resident(r), dict(fleet.index.lookup(r.names))))

    fleet.env.process(probe())
    fleet.run([r])
    (pool_mid, index_mid), (pool_after, index_after) = seen
    assert pool_mid == blocks and index_mid == {}
    assert pool_after == blocks and index_after["i0"].blocks == blocks


@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 10**6), seed=st.integers(0, 1000), n=st.integers(1, 250))
def test_a_shape_is_drawn_from_its_number_and_its_turns_extend_what_came_before(k: int, seed: int, n: int) -> None:
    """``shapeK``: its parameters come from K alone, its requests from K and the seed; every prompt
    is in whole blocks but its last, within the longest a shape makes; a prompt's blocks are some
    already seen (a tenant's head, or a session's earlier turn) and then new ones, never the other way."""
    from radixkv.bench.fleet_sim import SHAPE_CHOICES, SHAPE_MAX_TOKENS, default_pool, shape_params

    p = shape_params(k)
    assert p == shape_params(k) and all(p[name] in choices for name, choices in SHAPE_CHOICES.items())
    reqs, bt = workload(f"shape{k}", n, seed)
    again, _ = workload(f"shape{k}", n, seed)
    assert [(r.arrival, r.blocks, r.tokens, r.output) for r in reqs] == [(r.arrival, r.blocks, r.tokens, r.output)
                                                                         for r in again]
    assert len(reqs) == n and [r.rid for r in reqs] == list(range(n))
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:]))
    seen: set[int] = set()
    heads = p["fleetwide"] // bt
    for r in reqs:
        assert len(r.blocks) == -(-r.tokens // bt) and r.tokens <= SHAPE_MAX_TOKENS and r.output == p["output"]
        old = next((j for j, b in enumerate(r.blocks) if b not in seen), len(r.blocks))
        assert not seen.intersection(r.blocks[old:]), "a block seen before after a new one"
        if p["turns"] == 1:
            assert old <= (p["fleetwide"] + SHAPE_MAX_TOKENS // 2) // bt, "without turns only a head is reused"
        if heads:
            assert r.blocks[:heads] == reqs[0].blocks[:heads], "the fleet-wide prefix heads every prompt"
        seen.update(r.blocks)
    pool = default_pool(f"shape{k}", reqs, bt)
    assert pool >= 2 * max(r.tokens for r in reqs) and pool % bt == 0


@settings(max_examples=8, deadline=None)
@given(k=st.integers(0, 10**6), policy=st.sampled_from(["cost", "prefix", "round_robin"]))
def test_a_shape_runs_on_its_own_pool(k: int, policy: str) -> None:
    from radixkv.bench.fleet_sim import default_pool

    reqs, bt = workload(f"shape{k}", 40, 0)
    scale_to_load(reqs, bt, MODEL, 2, 0.8)
    pool = default_pool(f"shape{k}", reqs, bt)
    out = run(reqs, bt, instances=2, policy=policy, pool_tokens=pool, cpu_tokens=pool)
    assert sum(out["served"]) == len(reqs) and all(t > 0 for t in out["ttft"])


def test_a_shape_is_named_by_a_plain_number() -> None:
    from radixkv.bench import fleet_sim

    for kind in ("shape", "shapex", "shape-1", "shape01", "shape\u0661"):
        with pytest.raises(ValueError, match="workload"):
            workload(kind, 10, 0)
        assert fleet_sim.main(["--workloads", kind]) == 2


@pytest.mark.parametrize("shape,instances,load,n", [("shape5", 4, 0.8, 150), ("shape5", 8, 0.5, 150),
                                                    ("shape23", 8, 0.5, 200)])
def test_a_prompt_nearly_every_request_shares_is_served_by_every_instance(shape: str, instances: int, load: float,
                                                                         n: int) -> None:
    """One system prompt heads nearly every request (shapes 5 and 23: one tenant, a small pool): the
    cost policy copies it to instances that wait less as its share of the arrivals calls for, so
    every instance serves at least a quarter of its even share (without the copies, the instances
    that first held it served everything and 1 to 4 of them nothing)."""
    from radixkv.bench.fleet_sim import default_pool

    reqs, bt = workload(shape, n, 0)
    scale_to_load(reqs, bt, MODEL, instances, load)
    pool = default_pool(shape, reqs, bt)
    out = run(reqs, bt, instances=instances, policy="cost", pool_tokens=pool, cpu_tokens=pool)
    assert min(out["served"]) >= len(reqs) / instances / 4, out["served"]


@pytest.mark.parametrize("shape,instances,load,seed", [("shape26", 4, 0.8, 1), ("shape26", 8, 0.5, 0),
                                                       ("shape28", 16, 0.8, 1)])
def test_a_fleet_wide_prompt_before_a_few_tenants_leaves_no_instance_idle(shape: str, instances: int, load: float,
                                                                          seed: int) -> None:
    """A fleet-wide system prompt every request shares, then one of a few tenants' (shapes 26 and
    28): the fleet-wide part's share of the arrivals calls for every instance, though no one
    tenant's does, and the cost policy copies it by that part's share, so every instance serves at
    least an eighth of its even share (copies asked of the tenant's whole prompt alone, with the
    share's instances rounded down, left one to three instances serving nothing on each)."""
    from radixkv.bench.fleet_sim import default_pool

    reqs, bt = workload(shape, 300, seed)
    scale_to_load(reqs, bt, MODEL, instances, load)
    pool = default_pool(shape, reqs, bt)
    out = run(reqs, bt, instances=instances, policy="cost", pool_tokens=pool, cpu_tokens=pool)
    assert min(out["served"]) >= len(reqs) / instances / 8, out["served"]


@pytest.mark.parametrize("instances,load", [(4, 0.5), (8, 0.95)])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_stream_of_one_prompt_on_a_cold_fleet_is_computed_on_every_instance_before_its_first_token(
        instances: int, load: float, seed: int) -> None:
    """One system prompt heads every request (shape 5), arriving as a stream on a cold fleet: once
    the first instance has been computing it for ``STREAM_AFTER`` of its prefill, the requests
    that keep arriving are a stream's, and computing the prompt again elsewhere is not charged as
    a copy, so every instance is sent it before its first token comes back (before the rule, 2 of 4
    and 6 of 8 were; the others idled while the first ones queued).  A
    burst arriving at once still follows its first request (the tests of bursts in
    ``test_routing.py``)."""
    from radixkv.bench.fleet_sim import default_pool

    reqs, bt = workload("shape5", 150, seed)
    scale_to_load(reqs, bt, MODEL, instances, load)
    pool = default_pool("shape5", reqs, bt)
    fleet = Fleet(instances, "cost", MODEL, bt, pool_tokens=pool, cpu_tokens=pool, budget=8192, seed=seed,
                      rebalance=True)
    fleet.run(reqs)
    fleet.check()
    first_token = min(r.arrival + r.ttft for r in reqs)
    before = [r for r in reqs if r.arrival < first_token]
    assert len({r.instance for r in before}) == instances, sorted((r.arrival, r.instance) for r in before)


@pytest.mark.parametrize("shape,instances,load,n", [("shape5", 8, 0.8, 400), ("shape23", 4, 0.8, 300)])
def test_the_router_pins_what_each_instances_requests_in_flight_hold_and_sends_a_prompt_where_it_fits(
        shape: str, instances: int, load: float, n: int) -> None:
    """On shapes whose pools fill (one prompt nearly every request shares, a pool of 1/8 of the
    distinct tokens), at every arrival the blocks the router counts as pinned on an instance are
    the union of the blocks of the requests in flight there (arrived, not ended), each pool is the
    simulator's; a prompt the fit rule moved fits where it went, or falls short there by fewer
    pages than where the cost put it (``overcommit``), and the rule did move some to where it fits."""
    from radixkv.bench.fleet_sim import _Instance, default_pool
    from radixkv.fleet.routing import Chooser

    reqs, bt = workload(shape, n, 0)
    scale_to_load(reqs, bt, MODEL, instances, load)
    pool = default_pool(shape, reqs, bt)
    flight: dict[str, dict[int, SimRequest]] = {}
    moved: list[bool] = []                  # per move: whether it fits where it went
    fit = Chooser._fit

    def watched_fit(chooser: Chooser, scored: list, names: list, own: int, wait: dict, now: float) -> bool:
        short = {s[4].name: chooser.overcommit(s[4], names, own) for s in scored}
        first = scored[0][4].name
        did = fit(chooser, scored, names, own, wait, now)
        if did:
            went = scored[0][4].name
            assert short[went] <= 0 or short[went] < short[first], "moved where it falls short by as many pages"
            moved.append(short[went] <= 0)
        return did

    class Watched(Fleet):
        def arrive(self, r: SimRequest) -> None:
            for inst in self.instances:
                held = set().union(*(q.names for q in flight.get(inst.name, {}).values()))
                assert set(self.chooser._pinned.get(inst.name, {})) == held, inst.name
                assert self.backend[inst.name].pool_blocks == self.pool_blocks
            super().arrive(r)
            flight.setdefault(r.instance, {})[r.rid] = r
            self.chooser.check(self.backends)

    end = _Instance.end

    def ended(inst: _Instance, r: SimRequest) -> None:
        del flight[inst.name][r.rid]
        end(inst, r)

    fleet = Watched(instances, "cost", MODEL, bt, pool_tokens=pool, cpu_tokens=pool, budget=8192)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Instance, "end", ended)
        mp.setattr(Chooser, "_fit", watched_fit)
        fleet.run(reqs)
    fleet.check()
    assert not any(flight.values()) and not any(fleet.chooser._pinned.values())
    assert any(moved), "the fit rule moved no prompt to where it fits: the check checked nothing"


@pytest.fixture(autouse=True)
def _fleets_closed(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every ``Fleet`` a test builds is closed after it (``simulate`` closes its own; a test that
    builds one left its caches' threads to the interpreter's exit)."""
    import weakref

    made: list[weakref.ref[Fleet]] = []
    init = Fleet.__init__

    def tracked(self: Fleet, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(Fleet, "__init__", tracked)
    yield
    for ref in made:
        fleet = ref()
        if fleet is not None:
            fleet.close()


def run_checked(fleet: Fleet, reqs: list[SimRequest], also: Any = None, **patches: Any) -> None:
    """Run ``reqs`` on ``fleet`` with ``Fleet.check`` (and ``also()``, given) after every engine
    step (as each instance publishes its events) and ``_Instance``'s methods named in ``patches``
    replaced."""
    from radixkv.bench.fleet_sim import _Instance

    publish = _Instance.publish

    def checked(inst: _Instance) -> None:
        publish(inst)
        fleet.check()
        if also is not None:
            also()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Instance, "publish", checked)
        for name, method in patches.items():
            mp.setattr(_Instance, name, method)
        fleet.run(reqs)


@settings(max_examples=30, deadline=None)
@given(trace=traces(), policy=st.sampled_from(["cost", "prefix", "round_robin"]), instances=st.integers(1, 3),
       room=st.integers(0, 6), output_pages=st.booleans(), gap=st.sampled_from([0.0, 1e-4, 1.0]))
def test_the_pages_requests_take_are_the_pages_the_engine_holds_after_every_step(
        trace: tuple, policy: str, instances: int, room: int, output_pages: bool, gap: float) -> None:
    """With or without ``output_pages``, on pools barely larger than the largest request (so
    requests wait for pages), after every engine step of every instance the pages its cache counts
    as the engine's are exactly those its requests took and have not given to the pool (``Fleet.check``),
    and at the end none is left: every private page came back."""
    from radixkv.bench.fleet_sim import full_blocks, private_blocks

    reqs, bt = trace
    for i, r in enumerate(reqs):
        r.arrival = gap * i
    need = max(full_blocks(r, bt) + (private_blocks(r, bt) if output_pages else 0) for r in reqs)
    fleet = Fleet(instances, policy, MODEL, bt, pool_tokens=(need + room) * bt, cpu_tokens=0, budget=8192,
                  output_pages=output_pages)
    steps: list[None] = []
    run_checked(fleet, reqs, also=lambda: steps.append(None))
    assert steps and all(r.ttft == r.ttft for r in reqs), "a request was never served"
    assert all(inst.cache.stats()["pages_engine"] == 0 for inst in fleet.instances)


@settings(max_examples=30, deadline=None)
@given(full=st.integers(1, 6), partial=st.integers(1, 15), more=st.integers(1, 100))
def test_with_output_pages_a_request_holds_a_page_for_every_block_of_its_prompt_and_output(
        full: int, partial: int, more: int) -> None:
    """Two requests of distinct blocks arriving together on one instance whose pool holds one
    request's prompt and output but not two: with ``output_pages`` the second starts only after the
    first's last token (it waits for pages); without, both prompts fit and share the first step."""
    from radixkv.bench.fleet_sim import private_blocks

    bt = 16
    output = full * bt + more           # at least as many pages as the prompt's full blocks
    reqs = [SimRequest(i, 0.0, [100 * i + j for j in range(full + 1)], full * bt + partial, output) for i in range(2)]
    own = private_blocks(reqs[0], bt)
    assert own == -(-(full * bt + partial + output) // bt) - full and own >= 2
    pool = (full + own) * bt            # one request's pages; two prompts' full blocks fit too
    assert 2 * full <= full + own
    step = MODEL.fixed_s + MODEL.prefill(2 * (full * bt + partial))
    without = run(reqs, bt, pool_tokens=pool)
    assert without["ttft"] == [pytest.approx(step)] * 2
    with_pages = run(reqs, bt, pool_tokens=pool, output_pages=True)
    first, second = with_pages["ttft"]
    assert first == pytest.approx(MODEL.fixed_s + MODEL.prefill(full * bt + partial))
    decode = (output - 1) * MODEL.decode_s(1)
    assert second >= first + decode
    with pytest.raises(ValueError, match="pool_tokens"):     # a prompt and its output no pool could hold
        run(reqs[:1], bt, pool_tokens=pool - bt, output_pages=True)


def test_output_pages_is_a_setting_of_the_run_that_the_goals_check_keeps_apart(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--output-pages`` is named in the table's profile line, so a table of runs with and without
    it checks each apart; a pool that holds a prompt but not its output is refused in one line."""
    from radixkv.bench import fleet_sim
    from radixkv.bench.fleet_sim import goals

    tables = []
    for extra in ([], ["--output-pages"]):
        out = tmp_path / f"t{len(tables)}.txt"
        argv = ["--workloads", "tenants", "--instances", "2", "--loads", "0.5", "--seeds", "0", "--requests", "40",
                "--policies", "cost,round_robin", "--out", str(out), "--jobs", "1", *extra]
        assert fleet_sim.main(argv) == 0
        tables.append(out.read_text())
    capsys.readouterr()
    profiles = [next(line for line in t.splitlines() if line.startswith("# profile ")) for t in tables]
    assert "output pages" not in profiles[0] and "output pages" in profiles[1]
    assert " of 2 (run, workload" in goals((tables[0] + tables[1]).splitlines())[-1]     # one cell per run
    argv = ["--workloads", "tenants", "--instances", "2", "--requests", "40", "--pool-tokens", "1600", "--output-pages"]
    assert fleet_sim.main(argv) == 2
    out = capsys.readouterr()
    assert "does not fit" in out.err and out.err.count("\n") == 1 and not out.out


@st.composite
def long_outputs(draw: st.DrawFn) -> tuple[list[SimRequest], int]:
    """``traces()`` with outputs of up to three blocks, arriving together or close together: decodes
    that reach new pages while others wait."""
    reqs, bt = draw(traces())
    gap = draw(st.sampled_from([0.0, 1e-4, 1e-2]))
    for i, r in enumerate(reqs):
        r.arrival, r.output = gap * i, draw(st.integers(1, 3 * bt))
    return reqs, bt


@settings(max_examples=40, deadline=None)
@given(trace=long_outputs(), policy=st.sampled_from(["cost", "prefix", "round_robin"]), instances=st.integers(1, 3),
       room=st.integers(0, 4))
def test_with_preemption_every_request_ends_and_its_pages_are_the_engines_after_every_step(
        trace: tuple, policy: str, instances: int, room: int) -> None:
    """With ``preempt`` on pools barely larger than the largest request, after every engine step
    the pages the requests took are the engine's, no running request has decoded past its pages
    (``Fleet.check``); no request is admitted in a step that preempted one; every request gets its
    first token and ends, each preemption is counted on the request it stopped, and every page
    comes back."""
    from radixkv.bench.fleet_sim import _Instance, full_blocks, private_blocks

    reqs, bt = trace
    need = max(full_blocks(r, bt) + private_blocks(r, bt) for r in reqs)
    fleet = Fleet(instances, policy, MODEL, bt, pool_tokens=(need + room) * bt, cpu_tokens=0, budget=8192,
                  output_pages=True, preempt=True)
    end, grow, start = _Instance.end, _Instance._grow, _Instance.start
    ends: list[int] = []
    preempting: set[str] = set()

    def grown(inst: _Instance) -> bool:
        preempted = grow(inst)
        (preempting.add if preempted else preempting.discard)(inst.name)
        return preempted

    def started(inst: _Instance, r: SimRequest) -> float | None:
        assert inst.name not in preempting, "a request admitted in a step that preempted one"
        return start(inst, r)

    def ended(inst: _Instance, r: SimRequest) -> None:
        assert r.left <= 1e-9 and r.recompute == 0 and not r.pages
        ends.append(r.rid)
        end(inst, r)

    run_checked(fleet, reqs, end=ended, _grow=grown, start=started)
    assert sorted(ends) == sorted(r.rid for r in reqs), "a request never ended"
    assert all(r.ttft == r.ttft for r in reqs)
    assert sum(r.preempted for r in reqs) == sum(inst.preemptions for inst in fleet.instances)
    assert all(inst.cache.stats()["pages_engine"] == 0 and not inst.running and not inst.waiting
               for inst in fleet.instances)


@settings(max_examples=30, deadline=None)
@given(trace=long_outputs(), policy=st.sampled_from(["cost", "prefix", "round_robin", "least_loaded"]),
       instances=st.integers(1, 3))
def test_where_every_request_fits_at_once_taking_pages_as_decoded_changes_nothing(
        trace: tuple, policy: str, instances: int) -> None:
    """On pools that hold every request's prompt and output at once nothing waits for pages either
    way: taking them as decodes reach them gives the reservation's TTFTs, hits and split, and
    preempts nothing."""
    from radixkv.bench.fleet_sim import full_blocks, private_blocks

    reqs, bt = trace
    pool = sum(full_blocks(r, bt) + private_blocks(r, bt) for r in reqs) * bt
    kw: dict[str, Any] = dict(instances=instances, policy=policy, pool_tokens=pool, output_pages=True)
    reserved, decoded = run(reqs, bt, **kw), run(reqs, bt, preempt=True, **kw)
    assert decoded["preempted"] == 0
    for key in ("ttft", "hit", "served"):
        assert decoded[key] == reserved[key], key


def test_a_decode_that_finds_no_page_preempts_the_request_admitted_last_which_recomputes() -> None:
    """One instance whose pool holds two prompts but not two outputs: reserving output pages, the
    second request waits for the first to end; taking them as decoded, both prompts share the
    first step, and when a decode finds no page the request admitted last is preempted, recomputes
    its prompt and what it had generated, and ends; the first is never stopped."""
    from radixkv.bench.fleet_sim import _Instance

    bt, full, output = 16, 3, 5 * 16
    reqs = [SimRequest(i, 0.0, [100 * i + j for j in range(full)], full * bt, output) for i in range(2)]
    pool = (full + 6) * bt                  # one request's 3 + 5 pages and a spare; two prompts fit
    reserved = run(reqs, bt, pool_tokens=pool, output_pages=True)
    assert reserved["ttft"][1] > reserved["ttft"][0] + (output - 1) * MODEL.decode_s(1)
    fleet = Fleet(1, "cost", MODEL, bt, pool_tokens=pool, cpu_tokens=0, budget=8192, output_pages=True, preempt=True)
    computed: list[tuple[int, int]] = []
    start = _Instance._start

    def started(inst: _Instance, r: SimRequest) -> float | None:
        cost = start(inst, r)
        if cost is not None:
            computed.append((r.rid, r.remaining))
        return cost

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Instance, "_start", started)
        fleet.run(reqs)
    fleet.check()
    both = MODEL.fixed_s + MODEL.prefill(2 * full * bt)
    assert [r.ttft for r in reqs] == [pytest.approx(both)] * 2
    assert [r.preempted for r in reqs] == [0, 1] and fleet.instances[0].preemptions == 1
    # its prompt's blocks stayed cached while unheld (nothing else wanted the pages): it recomputes
    # what it had generated, the last block of its prompt included (vLLM leaves a prompt's last token to compute)
    assert computed[:2] == [(0, full * bt), (1, full * bt)]
    rid, again = computed[2]
    assert rid == 1 and bt < again <= bt + output and fleet.instances[0].served == 2


@settings(max_examples=40, deadline=None)
@given(trace=long_outputs(), policy=st.sampled_from(["cost", "round_robin"]), instances=st.integers(1, 2),
       room=st.integers(0, 6))
def test_a_resumed_request_recomputes_what_of_its_sequence_the_pool_no_longer_holds(
        trace: tuple, policy: str, instances: int, room: int) -> None:
    """A preempted request's full blocks, its prompt's and those of what it generated, stay cached
    as vLLM's do: when it resumes, its prefill computes exactly the positions of its prompt and
    recomputed output past the leading blocks of that sequence its instance's pool still holds
    (at least its last block's, as vLLM leaves a prompt's last token to compute), and its match
    holds those blocks until it ends (``Fleet.check`` after every step)."""
    from radixkv.bench.fleet_sim import _Instance, full_blocks, private_blocks
    from radixkv.testing.machines import resident_tokens

    reqs, bt = trace
    need = max(full_blocks(r, bt) + private_blocks(r, bt) for r in reqs)
    fleet = Fleet(instances, policy, MODEL, bt, pool_tokens=(need + room) * bt, cpu_tokens=0, budget=8192,
                  output_pages=True, preempt=True)
    start = _Instance._start
    resumed: list[int] = []

    def started(inst: _Instance, r: SimRequest) -> float | None:
        if not r.preempted:
            return start(inst, r)
        sequence = inst._sequence(r)
        positions = r.tokens + r.recompute
        held = min(resident_tokens(inst.cache.tree, sequence), -(-positions // bt) - 1)
        cost = start(inst, r)
        if cost is not None:
            assert r.remaining == positions - held * bt, (r.remaining, positions, held)
            assert r.seq_held == max(0, held - full_blocks(r, bt))
            resumed.append(r.seq_held)
        return cost

    run_checked(fleet, reqs, _start=started)
    event(f"resumed: {len(resumed)}, with generated blocks found: {sum(1 for k in resumed if k)}")
    assert all(inst.cache.stats()["pages_engine"] == 0 for inst in fleet.instances)


def test_a_preempted_request_whose_blocks_stay_cached_resumes_by_computing_one_token() -> None:
    """One instance, two 32-token prompts generating 48 tokens each, a pool of 9 pages: the second
    is preempted once, after generating 33 tokens; its prompt's 2 blocks and its output's 2 full
    ones stay cached, nothing evicts them before it resumes, and its resumed prefill computes the
    one token past them (it recomputed 49 when only its prompt's blocks were cached)."""
    from radixkv.bench.fleet_sim import _Instance

    bt, full, output = 16, 2, 48
    reqs = [SimRequest(i, 0.0, [100 * (i + 1) + j for j in range(full)], full * bt, output) for i in range(2)]
    fleet = Fleet(1, "cost", MODEL, bt, pool_tokens=9 * bt, cpu_tokens=0, budget=8192, output_pages=True, preempt=True)
    computed: list[tuple[int, int, int]] = []
    start = _Instance._start

    def started(inst: _Instance, r: SimRequest) -> float | None:
        cost = start(inst, r)
        if cost is not None:
            computed.append((r.rid, r.remaining, r.seq_held))
        return cost

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Instance, "_start", started)
        fleet.run(reqs)
    fleet.check()
    assert [r.preempted for r in reqs] == [0, 1]
    assert computed == [(0, full * bt, 0), (1, full * bt, 0), (1, 1, 2)]
    assert fleet.instances[0].served == 2 and fleet.instances[0].cache.stats()["pages_engine"] == 0


@settings(max_examples=40, deadline=None)
@given(trace=long_outputs(), policy=st.sampled_from(["cost", "prefix", "round_robin"]), instances=st.integers(1, 2),
       room=st.integers(0, 6), preempt=st.booleans())
def test_a_finished_requests_full_blocks_stay_cached_unheld_and_its_other_pages_are_freed(
        trace: tuple, policy: str, instances: int, room: int, preempt: bool) -> None:
    """With ``output_pages``, reserved or taken as decoded: as a request ends, every full block of
    its sequence whose KV exists (its prompt and its output but the last token) is in its
    instance's pool, as vLLM keeps a finished request's blocks cached; no request holds those past
    its prompt, they are cached pages, not the engine's, and its other pages are free
    (``Fleet.check`` after every step).  Without ``output_pages`` nothing past its prompt is cached."""
    from radixkv.bench.fleet_sim import _Instance, full_blocks, private_blocks
    from radixkv.testing.machines import resident_tokens

    reqs, bt = trace
    again = copy.deepcopy(reqs)
    need = max(full_blocks(r, bt) + private_blocks(r, bt) for r in reqs)
    fleet = Fleet(instances, policy, MODEL, bt, pool_tokens=(need + room) * bt, cpu_tokens=0, budget=8192,
                  output_pages=True, preempt=preempt)
    end = _Instance.end
    generated: list[int] = []

    def ended(inst: _Instance, r: SimRequest) -> None:
        stats = inst.cache.stats()
        before = stats["pages_cached"], stats["pages_free"], stats["pages_engine"]
        kv_full = (r.tokens + r.output - 1) // bt
        mine, full = inst._sequence(r, kv_full * bt), full_blocks(r, bt)
        # the engine's pages it holds: its private ones (its prompt's blocks are the pool's, held)
        alone = len(r.private) if r.private is not None else 0
        # past its prompt, less what a resumed request found cached (the pool's already)
        cached_past = kv_full - full - r.seq_held
        end(inst, r)
        assert resident_tokens(inst.cache.tree, mine) == kv_full, "a full block of its sequence was not kept"
        stats = inst.cache.stats()
        assert stats["pages_engine"] == before[2] - alone
        assert stats["pages_cached"] == before[0] + cached_past
        assert stats["pages_free"] == before[1] + alone - cached_past
        generated.append(cached_past)

    run_checked(fleet, reqs, end=ended)
    assert len(generated) == len(reqs)
    event(f"requests ending with generated blocks cached: {sum(1 for g in generated if g)}")
    for inst in fleet.instances:
        assert inst.cache.stats()["pages_engine"] == 0
        inst.cache.check()
    plain = Fleet(instances, policy, MODEL, bt, pool_tokens=(need + room) * bt, cpu_tokens=0, budget=8192)
    plain.run(again)
    assert all(inst.cache.stats()["pages_cached"] <= sum(full_blocks(r, bt) for r in again) for inst in plain.instances)
    assert not plain._sequence_ids, "an output cached where outputs take no pages"


@settings(max_examples=30, deadline=None)
@given(trace=long_outputs(), policy=st.sampled_from(["cost", "round_robin"]), instances=st.integers(1, 2),
       room=st.integers(0, 4), preempt=st.booleans())
def test_the_cpu_tier_keeps_prompts_and_declines_the_generated_blocks_the_pool_lets_go(
        trace: tuple, policy: str, instances: int, room: int, preempt: bool) -> None:
    """With ``output_pages`` and a CPU tier, after every engine step: no tier holds a generated
    block's chunk (they are offered as the pool lets them go, and declined, as a tier below vLLM
    keeps prompts), while every prompt block a tier holds is one the requests sent; ``Fleet.check``
    holds.  The CPU tier takes the prompt blocks the pool lets go as it did before."""
    from radixkv.bench.fleet_sim import full_blocks, private_blocks

    reqs, bt = trace
    need = max(full_blocks(r, bt) + private_blocks(r, bt) for r in reqs)
    fleet = Fleet(instances, policy, MODEL, bt, pool_tokens=(need + room) * bt, cpu_tokens=(need + room) * bt,
                  budget=8192, output_pages=True, preempt=preempt)

    def tiers_keep_prompts() -> None:
        prompts = {k for r in reqs for k in r.tier_keys}       # the tier keys of the prompts sent so far
        for inst in fleet.instances:
            tier = inst.cache.stack.tiers[0]  # type: ignore[union-attr]
            assert not any(tier.contains_prefix([k]) for k in fleet.generated_keys), "a generated block stored"
            assert {e.key for e in tier.entries()} <= prompts

    run_checked(fleet, reqs, also=tiers_keep_prompts)
    declined = sum(inst.cache.stack.tiers[0].stats()["not_admitted"] for inst in fleet.instances)  # type: ignore[union-attr]
    event(f"generated blocks declined: {'some' if declined else 'none'}")


def test_a_finished_requests_cached_output_takes_the_pages_an_older_prompt_is_evicted_from() -> None:
    """One instance, a pool of 10 pages, requests one after another: request 0 (prompt P0 of 2
    blocks, 1 token out) ends with P0 cached; request 1 (2 blocks, 80 out) ends with its prompt and
    4 output blocks cached, 2 pages free; request 2 (a new 2-block prompt) needs 3 pages and evicts
    the least recently used leaf, P0 (a finished output is cached as vLLM caches it, not freed);
    request 3, P0 and a block more, finds none of it.  When a finished output's pages were freed,
    6 were free after request 1 and request 3 found all of P0."""
    from radixkv.testing.machines import resident_tokens

    bt = 16
    p0 = [100, 101]
    reqs = [SimRequest(0, 0.0, p0, 2 * bt, 1), SimRequest(1, 10.0, [200, 201], 2 * bt, 80),
            SimRequest(2, 20.0, [300, 301], 2 * bt, 1), SimRequest(3, 30.0, p0 + [102], 3 * bt, 1)]
    fleet = Fleet(1, "cost", MODEL, bt, pool_tokens=10 * bt, cpu_tokens=0, budget=8192, output_pages=True)
    fleet.run(copy.deepcopy(reqs[:2]))
    inst = fleet.instances[0]
    stats = inst.cache.stats()
    assert (stats["pages_cached"], stats["pages_free"], stats["pages_engine"]) == (2 + 6, 2, 0)
    assert resident_tokens(inst.cache.tree, inst._sequence(reqs[1], 6 * bt)) == 6
    fleet = Fleet(1, "cost", MODEL, bt, pool_tokens=10 * bt, cpu_tokens=0, budget=8192, output_pages=True)
    fleet.run(reqs)
    fleet.check()
    assert [r.hit_tokens for r in reqs] == [0, 0, 0, 0]


def test_preempt_needs_output_pages_and_is_named_in_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--preempt`` without ``--output-pages`` is refused in one line; with it the profile line
    names it (so the goals check keeps the runs apart) and each row counts its preemptions."""
    from radixkv.bench import fleet_sim

    argv = ["--workloads", "tenants", "--instances", "2", "--loads", "0.5", "--seeds", "0", "--requests", "40",
            "--policies", "cost,round_robin", "--jobs", "1"]
    assert fleet_sim.main([*argv, "--preempt"]) == 2
    err = capsys.readouterr().err
    assert "--preempt" in err and err.count("\n") == 1
    out = tmp_path / "t.txt"
    assert fleet_sim.main([*argv, "--output-pages", "--preempt", "--out", str(out)]) == 0
    text = out.read_text()
    assert "taken as decoded, preempting" in next(line for line in text.splitlines() if line.startswith("# profile "))
    rows = [line for line in text.splitlines() if line.startswith("tenants")]
    assert len(rows) == 2 and all(" preempted " in row for row in rows)
    with pytest.raises(ValueError, match="preempt"):
        Fleet(1, "cost", MODEL, 16, pool_tokens=1024, cpu_tokens=0, budget=8192, preempt=True)


@settings(max_examples=15, deadline=None)
@given(tenants=st.integers(1, 4), system=st.integers(1, 700), question=st.integers(1, 300), requests=st.integers(1, 30),
       burst=st.integers(1, 3), seed=st.integers(0, 50))
def test_like_fleet_runs_the_requests_bench_fleet_sends(tenants: int, system: int, question: int, requests: int,
                                                          burst: int, seed: int) -> None:
    """``--like-fleet ARGS`` simulates what ``bench fleet ARGS`` sends: per seed the same arrivals
    and prompt lengths, two prompts sharing a block id exactly where they share that block's
    tokens and every token before it, each request generating ``--max-tokens``, on its instances
    and pool (less vLLM's null block, as the router reads it from vLLM's metrics)."""
    from radixkv.bench import fleet
    from radixkv.bench.fleet_sim import like_fleet
    from radixkv.fleet.router import pool_blocks

    text = (f"--tenants {tenants} --system-tokens {system} --question-tokens {question} --requests {requests} "
            f"--burst {burst} --max-tokens 40 --pool-blocks 40 --instances 3 --seed {seed},{seed + 1}")
    instances, pool, runs = like_fleet(text)
    vllm_reads = f'vllm:cache_config_info{{block_size="{fleet.BLOCK}",num_gpu_blocks="40"}} 1.0\n'
    assert (instances, pool) == (3, pool_blocks(vllm_reads, fleet.BLOCK) * fleet.BLOCK) == (3, 39 * fleet.BLOCK)
    assert [s for s, _ in runs] == [seed, seed + 1]
    args = fleet._parser().parse_args(text.split())
    bt = fleet.BLOCK
    for s, reqs in runs:
        work, _ = fleet._work(args, s)
        assert [(r.arrival, r.tokens, r.output) for r in reqs] == [(at, len(p), 40) for at, p in work]
        for (_, p), r in zip(work, reqs):
            assert len(r.blocks) == -(-len(p) // bt)
        for (_, p), r in zip(work, reqs):
            for (_, q), o in zip(work, reqs):
                for j in range(min(len(r.blocks), len(o.blocks))):
                    assert (r.blocks[j] == o.blocks[j]) == (p[:(j + 1) * bt] == q[:(j + 1) * bt])


@settings(max_examples=15, deadline=None)
@example(turns=2, tenants=1, system=100, question=28, max_tokens=128, requests=1, burst=1, seed=0)  # answers end on a block
@given(turns=st.integers(2, 4), tenants=st.integers(1, 3), system=st.integers(1, 400), question=st.integers(1, 200),
       max_tokens=st.integers(1, 300), requests=st.integers(1, 8), burst=st.integers(1, 3), seed=st.integers(0, 50))
def test_like_fleet_runs_conversations_as_bench_fleet_sends_them(turns: int, tenants: int, system: int, question: int,
                                                                 max_tokens: int, requests: int, burst: int,
                                                                 seed: int) -> None:
    """``--like-fleet`` with ``--turns``: each request of ``bench fleet``'s opens a conversation whose
    next turn follows the last one's end (``after``), its prompt the last prompt, that answer
    (``--max-tokens`` tokens no prompt says) and ``question(i, turn)``; a turn's blocks begin with
    the last turn's full blocks and the answer's (``answer``: the full blocks of the prompt and the
    answer but its last token, which vLLM caches), and an answer's blocks are no other
    conversation's.  The simulator serves it all, each turn after the one before ends."""
    from radixkv.bench import fleet
    from radixkv.bench.fleet_sim import like_fleet

    text = (f"--turns {turns} --tenants {tenants} --system-tokens {system} --question-tokens {question} "
            f"--requests {requests} --burst {burst} --max-tokens {max_tokens} --pool-blocks 40 --seed {seed}")
    _, _, [(_, reqs)] = like_fleet(text)
    args = fleet._parser().parse_args(text.split())
    work, _ = fleet._work(args, seed)
    bt = fleet.BLOCK
    assert [r.rid for r in reqs] == list(range(len(reqs))) == list(range(requests * turns))
    assert [(r.arrival, r.rid) for r in reqs] == sorted((r.arrival, r.rid) for r in reqs)
    by_rid = {r.rid: r for r in reqs}
    firsts = [r for r in reqs if r.after == -1]
    assert [(r.arrival, r.tokens) for r in sorted(firsts, key=lambda r: r.rid)] == [(at, len(p)) for at, p in work]
    owner: dict[int, int] = {}                    # answer block -> its conversation
    for k, first in enumerate(sorted(firsts, key=lambda r: r.rid)):
        chain, r = [first], first
        while (nxt := [o for o in reqs if o.after == r.rid]):
            assert len(nxt) == 1
            r = nxt[0]
            chain.append(r)
        assert len(chain) == turns
        for a, b in zip(chain, chain[1:]):
            full = a.tokens // bt
            assert b.arrival == first.arrival and b.output == a.output == max_tokens
            assert b.tokens == a.tokens + max_tokens + question
            assert len(a.answer) == (a.tokens + max_tokens - 1) // bt - full
            assert b.blocks[:full + len(a.answer)] == a.blocks[:full] + a.answer
            for block in a.answer:
                assert owner.setdefault(block, k) == k
        assert chain[-1].answer == [] and by_rid[chain[-1].rid] is chain[-1]
    prompts = {b for r in firsts for b in r.blocks}
    assert not prompts & set(owner)
    s = simulate(reqs, bt, instances=2, policy="cost", model=PROFILES["vllm-cpu-fleet"], pool_tokens=1 << 16,
                 cpu_tokens=0, budget=2048, check=True, output_pages=True)
    assert s["served"] and sum(s["served"]) == len(reqs)
    # the later turns moved to the other instance, by the router's reason, as bench fleet counts them
    assert s["moved"] is not None and set(s["moved"]) <= {"cost", "idle", "copy", "fit"}
    assert sum(s["moved"].values()) <= requests * (turns - 1)
    one = simulate(reqs, bt, instances=1, policy="cost", model=PROFILES["vllm-cpu-fleet"], pool_tokens=1 << 16,
                   cpu_tokens=0, budget=2048, output_pages=True)
    assert one["moved"] == {}, "one instance: nothing moves"
    rr = simulate(reqs, bt, instances=2, policy="round_robin", model=PROFILES["vllm-cpu-fleet"], pool_tokens=1 << 16,
                  cpu_tokens=0, budget=2048, output_pages=True)
    assert set(rr["moved"] or {}) <= {"round_robin"}
    single = [SimRequest(r.rid, r.arrival, r.blocks, r.tokens, r.output) for r in firsts]
    assert simulate(single, bt, instances=2, policy="cost", model=PROFILES["vllm-cpu-fleet"], pool_tokens=1 << 16,
                    cpu_tokens=0, budget=2048)["moved"] is None, "no later turns: nothing to count"


def test_like_fleet_is_refused_in_one_line_as_bench_fleet_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    """A flag ``bench fleet`` refuses, or one ``--like-fleet`` sets, is one line and exit 2, and so
    is ``--slower`` without ``--like-fleet`` (whose arrivals are not rescaled to a load) or not a
    positive finite number; a run prints one row per seed and policy in one cell."""
    from radixkv.bench import fleet_sim

    for argv in (["--like-fleet=--requests 0"], ["--like-fleet=--bogus 1"], ["--like-fleet=--requests 5", "--seeds", "1"],
                 ["--like-fleet=--requests 5", "--workloads", "tenants"], ["--slower", "2"],
                 *(["--like-fleet=--requests 5", "--slower", bad] for bad in ("0", "nan", "inf")),
                 ["--summarize", "missing.txt", "--slower", "0"]):
        assert fleet_sim.main(argv) == 2, argv
        out = capsys.readouterr()
        named = "--slower" if "--slower" in argv else "--"
        assert out.err.count("\n") == 1 and named in out.err and not out.out, argv
    argv = ["--like-fleet=--requests 12 --tenants 2 --system-tokens 300 --max-tokens 200 --pool-blocks 33 --seed 0,1",
            "--policies", "cost,round_robin", "--output-pages", "--preempt"]
    assert fleet_sim.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fleet ")]
    assert len(rows) == 4 and len({line.split()[2] for line in rows}) == 1


@given(st.floats(0.1, 10.0), st.integers(1, 4), st.integers(0, 5))
@settings(max_examples=20, deadline=None)
def test_a_slower_machine_takes_every_step_that_many_times_as_long(factor: float, requests: int, seed: int) -> None:
    """``slower(model, F)``: prefill and decode steps F times the profile's, loads and the fixed cost
    as they were; on requests that never wait for one another (spaced far apart) every TTFT is the
    fixed cost plus F times its compute."""
    from radixkv.bench.fleet_sim import slower

    base = PROFILES["vllm-cpu"]
    model = slower(base, factor)
    assert model.prefill_s_per_token == pytest.approx(base.prefill_s_per_token * factor)
    assert model.decode_step_s == pytest.approx(base.decode_step_s * factor)
    assert model.decode_s_per_seq == pytest.approx(base.decode_s_per_seq * factor)
    assert (model.fixed_s, model.load_s_per_token) == (base.fixed_s, base.load_s_per_token)
    rng = random.Random(seed)
    reqs = [SimRequest(i, 1000.0 * i, [rng.randrange(1 << 30) for _ in range(3)], 300, 4) for i in range(requests)]
    plain, slow = (simulate(reqs, 128, instances=2, policy="cost", model=m, pool_tokens=1 << 16, cpu_tokens=0,
                            budget=2048, check=True) for m in (base, model))
    for a, b in zip(plain["ttft"], slow["ttft"]):
        assert b - base.fixed_s == pytest.approx((a - base.fixed_s) * factor)


def test_slower_is_named_in_the_profile_line_with_the_slower_costs(capsys: pytest.CaptureFixture[str]) -> None:
    """``--slower F``: the table's profile line gives the instances' costs, F times the profile's,
    and says that the router estimates with ``vllm-cpu``, as ``bench fleet`` starts its router."""
    from radixkv.bench import fleet_sim

    argv = ["--like-fleet=--requests 6 --tenants 2 --system-tokens 300 --max-tokens 20 --pool-blocks 33 --seed 0",
            "--policies", "cost", "--jobs", "1", "--slower", "2"]
    assert fleet_sim.main(argv) == 0
    profile = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("# profile"))
    base = PROFILES["vllm-cpu-fleet"]           # --like-fleet's instances: the model bench fleet serves
    assert f"prefill {base.prefill_s_per_token * 2e6:.1f} us/token" in profile and "every step x2" in profile
    assert profile.endswith("; the router estimates with the vllm-cpu profile"), profile
    # the router on the instances' own profile: nothing to say
    assert fleet_sim.main(argv[:-2] + ["--router-profile", "vllm-cpu-fleet"]) == 0
    profile = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("# profile"))
    assert "the router estimates" not in profile, profile


def test_the_router_estimates_with_its_own_model_and_the_instances_run_on_theirs() -> None:
    """``Fleet(router_model=...)``: the chooser's cost model is the router's, the instances' steps
    the engine's; without it both are ``model``."""
    engine, router = PROFILES["h100-8b"], PROFILES["vllm-cpu"]
    assert Fleet(2, "cost", engine, 64, pool_tokens=1 << 14, cpu_tokens=0, budget=8192).chooser.model is engine
    fleet = Fleet(2, "cost", engine, 64, pool_tokens=1 << 14, cpu_tokens=0, budget=8192, router_model=router)
    assert fleet.chooser.model is router and fleet.model is engine
    reqs = [SimRequest(0, 0.0, list(range(10)), 640, 1)]
    fleet.run(reqs)
    fleet.check()
    assert reqs[0].ttft == pytest.approx(engine.fixed_s + engine.prefill(640)), "the step is the engine's"


# -- conversations: a turn's prompt holds the last turn's answer --------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 120))
def test_a_chat_turns_prompt_is_the_last_turns_prompt_its_answer_and_a_question(seed: int, n: int) -> None:
    """``chat``: deterministic per seed; every later turn arrives after the turn it follows, and
    its prompt is that turn's prompt, its answer and a question, token for token: its blocks begin
    with that turn's full blocks and its ``answer`` (the full blocks of its sequence); no prompt
    passes ``CHAT_MAX_TOKENS``; an answer's ids are no other request's."""
    from radixkv.bench.fleet_sim import CHAT_MAX_TOKENS, full_blocks

    reqs, bt = workload("chat", n, seed)
    again, _ = workload("chat", n, seed)
    assert [(r.arrival, r.blocks, r.tokens, r.output, r.answer, r.after) for r in reqs] == \
        [(r.arrival, r.blocks, r.tokens, r.output, r.answer, r.after) for r in again]
    assert len(reqs) == n and [r.rid for r in reqs] == list(range(n))
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    answers = [b for r in reqs for b in r.answer]
    assert len(answers) == len(set(answers))
    for r in reqs:
        assert r.tokens <= CHAT_MAX_TOKENS and len(r.blocks) == -(-r.tokens // bt)
        full = full_blocks(r, bt)
        assert len(r.answer) == (r.tokens + r.output) // bt - full
        assert not set(r.answer) & set(r.blocks)
        if r.after == -1:
            continue
        last = reqs[r.after]
        assert last.rid < r.rid and last.arrival < r.arrival
        assert last.tokens + last.output + 16 <= r.tokens <= last.tokens + last.output + 256
        head = last.blocks[:full_blocks(last, bt)] + last.answer
        assert r.blocks[:len(head)] == head and not set(r.blocks[len(head):]) & set(answers)
    event(f"later turns: {'some' if any(r.after != -1 for r in reqs) else 'none'}")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), policy=st.sampled_from(POLICIES),
       output_pages=st.booleans())
def test_one_unbounded_instance_reuses_a_conversations_answers_only_when_the_engine_caches_outputs(
        seed: int, n: int, policy: str, output_pages: bool) -> None:
    """One unbounded instance, requests far apart: every request reuses exactly its infinite-cache
    hits, which with ``output_pages`` count the answers the last turns generated (the engine
    caches them) and without do not; with answers in the prompts, caching outputs gains at least
    the later turns' answers."""
    reqs, bt = workload("chat", n, seed)
    for i, r in enumerate(reqs):
        r.arrival = 1000.0 * i
    out = run(reqs, bt, policy=policy, output_pages=output_pages)
    hits = ideal_hits(reqs, bt, outputs=output_pages)
    assert out["hit"] == sum(hits) / sum(r.tokens for r in reqs)
    assert out["deferred"] == 0
    later = [r for r in reqs if r.after != -1]
    gain = sum(ideal_hits(reqs, bt, outputs=True)) - sum(ideal_hits(reqs, bt))
    assert gain >= sum(len(reqs[r.after].answer) * bt for r in later if reqs[r.after].answer) - \
        sum(bt for r in later if reqs[r.after].answer and (reqs[r.after].tokens + reqs[r.after].output) % bt == 0)
    event(f"answers reused: {'some' if gain else 'none'}")


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 60), instances=st.integers(1, 3), load=st.sampled_from([0.5, 0.95, 3.0]),
       policy=st.sampled_from(["cost", "prefix", "round_robin"]), output_pages=st.booleans())
def test_a_later_turn_arrives_no_sooner_than_the_answer_it_holds_ended(
        seed: int, n: int, instances: int, load: float, policy: str, output_pages: bool) -> None:
    """Whatever the load: no request arrives before the request it follows (``after``) ended; one
    that the workload sent sooner arrives the moment it ended, later by ``deferred``; every request
    ends; ``Fleet.check`` holds after every step."""
    reqs, bt = workload("chat", n, seed)
    scale_to_load(reqs, bt, MODEL, instances, load, output_pages)
    sent = {r.rid: r.arrival for r in reqs}
    fleet = Fleet(instances, policy, MODEL, bt, pool_tokens=20_000, cpu_tokens=20_000, budget=8192,
                  output_pages=output_pages)
    run_checked(fleet, reqs)
    for r in reqs:
        assert r.ended >= r.arrival + r.ttft
        assert r.arrival == pytest.approx(sent[r.rid] + r.deferred)
        if r.after != -1:
            assert r.arrival >= reqs[r.after].ended
            assert r.deferred == 0 or r.arrival == reqs[r.after].ended
    event(f"deferred: {'some' if any(r.deferred for r in reqs) else 'none'}")


def test_a_request_after_one_that_is_not_an_earlier_request_of_the_run_is_refused() -> None:
    for first, after in ((-1, 1), (-1, 7), (-1, -2), (1, -1)):        # itself, none such, not a rid, a later one
        reqs = [SimRequest(0, 0.0, [1], 10, 1, after=first), SimRequest(1, 1.0, [2], 10, 1, after=after)]
        fleet = Fleet(1, "cost", MODEL, 16, pool_tokens=1024, cpu_tokens=0, budget=8192)
        with pytest.raises(ValueError, match="after"):
            fleet.run(reqs)
        assert fleet.env.now == 0 and all(inst.served == 0 for inst in fleet.instances)


def test_the_cpu_tier_keeps_an_answer_once_a_later_turns_prompt_holds_it() -> None:
    """One instance, 16-token blocks, a pool of 8 pages and a CPU tier: A (a 2-block prompt)
    generates 33 tokens, 2 full blocks of answer; B, its next turn, holds both in its prompt and
    reuses all 4 blocks; C's 7-block prompt pushes everything into the CPU tier; D, B's prompt
    again, loads all 4 blocks from the tier.  Were the answer still declined as a generated block
    once B's prompt held it, D would load only A's prompt from the tier."""
    bt = 16
    a = SimRequest(0, 0.0, [1, 2], 2 * bt, 33, answer=[3, 4])
    b_blocks = [1, 2, 3, 4, 5]
    b = SimRequest(1, 0.001, b_blocks, 4 * bt + 1 + 10, 1, after=0)
    c = SimRequest(2, 10.0, [20, 21, 22, 23, 24, 25, 26, 27], 7 * bt + 5, 1)
    d = SimRequest(3, 20.0, b_blocks, 4 * bt + 1 + 10, 1)
    reqs = [a, b, c, d]
    fleet = Fleet(1, "cost", MODEL, bt, pool_tokens=9 * bt, cpu_tokens=64 * bt, budget=8192, output_pages=True)
    run_checked(fleet, reqs)
    assert b.deferred > 0 and b.hit_tokens == 4 * bt and b.below_tokens == 0
    assert (d.hit_tokens, d.below_tokens) == (4 * bt, 4 * bt)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 80), instances=st.integers(1, 4), load=st.sampled_from([0.3, 0.95, 3.0]))
def test_a_run_whose_turns_waited_for_their_answers_reports_the_load_they_met(
        seed: int, n: int, instances: int, load: float) -> None:
    """Turns held back for their answers only ever arrive later: the load the run met
    (``met_load``, over the arrivals as they happened) is at most the load named, and is reported
    exactly when some turn waited."""
    reqs, bt = workload("chat", n, seed)
    scale_to_load(reqs, bt, MODEL, instances, load, True)
    out = run(reqs, bt, instances=instances, pool_tokens=20_000, output_pages=True)
    assert (out["met_load"] is None) == (out["deferred"] == 0)
    if out["deferred"]:
        assert out["met_load"] <= load * (1 + 1e-9)
    event(f"deferred: {'some' if out['deferred'] else 'none'}")


def test_jobs_change_the_time_alone_and_a_dead_worker_is_named(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--jobs N`` runs N simulations at once: the table is the same, row for row, as one process
    writes it (a grid with shapes and preemption, and ``--like-fleet``); ``--jobs 0`` is one line and
    exit 2; a worker that dies is ``WorkerDied``, which the command prints in one line (exit 1)."""
    import signal

    from radixkv.bench import fleet_sim

    grid = ["--workloads", "hot,shape64", "--instances", "2,3", "--loads", "0.9", "--seeds", "0,1", "--requests", "30",
            "--policies", "cost,cache_aware,round_robin", "--output-pages", "--preempt"]
    like = ["--like-fleet=--requests 10 --tenants 2 --system-tokens 300 --max-tokens 20 --pool-blocks 33 --seed 0,1",
            "--policies", "cost,prefix"]
    for argv in (grid, like):
        tables = []
        for jobs in ("1", "2"):
            out = tmp_path / f"t{jobs}.txt"
            assert fleet_sim.main([*argv, "--jobs", jobs, "--out", str(out)]) == 0
            lines = out.read_text().splitlines()
            timing = [i for i, line in enumerate(lines) if re.fullmatch(r"# \d+ s, .*", line)]
            assert len(timing) == 1 and lines[timing[0]].endswith("2 processes" if jobs == "2" else "1 process")
            tables.append([line for i, line in enumerate(lines[1:], 1) if i not in timing])
        assert tables[0] == tables[1] and sum(1 for line in tables[0] if line.startswith(("hot ", "shape64 ", "fleet "))) >= 4
    capsys.readouterr()
    assert fleet_sim.main([*grid, "--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert "--jobs" in err and err.count("\n") == 1
    # a worker killed mid-run: named, not a hang, not a traceback
    with pytest.raises(fleet_sim.WorkerDied):
        list(fleet_sim.in_order(signal.raise_signal, range(3), lambda _: signal.SIGKILL, 2))
    assert [r for _, r in fleet_sim.in_order(abs, [-1, 2, -3], lambda x: x, 2)] == [1, 2, 3]
    assert [r for _, r in fleet_sim.in_order(abs, [-1, 2, -3], lambda x: x, 1)] == [1, 2, 3]


def test_the_references_imbalance_thresholds_are_flags_named_in_the_table(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``--balance-abs``/``--balance-rel`` set ``prefix``'s and ``cache_aware``'s imbalance thresholds
    (sglang-router's default 64 against the router's 16): the profile line names them when they are
    not the default, so the goals check keeps the runs apart; the default's rows do not change (its
    rule has no such threshold); a bad value is one line and exit 2."""
    from radixkv.bench import fleet_sim
    from radixkv.bench.fleet_sim import goals

    argv = ["--workloads", "hot", "--instances", "4", "--loads", "0.9", "--seeds", "0", "--requests", "120",
            "--policies", "cost,cache_aware", "--jobs", "1"]
    tables = {}
    for extra in ([], ["--balance-abs", "64"], ["--balance-abs", "0", "--balance-rel", "1"]):
        out = tmp_path / "t.txt"
        assert fleet_sim.main([*argv, *extra, "--out", str(out)]) == 0
        tables[" ".join(extra)] = out.read_text().splitlines()
    capsys.readouterr()
    profile = {k: next(line for line in t if line.startswith("# profile ")) for k, t in tables.items()}
    assert "imbalance" not in profile[""]
    assert profile["--balance-abs 64"].endswith("imbalance 64/1.5")
    assert profile["--balance-abs 0 --balance-rel 1"].endswith("imbalance 0/1")
    rows = {k: {line.split()[4]: line for line in t if line.startswith("hot ")} for k, t in tables.items()}
    assert len({r["cost"] for r in rows.values()}) == 1
    # balancing on any imbalance at all is another rule than balancing past 64 requests
    assert rows["--balance-abs 64"]["cache_aware"] != rows["--balance-abs 0 --balance-rel 1"]["cache_aware"]
    assert " of 3 (run, workload" in goals([line for t in tables.values() for line in t])[-1]
    for bad in (["--balance-abs", "-1"], ["--balance-rel", "0.9"], ["--balance-rel", "nan"], ["--balance-rel", "inf"]):
        assert fleet_sim.main([*argv, *bad]) == 2, bad
        err = capsys.readouterr().err
        assert bad[0] in err and err.count("\n") == 1, bad


def _burst_run(seed: int, instances: int, load: float, rebalance: bool) -> tuple[Fleet, list[SimRequest]]:
    """Shape 49 (bursts of one tenant's long prompt), 160 requests, run with ``Fleet.check`` after
    every step; asserts each request was served where the router last sent it."""
    from radixkv.bench.fleet_sim import default_pool

    reqs, bt = workload("shape49", 160, seed)
    scale_to_load(reqs, bt, MODEL, instances, load)
    pool = default_pool("shape49", reqs, bt)
    fleet = Fleet(instances, "cost", MODEL, bt, pool_tokens=pool, cpu_tokens=pool, budget=8192, seed=seed,
                  rebalance=rebalance)
    served: dict[int, str] = {}
    finish = __import__("radixkv.bench.fleet_sim", fromlist=["_Instance"])._Instance.finish_prefill

    def finish_prefill(inst: Any, r: SimRequest) -> None:
        served[r.rid] = inst.name
        finish(inst, r)

    run_checked(fleet, reqs, finish_prefill=finish_prefill)
    assert all(served[r.rid] == r.instance for r in reqs), "a request was served where the router did not send it"
    return fleet, reqs


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), instances=st.sampled_from([2, 4]), load=st.sampled_from([0.5, 0.95]))
def test_requests_a_busy_instance_queued_move_to_one_that_fell_free_and_are_served_there(
        seed: int, instances: int, load: float) -> None:
    """Bursts of one tenant's long prompt (shape 49), rebalancing on: an instance that falls free
    takes requests still waiting on another (``Chooser.rebalance``, rule 9), never one its engine
    started; the pages and counts stay exact after every step (``Fleet.check``), each moved request
    is served where it moved, and the run is the same run again (deterministic with the moves)."""
    from radixkv.bench.fleet_sim import summary

    fleet, reqs = _burst_run(seed, instances, load, rebalance=True)
    moved = [r for r in reqs if r.why == "rebalance"]
    event(f"moved: {min(len(moved), 5)}")
    assert len(moved) <= fleet.rebalanced and all(r.ttft == r.ttft for r in reqs)
    again, reqs2 = _burst_run(seed, instances, load, rebalance=True)
    assert summary(reqs, fleet)["ttft"] == summary(reqs2, again)["ttft"] and fleet.rebalanced == again.rebalanced


def test_the_simulator_rebalances_only_after_the_instance_that_spoke_scheduled_its_next_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM schedules its next step before its outputs reach the router, so rebalancing never
    takes a request that step admits: in the simulator every rebalancing comes while no instance
    is between a step's end and its next step's admission, and the bursts still move requests."""
    calls: list[bool] = []
    rebalance = Fleet.rebalance

    def checked(fleet: Fleet) -> set[str]:
        calls.append(any(inst.scheduling for inst in fleet.instances))
        return rebalance(fleet)

    monkeypatch.setattr(Fleet, "rebalance", checked)
    fleet, reqs = _burst_run(0, 2, 0.95, rebalance=True)
    assert calls and not any(calls), f"{sum(calls)} of {len(calls)} rebalancings came before a step was scheduled"
    assert fleet.rebalanced > 0


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), instances=st.sampled_from([2, 4]))
def test_a_request_moved_to_an_instance_that_only_decodes_starts_at_once(seed: int, instances: int) -> None:
    """The first request moved to an instance with nothing waiting whose step scheduled or in
    flight computes no prompt is tried there at the moment it moves, as an arrival would be (the
    simulator's decode is fluid; the next ones moved with it may find that step's budget spent);
    none is tried before it moves."""
    from radixkv.bench.fleet_sim import _Instance

    moved: dict[int, tuple[float, bool]] = {}       # rid: (when, its new instance was free then)
    tried: dict[int, list[tuple[str, float]]] = {}
    rebalance, start = Fleet.rebalance, _Instance.start

    def watched(fleet: Fleet) -> set[str]:
        free = {i.name: not i.waiting and not i.prefilling for i in fleet.instances}
        before = {r.rid: r.instance for i in fleet.instances for r in i.waiting}
        targets = rebalance(fleet)
        for i in fleet.instances:
            first = True        # the first moved to a free instance is tried at once; the next may find the step full
            for r in i.waiting:
                if before.get(r.rid, i.name) != i.name:
                    moved[r.rid] = (fleet.env.now, free[i.name] and first)
                    first = False
        return targets

    def tried_start(inst: Any, r: SimRequest) -> Any:
        tried.setdefault(r.rid, []).append((inst.name, inst.fleet.env.now))
        return start(inst, r)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Fleet, "rebalance", watched)
        mp.setattr(_Instance, "start", tried_start)
        _, reqs = _burst_run(seed, instances, 0.95, rebalance=True)
    by_rid = {r.rid: r for r in reqs}
    for rid, (when, free) in moved.items():
        there = [t for name, t in tried[rid] if name == by_rid[rid].instance]
        assert there and there[0] >= when, (rid, when, tried[rid])
        if free:
            assert there[0] == when, f"request {rid} moved at {when} to a free instance, first tried there at {there[0]}"
    event(f"moved to a free instance: {min(5, sum(free for _, free in moved.values()))}")


def test_the_simulator_moves_requests_only_with_rebalancing_on() -> None:
    """The same bursts at 95% load on two instances: requests move with ``rebalance=True``, none
    without (the default)."""
    on, reqs = _burst_run(0, 2, 0.95, rebalance=True)
    assert on.rebalanced > 0 and any(r.why == "rebalance" for r in reqs)
    off, reqs = _burst_run(0, 2, 0.95, rebalance=False)
    assert off.rebalanced == 0 and not any(r.why == "rebalance" for r in reqs)


def test_a_simulation_leaves_no_thread_and_no_fleet_behind() -> None:
    """``simulate`` closes its fleet's caches: their CPU tiers' writer and loader threads stop, and
    nothing of the fleet stays alive (a process running hundreds of cells, as ``--jobs``' workers
    do, once grew by 10-30 MB a cell until the kernel killed it)."""
    import gc
    import threading

    from radixkv.bench.fleet_sim import default_pool

    gc.collect()
    before = {t.ident for t in threading.enumerate()}
    fleets = sum(1 for o in gc.get_objects() if type(o) is Fleet)       # other tests' own
    reqs, bt = workload("shape61", 60, 0)
    pool = default_pool("shape61", reqs, bt)
    scale_to_load(reqs, bt, MODEL, 3, 0.8)
    simulate(reqs, bt, instances=3, policy="cost", model=MODEL, pool_tokens=pool, cpu_tokens=pool, budget=8192)
    gc.collect()
    assert [t.name for t in threading.enumerate() if t.ident not in before] == []
    assert sum(1 for o in gc.get_objects() if type(o) is Fleet) <= fleets, "a fleet outlived its simulation"
