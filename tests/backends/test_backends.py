"""Storage tiers: the differential contract for every backend, and what each one promises beyond it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import xxhash

from radixkv import backends
from radixkv.backends import MemoryTier, Tier
from radixkv.backends.cpu import CpuTier
from radixkv.backends.lmdb import LmdbTier
from radixkv.testing.backends import CpuTierContract, LmdbTierContract, LmdbTtlTierContract, MemoryTierContract
from radixkv.testing.contract import TierContract

pytest.importorskip("lmdb")


def key(i: int, ns: int = 0) -> bytes:
    return bytes([ns]) * 8 + i.to_bytes(16, "little")


# -- the contract, for every tier -------------------------------------------------------------

class CpuInferredSlotsContract(CpuTierContract):
    def make_tier(self) -> Tier:
        return CpuTier(max_bytes=1200)  # slot size set by the first put


# The full contract runs are slow (seconds each): `make test` runs them; the loop keeps a short run of
# every shipped contract (test_harness.py's test_shipped_backends_pass_under_several_seeds).
class TestMemoryContract(MemoryTierContract.TestCase):
    pytestmark = pytest.mark.slow


class TestCpuContract(CpuTierContract.TestCase):
    pytestmark = pytest.mark.slow


class TestCpuInferredSlotsContract(CpuInferredSlotsContract.TestCase):
    pytestmark = pytest.mark.slow      # a slot size inferred


class TestLmdbContract(LmdbTierContract.TestCase):
    pytestmark = pytest.mark.slow      # on disk


class TestLmdbTtlContract(LmdbTtlTierContract.TestCase):
    pytestmark = pytest.mark.slow      # on disk, with a TTL


def test_the_contract_runs_from_a_factory_in_tmp_path(tmp_path: Path) -> None:
    """The function form: a factory taking the example's directory and the machine's clock."""
    TierContract.check(lambda path, clock: LmdbTier(path, max_bytes=1000, sync=False, clock=clock),
                       tmp_path=tmp_path, persistent=True, lru=True, used_bytes_exact=True,
                       settings=settings(max_examples=5, stateful_step_count=20))
    assert not any(tmp_path.iterdir()), "every example's directory is removed at teardown"


# -- the protocol and the registry ------------------------------------------------------------

def test_registry_creates_by_name_and_lazily(tmp_path: Path) -> None:
    assert {"memory", "cpu", "lmdb", "s3"} <= set(backends.available())
    assert isinstance(backends.create("memory"), MemoryTier)
    assert isinstance(backends.create("cpu", max_bytes=1024), CpuTier)
    with backends.create("lmdb", path=tmp_path / "db", max_bytes=1024, sync=False) as tier:
        assert isinstance(tier, LmdbTier)
    assert backends.CpuTier is CpuTier and backends.LmdbTier is LmdbTier
    with pytest.raises(ValueError, match="no tier named 'nope'.*memory"):
        backends.create("nope")
    backends.register("test-mem", MemoryTier)
    assert isinstance(backends.create("test-mem"), MemoryTier)
    with pytest.raises(ValueError, match="module:attribute"):
        backends.register("bad", "no_colon")


@pytest.mark.parametrize("bad, error", [(b"short", ValueError), ("x" * 24, TypeError),
                                        (bytearray(24), TypeError)])
def test_keys_are_24_bytes(bad: object, error: type[Exception]) -> None:
    for tier in (MemoryTier(), CpuTier(1024)):
        with pytest.raises(error, match="key"):
            tier.get(bad)  # type: ignore[arg-type]
        with pytest.raises(error, match="key"):
            tier.put(bad, b"x")  # type: ignore[arg-type]


def test_tier_is_abstract() -> None:
    with pytest.raises(TypeError):
        Tier()  # type: ignore[abstract]


def test_lmdb_module_imports_the_real_lmdb_and_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    import lmdb

    from radixkv.backends import lmdb as backend
    assert backend._import_lmdb() is lmdb
    monkeypatch.setitem(sys.modules, "lmdb", None)
    with pytest.raises(ImportError, match=r"pip install radixkv\[lmdb\]"):
        LmdbTier(tmp_path, max_bytes=1024)


# -- CpuTier ----------------------------------------------------------------------------------

def test_cpu_tier_evicts_least_recently_used() -> None:
    tier = CpuTier(max_bytes=3 * 64, slot_bytes=64)
    for i in range(3):
        assert tier.put(key(i), bytes([i]) * 50)
    assert tier.get(key(0)) is not None  # 0 is now the most recent; 1 the least
    assert tier.put(key(3), b"x" * 50)
    assert tier.contains_prefix([key(0), key(2), key(3)]) == 3
    assert tier.contains_prefix([key(1)]) == 0
    assert tier.stats()["evictions"] == 1
    tier.check()


def test_cpu_tier_rejects_blobs_larger_than_a_slot_and_drops_the_old_one() -> None:
    tier = CpuTier(max_bytes=256, slot_bytes=64)
    assert tier.put(key(0), b"a" * 64)
    assert not tier.put(key(0), b"b" * 65)
    assert tier.get(key(0)) is None and tier.stats()["rejected"] == 1
    tier.check()


def test_cpu_tier_arena_is_pinned_only_with_an_accelerator() -> None:
    plain = CpuTier(max_bytes=1024, pinned=False)
    assert not plain.pinned and plain.stats()["pinned_memory"] == 0
    default = CpuTier(max_bytes=1024)
    assert default.pinned == torch.accelerator.is_available()
    if not torch.accelerator.is_available():
        with pytest.raises(RuntimeError):
            CpuTier(max_bytes=1024, pinned=True)


@settings(max_examples=20, deadline=None)
@given(stored=st.integers(1, 6), data=st.data())
def test_cpu_and_lmdb_tiers_count_pinned_entries_alike(stored: int, data: st.DataObject) -> None:
    """``stats()["pinned"]`` counts pins in both local tiers (the CPU tier's arena memory is
    ``pinned_memory``): for stored keys pinned in order, the same number, and the entries listed as
    pinned."""
    pins = data.draw(st.integers(0, stored), label="pins")
    with tempfile.TemporaryDirectory() as d:
        cpu = CpuTier(max_bytes=64 * 64, slot_bytes=64, pinned=False)
        lmdb = LmdbTier(d, max_bytes=1 << 20)
        try:
            for tier in (cpu, lmdb):
                for i in range(stored):
                    assert tier.put(key(i), b"x" * 64)
                assert tier.pin([key(i) for i in range(pins)]) == pins
                assert tier.stats()["pinned"] == pins == sum(e.pinned for e in tier.entries())
                tier.check()
            assert cpu.stats()["pinned_memory"] == 0
        finally:
            cpu.close()
            lmdb.close()


def test_cpu_tier_read_leases_its_slot_until_consume_returns() -> None:
    tier = CpuTier(max_bytes=2 * 64, slot_bytes=64)
    tier.put(key(0), b"A" * 64)
    tier.put(key(1), b"B" * 64)

    def consume(view: memoryview) -> bytes:
        # Overwrite, evict and delete the key being read: its slot must not be reused meanwhile.
        tier.put(key(0), b"C" * 64)
        tier.put(key(2), b"D" * 64)
        tier.put(key(3), b"E" * 64)
        tier.check()
        assert tier.stats()["entries"] <= 2
        return bytes(view)

    assert tier.read(key(0), consume) == b"A" * 64
    tier.check()
    assert tier.used_bytes <= tier.capacity_bytes
    assert tier.put(key(4), b"F" * 64)  # the retired slot came back
    tier.check()


def test_cpu_tier_is_thread_safe() -> None:
    tier = CpuTier(max_bytes=16 * 256, slot_bytes=256)
    errors: list[BaseException] = []

    def blob_for(k: bytes, version: int) -> bytes:
        body = k + version.to_bytes(4, "little") * 40
        return xxhash.xxh3_64_digest(body) + body

    def check_whole(view: memoryview) -> None:
        if xxhash.xxh3_64_digest(view[8:]) != bytes(view[:8]):
            errors.append(AssertionError("torn zero-copy read"))

    def worker(seed: int) -> None:
        try:
            for step in range(400):
                k = key((seed * 7 + step) % 24)
                op = (seed + step) % 5
                if op in (0, 1):
                    tier.put(k, blob_for(k, step))
                elif op == 2:
                    got = tier.get(k)
                    if got is not None:
                        assert got[8:32] == k and xxhash.xxh3_64_digest(got[8:]) == got[:8], "torn read"
                elif op == 3:
                    tier.read(k, check_whole)
                else:
                    tier.delete(k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    tier.check()


# -- LmdbTier ---------------------------------------------------------------------------------

def _run_python(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out


_WRITER = """
    import sys
    from radixkv.backends.lmdb import LmdbTier
    path, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tier = LmdbTier(path, max_bytes=1 << 20, sync=False)
    for i in range(first, first + count):
        k = bytes(8) + i.to_bytes(16, "little")
        assert tier.put(k, k * (1 + i % 7))
    tier.close()
"""


@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
def test_lmdb_entries_survive_a_restart(tmp_path: Path) -> None:
    _finish(_run_python(_WRITER, str(tmp_path), "0", "20"))
    out = _finish(_run_python("""
        import sys
        from radixkv.backends.lmdb import LmdbTier
        tier = LmdbTier(sys.argv[1], max_bytes=1 << 20)
        tier.check()
        keys = [bytes(8) + i.to_bytes(16, "little") for i in range(20)]
        assert all(tier.get(k) == k * (1 + i % 7) for i, k in enumerate(keys))
        print(tier.contains_prefix(keys), tier.used_bytes)
    """, str(tmp_path)))
    assert out.split() == ["20", str(sum(24 * (1 + i % 7) for i in range(20)))]


@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
def test_lmdb_two_processes_write_concurrently(tmp_path: Path) -> None:
    procs = [_run_python(_WRITER, str(tmp_path), str(first), "60") for first in (0, 1000)]
    for proc in procs:
        _finish(proc)
    with LmdbTier(tmp_path, max_bytes=1 << 20) as tier:
        tier.check()
        for first in (0, 1000):
            keys = [bytes(8) + i.to_bytes(16, "little") for i in range(first, first + 60)]
            assert tier.contains_prefix(keys) == 60
        assert tier.used_bytes == sum(24 * (1 + i % 7) for i in [*range(60), *range(1000, 1060)])


def test_lmdb_map_full_evicts_and_retries(tmp_path: Path) -> None:
    # The byte budget is far above what a 256 KiB map can hold: the map fills first.
    tier = LmdbTier(tmp_path, max_bytes=64 << 20, map_size=256 << 10, sync=False)
    blob = b"m" * (10 << 10)
    assert all(tier.put(key(i), blob) for i in range(80))  # 800 KiB through a 256 KiB map
    stats = tier.stats()
    assert stats["map_full"] >= 1 and stats["evictions"] >= 1
    assert stats["limit_bytes"] < 256 << 10
    assert tier.get(key(79)) == blob
    tier.check()
    tier.close()


def test_lmdb_ttl_expires_entries_by_an_injected_clock(tmp_path: Path) -> None:
    now = [1000.0]
    tier = LmdbTier(tmp_path, max_bytes=1 << 20, ttl=10, clock=lambda: now[0], sync=False)
    tier.put(key(0), b"old")
    now[0] += 6
    tier.put(key(1), b"new")
    assert tier.get(key(0)) == b"old"  # reading does not extend a TTL
    now[0] += 5
    assert tier.get(key(0)) is None and tier.contains_prefix([key(0)]) == 0
    assert tier.contains_prefix([key(1)]) == 1
    tier.purge_expired()
    assert tier.used_bytes == 3 and tier.stats()["expired"] == 1
    now[0] += 5
    tier.purge_expired()
    assert tier.used_bytes == 0
    tier.check()
    tier.close()


def test_lmdb_lru_uses_batched_access_times(tmp_path: Path) -> None:
    now = [0.0]
    tier = LmdbTier(tmp_path, max_bytes=300, clock=lambda: now[0], sync=False, touch_every=1000,
                    touch_seconds=1e9)
    for i in range(3):
        now[0] += 1
        tier.put(key(i), b"x" * 100)
    now[0] += 1
    assert tier.get(key(0)) is not None
    assert tier.stats()["pending_touches"] == 1  # recorded, not yet written
    now[0] += 1
    tier.put(key(3), b"y" * 100)  # the write applies the touch first: key 1 is the oldest now
    assert tier.contains_prefix([key(0), key(2), key(3)]) == 3 and tier.contains_prefix([key(1)]) == 0
    tier.check()
    tier.close()


def _in_forked_child(child: Callable[[], bool]) -> bool:
    """Run ``child`` in a forked process; whether it returned true."""
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = child()
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def test_lmdb_reopens_itself_after_fork(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, max_bytes=1 << 20, sync=False)
    tier.put(key(0), b"parent")

    def child() -> bool:  # uses the inherited object: it must reopen, not share the handle
        ok = tier.get(key(0)) == b"parent" and tier.put(key(1), b"child")
        tier.close()
        return ok

    assert _in_forked_child(child)
    assert tier.get(key(1)) == b"child"
    tier.check()
    tier.close()


def test_lmdb_fork_waits_for_live_transactions(tmp_path: Path) -> None:
    # A child closing its inherited handle would end a read the parent has in flight.
    tier = LmdbTier(tmp_path, max_bytes=1 << 20, sync=False)
    tier.put(key(0), b"x")
    reading, finished = threading.Event(), []

    def slow_consume(view: memoryview) -> None:
        reading.set()
        time.sleep(0.3)
        finished.append(True)

    reader = threading.Thread(target=tier.read, args=(key(0), slow_consume))
    reader.start()
    assert reading.wait(10)
    assert _in_forked_child(lambda: bool(finished))  # the read was over before the fork happened
    reader.join()
    assert tier.get(key(0)) == b"x"
    tier.check()
    tier.close()


@pytest.mark.slow                 # a process of its own: `make test` runs it
def test_lmdb_clears_readers_of_dead_processes(tmp_path: Path) -> None:
    # While some process has the environment open, a reader slot of a killed process stays
    # taken (and pins old pages) until someone runs reader_check: the tier does on open.
    holder = LmdbTier(tmp_path, max_bytes=1 << 20, sync=False)
    reader = _run_python("""
        import sys, time, lmdb
        env = lmdb.open(sys.argv[1], max_dbs=5, max_readers=512)
        txn = env.begin()
        print("reading", flush=True)
        time.sleep(60)
    """, str(tmp_path))
    assert reader.stdout is not None and reader.stdout.readline().strip() == "reading"
    reader.kill()
    reader.communicate(timeout=30)
    out = _finish(_run_python("""
        import sys
        from radixkv.backends.lmdb import LmdbTier
        print(LmdbTier(sys.argv[1], max_bytes=1 << 20).stats()["stale_readers_cleared"])
    """, str(tmp_path)))
    assert int(out) >= 1
    holder.close()
