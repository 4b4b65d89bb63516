"""The retained base-table versions and what GC needs of each, each manifest read once.

Of every retained version GC needs its merge progress (a reader time-travelling to it reads the
generations above it) and its commit time (when the base-version cleanup removes it). A table
version is immutable, so GC reads only the manifests it does not know yet. What it knows is kept
beside the table in `_memwal/gc_versions.json` (written by `run_gc` after a pass that learned
something), because every GC run is a new process (CLI, Dagster run).

Finding the versions without listing `_versions/` (its listing grows with the history). Lance
only ever adds a version above the newest (a commit makes latest + 1, and the manifest key of a
version is computable), so a pass:
1. reads the newest version the summary knows again (HEAD and GET) and compares it with the
   summary's row (size, commit time to the microsecond, merge progress): a table removed and
   created again at this URI has another manifest there, or none (when it is shorter);
2. HEADs the oldest version the summary knows (there, with its size): anyone's
   `cleanup_old_versions` removes the oldest versions first (by age, and by count among those
   old enough);
3. probes upward from the newest known version (HEAD of the next key until there is none; the
   plan checks that it reached the latest version Lance opened, else a gap: list).
Any surprise in 1-3 (a manifest missing or different), a summary that is missing or not usable,
a base-version cleanup run by this pass, and a listing older than `full_scan_interval_seconds`
(`GcOptions`; its time is in the summary) make the pass list `_versions/` instead.

Why a summary that was not listed is safe: a version believed retained but removed since (a tagged
oldest version left while younger ones went, a cleanup between listings) only holds more: it
lowers the time-travel bound (merge progress is a minimum over the versions), its older commit
time can only make `run_gc` run Lance's cleanup (`run._nothing_old_enough`), which decides from
the manifests themselves, and the leak scan lists `_versions/` itself. The rows of the versions
below the newest are not checked against their manifests between listings: a version's manifest
never changes, and the one way to get other manifests at the same keys (the table created again)
changes or removes the newest one first, which step 1 sees. The summary is written by GC alone,
sealed with a checksum. A version *missing* from what a pass believes would let it collect what
that version reads; the probe cannot miss one above the newest known (it goes up to the latest),
and one below can only appear in a slot a cleanup freed (a commit that read a version older than
the retention floor, `GcOptions`, which rules that out); the next listing would see it.

When `_versions/` is listed (at least once per interval):
- an entry is used only for a version the listing shows now, with the same manifest size and
  modification time as when it was read; any other listed version is read from its manifest.
  Versions removed since are simply not listed, so they hold nothing; a table re-created at the
  same URI writes new manifests, usually with new times, but a store whose times have whole
  seconds (S3) can show the same key, size and time: so the newest manifest the summary vouches
  for is read and its commit time compared (to the microsecond) with the recorded one; a
  difference drops the summary (`recreated`), and the leak scan's and the regions' caches with it;
- a summary that is missing, garbled, of another format or whose checksum does not match is
  ignored (every manifest is read, and the summary written again); writing it may fail;
- whatever it holds was true of a manifest with that exact size and time: it can never make GC
  keep less than reading every manifest again would (the property tests compare the two).
The facts are kept as columns (`fact_table.py`): the summary is read and written as typed
arrays, a version's facts are built only when asked for, and the retention is computed over the
columns and the distinct merge states (`retention.py`). The summary holds the newest versions
(its tail); the older ones are sealed in an object of their own, described in the summary by
the aggregates a pass needs (`fact_segments.py`), so a pass reads and writes about as much
however long the retention, and reads the sealed facts only when asked what the aggregates do
not tell, or when it lists.
The summary also records when the leak scan last completed (`leaks.py`: it runs once per
interval). A process that reads it without writing (`plan_gc` from `memwal status`, a dry run)
only saves the reads it can.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from memwal_core.errors import MemwalError, one_line
from memwal_core.jobs.gc import fact_segments
from memwal_core.jobs.gc.fact_segments import SealedPart
from memwal_core.jobs.gc.fact_table import FactTable, VersionFacts
from memwal_core.jobs.gc.items import GcError
from memwal_core.state import layout, sealed, table
from memwal_core.state.store import NotFound, ObjectInfo, TableLocation

log = logging.getLogger("memwal.gc")

VERSIONS_DIR = "_versions"
FORMAT = 3  # 1: rows of JSON numbers; 2: columns in base64 (each read as no summary: every manifest is read once, and it is written again)
_U64_MAX = 2**64 - 1


@dataclass
class VersionHistory:
    """The listed versions' facts, and how they were learned this pass: the newest as columns
    (`tail`), the older ones sealed (`sealed`: described by aggregates, their facts read only
    when asked for, `full`)."""

    tail: FactTable = field(default_factory=FactTable.empty)
    sealed: SealedPart | None = None
    loc: TableLocation | None = field(default=None, repr=False)  # where the sealed facts are read from
    read: int = 0  # manifests read this pass
    known: int = 0  # facts taken from the summary
    summary: str = "missing"  # used, missing, or why it was ignored
    listing: list[ObjectInfo] | None = None  # `_versions/` as listed (the leak scan's too); None: probed
    changed: bool = True  # the summary to write differs from the one found
    recreated: bool = False  # the summary described another table at this URI: every cache is dropped
    listed_at: float | None = None  # when `_versions/` was last listed (now, when this pass did)
    leaks_at: float | None = None  # when the leak scan last completed (`leaks.py`)
    must_list: bool = False  # a later read in this pass lists (a base-version cleanup ran in between)
    read_part: str | None = None  # the sealed object the summary named when read (`save_summary` removes others)
    _full: FactTable | None = field(default=None, repr=False, compare=False)
    _unreadable: bool = field(default=False, repr=False, compare=False)  # the sealed object was read around

    @property
    def listed(self) -> bool:
        return self.listing is not None

    @property
    def count(self) -> int:
        """How many versions (without reading the sealed ones)."""
        return len(self.tail) + (self.sealed.count if self.sealed is not None else 0)

    @property
    def facts(self) -> FactTable:
        """Every version's facts (the sealed ones read once, when first asked for)."""
        return self.full()

    def full(self) -> FactTable:
        if self.sealed is None:
            return self.tail
        if self._full is None:
            older, self._unreadable = _sealed_facts(self.loc, self.sealed)
            self._full = older.grown(self.tail.values())
            self.changed = self.changed or self._unreadable  # sealed again when saved
        return self._full

    def get(self, version: int) -> VersionFacts | None:
        """One version's facts (a sealed one's read with all of them)."""
        if self.sealed is None or version > self.sealed.last:
            return self.tail.get(version)
        return self.full().get(version)

    def indexed(self, version: int) -> bool | None:
        """Whether `version` carries the MemWAL index (None: not a version it holds). A sealed
        version is answered from the aggregates when they tell, else from its facts."""
        if self.sealed is not None and version <= self.sealed.last:
            if version < self.sealed.first:
                return None
            told = self.sealed.indexed(version)
            if told is not None:
                return told
        f = self.get(version)
        return None if f is None else f.merged is not None

    def newest(self) -> int | None:
        return self.tail.versions[-1] if len(self.tail) else None

    def oldest(self) -> tuple[int, int] | None:
        """(version, manifest size) of the oldest version."""
        if self.sealed is not None:
            return self.sealed.first, self.sealed.first_size
        return (self.tail.versions[0], self.tail.sizes[0]) if len(self.tail) else None

    def versions(self) -> fact_segments.VersionList:
        return fact_segments.VersionList(self.count, self.full)

    def to_dict(self) -> dict[str, Any]:
        return {"versions": self.count, "manifests_read": self.read, "from_summary": self.known,
                "summary": self.summary, "listed": self.listed}


@dataclass
class Summary:
    """What `_memwal/gc_versions.json` holds: the newest versions' facts, the older ones' sealed
    part, and when the table was last listed in full."""

    facts: FactTable = field(default_factory=FactTable.empty)  # the tail
    listed_at: float | None = None
    leaks_at: float | None = None
    sealed: SealedPart | None = None

    def history(self, loc: TableLocation) -> VersionHistory:
        """The versions as a history (the sealed ones read when asked for)."""
        return VersionHistory(tail=self.facts, sealed=self.sealed, loc=loc)


def due(at: float | None, now: float, interval: float) -> bool:
    """Whether what was done at `at` is due again (never done, an interval passed, a clock that
    went back)."""
    return at is None or not 0 <= now - at < interval


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


def encode(facts: Mapping[int, VersionFacts], listed_at: float | None = None, leaks_at: float | None = None,
           part: SealedPart | None = None) -> bytes:
    """The summary's bytes: the tail's facts as columns (`fact_table.py`) and the sealed part's
    description, sealed. ValueError for facts no summary can hold (numbers out of range: the
    summary is then not written)."""
    table = facts if isinstance(facts, FactTable) else FactTable.of(facts.values())
    meta, blob = table.to_parts()
    return sealed.seal_blob({"leaks_at": leaks_at, "listed_at": listed_at, "facts": meta,
                             "sealed": part.to_json() if part is not None else None}, blob, FORMAT)


def decode(raw: bytes) -> FactTable:
    """The summary's tail (every version when none is sealed); ValueError (with why) for
    anything but a summary this code wrote."""
    return decode_summary(raw).facts


def decode_summary(raw: bytes) -> Summary:
    """The summary; ValueError (with why) for anything but a summary this code wrote."""
    d, blob = sealed.unseal_blob(raw, FORMAT)
    if not isinstance(d, dict):
        raise ValueError("not a summary")
    times = [d.get("listed_at"), d.get("leaks_at")]
    if not all(t is None or (isinstance(t, (int, float)) and type(t) is not bool) for t in times):
        raise ValueError("a bad listing time")
    tail = FactTable.from_parts(d.get("facts"), blob)
    part = None if d.get("sealed") is None else SealedPart.from_json(d["sealed"])
    if part is not None and not (len(tail) and tail.versions[0] > part.last):
        raise ValueError("a tail that is not above its sealed part")
    return Summary(tail, *(None if t is None else float(t) for t in times), part)


def load_summary(loc: TableLocation) -> tuple[FactTable, str]:
    """Every version's facts the summary holds and "used"; or nothing, and why (a summary is
    never needed)."""
    summary, why = _load(loc)
    return summary.history(loc).full(), why


def _sealed_facts(loc: TableLocation | None, part: SealedPart) -> tuple[FactTable, bool]:
    """The sealed part's facts, and False; when its object cannot be read (gone, garbled), the
    versions it held that are still listed, read from their manifests, and True (the pass then
    seals them again)."""
    try:
        if loc is None:
            raise ValueError("no table to read it from")
        return fact_segments.unseal(part, loc.store.get(part.key)), False
    except Exception as e:  # noqa: BLE001 - a cache: the manifests say the same
        log.warning("%s could not be used (%s); reading the versions %d-%d from their manifests",
                    part.key, one_line(e), part.first, part.last)
    if loc is None:
        raise GcError(f"the sealed versions {part.first}-{part.last} cannot be read")
    todo = [(v, info) for v, info in sorted(list_versions(loc).items()) if part.first <= v <= part.last]
    return FactTable.of(_read_all(loc, todo)), True


def _load(loc: TableLocation) -> tuple[Summary, str]:
    try:
        raw = loc.store.get(layout.GC_VERSIONS_KEY)
    except NotFound:
        return Summary(), "missing"
    except Exception as e:  # noqa: BLE001 - a cache: every manifest is read instead
        log.warning("%s could not be read (%s); reading every retained manifest", layout.GC_VERSIONS_KEY, one_line(e))
        return Summary(), f"unreadable: {one_line(e)}"
    try:
        return decode_summary(raw), "used"
    except Exception as e:  # noqa: BLE001 - a cache: anything it cannot be decoded as means reading around it
        log.warning("%s ignored (%s); reading every retained manifest and writing it again",
                    layout.GC_VERSIONS_KEY, e)
        return Summary(), f"ignored: {e}"


def save_summary(loc: TableLocation, history: VersionHistory) -> None:
    """Write what `history` knows (when it learned something); failing only costs reads later.
    A tail longer than `fact_segments.TAIL_MAX` is sealed first (all but its newest
    `TAIL_KEEP`, with the versions sealed before): the new object is written before the summary
    that names it. The sealed objects the summary does not name are removed after it is written
    when it names another object than the one read, and on a pass that listed `_versions/` (what
    a crash between the two writes left)."""
    if not history.changed:
        return
    try:
        tail, part = history.tail, history.sealed
        if not isinstance(tail, FactTable):
            tail = FactTable.of(tail.values())
        if len(tail) > fact_segments.TAIL_MAX or history._unreadable:
            full = history.full()
            cut = len(full) - fact_segments.TAIL_KEEP
            part, tail = None, full
            if cut > 0:
                part, raw = fact_segments.seal(full.select(range(cut)))
                tail = full.select(range(cut, len(full)))
                loc.store.put(part.key, raw)
        loc.store.put(layout.GC_VERSIONS_KEY, encode(tail, history.listed_at, history.leaks_at, part))
        history.changed, history.tail, history.sealed, history._unreadable = False, tail, part, False
        if (part.key if part is not None else None) != history.read_part or history.listed:
            _drop_unnamed(loc, part)
            history.read_part = part.key if part is not None else None
    except Exception as e:  # noqa: BLE001 - a cache
        log.warning("could not write %s: %s", layout.GC_VERSIONS_KEY, one_line(e))


def _drop_unnamed(loc: TableLocation, part: SealedPart | None) -> None:
    """Remove the sealed objects other than `part`'s (those of earlier summaries)."""
    try:
        old = [o.key for o in loc.store.list(fact_segments.DIR) if part is None or o.key != part.key]
        if old:
            loc.store.delete_many(old)
    except Exception as e:  # noqa: BLE001 - left for the next pass that seals
        log.info("earlier sealed version facts not removed: %s", one_line(e))


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


def _read_all(loc: TableLocation, todo: list[tuple[int, ObjectInfo]], max_workers: int = 16) -> list[VersionFacts]:
    """`_read` of each version, in parallel; those that vanished meanwhile left out."""
    if not todo:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(todo)))) as pool:
        return [f for f in pool.map(lambda vi: _read(loc, *vi), todo) if f is not None]


def _another_table(loc: TableLocation, known: FactTable, listed: dict[int, ObjectInfo]) -> bool:
    """Whether the newest listed version the summary vouches for (same size and time) has another
    commit time than recorded: the table was re-created at this URI within the store's time
    resolution. One manifest read per pass; a manifest gone meanwhile proves nothing."""
    vouched = [v for v, info in listed.items()
               if (k := _vouched(known, v, info)) is not None and k.stamp is not None]
    if not vouched:
        return False
    v = max(vouched)
    try:
        raw = loc.store.get(listed[v].key)
    except NotFound:
        return False
    return table.commit_timestamp(raw) != known[v].stamp


def _vouched(known: FactTable, v: int, info: ObjectInfo) -> VersionFacts | None:
    """The summary's facts of version `v` when they were read from that very manifest (same size
    and modification time), else None."""
    i = known.position(v)
    if i is None or known.sizes[i] != info.size or known.mtimes[i] != info.mtime:
        return None
    return known.at(i)


class _Mismatch(MemwalError):
    """The newest known version's manifest is not the one the summary describes."""

    def __init__(self, another_table: bool):
        super().__init__()
        self.another_table = another_table


def _probe(loc: TableLocation, base: VersionHistory, checked: bool,
           latest: int | None) -> list[tuple[int, ObjectInfo]] | None:
    """The versions committed above the newest known one (steps 1-3 of the module docstring);
    None: versions may be missing, list `_versions/`; `_Mismatch`: the newest known manifest is
    another one (nothing of the summary is used). `checked`: steps 1-2 were done in this pass."""
    known = base.tail
    top = known.versions[-1]
    if not checked:
        info = table.head_manifest(loc, top)
        if info is None:
            return None
        got = _read(loc, top, info)
        if got is None:
            return None
        k = known[top]  # not the modification time: a HEAD may give it less precisely than a listing
        if (got.size, got.stamp, got.merged) != (k.size, k.stamp, k.merged):
            raise _Mismatch(got.stamp != k.stamp)
        low, size = base.oldest()
        info = table.head_manifest(loc, low)
        if info is None or info.size != size:
            return None
    new = []
    v = top + 1
    while (info := table.head_manifest(loc, v)) is not None:
        new.append((v, info))
        v += 1
    if latest is not None and v <= latest:  # a version below the latest is missing: list
        return None
    return new


def read_history(loc: TableLocation, *, use_summary: bool = True, earlier: VersionHistory | None = None,
                 max_workers: int = 16, interval: float = 0.0, now: float | None = None,
                 latest: int | None = None, for_leaks: bool = False) -> VersionHistory:
    """Every retained version's facts: from the summary when it knows that very manifest, else read.
    `use_summary=False`: list and read every manifest (what the summary must always agree with).
    `earlier`: a history read earlier in this pass, taken as the summary (its reads count in
    this one). `interval`: list `_versions/` when the last listing is older (0: every pass), or
    when the leak scan is due (`for_leaks`, so that it takes this listing); else probe for new
    versions (module docstring). `latest`: a version known to exist (the one the plan opened)."""
    now = time.time() if now is None else now
    if earlier is not None:
        base, why = Summary(earlier.tail, earlier.listed_at, earlier.leaks_at, earlier.sealed), earlier.summary
    else:
        base, why = _load(loc) if use_summary else (Summary(), "not used")
    # The sealed object the summary on the store names (removed once a summary names another).
    read_part = earlier.read_part if earlier is not None else base.sealed.key if base.sealed is not None else None
    known = base.history(loc)
    if earlier is not None:
        known._full, known._unreadable = earlier._full, earlier._unreadable
    listed_before = earlier is not None and earlier.listed  # earlier in this pass: the leak scan takes it
    must_list = (why != "used" or not len(base.facts) or (earlier is not None and earlier.must_list)
                 or due(base.listed_at, now, interval)
                 or (for_leaks and not listed_before and due(base.leaks_at, now, interval)))
    recreated = earlier.recreated if earlier is not None else False
    try:
        probed = None if must_list else _probe(loc, known, earlier is not None, latest)
    except _Mismatch as e:
        probed, base, recreated = None, Summary(), e.another_table
        known = base.history(loc)
        why = ("ignored: it describes another table at this URI (re-created)" if recreated
               else "ignored: its newest version is not that version's manifest")
        log.warning("%s %s; reading every retained manifest", layout.GC_VERSIONS_KEY, why[len("ignored: "):])
    out = VersionHistory(summary=why, recreated=recreated, listed_at=base.listed_at, leaks_at=base.leaks_at, loc=loc,
                         read_part=read_part)
    if probed is not None:
        kept, todo = known.tail, probed
        out.sealed, out._full, out._unreadable = known.sealed, known._full, known._unreadable
        if listed_before:  # a version committed since is the leak scan's step 3
            out.listing = earlier.listing
    else:
        _, kept, todo = _listed(loc, known.full() if len(base.facts) else FactTable.empty(), out, earlier is None)
        out.listed_at = now
    got = _read_all(loc, todo, max_workers)
    try:
        out.tail = kept.grown(got)
        if out._full is not None:
            out._full = out._full.grown(got)
    except ValueError as e:  # a manifest with numbers out of any range (Lance writes none)
        raise GcError(f"table {loc.lance_uri}: a retained version's manifest cannot be summarized: {e}") from None
    out.read = len(got)
    # Whether the summary on the store differs from what is known now (a listing pass writes its time).
    out.changed = (earlier.changed if earlier is not None else why != "used") or bool(todo) or out.listed \
        or out._unreadable
    out.read += earlier.read if earlier is not None else 0
    out.known = max(0, out.count - out.read)
    return out


def _listed(loc: TableLocation, known: FactTable, out: VersionHistory,
            check_table: bool) -> tuple[FactTable, FactTable, list[tuple[int, ObjectInfo]]]:
    """One listing of `_versions/`, into `out`: the summary's facts (all of them dropped when it
    describes another table: `check_table`), those of them for the listed manifests it knows
    (same size and time), and the versions to read."""
    out.listing = list(loc.store.list(VERSIONS_DIR))
    listed = list_versions(loc, out.listing)
    if check_table and known and _another_table(loc, known, listed):
        known, out.recreated = FactTable.empty(), True
        out.summary = "ignored: it describes another table at this URI (re-created)"
        out.leaks_at = None
        log.warning("%s %s; reading every retained manifest", layout.GC_VERSIONS_KEY,
                    out.summary[len("ignored: "):])
    kept, todo = [], []
    for v, info in sorted(listed.items()):
        i = known.position(v)
        if i is not None and known.sizes[i] == info.size and known.mtimes[i] == info.mtime:
            kept.append(i)
        else:
            todo.append((v, info))
    return known, known.select(kept), todo
