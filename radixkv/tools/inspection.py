"""What the tiers hold, whether it verifies, and dropping a namespace: ``python -m radixkv inspect``.

    python -m radixkv inspect --config radixkv.yaml              # per tier, per namespace: chunks, bytes, ...
    python -m radixkv inspect --config radixkv.yaml --verify     # read every chunk and check its seal
    python -m radixkv inspect --config radixkv.yaml --drop 3f9c0a1e2b4d5c6f   # after a confirmation (or --yes)
    python -m radixkv inspect --config radixkv.yaml --json       # the same for scripts

The tiers are the configuration's persistent ones (``local_disk``, ``remote_url``): a CPU tier
lives in its engine's process, so a command run beside it sees none of it (from Python,
``holdings(cache.stack.tiers)`` lists a live cache's CPU tier too).  A namespace is shown by its
8-byte id (hex): ids are digests and name nothing, except the configuration's own namespace, which
is labelled with its model when the configuration has a ``layout`` (the id depends on it).

``verify`` reads every entry and checks it with ``radixkv.core.format.verify_chunk`` under the
deployment secrets (``secret``/``previous_secret`` of the configuration, else ``RADIXKV_SECRET``
and ``RADIXKV_PREVIOUS_SECRET``): ``corrupt`` is a blob that does not verify (bit rot, truncation,
a key that is not its tokens' digest), ``forged`` one not sealed by a secret the reader holds (or
sealed with one when the reader has none).  Reads run ``concurrency`` at a time; nothing is deleted
unless ``delete=True`` (``--delete-bad``).  Listing needs ``Tier.entries``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple, Sequence

from radixkv.core._checks import check_int
from radixkv.tools._progress import progress
from radixkv.core.format import ChunkAuthError, ChunkFormatError, Seal, verify_chunk

if TYPE_CHECKING:
    import argparse

    from radixkv.core.tier import Entry, Tier
    from radixkv.config import CacheConfig

__all__ = ["Holding", "VerifyReport", "drop", "holdings", "verify"]

class Holding(NamedTuple):
    """What one tier holds of one namespace: ``chunks`` entries of ``bytes`` bytes, the oldest and
    newest stamps (``Entry.stamp``: wall-clock seconds, ``None`` where the tier records none) and
    how many are ``pinned``.  ``label``: the model, for a namespace the caller named."""

    tier: str
    namespace: str
    label: str
    chunks: int
    bytes: int
    oldest: float | None
    newest: float | None
    pinned: int


class VerifyReport(NamedTuple):
    """The outcome of ``verify`` on one tier: entries ``checked`` and how many were ``ok``,
    ``corrupt``, ``forged``, ``missing`` (gone between the listing and the read) or ``error`` (the
    read failed), ``deleted`` bad ones, and up to ``limit`` examples ``(key hex, kind, message)``."""

    tier: str
    checked: int
    ok: int
    corrupt: int
    forged: int
    missing: int
    error: int
    deleted: int
    bad: tuple[tuple[str, str, str], ...]


def holdings(tiers: Sequence[Tier], *, names: Mapping[bytes, str] | None = None,
             ns_id: bytes | None = None) -> list[Holding]:
    """Per tier and namespace (of ``ns_id`` only, when given), what it holds; ``names`` labels
    namespace ids.  A tier that cannot list (``Tier.entries``) raises ``NotImplementedError``.
    Cost: one ``entries`` listing per tier, O(entries)."""
    names = dict(names or {})
    rows: list[Holding] = []
    for tier in tiers:
        per: dict[bytes, list[Any]] = {}
        for entry in tier.entries(ns_id):
            row = per.setdefault(entry.key[:8], [0, 0, None, None, 0])
            row[0] += 1
            row[1] += entry.size
            if entry.stamp is not None:
                row[2] = entry.stamp if row[2] is None else min(row[2], entry.stamp)
                row[3] = entry.stamp if row[3] is None else max(row[3], entry.stamp)
            row[4] += entry.pinned
        rows.extend(Holding(tier.name, ns.hex(), names.get(ns, ""), *row) for ns, row in sorted(per.items()))
    return rows


def verify(tier: Tier, *, secret: bytes | str | None = None, previous_secret: bytes | str | None = None,
           ns_id: bytes | None = None, concurrency: int = 8, delete: bool = False, show_progress: bool = False,
           limit: int = 20) -> VerifyReport:
    """Read every entry of ``tier`` (of ``ns_id``) and check it (``radixkv.core.format.verify_chunk``)
    under ``secret``/``previous_secret`` (default: the environment's), at most ``concurrency``
    reads at a time; with ``delete``, delete what does not verify.  ``show_progress``: a bar on
    stderr.  Cost: one listing, then one read and one hash or MAC pass per entry."""
    check_int(concurrency, "concurrency", 1)
    check_int(limit, "limit")
    from radixkv.core.stack import PREVIOUS_SECRET_ENV, SECRET_ENV

    secret = secret if secret is not None else os.environ.get(SECRET_ENV) or None
    previous_secret = previous_secret if previous_secret is not None else os.environ.get(PREVIOUS_SECRET_ENV) or None
    seals: dict[bytes, Seal] = {}
    seals_lock = threading.Lock()

    def seal_of(ns: bytes) -> Seal:
        with seals_lock:
            if ns not in seals:
                seals[ns] = Seal(secret, previous_secret, namespace_id=ns)
            return seals[ns]

    def check(entry: Entry) -> tuple[str, str]:
        try:
            blob = tier.get(entry.key)
        except Exception as exc:  # noqa: BLE001 - a fault of the tier is counted, never raised
            return "error", f"{type(exc).__name__}: {exc}"
        if blob is None:
            return "missing", ""
        try:
            verify_chunk(blob, namespace_id=entry.key[:8], key=entry.key[8:], seal=seal_of(entry.key[:8]))
        except ChunkAuthError as exc:
            return "forged", str(exc)
        except ChunkFormatError as exc:
            return "corrupt", str(exc)
        return "ok", ""

    entries = list(tier.entries(ns_id))
    counts: Counter[str] = Counter()
    bad: list[tuple[str, str, str]] = []
    doomed: list[bytes] = []
    with progress(len(entries), f"verify {tier.name}", enabled=show_progress) as bar, \
            ThreadPoolExecutor(concurrency, thread_name_prefix="radixkv-verify") as pool:
        pending: list[tuple[Entry, Future[tuple[str, str]]]] = []
        for i, entry in enumerate(entries):
            pending.append((entry, pool.submit(check, entry)))
            if len(pending) >= 2 * concurrency or i == len(entries) - 1:   # a bounded window in flight
                for done_entry, future in pending:
                    kind, message = future.result()
                    counts[kind] += 1
                    if kind in ("corrupt", "forged"):
                        doomed.append(done_entry.key)
                        if len(bad) < limit:
                            bad.append((done_entry.key.hex(), kind, message))
                    bar.update(1)
                pending = []
    deleted = sum(bool(tier.delete(key)) for key in doomed) if delete else 0
    return VerifyReport(tier.name, len(entries), counts["ok"], counts["corrupt"], counts["forged"], counts["missing"],
                        counts["error"], deleted, tuple(bad))


def drop(tiers: Iterable[Tier], ns_id: bytes) -> dict[str, int]:
    """Delete every entry of namespace ``ns_id`` from each tier; per tier, how many (a remote
    tier may say 0 when it cannot count).  Cost: one ``drop_namespace`` per tier."""
    from radixkv.core.tier import check_namespace_id

    check_namespace_id(ns_id)
    return {tier.name: int(tier.drop_namespace(ns_id)) for tier in tiers}


# -- the command ----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m radixkv inspect``."""
    parser.add_argument("--config", required=True, help="the radixkv YAML/JSON configuration of the tiers")
    parser.add_argument("--verify", action="store_true", help="read every chunk and check its seal")
    parser.add_argument("--delete-bad", action="store_true", help="with --verify: delete corrupt and forged chunks")
    parser.add_argument("--concurrency", type=int, default=8, help="reads in flight while verifying (default 8)")
    parser.add_argument("--namespace", help="only this namespace (hex id, or the configuration's model)")
    parser.add_argument("--drop", metavar="NAMESPACE", help="delete a namespace (hex id, or the configuration's "
                        "model) from every tier, after a confirmation")
    parser.add_argument("--yes", action="store_true", help="do not ask before --drop or --delete-bad")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def persistent_tiers(cfg: CacheConfig) -> tuple[list[Tier], dict[bytes, str]]:
    """The tiers of ``cfg`` a separate process can see (LMDB, S3, Redis: not the CPU tier, which
    lives in its engine's process), and the configured namespace's id labelled with its model
    (when the configuration has a ``layout``).  Opens the tiers: the caller closes them."""
    from dataclasses import replace

    names: dict[bytes, str] = {}
    layout = None
    if cfg.layout is not None:
        layout = cfg.make_layout(None)
        ns = cfg.make_namespace()
        names[ns.bind(layout).id] = ns.model
    # A tier this command cannot open is an error, not an empty listing: required, whatever the
    # configuration says for an engine (which starts without it).
    bare = replace(cfg, local_cpu=False, max_local_cpu_size=None, local_disk_required=bool(cfg.local_disk),
                   remote_required=bool(cfg.remote_url))
    return bare.make_tiers(layout), names        # type: ignore[arg-type]  # no CPU tier: layout unused


def namespace_arg(text: str, names: Mapping[bytes, str]) -> bytes:
    """A namespace given on the command line: 16 hex digits, or the configured model's name."""
    for ns, model in names.items():
        if text == model:
            return ns
    try:
        ns = bytes.fromhex(text)
    except ValueError:
        ns = b""
    if len(ns) != 8:
        raise ValueError(f"namespace: {text!r} is neither 16 hex digits nor the configured model "
                         f"({', '.join(names.values()) or 'no layout in the configuration'})")
    return ns


def _when(stamp: float | None) -> str:
    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """Rows as aligned text columns (numbers right-aligned).  O(cells)."""
    cells = [[str(c) for c in header]] + [[f"{c:,}" if isinstance(c, int) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(isinstance(r[i], int) for r in rows) if rows else False for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(r, widths, numeric)).rstrip()
                     for r in cells)


def _confirm(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        print(f"{question} -- not confirmed (no terminal): pass --yes", file=sys.stderr)
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def main(args: argparse.Namespace) -> int:
    """``python -m radixkv inspect``: print the holdings (and the verification, or drop a
    namespace).  Exit status 0, 1 when a verification found bad chunks, 2 when not confirmed."""
    from radixkv.config import load_config

    cfg = load_config(args.config)
    tiers, names = persistent_tiers(cfg)
    out: dict[str, Any] = {}
    status = 0
    try:
        if not tiers:
            print("radixkv inspect: the configuration has no local_disk or remote_url tier", file=sys.stderr)
            return 0
        only = namespace_arg(args.namespace, names) if args.namespace else None
        if args.drop:
            ns = namespace_arg(args.drop, names)
            label = f"{ns.hex()}" + (f" ({names[ns]})" if ns in names else "")
            if not _confirm(f"Delete every chunk of namespace {label} from {', '.join(t.name for t in tiers)}?",
                            args.yes):
                return 2
            out["dropped"] = drop(tiers, ns)
        rows = holdings(tiers, names=names, ns_id=only)
        out["holdings"] = [r._asdict() for r in rows]
        if args.verify:
            delete = args.delete_bad and _confirm("Delete the corrupt and forged chunks found?", args.yes)
            reports = [verify(t, secret=cfg.secret, previous_secret=cfg.previous_secret, ns_id=only,
                              concurrency=args.concurrency, delete=delete, show_progress=not args.no_progress)
                       for t in tiers]
            out["verify"] = [r._asdict() for r in reports]
            status = int(any(r.corrupt or r.forged for r in reports))
        if args.json:
            print(json.dumps(out, indent=2))
            return status
        if "dropped" in out:
            print("dropped: " + ", ".join(f"{k} {v:,}" for k, v in out["dropped"].items()))
        print(table([(r.tier, r.namespace, r.label or "-", r.chunks, r.bytes, _when(r.oldest), _when(r.newest),
                      r.pinned) for r in rows],
                    ("tier", "namespace", "model", "chunks", "bytes", "oldest", "newest", "pinned")))
        if args.verify:
            print()
            print(table([(r.tier, r.checked, r.ok, r.corrupt, r.forged, r.missing, r.error, r.deleted)
                         for r in reports],
                        ("tier", "checked", "ok", "corrupt", "forged", "missing", "error", "deleted")))
            for r in reports:
                for key, kind, message in r.bad:
                    print(f"  {r.tier} {key} {kind}: {message}")
        return status
    finally:
        for tier in tiers:
            tier.close()
