"""The garbage collector (spec "Garbage Collector"): reclaim what no reader or writer needs.

A pure planner (`plan_gc`) reads committed state only and returns a `GcPlan` listing every
object it would delete, with its kind, key, bytes and the reason it is eligible, plus counts
of what it keeps and why; the executor (`execute_gc`) deletes exactly that, after committing a
region manifest version that no longer lists the deleted generations. `run_gc` does both, after
the optional base-table version cleanup. A dry run (`run_gc(dry_run=True)`, `memwal maintain
--dry-run`) is the same path with execution off: the cleanup is planned by Lance itself
(`explain_cleanup_old_versions`, same settings), and GC is planned as if those versions were gone,
so it lists what the real run deletes. Per region:

1. **Generations** `g <= limit[region]`, where `limit` is the minimum of
   - `merged[region]` of the latest table version,
   - `index_catchup[I][region]` for every index I whose catch-up gates GC
     (`MemWalState.gating_indexes`; an index or region absent from `index_catchup` counts as 0),
   - `merged[region]` of **every retained base-table version** (`ds.versions()`): a reader
     time-travelling to version v reads the generations newer than v's merged, so they stay.
     A version whose table has no MemWAL index yet needs none.
   - 0 for a sharded region whose routing value no MemWAL index snapshot records yet
     (`unrecorded_regions`): its merged generations are the merger's authority for that value.
   A region with data from before the MemWAL initialization (`state/lifecycle.py`) keeps
   everything until discarded; its discarded generations are then held only by versions from
   before the initialization (`_stale_limit`).
2. **WAL entries** at positions `p <= replay_after_wal_entry_position` and below the WAL tail,
   whose entry generation is one of the deleted (or earlier deleted) generations. An entry that
   names no generation (Lance 13 / LanceDB 0.40 write only `writer_epoch`) is decided by its
   position instead (`covered_position`): the spec's flush sets `replay_after` to the last entry
   of the generation it commits, so the newest region manifest version whose
   `current_generation - 1` is at most the collectable bound says up to which position every
   entry lives in a collectable generation; no entry is read to learn its generation. Kept always:
   - every **fence sentinel**: pylance detects fencing when a stale writer's put-if-absent of
     its next WAL position collides, and that position is always a later writer's sentinel
     (each claim writes one at the tip). Delete it and the stale writer's put succeeds into a
     covered position that no replay reads: an acknowledged, lost write (seen on 14.0.2);
   - the entry at the **highest position**: a writer that cannot find the hinted position
     derives its next position from the highest existing file; with the tail gone it would
     reuse covered positions, and its entries there would never be replayed;
   - by default every entry of the region's current `writer_epoch` (`keep_current_epoch_wal`).
   The scan walks down from the cut to the first missing position, skipping the current
   epoch's contiguous run by bisection; below that hole earlier runs left only kept entries,
   unless a delete failed part-way (S3 DeleteObjects answers per key; a crash). Such a delete
   leaves GC's intent marker `_memwal/gc_pending/{region}` (written before a region's WAL and
   manifest deletes, removed once they all went); for a marked region the WAL directory is
   listed once and what lies below the hole classified the same way.
3. **Region manifest versions** below the newest `manifest_retention` and older than
   `manifest_min_age_seconds`, a prefix only (the versions left stay contiguous up to the latest),
   never the latest (for a marked region, versions below a hole are found by one listing of
   the manifest directory). `version_hint.json` is rewritten to the latest version first when it is
   missing or points outside the versions that stay.
4. **Orphan directories** `*_gen_*` in the region directory that the latest manifest does not
   list, whose generation is below its `current_generation` (a flush in progress writes its
   directory before the manifest), and whose newest object is older than `orphan_grace_seconds`.
   The latest manifest is read again right before they are deleted.

5. **Leaked base-table files** (`jobs/leaks.py`, when `collect_leaked_files` and the plan covers
   every region): files under `data/`, `_deletions/`, `_transactions/`, `_indices/` that no
   retained version's manifest references (commits that lost a race or crashed), older than
   `leaked_file_grace_seconds` (a week, never below the retention floor); kind `leaked`,
   region "" (deleted after the regions' work).

Every committing step holds the table lease (`state/lease.py`): `run_gc` / `execute_gc` take it,
and the base-version cleanup, each manifest commit and each delete are fenced by it.

Execution, per region: commit the trimmed manifest (`region.commit_next`: a lost race reloads
and re-applies the trim to the fresh manifest; `writer_epoch` never changes), then delete
generation directories and WAL entries (lowest position first), fix the version hint, delete
old manifest versions (oldest first), re-read the latest manifest and delete the orphans still
unlisted. A crash after the commit leaves unlisted directories: the next run's orphan sweep
takes them once they are older than the grace period.

Safety: every key comes from `layout` (generation paths are validated) and must lie inside
its region directory; a region whose manifest lists an unsafe path is reported corrupt and
nothing in it is touched; a region whose manifest cannot be read is skipped with an error.
Planning uses gets and existence probes; the only listings are the region directories (one
per region, for orphans), the directories about to be deleted (their keys), GC's intent
markers (one per table), the WAL and manifest directories of marked regions, and the base
table's `_versions` (`ds.versions()`, through Lance).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable

from memwal_core import faults
from memwal_core.errors import MemwalError, one_line
from memwal_core.options import GcOptions
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.jobs.gc import leaks
from memwal_core.state import layout, lease, lifecycle, region, routing, table, wal
from memwal_core.state.store import ObjectInfo, TableLocation

log = logging.getLogger("memwal.gc")

GENERATION = "generation"
WAL = "wal"
MANIFEST = "manifest"
ORPHAN = "orphan"
LEAKED = "leaked"  # a base-table file of a lost or crashed commit (`jobs/leaks.py`); region_id ""
KINDS = (GENERATION, WAL, MANIFEST, ORPHAN, LEAKED)
BASE_VERSION = "base_version"  # a base-table version Lance's cleanup removes (not a GcItem)

CRASH_AFTER_MANIFEST_COMMIT = "gc.after_manifest_commit"


class GcError(MemwalError):
    """GC cannot establish what is safe to delete for the whole table (nothing is deleted)."""


@dataclass(frozen=True)
class GcItem:
    """One thing to delete: a directory (generation, orphan) or one object (WAL, manifest)."""

    kind: str
    region_id: str
    path: str  # directory prefix or object key, relative to the table root
    bytes: int
    reason: str
    keys: tuple[str, ...]  # the objects deleted for this item
    number: int | None = None  # generation, WAL position or manifest version

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["objects"] = len(self.keys)
        del d["keys"]
        return d


@dataclass(frozen=True)
class GcHold:
    """Generations GC keeps for one reason, over all regions (what `memwal status`, the
    `garbage` asset and `--dry-run` show). Reasons: `time_travel` (a retained base-table
    version still reads them; `until` = when the newest such version becomes old enough for
    the configured base-version cleanup, None when no cleanup is configured), `index_behind:<name>`
    (a gating index has not caught up), `not_merged` (pending; includes a region stuck behind
    a wall), `value_unrecorded` (a sharded region's routing value is not yet in a MemWAL index
    snapshot: its merged generations are the merger's authority for it until the index builder,
    which runs before GC in the maintenance job, records it), `stale` (a region with data from
    before the MemWAL initialization, not yet discarded: nothing of it is collected).
    Bytes are the generations' `in_memory_bytes` from the manifests (no listing)."""

    reason: str
    generations: int
    bytes: int
    regions: int
    until: float | None = None

    def describe(self) -> str:
        when = ""
        if self.reason == "time_travel":
            when = (f" until {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.until))}" if self.until
                    else " until old base-table versions are cleaned up (no cleanup configured)")
        return f"{self.generations} generations ({self.bytes} bytes) in {self.regions} regions: {self.reason}{when}"


def _hold_reason(bound: str) -> str:
    return "time_travel" if bound.startswith("retained_version:") else bound


@dataclass
class RegionGcPlan:
    region_id: str
    manifest_version: int = 0
    writer_epoch: int = 0
    current_generation: int = 0
    replay_after: int = 0
    wal_tail: int = 0
    limit: int = 0  # generations <= limit are collectable
    items: list[GcItem] = field(default_factory=list)
    kept: collections.Counter = field(default_factory=collections.Counter)  # "kind:reason" -> n
    trim: list[tuple[int, str]] = field(default_factory=list)  # (generation, path) to unlist
    hint: int | None = None  # version_hint.json as read
    lowest_kept_version: int = 0
    leftover_scan: bool = False  # a marker said an earlier delete may have left survivors
    error: str | None = None
    held: dict[str, list] = field(default_factory=dict)  # hold reason -> [generations, bytes, until]

    def by_kind(self, kind: str) -> list[GcItem]:
        return [i for i in self.items if i.kind == kind]


@dataclass
class BaseCleanupPlan:
    """What Lance's `cleanup_old_versions` would remove with GC's settings, as Lance itself
    explains it (`explain_cleanup_old_versions`): the base-table versions (never the latest, never
    a tagged one) and the files that go with them. Age-based settings are relative to when it was
    planned: a version that turns old enough after that is not in it."""

    versions: list[int]
    bytes: int = 0
    files: dict[str, int] = field(default_factory=dict)  # Lance's kinds: manifest, data, transaction, ...
    paths: list[str] = field(default_factory=list)  # the first files, table-relative
    paths_truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"versions": self.versions, "old_versions": len(self.versions), "bytes": self.bytes,
                "files": dict(self.files), "paths": self.paths, "paths_truncated": self.paths_truncated}


@dataclass
class GcPlan:
    table_uri: str
    table_version: int
    config: GcOptions
    planned_at: float
    retained_versions: list[int]
    gating_indexes: list[str]
    regions: dict[str, RegionGcPlan]
    region_errors: dict[str, str] = field(default_factory=dict)  # region id -> why it is skipped
    # Planned with these base versions taken as removed (a dry run's cleanup); None: as they are.
    base_cleanup: BaseCleanupPlan | None = None
    leaked: list[GcItem] = field(default_factory=list)  # base-table files of lost commits
    leak_scan: dict[str, Any] = field(default_factory=dict)  # its cost and what it kept
    lifecycle: lifecycle.Lifecycle | None = None  # stale-region verdicts the plan used

    @property
    def items(self) -> list[GcItem]:
        return [i for r in self.regions.values() for i in r.items] + self.leaked

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def objects(self) -> int:
        return sum(len(i.keys) for i in self.items)

    @property
    def kept(self) -> dict[str, int]:
        total: collections.Counter = collections.Counter()
        for r in self.regions.values():
            total.update(r.kept)
        total.update(self.leak_scan.get("kept", {}))
        return dict(sorted(total.items()))

    def counts(self) -> dict[str, int]:
        c = collections.Counter(i.kind for i in self.items)
        return {k: c.get(k, 0) for k in KINDS}

    @property
    def holds(self) -> list[GcHold]:
        return summarize_holds(self.regions.values())

    def to_dict(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        return {
            "table": self.table_uri, "table_version": self.table_version, "config": cfg,
            "retained_versions": self.retained_versions, "gating_indexes": self.gating_indexes,
            "items": [i.to_dict() for i in self.items], "counts": self.counts(),
            "objects": self.objects, "bytes": self.bytes, "kept": self.kept,
            "limits": {rid: r.limit for rid, r in sorted(self.regions.items()) if not r.error},
            "region_errors": dict(self.region_errors),
            "holds": [asdict(h) | {"text": h.describe()} for h in self.holds],
            "base_cleanup": self.base_cleanup.to_dict() if self.base_cleanup is not None else None,
            "leak_scan": dict(self.leak_scan),
        }


def summarize_holds(regions: Iterable[RegionGcPlan]) -> list[GcHold]:
    """Per reason: generations, bytes, regions and (time travel) the latest end of the hold."""
    acc: dict[str, list] = {}
    for r in regions:
        for reason, (gens, nbytes, until) in r.held.items():
            a = acc.setdefault(reason, [0, 0, 0, None])
            a[0] += gens
            a[1] += nbytes
            a[2] += 1
            if until is not None:
                a[3] = until if a[3] is None else max(a[3], until)
    return [GcHold(reason, *acc[reason]) for reason in sorted(acc)]


@dataclass
class GcResult:
    table_uri: str
    deleted: list[GcItem] = field(default_factory=list)
    deleted_objects: int = 0
    bytes_reclaimed: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    manifest_commits: int = 0
    skipped: list[GcItem] = field(default_factory=list)  # planned, not deleted on re-check
    region_errors: dict[str, str] = field(default_factory=dict)
    base_cleanup: dict[str, Any] | None = None
    plan_seconds: float = 0.0
    execute_seconds: float = 0.0
    holds: list[GcHold] = field(default_factory=list)  # what the plan kept and why (see GcHold)
    # Base-table versions the plan read (each one a reader may time-travel to): every GC pass
    # reads them all, so this is what its cost grows with (`gc.cleanup_base_versions_*` bounds it).
    retained_versions: int = 0
    dry_run: bool = False
    plan: GcPlan | None = None  # what was planned (a dry run's answer: its items would be deleted)
    # Leaked base-table files deleted (objects, bytes; also in `deleted` as kind "leaked") and
    # what finding them cost (`jobs/leaks.py`: manifests read, files listed, seconds).
    leaked_objects: int = 0
    leaked_bytes: int = 0
    leak_scan: dict[str, Any] = field(default_factory=dict)
    # Stale regions discarded after `discard_stale_after_seconds`: region -> generations through.
    stale_discarded: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        c = collections.Counter(i.kind for i in self.deleted)
        return {k: c.get(k, 0) for k in KINDS}

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": self.table_uri, "deleted": self.counts(), "deleted_objects": self.deleted_objects,
            "bytes_reclaimed": self.bytes_reclaimed, "kept": dict(self.kept),
            "manifest_commits": self.manifest_commits, "region_errors": dict(self.region_errors),
            "skipped": [i.to_dict() for i in self.skipped], "base_cleanup": self.base_cleanup,
            "plan_seconds": round(self.plan_seconds, 3), "execute_seconds": round(self.execute_seconds, 3),
            "retained_versions": self.retained_versions,
            "leaked_objects": self.leaked_objects, "leaked_bytes": self.leaked_bytes, "leak_scan": dict(self.leak_scan),
            "stale_discarded": dict(self.stale_discarded),
            "items": [i.to_dict() for i in self.deleted],
            **({"dry_run": True, "planned": [i.to_dict() for i in self.plan.items]}
               if self.dry_run and self.plan is not None else {}),
        }


# ------------------------------------------------------------------------------------------
# Retention: what the base table's versions still need
# ------------------------------------------------------------------------------------------

# (lance uri, version, version timestamp) -> merged by region, or None (no MemWAL index).
# Table versions are immutable; the timestamp tells a re-created table's version N apart.
_MERGED_CACHE: dict[tuple[str, int, str], dict[str, int] | None] = {}
_MERGED_CACHE_LOCK = threading.Lock()
_MERGED_CACHE_MAX = 100_000


def _merged_at(loc: TableLocation, version: int, stamp: str) -> dict[str, int] | None:
    key = (loc.lance_uri, version, stamp)
    with _MERGED_CACHE_LOCK:
        if key in _MERGED_CACHE:
            return _MERGED_CACHE[key]
    try:
        merged: dict[str, int] | None = table.read_memwal_state(loc, version).merged
    except table.MemWalNotInitialized:
        merged = None  # a reader of this version does no MemWAL read: needs no generation
    with _MERGED_CACHE_LOCK:
        if len(_MERGED_CACHE) >= _MERGED_CACHE_MAX:
            _MERGED_CACHE.clear()
        _MERGED_CACHE[key] = merged
    return merged


@dataclass
class _Retention:
    """Per region: the lowest merged generation over retained versions, and which version."""

    versions: list[int]
    states: dict[int, dict[str, int]]  # retained versions with a MemWAL index
    stamps: dict[int, float] = field(default_factory=dict)  # version -> commit time (epoch seconds)

    def held_until(self, region_id: str, generation: int, older_than: timedelta | None) -> float | None:
        """When the newest retained version still reading `generation` becomes old enough for
        the base-version cleanup (None: no cleanup configured, or no timestamp)."""
        if older_than is None:
            return None
        needing = [v for v, m in self.states.items() if m.get(region_id, 0) < generation]
        if not needing or max(needing) not in self.stamps:
            return None
        return self.stamps[max(needing)] + older_than.total_seconds()

    def bound(self, region_id: str) -> tuple[int, int | None]:
        best, which = None, None
        for v in sorted(self.states):
            m = self.states[v].get(region_id, 0)
            if best is None or m < best:
                best, which = m, v
        return (best, which) if best is not None else (2**63, None)


def _stamp(value: Any) -> float | None:
    try:
        return value.timestamp() if hasattr(value, "timestamp") else float(value)
    except (TypeError, ValueError, OSError):
        return None


def _retention(loc: TableLocation, ds, gone: frozenset[int] = frozenset()) -> _Retention:
    """What the retained versions need; `gone`: versions taken as removed (a dry run's cleanup)."""
    versions, states, stamps = [], {}, {}
    for info in ds.versions():
        v = int(info["version"])
        if v in gone:
            continue
        stamp = _stamp(info.get("timestamp"))
        if stamp is not None:
            stamps[v] = stamp
        try:
            merged = _merged_at(loc, v, str(info.get("timestamp")))
        except table.TableError as e:
            if "not found" in str(e):  # cleaned up since the listing: no longer retained
                log.info("table version %d vanished while planning GC (cleaned up): %s", v, e)
                continue
            raise GcError(f"cannot read the MemWAL state of retained table version {v}: {e}") from None
        versions.append(v)
        if merged is not None:
            states[v] = merged
    return _Retention(sorted(versions), states, stamps)


# ------------------------------------------------------------------------------------------
# Planning
# ------------------------------------------------------------------------------------------

def _safe_keys(infos: Iterable[ObjectInfo], directory: str, region_dir: str) -> list[ObjectInfo]:
    out = []
    for o in infos:
        if not (layout.is_inside(o.key, directory) and layout.is_inside(o.key, region_dir)):
            raise layout.UnsafePath(f"listed key {o.key!r} is not inside {directory}/")
        out.append(o)
    return out


def _list_dir(loc: TableLocation, directory: str, region_dir: str) -> list[ObjectInfo]:
    return _safe_keys(loc.store.list(directory), directory, region_dir)


@dataclass
class _Context:
    loc: TableLocation
    config: GcOptions
    now: float
    merged: dict[str, int]
    catchup: dict[str, dict[str, int]]
    gating: list[str]
    retention: _Retention
    pending: set[str] = field(default_factory=set)  # regions with a GC intent marker
    # Sharded regions whose routing value no MemWAL index snapshot records authoritatively:
    # their merged generations are the merger's only authority for it (see `unrecorded_regions`).
    unrecorded: set[str] = field(default_factory=set)
    spec_ids: list[int] = field(default_factory=list)  # region specs of the MemWAL index
    stale: lifecycle.Lifecycle | None = None  # regions with data from before the MemWAL initialization


def _stale_limit(ctx: _Context, rid: str) -> int:
    """The highest collectable *stale* generation of a discarded region: merge progress (the
    discard) and what versions from before the initialization still read. This lifetime's
    versions, gating indexes and region values never depended on them (they were never merged)."""
    init = ctx.stale.init.table_version if ctx.stale and ctx.stale.init else 0
    older = [m.get(rid, 0) for v, m in ctx.retention.states.items() if v < init]
    return min([ctx.merged.get(rid, 0)] + older)


def _limit(ctx: _Context, rid: str) -> tuple[int, list[tuple[str, int]]]:
    """The highest collectable generation and the bounds it is the minimum of (named)."""
    bounds = [("not_merged", ctx.merged.get(rid, 0))]
    for name in ctx.gating:
        bounds.append((f"index_behind:{name}", ctx.catchup.get(name, {}).get(rid, 0)))
    low, which = ctx.retention.bound(rid)
    if which is not None:
        bounds.append((f"retained_version:{which}", low))
    return min(b for _, b in bounds), bounds


def unrecorded_regions(loc: TableLocation, state: table.MemWalState,
                       manifests: dict[str, region.RegionManifest]) -> set[str]:
    """Sharded regions whose routing value the MemWAL index snapshot does not record as
    authoritative (derived from merged rows).

    The merger checks every pending generation against the region's value, taken from the
    snapshot or else from the region's merged generations. Trimming those before a snapshot
    recorded the value would leave it nothing to check against but the pending rows themselves,
    so a generation whose rows all belong to another region would be accepted (found by the
    harness soak: a misrouted generation merged after GC). These regions keep their merged
    generations until the next snapshot records the value. An unreadable snapshot counts as
    recording nothing."""
    from memwal_core.jobs import snapshot  # local: snapshot is heavy and GC plans without it otherwise

    specs = {s.spec_id: snapshot.spec_from_pb(s) for s in state.details.region_specs}
    sharded = {sid for sid, spec in specs.items()
               if spec.fields and not all(f.transform == routing.UNSHARDED for f in spec.fields)}
    need = {rid for rid, m in manifests.items() if m.message.region_spec_id in sharded}
    if not need:
        return set()
    try:
        recorded = snapshot.recorded_values(loc, state)
    except Exception as e:  # noqa: BLE001 - unreadable: nothing is recorded as far as GC may assume
        log.warning("MemWAL index snapshot unreadable (%s): merged generations of sharded regions are kept", e)
        recorded = {}
    return {rid for rid in need if not recorded.get(rid)}


def _plan_region(ctx: _Context, rid: str, m: region.RegionManifest) -> RegionGcPlan:
    store, cfg = ctx.loc.store, ctx.config
    rdir = layout.region_dir(rid)
    rp = RegionGcPlan(rid, m.version, m.writer_epoch, m.current_generation,
                      m.message.replay_after_wal_entry_position, leftover_scan=rid in ctx.pending)
    # Validate every listed path before anything else: a corrupt manifest deletes nothing.
    try:
        listed = [(g, layout.generation_dir(rid, g.path, g.generation)) for g in m.generations]
    except layout.UnsafePath as e:
        why = str(e).removeprefix(f"region {rid}: ")  # layout names the region already
        rp.error = f"region {rid}: corrupt manifest version {m.version}: {why}; nothing collected here"
        return rp
    verdict = ctx.stale.verdict(rid) if ctx.stale else None
    if ctx.stale and rid in ctx.stale.errors:
        rp.error = f"{ctx.stale.errors[rid]}; nothing collected here"
        return rp
    if verdict is not None and ctx.stale.blocks(rid, ctx.merged.get(rid, 0)):
        # Stale and not discarded: the merger refuses it; its files are the evidence of the verdict.
        rp.kept["region:stale"] += 1
        for g, _ in listed:
            rp.kept["generation:stale"] += 1
            _hold(ctx, rp, "stale", g)
        return rp
    try:  # what the merger refuses, GC leaves alone: progress says nothing true about it
        region.check_spec(m, ctx.spec_ids)
        region.pending_generations(m, ctx.merged.get(rid, 0))
    except region.CorruptManifest as e:
        rp.error = f"region {rid}: corrupt manifest version {m.version}: {e.detail}; nothing collected here"
        return rp
    limit, bounds = _limit(ctx, rid)
    rp.limit = limit
    # Generations only: WAL entries and manifest versions do not carry the region's value.
    gen_bounds = bounds + ([("value_unrecorded", 0)] if rid in ctx.unrecorded else [])
    gen_limit = min(b for _, b in gen_bounds)
    stale_limit = _stale_limit(ctx, rid) if verdict is not None else 0

    # 1. generations
    for g, gdir in listed:
        if m.sealed:  # no manifest version may be written on a sealed region, so no trim either
            rp.kept["generation:sealed"] += 1
            continue
        if verdict is not None and verdict.is_stale(g.generation) and g.generation <= stale_limit:
            objs = _list_dir(ctx.loc, gdir, rdir)
            rp.items.append(GcItem(GENERATION, rid, gdir, sum(o.size for o in objs),
                                   f"generation {g.generation} predates the MemWAL initialization, discarded",
                                   tuple(o.key for o in objs), g.generation))
            rp.trim.append((g.generation, g.path))
        elif g.generation <= gen_limit and g.generation < m.current_generation:
            objs = _list_dir(ctx.loc, gdir, rdir)
            rp.items.append(GcItem(GENERATION, rid, gdir, sum(o.size for o in objs),
                                   f"generation {g.generation} <= merged and caught-up limit {gen_limit}",
                                   tuple(o.key for o in objs), g.generation))
            rp.trim.append((g.generation, g.path))
        else:
            why = next((name for name, b in gen_bounds if g.generation > b), "not_flushed")
            rp.kept[f"generation:{why}"] += 1
            _hold(ctx, rp, _hold_reason(why), g)
    if "time_travel" in rp.held:
        tt = rp.held["time_travel"]
        tt[2] = ctx.retention.held_until(rid, tt[2], cfg.base_cleanup_older_than)
    for reason, h in rp.held.items():
        if reason != "time_travel":
            h[2] = None
    kept_listed = {g.generation for g, _ in listed} - {g for g, _ in rp.trim}

    # 2. WAL entries
    _plan_wal(ctx, rp, m, limit, kept_listed)

    # 3. old manifest versions
    _plan_manifests(ctx, rp, m)

    # 4. orphan directories
    listed_names = {g.path for g, _ in listed}
    for name in store.list_dirs(rdir):
        gen = layout.generation_of_dir(name)
        if gen is None or name in listed_names:
            continue
        if "/" in name or name in (".", ".."):
            continue
        odir = f"{rdir}/{name}"
        if not layout.is_inside(odir + "/x", rdir):
            continue
        if gen >= m.current_generation:
            rp.kept["orphan:flush_in_progress"] += 1
            continue
        objs = _list_dir(ctx.loc, odir, rdir)
        if not objs:
            rp.kept["orphan:empty"] += 1
            continue
        age = ctx.now - max(o.mtime for o in objs)
        if age < cfg.orphan_grace_seconds:
            rp.kept["orphan:young"] += 1
            continue
        rp.items.append(GcItem(ORPHAN, rid, odir, sum(o.size for o in objs),
                               f"unlisted generation {gen} directory, newest object {age:.0f}s old",
                               tuple(o.key for o in objs), gen))
    return rp


def _listed_positions(loc: TableLocation, directory: str, suffix: str, region_dir: str) -> list[int]:
    """Positions (WAL) or versions (manifests) of the `{bitrev}{suffix}` objects in `directory`."""
    out = []
    for o in _list_dir(loc, directory, region_dir):
        name = o.key.rsplit("/", 1)[-1]
        if name.endswith(suffix) and (n := layout.parse_bitrev(name[: -len(suffix)])):
            out.append(n)
    return out


def _hold(ctx: _Context, rp: RegionGcPlan, reason: str, g: region.Generation) -> None:
    h = rp.held.setdefault(reason, [0, 0, None])
    h[0] += 1
    h[1] += int(g.in_memory_bytes or 0)
    if reason == "time_travel":  # the highest such generation decides until when (see below)
        h[2] = g.generation if h[2] is None else max(h[2], g.generation)


def covered_position(store, rid: str, m: region.RegionManifest, bound: int) -> tuple[int, int | None]:
    """(position, manifest version): the highest WAL position whose entries all went into
    generations <= `bound`, read from the region manifest history; (0, None) when unknown.

    Spec (Region Manifest): a flush commits the manifest version that lists the new generation,
    advances `current_generation` past it and sets `replay_after_wal_entry_position` to the last
    WAL entry it contains; so at any version v, every entry at a position <= replay_after(v)
    lives in a generation < current_generation(v). Any version read with
    `current_generation - 1 <= bound` therefore gives a position below which every entry is in a
    generation <= bound, without reading a single entry: that check on a version actually read is
    the whole safety argument. Which version is found is only a matter of how much is reclaimed:
    `current_generation` never decreases from one version to the next and the versions GC leaves
    are a contiguous suffix, so two bisections (the oldest version still there, then the newest
    that qualifies) find the best one in O(log versions) reads; a version that cannot be read is
    taken for part of the collected prefix and never returned (at worst less is reclaimed)."""
    if m.current_generation - 1 <= bound:
        return m.message.replay_after_wal_entry_position, m.version
    cache: dict[int, region.RegionManifest | None] = {m.version: m}

    def load(v: int) -> region.RegionManifest | None:
        if v not in cache:
            try:
                cache[v] = region.load_version(store, rid, v)
            except region.RegionError:
                cache[v] = None
        return cache[v]

    lo, hi = 1, m.version  # the oldest version still there: missing ones are a prefix
    while lo < hi:
        mid = (lo + hi) // 2
        if store.exists(layout.manifest_key(rid, mid)):
            hi = mid
        else:
            lo = mid + 1
    best: region.RegionManifest | None = None
    lo, hi = lo, m.version - 1  # the newest qualifying version in [oldest, latest - 1]
    while lo <= hi:
        mid = (lo + hi) // 2
        got = load(mid)
        if got is None:  # unreadable: like the missing prefix (a delete that failed part-way)
            lo = mid + 1
        elif got.current_generation - 1 <= bound:
            best, lo = got, mid + 1
        else:
            hi = mid - 1
    if best is None:
        return 0, None
    return best.message.replay_after_wal_entry_position, best.version


def _plan_wal(ctx: _Context, rp: RegionGcPlan, m: region.RegionManifest, limit: int,
              kept_listed: set[int]) -> None:
    store, rid = ctx.loc.store, rp.region_id
    rdir = layout.region_dir(rid)
    replay_after = m.message.replay_after_wal_entry_position
    hint = max(replay_after, m.message.wal_entry_position_last_seen)

    def exists(p: int) -> bool:
        return p >= 1 and store.exists(layout.wal_key(rid, p))

    # The tail: probe forward from the hint (or the one after it, which GC may have left as
    # the first survivor when the hinted entry itself was covered and deleted).
    if exists(hint):
        tail = wal.probe_tail(store, rid, hint)
    elif exists(hint + 1):
        tail = wal.probe_tail(store, rid, hint + 1)
    else:
        tail = 0  # empty WAL, or no entry where the manifest says: delete nothing
    rp.wal_tail = tail
    if tail < 1:
        return
    rp.kept["wal:tail"] += 1
    if tail - replay_after - 1 > 0:
        rp.kept["wal:uncovered"] += tail - replay_after - 1  # positions strictly between
    cut = min(replay_after, tail - 1)
    if cut < 1:
        return

    # Entries without a `generation` in their metadata (Lance 13, LanceDB 0.40) are decided
    # by position: those at or below `nogen_cut` went into generations that are all collectable
    # now (<= limit, < current_generation) and none of which is still listed as kept.
    nogen_bound = min([limit, m.current_generation - 1] + [g - 1 for g in kept_listed])
    nogen: list[int] = []  # found once, on the first such entry: pylance 14 tables never need it

    def nogen_cut() -> int:
        if not nogen:
            nogen.append(covered_position(store, rid, m, nogen_bound)[0] if nogen_bound >= 1 else 0)
        return nogen[0]

    metas: dict[int, wal.WalEntryMeta | None] = {}

    def meta(p: int) -> wal.WalEntryMeta | None:
        """Entry metadata; None when the position does not exist."""
        if p not in metas:
            try:
                metas[p] = wal.read_entry_meta(store, rid, p)
            except wal.WalEntryError as e:
                if "does not exist" in str(e):
                    metas[p] = None
                else:
                    metas[p] = wal.WalEntryMeta(p, -1, None, False, 0)  # unreadable: keep
                    log.warning("%s", e)
        return metas[p]

    p = cut
    if ctx.config.keep_current_epoch_wal:
        top = meta(cut)
        if top is not None and top.writer_epoch == m.writer_epoch:
            # Positions from the current epoch's sentinel up to the cut are all this epoch's
            # (epochs do not decrease along the WAL): find the first by bisection.
            lo, hi = 1, cut
            while lo < hi:
                mid = (lo + hi) // 2
                e = meta(mid)
                if e is not None and e.writer_epoch == m.writer_epoch:
                    hi = mid
                else:
                    lo = mid + 1
            rp.kept["wal:current_epoch"] += cut - lo + 1
            p = lo - 1
    def classify(p: int, e: wal.WalEntryMeta) -> None:
        if e.writer_epoch < 0:
            rp.kept["wal:unreadable"] += 1
        elif e.fence_sentinel:
            rp.kept["wal:fence_sentinel"] += 1
        elif ctx.config.keep_current_epoch_wal and e.writer_epoch == m.writer_epoch:
            rp.kept["wal:current_epoch"] += 1
        elif e.generation is None:
            if p > nogen_cut():
                rp.kept["wal:no_generation"] += 1
            else:
                key = layout.wal_key(rid, p)
                rp.items.append(GcItem(WAL, rid, key, e.size,
                                       f"covered (<= {nogen_cut()}) entry of generations <= {nogen_bound}",
                                       (key,), p))
        elif e.generation > limit or e.generation >= m.current_generation or e.generation in kept_listed:
            rp.kept["wal:generation_kept"] += 1
        else:
            key = layout.wal_key(rid, p)
            rp.items.append(GcItem(WAL, rid, key, e.size,
                                   f"covered (<= {replay_after}) entry of deleted generation {e.generation}",
                                   (key,), p))

    while p >= 1:
        e = meta(p)
        if e is None:
            break  # a hole: earlier runs deleted from here down (see below)
        classify(p, e)
        p -= 1
    if p > 1 and rp.leftover_scan:
        # Below the hole, a run whose delete batch failed for some keys (S3 DeleteObjects
        # answers per key) left survivors: list the directory once and classify what is
        # there (sentinels and other kept entries are classified again, and kept again).
        for q in sorted(_listed_positions(ctx.loc, layout.wal_dir(rid), layout.WAL_SUFFIX, rdir), reverse=True):
            if q < p and (e := meta(q)) is not None:
                classify(q, e)


def _plan_manifests(ctx: _Context, rp: RegionGcPlan, m: region.RegionManifest) -> None:
    store, rid, cfg = ctx.loc.store, rp.region_id, ctx.config
    latest = m.version
    rp.hint = region.read_version_hint(store, rid)
    first_candidate = latest - cfg.manifest_retention
    rp.kept["manifest:latest"] += 1
    rp.kept["manifest:retention_count"] += min(cfg.manifest_retention, latest) - 1
    existing: list[tuple[int, ObjectInfo]] = []
    v = first_candidate
    while v >= 1:
        info = store.head(layout.manifest_key(rid, v))
        if info is None:
            break  # a hole: earlier runs deleted from here down
        existing.append((v, info))
        v -= 1
    if v > 1 and rp.leftover_scan:
        # A run whose delete batch failed for some keys left survivors below the hole: one
        # listing of the (small: retained and young versions) manifest directory finds them.
        mdir = layout.manifest_dir(rid)
        for o in _list_dir(ctx.loc, mdir, layout.region_dir(rid)):
            name = o.key.rsplit("/", 1)[-1]
            n = layout.parse_bitrev(name[: -len(layout.MANIFEST_SUFFIX)]) \
                if name.endswith(layout.MANIFEST_SUFFIX) else None
            if n and n < v:
                existing.append((n, o))
        existing.sort(key=lambda x: -x[0])
    existing.reverse()  # oldest first: delete a prefix only, so the rest stays contiguous
    lowest_kept = latest
    for i, (v, info) in enumerate(existing):
        age = ctx.now - info.mtime
        if age < cfg.manifest_min_age_seconds:
            rp.kept["manifest:young"] += len(existing) - i
            lowest_kept = v
            break
        rp.items.append(GcItem(MANIFEST, rid, info.key, info.size,
                               f"version {v} < latest {latest} - {cfg.manifest_retention}, {age:.0f}s old",
                               (info.key,), v))
    else:
        lowest_kept = max(1, first_candidate + 1)
    rp.lowest_kept_version = min(lowest_kept, latest)


def _pending(loc: TableLocation) -> set[str]:
    """Regions whose last WAL/manifest delete did not finish (one listing for the table)."""
    out = set()
    for o in loc.store.list(layout.GC_PENDING_DIR):
        name = o.key.rsplit("/", 1)[-1]
        if layout.is_region_id(name) and o.key == layout.gc_pending_key(name):
            out.add(name)
    return out


def plan_gc(loc: TableLocation, config: GcOptions | None = None, *, regions: list[str] | None = None,
            now: float | None = None, base_cleanup: BaseCleanupPlan | None = None) -> GcPlan:
    """What GC would delete, and why; reads only. `base_cleanup`: plan as if its base-table
    versions were removed already (what the real run's cleanup does before it plans)."""
    config = config or GcOptions()
    now = time.time() if now is None else now
    ds = table.open_dataset(loc)
    state = table.read_memwal_state(loc, ds.version)
    from memwal_core.jobs.catchup import base_indexes  # local import: catchup imports lance at module level too

    gating = state.gating_indexes(list(base_indexes(ds)))
    gone = frozenset(base_cleanup.versions) if base_cleanup is not None else frozenset()
    if ds.version in gone:  # Lance never removes the latest version; a plan saying so is wrong
        raise GcError(f"base cleanup plan removes the latest table version {ds.version}")
    retention = _retention(loc, ds, gone)
    # Manifests are read after the table state: merge progress only grows, so a merge landing
    # in between can only make the limits computed above conservative.
    ids = regions if regions is not None else region.list_regions(loc.store).region_ids
    loaded = region.load_many(loc.store, ids, max_workers=config.max_workers)
    ctx = _Context(loc, config, now, state.merged, state.catchup, gating, retention, _pending(loc),
                   unrecorded_regions(loc, state, loaded.manifests),
                   [s.spec_id for s in state.details.region_specs],
                   lifecycle.assess(loc, loaded.manifests, current_version=ds.version, record=False))
    plans: dict[str, RegionGcPlan] = {}
    errors: dict[str, str] = {}

    def one(rid: str) -> RegionGcPlan:
        got = loaded[rid]
        if not got.ok:
            return RegionGcPlan(rid, error=f"{got.message}; region skipped")
        m = got.manifest
        try:
            return _plan_region(ctx, rid, m)
        except Exception as e:  # noqa: BLE001 - one broken region must not stop the others
            return RegionGcPlan(rid, m.version, error=f"region {rid}: {type(e).__name__}: {e}; region skipped")

    with ThreadPoolExecutor(max_workers=max(1, min(config.max_workers, len(loaded) or 1))) as pool:
        for rp in pool.map(one, sorted(loaded)):
            plans[rp.region_id] = rp
            if rp.error:
                errors[rp.region_id] = rp.error
                rp.items.clear()
                rp.trim.clear()
                log.error("%s", rp.error)
    plan = GcPlan(loc.lance_uri, ds.version, config, now, retention.versions, gating, plans, errors, base_cleanup,
                  lifecycle=ctx.stale)
    if config.collect_leaked_files and regions is None:
        _plan_leaks(loc, plan, now)
    return plan


LEAKS_KEY = "leaked files"  # the plan's / result's `region_errors` key for a failed leak scan


def _plan_leaks(loc: TableLocation, plan: GcPlan, now: float) -> None:
    scan = leaks.plan_leaks(loc, now, plan.config.leaked_grace)
    plan.leak_scan = {"versions_read": scan.versions, "files_listed": scan.files_listed,
                      "list_seconds": round(scan.list_seconds, 3), "refs_seconds": round(scan.refs_seconds, 3),
                      "kept": dict(scan.kept)}
    if scan.error:
        plan.region_errors[LEAKS_KEY] = scan.error
        log.error("%s", scan.error)
        return
    for lk in scan.leaks:
        plan.leaked.append(GcItem(LEAKED, "", lk.key, lk.bytes,
                                  f"{lk.what} no retained version references ({scan.versions} manifests read), "
                                  f"{lk.age:.0f}s old", lk.keys))


# ------------------------------------------------------------------------------------------
# Execution
# ------------------------------------------------------------------------------------------

def _check_item(item: GcItem) -> None:
    """Every key must be where its kind says, inside its region directory."""
    if item.kind == LEAKED:
        if item.region_id or not all(leaks.is_leak_key(k) for k in item.keys) or not all(
                k == item.path or layout.is_inside(k, item.path) for k in item.keys):
            raise layout.UnsafePath(f"refusing to delete leaked-file item {item.path!r} (a key lies outside "
                                    f"{', '.join(leaks.LEAK_DIRS)})")
        return
    rdir = layout.region_dir(item.region_id)
    if item.kind == WAL:
        ok = item.keys == (layout.wal_key(item.region_id, item.number),)
    elif item.kind == MANIFEST:
        ok = item.keys == (layout.manifest_key(item.region_id, item.number),)
    else:
        ok = layout.is_inside(item.path + "/x", rdir) and "/" not in item.path[len(rdir) + 1:]
        ok = ok and all(layout.is_inside(k, item.path) for k in item.keys)
    if not ok or not all(layout.is_inside(k, rdir) for k in item.keys):
        raise layout.UnsafePath(f"region {item.region_id}: refusing to delete {item.path!r} "
                                "(a key lies outside its directory)")


def _trim_mutation(trim: list[tuple[int, str]]) -> region.Mutation:
    drop = set(trim)

    def mutate(msg: pb.RegionManifest) -> bool:
        changed = False
        for i in reversed(range(len(msg.flushed_generations))):
            g = msg.flushed_generations[i]
            if (g.generation, g.path) in drop:
                del msg.flushed_generations[i]
                changed = True
        return changed

    return mutate


@dataclass
class _RegionOutcome:
    deleted: list[GcItem] = field(default_factory=list)
    skipped: list[GcItem] = field(default_factory=list)
    objects: int = 0
    commits: int = 0
    error: str | None = None


def _delete(loc: TableLocation, items: list[GcItem], out: _RegionOutcome) -> None:
    keys = [k for i in items for k in i.keys]
    for i in items:
        _check_item(i)
    if keys:
        lease.fence(loc, "GC delete")
    for start in range(0, len(keys), 1000):
        out.objects += loc.store.delete_many(keys[start:start + 1000])
    out.deleted.extend(items)


def _execute_region(loc: TableLocation, rp: RegionGcPlan) -> _RegionOutcome:
    out = _RegionOutcome()
    store, rid = loc.store, rp.region_id
    try:
        for i in rp.items:
            _check_item(i)
        if rp.trim:
            current = region.load_latest(store, rid)
            committed = region.commit_next(store, current, _trim_mutation(rp.trim))
            if committed is not None:
                out.commits += 1
                log.info("region %s: manifest version %d drops generations %s", rid, committed.version,
                         [g for g, _ in rp.trim])
            faults.point(CRASH_AFTER_MANIFEST_COMMIT)
        # WAL entries and manifest versions are found by walking positions down to the first
        # missing one. A delete that fails part-way (S3 DeleteObjects answers per key; a crash)
        # can leave survivors below such a hole: the intent marker, written before and removed
        # once everything went, makes the next plan look below the holes (one listing each).
        wal_items = sorted(rp.by_kind(WAL), key=lambda i: i.number)
        manifests = rp.by_kind(MANIFEST)
        marker = layout.gc_pending_key(rid)
        if wal_items or manifests:
            store.put(marker, f"GC of region {rid} deleting WAL entries / manifest versions\n".encode())
        _delete(loc, rp.by_kind(GENERATION) + wal_items, out)

        if manifests:
            latest = region.probe_latest_version(store, rid, rp.manifest_version)
            hint = region.read_version_hint(store, rid)
            if hint is None or hint < rp.lowest_kept_version or hint > latest:
                region.write_version_hint(store, rid, latest)
            _delete(loc, manifests, out)
        if wal_items or manifests or rp.leftover_scan:
            store.delete_many([marker])

        orphans = rp.by_kind(ORPHAN)
        if orphans:
            # Re-read the latest manifest after the listing: a directory listed (or being
            # flushed) since the plan is not an orphan any more.
            fresh = region.load_latest(store, rid)
            listed = {g.path for g in fresh.generations}
            ok, late = [], []
            for i in orphans:
                name = i.path.rsplit("/", 1)[-1]
                (late if name in listed or i.number >= fresh.current_generation else ok).append(i)
            out.skipped.extend(late)
            _delete(loc, ok, out)
    except Exception as e:  # noqa: BLE001 - reported per region; the others proceed
        out.error = str(e) if isinstance(e, region.RegionError) else f"region {rid}: {type(e).__name__}: {e}"
        log.error("GC of %s", out.error)
    return out


@lease.step("gc")
def execute_gc(loc: TableLocation, plan: GcPlan) -> GcResult:
    """Delete exactly what `plan` lists (orphans re-checked against the latest manifest).

    A dry run's plan (`plan.base_cleanup` set) is refused: it was made as if Lance's cleanup
    had removed base-table versions that are still retained, and lists generations they can
    still time-travel to."""
    if plan.base_cleanup is not None:
        raise GcError(f"table {plan.table_uri}: refusing to execute a dry run's plan (made as if "
                      f"{len(plan.base_cleanup.versions)} base-table versions were cleaned up, which are still "
                      "retained); run GC itself (`run_gc`), which cleans up first and plans after")
    t0 = time.monotonic()
    result = GcResult(plan.table_uri, kept=plan.kept, region_errors=dict(plan.region_errors))
    todo = [rp for rp in plan.regions.values() if not rp.error and (rp.items or rp.trim or rp.leftover_scan)]
    workers = max(1, min(plan.config.max_workers, len(todo) or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for rp, out in zip(todo, pool.map(lambda r: _execute_region(loc, r), todo)):
            result.deleted.extend(out.deleted)
            result.skipped.extend(out.skipped)
            result.deleted_objects += out.objects
            result.manifest_commits += out.commits
            if out.error:
                result.region_errors[rp.region_id] = out.error
    result.leak_scan = dict(plan.leak_scan)
    if plan.leaked:
        out = _RegionOutcome()
        try:
            _delete(loc, plan.leaked, out)
        except Exception as e:  # noqa: BLE001 - reported; the regions' results stand
            result.region_errors[LEAKS_KEY] = f"deleting leaked files: {one_line(e)}"
            log.error("GC: %s", result.region_errors[LEAKS_KEY])
        result.deleted.extend(out.deleted)
        result.deleted_objects += out.objects
        result.leaked_objects = sum(len(i.keys) for i in out.deleted)
        result.leaked_bytes = sum(i.bytes for i in out.deleted)
    result.bytes_reclaimed = sum(i.bytes for i in result.deleted)
    result.execute_seconds = time.monotonic() - t0
    return result


def _cleanup_kwargs(config: GcOptions) -> dict[str, Any]:
    """Lance's `cleanup_old_versions` arguments for GC's settings (the cleanup and its dry run)."""
    kw: dict[str, Any] = {"error_if_tagged_old_versions": False}
    if config.base_cleanup_older_than is not None:
        kw["older_than"] = config.base_cleanup_older_than
    if config.cleanup_base_versions_retain is not None:
        kw["retain_versions"] = config.cleanup_base_versions_retain
    return kw


def _manifest_version(path: str) -> int | None:
    """The table version of a `_versions/*.manifest` path: Lance's V2 naming stores
    `u64::MAX - version` zero-padded to 20 digits (newest first), V1 the version itself."""
    name = path.rsplit("/", 1)[-1]
    stem = name[: -len(".manifest")] if name.endswith(".manifest") else ""
    if "/_versions/" not in "/" + path or not stem.isdigit():
        return None
    n = int(stem)
    return (2**64 - 1) - n if len(stem) == 20 else n


def plan_base_cleanup(loc: TableLocation, config: GcOptions, *, max_paths: int = 1000) -> BaseCleanupPlan | None:
    """What `cleanup_base_versions` would remove now, from Lance's own explanation with the same
    arguments (None when no cleanup is configured). Every file is listed to find the versions
    (each removed version's manifest is one of them); `paths` keeps the first `max_paths`."""
    if not config.base_cleanup:
        return None
    ds = table.open_dataset(loc)
    ex = ds.explain_cleanup_old_versions(**_cleanup_kwargs(config), include_files=True, max_files=2**31 - 1)
    # Lance names files by their object-store path: the table root (local) or the key in the bucket.
    root = loc.lance_uri.rstrip("/").split("://", 1)[-1].lstrip("/")
    roots = [r + "/" for r in (root, root.split("/", 1)[-1] if "://" in loc.lance_uri else root) if r]
    paths, versions = [], set()
    for c in ex.candidate_files:
        rel = c.path.lstrip("/")
        rel = next((rel[len(r):] for r in roots if rel.startswith(r)), rel)
        paths.append(rel)
        if c.kind == "manifest" and (v := _manifest_version(rel)) is not None:
            versions.add(v)
    if len(versions) != ex.stats.old_versions or ex.candidate_files_truncated:
        raise GcError(f"cannot tell which base-table versions the cleanup would remove: Lance explains "
                      f"{ex.stats.old_versions} old versions, {len(versions)} manifests were recognized")
    files = collections.Counter(c.kind for c in ex.candidate_files)
    return BaseCleanupPlan(sorted(versions), int(ex.stats.bytes_removed), dict(sorted(files.items())),
                           paths[:max_paths], len(paths) > max_paths)


def cleanup_base_versions(loc: TableLocation, config: GcOptions) -> dict[str, int]:
    """Option 5: Lance's own `cleanup_old_versions` (tagged versions are left alone). No version
    listing here: `ds.versions()` reads every retained manifest, the largest part of a GC pass on
    a long history, and the plan that follows reads them once anyway (`run_gc` fills in the counts).

    `older_than` is always passed, at least the retention floor (`GcOptions`): Lance removes a
    version only when it is older than `older_than` *and* not among the newest `retain_versions`
    (given only `retain_versions`, it removes every older version whatever its age), so a
    cleanup by count alone would otherwise remove versions a commit in flight still reads."""
    if not config.base_cleanup:
        return {"old_versions": 0, "bytes_removed": 0}
    ds = table.open_dataset(loc)
    kw = _cleanup_kwargs(config)
    lease.fence(loc, "base-table version cleanup")
    faults.op("lance_cleanup_old_versions")  # reliability tests: a crash point
    stats = ds.cleanup_old_versions(**kw)
    return {"old_versions": int(getattr(stats, "old_versions", 0)),
            "bytes_removed": int(getattr(stats, "bytes_removed", 0))}


@lease.step("gc")
def run_gc(loc: TableLocation, config: GcOptions | None = None, *, regions: list[str] | None = None,
           dry_run: bool = False, progress: Callable[[str], None] | None = None) -> GcResult:
    """Base-version cleanup (when configured), plan, execute. A dry run is the same path with
    execution off: the cleanup is planned instead (Lance's explanation) and GC planned as if
    those versions were gone; `result.plan` lists what would be deleted."""
    config = config or GcOptions()
    base: dict[str, Any] | None = None
    discarded = _discard_expired(loc, config, dry_run)
    base_plan: BaseCleanupPlan | None = None
    if config.base_cleanup and (dry_run or _record_stale(loc)):
        try:
            if dry_run:
                base_plan = plan_base_cleanup(loc, config)
                base = {"dry_run": True, "old_versions": len(base_plan.versions), "bytes_removed": base_plan.bytes}
            else:
                base = cleanup_base_versions(loc, config)
            if progress:
                progress(f"base table: {base['old_versions']} old versions "
                         f"{'would be cleaned up' if dry_run else 'cleaned up'}")
        except Exception as e:  # noqa: BLE001 - planning below stays safe: it reads what is retained
            base = {"error": one_line(e)}
            log.warning("base table version cleanup failed, collecting without it: %s", base["error"])
    t0 = time.monotonic()
    plan = plan_gc(loc, config, regions=regions, base_cleanup=base_plan)
    plan_s = time.monotonic() - t0
    if progress:
        progress(f"plan: {plan.objects} objects, {plan.bytes / 1e6:.1f} MB, {len(plan.region_errors)} region errors")
    if dry_run:
        result = GcResult(plan.table_uri, kept=plan.kept, region_errors=dict(plan.region_errors), dry_run=True,
                          leak_scan=dict(plan.leak_scan))
    else:
        result = execute_gc(loc, plan)
        if plan.lifecycle is not None:  # regions classified for the first time: not again next pass
            lifecycle.save(loc, plan.lifecycle, verdicts_only=True)
    if base is not None and "error" not in base:  # as the plan read them, right after the cleanup
        base["versions_after"] = len(plan.retained_versions)
        base["versions_before"] = base["versions_after"] + base["old_versions"]
    result.base_cleanup = base
    result.plan = plan
    result.retained_versions = len(plan.retained_versions)
    result.plan_seconds = plan_s
    result.holds = plan.holds
    result.stale_discarded = discarded
    return result


def _record_stale(loc: TableLocation) -> bool:
    """Record stale-region verdicts before the base-version cleanup: the versions around the
    MemWAL initialization are its only evidence, and once cleaned up an unrecorded
    initialization is unknown (nothing would be judged stale). Nothing to record on a table
    without stale regions (then an unknown initialization judges nothing wrongly). False: the
    verdicts could not be established or recorded, so the cleanup waits for the next run."""
    try:
        lc, _ = lifecycle.assess_table(loc)
        if lc.stale:
            lifecycle.save(loc, lc, strict=True)
        return True
    except Exception as e:  # noqa: BLE001 - the cleanup must not erase the only evidence
        log.warning("base-version cleanup skipped: the stale-region verdicts could not be recorded first: %s",
                    one_line(e))
        return False


def _discard_expired(loc: TableLocation, config: GcOptions, dry_run: bool) -> dict[str, int]:
    """Discard the stale regions reported for longer than `discard_stale_after_seconds`
    (region -> generations discarded through; a dry run says which it would)."""
    if config.discard_stale_after_seconds is None:
        return {}
    try:
        out = lifecycle.discard(loc, None, dry_run=dry_run, by="grace",
                                only_older_than=config.discard_stale_after_seconds)
    except Exception as e:  # noqa: BLE001 - GC proceeds; the stale regions stay held
        log.warning("discarding expired stale regions failed: %s", one_line(e))
        return {}
    return out.discarded


__all__ = ["GcOptions", "GcItem", "GcPlan", "GcResult", "RegionGcPlan", "GcError", "plan_gc", "execute_gc",
           "run_gc", "cleanup_base_versions", "plan_base_cleanup", "BaseCleanupPlan", "GcHold", "summarize_holds", "CRASH_AFTER_MANIFEST_COMMIT"]
