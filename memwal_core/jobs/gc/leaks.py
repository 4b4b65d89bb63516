"""Leaked base-table files: what commits that lost a race (or crashed) left behind.

A Lance commit writes its data files (`data/`), deletion files (`_deletions/`), its
transaction file (`_transactions/`) and index files (`_indices/{uuid}/`) first and its manifest
last; a commit that loses the race for its version and is abandoned (or crashes) leaves those
files, referenced by no manifest. Lance's `cleanup_old_versions` removes such "unverified"
files only once they are 7 days old, or at any age with `delete_unverified=True`, which would
also delete the files of a commit in flight (its manifest is not written yet) and is therefore
only safe when nothing else writes. memwal needs neither: it knows what every retained version
references and keeps anything younger than a grace period.

Plan (`plan_leaks`, read-only):
1. list `_versions/` and read every manifest there (the retained versions, detached ones
   included; one GET each, cached per process since versions are immutable, and what the
   versions reference is kept for the next run in `_memwal/gc_refs.json`, `leak_refs.py`, so a
   manifest is read once): the data files and deletion files of their
   fragments, their transaction file, and the uuids of their indexes. A manifest that cannot be
   read or that carries a field memwal does not know where file references live (a data file in
   another base, a future format) stops the whole scan: nothing is collected (fail closed);
2. list the four directories; a file no retained version references, older than the grace
   (`GcOptions.leaked_file_grace_seconds`, newest file for an index directory), is leaked;
3. list `_versions/` again: a version committed during the scan has its references removed from
   the candidates.

Why this is safe: a new commit references the files of the version it read (retained, so read in
step 1, or committed during the scan, step 3) plus files it wrote itself, which are younger than
the grace unless that commit has run longer than the grace (a day by default; a memwal step that
holds the table lease is fenced long before). Lance's own cleanup may remove versions meanwhile:
that only removes references, never adds one.

When: the scan lists the whole table, and leaked files are rare (a lost race, a crash), so a GC
pass scans only when `GcOptions.full_scan_interval_seconds` passed since the last scan that
completed (its time is kept in the version summary, `history.py`, written by execution; a failed
scan is not recorded, so the next pass scans again). Skipping a scan deletes nothing, which is
always safe; a file leaked at time t is collected by the first scan after t + grace, so within
grace + interval (plus the time to the next pass). `run_gc(dry_run=True)` always scans, and a
plan that skipped says when the next scan is due (`GcPlan.leak_scan`).
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field

from memwal_core.errors import MemwalError
from memwal_core.jobs.gc import history, leak_refs
from memwal_core.jobs.gc.holds import KeepReason
from memwal_core.state import table
from memwal_core.state.store import NotFound, ObjectInfo, TableLocation

log = logging.getLogger("memwal.gc")

DATA_DIR, DELETIONS_DIR, TRANSACTIONS_DIR, INDICES_DIR, VERSIONS_DIR = (
    "data", "_deletions", "_transactions", "_indices", "_versions")
LEAK_DIRS = (DATA_DIR, DELETIONS_DIR, TRANSACTIONS_DIR, INDICES_DIR)
_U64_MAX = 2**64 - 1

# Field numbers of Lance's table.proto messages, and the ones known to hold no file reference
# elsewhere (anything else in a DataFile / DeletionFile stops the scan: it may be `base_id`).
_MANIFEST_FRAGMENTS, _MANIFEST_TRANSACTION_FILE = 2, 12
_FRAGMENT_ID, _FRAGMENT_FILES, _FRAGMENT_DELETION = 1, 2, 3
_DATAFILE_PATH, _DATAFILE_KNOWN = 1, {1, 2, 3, 4, 5, 6}
_DELETION_TYPE, _DELETION_READ_VERSION, _DELETION_ID, _DELETION_KNOWN = 1, 2, 3, {1, 2, 3, 4}
_DELETION_SUFFIX = {0: "arrow", 1: "bin"}


class LeakScanError(MemwalError):
    """The references of the retained versions cannot be established: collect nothing."""


@dataclass(frozen=True)
class References:
    """What one table version references under the leak directories."""

    files: frozenset[str]  # keys relative to the table root
    index_uuids: frozenset[str]


@dataclass
class Leak:
    key: str  # a file, or an index directory (`_indices/{uuid}`)
    keys: tuple[str, ...]
    bytes: int
    age: float
    what: str  # data file, deletion file, transaction file, index directory


@dataclass
class LeakScan:
    leaks: list[Leak] = field(default_factory=list)
    kept: collections.Counter[KeepReason] = field(default_factory=collections.Counter)
    versions: int = 0
    files_listed: int = 0
    list_seconds: float = 0.0  # the four directory listings
    refs_seconds: float = 0.0  # reading the retained manifests (cached ones are free)
    error: str | None = None
    manifests_read: int = 0  # manifests not known from the summary or this process
    refs: leak_refs.RefsSummary | None = None  # what the next scan may take as known (changed this scan)


def _fields(b: bytes):
    """(field number, wire type, value) of one protobuf message, in order."""
    i = 0
    while i < len(b):
        key, i = table.varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = table.varint(b, i)
        elif wt == 1:
            v, i = b[i:i + 8], i + 8
        elif wt == 5:
            v, i = b[i:i + 4], i + 4
        elif wt == 2:
            n, i = table.varint(b, i)
            v, i = b[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wt}")
        yield num, wt, v


def references_of(raw: bytes, where: str) -> References:
    """The files one Lance manifest file references (see the module docstring)."""
    try:
        if len(raw) < 16 or raw[-4:] != b"LANC":
            raise ValueError("no LANC footer")
        (offset,) = struct.unpack_from("<Q", raw, len(raw) - 16)
        (length,) = struct.unpack_from("<I", raw, offset)
        manifest = raw[offset + 4: offset + 4 + length]
        files: set[str] = set()
        for num, wt, v in _fields(manifest):
            if num == _MANIFEST_TRANSACTION_FILE and wt == 2 and v:
                files.add(f"{TRANSACTIONS_DIR}/{v.decode()}")
            elif num == _MANIFEST_FRAGMENTS and wt == 2:
                frag_id, deletion = 0, None
                for fnum, fwt, fv in _fields(v):
                    if fnum == _FRAGMENT_ID and fwt == 0:
                        frag_id = fv
                    elif fnum == _FRAGMENT_FILES and fwt == 2:
                        parts = {n: x for n, _, x in _fields(fv)}
                        if set(parts) - _DATAFILE_KNOWN:
                            raise ValueError(f"a data file with fields {sorted(set(parts) - _DATAFILE_KNOWN)} "
                                             "memwal does not know (a file in another base?)")
                        files.add(f"{DATA_DIR}/{parts[_DATAFILE_PATH].decode()}")
                    elif fnum == _FRAGMENT_DELETION and fwt == 2:
                        deletion = {n: x for n, _, x in _fields(fv)}
                if deletion is not None:
                    if set(deletion) - _DELETION_KNOWN:
                        raise ValueError(f"a deletion file with fields {sorted(set(deletion) - _DELETION_KNOWN)} "
                                         "memwal does not know")
                    suffix = _DELETION_SUFFIX[deletion.get(_DELETION_TYPE, 0)]
                    files.add(f"{DELETIONS_DIR}/{frag_id}-{deletion.get(_DELETION_READ_VERSION, 0)}-"
                              f"{deletion.get(_DELETION_ID, 0)}.{suffix}")
        _version, indices = table.parse_index_section(raw, where)
        uuids = frozenset(str(uuid.UUID(bytes=i.uuid.uuid)) for i in indices)
        return References(frozenset(files), uuids)
    except table.TableError:
        raise
    except (struct.error, ValueError, KeyError, UnicodeDecodeError) as e:
        raise LeakScanError(f"{where}: cannot read its file references: {e}") from None


# (lance uri, manifest key, size, mtime) -> references; manifests are immutable once written,
# but a table dropped and created again at the same URI writes the same keys, often at the same
# size: the modification time tells the two apart.
_REFS: dict[tuple[str, str, int, float], References] = {}
_REFS_LOCK = threading.Lock()
_REFS_MAX = 100_000


def _manifests(loc: TableLocation, listing: list[ObjectInfo] | None = None) -> dict[str, ObjectInfo]:
    out = {}
    for o in loc.store.list(VERSIONS_DIR) if listing is None else listing:
        name = o.key[len(VERSIONS_DIR) + 1:]
        if not name.endswith(".manifest"):
            continue  # latest_version_hint.json and the like
        stem = name[: -len(".manifest")]
        if stem.startswith("d"):  # a detached version (`d{n}.manifest`): its files are referenced too
            stem = stem[1:]
        if "/" in name or not stem.isdigit():
            raise LeakScanError(f"{o.key}: a manifest memwal cannot place (unknown naming)")
        out[o.key] = o
    return out


def _refs_of(loc: TableLocation, key: str, info: ObjectInfo, scan: LeakScan | None) -> References | None:
    """One manifest's references (None: removed by Lance's cleanup since the listing)."""
    ck = (loc.lance_uri, key, info.size, info.mtime)
    with _REFS_LOCK:
        refs = _REFS.get(ck)
    if refs is None:
        try:
            raw = loc.store.get(key)
        except NotFound:
            return None
        if scan is not None:
            scan.manifests_read += 1
        refs = references_of(raw, f"table {loc.lance_uri} manifest {key}")
        with _REFS_LOCK:
            if len(_REFS) >= _REFS_MAX:
                _REFS.clear()
            _REFS[ck] = refs
    return refs


def _references(loc: TableLocation, manifests: dict[str, ObjectInfo],
                scan: LeakScan | None = None) -> tuple[set[str], set[str]]:
    files: set[str] = set()
    uuids: set[str] = set()
    for key, info in manifests.items():
        refs = _refs_of(loc, key, info, scan)
        if refs is not None:
            files |= refs.files
            uuids |= refs.index_uuids
    return files, uuids


def _retained_references(loc: TableLocation, manifests: dict[str, ObjectInfo], scan: LeakScan,
                         use_summary: bool) -> tuple[set[str], set[str]]:
    """What the listed manifests reference: the versions' from the summary (`leak_refs.py`) and
    the manifests it does not know, read; detached versions are read (or taken from this process)."""
    attached: dict[int, tuple[str, ObjectInfo]] = {}
    other: dict[str, ObjectInfo] = {}
    for key, info in manifests.items():
        v = history.version_of(key)
        if v is not None and v in attached:  # both namings: Lance's V2 one is recorded, the other read
            if key == table.manifest_keys(v)[0]:
                other[attached[v][0]] = attached[v][1]
                attached[v] = (key, info)
            else:
                other[key] = info
        elif v is not None:
            attached[v] = (key, info)
        else:
            other[key] = info
    summary = leak_refs.load(loc) if use_summary else None
    changed = not leak_refs.usable(summary, {v: i for v, (_, i) in attached.items()})
    if changed:
        summary = leak_refs.RefsSummary()
    for v in sorted(attached):
        if v not in summary.versions:
            key, info = attached[v]
            refs = _refs_of(loc, key, info, scan)
            if refs is not None:
                summary.add(v, info, refs.files, refs.index_uuids)
                changed = True
    retained = sorted(v for v in attached if v in summary.versions)
    files, uuids = summary.referenced(retained)
    more_files, more_uuids = _references(loc, other, scan)
    if summary.prune(retained) or changed:
        scan.refs = summary
    return files | more_files, uuids | more_uuids


def plan_leaks(loc: TableLocation, now: float, grace_seconds: float, *, use_summary: bool = True,
               versions_listing: list[ObjectInfo] | None = None) -> LeakScan:
    """Leaked files older than `grace_seconds` (see the module docstring); reads only.
    `use_summary=False`: read every manifest this process has not read (ignore `leak_refs.py`).
    `versions_listing`: step 1's listing of `_versions/`, taken earlier by the caller (a version
    committed since is found by step 3 like one committed during the scan)."""
    scan = LeakScan()
    try:
        t0 = time.monotonic()
        manifests = _manifests(loc, versions_listing)
        if not manifests:
            raise LeakScanError("no manifest under _versions/")
        files, uuids = _retained_references(loc, manifests, scan, use_summary)
        scan.versions = len(manifests)
        scan.refs_seconds = time.monotonic() - t0
        t0 = time.monotonic()
        listed = {d: list(loc.store.list(d)) for d in LEAK_DIRS}
        scan.list_seconds = time.monotonic() - t0
        # A version committed while the directories were listed: its references count too.
        later = {k: o for k, o in _manifests(loc).items() if k not in manifests}
        if later:
            more_files, more_uuids = _references(loc, later, scan)
            files |= more_files
            uuids |= more_uuids
            scan.versions += len(later)
    except (LeakScanError, table.TableError) as e:
        scan.error = f"leaked files not collected: {e}"
        return scan
    except Exception as e:  # noqa: BLE001 - listing failed: collect nothing this time
        scan.error = f"leaked files not collected: {type(e).__name__}: {e}"
        return scan
    index_dirs: dict[str, list[ObjectInfo]] = collections.defaultdict(list)
    for d, objs in listed.items():
        scan.files_listed += len(objs)
        for o in objs:
            rel = o.key[len(d) + 1:]
            if d == INDICES_DIR:
                uid = rel.split("/", 1)[0]
                if uid in uuids:
                    scan.kept[KeepReason.LEAKED_INDEX_REFERENCED] += 1
                else:
                    index_dirs[uid].append(o)
                continue
            if o.key in files:
                continue
            if "/" in rel or rel.startswith(".") or rel == "":
                scan.kept[KeepReason.LEAKED_UNKNOWN_NAME] += 1  # nothing Lance writes there: not ours to judge
                continue
            age = now - o.mtime
            if age < grace_seconds:
                scan.kept[KeepReason.LEAKED_YOUNG] += 1
                continue
            what = {DATA_DIR: "data file", DELETIONS_DIR: "deletion file", TRANSACTIONS_DIR: "transaction file"}[d]
            scan.leaks.append(Leak(o.key, (o.key,), o.size, age, what))
    for uid, objs in sorted(index_dirs.items()):
        if "/" not in objs[0].key[len(INDICES_DIR) + 1:]:
            scan.kept[KeepReason.LEAKED_UNKNOWN_NAME] += len(objs)  # a file directly in _indices/
            continue
        age = now - max(o.mtime for o in objs)
        if age < grace_seconds:
            scan.kept[KeepReason.LEAKED_YOUNG] += len(objs)
            continue
        scan.leaks.append(Leak(f"{INDICES_DIR}/{uid}", tuple(sorted(o.key for o in objs)),
                               sum(o.size for o in objs), age, "index directory"))
    return scan


def is_leak_key(key: str) -> bool:
    """Only keys inside the four leak directories, without any `.`/`..` part, may be deleted."""
    parts = key.split("/")
    return len(parts) >= 2 and parts[0] in LEAK_DIRS and all(p not in ("", ".", "..") for p in parts)
