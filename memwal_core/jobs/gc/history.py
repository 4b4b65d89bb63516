"""The retained base-table versions and what GC needs of each, each manifest read once.

Of every retained version GC needs its merge progress (a reader time-travelling to it reads the
generations above it) and its commit time (when the base-version cleanup removes it). A table
version is immutable, so a GC pass lists `_versions/` once (the retained versions, with each
manifest's size and modification time) and reads only the manifests it does not know yet. What
it knows is kept beside the table in `_memwal/gc_versions.json` (written by `run_gc` after a
pass that learned something), because every GC run is a new process (CLI, Dagster run).

The summary is a pure cache:
- an entry is used only for a version the listing shows now, with the same manifest size and
  modification time as when it was read; any other listed version is read from its manifest.
  Versions removed since (memwal's or anyone's `cleanup_old_versions`) are simply not listed,
  so they hold nothing; a table re-created at the same URI writes new manifests, usually with
  new times, but a store whose times have whole seconds (S3) can show the same key, size and
  time: so each pass also reads the newest manifest the summary vouches for and compares its
  commit time (to the microsecond) with the recorded one; a difference drops the summary
  (`recreated`), and the leak scan's and the regions' caches with it;
- a summary that is missing, garbled, of another format or whose checksum does not match is
  ignored (every manifest is read, and the summary written again); writing it may fail;
- it is written by GC alone, with what GC read from the manifests it lists, so whatever it
  holds was true of a manifest with that exact size and time: it can never make GC keep less
  than reading every manifest again would (the property tests compare the two).
A process that reads it without writing (`plan_gc` from `memwal status`, a dry run) only saves
the reads it can.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from memwal_core.errors import one_line
from memwal_core.jobs.gc import sealed
from memwal_core.jobs.gc.items import GcError
from memwal_core.state import layout, table
from memwal_core.state.store import NotFound, ObjectInfo, TableLocation

log = logging.getLogger("memwal.gc")

VERSIONS_DIR = "_versions"
FORMAT = 1
_U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class VersionFacts:
    """What GC needs of one table version, and the manifest (size, modification time) it was
    read from. `merged` None: the version has no MemWAL index (its readers read no generation)."""

    version: int
    size: int
    mtime: float
    stamp: float | None  # commit time, epoch seconds (Lance's manifest timestamp)
    merged: dict[str, int] | None


@dataclass
class VersionHistory:
    """The listed versions' facts, and how they were learned this pass."""

    facts: dict[int, VersionFacts] = field(default_factory=dict)
    read: int = 0  # manifests read this pass
    known: int = 0  # facts taken from the summary
    summary: str = "missing"  # used, missing, or why it was ignored
    listing: list[ObjectInfo] = field(default_factory=list)  # `_versions/` as listed (the leak scan's too)
    changed: bool = True  # the summary to write differs from the one found
    recreated: bool = False  # the summary described another table at this URI: every cache is dropped

    def to_dict(self) -> dict[str, Any]:
        return {"versions": len(self.facts), "manifests_read": self.read, "from_summary": self.known,
                "summary": self.summary}


def version_of(key: str) -> int | None:
    """The table version of a `_versions/` manifest key (Lance's V2 naming: `u64::MAX - version`
    in 20 digits; V1: the version); None for anything else (detached versions, the hint, temporary
    files)."""
    name = key[len(VERSIONS_DIR) + 1:] if key.startswith(VERSIONS_DIR + "/") else ""
    stem = name[: -len(".manifest")] if name.endswith(".manifest") else ""
    if not stem.isdigit() or "/" in name:
        return None
    return _U64_MAX - int(stem) if len(stem) == 20 else int(stem)


def list_versions(loc: TableLocation, listing: list[ObjectInfo] | None = None) -> dict[int, ObjectInfo]:
    """The retained versions' manifests (from one listing of `_versions/`, or `listing`); V2
    naming first when both exist."""
    out: dict[int, ObjectInfo] = {}
    for o in loc.store.list(VERSIONS_DIR) if listing is None else listing:
        v = version_of(o.key)
        if v is not None and (v not in out or o.key == table.manifest_keys(v)[0]):
            out[v] = o
    return out


def encode(facts: dict[int, VersionFacts]) -> bytes:
    """The summary's bytes: versions in order, equal merge states stored once."""
    states: list[dict[str, int] | None] = []
    index: dict[str, int] = {}
    rows = []
    for v in sorted(facts):
        f = facts[v]
        key = json.dumps(f.merged, sort_keys=True)
        if key not in index:
            index[key] = len(states)
            states.append(f.merged)
        rows.append([v, f.size, f.mtime, f.stamp, index[key]])
    return sealed.seal({"versions": rows, "states": states}, FORMAT)


def decode(raw: bytes) -> dict[int, VersionFacts]:
    """The summary's facts; ValueError (with why) for anything but a summary this code wrote."""
    d = sealed.unseal(raw, FORMAT)
    states = d["states"]
    if not isinstance(states, list):
        raise ValueError("states is not a list")
    checked: list[dict[str, int] | None] = []
    for s in states:
        if s is not None and not (isinstance(s, dict) and all(
                isinstance(k, str) and type(g) is int and g >= 0 for k, g in s.items())):
            raise ValueError("a merge state is not a map of region to generation")
        checked.append(s)
    out: dict[int, VersionFacts] = {}
    for row in d["versions"]:
        v, size, mtime, stamp, state = row
        if not (type(v) is int and v >= 1 and type(size) is int and isinstance(mtime, (int, float))
                and (stamp is None or isinstance(stamp, (int, float))) and type(state) is int
                and 0 <= state < len(checked)) or v in out:
            raise ValueError(f"a bad version row {row!r}")
        out[v] = VersionFacts(v, size, float(mtime), None if stamp is None else float(stamp), checked[state])
    return out


def load_summary(loc: TableLocation) -> tuple[dict[int, VersionFacts], str]:
    """The summary's facts and "used"; or nothing, and why (a summary is never needed)."""
    try:
        raw = loc.store.get(layout.GC_VERSIONS_KEY)
    except NotFound:
        return {}, "missing"
    except Exception as e:  # noqa: BLE001 - a cache: every manifest is read instead
        log.warning("%s could not be read (%s); reading every retained manifest", layout.GC_VERSIONS_KEY, one_line(e))
        return {}, f"unreadable: {one_line(e)}"
    try:
        return decode(raw), "used"
    except (ValueError, KeyError, TypeError) as e:
        log.warning("%s ignored (%s); reading every retained manifest and writing it again",
                    layout.GC_VERSIONS_KEY, e)
        return {}, f"ignored: {e}"


def save_summary(loc: TableLocation, history: VersionHistory) -> None:
    """Write what `history` knows (when it learned something); failing only costs reads later."""
    if not history.changed:
        return
    try:
        loc.store.put(layout.GC_VERSIONS_KEY, encode(history.facts))
        history.changed = False
    except Exception as e:  # noqa: BLE001 - a cache
        log.warning("could not write %s: %s", layout.GC_VERSIONS_KEY, one_line(e))


def _read(loc: TableLocation, v: int, info: ObjectInfo) -> VersionFacts | None:
    """One version's facts from its manifest; None when it vanished since the listing (cleaned up)."""
    try:
        raw = loc.store.get(info.key)
    except NotFound:
        log.info("table version %d vanished while planning GC (cleaned up)", v)
        return None
    where = f"table {loc.lance_uri} version {v}"
    try:
        state = table.memwal_state_of(raw, where)
        merged: dict[str, int] | None = state.merged
        got = state.table_version
    except table.MemWalNotInitialized:
        merged, got = None, table.parse_index_section(raw, where)[0]
    except table.TableError as e:
        raise GcError(f"cannot read the MemWAL state of retained table version {v}: {e}") from None
    if got != v:
        raise GcError(f"{where}: its manifest {info.key} says version {got}")
    return VersionFacts(v, info.size, info.mtime, table.commit_timestamp(raw), merged)


def _another_table(loc: TableLocation, known: dict[int, VersionFacts], listed: dict[int, ObjectInfo]) -> bool:
    """Whether the newest listed version the summary vouches for (same size and time) has another
    commit time than recorded: the table was re-created at this URI within the store's time
    resolution. One manifest read per pass; a manifest gone meanwhile proves nothing."""
    vouched = [v for v, info in listed.items()
               if (k := known.get(v)) is not None and k.size == info.size and k.mtime == info.mtime
               and k.stamp is not None]
    if not vouched:
        return False
    v = max(vouched)
    try:
        raw = loc.store.get(listed[v].key)
    except NotFound:
        return False
    return table.commit_timestamp(raw) != known[v].stamp


def read_history(loc: TableLocation, *, use_summary: bool = True, earlier: VersionHistory | None = None,
                 max_workers: int = 16) -> VersionHistory:
    """Every listed version's facts: from the summary when it knows that very manifest, else read.
    `use_summary=False`: read every manifest (what the summary must always agree with).
    `earlier`: a history read earlier in this pass, taken as the summary (checked against this
    listing the same way; its reads count in this one)."""
    listing = list(loc.store.list(VERSIONS_DIR))
    listed = list_versions(loc, listing)
    if earlier is not None:
        known, why = earlier.facts, earlier.summary
    else:
        known, why = load_summary(loc) if use_summary else ({}, "not used")
    recreated = False
    if earlier is None and known:
        recreated = _another_table(loc, known, listed)
        if recreated:
            known, why = {}, "ignored: it describes another table at this URI (re-created)"
            log.warning("%s %s; reading every retained manifest", layout.GC_VERSIONS_KEY, why[len("ignored: "):])
    elif earlier is not None:
        recreated = earlier.recreated
    out = VersionHistory(summary=why, listing=listing, recreated=recreated)
    todo = []
    for v, info in sorted(listed.items()):
        k = known.get(v)
        if k is not None and k.size == info.size and k.mtime == info.mtime:
            out.facts[v] = k
        else:
            todo.append((v, info))
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(todo)))) as pool:
            for got in pool.map(lambda vi: _read(loc, *vi), todo):
                if got is not None:
                    out.facts[got.version] = got
                    out.read += 1
    out.facts = dict(sorted(out.facts.items()))
    # Whether the summary on the store differs from what is known now.
    out.changed = (earlier.changed if earlier is not None else why != "used") or bool(todo) \
        or out.facts.keys() != known.keys()
    out.read += earlier.read if earlier is not None else 0
    out.known = max(0, len(out.facts) - out.read)
    return out
