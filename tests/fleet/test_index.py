"""The fleet index against a plain reference model: any order of batches, gaps and the replays that
fill them, given-up gaps, clears, restarts, memory bounds; lookups and holdings agree after every
step, and ``check()`` holds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("msgspec")

from radixkv.fleet.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch  # noqa: E402
from radixkv.fleet.index import Index, Match, Spread, medium_key, medium_rank  # noqa: E402


class Reference:
    """The index's contract, written plainly: lists and sets, replays of whole histories."""

    def __init__(self, max_blocks: int, max_pending: int) -> None:
        self.max_blocks, self.max_pending = max_blocks, max_pending
        self.inst: dict[str, dict[str, Any]] = {}

    def apply(self, name: str, seq: int, batch: EventBatch) -> None:
        st_ = self.inst.setdefault(name, {"next": None, "pending": {}, "order": [], "held": {}})
        if st_["next"] is None or seq < st_["next"]:
            if st_["next"] is not None:
                self.clear(st_)
                st_["pending"] = {}
            st_["next"] = seq
        st_["pending"][seq] = batch
        if seq > st_["next"] and len(st_["pending"]) > self.max_pending:    # a gap given up
            self.clear(st_)
            st_["next"] = min(st_["pending"])
        self.drain(st_)

    def skip(self, name: str) -> None:
        st_ = self.inst[name]
        if st_["pending"]:
            self.clear(st_)
            st_["next"] = min(st_["pending"])
            self.drain(st_)

    def drain(self, st_: dict[str, Any]) -> None:
        while st_["next"] in st_["pending"]:
            for ev in st_["pending"].pop(st_["next"]).events:
                self.event(st_, ev)
            st_["next"] += 1

    @staticmethod
    def clear(st_: dict[str, Any]) -> None:
        st_["order"], st_["held"] = [], {}

    def event(self, st_: dict[str, Any], ev: Any) -> None:
        order, held = st_["order"], st_["held"]
        if isinstance(ev, AllBlocksCleared):          # vLLM's GPU prefix cache reset: the GPU medium only
            for h in list(held):
                held[h] = (held[h][0], held[h][1] - {"GPU", None})
                if not held[h][1]:
                    del held[h]
                    order.remove(h)
        elif isinstance(ev, BlockStored):
            parent, m = ev.parent_block_hash, medium_key(ev.medium)
            for h in ev.block_hashes:
                if h in order:
                    order.remove(h)
                order.append(h)
                media = held[h][1] if h in held else set()
                held[h] = (parent, media | {m})
                parent = h
            while len(order) > self.max_blocks:
                del held[order.pop(0)]
        else:
            m = medium_key(ev.medium)
            for h in ev.block_hashes:
                if h in held and m in held[h][1]:
                    held[h][1].discard(m)
                    if not held[h][1]:
                        del held[h]
                        order.remove(h)

    def lookup(self, hashes: list[int], include_stale: bool) -> dict[str, Match]:
        out = {}
        for name, st_ in self.inst.items():
            if st_["pending"] and not include_stale:
                continue
            media = {m for _, ms in st_["held"].values() for m in ms}
            best = None
            for m in sorted(media, key=medium_rank):
                run = 0
                for h in hashes:
                    if h not in st_["held"] or m not in st_["held"][h][1]:
                        break
                    run += 1
                if run and (best is None or run > best.blocks):
                    best = Match(run, m)
            if best is not None:
                out[name] = best
        return out

    def spread(self, hashes: list[int], include_stale: bool) -> dict[str, Spread]:
        """Per instance the leading run held on any medium, and the fastest medium of each block."""
        out = {}
        for name, st_ in self.inst.items():
            if st_["pending"] and not include_stale:
                continue
            counts: dict[Any, int] = {}
            for h in hashes:
                if h not in st_["held"]:
                    break
                fastest = min(st_["held"][h][1], key=medium_rank)
                counts[fastest] = counts.get(fastest, 0) + 1
            if counts:
                out[name] = Spread(sum(counts.values()), tuple(sorted(counts.items(), key=lambda kv: medium_rank(kv[0]))))
        return out


INSTANCES = ["a", "b", "c"]
# mostly 64-bit ints (the index's arrays), sometimes hashes it keeps in a dict beside them
hash_ = st.one_of(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9), st.sampled_from([b"x", b"y", -3, 2**70, 2**64 - 1]))
hashes = st.lists(hash_, min_size=1, max_size=5)
media = st.sampled_from(["GPU", "CPU", "cpu", "STORAGE", None, "disk"])
stored = st.builds(lambda hs, p, m: BlockStored(block_hashes=hs, parent_block_hash=p, token_ids=[], block_size=4,
                                                 lora_id=None, medium=m, lora_name=None),
                   hashes, st.one_of(st.none(), hash_), media)
removed = st.builds(lambda hs, m: BlockRemoved(block_hashes=hs, medium=m), hashes, media)
event = st.one_of(stored, stored, removed, st.just(AllBlocksCleared()))
batches = st.builds(lambda evs: EventBatch(ts=0.0, events=evs), st.lists(event, max_size=3))
op = st.one_of(
    st.tuples(st.just("apply"), st.sampled_from(INSTANCES), st.integers(-2, 3), batches, st.booleans()),
    st.tuples(st.just("apply"), st.sampled_from(INSTANCES), st.integers(-2, 3), batches, st.booleans()),
    st.tuples(st.just("skip"), st.sampled_from(INSTANCES)),
    st.tuples(st.just("lookup"), st.lists(hash_, max_size=8), st.booleans()),
)


def agree(idx: Index, ref: Reference) -> None:
    idx.check()
    for name, st_ in ref.inst.items():
        assert idx.stale(name) == bool(st_["pending"])
        assert idx.next_seq(name) == st_["next"]
        want = {h: (p, sorted(ms, key=medium_rank)) for h, (p, ms) in st_["held"].items()}
        assert idx.held(name) == want
        assert list(idx.held(name)) == st_["order"]
        assert idx.blocks(name) == len(want)
    assert len(idx) == len({h for st_ in ref.inst.values() for h in st_["held"]})


# cheap examples (a few ms): four times the profile's count, so that rarer paths (a gap given up
# after max_pending waiting batches, eviction past max_blocks mid-chain) come up in every run.
# ``every_step``: check and compare after every step (each read applies the queued events), or
# only at lookups and the end (long queues of events applied together)
@settings(max_examples=4 * settings.default.max_examples)
# ``native``: the extension's table and walk where it is built, or the numpy path throughout
@given(ops=st.lists(op, max_size=40), max_blocks=st.integers(1, 8), max_pending=st.integers(1, 4),
       every_step=st.booleans(), native=st.booleans())
def test_index_matches_reference(ops: list[tuple], max_blocks: int, max_pending: int, every_step: bool,
                                 native: bool) -> None:
    idx, ref = Index(max_blocks=max_blocks, max_pending=max_pending), Reference(max_blocks, max_pending)
    idx.native = native
    for o in ops:
        if o[0] == "apply":
            _, name, delta, batch, live = o
            st_ = ref.inst.get(name)
            base = 0 if st_ is None else st_["next"]
            if live and st_ is not None and st_["pending"]:
                base = max(st_["pending"]) + 1    # the live stream goes on past a gap
            seq = max(0, base + delta)            # in order, gaps (> 0), restarts, replays (< 0)
            idx.apply(name, seq, batch)
            ref.apply(name, seq, batch)
        elif o[0] == "skip":
            if o[1] in ref.inst:
                idx.skip_gap(o[1])
                ref.skip(o[1])
        else:
            assert idx.lookup(o[1], include_stale=o[2]) == ref.lookup(o[1], o[2])
            assert idx.lookup_spread(o[1], include_stale=o[2]) == ref.spread(o[1], o[2])
        if every_step:
            agree(idx, ref)
    agree(idx, ref)


@settings(max_examples=settings.default.max_examples // 2, deadline=None)
@given(n=st.integers(1, 300), width=st.integers(1, 70), seed=st.integers(0, 2**32 - 1), native=st.booleans())
def test_table_grows_and_shrinks_under_many_blocks(n: int, width: int, seed: int, native: bool) -> None:
    """Hundreds of random 64-bit hashes in chains, some dropped: table rebuilds, log rebuilds,
    evictions and a second holder on every other block, against the same reference."""
    import random
    rng = random.Random(seed)
    idx, ref = Index(max_blocks=200, max_pending=4), Reference(200, 4)
    idx.native = native
    hs = [rng.getrandbits(64) for _ in range(n)]
    seqs = {"a": 0, "b": 0}
    for start in range(0, n, width):
        for name, part in (("a", hs[start:start + width]), ("b", hs[start:start + width:2])):
            batch = stored_on("GPU" if name == "a" else "CPU", part, hs[start - 1] if start else None)
            idx.apply(name, seqs[name], batch)
            ref.apply(name, seqs[name], batch)
            seqs[name] += 1
        gone = EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=hs[start:start + width:3], medium="GPU")])
        idx.apply("a", seqs["a"], gone)
        ref.apply("a", seqs["a"], gone)
        seqs["a"] += 1
    agree(idx, ref)
    assert idx.lookup(hs) == ref.lookup(hs, False)
    assert idx.lookup(np.array(hs, dtype=np.uint64)) == ref.lookup(hs, False)
    idx.apply("a", 0, stored_on("GPU", hs[:3]))                    # a restart
    ref.apply("a", 0, stored_on("GPU", hs[:3]))
    agree(idx, ref)


def stored_on(medium: str, hs: list[int], parent: int | None = None) -> EventBatch:
    return EventBatch(ts=0.0, events=[BlockStored(block_hashes=hs, parent_block_hash=parent, token_ids=[],
                                                  block_size=16, lora_id=None, medium=medium, lora_name=None)])


def test_fastest_medium_and_longest_run() -> None:
    idx = Index()
    idx.apply("x", 0, stored_on("CPU", [1, 2, 3]))
    idx.apply("x", 1, stored_on("GPU", [1, 2]))
    idx.apply("y", 5, stored_on("STORAGE", [1, 2]))
    idx.apply("y", 6, stored_on("GPU", [1, 2]))
    assert idx.lookup([1, 2, 3, 4]) == {"x": Match(3, "CPU"), "y": Match(2, "GPU")}
    assert idx.lookup([9]) == {}


def test_gap_then_replay_then_restart() -> None:
    idx = Index()
    idx.apply("x", 0, stored_on("GPU", [1]))
    idx.apply("x", 2, EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[1], medium="GPU")]))
    assert idx.stale("x") and idx.lookup([1]) == {} and idx.lookup([1], include_stale=True) == {"x": Match(1, "GPU")}
    idx.apply("x", 1, stored_on("GPU", [1, 2]))               # the replay fills the gap
    assert not idx.stale("x") and idx.lookup([1, 2]) == {}
    idx.apply("x", 3, stored_on("GPU", [5]))
    idx.apply("x", 0, stored_on("GPU", [7]))                  # a restart
    assert idx.lookup([5]) == {} and idx.lookup([7]) == {"x": Match(1, "GPU")}
    idx.remove("x")
    idx.check()
    assert len(idx) == 0 and idx.instances() == []


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        Index(max_blocks=0)
    with pytest.raises(TypeError, match="max_pending"):
        Index(max_pending=1.5)  # type: ignore[arg-type]
    idx = Index()
    with pytest.raises(TypeError, match="instance"):
        idx.apply(1, 0, stored_on("GPU", [1]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seq"):
        idx.apply("x", "0", stored_on("GPU", [1]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch"):
        idx.apply("x", 0, [])
    with pytest.raises(KeyError, match="nobody"):
        idx.stale("nobody")
    idx.apply("x", 0, stored_on("GPU", [1]))            # the next batch of a known instance: checked alike
    with pytest.raises(TypeError, match="batch"):
        idx.apply("x", 1, [])
    with pytest.raises(TypeError, match="unknown event int"):
        idx.apply("x", 1, SimpleNamespace(events=[1]))
    with pytest.raises(TypeError, match="seq"):
        idx.apply("x", True, stored_on("GPU", [2]))
    assert idx.next_seq("x") == 1
    idx.apply("x", 1, EventBatch(ts=0.0, events=[BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=[],
                                                              block_size=16, lora_id=None,
                                                              medium=["GPU"],  # type: ignore[arg-type]
                                                              lora_name=None)]))
    with pytest.raises(TypeError, match="medium must be a str"):
        idx.check()


def test_bench_fleet_index_smoke(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from radixkv.bench import BENCHMARKS
    from radixkv.bench.fleet_index import main
    assert "fleet_index" in BENCHMARKS
    out = tmp_path / "r.txt"
    assert main(["--instances", "3", "--prompt-blocks", "100", "--blocks", "300", "--memory-blocks", "3000",
                 "--repeat", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# python -m radixkv.bench fleet_index") and "bytes a held block" in text
    assert "from an array" in text and "hashing the prompt" in text


# ---- the extension's one-pass walk (cuda_ext/index_walk.cpp) against the numpy path ----------

@pytest.fixture(scope="module")
def walk() -> None:
    """The C++ extension built (or found built) once for this module, and the index using it."""
    import shutil

    from radixkv.core import ops
    from radixkv.fleet import index as index_mod

    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on PATH: only the numpy path can run here")
    assert ops.build() in ("cpp", "cuda+cpp")
    index_mod._NATIVE.clear()                 # looked up again, now that the build is there
    assert index_mod._native() is not None


def both_paths(idx: Index, hs: Any, stale: bool) -> tuple[Any, Any]:
    """(lookup, lookup_spread) through the extension, after checking the numpy path gives the same."""
    native = (idx.lookup(hs, include_stale=stale), idx.lookup_spread(hs, include_stale=stale))
    idx.native = False
    try:
        plain = (idx.lookup(hs, include_stale=stale), idx.lookup_spread(hs, include_stale=stale))
    finally:
        idx.native = True
    assert native == plain
    return native


int_hashes = st.lists(st.integers(0, 9), max_size=8)


@given(ops=st.lists(op, max_size=30), queries=st.lists(st.tuples(int_hashes, st.booleans()), max_size=4),
       max_blocks=st.integers(1, 8))
def test_walk_matches_numpy_path(walk: None, ops: list[tuple], queries: list[tuple[list[int], bool]],
                                 max_blocks: int) -> None:
    """Random histories (gaps, clears, restarts, evictions): both paths give the reference's answers."""
    idx, ref = Index(max_blocks=max_blocks, max_pending=2), Reference(max_blocks, 2)
    for o in ops:
        if o[0] == "apply":
            _, name, delta, batch, _live = o
            seq = max(0, (0 if name not in ref.inst else ref.inst[name]["next"]) + delta)
            idx.apply(name, seq, batch)
            ref.apply(name, seq, batch)
        elif o[0] == "lookup":
            queries = queries + [(o[1], o[2])]
    for hs, stale in queries:
        got = both_paths(idx, hs, stale)
        assert got == (ref.lookup(hs, stale), ref.spread(hs, stale))
        if all(isinstance(h, int) and 0 <= h < 2**64 for h in hs):
            assert both_paths(idx, np.array(hs, dtype=np.uint64), stale) == got


@settings(max_examples=settings.default.max_examples // 2, deadline=None)
@given(holdings=st.lists(st.tuples(st.integers(0, 39), st.sampled_from(["GPU", "CPU", "STORAGE"]),
                                   st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=60),
       drops=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 12)), max_size=10),
       prompt_len=st.integers(0, 80))
def test_walk_matches_numpy_path_on_wide_masks(walk: None, holdings: list[tuple[int, str, int, int]],
                                               drops: list[tuple[int, int]], prompt_len: int) -> None:
    """Up to 40 instances on three media (masks of 8 to 128 bits, in one or two words), chains of
    large 64-bit hashes with holes: both paths agree, and with the reference."""
    prompt = [(2**64 - 1 - 7919 * i) % 2**64 for i in range(80)]
    idx, ref = Index(), Reference(4_000_000, 1024)
    seqs: dict[str, int] = {}
    for who, medium, start, length in holdings:
        name = f"i{who}"
        batch = stored_on(medium, prompt[start:start + length], prompt[start - 1] if start else None)
        for target in (idx, ref):
            target.apply(name, seqs.get(name, 0), batch)
        seqs[name] = seqs.get(name, 0) + 1
        for d_who, at in drops:
            if f"i{d_who}" == name:
                gone = EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[prompt[at]], medium="CPU")])
                for target in (idx, ref):
                    target.apply(name, seqs[name], gone)
                seqs[name] += 1
    hs = prompt[:prompt_len]
    got = both_paths(idx, hs, False)
    assert got == (ref.lookup(hs, False), ref.spread(hs, False))
    assert both_paths(idx, np.array(hs, dtype=np.uint64), False) == got


def same_state(a: Index, b: Index, probes: list[Any]) -> None:
    """``a`` and ``b`` hold the same: every read of the index agrees, and both check."""
    a.check()
    b.check()
    assert a.instances() == b.instances() and len(a) == len(b)
    for name in a.instances():
        assert list(a.held(name).items()) == list(b.held(name).items())
        assert (a.blocks(name), a.stale(name), a.next_seq(name)) == (b.blocks(name), b.stale(name), b.next_seq(name))
    for hs in probes:
        for stale in (False, True):
            assert a.lookup(hs, include_stale=stale) == b.lookup(hs, include_stale=stale)
            assert a.lookup_spread(hs, include_stale=stale) == b.lookup_spread(hs, include_stale=stale)


@settings(max_examples=settings.default.max_examples // 2, deadline=None)
@given(ops=st.lists(op, max_size=40), max_blocks=st.integers(1, 8), switch=st.integers(0, 40),
       chains=st.lists(st.tuples(st.sampled_from(INSTANCES), st.integers(0, 2**64 - 1), st.integers(1, 90),
                                 st.sampled_from(["GPU", "CPU"])), max_size=4))
def test_native_apply_matches_numpy_apply(walk: None, ops: list[tuple], max_blocks: int, switch: int,
                                          chains: list[tuple[str, int, int, str]]) -> None:
    """The same batches applied through the extension's table and through numpy's give the same
    index, read any way; and an index that switches paths half-way (the table built by one, grown
    and probed by the other) too.  Long chains of large hashes make the tables grow and rebuild."""
    native, plain, mixed = Index(max_blocks=max_blocks * 10), Index(max_blocks=max_blocks * 10), Index(max_blocks=max_blocks * 10)
    plain.native = False
    seqs: dict[str, int] = {}
    probes: list[Any] = []
    steps: list[tuple[str, int, EventBatch]] = []
    for name, start, length, medium in chains:
        hs = [(start + 0x9E3779B97F4A7C15 * i) % 2**64 for i in range(length)]
        steps.append((name, seqs.get(name, 0), stored_on(medium, hs)))
        seqs[name] = seqs.get(name, 0) + 1
        probes += [hs, np.array(hs[: length // 2], dtype=np.uint64)]
    for o in ops:
        if o[0] == "apply":
            _, name, delta, batch, _live = o
            seq = max(0, seqs.get(name, 0) + delta)
            steps.append((name, seq, batch))
            seqs[name] = max(seqs.get(name, 0), seq + 1)
        elif o[0] == "lookup":
            probes.append(o[1])
    for k, (name, seq, batch) in enumerate(steps):
        mixed.native = k < switch
        for idx in (native, plain, mixed):
            idx.apply(name, seq, batch)
    mixed.native = switch % 2 == 0
    same_state(native, plain, probes)
    same_state(mixed, plain, probes)


def test_native_functions_refuse_bad_arguments(walk: None) -> None:
    """The extension's index functions name the argument they refuse, and never read past a buffer."""
    from radixkv.fleet import index as index_mod

    fns = index_mod._native()
    table = np.zeros(16, index_mod._SLOT)
    table["val"] = -1
    raw = table.view(np.uint8)
    keys, vals, slots = np.arange(3, dtype=np.uint64), np.zeros(3, np.int32), np.zeros(3, np.intp)
    with pytest.raises(ValueError, match="table must be 12 << bits"):
        fns.index_find(raw, 5, keys, vals, slots)
    with pytest.raises(ValueError, match="bits"):
        fns.index_find(raw, 0, keys, vals, slots)
    with pytest.raises(TypeError, match="keys"):
        fns.index_find(raw, 4, keys.astype(np.int32), vals, slots)
    with pytest.raises(TypeError, match="vals_out"):
        fns.index_find(raw, 4, keys, vals.astype(np.int64), slots)
    with pytest.raises(ValueError, match="slots_out"):
        fns.index_find(raw, 4, keys, vals, slots[:2])
    with pytest.raises(TypeError, match="writable"):
        fns.index_put(bytes(raw), 4, keys, vals, slots)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        fns.index_put(raw, 4, keys, vals)
    assert fns.index_put(raw, 4, keys, np.array([5, 6, 7], np.int32), slots) == 3
    fns.index_find(raw, 4, keys[::-1].copy(), vals, slots)
    assert vals.tolist() == [7, 6, 5]
    with pytest.raises(ValueError, match="no empty slot"):
        fns.index_put(raw, 4, np.arange(100, 120, dtype=np.uint64), np.zeros(20, np.int32), np.zeros(20, np.intp))
    mask = np.ones((8, 1), np.uint8)
    order, starts = np.array([0], np.int64), np.array([0, 1], np.int64)
    per_id = (np.zeros(8, np.uint64), np.zeros(8, np.int8))     # no id's hash known: every block probed
    assert fns.index_walk(raw, 4, [0, 1, 2], mask, order, starts, None, *per_id, None) == [3]
    assert fns.index_walk(raw, 4, np.array([0, 1, 9], np.uint64), mask, order, starts, None, *per_id, None) == [2]
    assert fns.index_walk(raw, 4, [0, 1, 9], mask, order, starts, np.array([0, 1], np.int64), *per_id, None) == [0, 2]
    with pytest.raises(ValueError, match="best"):
        fns.index_walk(raw, 4, [0], mask, order, starts, np.array([0, 2], np.int64), *per_id, None)
    with pytest.raises(ValueError, match="past the mask's 4 rows"):
        fns.index_walk(raw, 4, [0], mask[:4], order, starts, None, per_id[0][:4], per_id[1][:4], None)
    with pytest.raises(ValueError, match="bit 9 is past"):
        fns.index_walk(raw, 4, [0], mask, np.array([9], np.int64), starts, None, *per_id, None)
    with pytest.raises(ValueError, match="starts"):
        fns.index_walk(raw, 4, [0], mask, order, np.array([0, 2], np.int64), None, *per_id, None)
    with pytest.raises(TypeError, match="mask"):
        fns.index_walk(raw, 4, [0], mask[:, 0], order, starts, None, *per_id, None)
    assert fns.index_walk(raw, 4, [0, b"x"], mask, order, starts, None, *per_id, None) is None     # the numpy path's to answer
    assert fns.index_walk(raw, 4, [0, -1], mask, order, starts, None, *per_id, None) is None
    assert fns.index_walk(raw, 4, [3, b"x"], mask, order, starts, None, *per_id, None) == [0]      # the walk ends before it
    with pytest.raises(ValueError, match="an entry per mask row"):
        fns.index_walk(raw, 4, [0], mask, order, starts, None, per_id[0][:7], per_id[1], None)
    with pytest.raises(TypeError, match="kinds"):
        fns.index_walk(raw, 4, [0], mask, order, starts, None, per_id[0], per_id[0], None)
    # The next id's hash: the table maps 10 to id 1 and 11 to id 6, but id 2 claims 11 too (an
    # index never does so: here it shows which id the walk took).  Row 6 lacks bit 1.
    t2 = np.zeros(16, index_mod._SLOT)
    t2["val"] = -1
    raw2 = t2.view(np.uint8)
    fns.index_put(raw2, 4, np.array([10, 11], np.uint64), np.array([1, 6], np.int32), np.zeros(2, np.intp))
    keys = np.zeros(8, np.uint64)
    keys[[1, 2, 6]] = [10, 11, 11]
    kinds = np.zeros(8, np.int8)
    rows = np.full((8, 1), 3, np.uint8)
    rows[6] = 1
    two, groups = np.array([0, 1], np.int64), np.array([0, 1, 2], np.int64)
    assert fns.index_walk(raw2, 4, [10, 11], rows, two, groups, None, keys, kinds, None) == [2, 2]    # took id 2
    flagged = kinds.copy()
    flagged[2] = 4                                              # id 2's hash is not in the table (free)
    assert fns.index_walk(raw2, 4, [10, 11], rows, two, groups, None, keys, flagged, None) == [2, 1]  # probed: id 6
    flagged[2] = 4 | 1                                          # the flag beside a parent kind
    assert fns.index_walk(raw2, 4, [10, 11], rows, two, groups, None, keys, flagged, None) == [2, 1]
    last = fns.index_walk(raw2, 4, [11, 10], rows[:7], two, groups, None, keys[:7], kinds[:7], None)
    assert last == [2, 0]                                       # id 6 is the last row: 10 probed
    # answer: lookup's dict built in C, {name: Match(run, medium)} for each set's pick
    sets = np.array([0, 2], np.int64)
    answer = (Match, ("a", "a"), ("GPU", None))
    got = fns.index_walk(raw2, 4, [10, 11], rows, two, groups, sets, keys, flagged, answer)
    assert got == {"a": Match(2, "GPU")} and type(got["a"]) is Match
    with pytest.raises(TypeError, match="answer"):
        fns.index_walk(raw2, 4, [10, 11], rows, two, groups, None, keys, kinds, answer)      # needs best
    with pytest.raises(TypeError, match="answer"):
        fns.index_walk(raw2, 4, [10, 11], rows, two, groups, sets, keys, kinds, (Match, ("a",), ("GPU",)))
    with pytest.raises(TypeError, match="answer"):
        fns.index_walk(raw2, 4, [10, 11], rows, two, groups, sets, keys, kinds, (dict, ("a", "a"), (1, 2)))
    out = np.empty(4, np.uint64)
    assert fns.index_gather([[1, 2**64 - 1], (3,), [2**63]], out) is True and out.tolist() == [1, 2**64 - 1, 3, 2**63]
    assert fns.index_gather([[1, 2], [3, 1]], out) is False
    assert fns.index_gather([[1, 2], [3, 2**64]], out) is None
    assert fns.index_gather([[1, 2], [3, True]], out) is None
    edges = [0, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**64 - 2]        # one, two and three 30-bit digits
    assert fns.index_gather([edges[:2], edges[2:]], np.empty(6, np.uint64)) is True
    got = np.empty(6, np.uint64)
    fns.index_gather([edges], got)
    assert got.tolist() == edges
    assert fns.index_gather([[2**90]], np.empty(1, np.uint64)) is None
    assert fns.index_gather([[-5]], np.empty(1, np.uint64)) is None
    with pytest.raises(ValueError, match="out has room for 4"):
        fns.index_gather([[1, 2], [3, 4, 5]], out)
    with pytest.raises(ValueError, match="seqs hold 3"):
        fns.index_gather([[1, 2], [3]], out)


@settings(max_examples=settings.default.max_examples // 2, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["store", "store", "remove", "clear"]), st.sampled_from(INSTANCES),
                                st.integers(0, 3), st.integers(0, 40), st.integers(1, 40),
                                st.sampled_from(["GPU", "CPU"])), min_size=1, max_size=25),
       max_blocks=st.integers(20, 120), queries=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40),
                                                                   st.integers(0, 60)), max_size=6))
def test_walk_next_id_fast_path(walk: None, steps: list[tuple[str, str, int, int, int, str]], max_blocks: int,
                                queries: list[tuple[int, int, int]]) -> None:
    """The walk's check of the next id (a chain stored at once gets consecutive ids): four long
    chains sharing their first blocks, stored in pieces in any order (a piece's parent the block
    before it), removed in pieces, stored again (freed ids reused), cleared and evicted: lookups
    from any block of a chain, through the walk and numpy, give the reference's answers."""
    shared = [2**63 + 17 * i for i in range(10)]
    tails = [[(0x9E3779B97F4A7C15 * (c * 1000 + i + 1)) % 2**64 for i in range(50)] for c in range(4)]
    chains_ = [shared + t for t in tails]
    idx, ref = Index(max_blocks=max_blocks), Reference(max_blocks, 1024)
    seqs: dict[str, int] = {}
    for kind, name, c, start, length, medium in steps:
        part = chains_[c][start:start + length]
        if kind == "store":
            batch = stored_on(medium, part, chains_[c][start - 1] if start else None)
        elif kind == "remove":
            batch = EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=part, medium=medium)])
        else:
            batch = EventBatch(ts=0.0, events=[AllBlocksCleared()])
        seq = seqs.get(name, 0)
        idx.apply(name, seq, batch)
        ref.apply(name, seq, batch)
        seqs[name] = seq + 1
    idx.check()
    for c, start, length in queries + [(c, 0, 60) for c in range(4)]:
        hs = chains_[c][start:start + length]
        got = both_paths(idx, hs, False)
        assert got == (ref.lookup(hs, False), ref.spread(hs, False))
        assert both_paths(idx, np.array(hs, dtype=np.uint64), False) == got
