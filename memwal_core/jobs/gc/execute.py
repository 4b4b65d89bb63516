"""Execution (`execute_gc`): delete exactly what a plan lists, region by region in parallel.

Per region: commit the trimmed manifest (`region.commit_next`: a lost race reloads and re-applies
the trim to the fresh manifest; `writer_epoch` never changes), then delete generation directories
and WAL entries (lowest position first), fix the version hint, delete old manifest versions
(oldest first), re-read the latest manifest and delete the orphans still unlisted. A crash after
the commit leaves unlisted directories: the next run's orphan sweep takes them once they are older
than the grace period. The table's leaked files go after every region. Every key is checked
against its kind before it is deleted (`_check_item`), and every delete is fenced by the lease."""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from memwal_core import faults
from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.jobs.gc import history, leak_refs, leaks, region_cache
from memwal_core.jobs.gc.items import GENERATION, LEAKED, LEAKS_KEY, MANIFEST, ORPHAN, WAL, GcError, GcItem
from memwal_core.jobs.gc.plan import GcPlan, RegionGcPlan
from memwal_core.jobs.gc.result import GcResult
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, lease, region
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.gc")

CRASH_AFTER_MANIFEST_COMMIT = "gc.after_manifest_commit"


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
    failure: RegionFailure | None = None


def _delete(loc: TableLocation, items: list[GcItem], out: _RegionOutcome) -> None:
    keys = [k for i in items for k in i.keys]
    for i in items:
        _check_item(i)
    if keys:
        lease.fence(loc, "GC delete")
    for start in range(0, len(keys), 1000):
        out.objects += loc.store.delete_many(keys[start:start + 1000])
    out.deleted.extend(items)



def _commit_trim(loc: TableLocation, rp: RegionGcPlan, out: _RegionOutcome) -> None:
    """A manifest version that no longer lists the generations about to be deleted."""
    if not rp.trim:
        return
    current = region.load_latest(loc.store, rp.region_id)
    committed = region.commit_next(loc.store, current, _trim_mutation(rp.trim))
    if committed is not None:
        out.commits += 1
        log.info("region %s: manifest version %d drops generations %s", rp.region_id, committed.version,
                 [g for g, _ in rp.trim])
    faults.point(CRASH_AFTER_MANIFEST_COMMIT)


def _delete_listed(loc: TableLocation, rp: RegionGcPlan, out: _RegionOutcome) -> None:
    """Generation directories, WAL entries (lowest position first), old manifest versions
    (oldest first, after the version hint points at a version that stays).

    WAL entries and manifest versions are found by walking positions down to the first missing
    one. A delete that fails part-way (S3 DeleteObjects answers per key; a crash) can leave
    survivors below such a hole: the intent marker, written before and removed once everything
    went, makes the next plan look below the holes (one listing each)."""
    store, rid = loc.store, rp.region_id
    wal_items = sorted(rp.by_kind(WAL), key=lambda i: i.number)
    manifests = rp.by_kind(MANIFEST)
    marker = layout.gc_pending_key(rid)
    if wal_items or manifests:
        store.put(marker, f"GC of region {rid} deleting WAL entries / manifest versions\n".encode())
        # The cache as it will be after the deletes: while the marker stands, nothing reads it.
        # Not the orphan sweep yet: it counts as done once its deletes went (`_execute_region`).
        if rp.cache is not None:
            early = rp.cache
            if rp.by_kind(ORPHAN):
                early = copy.copy(rp.cache)
                early.orphans_at = rp.orphans_before
            region_cache.save(store, early)
            rp.cache_changed = early is not rp.cache
    _delete(loc, rp.by_kind(GENERATION) + wal_items, out)
    if manifests:
        latest = region.probe_latest_version(store, rid, rp.manifest_version)
        hint = region.read_version_hint(store, rid)
        if hint is None or hint < rp.lowest_kept_version or hint > latest:
            region.write_version_hint(store, rid, latest)
        _delete(loc, manifests, out)
    if wal_items or manifests or rp.leftover_scan:
        store.delete_many([marker])


def _delete_orphans(loc: TableLocation, rp: RegionGcPlan, out: _RegionOutcome) -> None:
    """The planned orphans still unlisted: the latest manifest is read again after the listing,
    and a directory listed (or being flushed) since the plan is not an orphan any more."""
    orphans = rp.by_kind(ORPHAN)
    if not orphans:
        return
    fresh = region.load_latest(loc.store, rp.region_id)
    listed = {g.path for g in fresh.generations}
    ok, late = [], []
    for i in orphans:
        name = i.path.rsplit("/", 1)[-1]
        (late if name in listed or i.number >= fresh.current_generation else ok).append(i)
    out.skipped.extend(late)
    _delete(loc, ok, out)


def _execute_region(loc: TableLocation, rp: RegionGcPlan) -> _RegionOutcome:
    out = _RegionOutcome()
    rid = rp.region_id
    try:
        for i in rp.items:
            _check_item(i)
        _commit_trim(loc, rp, out)
        _delete_listed(loc, rp, out)
        _delete_orphans(loc, rp, out)
        if rp.cache is not None and rp.cache_changed:  # nothing of it deleted: as planned
            region_cache.save(loc.store, rp.cache)
            rp.cache_changed = False
    except Exception as e:  # noqa: BLE001 - reported per region; the others proceed
        reason = str(e) if isinstance(e, region.RegionError) else f"region {rid}: {type(e).__name__}: {e}"
        permanent = isinstance(e, (layout.UnsafePath, region.CorruptManifest))  # only a repair helps
        out.failure = RegionFailure(rid, None, reason, permanent, step="gc")
        log.error("GC of %s", reason)
    return out


def _delete_leaked(loc: TableLocation, leaked: list[GcItem], result: GcResult) -> bool:
    """The table's leaked files, after the regions' work; False when deleting failed (reported
    under `LEAKS_KEY`)."""
    out = _RegionOutcome()
    ok = True
    try:
        _delete(loc, leaked, out)
    except Exception as e:  # noqa: BLE001 - reported; the regions' results stand
        result.failures.append(RegionFailure(LEAKS_KEY, None, f"deleting leaked files: {one_line(e)}", False,
                                             step="gc"))
        log.error("GC: %s", result.region_errors[LEAKS_KEY])
        ok = False
    result.deleted.extend(out.deleted)
    result.deleted_objects += out.objects
    result.leaked_objects = sum(len(i.keys) for i in out.deleted)
    result.leaked_bytes = sum(i.bytes for i in out.deleted)
    return ok


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
    result = GcResult(plan.table_uri, kept=plan.kept, failures=list(plan.failures))
    todo = [rp for rp in plan.regions.values()
            if not rp.error and (rp.items or rp.trim or rp.leftover_scan or rp.cache_changed)]
    workers = max(1, min(plan.config.max_workers, len(todo) or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for out in pool.map(lambda r: _execute_region(loc, r), todo):
            result.deleted.extend(out.deleted)
            result.skipped.extend(out.skipped)
            result.deleted_objects += out.objects
            result.manifest_commits += out.commits
            if out.failure is not None:
                result.failures.append(out.failure)
    result.leak_scan = dict(plan.leak_scan)
    leaks_deleted = _delete_leaked(loc, plan.leaked, result) if plan.leaked else True
    if plan.leak_refs is not None:  # what the retained versions reference: not read again next pass
        leak_refs.save(loc, plan.leak_refs)
    if plan.history is not None:  # the base-table versions read this pass, and when the leak scan
        # last completed: recorded only after its deletes and its reference summary, so a pass
        # cut short (or whose leak deletes failed) is followed by a pass that scans again
        h = plan.history
        if plan.leaks_scanned_at is not None and leaks_deleted:
            h.leaks_at, h.changed = plan.leaks_scanned_at, True
        history.save_summary(loc, h)
    result.bytes_reclaimed = sum(i.bytes for i in result.deleted)
    result.execute_seconds = time.monotonic() - t0
    return result
