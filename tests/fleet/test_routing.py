"""The router's decision (``radixkv.fleet.routing``): the cost policy picks what its formula says
for any queues, holdings, media, peers and loads (a property against an independent reading of the
docstring); what the router just sent counts as held until it settles or expires; a burst follows
its first request while that is cheaper; the reference policies follow their own rules."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
from hypothesis import assume, event, given, settings, strategies as st

from radixkv.fleet.index import MEDIA, Match
from radixkv.fleet.routing import (AUTO_CAP, AUTO_MAX, LOAD_ARRIVALS, PROFILES, STREAM_AFTER, Backend, Chooser,
                                    CostModel, Recent, auto_affinity)

MODEL = CostModel(prefill_s_per_token=1e-4, fixed_s=0.01,
                  load_s_per_token={"GPU": 0.0, "CPU": 1e-5, "STORAGE": 5e-5, "PEER": 2e-5, "SHARED": 3e-5},
                  decode_step_s=0.02, decode_s_per_seq=0.005)


def backends(n: int) -> list[Backend]:
    return [Backend(f"http://{i}", f"i{i}") for i in range(n)]


def touch(order: list[Any], names: list[Any], cap: int) -> list[Any]:
    """A model of a bounded LRU: ``names`` move to the end of ``order`` (least recent first); the
    least recent beyond ``cap`` are dropped from it and returned."""
    for name in names:
        if name in order:
            order.remove(name)
        order.append(name)
    dropped = order[:max(0, len(order) - cap)]
    del order[:len(dropped)]
    return dropped


def occupy(chooser: Chooser, b: Backend, *, queued: int = 0, waiting: int = 1, decoding: int = 0,
           now: float = 0.0) -> None:
    """Put ``b`` in a state through the chooser's own calls, as the router would: ``decoding``
    requests past their first token, then ``waiting`` requests still waiting for it, the first
    of them with ``queued`` uncached tokens (each request's tokens all uncached, no block names)."""
    assert queued == 0 or waiting > 0
    for _ in range(decoding):
        chooser.prefilled(b, chooser.sent(b, 0, 0, (), now), (), now, now)
    for i in range(waiting):
        chooser.sent(b, queued if i == 0 else 0, 0, (), now)


def calls_for_another(holding: int, worth: float) -> bool:
    """Whether a prefix ``holding`` instances hold, worth ``worth`` instances (its share of the
    arrivals times the instances), calls for another holder: one more is at most its worth, or two
    or more hold it and fewer than its worth (rounded up once two hold it)."""
    return holding + 1 <= worth or (holding >= 2 and holding < worth)


def near_a_bound(holding: int, worth: float) -> bool:
    """Whether ``worth`` is within float noise of a bound of ``calls_for_another``."""
    return abs(holding + 1 - worth) <= 1e-6 or abs(holding - worth) <= 1e-6


def rare(chooser: Chooser, instances: int) -> Chooser:
    """``chooser`` after many arrivals of other prompts: the next prompt's prefix has a small share of
    the arrivals (about 1 / (LOAD_ARRIVALS x instances)), so no rule replicates it."""
    for i in range(LOAD_ARRIVALS * instances * 4):
        chooser.demand.add([("other", i)], LOAD_ARRIVALS * instances)
    return chooser


def expected_own(tokens: int, mine: Match | None, peer: int, shared: int, bs: int) -> tuple[float, int]:
    """The docstring's "own": the fastest of computing all, loading from the instance's medium,
    from the best peer, from the shared tier."""
    options = [(MODEL.fixed_s + MODEL.prefill_s_per_token * tokens, 0)]
    if mine is not None:
        h = min(mine.blocks * bs, tokens)
        options.append((MODEL.fixed_s + MODEL.load_s_per_token[mine.medium] * h + MODEL.prefill_s_per_token * (tokens - h), h))
    for h, medium in ((peer, "PEER"), (shared, "SHARED")):
        if h:
            options.append((MODEL.fixed_s + MODEL.load_s_per_token[medium] * h + MODEL.prefill_s_per_token * (tokens - h), h))
    return min(options, key=lambda o: (o[0], -o[1]))


def by_load(load: float) -> float:
    """The affinity at ``load``: linear to AUTO_MAX, past that the queue's growth 1 / (1 - load), at
    most AUTO_CAP."""
    return min(AUTO_CAP, max(1.0 + (AUTO_MAX - 1.0) * load, 1.0 / (1.0 - load) if load < 1 else AUTO_CAP))


@given(load=st.floats(0.0, 1.0), more=st.floats(0.0, 1.0))
def test_the_affinity_by_load_grows_from_1_to_its_cap(load: float, more: float) -> None:
    """1 on an idle fleet, never less than the linear rule, never more than AUTO_CAP, never less at a
    higher load; below two thirds the linear rule itself."""
    a = auto_affinity(load)
    assert auto_affinity(0.0) == 1.0 and auto_affinity(1.0) == AUTO_CAP
    assert 1.0 + (AUTO_MAX - 1.0) * load <= a <= AUTO_CAP
    assert auto_affinity(max(load, more)) >= a
    if load <= 2 / 3:
        assert a == pytest.approx(1.0 + (AUTO_MAX - 1.0) * load)
    assert a == pytest.approx(by_load(load))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 6), data=st.data(), tokens=st.integers(0, 3000), p2p=st.booleans(),
       shared=st.integers(0, 40), affinity=st.one_of(st.none(), st.floats(1.0, 8.0)),
       budget=st.sampled_from([64, 512, 2048, 8192]))
def test_the_cost_policy_picks_the_least_expected_ttft(n: int, data: st.DataObject, tokens: int, p2p: bool,
                                                        shared: int, affinity: float | None, budget: int) -> None:
    bs = 64
    fleet = backends(n)
    state = {}
    for b in fleet:
        b.healthy = data.draw(st.booleans(), label="healthy")
        if data.draw(st.booleans(), label="idle"):         # nothing in flight
            continue
        queued = data.draw(st.integers(0, 5000), label="queued")
        waiting = data.draw(st.integers(0, 3), label="waiting") + (queued > 0)
        state[b.name] = (queued, waiting, data.draw(st.integers(0, 12), label="decoding"))
    held = {b.name: Match(data.draw(st.integers(1, 50)), data.draw(st.sampled_from(MEDIA)))
            for b in fleet if data.draw(st.booleans(), label="holds")}
    # what the router has just sent where (its blocks: on the GPU once computed, not yet in the index)
    sent = {b.name: data.draw(st.integers(1, 50)) for b in fleet if data.draw(st.booleans(), label="sent")}
    names = list(range(tokens // bs))
    chooser = Chooser("cost", block_size=bs, lookup=lambda _: dict(held), model=MODEL, affinity=affinity, p2p=p2p,
                      shared=(lambda ns: shared) if shared else None, budget=budget)
    for b in fleet:
        if b.name in state:
            queued, waiting, decoding = state[b.name]
            occupy(chooser, b, queued=queued, waiting=waiting, decoding=decoding)
    chooser.recent.lookup = lambda ns, now: {k: min(v, len(ns)) for k, v in sent.items() if min(v, len(ns))}  # type: ignore[method-assign]
    chooser.load = load = data.draw(st.floats(0.0, 1.0), label="load so far")
    up = [b for b in fleet if b.healthy] or fleet
    window = LOAD_ARRIVALS * len(up)
    prior = data.draw(st.integers(0, 3 * window), label="arrivals of other prompts before")
    for i in range(prior):
        chooser.demand.add([("other", i)], window)
    choice = chooser.choose(fleet, tokens, names, now=0.0)
    event(f"why: {choice.why}")
    assert choice.why in ("cost", "idle", "copy") and sorted(b.name for b in choice.order) == sorted(b.name for b in up)
    now_affinity = affinity
    if affinity is None:
        # the load: the fraction of instances with prefill queued, averaged over LOAD_ARRIVALS per instance
        busy = sum(1 for b in up if b.queued_tokens) / len(up)
        load += (busy - load) / (LOAD_ARRIVALS * len(up))
        assert chooser.load == pytest.approx(load)
        affinity = by_load(load)
        now_affinity = by_load(busy)          # duplicated work: the load at this moment
    held_here = held if names else {}
    sent_here = {k: min(v, len(names)) for k, v in sent.items() if min(v, len(names))}
    # an instance holds what the index says or, on the GPU, what it was just sent, if that is more
    mine = {**held_here, **{k: Match(v, "GPU") for k, v in sent_here.items()
                            if k not in held_here or v > held_here[k].blocks}}
    # sent and not yet in the index: under way from what the index shows to what was sent
    pending = {k: (min(held_here[k].blocks * bs, tokens) if k in held_here else 0, min(v * bs, tokens))
               for k, v in sent_here.items() if k not in held_here or v > held_here[k].blocks}
    shared_tokens = min(shared * bs, tokens) if shared and names else 0

    def cost(b: Backend) -> tuple[float, int, float, float]:
        # a peer loads only what the index says another instance holds (what was just sent is not there yet)
        peer = max((min(m.blocks * bs, tokens) for inst, m in held_here.items() if inst != b.name), default=0) if p2p else 0
        own, reused = expected_own(tokens, mine.get(b.name), peer, shared_tokens, bs)
        weight = affinity if b.in_flight else (1.0 + affinity) / 2   # an idle instance: halfway to the affinity
        # computing what another instance is computing for this prompt now: weighed by the load at this
        # moment, divided by 1 + the other instances with nothing queued (spare capacity absorbs a copy)
        dup = max((to - max(done, reused) for inst, (done, to) in pending.items() if inst != b.name), default=0)
        spare = sum(1 for o in up if o is not b and not o.queued_tokens)
        extra = max(0.0, now_affinity - weight) * MODEL.prefill_s_per_token * dup / (1 + spare) if dup > 0 else 0.0
        decoding = b.in_flight - b.waiting
        # each step until its prefill ends (budget tokens a step) also decodes the running requests
        steps = max(1, math.ceil((b.queued_tokens + tokens - reused) / budget))
        decode = steps * (MODEL.decode_step_s + MODEL.decode_s_per_seq * decoding) if decoding else 0.0
        queue = MODEL.prefill_s_per_token * b.queued_tokens
        # the TTFT it would give, unweighted (an idle instance's with the copy's charge)
        ttft = queue + decode + own + (0.0 if b.in_flight else extra)
        return queue + decode + weight * own + extra, reused, ttft, queue + decode

    costs = {b.name: cost(b) for b in up}
    order = list(choice.order)

    def by_cost(seq: list[Backend]) -> bool:
        return all(costs[a.name][0] <= costs[b.name][0] + 1e-12 for a, b in zip(seq, seq[1:]))

    # an idle instance sooner than every busy one goes first, unless it gives up a prefix fewer than
    # two healthy instances hold; the rest are in the order of the weighted cost
    best_reuse = max(c[1] for c in costs.values())
    holders = sum(1 for b in up if b.name in mine and min(mine[b.name].blocks * bs, tokens) >= best_reuse)
    idle = [b for b in up if not b.in_flight]
    busy_ttft = min((costs[b.name][2] for b in up if b.in_flight), default=math.inf)
    soonest = min((costs[b.name][2] for b in idle), default=math.inf)

    def may_jump(b: Backend) -> bool:
        return (not b.in_flight and costs[b.name][2] <= soonest + 1e-12 and costs[b.name][2] < busy_ttft
                and (costs[b.name][1] >= best_reuse or holders >= 2))

    def wait(b: Backend) -> float:              # before its own prefill: the queue and the decode steps
        return costs[b.name][3]

    def replicas(first: Backend) -> list[Backend]:
        """The instances the rule may put before ``first``: it holds its prefix (h blocks); the
        longest of the lengths of it that instances hold that the index shows somewhere and that
        calls for another holder (``calls_for_another``) is copied, to an instance that does not
        hold that length and waits less than ``first`` (none such: nothing is)."""
        h = min(costs[first.name][1] // bs, len(names))
        if h < 1 or first.name not in mine or mine[first.name].blocks < h:
            return []
        # this prompt's share of the arrivals, each weighing 1 - 1/window of the one after it (all
        # its blocks alike: the other arrivals share none of them)
        share = 1.0 / sum((1.0 - 1.0 / window) ** i for i in range(prior + 1))
        for level in sorted({min(mine[b.name].blocks, h) for b in up if b.name in mine}, reverse=True):
            if not any(m.blocks >= level for m in held_here.values()):
                continue
            holding = {b.name for b in up if b.name in mine and mine[b.name].blocks >= level}
            if not calls_for_another(len(holding), share * len(up)):
                continue
            return [b for b in up if b.name not in holding and wait(b) < wait(first)]
        return []

    def before_replication(seq: list[Backend]) -> None:
        first = seq[0]
        jumped = may_jump(first) and by_cost(seq[1:])
        assert jumped or by_cost(seq), "in the order of the cost, or the soonest idle instance first"
        if first.in_flight and idle and soonest < busy_ttft - 1e-12:
            tied = [b for b in idle if costs[b.name][2] <= soonest + 1e-12]
            assert not all(may_jump(b) for b in tied), "a busy instance first while an idle one was sooner"
        if not jumped:
            ranked = [costs[b.name] for b in seq]
            best = ranked[0][0]
            ties = [c for c in ranked if abs(c[0] - best) <= 1e-12]
            assert ranked[0][1] == max(t[1] for t in ties), "ties go to the longer prefix"
            tied = [b for b, c in zip(seq, ranked) if abs(c[0] - best) <= 1e-12 and c[1] == ranked[0][1]]
            assert first.in_flight == min(b.in_flight for b in tied), "then to fewer in flight"

    # a prefix held by fewer instances than its share of the arrivals: the instance that does not
    # hold it, waits less than the first and gives the first token soonest goes before it
    try:
        before_replication(order)
        plain = not replicas(order[0])
    except AssertionError:
        plain = False
    event(f"replicated: {not plain}, prior arrivals: {bool(prior)}")
    assert choice.why in (("cost", "idle") if plain else ("copy",))
    if choice.why == "idle":        # rule 5 put an idle instance before a busy one its cost ranked first
        jumper = order[0]
        assert not jumper.in_flight and may_jump(jumper), "said idle, but not the soonest idle instance"
        assert any(b.in_flight and costs[b.name][0] <= costs[jumper.name][0] + 1e-12 for b in up), \
            "said idle, but it was first by its cost"
    if not plain:
        others = replicas(order[1]) if len(order) > 1 else []
        assert order[0] in others, "neither the rules' first nor a replica of its prefix"
        assert costs[order[0].name][2] <= min(costs[b.name][2] for b in others) + 1e-12, "not the soonest replica"
        before_replication(order[1:])
    assert choice.promised == costs[choice.order[0].name][1]
    chooser.check(fleet)


def test_what_the_router_sent_counts_as_held_until_it_settles_or_expires() -> None:
    recent = Recent(ttl_s=10.0, settle_s=1.0)
    recent.add("a", [1, 2, 3], now=0.0)
    recent.add("b", [1, 2], now=0.5)
    assert recent.lookup([1, 2, 3, 4], now=1.0) == {"a": 3, "b": 2}
    recent.settle("a", [1, 2, 3], now=2.0)            # its first token: events confirm within 1 s
    assert recent.lookup([1, 2, 3], now=2.5) == {"a": 3, "b": 2}
    assert recent.lookup([1, 2, 3], now=3.5) == {"b": 2}
    assert recent.lookup([1, 2], now=10.6) == {}       # b's expired unsettled after ttl_s
    recent.expire(11.0)
    assert len(recent) == 0
    recent.check()
    with pytest.raises(ValueError, match="ttl_s"):
        Recent(ttl_s=0)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 6), max_size=5),
                              st.floats(0, 20), st.booleans()), max_size=30), cap=st.integers(1, 8))
def test_recent_matches_a_model_of_expiries(ops: list[Any], cap: int) -> None:
    """``Recent`` against a dict model: names LRU-bounded, expiry per (name, instance), the
    leading run of live names of each instance, and when each live record began (the first send
    since it last expired)."""
    recent = Recent(ttl_s=5.0, settle_s=1.0, max_names=cap)
    model: dict[int, dict[str, float]] = {}
    began: dict[tuple[int, str], float] = {}
    order: list[int] = []
    now = 0.0
    for inst, names, dt, settle in ops:
        now += dt
        if settle:
            recent.settle(inst, names, now)
            for nm in names:
                if nm in model and inst in model[nm]:
                    model[nm][inst] = min(model[nm][inst], now + 1.0)
        else:
            recent.add(inst, names, now)
            for nm in names:
                if model.get(nm, {}).get(inst, -1.0) <= now:
                    began[nm, inst] = now
                model.setdefault(nm, {})[inst] = now + 5.0
            for nm in touch(order, names, cap):
                del model[nm]
        recent.check()
        for nm in range(7):
            for who in "abc":
                live = model.get(nm, {}).get(who, -1.0) > now
                assert recent.since(nm, who, now) == (began[nm, who] if live else None)
        query = list(range(7))
        want: dict[str, int] = {}
        for who in "abc":
            k = 0
            while k < len(query) and model.get(query[k], {}).get(who, -1.0) > now:
                k += 1
            if k:
                want[who] = k
        assert recent.lookup(query, now) == want


@pytest.mark.parametrize("instances, burst", [(2, 6), (2, 4), (3, 6), (4, 8)])
def test_tenants_arriving_on_an_idle_fleet_spread_whatever_the_burst_size(instances: int, burst: int) -> None:
    """Bursts of one new tenant each, every burst arriving on an idle fleet: each burst follows its
    first request, and the first requests of new tenants take turns over the instances (a turn
    counted per request would send every tenant to one instance when the burst size is a multiple
    of the instances)."""
    fleet = backends(instances)
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=PROFILES["vllm-cpu"])
    tenants = 4 * instances
    sent: dict[str, int] = {}
    for t in range(tenants):
        names = [("tenant", t, k) for k in range(96)]
        got = []
        for _ in range(burst):
            choice = chooser.choose(fleet, 96 * 16 + 64, names, now=float(t))
            charge = chooser.sent(choice.order[0], 96 * 16 + 64, choice.promised, names, now=float(t))
            got.append((choice.order[0], charge))
        assert len({b.name for b, _ in got}) == 1, f"tenant {t}'s burst scattered"
        sent[got[0][0].name] = sent.get(got[0][0].name, 0) + burst
        for b, charge in got:                      # the burst is served: the fleet is idle again
            chooser.prefilled(b, charge, names, now=float(t) + 0.5)
            chooser.ended(b, 96 * 16 + 64, names)
        chooser.check(fleet)
    assert sorted(sent.values()) == [4 * burst] * instances


def test_a_burst_follows_its_first_request_while_that_is_cheaper() -> None:
    """Eight instances busy decoding (nothing queued), no KV events yet: a burst of one tenant's
    long prompt goes where its first request went until the queue there costs more than the prefix
    saves.  (On idle instances a request starts at once, and goes there when that is sooner.)"""
    fleet = backends(8)
    for b in fleet:
        b.in_flight = 1
    model = PROFILES["h100-8b"]
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=model, affinity=2.0)
    names, length = list(range(2048 // 16)), 2048 + 64
    first = None
    hit_s, miss_s = model.fixed_s + model.prefill(64), model.fixed_s + model.prefill(length)
    for i in range(40):
        choice = chooser.choose(fleet, length, names, now=0.0)
        chosen = choice.order[0]
        if first is None:
            first = chosen
        else:
            # every step until the prefill ends also decodes the instance's one running request
            steps = max(1, math.ceil((first.queued_tokens + 64) / chooser.budget))
            there = model.prefill(first.queued_tokens) + steps * model.decode_s(1) + 2.0 * hit_s
            elsewhere = math.ceil(length / chooser.budget) * model.decode_s(1) + 2.0 * miss_s
            if abs(there - elsewhere) > 1e-9:          # (a tie goes to the longer prefix: first)
                assert (chosen is first) == (there < elsewhere), f"request {i}: queue {first.queued_tokens} tokens"
            if chosen is first:
                assert choice.promised == 2048
        chooser.sent(chosen, length, choice.promised, names, now=0.0)
    assert first is not None and first.in_flight > 20, "the burst scattered"
    assert sum(1 for b in fleet if b.in_flight > 1) > 1, "the queue never sent one elsewhere"
    chooser.check(fleet)
    # the same burst under "prefix" with no events: every request a no_match, spread over the idlest
    plain = Chooser("prefix", block_size=16, lookup=lambda _: {}, recent=Recent(ttl_s=1e-9, settle_s=0.0))
    fleet2 = backends(8)
    spread = set()
    for _ in range(4):
        choice = plain.choose(fleet2, 2048 + 64, names, now=1.0)
        plain.sent(choice.order[0], 2048 + 64, choice.promised, names, now=0.0)   # expired by 1.0
        spread.add(choice.order[0].name)
    assert len(spread) == 4


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(st.integers(0, 100), min_size=2, max_size=5), data=st.data(), tokens=st.integers(1, 2000))
def test_cache_aware_follows_sglang_rules(loads: list[int], data: st.DataObject, tokens: int) -> None:
    """Imbalance (max - min > 64 and max > 1.5 min): the least loaded; else the best match over
    30% of the prompt; else the smallest tree."""
    fleet = backends(len(loads))
    for b, n in zip(fleet, loads):
        b.in_flight = n
    chooser = Chooser("cache_aware", block_size=16, balance_abs=64, balance_rel=1.5, cache_threshold=0.3)
    names = list(range(tokens // 16))
    for b in fleet:
        k = data.draw(st.integers(0, len(names)), label="sent")
        if k:
            chooser.recent.add(b.name, names[:k], now=0.0)
        extra = data.draw(st.integers(0, 3), label="other names")
        chooser.recent.add(b.name, [10_000 + 10 * fleet.index(b) + j for j in range(extra)], now=0.0) if extra else None
    runs = chooser.recent.lookup(names, now=1.0)
    choice = chooser.choose(fleet, tokens, names, now=1.0)
    lo, hi = min(loads), max(loads)
    if hi - lo > 64 and hi > 1.5 * lo:
        assert choice.why == "balance" and choice.order[0].in_flight == lo
    elif names and max(runs.values(), default=0) * 16 / tokens > 0.3:
        assert choice.why == "prefix" and runs[choice.order[0].name] == max(runs.values())
    else:
        sizes = {b.name: chooser.recent.size(b.name, 1.0) for b in fleet}
        assert choice.why == "no_match" and sizes[choice.order[0].name] == min(sizes.values())


def test_dynamo_credits_each_medium_as_published() -> None:
    fleet = backends(3)
    held = {"i0": Match(10, "STORAGE"), "i1": Match(10, "CPU"), "i2": Match(8, "GPU")}
    chooser = Chooser("dynamo", block_size=16, lookup=lambda _: dict(held))
    # 16 blocks: costs 16 - 2.5, 16 - 7.5, 16 - 8 -> the GPU holder of fewer blocks wins
    assert chooser.choose(fleet, 256, list(range(16)), now=0.0).order[0].name == "i2"
    fleet[2].active_tokens = 16 * 2                     # two decode blocks more: 10 > 8.5
    assert chooser.choose(fleet, 256, list(range(16)), now=0.0).order[0].name == "i1"


def test_bad_arguments_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="policy"):
        Chooser("fastest")
    for affinity in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="affinity"):
            Chooser("cost", affinity=affinity)
    with pytest.raises(ValueError, match="block_size"):
        Chooser("cost", block_size=0)
    for abs_, rel in ((-1, 1.5), (2, 0.99), (2, float("inf")), (2, float("nan")), (2.5, 1.5)):
        with pytest.raises(ValueError, match="balance_"):
            Chooser("prefix", balance_abs=abs_, balance_rel=rel)  # type: ignore[arg-type]


def test_a_prefix_split_across_media_is_credited_whole_at_each_mediums_cost() -> None:
    """Its head in the pool, its tail in the CPU tier: by one medium the index sees only the head;
    by ``lookup_spread`` the cost policy sees the whole prefix, the tail at the CPU tier's cost."""
    from radixkv.fleet.events import BlockStored, EventBatch
    from radixkv.fleet.index import Index

    idx = Index()

    def stored(seq: int, medium: str, hashes: list[int], parent: int | None) -> None:
        idx.apply("a", seq, EventBatch(ts=0.0, events=[BlockStored(block_hashes=hashes, parent_block_hash=parent,
                  token_ids=[], block_size=16, lora_id=None, medium=medium, lora_name=None)]))

    stored(0, "GPU", [1, 2], None)
    stored(1, "CPU", [3, 4, 5, 6], 2)
    idx.apply("b", 0, EventBatch(ts=0.0, events=[BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None,
              token_ids=[], block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
    names = [1, 2, 3, 4, 5, 6]
    assert idx.lookup(names)["a"].blocks == 2
    assert idx.lookup_spread(names)["a"].blocks == 6 and dict(idx.lookup_spread(names)["a"].by_medium) == {"GPU": 2, "CPU": 4}
    fleet = backends(2)
    fleet[0].name, fleet[1].name = "a", "b"
    chooser = Chooser("cost", block_size=16, lookup=idx.lookup, spread=idx.lookup_spread, model=MODEL, affinity=1.0)
    choice = chooser.choose(fleet, 6 * 16 + 8, names, now=0.0)
    assert choice.order[0].name == "a" and choice.promised == 96      # 96 tokens reused, 64 of them loaded
    blind = Chooser("cost", block_size=16, lookup=idx.lookup, model=MODEL, affinity=1.0)
    assert blind.choose(fleet, 6 * 16 + 8, names, now=0.0).order[0].name == "b"   # 48 on b's GPU > 32 on a's


def test_with_p2p_what_was_only_sent_is_not_a_load_for_peers() -> None:
    """A prefix the router has just sent one instance is not yet anywhere to load from: another
    instance would compute it, so its cost there is the whole prefill and it promises nothing."""
    fleet = backends(2)
    for b in fleet:
        b.in_flight = 1
    model = PROFILES["h100-8b"]
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=model, affinity=1.0, p2p=True)
    names, length = list(range(2048 // 16)), 2048 + 64
    first = chooser.choose(fleet, length, names, now=0.0)
    chooser.sent(first.order[0], length, first.promised, names, now=0.0)
    second = chooser.choose(fleet, length, names, now=0.0)
    # the other instance: the first request's queue there costs more than computing it all here
    assert second.order[0] is not first.order[0] and second.promised == 0
    # once the index says it holds the prefix, the other instance can load it from there
    chooser.lookup = lambda _: {first.order[0].name: Match(2048 // 16, "GPU")}
    third = chooser.choose(fleet, length, names, now=0.0)
    assert third.order[0] is not first.order[0] and third.promised == 2048


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 16), busy=st.lists(st.booleans(), min_size=1, max_size=16), arrivals=st.integers(1, 400))
def test_the_load_is_the_busy_fraction_averaged_over_arrivals(n: int, busy: list[bool], arrivals: int) -> None:
    """Under a steady busy fraction the cost policy's load moves toward it and never past it; it
    takes about LOAD_ARRIVALS arrivals an instance (a burst alone does not make a fleet busy)."""
    fleet = backends(n)
    for b, queued in zip(fleet, busy * n):
        b.queued_tokens, b.waiting, b.in_flight = (64, 1, 1) if queued else (0, 0, 0)
    target = sum(1 for b in fleet if b.queued_tokens) / n
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL)
    last = chooser.load
    for _ in range(arrivals):
        chooser.choose(fleet, 64, [1, 2, 3, 4], now=0.0)
        assert last <= chooser.load <= target + 1e-12, "toward the busy fraction, never past it"
        last = chooser.load
    assert chooser.load == pytest.approx(target * (1 - (1 - 1 / (LOAD_ARRIVALS * n)) ** arrivals))


@settings(max_examples=200, deadline=None)
@given(load=st.floats(0.0, 1.0), held=st.integers(1, 40), qa=st.integers(1, 40_000), qb=st.integers(1, 40_000),
       extra=st.integers(1, 3000))
def test_the_holder_wins_while_its_queue_is_less_than_the_affinity_times_the_work_it_saves(
        load: float, held: int, qa: int, qb: int, extra: int) -> None:
    """Two busy instances, one holding the prompt's head: the cost policy weighs the work each would
    compute by the affinity of the load (``by_load``: past two thirds, 1 / (1 - load)), so the
    holder wins exactly while its extra queue is less than that affinity times the prefill it saves."""
    bs = 64
    tokens = held * bs + extra
    fleet = backends(2)
    chooser = rare(Chooser("cost", block_size=bs, lookup=lambda _: {"i0": Match(held, "GPU")}, model=MODEL,
                           budget=1 << 30), 2)
    for b, q in zip(fleet, (qa, qb)):
        occupy(chooser, b, queued=q)
    chooser.load = load
    choice = chooser.choose(fleet, tokens, list(range(tokens // bs)), now=0.0)
    affinity = by_load(load + (1.0 - load) / (LOAD_ARRIVALS * 2))     # both busy: the average moves towards 1
    cost_a = MODEL.prefill(qa) + affinity * (MODEL.fixed_s + MODEL.prefill(tokens - held * bs))
    cost_b = MODEL.prefill(qb) + affinity * (MODEL.fixed_s + MODEL.prefill(tokens))
    assume(abs(cost_a - cost_b) > 1e-9 * max(cost_a, cost_b))
    assert choice.order[0].name == ("i0" if cost_a < cost_b else "i1")
    chooser.check(fleet)


@settings(max_examples=300, deadline=None)
@given(idle=st.integers(1, 8), load=st.floats(0.0, 0.2) | st.floats(0.0, 1.0), blocks=st.integers(1, 40),
       queued=st.integers(0, 3000) | st.integers(0, 20_000), ago=st.just(0.0) | st.floats(0.0, 0.5), data=st.data())
def test_a_copy_of_work_under_way_is_charged_less_the_more_instances_are_idle_and_not_for_a_stream(
        idle: int, load: float, blocks: int, queued: int, ago: float, data: st.DataObject) -> None:
    """The router began sending a prompt to one instance ``ago`` seconds before (under way, not
    yet in the index), and the same prompt arrives again: computing it on an idle instance is
    charged as a copy of that work, at the load of the moment, divided by 1 + the other idle
    instances (the fleet's spare capacity absorbs it); unless the router began sending it at
    least ``STREAM_AFTER`` of its expected prefill ago and two holders are at most its share of
    the arrivals times the instances: then it is a stream's, and not charged."""
    bs = 64
    tokens = blocks * bs + 10
    fleet = backends(1 + idle)
    a = fleet[0]
    names = list(range(blocks))
    chooser = Chooser("cost", block_size=bs, lookup=lambda _: {}, model=MODEL, budget=1 << 30)
    window = LOAD_ARRIVALS * len(fleet)
    # (a light load, a short queue, few other arrivals: where the charge decides, and a stream's
    # share calls for another holder; or any)
    prior = data.draw(st.integers(0, 3) | st.integers(0, 3 * window), label="arrivals of other prompts before")
    for i in range(prior):
        chooser.demand.add([("other", i)], window)
    occupy(chooser, a, queued=tokens + queued)
    chooser.recent.add(a.name, names, now=0.0)
    chooser.recent.add(a.name, names, now=ago / 2)      # sent again since: the record began at 0
    chooser.load = load
    choice = chooser.choose(fleet, tokens, names, now=ago)
    busy = 1 / len(fleet)
    affinity = by_load(load + (busy - load) / (LOAD_ARRIVALS * len(fleet)))
    weight = (1 + affinity) / 2
    share = 1.0 / sum((1.0 - 1.0 / window) ** i for i in range(prior + 1))
    after = STREAM_AFTER * (MODEL.fixed_s + MODEL.prefill(blocks * bs))
    assume(abs(ago - after) > 1e-9 and not near_a_bound(1, share * len(fleet)))
    stream = ago > after and calls_for_another(1, share * len(fleet))
    copy = 0.0 if stream else max(0.0, by_load(busy) - weight) * MODEL.prefill(blocks * bs) / idle
    cost_a = MODEL.prefill(a.queued_tokens) + affinity * (MODEL.fixed_s + MODEL.prefill(tokens - blocks * bs))
    cost_idle = weight * (MODEL.fixed_s + MODEL.prefill(tokens)) + copy
    assume(abs(cost_a - cost_idle) > 1e-9 * max(cost_a, cost_idle))
    assert (choice.order[0] is a) == (cost_a < cost_idle)
    assert choice.why == "cost", "not in the index: never a copy by share"
    chooser.check(fleet)


@settings(max_examples=200, deadline=None)
@given(queues=st.lists(st.integers(1, 20_000), min_size=1, max_size=4), idle=st.integers(1, 3),
       prefix=st.integers(1, 60), tail=st.integers(1, 500), load=st.floats(0.0, 1.0))
def test_an_idle_instance_goes_first_exactly_when_sooner_and_the_prefix_is_held_twice(
        queues: list[int], idle: int, prefix: int, tail: int, load: float) -> None:
    """Busy instances holding a prompt's prefix (each with a queue), idle ones holding nothing: the
    soonest idle instance goes first exactly when its TTFT (computing everything) is below every
    holder's (its queue and the tail) and the weighted cost prefers a holder and two or more
    instances hold the prefix; otherwise the least weighted cost wins."""
    bs = 64
    tokens = prefix * bs + tail
    fleet = backends(len(queues) + idle)
    held = {b.name: Match(prefix, "GPU") for b in fleet[:len(queues)]}
    chooser = rare(Chooser("cost", block_size=bs, lookup=lambda _: dict(held), model=MODEL, budget=1 << 30), len(fleet))
    for b, q in zip(fleet, queues):
        occupy(chooser, b, queued=q)
    chooser.load = load
    choice = chooser.choose(fleet, tokens, list(range(tokens // bs)), now=0.0)
    affinity = by_load(load + (len(queues) / len(fleet) - load) / (LOAD_ARRIVALS * len(fleet)))
    own_busy = MODEL.fixed_s + MODEL.prefill(tokens - prefix * bs)
    own_idle = MODEL.fixed_s + MODEL.prefill(tokens)
    busy_cost = min(MODEL.prefill(q) + affinity * own_busy for q in queues)
    idle_cost = (1 + affinity) / 2 * own_idle
    busy_ttft = min(MODEL.prefill(q) for q in queues) + own_busy
    assume(abs(busy_cost - idle_cost) > 1e-9 and abs(busy_ttft - own_idle) > 1e-9)
    if idle_cost < busy_cost or (own_idle < busy_ttft and len(queues) >= 2):
        assert choice.order[0] not in fleet[:len(queues)] and choice.promised == 0
    else:
        assert choice.order[0] in fleet[:len(queues)] and choice.promised == prefix * bs
    chooser.check(fleet)


@pytest.mark.parametrize("holders", [1, 2])
def test_an_idle_instance_sooner_than_the_busy_ones_takes_a_prefix_two_instances_hold(holders: int) -> None:
    """At high load the affinity weighs an idle instance's work above the holders' short queues, but
    an idle instance that gives the prompt its first token sooner than every busy one takes it, when
    the prefix it would compute again is held by two instances at least (replicated, so popular); a
    prefix one instance holds (a session's earlier turn) stays with its holder."""
    bs, prefix = 64, 40
    tokens = prefix * bs + 64
    fleet = backends(3)
    held = {b.name: Match(prefix, "GPU") for b in fleet[:holders]}
    chooser = rare(Chooser("cost", block_size=bs, lookup=lambda _: dict(held), model=MODEL, budget=1 << 30), 3)
    for b in fleet[:2]:
        occupy(chooser, b, queued=4000)                   # 0.4 s of prefill ahead
    chooser.load = 0.9
    choice = chooser.choose(fleet, tokens, list(range(prefix + 1)), now=0.0)
    affinity = by_load(0.9 + (2 / 3 - 0.9) / (LOAD_ARRIVALS * 3))
    idle_ttft = MODEL.fixed_s + MODEL.prefill(tokens)
    holder_ttft = MODEL.prefill(4000) + MODEL.fixed_s + MODEL.prefill(64)
    # the weighted cost prefers the holder; its TTFT is later than the idle instance's
    assert MODEL.prefill(4000) + affinity * (holder_ttft - MODEL.prefill(4000)) < (1 + affinity) / 2 * idle_ttft
    assert idle_ttft < holder_ttft
    if holders == 2:
        assert (choice.order[0].name, choice.promised) == ("i2", 0)
    else:
        assert (choice.order[0].name, choice.promised) == ("i0", prefix * bs)
    chooser.check(fleet)


@settings(max_examples=300, deadline=None)
@given(queues=st.lists(st.integers(1, 20_000), min_size=2, max_size=8, unique=True), data=st.data(),
       prefix=st.integers(1, 60), tail=st.integers(1, 500), affinity=st.floats(1.0, 20.0))
def test_a_prefix_held_by_fewer_instances_than_its_share_of_the_arrivals_is_copied_to_a_less_busy_one(
        queues: list[int], data: st.DataObject, prefix: int, tail: int, affinity: float) -> None:
    """Busy instances, ``k`` of them holding the prompt's prefix in the index: the least weighted
    cost wins unless it is a holder and ``k`` holders call for another (``calls_for_another``: the
    prefix's share of the arrivals, decayed over ``LOAD_ARRIVALS`` per instance, times the
    instances); then the instance that does not hold it, waits less than that holder and gives the
    first token soonest goes first."""
    bs, n = 64, len(queues)
    k = data.draw(st.integers(1, n - 1), label="holders")
    tokens = prefix * bs + tail
    names = list(range(tokens // bs))
    fleet = backends(n)
    held = {b.name: Match(prefix, "GPU") for b in fleet[:k]}
    chooser = Chooser("cost", block_size=bs, lookup=lambda _: dict(held), model=MODEL, budget=1 << 30,
                      affinity=affinity)
    for b, q in zip(fleet, queues):
        occupy(chooser, b, queued=q)
    window = LOAD_ARRIVALS * n
    # the arrivals before this one: this prompt's (True) or another's
    before = data.draw(st.lists(st.booleans(), max_size=3 * window), label="arrivals before")
    for i, mine in enumerate(before):
        chooser.demand.add(names if mine else [("other", i)], window)
    choice = chooser.choose(fleet, tokens, names, now=0.0)
    decay = 1.0 - 1.0 / window
    arrivals = before + [True]
    weights = [decay ** (len(arrivals) - 1 - i) for i in range(len(arrivals))]
    share = sum(w for w, mine in zip(weights, arrivals) if mine) / sum(weights)
    assert chooser.demand.share(names[prefix - 1], window) == pytest.approx(share)
    own_hit = MODEL.fixed_s + MODEL.prefill(tokens - prefix * bs)
    own_all = MODEL.fixed_s + MODEL.prefill(tokens)
    cost = {b.name: MODEL.prefill(b.queued_tokens) + affinity * (own_hit if b.name in held else own_all) for b in fleet}
    first = min(fleet, key=lambda b: cost[b.name])
    assume(all(abs(cost[b.name] - cost[first.name]) > 1e-9 for b in fleet if b is not first))
    assume(not near_a_bound(k, share * n))
    less_busy = [b for b in fleet[k:] if b.queued_tokens < first.queued_tokens]
    event(f"copied: {first.name in held and calls_for_another(k, share * n) and bool(less_busy)}, "
          f"rounded up: {calls_for_another(k, share * n) and k + 1 > share * n}")
    if first.name in held and calls_for_another(k, share * n) and less_busy:
        expected = min(less_busy, key=lambda b: b.queued_tokens)
        assert (choice.order[0], choice.promised, choice.why) == (expected, 0, "copy")
        assert choice.order[1] is first
    else:
        assert (choice.order[0], choice.why) == (first, "cost")
    chooser.check(fleet)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(3, 8), data=st.data(), part=st.integers(1, 40), rest=st.integers(1, 40),
       tail=st.integers(1, 500), affinity=st.floats(1.0, 20.0))
def test_a_leading_part_more_arrivals_share_is_copied_as_its_own_share_calls_for(
        n: int, data: st.DataObject, part: int, rest: int, tail: int, affinity: float) -> None:
    """A prompt of a leading part that another tenant's prompts share too (a fleet-wide system
    prompt, ``part`` blocks), then its tenant's (``rest`` blocks): ``whole`` instances hold both in
    the index, ``only`` the leading part, the others neither; each has a queue.  When a holder has
    the least weighted cost, the whole prefix is copied if its holders call for another
    (``calls_for_another`` at its share of the arrivals times the instances; to the soonest
    instance that does not hold it and waits less than that holder; none such: no copy);
    otherwise, when some instances hold the leading part alone, it is, if its holders call for
    another at its own share (to the soonest that holds neither and waits less); otherwise
    nothing is copied."""
    bs = 64
    whole = data.draw(st.integers(1, n - 1), label="instances holding the whole prefix")
    only = data.draw(st.integers(0, n - whole), label="instances holding the leading part alone")
    queues = data.draw(st.lists(st.integers(1, 20_000), min_size=n, max_size=n, unique=True), label="queues")
    tokens = (part + rest) * bs + tail
    names = ([("fleet", j) for j in range(part)] + [("tenant", j) for j in range(rest)]
             + [("question", j) for j in range(tokens // bs - part - rest)])
    other_tenant = names[:part] + [("other tenant", j) for j in range(rest)]
    fleet = backends(n)
    held = {b.name: Match(part + rest, "GPU") for b in fleet[:whole]}
    held.update({b.name: Match(part, "GPU") for b in fleet[whole:whole + only]})
    chooser = Chooser("cost", block_size=bs, lookup=lambda _: dict(held), model=MODEL, budget=1 << 30,
                      affinity=affinity)
    for b, q in zip(fleet, queues):
        occupy(chooser, b, queued=q)
    window = LOAD_ARRIVALS * n
    # (or, often, a long run mostly of the other tenant: the leading part's share near 1, the
    # whole's small, where only the leading part calls for holders)
    before = data.draw(st.lists(st.sampled_from(["this tenant", "other tenant", "other"]), max_size=3 * window)
                       | st.lists(st.sampled_from(["this tenant"] + ["other tenant"] * 3), min_size=window,
                                  max_size=3 * window), label="arrivals before")
    for i, who in enumerate(before):
        chooser.demand.add(names if who == "this tenant" else other_tenant if who == "other tenant"
                           else [("other", i)], window)
    choice = chooser.choose(fleet, tokens, names, now=0.0)
    decay = 1.0 - 1.0 / window
    arrivals = before + ["this tenant"]
    weights = [decay ** (len(arrivals) - 1 - i) for i in range(len(arrivals))]
    share_whole = sum(w for w, who in zip(weights, arrivals) if who == "this tenant") / sum(weights)
    share_part = sum(w for w, who in zip(weights, arrivals) if who != "other") / sum(weights)
    assume(not near_a_bound(whole, share_whole * n) and not near_a_bound(whole + only, share_part * n))
    reuse = {b.name: (held[b.name].blocks * bs if b.name in held else 0) for b in fleet}
    ttft = {b.name: MODEL.prefill(b.queued_tokens) + MODEL.fixed_s + MODEL.prefill(tokens - reuse[b.name])
            for b in fleet}
    cost = {b.name: ttft[b.name] + (affinity - 1) * (ttft[b.name] - MODEL.prefill(b.queued_tokens)) for b in fleet}
    first = min(fleet, key=lambda b: cost[b.name])
    assume(all(abs(cost[b.name] - cost[first.name]) > 1e-9 for b in fleet if b is not first))
    expected = []
    whole_calls = calls_for_another(whole, share_whole * n)
    if first.name in held and reuse[first.name] == (part + rest) * bs and whole_calls:
        expected = [b for b in fleet[whole:] if b.queued_tokens < first.queued_tokens]
    elif first.name in held and only and calls_for_another(whole + only, share_part * n):
        expected = [b for b in fleet[whole + only:] if b.queued_tokens < first.queued_tokens]
    by_part = bool(expected) and not (reuse[first.name] == (part + rest) * bs and whole_calls)
    event(f"copied: {bool(expected)}, the leading part alone: {by_part}")
    if expected:
        soonest = min(ttft[b.name] for b in expected)
        assume(sum(1 for b in expected if abs(ttft[b.name] - soonest) <= 1e-12) == 1)
        assert choice.why == "copy" and choice.order[0] in expected and ttft[choice.order[0].name] == soonest
        assert choice.order[1] is first
    else:
        assert (choice.order[0], choice.why) == (first, "cost")
    chooser.check(fleet)


@settings(max_examples=100, deadline=None)
@given(queued=st.integers(0, 20_000), prefix=st.integers(1, 40), tail=st.integers(1, 500),
       affinity=st.floats(1.0, 20.0))
def test_an_idle_instance_put_before_the_busy_holders_says_idle(queued: int, prefix: int, tail: int,
                                                                 affinity: float) -> None:
    """Two busy instances hold the prompt's prefix, a third is idle and holds none of it: the
    idle one goes first, as ``idle``, exactly when a holder has the least weighted cost and the
    idle one's expected first token (all of the prompt computed) is sooner than a holder's (its
    queue and the rest); else a holder goes first, as ``cost``."""
    bs = 64
    tokens = prefix * bs + tail
    names = list(range(tokens // bs))
    fleet = backends(3)
    held = {b.name: Match(prefix, "GPU") for b in fleet[:2]}
    chooser = rare(Chooser("cost", block_size=bs, lookup=lambda _: dict(held), model=MODEL, budget=1 << 30,
                           affinity=affinity), 3)
    for b in fleet[:2]:
        occupy(chooser, b, queued=queued)
    choice = chooser.choose(fleet, tokens, names, now=0.0)
    queue = MODEL.prefill(queued)
    own_hit, own_all = MODEL.fixed_s + MODEL.prefill(tail), MODEL.fixed_s + MODEL.prefill(tokens)
    holder_cost, idle_cost = queue + affinity * own_hit, (1.0 + affinity) / 2 * own_all
    holder_ttft, idle_ttft = queue + own_hit, own_all
    assume(abs(holder_cost - idle_cost) > 1e-9 and abs(holder_ttft - idle_ttft) > 1e-9)
    if holder_cost < idle_cost and idle_ttft < holder_ttft:
        assert (choice.order[0], choice.why) == (fleet[2], "idle")
    elif holder_cost < idle_cost:
        assert choice.order[0] in fleet[:2] and choice.why == "cost"
    else:
        assert (choice.order[0], choice.why) == (fleet[2], "cost")
    event(f"why: {choice.why}")
    chooser.check(fleet)


def test_a_prefix_not_yet_computed_anywhere_is_not_copied() -> None:
    """What the router has only sent (a burst's first request, its prefill not done, the index
    empty) is never copied: a copy would compute the prefix again beside the first."""
    bs, prefix = 64, 20
    tokens = prefix * bs + 64
    names = list(range(prefix + 1))
    fleet = backends(4)
    chooser = Chooser("cost", block_size=bs, lookup=lambda _: {}, model=MODEL, budget=1 << 30, affinity=8.0)
    first = chooser.choose(fleet, tokens, names, now=0.0).order[0]
    chooser.sent(first, tokens, 0, names, now=0.0)
    for _ in range(6):                          # the rest of the burst: every request's share is 1
        choice = chooser.choose(fleet, tokens, names, now=0.0)
        assert choice.order[0] is first
        chooser.sent(first, tokens, choice.promised, names, now=0.0)
    chooser.check(fleet)


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 4)), max_size=80),
       window=st.integers(1, 40), cap=st.integers(1, 8))
def test_demand_matches_a_model_of_decayed_counts(ops: list[tuple[str, int]], window: int, cap: int) -> None:
    """Each arrival adds 1 to each of its names and to the total, everything before it decayed by
    1 - 1/window an arrival; a name's share is its count over the total; at most ``cap`` names are
    kept, the one seen least recently dropped first (its share then 0)."""
    from radixkv.fleet.routing import Demand

    demand = Demand(max_names=cap)
    decay = 1.0 - 1.0 / window
    counts: dict[str, float] = {}
    seen: list[str] = []                        # least recently seen first
    total = 0.0
    for head, depth in ops:
        names = [head * (i + 1) for i in range(depth)]       # chained: "a", "aa", "aaa", ...
        demand.add(names, window)
        total = total * decay + 1.0
        counts = {name: c * decay for name, c in counts.items()}
        for name in names:
            counts[name] = counts.get(name, 0.0) + 1.0
        for name in touch(seen, names, cap):
            del counts[name]
        demand.check()
        assert len(demand) == len(seen)
        for name in {n for h in "abcdef" for n in (h, h * 2, h * 3)}:
            assert demand.share(name, window) == pytest.approx(counts.get(name, 0.0) / total, abs=1e-9)


@given(n=st.integers(2, 8), data=st.data())
def test_among_equal_queues_the_one_sent_earliest_takes_the_next(n: int, data: st.DataObject) -> None:
    """Every instance has one cold prompt of the same length queued, sent at different times (in
    any order over the instances): they cost the same, and the next cold prompt goes where the
    queued one was sent earliest, the queue furthest along.  (On the real fleet such a tie went to
    the instance that had just been sent its prompt and waited 231 ms where the other was free
    40 ms later.)  The next after it, with two queued there, goes to the next earliest."""
    fleet = backends(n)
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=PROFILES["vllm-cpu"])
    times = data.draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n, unique=True), label="sent at")
    length = 1536 + 64
    for b, t in sorted(zip(fleet, times), key=lambda bt: bt[1]):
        chooser.sent(b, length, 0, [("tenant", b.name, k) for k in range(96)], now=t)
    chooser.check(fleet)
    by_time = [b for b, _ in sorted(zip(fleet, times), key=lambda bt: bt[1])]
    for k in range(2):
        names = [("new", k, j) for j in range(96)]
        choice = chooser.choose(fleet, length, names, now=1.5)
        assert choice.order[0] is by_time[k], f"prompt {k} went to {choice.order[0].name}, not {by_time[k].name}"
        chooser.sent(choice.order[0], length, choice.promised, names, now=1.5)
        chooser.check(fleet)
    for b in fleet:                         # every queued prompt's first token: the send times go
        while b.waiting:
            chooser.prefilled(b, length, [], now=2.0)
    chooser.check(fleet)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 6), data=st.data())
def test_a_prompt_goes_where_it_and_its_output_fit_among_the_instances_that_reuse_as_much(
        n: int, data: st.DataObject) -> None:
    """Each instance has a pool of a drawn size (or none known) and requests in flight that pin drawn
    prompts, some sharing the new prompt's prefix, each with a drawn output or none (unknown).  The
    new prompt goes where the cost policy puts it with no pool known, unless it does not fit there
    (the blocks that instance's requests in flight pin, plus the pages their outputs and partial
    last blocks take, plus the prompt's other blocks and its own output's pages, are more than its
    pool) and another instance that reuses at least as much of it has room: then to one of those,
    the rest of the order unchanged; where none has room, to the one of those whose pool falls
    short by the fewest pages, if fewer than the first's.  What is pinned and held is what the
    requests in flight hold: nothing once every request has ended."""
    fleet = backends(n)
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL)
    prompt = [("p", j) for j in range(data.draw(st.integers(1, 40), label="prompt blocks"))]
    requests, pinned, alone = [], {b.name: set() for b in fleet}, {b.name: 0 for b in fleet}
    outputs = st.none() | st.integers(1, 200)

    def pages(tokens: int, names: list, output: int | None) -> int:
        return 0 if output is None else -(-(tokens + output) // 16) - len(names)

    for b in fleet:
        for k in range(data.draw(st.integers(0, 3), label=f"requests on {b.name}")):
            shared = data.draw(st.integers(0, len(prompt)), label="blocks shared with the prompt")
            names = prompt[:shared] + [(b.name, k, j) for j in range(data.draw(st.integers(0, 30)))]
            tokens = len(names) * 16 + 8
            output = data.draw(outputs, label="its output")
            charge = chooser.sent(b, tokens, 0, names, now=0.0, output=output)
            done = data.draw(st.booleans(), label="prefilled")
            if done:
                chooser.prefilled(b, charge, names, now=0.5)
            requests.append((b, tokens, names, charge, done, output))
            pinned[b.name].update(names)
            alone[b.name] += pages(tokens, names, output)
        held = len(pinned[b.name]) + alone[b.name]
        b.pool_blocks = data.draw(st.none() | st.integers(held, held + 45), label=f"pool of {b.name}")
    chooser.check(fleet)
    twin, twin_fleet = copy.deepcopy((chooser, fleet))
    for tb in twin_fleet:
        tb.pool_blocks = None
    tokens = len(prompt) * 16 + 8
    output = data.draw(outputs, label="the prompt's output")
    own = pages(tokens, prompt, output)

    def fits(name: str) -> bool:
        pool = next(b.pool_blocks for b in fleet if b.name == name)
        return pool is None or len(pinned[name] | set(prompt)) + alone[name] + own <= pool

    def reuse(name: str) -> int:               # what the router sent there lately: its longest run of the prompt
        return max((16 * sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(names, prompt)))
                    for b, _, names, _, _, _ in requests if b.name == name), default=0)

    def over(name: str) -> int:                 # pages by which its pool falls short, with the prompt
        pool = next(b.pool_blocks for b in fleet if b.name == name)
        return 0 if pool is None else len(pinned[name] | set(prompt)) + alone[name] + own - pool

    plain = [b.name for b in twin.choose(twin_fleet, tokens, prompt, now=1.0, output=output).order]
    choice = chooser.choose(fleet, tokens, prompt, now=1.0, output=output)
    got = [b.name for b in choice.order]
    first = plain[0]
    room = [name for name in plain[1:] if reuse(name) >= reuse(first) and fits(name)]
    less = [name for name in plain[1:] if reuse(name) >= reuse(first) and over(name) < over(first)]
    event(f"fit moved it: {not fits(first) and bool(room)}")
    event(f"moved to a pool less overcommitted: {not fits(first) and not room and bool(less)}")
    event(f"its output's pages counted: {own > 0}")
    if fits(first) or not (room or less):
        assert got == plain and choice.why != "fit"
    else:
        if room:
            assert choice.why == "fit" and got[0] in room, (got, room)
        else:                                   # fits nowhere that reuses as much: the least overcommitted
            assert choice.why == "fit" and got[0] == min(less, key=lambda name: (over(name), plain.index(name)))
        assert got[1:] == [name for name in plain if name != got[0]], "only the one that fits moved"
        assert choice.promised == min(reuse(got[0]), tokens)
    chooser.check(fleet)
    for b, length, names, charge, done, out in requests:
        if not done:
            chooser.prefilled(b, charge, names, now=2.0)
        chooser.ended(b, length, names, out)
        chooser.check(fleet)
    assert not any(chooser._pinned.values()), "blocks still pinned after every request ended"
    assert not any(chooser._private.values()), "pages still held alone after every request ended"


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 6), data=st.data())
def test_a_prompt_that_fits_nowhere_goes_to_the_pool_that_falls_short_by_the_fewest_pages(
        n: int, data: st.DataObject) -> None:
    """No instance holds the new prompt; each has requests in flight (drawn prompts, outputs told
    or not) and a pool that, with the prompt and its output's pages, falls short by a drawn number
    of pages (or has room).  Where the first of the cost policy's order (no pool known) has room,
    the order stands; where none has room, the instance whose pool falls short by the fewest pages
    goes first (the earlier in that order among equals), if fewer than the first's; the rest of the
    order is unchanged."""
    fleet = backends(n)
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL)
    prompt = [("p", j) for j in range(data.draw(st.integers(1, 20), label="prompt blocks"))]
    tokens, output = len(prompt) * 16 + 8, data.draw(st.none() | st.integers(1, 300), label="its output")
    own = chooser.pages(tokens, prompt, output)
    short = {}
    for b in fleet:
        held = 0
        for k in range(data.draw(st.integers(1, 3), label=f"requests on {b.name}")):
            names = [(b.name, k, j) for j in range(data.draw(st.integers(1, 10)))]
            out = data.draw(st.none() | st.integers(1, 300))
            charge = chooser.sent(b, len(names) * 16 + 8, 0, names, now=0.0, output=out)
            if data.draw(st.booleans(), label="prefilled"):
                chooser.prefilled(b, charge, names, now=0.5)
            held += len(names) + chooser.pages(len(names) * 16 + 8, names, out)
        short[b.name] = data.draw(st.integers(-2, held), label=f"pages {b.name} falls short by")
        b.pool_blocks = held + len(prompt) + own - short[b.name]      # the prompt alone fits it empty
    chooser.check(fleet)
    twin, twin_fleet = copy.deepcopy((chooser, fleet))
    for tb in twin_fleet:
        tb.pool_blocks = None
    plain = [b.name for b in twin.choose(twin_fleet, tokens, prompt, now=1.0, output=output).order]
    choice = chooser.choose(fleet, tokens, prompt, now=1.0, output=output)
    got = [b.name for b in choice.order]
    assert all(chooser.overcommit(b, prompt, own) == short[b.name] for b in fleet)
    first = plain[0]
    room = [name for name in plain[1:] if short[name] <= 0]
    less = [name for name in plain[1:] if short[name] < short[first]]
    event(f"the first has room: {short[first] <= 0}; another has: {bool(room)}; less short: {bool(less)}")
    if short[first] <= 0 or not (room or less):
        assert got == plain and choice.why != "fit"
    else:
        assert choice.why == "fit"
        if room:
            assert got[0] in room
        else:
            assert got[0] == min(less, key=lambda name: (short[name], plain.index(name)))
        assert got[1:] == [name for name in plain if name != got[0]]
    chooser.check(fleet)


@settings(max_examples=150, deadline=None)
@given(prompt_blocks=st.integers(4, 60), decoding=st.integers(1, 20), output=st.integers(16, 512),
       spare=st.integers(0, 40), queued=st.integers(0, 4000))
def test_a_pool_full_of_outputs_sends_a_prompt_to_another_holder_with_room(
        prompt_blocks: int, decoding: int, output: int, spare: int, queued: int) -> None:
    """Two instances hold a tenant's prompt.  One has ``decoding`` of its requests in flight, each
    generating ``output`` tokens, and a pool that holds their blocks and pages with ``spare``
    pages to spare; the other has ``queued`` tokens of another prompt waiting and room.  Where the
    cost policy (no pool known) sends the tenant's next request (the same output) to the first, it
    goes there while its pages fit, and else to the other (``fit``).  With the outputs unknown
    (no ``max_tokens``), the router counts the prompts' blocks alone and the pools change nothing."""
    prompt = [("tenant", j) for j in range(prompt_blocks)]
    tokens = prompt_blocks * 16 + 8

    def fleet(out: int | None, pools: bool) -> tuple[Chooser, list[Backend]]:
        a, b = backends(2)
        chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL)
        charge = chooser.sent(b, tokens, 0, prompt, now=0.0, output=out)     # b computed it and ended
        chooser.prefilled(b, charge, prompt, now=0.2)
        chooser.ended(b, tokens, prompt, out)
        for _ in range(decoding):
            charge = chooser.sent(a, tokens, 0, prompt, now=0.0, output=out)
            chooser.prefilled(a, charge, prompt, now=0.5)
        if queued:
            other = [("other", j) for j in range(queued // 16)]
            chooser.sent(b, queued, 0, other, now=0.9, output=out)
        if pools:
            a.pool_blocks = prompt_blocks + decoding * alone + spare
            b.pool_blocks = prompt_blocks + queued // 16 + 2 * (alone + 40)
        chooser.check([a, b])
        return chooser, [a, b]

    alone = Chooser("cost", block_size=16).pages(tokens, prompt, output)
    assert alone == -(-(tokens + output) // 16) - prompt_blocks
    twin, plain_fleet = fleet(output, pools=False)
    plain = twin.choose(plain_fleet, tokens, prompt, now=1.0, output=output).order[0].name
    chooser, (a, b) = fleet(output, pools=True)
    choice = chooser.choose([a, b], tokens, prompt, now=1.0, output=output)
    event(f"the first without pools: {plain}; its pages fit there: {alone <= spare}")
    if plain == b.name:
        assert choice.order[0] is b and choice.why != "fit"
    elif alone <= spare:
        assert choice.order[0] is a and choice.why != "fit"
    else:
        assert choice.order[0] is b and choice.why == "fit" and choice.promised == tokens - tokens % 16
    unknown, unknown_fleet = fleet(None, pools=True)
    assert unknown.choose(unknown_fleet, tokens, prompt, now=1.0).order[0].name == plain


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=12), data=st.data())
def test_a_first_token_drops_its_own_send_time_in_any_order(times: list[float], data: st.DataObject) -> None:
    """Requests sent to one instance at drawn times (the router's clock: in order) get their first
    tokens in any order (a retry's failure, a short prompt past a long one): each drops its own send
    time, so what is left is the send times of the requests still waiting, the oldest first, which
    ties are broken by."""
    b = backends(1)[0]
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL)
    times = sorted(times)
    charges = [chooser.sent(b, 100, 0, [("r", i)], now=t) for i, t in enumerate(times)]
    waiting = set(range(len(times)))
    for i in data.draw(st.permutations(range(len(times))), label="first tokens in order"):
        chooser.prefilled(b, charges[i], [("r", i)], now=20.0, sent_at=times[i])
        waiting.discard(i)
        chooser.check([b])
        assert list(chooser._sent_at[b.name]) == sorted(times[j] for j in waiting)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_wait_for_pages_ends_when_the_requests_expected_to_end_first_have_freed_enough(
        data: st.DataObject) -> None:
    """One instance with a pool of a drawn size has requests in flight that pin drawn prompts (some
    sharing the new one's head), each with a drawn output or none, some past their first token at
    drawn times; a drawn earlier request may have shown the instance's seconds a decode step.  The
    wait ``page_wait`` reports for a new prompt and its output is the time, from now, at which
    ending the requests decoding a known output in the order of their expected ends (first token
    plus a step for every token after it, the step at least what each request still decoding
    shows: the time since its first token over its steps) first makes the prompt fit (``fits``):
    0 when it fits now.  When ending all of them does not make it fit: where they are every request
    decoding there, some wait for their first token, and the prompt fits an empty pool, the last
    of those ends plus a decode of their mean output (the waiting requests free nothing before they
    have decoded); else ``None``."""
    b = backends(1)[0]
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL)
    prompt = [("p", j) for j in range(data.draw(st.integers(1, 30), label="prompt blocks"))]
    step = MODEL.decode_s(1)
    if data.draw(st.booleans(), label="an end showed the step"):
        out, first, end = data.draw(st.integers(2, 100)), data.draw(st.floats(0.0, 0.5)), data.draw(st.floats(0.5, 1.0))
        chooser.prefilled(b, chooser.sent(b, 40, 0, [("old", 0)], 0.0, out), [("old", 0)], first, 0.0, 40, out)
        chooser.ended(b, 40, [("old", 0)], out, end)
        step = (end - first) / (out - 1)
        assert chooser._step_s[b.name] == pytest.approx(step)
    decodes = []
    told = data.draw(st.booleans(), label="every output told")
    for k in range(data.draw(st.integers(0, 10), label="requests in flight")):
        shared = data.draw(st.integers(0, len(prompt)) | st.just(len(prompt)), label="blocks shared with the prompt")
        names = prompt[:shared] + [("r", k, j) for j in range(data.draw(st.integers(0, 20)))]
        tokens = len(names) * 16 + data.draw(st.integers(0, 15))
        output = data.draw(st.integers(1, 300) if told else st.integers(1, 300) | st.none(), label="its output")
        charge = chooser.sent(b, tokens, 0, names, now=0.0, output=output)
        if data.draw(st.integers(0, 3), label="past its first token unless 0"):
            first = data.draw(st.floats(0.0, 1.0), label="its first token")
            chooser.prefilled(b, charge, names, first, 0.0, tokens, output)
            if output is not None:
                decodes.append((first, output, tokens, names))
    if "i0" not in chooser._step_s:
        step = MODEL.decode_s(max(1, b.decoding))
    now = data.draw(st.floats(0.5, 3.0), label="now")
    # a request still decoding after e seconds of its s steps shows a step of at least e / s
    step = max([step] + [(now - first) / (output - 1) for first, output, _, _ in decodes if output > 1])
    held = len(chooser._pinned.get(b.name, {})) + chooser._private.get(b.name, 0)
    b.pool_blocks = held + data.draw(st.integers(0, 12) | st.integers(0, 40), label="pages to spare")
    chooser.check([b])
    names = prompt + [("new", j) for j in range(data.draw(st.integers(0, 10)))]
    tokens = len(names) * 16 + data.draw(st.integers(0, 15))
    own = chooser.pages(tokens, names, data.draw(st.none() | st.integers(1, 300), label="the new output"))
    got = chooser.page_wait(b, names, own, now)
    twin, twin_b = copy.deepcopy((chooser, b))
    expected = 0.0 if twin.fits(twin_b, names, own) else None
    for first, output, length, request in sorted(decodes, key=lambda d: d[0] + max(0, d[1] - 1) * step):
        if expected is not None:
            break
        twin.ended(twin_b, length, request, output)
        twin.check([twin_b])
        if twin.fits(twin_b, names, own):
            expected = max(0.0, first + max(0, output - 1) * step - now)
    timed_all = decodes and len(decodes) == b.decoding and b.waiting > 0 and own + len(set(names)) <= b.pool_blocks
    if expected is None and timed_all:
        last = max(first + max(0, output - 1) * step for first, output, _, _ in decodes)
        expected = max(0.0, last + step * sum(max(0, output - 1) for _, output, _, _ in decodes) / len(decodes) - now)
        event("the wait: past the requests timed")
    event(f"the wait: {'none' if expected is None else 'now' if expected == 0 else 'some'}")
    assert (got is None) == (expected is None) and (got is None or got == pytest.approx(expected)), (got, expected)


@settings(max_examples=200, deadline=None)
@given(decoding=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(2, 300)), min_size=1, max_size=5),
       waiting=st.lists(st.integers(1, 300), min_size=1, max_size=6), prompt_blocks=st.integers(1, 20),
       wait_blocks=st.integers(20, 40), now=st.floats(1.0, 2.0))
def test_a_pool_its_waiting_requests_fill_is_waited_out_past_every_request_decoding_there(
        decoding: list[tuple[float, int]], waiting: list[int], prompt_blocks: int, wait_blocks: int,
        now: float) -> None:
    """Requests of one block decode drawn outputs (first tokens at drawn times) and requests of
    ``wait_blocks`` blocks wait for their first token, filling the pool; a new prompt of fresh
    blocks needs ``prompt_blocks`` pages more than the decoding ones free.  The waiting ones
    start as those end and free nothing before they have decoded, so the wait is the last of those
    ends plus a decode of their mean output, the step at least what each of them shows; with one
    request decoding an output the router was not told, it is ``None`` (that one may end first)."""
    b = backends(1)[0]
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL)
    for k, (first, output) in enumerate(decoding):
        names = [("d", k)]
        chooser.prefilled(b, chooser.sent(b, 16, 0, names, 0.0, output), names, first, 0.0, 16, output)
    freed = len(chooser._pinned[b.name]) + chooser._private[b.name]     # what their ends free
    for k, output in enumerate(waiting):
        chooser.sent(b, wait_blocks * 16, 0, [("w", k, j) for j in range(wait_blocks)], 0.0, output)
    b.pool_blocks = len(chooser._pinned[b.name]) + chooser._private[b.name]
    chooser.check([b])
    names = [("new", j) for j in range(freed + prompt_blocks)]
    own = chooser.pages(len(names) * 16, names, None)
    step = max([MODEL.decode_s(len(decoding))] + [(now - first) / (output - 1) for first, output in decoding])
    last = max(first + (output - 1) * step for first, output in decoding)
    expected = max(0.0, last + step * sum(output - 1 for _, output in decoding) / len(decoding) - now)
    assert chooser.page_wait(b, names, own, now) == pytest.approx(expected)
    untold = [("u", 0)]
    chooser.prefilled(b, chooser.sent(b, 16, 0, untold, 0.0, None), untold, 0.5, 0.0, 16, None)
    b.pool_blocks = len(chooser._pinned[b.name]) + chooser._private[b.name]
    assert chooser.page_wait(b, names, own, now) is None


@settings(max_examples=200, deadline=None)
@given(prompt_blocks=st.integers(4, 60), output=st.integers(2, 400), spare=st.integers(0, 30),
       firsts=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12), known=st.booleans())
def test_a_pool_full_of_long_outputs_sends_a_prompt_to_an_instance_with_room_when_its_prefill_costs_less_than_the_wait(
        prompt_blocks: int, output: int, spare: int, firsts: list[float], known: bool) -> None:
    """The only holder of a prompt has requests of it decoding ``output`` tokens each (first tokens
    at drawn times) in a pool with ``spare`` pages to spare; an idle instance that holds nothing has
    room.  The next request of the prompt (the same output) goes to the idle one when its cost
    there (computing the whole prompt) is below the holder's, or when the prompt does not fit in the
    holder's pool and that cost is below the holder's with its wait for pages (when enough requests
    are expected to end: first token plus a decode step a token, the step at least what the
    requests still decoding show) in place of its queue (``fit``);
    else to the holder.  With the outputs unknown to the router (no ``max_tokens``), the holder
    keeps it while its cost is the least: no wait for pages can be told."""
    a, b = backends(2)
    prompt = [("tenant", j) for j in range(prompt_blocks)]
    chooser = Chooser("cost", block_size=16, model=MODEL, affinity=2.0,
                      lookup=lambda names: {a.name: Match(min(len(names), prompt_blocks), "GPU")})
    for i in range(40):                     # the prompt is a small share of the arrivals: no copy is called for
        chooser.demand.add([("x", i)], LOAD_ARRIVALS * 2)
    tokens = prompt_blocks * 16 + 8
    told = output if known else None
    for first in firsts:
        charge = chooser.sent(a, tokens, tokens, prompt, now=0.0, output=told)
        chooser.prefilled(a, charge, prompt, first, 0.0, tokens, told)
    alone = chooser.pages(tokens, prompt, output)
    a.pool_blocks = prompt_blocks + (len(firsts) * alone if known else 0) + spare
    b.pool_blocks = 10 * (prompt_blocks + alone)
    chooser.check([a, b])
    now = 1.0
    queue_a = MODEL.decode_s(len(firsts))   # one engine step, which also decodes what a is decoding
    step = max([queue_a] + [(now - f) / (output - 1) for f in firsts])
    cost_a = queue_a + 2.0 * (MODEL.fixed_s + MODEL.prefill(8))
    cost_b = 1.5 * (MODEL.fixed_s + MODEL.prefill(tokens))     # idle: halfway between 1 and the affinity
    need = (alone if known else 0) - spare
    ends = sorted(f + (output - 1) * step for f in firsts)
    wait = None
    if known and need <= 0:
        wait = 0.0
    elif known and need <= len(firsts) * alone:
        wait = max(0.0, ends[-(-need // alone) - 1] - now)
    assume(abs(cost_b - cost_a) > 1e-9)
    assume(wait is None or abs(cost_b - cost_a - max(0.0, wait - queue_a)) > 1e-9)
    choice = chooser.choose([a, b], tokens, prompt, now, output=told)
    event(f"the holder's pool: {'fits' if wait == 0 else 'unknown' if wait is None else 'waits'}")
    if cost_b < cost_a:
        assert choice.order[0] is b and choice.why == "cost"
    elif wait and cost_b < cost_a + max(0.0, wait - queue_a):
        assert choice.order[0] is b and choice.why == "fit"
    else:
        assert choice.order[0] is a and choice.why == "cost"
    chooser.check([a, b])


@settings(max_examples=100, deadline=None)
@given(prompt_blocks=st.integers(1, 40), new_blocks=st.integers(0, 60), output=st.integers(1, 300),
       spare=st.integers(0, 20))
def test_a_request_that_ends_frees_none_of_the_blocks_the_waiting_prompt_reuses(
        prompt_blocks: int, new_blocks: int, output: int, spare: int) -> None:
    """The only request in flight pins a prompt and decodes a known output; the next prompt is the
    same prompt and ``new_blocks`` more.  When it does not fit, the request's end frees its pages
    alone and not the prompt's blocks, which stay cached for the next prompt: the wait is until that
    end when those pages are enough, else unknown (``None``)."""
    b = backends(1)[0]
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL)
    prompt = [("p", j) for j in range(prompt_blocks)]
    tokens = prompt_blocks * 16 + 8
    chooser.prefilled(b, chooser.sent(b, tokens, 0, prompt, 0.0, output), prompt, 0.5, 0.0, tokens, output)
    alone = chooser.pages(tokens, prompt, output)
    b.pool_blocks = prompt_blocks + alone + spare
    names = prompt + [("new", j) for j in range(new_blocks)]
    own = chooser.pages(len(names) * 16 + 8, names, output)
    need = new_blocks + own - spare
    step = max(MODEL.decode_s(1), 0.5 / (output - 1) if output > 1 else 0.0)
    expected = 0.0 if need <= 0 else max(0.0, 0.5 + (output - 1) * step - 1.0) if need <= alone else None
    got = chooser.page_wait(b, names, own, 1.0)
    assert (got is None) == (expected is None) and (got is None or got == pytest.approx(expected)), (got, expected)


def test_an_instance_that_falls_free_takes_the_last_request_waiting_where_it_is_sooner() -> None:
    """Three cold prompts wait on one instance, the other has nothing waiting: rebalancing moves the
    last of them there (its queue ahead of it on the first is longer than its own prefill on the
    second), the router's counts follow it, and its first token is then told with the move's charge
    and send time.  A request ``movable`` refuses stays; no other policy moves anything, nor the
    cost policy unless asked to.  With less than a step's budget of prompt tokens ahead of it, the
    engine has it in the step under way or the next: it stays, unless it does not fit the pool."""
    a, b = backends(2)
    names = {k: [("p", k, j) for j in range(60)] for k in range(3)}
    starting = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL, rebalance=True, budget=2001)
    for k in range(3):
        starting.sent(a, 1000, 0, names[k], now=float(k), key=k)
    assert starting.rebalance([a, b], 5.0) == [], "2000 tokens ahead of it, a step of 2001: it is starting"
    starting.check([a, b])
    a.pool_blocks = 150             # the three prompts' 180 blocks do not fit: it waits for pages
    moves = starting.rebalance([a, b], 5.0)
    assert [(m.key, m.source, m.target) for m in moves] == [(2, a, b)]
    starting.check([a, b])
    a, b = backends(2)
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL, rebalance=True, budget=2000)
    charges = {k: chooser.sent(a, 1000, 0, names[k], now=float(k), key=k) for k in range(3)}
    assert chooser.rebalance([a, b], 5.0, movable=lambda key: key != 2) == [], "the last one is not movable"
    chooser.check([a, b])
    moves = chooser.rebalance([a, b], 5.0)
    assert moves and moves[0].key == 2 and moves[0].source is a and moves[0].target is b
    assert moves[0].charge == 1000 and moves[0].sent_at == 5.0
    assert (a.waiting, b.waiting) == (3 - len(moves), len(moves)) and a.queued_tokens + b.queued_tokens == 3000
    chooser.check([a, b])
    assert chooser.rebalance([a, b], 5.0) == [], "what moved is where it is sooner: nothing more moves"
    moved = {m.key: m for m in moves}
    for k in range(3):
        where, charge, sent_at = (b, moved[k].charge, 5.0) if k in moved else (a, charges[k], float(k))
        chooser.prefilled(where, charge, names[k], 6.0, sent_at, 1000, None, key=k)
        chooser.ended(where, 1000, names[k], None, 7.0)
        chooser.check([a, b])
    assert all(x.in_flight == x.waiting == x.queued_tokens == 0 for x in (a, b))
    for policy in ("prefix", "cache_aware", "dynamo", "least_loaded", "round_robin"):
        a, b = backends(2)
        other = Chooser(policy, block_size=16, lookup=lambda _: {}, model=MODEL, rebalance=True)
        for k in range(3):
            other.sent(a, 1000, 0, names[k], now=float(k), key=k)
        assert other.rebalance([a, b], 5.0) == [], policy
    a, b = backends(2)
    off = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL)
    for k in range(3):
        off.sent(a, 1000, 0, names[k], now=float(k), key=k)
    assert off.rebalance([a, b], 5.0) == [], "off unless asked for"


@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 4), ops=st.lists(st.tuples(st.sampled_from("ssspper"), st.integers(0, 10**6)), max_size=40),
       budget=st.sampled_from((16, 16, 160, 2048)))
def test_rebalancing_keeps_every_count_and_moves_only_from_two_waiting_to_none(n: int, ops: list[tuple[str, int]],
                                                                            budget: int) -> None:
    """Requests sent (prompts of shared and own blocks, some with pages for their output; chosen or
    sent anywhere), first tokens,
    ends and rebalancing in any order: after each step the router's counts pass ``check``; a move
    takes the request sent last to an instance where two or more wait, to one where none did, and
    its record goes with it, from behind a step's budget of prompt tokens or more unless the
    instance has a pool (where it may not fit); rebalancing again at once moves nothing."""
    bs = backends(n)
    pool = [None, 40, 400]
    for i, b in enumerate(bs):
        b.pool_blocks = pool[i % len(pool)]
    chooser = Chooser("cost", block_size=16, lookup=lambda _: {}, model=MODEL, rebalance=True, budget=budget)
    # waiting: where, charge, sent_at, names, tokens, output, and when it got there (moves too)
    where: dict[int, tuple[Backend, int, float, list[Any], int, int | None, int]] = {}
    turn = itertools.count()
    decoding: list[tuple[Backend, list[Any], int, int | None]] = []
    now = 0.0
    for k, (op, x) in enumerate(ops):
        now += 0.01
        if op == "s":
            tokens = 16 * (1 + x % 12)
            names = [("shared", j) for j in range(x % 3)] + [("own", k, j) for j in range(tokens // 16 - x % 3)]
            output = None if x % 2 else 1 + x % 50
            # chosen, or (as a retry or the instance's own choice would) any instance
            b = chooser.choose(bs, tokens, names, now, output).order[0] if x % 3 else bs[x // 3 % n]
            charge = chooser.sent(b, tokens, 0, names, now, output, key=k)
            where[k] = (b, charge, now, names, tokens, output, next(turn))
        elif op == "p" and where:
            key = sorted(where)[x % len(where)]
            b, charge, sent_at, names, tokens, output, _ = where.pop(key)
            chooser.prefilled(b, charge, names, now, sent_at, tokens, output, key=key)
            decoding.append((b, names, tokens, output))
        elif op == "e" and decoding:
            b, names, tokens, output = decoding.pop(x % len(decoding))
            chooser.ended(b, tokens, names, output, now)
        elif op == "r":
            free = {b.name for b in bs if not b.waiting}
            last = {b.name: max((key for key, w in where.items() if w[0] is b), key=lambda key: where[key][6],
                                default=None) for b in bs}
            queued = {b.name: b.queued_tokens for b in bs}
            for move in chooser.rebalance(bs, now):
                assert move.target.name in free and move.source.name not in free
                assert move.key == last[move.source.name], "the request sent last there moves"
                ahead = queued[move.source.name] - where[move.key][1]
                assert ahead >= budget or move.source.pool_blocks is not None, "a request starting moved"
                queued[move.source.name] = ahead
                queued[move.target.name] += move.charge
                _, _, _, names, tokens, output, _ = where[move.key]
                where[move.key] = (move.target, move.charge, move.sent_at, names, tokens, output, next(turn))
                last = {b.name: max((key for key, w in where.items() if w[0] is b), key=lambda key: where[key][6],
                                    default=None) for b in bs}
            event("a move" if any(w[2] == now for w in where.values()) else "no move")
            assert chooser.rebalance(bs, now) == []
        chooser.check(bs)
        for b in bs:
            mine = [key for key, w in where.items() if w[0] is b]
            assert b.waiting == len(mine) and list(chooser._waiting.get(b.name, {})) == sorted(
                mine, key=lambda key: where[key][6]), f"{b.name}: the requests waiting there"
