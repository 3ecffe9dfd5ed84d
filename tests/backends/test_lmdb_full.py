"""LmdbTier never stops caching when its map fills (the sizes of the report that found it), in
this process and in a fresh one; its files are private; one environment per path per process."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmdb")

from radixkv.backends import lmdb as backend  # noqa: E402
from radixkv.backends.lmdb import LmdbTier  # noqa: E402

BLOB = 2240
PUTS = 400


def key(i: int) -> bytes:
    return bytes(8) + i.to_bytes(16, "little")


def blob(i: int) -> bytes:
    return i.to_bytes(4, "little") * (BLOB // 4)


def _fill(tier: LmdbTier, start: int) -> None:
    stored = [tier.put(key(i), blob(i)) for i in range(start, start + PUTS)]
    assert all(stored), f"{stored.count(False)} of {PUTS} puts refused: the tier stopped caching"
    for i in range(start + PUTS - 20, start + PUTS):  # the newest entries are there, intact
        assert tier.get(key(i)) == blob(i)
    tier.check()


_FRESH = """
import sys
from radixkv.backends.lmdb import LmdbTier
tier = LmdbTier(sys.argv[1], 10 << 20, map_size=1 << 20)
stored = sum(tier.put(bytes(8) + i.to_bytes(16, "little"), i.to_bytes(4, "little") * 560) for i in range(1000, 1400))
assert tier.get(bytes(8) + (1399).to_bytes(16, "little")) == (1399).to_bytes(4, "little") * 560
tier.check()
print(stored)
"""


@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
def test_the_reported_sizes_keep_storing_here_and_in_a_fresh_process(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path / "db", 10 << 20, map_size=1 << 20)
    _fill(tier, 0)
    assert tier.stats()["evictions"] > 0  # the map, not the 10 MiB budget, was the limit
    tier.close()
    out = subprocess.run([sys.executable, "-c", _FRESH, str(tmp_path / "db")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.split() == [str(PUTS)], out.stderr
    with LmdbTier(tmp_path / "db", 10 << 20, map_size=1 << 20) as again:
        _fill(again, 2000)


def test_a_map_filled_to_the_last_page_is_recovered_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the headroom (as a map filled by another process or an older version), writes hit
    # MDB_MAP_FULL; the tier evicts in small committed transactions and goes on.
    monkeypatch.setattr(backend, "_HEADROOM", 1.0)
    tier = LmdbTier(tmp_path / "db", 10 << 20, map_size=1 << 20)
    _fill(tier, 0)
    stats = tier.stats()
    assert stats["map_full"] >= 1 and stats["evictions"] > 0
    tier.close()


def test_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "private"
    with LmdbTier(path, 1 << 20, sync=False) as tier:
        tier.put(key(0), b"x")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for name in ("data.mdb", "lock.mdb"):
        assert stat.S_IMODE(os.stat(path / name).st_mode) == 0o600, name
    with LmdbTier(tmp_path / "shared", 1 << 20, sync=False, file_mode=0o640, dir_mode=0o750):
        pass
    assert stat.S_IMODE(os.stat(tmp_path / "shared" / "data.mdb").st_mode) == 0o640
    with pytest.raises(ValueError, match="file_mode"):
        LmdbTier(tmp_path / "bad", 1 << 20, file_mode=0o1777)


def test_one_environment_per_path_shared_by_every_tier_object(tmp_path: Path) -> None:
    first = LmdbTier(tmp_path, 1 << 20, sync=False)
    second = LmdbTier(str(tmp_path) + "/", 1 << 20, sync=False)  # the same path, spelled differently
    assert first._environment() is second._environment()
    assert first.put(key(1), b"one") and second.get(key(1)) == b"one"
    first.close()
    assert second.put(key(2), b"two") and second.get(key(1)) == b"one"  # still open for the other
    second.close()
    with LmdbTier(tmp_path, 1 << 20, sync=False) as third:  # reopened once the last one closed
        assert third.get(key(2)) == b"two"


def test_a_path_that_is_a_file_or_not_a_path_is_refused_naming_it(tmp_path: Path) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("not a directory")
    with pytest.raises(ValueError, match="path: .*a-file.* is a file, not a directory"):
        LmdbTier(afile, 1 << 20)
    with pytest.raises(TypeError, match="path must be a directory path"):
        LmdbTier(42, 1 << 20)                                  # type: ignore[arg-type]
    assert afile.read_text() == "not a directory"                  # left as it was
