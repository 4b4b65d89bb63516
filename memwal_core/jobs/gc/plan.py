"""Planning (`plan_gc`): what GC would delete, and why, from committed state only; reads only.

Every region is planned in parallel (`_plan_region`): its manifest is validated first (a corrupt
one deletes nothing and is reported; `listed.py`), a stale region keeps everything, then come its
generations (`_plan_generations`, the holds on the others), WAL entries (`wal.py`), old manifest
versions (`manifests.py`) and orphan directories (`_plan_orphans`, when a full scan is due). The
table's leaked files (`leaks.py`) come last, when the plan covers every region and a full scan is
due (`GcOptions.full_scan_interval_seconds`: between, the retained versions are probed,
`history.py`, and the leak scan and the orphan sweeps skipped)."""

from __future__ import annotations

import bisect
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.jobs.gc import leak_refs, leaks, listed as listing, region_cache
from memwal_core.jobs.gc.base_cleanup import BaseCleanupPlan
from memwal_core.jobs.gc.history import VersionHistory, due
from memwal_core.jobs.gc.holds import Bound, GcHold, Hold, KeepReason, readable, summarize_holds
from memwal_core.jobs.gc.items import GENERATION, KINDS, LEAKED, LEAKS_KEY, ORPHAN, GcError, GcItem
from memwal_core.jobs.gc.listing import list_dir
from memwal_core.jobs.gc.manifests import plan_manifests
from memwal_core.jobs.gc.retention import Retention, read_retention
from memwal_core.jobs.gc.wal import plan_wal
from memwal_core.options import GcOptions
from memwal_core.state import commit_markers, layout, lifecycle, region, region_values, table
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.gc")


@dataclass
class RegionGcPlan:
    """One region's part of a plan: what to delete (`items`, and `trim`: the generations the
    committed manifest stops listing), what is kept and why (`kept`, `holds`), and the manifest
    facts execution checks against."""

    region_id: str
    manifest_version: int = 0
    writer_epoch: int = 0
    current_generation: int = 0
    replay_after: int = 0
    wal_tail: int = 0
    limit: int = 0  # generations <= limit are collectable
    items: list[GcItem] = field(default_factory=list)
    kept: collections.Counter[KeepReason] = field(default_factory=collections.Counter)
    trim: list[tuple[int, str]] = field(default_factory=list)  # (generation, path) to unlist
    hint: int | None = None  # version_hint.json as read
    lowest_kept_version: int = 0
    leftover_scan: bool = False  # a marker said an earlier delete may have left survivors
    failure: RegionFailure | None = None  # the region cannot be planned: nothing is collected in it
    holds: list[Hold] = field(default_factory=list)  # its generations kept above a bound, per bound
    # What the next pass may take as known of its WAL and manifest versions (`region_cache.py`),
    # as it will be after this plan's deletes; written by execution.
    cache: region_cache.RegionCache | None = None
    cache_changed: bool = False
    orphans_swept: bool = False  # the orphan sweep ran (else it was not due: `_sweep_due`)
    orphans_before: float | None = None  # when the sweep before it ran (kept until its deletes went)

    @property
    def error(self) -> str | None:
        return self.failure.reason if self.failure is not None else None

    def by_kind(self, kind: str) -> list[GcItem]:
        return [i for i in self.items if i.kind == kind]


@dataclass
class GcPlan:
    """What one GC pass would delete, over the table, from the committed state it read."""

    table_uri: str
    table_version: int
    config: GcOptions
    planned_at: float
    retained_versions: Sequence[int]  # counted without reading the sealed ones (`fact_segments.VersionList`)
    gating_indexes: list[str]
    regions: dict[str, RegionGcPlan]
    # Regions skipped (nothing collected in them), and a failed leak scan under `LEAKS_KEY`.
    failures: list[RegionFailure] = field(default_factory=list)
    # Planned with these base versions taken as removed (a dry run's cleanup); None: as they are.
    base_cleanup: BaseCleanupPlan | None = None
    leaked: list[GcItem] = field(default_factory=list)  # base-table files of lost commits
    leak_scan: dict[str, Any] = field(default_factory=dict)  # its cost and what it kept (readable keys)
    leak_kept: collections.Counter[KeepReason] = field(default_factory=collections.Counter)
    lifecycle: lifecycle.Lifecycle | None = None  # stale-region verdicts the plan used
    history: VersionHistory | None = None  # how the retained versions were learned (`history.py`)
    leak_refs: leak_refs.RefsSummary | None = None  # what they reference, when learned anew (`leak_refs.py`)
    # When this plan's leak scan ran (None: skipped or failed); execution records it in the
    # version summary once the scan's deletes and its reference summary are done.
    leaks_scanned_at: float | None = None

    @property
    def region_errors(self) -> dict[str, str]:
        """Region id (or `LEAKS_KEY`) -> why it is skipped, as the failures say it."""
        return {f.region_id: f.reason for f in self.failures}

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
    def kept(self) -> dict[KeepReason, int]:
        total: collections.Counter[KeepReason] = collections.Counter()
        for r in self.regions.values():
            total.update(r.kept)
        total.update(self.leak_kept)
        return dict(sorted(total.items()))

    def counts(self) -> dict[str, int]:
        c = collections.Counter(i.kind for i in self.items)
        return {k: c.get(k, 0) for k in KINDS}

    @property
    def holds(self) -> list[GcHold]:
        return summarize_holds(h for r in self.regions.values() for h in r.holds)

    def to_dict(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        return {
            "table": self.table_uri, "table_version": self.table_version, "config": cfg,
            "retained_versions": len(self.retained_versions), "gating_indexes": self.gating_indexes,
            "items": [i.to_dict() for i in self.items], "counts": self.counts(),
            "objects": self.objects, "bytes": self.bytes, "kept": readable(self.kept),
            "limits": {rid: r.limit for rid, r in sorted(self.regions.items()) if not r.error},
            "region_errors": self.region_errors, "failures": [f.to_dict() for f in self.failures],
            "holds": [asdict(h) | {"text": h.describe()} for h in self.holds],
            "base_cleanup": self.base_cleanup.to_dict() if self.base_cleanup is not None else None,
            "leak_scan": dict(self.leak_scan),
            "version_history": self.history.to_dict() if self.history is not None else None,
        }


@dataclass
class _Context:
    loc: TableLocation
    config: GcOptions
    now: float
    merged: dict[str, int]
    catchup: dict[str, dict[str, int]]
    gating: list[str]
    retention: Retention
    pending: set[str] = field(default_factory=set)  # regions with a GC intent marker
    # Sharded regions whose routing value neither an inline snapshot nor the durable record holds:
    # their merged generations are the merger's only authority for it (see `unrecorded_regions`).
    unrecorded: set[str] = field(default_factory=set)
    spec_ids: list[int] = field(default_factory=list)  # region specs of the MemWAL index
    stale: lifecycle.Lifecycle | None = None  # regions with data from before the MemWAL initialization
    # Per region, the generation below the first one of a merge commit not verified yet; None:
    # the markers could not be read, so every region is held that way (at 0).
    unverified: dict[str, int] | None = field(default_factory=dict)
    use_cache: bool = True  # what earlier passes learned of the regions (`region_cache.py`)
    sweep_interval: float = 0.0  # a region's orphan sweep runs once per this (0: every pass)


def _stale_limit(ctx: _Context, rid: str) -> int:
    """The highest collectable *stale* generation of a discarded region: merge progress (the
    discard) and what versions from before the initialization still read. This lifetime's
    versions, gating indexes and region values never depended on them (they were never merged)."""
    init = ctx.stale.init.table_version if ctx.stale and ctx.stale.init else 0
    merged, older = ctx.merged.get(rid, 0), ctx.retention.lowest_before(rid, init)
    return merged if older is None else min(merged, older)


def _bounds(ctx: _Context, rid: str) -> list[Bound]:
    """The bounds the highest collectable generation is the minimum of: merge progress, every
    gating index's catch-up (absent: 0), the retained versions' lowest merge progress."""
    bounds = [Bound(KeepReason.GENERATION_NOT_MERGED, ctx.merged.get(rid, 0))]
    for name in ctx.gating:
        bounds.append(Bound(KeepReason.GENERATION_INDEX_BEHIND, ctx.catchup.get(name, {}).get(rid, 0), index=name))
    time_travel = ctx.retention.bound(rid)
    if time_travel is not None:
        bounds.append(time_travel)
    if ctx.unverified is None or rid in ctx.unverified:
        bounds.append(Bound(KeepReason.GENERATION_UNVERIFIED, 0 if ctx.unverified is None else ctx.unverified[rid]))
    return bounds


def _unverified(loc: TableLocation) -> dict[str, int] | None:
    """`commit_markers.held_from` of the table's markers; None (hold every region) if they cannot
    be read."""
    try:
        return commit_markers.held_from(commit_markers.load(loc))
    except Exception as e:  # noqa: BLE001 - which generations a commit needs is unknown: keep them all
        log.error("the markers of unverified merge commits (%s) could not be read (%s): every region's "
                  "generations are kept this pass", layout.UNVERIFIED_DIR, one_line(e))
        return None


def unrecorded_regions(loc: TableLocation, state: table.MemWalState, manifests: dict[str, region.RegionManifest],
                       init: lifecycle.Initialization | None = None) -> set[str]:
    """Sharded regions whose routing value neither an inline MemWAL index snapshot nor the
    durable record of the lifetime of `init` holds as trusted (derived from merged rows, or the
    region manifest's).

    The merger checks every pending generation against the region's value, taken from the
    snapshot or else from the region's merged generations. Trimming those before a snapshot
    recorded the value would leave it nothing to check against but the pending rows themselves,
    so a generation whose rows all belong to another region would be accepted (found by the
    harness soak: a misrouted generation merged after GC). These regions keep their merged
    generations until the next index build records the value. An unreadable snapshot or record
    counts as recording nothing."""
    return region_values.unrecorded_regions(loc, state, manifests, init)


def _failure(rid: str, reason: str, *, permanent: bool) -> RegionFailure:
    return RegionFailure(rid, None, reason, permanent, step="gc")


def _corrupt(m: region.RegionManifest, why: str) -> RegionFailure:
    """The region's manifest is wrong (a repair is needed): nothing is collected there."""
    return _failure(m.region_id, f"region {m.region_id}: corrupt manifest version {m.version}: {why}; "
                    "nothing collected here", permanent=True)


def _plan_region(ctx: _Context, rid: str, m: region.RegionManifest) -> RegionGcPlan:
    """One region's plan, by the rules of the package docstring in their order."""
    rp = RegionGcPlan(rid, m.version, m.writer_epoch, m.current_generation,
                      m.message.replay_after_wal_entry_position, leftover_scan=rid in ctx.pending)
    # What earlier passes learned of its WAL entries, manifest versions and generation list (not
    # while a delete may have failed part-way: then the region is read in full, below its holes too).
    cache = region_cache.Checked(ctx.loc.store, None if rp.leftover_scan or not ctx.use_cache
                                 else region_cache.load(ctx.loc.store, rid))
    # Validate every listed path before anything else: a corrupt manifest deletes nothing.
    try:
        listed = listing.listed(m, cache.gens())
    except layout.UnsafePath as e:
        rp.failure = _corrupt(m, str(e).removeprefix(f"region {rid}: "))  # layout names the region already
        return rp
    verdict = ctx.stale.verdict(rid) if ctx.stale else None
    if ctx.stale and rid in ctx.stale.errors:
        rp.failure = _failure(rid, f"{ctx.stale.errors[rid]}; nothing collected here", permanent=False)
        return rp
    if verdict is not None and ctx.stale.blocks(rid, ctx.merged.get(rid, 0)):
        # Stale and not discarded: the merger refuses it; its files are the evidence of the verdict.
        _hold_stale(rp, [g for g, _ in listed.each()])
        return rp
    try:  # what the merger refuses, GC leaves alone: progress says nothing true about it
        region.check_spec(m, ctx.spec_ids)
        if not _mergeable_run(m, listed.run, ctx.merged.get(rid, 0)):
            region.pending_generations(m, ctx.merged.get(rid, 0))
    except region.CorruptManifest as e:
        rp.failure = _corrupt(m, e.detail)
        return rp
    bounds = _bounds(ctx, rid)
    rp.limit = min(b.generation for b in bounds)

    # 1. generations
    _plan_generations(ctx, rp, m, listed, bounds, verdict)
    kept_listed = _kept_listed(listed, rp.trim)

    # 2. WAL entries
    wal_plan = plan_wal(ctx.loc, m, rp.limit, kept_listed, keep_current_epoch=ctx.config.keep_current_epoch_wal,
                        leftover_scan=rp.leftover_scan, cache=cache)
    rp.wal_tail = wal_plan.tail
    rp.items += wal_plan.items
    rp.kept.update(wal_plan.kept)

    # 3. old manifest versions
    manifest_plan = plan_manifests(ctx.loc, m, ctx.config, ctx.now, leftover_scan=rp.leftover_scan, cache=cache)
    rp.hint, rp.lowest_kept_version = manifest_plan.hint, manifest_plan.lowest_kept_version
    rp.items += manifest_plan.items
    rp.kept.update(manifest_plan.kept)
    # 4. orphan directories
    rp.orphans_swept, rp.orphans_before = _sweep_due(ctx, cache), cache.orphans_at()
    if rp.orphans_swept:
        _plan_orphans(ctx, rp, m, listed.names())

    rp.cache = region_cache.after_pass(cache, rid, wal_plan.metas, {i.number for i in wal_plan.items},
                                       manifest_plan.kept_low, {i.number for i in manifest_plan.items},
                                       wal_plan.settled, listed.chunks,
                                       ctx.now if rp.orphans_swept else cache.orphans_at(), wal_plan.epoch_run)
    rp.cache_changed = rp.cache != cache.cache
    return rp


def _mergeable_run(m: region.RegionManifest, run: range | None, merged: int) -> bool:
    """Whether consecutive generations `run` pass `region.pending_generations` (no number
    twice, those above `merged` from `merged + 1` on, below `current_generation`, progress below
    it), told from the run's ends; False: let it check them one by one (and say why)."""
    if run is None:
        return False
    if merged and merged >= m.current_generation:
        return False
    return not run or run[-1] <= merged or (run[0] <= merged + 1 and run[-1] < m.current_generation)


def _kept_listed(listed: listing.Listed, trim: list[tuple[int, str]]) -> Sequence[int]:
    """The listed generations not trimmed (a trim is a prefix of a run: the rest stays a range)."""
    run = listed.run
    if run is not None and [g for g, _ in trim] == list(run[:len(trim)]):
        return run[len(trim):]
    return set(listed.numbers) - {g for g, _ in trim}


def _sweep_due(ctx: _Context, cache: region_cache.Checked) -> bool:
    """Whether the region's orphan sweep runs this pass: once per `sweep_interval` (`due`)."""
    return due(cache.orphans_at(), ctx.now, ctx.sweep_interval)


def _hold_stale(rp: RegionGcPlan, generations: list[region.Generation]) -> None:
    """A stale region keeps every generation (one hold)."""
    rp.kept[KeepReason.REGION_STALE] += 1
    hold = Hold(rp.region_id, Bound(KeepReason.GENERATION_STALE, 0))
    for g in generations:
        rp.kept[KeepReason.GENERATION_STALE] += 1
        hold.add(g.generation, int(g.in_memory_bytes or 0))
    rp.holds = [hold] if hold.generations else []


def _plan_generations(ctx: _Context, rp: RegionGcPlan, m: region.RegionManifest,
                      listed: listing.Listed, bounds: list[Bound],
                      verdict: lifecycle.RegionVerdict | None) -> None:
    """The generations to delete (and unlist: `rp.trim`), and a hold per bound on the others.
    A generation above a bound is held by the first one it exceeds. Generations only are bound
    by an unrecorded region value: WAL entries and manifest versions do not carry it."""
    rid = rp.region_id
    gen_bounds = bounds + ([Bound(KeepReason.GENERATION_VALUE_UNRECORDED, 0)] if rid in ctx.unrecorded else [])
    gen_limit = min(b.generation for b in gen_bounds)
    stale_limit = _stale_limit(ctx, rid) if verdict is not None else 0
    holds: dict[Bound, Hold] = {}
    if m.sealed or verdict is not None:
        _classify_each(ctx, rp, m, listed.each(), gen_bounds, gen_limit, verdict, stale_limit, holds)
    else:
        _classify_runs(ctx, rp, m, listed, gen_bounds, gen_limit, holds)
    for h in holds.values():  # the highest generation a retained version reads decides until when
        if h.reason is KeepReason.GENERATION_TIME_TRAVEL:
            h.until = ctx.retention.held_until(rid, h.highest, ctx.config.base_cleanup_older_than)
    rp.holds = list(holds.values())


def _classify_each(ctx: _Context, rp: RegionGcPlan, m: region.RegionManifest,
                   listed: list[tuple[region.Generation, str]], gen_bounds: list[Bound], gen_limit: int,
                   verdict: lifecycle.RegionVerdict | None, stale_limit: int, holds: dict[Bound, Hold]) -> None:
    """`_plan_generations` one generation at a time (a sealed region, or one with a verdict)."""
    for g, gdir in listed:
        if m.sealed:  # no manifest version may be written on a sealed region, so no trim either
            rp.kept[KeepReason.GENERATION_SEALED] += 1
            continue
        if verdict is not None and verdict.is_stale(g.generation) and g.generation <= stale_limit:
            why = f"generation {g.generation} predates the MemWAL initialization, discarded"
        elif g.generation <= gen_limit and g.generation < m.current_generation:
            why = f"generation {g.generation} <= merged and caught-up limit {gen_limit}"
        else:
            bound = _holding(gen_bounds, g.generation, m)
            rp.kept[bound.reason] += 1
            holds.setdefault(bound, Hold(rp.region_id, bound)).add(g.generation, int(g.in_memory_bytes or 0))
            continue
        _collect(ctx, rp, g, gdir, why)


def _holding(gen_bounds: list[Bound], generation: int, m: region.RegionManifest) -> Bound:
    """The bound holding a generation: the first one it exceeds (else: not flushed yet)."""
    return next((b for b in gen_bounds if generation > b.generation),
                Bound(KeepReason.GENERATION_NOT_FLUSHED, m.current_generation - 1))


def _collect(ctx: _Context, rp: RegionGcPlan, g: region.Generation, gdir: str, why: str) -> None:
    objs = list_dir(ctx.loc, gdir, layout.region_dir(rp.region_id))
    rp.items.append(GcItem(GENERATION, rp.region_id, gdir, sum(o.size for o in objs), why,
                           tuple(o.key for o in objs), g.generation))
    rp.trim.append((g.generation, g.path))


def _classify_runs(ctx: _Context, rp: RegionGcPlan, m: region.RegionManifest,
                   listed: listing.Listed, gen_bounds: list[Bound], gen_limit: int,
                   holds: dict[Bound, Hold]) -> None:
    """`_plan_generations` by runs (the generations are in ascending order): the collectable ones
    are a prefix, and the bound holding a generation changes only where it crosses a bound, so
    the held ones are counted a run between two bounds at a time (a region whose retained
    versions hold every generation lists them all, on every pass: `listed` sums their sizes by
    chunk)."""
    gens = listed.numbers
    if listed.run is None and any(a >= b for a, b in zip(gens, gens[1:])):  # not strictly ascending
        _classify_each(ctx, rp, m, listed.each(), gen_bounds, gen_limit, None, 0, holds)
        return
    collectable = bisect.bisect_right(gens, min(gen_limit, m.current_generation - 1))
    for g, gdir in listed.take(0, collectable):
        _collect(ctx, rp, g, gdir, f"generation {g.generation} <= merged and caught-up limit {gen_limit}")
    cuts = sorted({b.generation for b in gen_bounds} | {m.current_generation - 1})
    i = collectable
    while i < len(gens):
        # The run of generations up to the next bound at or above this one: one holding bound.
        j = bisect.bisect_right(gens, next((c for c in cuts if c >= gens[i]), gens[-1]))
        j = max(j, i + 1)
        bound = _holding(gen_bounds, gens[i], m)
        hold = holds.setdefault(bound, Hold(rp.region_id, bound))
        hold.generations += j - i
        hold.bytes += listed.mem(i, j)
        hold.highest = max(hold.highest, gens[j - 1])
        rp.kept[bound.reason] += j - i
        i = j


def _plan_orphans(ctx: _Context, rp: RegionGcPlan, m: region.RegionManifest, listed_names: set[str]) -> None:
    """`*_gen_*` directories the manifest does not list, below its `current_generation` (a
    flush in progress writes its directory before the manifest), whose newest object is older
    than `orphan_grace_seconds`."""
    rid = rp.region_id
    rdir = layout.region_dir(rid)
    for name in ctx.loc.store.list_dirs(rdir):
        if name in listed_names:  # first: a region holding its history lists every one
            continue
        gen = layout.generation_of_dir(name)
        if gen is None:
            continue
        if "/" in name or name in (".", ".."):
            continue
        odir = f"{rdir}/{name}"
        if not layout.is_inside(odir + "/x", rdir):
            continue
        if gen >= m.current_generation:
            rp.kept[KeepReason.ORPHAN_FLUSH_IN_PROGRESS] += 1
            continue
        objs = list_dir(ctx.loc, odir, rdir)
        if not objs:
            rp.kept[KeepReason.ORPHAN_EMPTY] += 1
            continue
        age = ctx.now - max(o.mtime for o in objs)
        if age < ctx.config.orphan_grace_seconds:
            rp.kept[KeepReason.ORPHAN_YOUNG] += 1
            continue
        rp.items.append(GcItem(ORPHAN, rid, odir, sum(o.size for o in objs),
                               f"unlisted generation {gen} directory, newest object {age:.0f}s old",
                               tuple(o.key for o in objs), gen))


def _pending(loc: TableLocation) -> set[str]:
    """Regions whose last WAL/manifest delete did not finish (one listing for the table)."""
    out = set()
    for o in loc.store.list(layout.GC_PENDING_DIR):
        name = o.key.rsplit("/", 1)[-1]
        if layout.is_region_id(name) and o.key == layout.gc_pending_key(name):
            out.add(name)
    return out


def plan_gc(loc: TableLocation, config: GcOptions | None = None, *, regions: list[str] | None = None,
            now: float | None = None, base_cleanup: BaseCleanupPlan | None = None,
            use_summary: bool = True, history: VersionHistory | None = None, full_scan: bool = False,
            view: lifecycle.TableAssessment | None = None) -> GcPlan:
    """What GC would delete, and why; reads only. `base_cleanup`: plan as if its base-table
    versions were removed already (what the real run's cleanup does before it plans).
    `use_summary=False`: read every retained version's manifest and every region in full,
    ignoring what earlier passes learned (`history.py`, `region_cache.py`); `history`: what this
    pass learned of the versions already (checked again). `full_scan`: list `_versions/` and scan
    for leaked files whether or not `full_scan_interval_seconds` passed since the last time.
    `view`: the table as this pass read it already (`run_gc`); None: read here."""
    config = config or GcOptions()
    now = time.time() if now is None else now
    # The table state, then the manifests (`TableAssessment`): merge progress only grows, so a
    # merge landing in between can only make the limits computed below conservative.
    view = view or lifecycle.assess_table(loc, max_workers=config.max_workers)
    ds, state = view.dataset, view.state
    from memwal_core.jobs.catchup import base_indexes  # local import: catchup imports lance at module level too

    gating = state.gating_indexes(list(base_indexes(ds)))
    gone = frozenset(base_cleanup.versions) if base_cleanup is not None else frozenset()
    if ds.version in gone:  # Lance never removes the latest version; a plan saying so is wrong
        raise GcError(f"base cleanup plan removes the latest table version {ds.version}")
    interval = 0.0 if full_scan or not use_summary else config.full_scan_interval_seconds
    scan_leaks = config.collect_leaked_files and regions is None
    retention = read_retention(loc, gone, use_summary=use_summary, earlier=history, max_workers=config.max_workers,
                               interval=interval, now=now, latest=ds.version, for_leaks=scan_leaks)
    loaded = view.reads if regions is None else _some(loc, view.reads, regions, config.max_workers)
    ctx = _Context(loc, config, now, state.merged, state.catchup, gating, retention, _pending(loc),
                   unrecorded_regions(loc, state, loaded.manifests, view.lifecycle.init),
                   [s.spec_id for s in state.details.region_specs], view.lifecycle,
                   _unverified(loc), use_cache=use_summary and not _recreated(retention.history),
                   sweep_interval=interval)
    plans = _plan_regions(ctx, loaded)
    failures = [rp.failure for rp in plans.values() if rp.failure is not None]
    plan = GcPlan(loc.lance_uri, ds.version, config, now, retention.versions, gating, plans, failures, base_cleanup,
                  lifecycle=ctx.stale, history=retention.history)
    if scan_leaks:
        _plan_leaks(loc, plan, now, use_summary and not _recreated(retention.history), interval)
    return plan


def _some(loc: TableLocation, reads: region.RegionReads, ids: list[str], max_workers: int) -> region.RegionReads:
    """The reads of `ids` (a plan of some regions); one not among the table's listed regions is
    read now (and fails as a missing region does)."""
    out = region.RegionReads({rid: reads[rid] for rid in ids if rid in reads})
    if missing := [rid for rid in ids if rid not in reads]:
        out.update(region.load_many(loc.store, missing, max_workers=max_workers))
    return out


def _recreated(history: VersionHistory | None) -> bool:
    """The version summary described another table at this URI: no cache of it is trusted."""
    return history is not None and history.recreated


def _plan_regions(ctx: _Context, loaded: region.RegionReads) -> dict[str, RegionGcPlan]:
    """Every region's plan, in parallel; a region that cannot be read or planned is skipped
    (its failure says why, nothing is collected in it) and the others proceed."""

    def one(rid: str) -> RegionGcPlan:
        got = loaded[rid]
        if not got.ok:
            return RegionGcPlan(rid, failure=_failure(rid, f"{got.message}; region skipped", permanent=got.permanent))
        m = got.manifest
        try:
            return _plan_region(ctx, rid, m)
        except Exception as e:  # noqa: BLE001 - one broken region must not stop the others
            return RegionGcPlan(rid, m.version, failure=_failure(
                rid, f"region {rid}: {type(e).__name__}: {e}; region skipped", permanent=False))

    plans: dict[str, RegionGcPlan] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(ctx.config.max_workers, len(loaded) or 1))) as pool:
        for rp in pool.map(one, sorted(loaded)):
            plans[rp.region_id] = rp
            if rp.failure is not None:
                rp.items.clear()
                rp.trim.clear()
                log.error("%s", rp.error)
    return plans


def _plan_leaks(loc: TableLocation, plan: GcPlan, now: float, use_summary: bool, interval: float) -> None:
    """The leak scan, when it is due (`leaks.py`: once per `interval`; the time of the last one
    that completed is in the version summary, recorded by execution after the scan's deletes)."""
    h = plan.history
    if h is not None and not due(h.leaks_at, now, interval):
        plan.leak_scan = {"skipped": True, "last_scan_seconds_ago": round(now - h.leaks_at, 1),
                          "next_scan_in_seconds": round(h.leaks_at + interval - now, 1)}
        return
    listing = h.listing if h is not None and plan.base_cleanup is None else None
    scan = leaks.plan_leaks(loc, now, plan.config.leaked_grace, use_summary=use_summary, versions_listing=listing)
    if not scan.error:
        plan.leaks_scanned_at = now
    plan.leak_refs = scan.refs
    plan.leak_scan = {"versions_read": scan.versions, "manifests_read": scan.manifests_read,
                      "files_listed": scan.files_listed,
                      "list_seconds": round(scan.list_seconds, 3), "refs_seconds": round(scan.refs_seconds, 3),
                      "kept": readable(scan.kept)}
    plan.leak_kept = collections.Counter(scan.kept)
    if scan.error:
        plan.failures.append(_failure(LEAKS_KEY, scan.error, permanent=False))
        log.error("%s", scan.error)
        return
    for lk in scan.leaks:
        plan.leaked.append(GcItem(LEAKED, "", lk.key, lk.bytes,
                                  f"{lk.what} no retained version references ({scan.versions} manifests read), "
                                  f"{lk.age:.0f}s old", lk.keys))
