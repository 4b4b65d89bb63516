"""Table lifecycle: regions whose data predates the current MemWAL initialization (stale).

Overwriting a table (`write_dataset(mode="overwrite")`, LanceDB `add(mode="overwrite")`) drops
the `__lance_mem_wal` index but leaves `_mem_wal/` on disk; `initialize_mem_wal` afterwards
starts with no merge progress, so every old generation looks pending. Merging them would put
rows the overwrite replaced back into the new table. This module says which generations are
*stale*, and nothing else in memwal merges, publishes or collects them until an operator
discards them (or `GcOptions.discard_stale_after_seconds` passes).

**The initialization** is the first version of the newest unbroken run of table versions that
carry the MemWAL index: the version before it (an overwrite, a `drop_index`, the table's
creation) has none. Its time is the last-modified time of that version's manifest *on the
store*, so it is compared with region files on the same clock (no client clock skew).
Found by walking versions back from the latest once, then recorded in `_memwal/lifecycle.json`
with the version checked up to (by the merger after its commits, and by GC right before its
base-version cleanup removes the evidence); later calls read only the versions committed since.
A store that fails to give the record stops the caller (`LifecycleUnreadable`): derived again,
the lifetime could be unknown. When the walk reaches a version that is no longer retained, the
initialization is unknown: nothing is judged stale (a table initialized before its retained
history cannot be told apart from one never overwritten, and the latter must keep working
exactly as before).

**A region is pre-initialization** when it has a manifest version written strictly before the
initialization (writers can only open a region once the index exists, so a region created in
this lifetime has none; the old lifetime's GC always kept a region's latest version, and GC
collects nothing in a region that is stale here, so the evidence stays until a verdict is
recorded). Its stale generations are those through `stale_through`:

- `M0` = its latest manifest version written before the initialization: every generation
  below `M0.current_generation` was flushed before it;
- WAL entries written before the initialization above `M0.replay_after_wal_entry_position`
  hold rows no generation had taken: a writer that claims the region later replays them into
  its next flushes (pylance 14 does, in the same MemTable as new rows). `stale_through` is then
  the generation of the first later manifest version whose replay position covers the last
  such entry; until a writer has flushed it the boundary is *open* (every generation is
  stale, and GC keeps the whole region).

Generations above `stale_through` (a writer re-opened the region after the initialization and
flushed rows it received afterwards) are current; they wait behind the stale ones, because
merge progress is one number per region. `discard` records progress at `stale_through` with
an empty merge commit (the rows are never merged); then they merge normally and GC collects
the stale ones without the time-travel hold of this lifetime's versions (which should never
have read them), keeping the hold of versions from before the initialization.

Limits (docs/reliability.md "Table lifecycle"): store times have a resolution (S3: one
second), so a region first written in the same second as the initialization counts as
current; a `restore` to a version of an earlier lifetime is not recognised.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import pyarrow as pa

from memwal_core.errors import MemwalError
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, lease, region, table, wal
from memwal_core.state.lance_mem_wal import is_commit_conflict, merged_markers
from memwal_core.state.store import NotFound, StoreError, TableLocation

log = logging.getLogger("memwal.lifecycle")

OPEN = None  # `stale_through` of a region whose boundary no flush has fixed yet
_WALK_CHUNK = 16
# Lance URI -> the initialization this process last verified: a process that assesses often
# without recording (the index builder, status, readers) reads only versions committed since.
_SEEN: dict[str, "Initialization"] = {}
# Whether a table version carries the MemWAL index, as a caller already read it (None: not
# known to it, the manifest is read); see `find_initialization`.
Indexed = Callable[[int], "bool | None"]


class LifecycleError(MemwalError):
    """A stale verdict cannot be carried out (e.g. discarding a region that is not stale)."""


class LifecycleUnreadable(StoreError):
    """The store failed to give `_memwal/lifecycle.json` (not "no record": a request that
    failed). Transient: the job stops rather than derive the lifetime again, which after GC
    cleaned up the versions around the initialization gives an unknown one (no stale verdicts,
    no region value records), a weaker answer than the record's."""


@dataclass(frozen=True)
class Initialization:
    """The current MemWAL initialization: the first table version of the lifetime."""

    table_version: int
    initialized_at: float | None      # store time of that version's manifest; None: unknown
    previous_version: int | None      # the version before it, without the index (None: not retained)
    checked_version: int              # the lifetime is verified unbroken up to here

    @property
    def known(self) -> bool:
        return self.initialized_at is not None

    def describe(self) -> str:
        where = f"the MemWAL initialization at table version {self.table_version}"
        if self.previous_version is not None:
            where += f" (table version {self.previous_version} has no MemWAL index: overwritten or re-created)"
        return where


@dataclass(frozen=True)
class RegionVerdict:
    """A pre-initialization region: generations through `stale_through` are stale."""

    region_id: str
    stale_through: int | None        # OPEN (None): unflushed pre-initialization WAL rows
    detected_at: float
    pre_version: int = 0             # M0: its latest manifest version before the initialization
    wal_position: int = 0            # the last WAL entry with rows written before it (0: none unflushed)

    @property
    def open(self) -> bool:
        return self.stale_through is OPEN

    def is_stale(self, generation: int) -> bool:
        return self.open or generation <= self.stale_through


@dataclass
class Lifecycle:
    """Verdicts for one table: the initialization and the pre-initialization regions."""

    init: Initialization | None
    stale: dict[str, RegionVerdict] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)
    discarded: dict[str, dict[str, Any]] = field(default_factory=dict)  # region -> {through, at, by}
    errors: dict[str, str] = field(default_factory=dict)               # regions not classified (transient)
    unrecorded: bool = False  # verdicts or the checked version differ from `_memwal/lifecycle.json`
    new_verdicts: bool = False  # regions classified that the record does not have
    recorded_checked: int = 0  # the version the record was checked up to (0: no record)

    def verdict(self, region_id: str) -> RegionVerdict | None:
        return self.stale.get(region_id)

    def stale_pending(self, region_id: str, merged: int, listed: Iterable[int]) -> list[int]:
        """The stale generations above `merged` that are still listed."""
        v = self.stale.get(region_id)
        return [] if v is None else [g for g in sorted(listed) if g > merged and v.is_stale(g)]

    def discarded_only(self, region_id: str, merged: int) -> bool:
        """Whether all of a region's merge progress is a discard (it merged nothing itself)."""
        v = self.stale.get(region_id)
        return v is not None and not v.open and merged <= v.stale_through

    def blocks(self, region_id: str, merged: int) -> bool:
        """Whether stale generations stand above merge progress (listed or not): the region
        cannot merge past them until they are discarded."""
        v = self.stale.get(region_id)
        if v is None:
            return False
        return v.open or v.stale_through > merged

    def message(self, region_id: str, merged: int, listed: list[int]) -> str:
        """The refusal, with the repair: what status, the checks and the merger say."""
        v = self.stale[region_id]
        stale = self.stale_pending(region_id, merged, listed)
        newer = [g for g in listed if g > merged and not v.is_stale(g)]
        init = self.init.describe() if self.init else "the MemWAL initialization"
        if v.open:
            what = (f"its {_span(stale)} and WAL rows up to entry {v.wal_position} that no generation "
                    "has taken yet predate " + init) if stale else \
                f"WAL rows up to entry {v.wal_position} that no generation has taken yet predate {init}"
        elif stale:
            what = f"its {_span(stale)} predate{'s' if len(stale) == 1 else ''} {init}"
        else:
            what = (f"its generations through {v.stale_through} predate {init} (none listed any more: "
                    "nothing would be lost by discarding them)")
        later = f"; {_span(newer)}, written after it, wait{'s' if len(newer) == 1 else ''} behind them" if newer else ""
        if v.open:
            return (f"region {region_id}: {what}; not merged{later}. Repair: a writer re-opening the region replays "
                    "those WAL rows into its next generation, which is stale too; discard the region after that "
                    f"flush (memwal regions discard URI {region_id}). If no writer will open it again, nothing "
                    f"in it belongs to this table any more: delete {layout.region_dir(region_id)}/ by hand")
        return (f"region {region_id}: {what}; not merged{later}. Repair: if the overwrite was meant to replace "
                f"these rows, run memwal regions discard URI {region_id} (then GC collects them); to keep them, "
                "write them into the table again")


def _span(gens: list[int]) -> str:
    """'generation 3' or 'generations 1..5' (the list is ascending)."""
    if len(gens) == 1:
        return f"generation {gens[0]}"
    return f"generations {gens[0]}..{gens[-1]}" if gens else "no generation"


# ---------------------------------------------------------------------------------------------
# The record (`_memwal/lifecycle.json`)


def read_record(loc: TableLocation, *, strict: bool = False) -> dict[str, Any] | None:
    """The record as written (None: none, or garbled: then it is derived again). `strict`: a
    store that cannot be read raises `LifecycleUnreadable` instead (a caller that must not go on
    without the record)."""
    try:
        d = json.loads(loc.store.get(layout.LIFECYCLE_KEY))
        if isinstance(d, dict) and isinstance(d.get("initialization"), dict):
            _init_from(d)  # the fields every reader needs
            return d
        return None
    except NotFound:
        return None
    except (ValueError, KeyError, TypeError) as e:  # garbled (JSON, fields): re-derived from the table
        log.warning("%s unreadable (%s: %s); deriving the lifecycle again", layout.LIFECYCLE_KEY,
                    type(e).__name__, e)
        return None
    except Exception as e:  # noqa: BLE001 - the store: derived again, unless the caller needs it
        if strict:
            raise LifecycleUnreadable(f"table {loc.lance_uri}: {layout.LIFECYCLE_KEY} cannot be read "
                                      f"({type(e).__name__}: {e}); it records the MemWAL lifetime and the stale "
                                      "verdicts, which are not worked out again without it (after old table "
                                      "versions were cleaned up that gives an unknown lifetime): try again") from e
        log.warning("%s unreadable (%s: %s); deriving the lifecycle again", layout.LIFECYCLE_KEY,
                    type(e).__name__, e)
        return None


def _write_record(loc: TableLocation, lc: Lifecycle, strict: bool = False) -> None:
    """Write `lc` as the record, unless the record already holds a later initialization: a
    process still in the table's earlier lifetime (its lease lost, or it read the table before
    the overwrite) must not put that lifetime back, or a later check would trust it across the
    versions GC has since cleaned up. A record that cannot be read is not written over."""
    if lc.init is None:
        return
    try:
        theirs = recorded_initialization(loc, strict=True)
        if theirs is not None and theirs.table_version > lc.init.table_version:
            log.warning("%s not replaced: it records %s, later than the initialization at table version %s "
                        "this process went from", layout.LIFECYCLE_KEY, theirs.describe(), lc.init.table_version)
            return
        d = {"initialization": asdict(lc.init),
             "stale": {rid: asdict(v) for rid, v in sorted(lc.stale.items())},
             "fresh": sorted(lc.fresh), "discarded": dict(sorted(lc.discarded.items()))}
        loc.store.put(layout.LIFECYCLE_KEY, json.dumps(d, sort_keys=True).encode())
    except Exception as e:  # noqa: BLE001 - the verdicts are derived again next time
        if strict:
            raise
        log.warning("could not record the table lifecycle: %s: %s", type(e).__name__, e)


def recorded_initialization(loc: TableLocation, *, strict: bool = False) -> Initialization | None:
    """The initialization in the table's record (None: no readable record). GC records it
    before its base-version cleanup removes the versions around it, so it covers a break in the
    history that the cleanup has since hidden from `find_initialization`."""
    rec = read_record(loc, strict=strict)
    return _init_from(rec) if rec else None


def _init_from(d: dict[str, Any]) -> Initialization:
    i = d["initialization"]
    return Initialization(int(i["table_version"]), i.get("initialized_at"), i.get("previous_version"),
                          int(i["checked_version"]))


# ---------------------------------------------------------------------------------------------
# The initialization


def _has_index(loc: TableLocation, version: int) -> bool | None:
    """Whether `version` carries the MemWAL index; None when it is not retained."""
    try:
        raw = table.read_manifest_bytes(loc, version)
    except table.TableError:
        return None
    _, indices = table.parse_index_section(raw, f"table {loc.lance_uri} version {version}")
    return any(i.name == table.MEMWAL_INDEX_NAME for i in indices)


CLOCK_TOLERANCE_S = 60.0  # store time vs the committer's own timestamp: more apart means rewritten


def _manifest_time(loc: TableLocation, version: int) -> float | None:
    """When `version` was committed, on the store's clock (its manifest's last-modified time).

    Cross-checked with the timestamp Lance writes into the manifest (the committer's clock): a
    manifest copied later (S3 has no rename: `migrate_manifest_paths_v2` copies) carries a new
    last-modified time, which would make every region of the lifetime look older than its
    initialization. When the two are further apart than `CLOCK_TOLERANCE_S`, the earlier is
    taken: fewer regions judged stale, never a region of this lifetime."""
    for key in table.manifest_keys(version):
        info = loc.store.head(key)
        if info is None:
            continue
        stamp = _commit_timestamp(loc, key)
        if stamp is not None and abs(info.mtime - stamp) > CLOCK_TOLERANCE_S:
            log.warning("table version %d: manifest last modified %.0f s away from its commit timestamp; "
                        "taking the earlier as the MemWAL initialization time", version, info.mtime - stamp)
            return min(info.mtime, stamp)
        return info.mtime
    return None


def _commit_timestamp(loc: TableLocation, key: str) -> float | None:
    """Lance's `Manifest.timestamp` (field 7, a protobuf Timestamp), or None."""
    import struct

    from google.protobuf.timestamp_pb2 import Timestamp
    from google.protobuf.unknown_fields import UnknownFieldSet

    try:
        raw = loc.store.get(key)
        (offset,) = struct.unpack_from("<Q", raw, len(raw) - 16)
        (length,) = struct.unpack_from("<I", raw, offset)
        head = pb.TableManifestHead.FromString(raw[offset + 4: offset + 4 + length])
        for f in UnknownFieldSet(head):
            if f.field_number == 7 and f.wire_type == 2:
                ts = Timestamp.FromString(f.data)
                return ts.seconds + ts.nanos / 1e9
    except Exception as e:  # noqa: BLE001 - the store time alone then
        log.info("no commit timestamp in %s: %s", key, e)
    return None


def find_initialization(loc: TableLocation, current: int, known: Initialization | None = None,
                        indexed: Indexed | None = None) -> Initialization:
    """The current lifetime's first version (see the module docstring). `known` (the record)
    is trusted when every version committed since it was checked still carries the index.

    `indexed`: whether a version carries the index, as the caller read it already (GC's pass
    reads every retained version's manifest, or its summary of them, anyway); a version it
    does not know is read here. Safe because a version's manifest never changes: an answer read
    earlier is the one reading it now gives, for the very manifests the caller vouches for
    (`jobs/gc/history.py` reads around a summary of another table at this URI). A version the
    caller read that was cleaned up since answers what it held where a read would say "not
    retained": the walk then finds the break a check just before the cleanup would have found
    (the record's purpose too), never one that did not happen. Versions committed after the
    caller read them are not known to it, so an overwrite landing meanwhile is read here. One
    that knows the version above `current` describes a longer table than the one opened: another
    table at this URI (versions only grow), so it is not used."""
    if indexed is not None and indexed(current + 1) is not None:
        log.warning("table %s: the versions read earlier in this pass go past version %d, the latest: "
                    "re-created meanwhile? reading the versions instead", loc.lance_uri, current)
        indexed = None
    if known is not None and known.table_version <= known.checked_version <= current:
        # A version cleaned up since (None) cannot show a break; one hidden entirely in such a gap
        # needs memwal not to have run for the whole retention period (docs: table lifecycle).
        versions = list(range(known.checked_version + 1, current + 1))
        if all(h is not False for h in _map(loc, versions, indexed)):
            return Initialization(known.table_version, known.initialized_at, known.previous_version, current)
    top = current
    while top >= 1:  # walk back in chunks, newest first, to the first version without the index
        chunk = list(range(top, max(0, top - _WALK_CHUNK), -1))
        for v, h in zip(chunk, _map(loc, chunk, indexed)):
            if h is None:  # the lifetime began before the retained history: unknown
                return Initialization(v + 1, None, None, current)
            if h is False:
                if v == current:
                    raise table.MemWalNotInitialized(
                        f"table {loc.lance_uri} version {current} has no MemWAL index ({table.MEMWAL_INDEX_NAME})")
                return Initialization(v + 1, _manifest_time(loc, v + 1), v, current)
        top = chunk[-1] - 1
    return Initialization(1, _manifest_time(loc, 1), None, current)


def outlived(loc: TableLocation, planned_version: int, known: Initialization | None,
             version: int) -> Initialization | None:
    """The initialization at table `version` when it is later than `planned_version` (what was
    read at `planned_version`, with `known` its initialization, belongs to an earlier lifetime
    of the table), else None. Raises when the initialization cannot be read.

    `known` is trusted across versions cleaned up since (they cannot show a break), so a
    cleanup that removed the versions without the index would hide the overwrite from it. GC
    records the new lifetime before such a cleanup: the table's record, when it was checked
    later than `known`, is walked from too, and the later initialization of the two is the answer.
    The record is read after the versions: a cleanup the walk could not see past was preceded
    by GC's record, which is then visible (a maintainer that lost the table lease to GC)."""
    now = find_initialization(loc, version, known)
    recorded = recorded_initialization(loc, strict=True)  # unread, the break may go unseen: raise
    if recorded is not None and recorded.checked_version <= version \
            and (known is None or recorded.checked_version > known.checked_version):
        by_record = find_initialization(loc, version, recorded)
        if by_record.table_version > now.table_version:
            now = by_record
    return now if now.table_version > planned_version else None


def _map(loc: TableLocation, versions: list[int], indexed: Indexed | None = None) -> list[bool | None]:
    """`_has_index` of each version; those `indexed` knows are answered from it, not read."""
    given = {v: h for v in versions if (h := indexed(v)) is not None} if indexed is not None else {}
    todo = [v for v in versions if v not in given]
    if len(todo) <= 1:
        read = {v: _has_index(loc, v) for v in todo}
    else:
        with ThreadPoolExecutor(max_workers=min(_WALK_CHUNK, len(todo))) as pool:
            read = dict(zip(todo, pool.map(lambda v: _has_index(loc, v), todo)))
    return [given[v] if v in given else read[v] for v in versions]


# ---------------------------------------------------------------------------------------------
# Regions


def classify_region(loc: TableLocation, rid: str, latest: region.RegionManifest, at: float,
                    now: float) -> RegionVerdict | None:
    """None for a region created after the initialization (time `at`), else its verdict."""
    store = loc.store
    versions: dict[int, float] = {}
    for o in store.list(layout.manifest_dir(rid)):
        name = o.key.rsplit("/", 1)[-1]
        if name.endswith(layout.MANIFEST_SUFFIX) and (n := layout.parse_bitrev(name[: -len(layout.MANIFEST_SUFFIX)])):
            versions[n] = o.mtime
    before = [v for v, t in versions.items() if t < at]
    if not before:
        return None
    m0 = latest if max(before) == latest.version else region.load_version(store, rid, max(before))
    replayed = m0.message.replay_after_wal_entry_position
    unflushed = 0  # the last WAL entry with rows, written before the initialization, past M0's replay position
    entries = sorted(((layout.parse_bitrev(o.key.rsplit("/", 1)[-1].removesuffix(layout.WAL_SUFFIX)), o.mtime)
                      for o in store.list(layout.wal_dir(rid)) if o.key.endswith(layout.WAL_SUFFIX)),
                     key=lambda e: -(e[0] or 0))
    for pos, t in entries:
        if not pos or pos <= replayed:
            break
        if t < at and not wal.read_entry_meta(store, rid, pos).fence_sentinel:
            unflushed = pos
            break
    through: int | None = m0.current_generation - 1
    if unflushed:
        through = OPEN
        for v in sorted(v for v in versions if v > m0.version):
            mv = latest if v == latest.version else region.load_version(store, rid, v)
            if mv.message.replay_after_wal_entry_position >= unflushed:
                through = mv.current_generation - 1
                break
    return RegionVerdict(rid, through, now, m0.version, unflushed)


def assess(loc: TableLocation, manifests: dict[str, region.RegionManifest], *, current_version: int | None = None,
           record: bool = True, now: float | None = None, indexed: Indexed | None = None) -> Lifecycle:
    """Verdicts for the regions of `manifests` (their latest manifests). `record=False` for
    readers (status, checks): they derive without writing. `indexed`: the versions the caller
    read already (`find_initialization`).

    Raises `LifecycleUnreadable` when the store fails to give the record (absent or garbled: it
    is derived again): every job stops then (the merger's and the index builder's plans, GC's
    pass, which so deletes nothing), as do the readers, rather than go on with a lifetime that
    the cleanup of old versions may have made unknown."""
    now = time.time() if now is None else now
    if current_version is None:
        current_version = table.open_dataset(loc).version
    rec = read_record(loc, strict=True)
    known = _init_from(rec) if rec else None
    seen = _SEEN.get(loc.lance_uri)
    start = seen if seen is not None and (known is None or seen.checked_version > known.checked_version) \
        and seen.checked_version <= current_version else known
    init = find_initialization(loc, current_version, start, indexed)
    _SEEN[loc.lance_uri] = init
    same = rec is not None and known is not None and known.table_version == init.table_version \
        and known.initialized_at == init.initialized_at
    lc = Lifecycle(init, recorded_checked=known.checked_version if known is not None else 0)
    if same:
        lc.fresh = set(rec.get("fresh", []))
        lc.discarded = dict(rec.get("discarded", {}))
        for rid, v in (rec.get("stale") or {}).items():
            lc.stale[rid] = RegionVerdict(rid, v.get("stale_through"), float(v.get("detected_at", now)),
                                          int(v.get("pre_version", 0)), int(v.get("wal_position", 0)))
    if not init.known:
        return lc
    todo = [rid for rid in manifests if rid not in lc.fresh and (rid not in lc.stale or lc.stale[rid].open)]

    def one(rid: str):
        try:
            return rid, classify_region(loc, rid, manifests[rid], init.initialized_at, now), None
        except Exception as e:  # noqa: BLE001 - this region only, and not judged either way
            return rid, None, region.as_region_error(rid, e)

    changed = False
    if todo:
        with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
            for rid, verdict, err in pool.map(one, todo):
                if err is not None:
                    lc.errors[rid] = f"{err}; its table lifecycle is unknown, not merged in this run"
                elif verdict is None:
                    if rid in lc.stale:  # an open verdict whose evidence went: keep it (never un-stale)
                        continue
                    lc.fresh.add(rid)
                    changed = True
                else:
                    old = lc.stale.get(rid)
                    if old is not None:
                        verdict = RegionVerdict(rid, verdict.stale_through, old.detected_at,
                                                verdict.pre_version, verdict.wal_position)
                    if old != verdict:
                        changed = True
                        if old is None and (verdict.open or verdict.stale_through > 0):
                            log.warning("region %s: data written before %s (stale through %s)", rid,
                                        init.describe(), "an open boundary" if verdict.open else verdict.stale_through)
                    lc.stale[rid] = verdict
    lc.new_verdicts = changed or not same
    lc.unrecorded = lc.new_verdicts or (known is not None and known.checked_version != init.checked_version)
    if record:
        save(loc, lc)
    return lc


def save(loc: TableLocation, lc: Lifecycle, *, strict: bool = False, verdicts_only: bool = False,
         refresh_after: int | None = None) -> None:
    """Record `lc` when it says more than the record (a planner assesses without writing; its
    executor saves what the plan found). `strict`: a failed write raises. `verdicts_only`: only
    when regions were classified (not for the checked version alone: GC, which writes no table
    version and so should not write a record on every pass), or, with `refresh_after`, when the
    record was checked that many versions ago (every new process reads the versions since)."""
    behind = lc.init is not None and refresh_after is not None and lc.unrecorded \
        and lc.init.checked_version - lc.recorded_checked >= refresh_after
    if (lc.new_verdicts or behind) if verdicts_only else lc.unrecorded:
        _write_record(loc, lc, strict)
        lc.unrecorded = lc.new_verdicts = False
        lc.recorded_checked = lc.init.checked_version if lc.init is not None else 0


@dataclass
class TableAssessment:
    """One read of the table for the steps that judge its regions: the latest version, its
    MemWAL state, every region's latest manifest, read after the state (merge progress only
    grows, so a merge landing in between only makes what is derived from the two
    conservative), and the verdicts on those manifests. A GC pass reads it once for its
    expired-region discard, its record before the base-version cleanup and its plan."""

    dataset: Any  # the `lance.LanceDataset` opened at `state.table_version`
    state: table.MemWalState
    reads: region.RegionReads
    lifecycle: Lifecycle


def assess_table(loc: TableLocation, *, record: bool = False, max_workers: int = 16,
                 indexed: Indexed | None = None, newest_known: int | None = None) -> TableAssessment:
    """`assess` over every region of the table (what status, `regions discard` and GC use);
    `indexed`: the versions the caller read already (`find_initialization`); `newest_known`: the
    latest version as the caller found it (`table.open_latest`)."""
    ds = table.open_latest(loc, newest_known)
    state = table.read_memwal_state(loc, ds.version)
    reads = region.load_many(loc.store, region.list_regions(loc.store).region_ids, max_workers=max_workers)
    return TableAssessment(ds, state, reads, assess(loc, reads.manifests, current_version=ds.version, record=record,
                                                    indexed=indexed))


def without_stale(m: region.RegionManifest, verdict: RegionVerdict | None) -> region.RegionManifest:
    """A copy of `m` that lists only its current generations (what readers may be shown and
    region values derived from)."""
    if verdict is None:
        return m
    msg = pb.RegionManifest()
    msg.CopyFrom(m.message)
    for i in reversed(range(len(msg.flushed_generations))):
        if verdict.is_stale(msg.flushed_generations[i].generation):
            del msg.flushed_generations[i]
    return region.RegionManifest(m.region_id, m.version, msg)  # not `m.raw`: those bytes are not this message


# ---------------------------------------------------------------------------------------------
# Discarding


@dataclass
class DiscardResult:
    discarded: dict[str, int] = field(default_factory=dict)   # region -> progress recorded (stale through)
    refused: dict[str, str] = field(default_factory=dict)     # region -> why not
    dry_run: bool = False
    table_version: int = 0


@lease.step("discard")
def discard(loc: TableLocation, region_ids: list[str] | None = None, *, dry_run: bool = False,
            by: str = "operator", only_older_than: float | None = None, now: float | None = None,
            assessed: TableAssessment | None = None) -> DiscardResult:
    """Record the stale generations of `region_ids` (None: every stale region) as handled: one
    merge commit with no rows that sets each region's merge progress to `stale_through`. Their
    rows never reach the table; later generations then merge, and GC collects the stale ones.

    Refused per region: not stale, already discarded, an open boundary (a writer would still
    replay pre-initialization WAL rows into its next generation), progress already past.
    `only_older_than`: only verdicts detected at least that many seconds ago (GC's grace).
    `assessed`: the table as read under this lease (GC's pass); its verdicts are updated in
    place by a discard, after which the caller reads the table again.

    Holds the table lease like every committing step (`lease=` keyword, `state/lease.py`;
    re-entered inside GC's grace discard, none for a dry run), and fences its commit: a commit
    that loses a race with a maintainer's leaves files behind, and the lifecycle record is a
    plain put that a merger saving the verdicts of its plan would otherwise overwrite."""
    now = time.time() if now is None else now
    a = assessed if assessed is not None else assess_table(loc)  # recorded below only when something is discarded
    lc, reads, state = a.lifecycle, a.reads, a.state
    out = DiscardResult(dry_run=dry_run, table_version=state.table_version)
    wanted = sorted(lc.stale) if region_ids is None else list(region_ids)
    marks: dict[str, int] = {}
    for rid in wanted:
        v = lc.stale.get(rid)
        merged = state.merged.get(rid, 0)
        if v is None:
            why = lc.errors.get(rid) or reads.region_errors.get(rid) or (
                "not a region of this table" if rid not in reads else "not stale: its data was written after "
                + (lc.init.describe() if lc.init and lc.init.known else "the MemWAL initialization (unknown)"))
            out.refused[rid] = why
        elif v.open:
            out.refused[rid] = (f"region {rid}: its WAL holds rows up to entry {v.wal_position} written before the "
                                "initialization that no generation has taken yet; a writer re-opening it would replay "
                                "them into its next generation, so its boundary is not known yet: discard after that flush")
        elif v.stale_through <= merged:
            if region_ids is not None:
                out.refused[rid] = f"region {rid}: already handled (merge progress {merged} >= {v.stale_through})"
        elif only_older_than is not None and now - v.detected_at < only_older_than:
            continue
        elif only_older_than is not None and merged > 0 and rid not in lc.discarded:
            # In a new lifetime a stale region's progress moves only by a discard: progress that
            # no discard recorded came with the table's MemWAL index from elsewhere, as when the
            # table is restored to a version of an earlier lifetime (not recognised as such).
            # Then its pending generations are the restored lifetime's own: never automatically.
            out.refused[rid] = (f"region {rid}: merge progress {merged} that no discard recorded (was the table "
                                "restored to a version from before the MemWAL initialization?); not discarded "
                                "automatically: discard it by hand if its rows are not wanted")
            log.warning("%s", out.refused[rid])
        else:
            marks[rid] = v.stale_through
    if dry_run or not marks:
        out.discarded = marks
        return out
    ds = table.open_dataset(loc)
    pk = table.primary_key(ds)
    empty = pa.Table.from_batches([], schema=ds.schema)
    for attempt in range(5):
        lease.fence(loc, "stale-region discard commit")
        try:
            ds.merge_insert(pk).when_matched_update_all().when_not_matched_insert_all() \
                .mark_sstables_as_compacted(merged_markers(marks)).execute(empty)
            break
        except OSError as e:
            if not is_commit_conflict(e) or attempt == 4:
                raise
            ds = table.open_dataset(loc)
            merged = table.read_memwal_state(loc).merged
            marks = {rid: g for rid, g in marks.items() if merged.get(rid, 0) < g}
            if not marks:
                break
    for rid, g in marks.items():
        lc.discarded[rid] = {"through": g, "at": now, "by": by}
        log.warning("region %s: generations through %d discarded (%s): never merged; GC collects them", rid, g, by)
    _write_record(loc, lc)
    out.discarded = marks
    out.table_version = table.open_dataset(loc).version
    return out
