"""From each service's plan and result to a `StepOutcome`: the one place that reads them.

Each function is `(plan, result) -> StepOutcome` for one step, a dry run when `result` is None
(or a dry-run result). Region failures come from the results themselves (`RegionFailure`s with
their permanence); the metric names and summaries are those the Dagster assets show, so renaming
one is a change here, never in the CLI.
"""

from __future__ import annotations

import time
from typing import Any

from memwal_core.failures import RegionFailure
from memwal_core.jobs import catchup, compaction, gc, merge, snapshot
from memwal_core.jobs.gc import history
from memwal_core.steps.outcome import StepOutcome, StepStatus
from memwal_core.units import size


def _fields(values: dict[str, Any], names: tuple[str, ...]) -> str:
    """`generations merged 8, bytes reclaimed 4.1 KiB` for the named values that are present."""
    return ", ".join(f"{n.replace('_', ' ')} {size(values[n]) if 'bytes' in n else values[n]}"
                     for n in names if n in values)


# ---------------------------------------------------------------------------------------- merge


def merged_after(plan: merge.MergePlan, result: merge.MergeResult | None, region_id: str) -> int:
    """A region's merged generation after the run (as planned when the run merged nothing there)."""
    r = result.regions.get(region_id) if result else None
    return max(plan.merged.get(region_id, 0), r.merged_generation if r else 0)


def pending_after(plan: merge.MergePlan, result: merge.MergeResult | None) -> dict[str, list[int]]:
    """The planned generations each region still has after the run."""
    return {rid: [g for g in gens if g > merged_after(plan, result, rid)] for rid, gens in plan.pending.items()}


def merge_failures(plan: merge.MergePlan, result: merge.MergeResult | None) -> list[RegionFailure]:
    """Regions the run left unmerged at their wall (a dry run: those the plan already stops)."""
    return plan.failures if result is None else result.failures


def merge_outcome(plan: merge.MergePlan, result: merge.MergeResult | None) -> StepOutcome:
    failures = merge_failures(plan, result)
    if result is None:
        metrics = {"regions_planned": len(plan.pending), "batches": len(plan.batches),
                   "generations_planned": sum(len(b.generations) for b in plan.batches),
                   "bytes_planned": sum(b.bytes for b in plan.batches), "regions_failed": len(failures),
                   "table_version": plan.table_version}
        summary = (f"{metrics['generations_planned']} generations in {len(plan.batches)} batches "
                   f"(table version {plan.table_version})")
        status = StepStatus.PLANNED if plan.batches else StepStatus.NOTHING_TO_DO
        return StepOutcome("merge", status, False, failures, metrics=metrics, summary=summary, plan=plan)
    metrics = {
        "regions_planned": len(set(plan.pending) | set(result.regions)),  # with generations to merge, or failed
        "regions_merged": sum(1 for r in result.regions.values() if r.generations_merged),
        "generations_merged": result.generations_merged,
        "generations_pending": sum(len(g) for g in pending_after(plan, result).values()),
        "commits": result.commits, "conflicts": result.conflicts,
        "rows_upserted": result.rows_upserted, "rows_deleted": result.rows_deleted,
        "bytes_read": result.bytes_read, "bytes_written": result.bytes_written,
        "duration_s": round(result.duration_s, 2), "regions_failed": len(failures),
        "table_version": result.table_version,
    }
    status = (StepStatus.PARTIAL if failures else StepStatus.OK if result.generations_merged or plan.batches
              else StepStatus.NOTHING_TO_DO)
    summary = _fields(metrics, ("generations_merged", "rows_upserted", "rows_deleted", "commits"))
    return StepOutcome("merge", status, True, failures, metrics=metrics, summary=summary, plan=plan, result=result)


# ----------------------------------------------------------------------------------- compaction


def compaction_metrics(plan: compaction.CompactionPlan, r: compaction.CompactionResult | None) -> dict[str, float]:
    """Health before and after, bytes, segments per index (a dry run: the plan's numbers)."""
    if r is None:
        h = plan.health
        return {"tasks": plan.tasks, "source_fragments": plan.source_fragments, "source_bytes": plan.source_bytes,
                "fragments": h.fragments, "small_fragments": h.small_fragments,
                "deleted_row_ratio": round(h.deleted_row_ratio, 4), "table_version": plan.table_version}
    before, after = r.health_before, r.health_after or r.health_before
    md: dict[str, float] = {
        "fragments": after.fragments, "small_fragments": after.small_fragments,
        "deleted_row_ratio": round(after.deleted_row_ratio, 4),
        "deletion_file_ratio": round(after.deletion_file_ratio, 4),
        "index_segments": sum(after.index_segments.values()),
        "fragments_before": before.fragments, "bytes_before": before.bytes, "bytes_after": after.bytes,
        "tasks": r.tasks, "conflicts": r.conflicts,
        "fragments_removed": r.fragments_removed, "fragments_added": r.fragments_added,
        "duration_s": round(r.duration_s, 3), "table_version": r.table_version,
    }
    for name, n in sorted(after.index_segments.items()):
        md[f"segments/{name}"] = n
    return md


def compaction_outcome(plan: compaction.CompactionPlan, r: compaction.CompactionResult | None) -> StepOutcome:
    metrics = compaction_metrics(plan, r)
    notes = [f"index {name}: not retrained: {why}" for name, why in plan.retrain_refused.items()]
    if r is None:
        status = StepStatus.NOTHING_TO_DO if plan.healthy else StepStatus.PLANNED
        return StepOutcome("compact", status, False, notes=notes, metrics=metrics, summary=plan.summary, plan=plan)
    errors = [f"index {name}: {err}" for name, err in r.errors.items()]
    if r.status.startswith("gave up"):
        notes.append(r.status)
    idle = r.status in ("healthy, skipped", "nothing to rewrite") and not r.committed
    status = StepStatus.PARTIAL if errors else StepStatus.NOTHING_TO_DO if idle else StepStatus.OK
    summary = f"status {r.status}, " + _fields(metrics, ("fragments_before", "fragments", "deleted_row_ratio",
                                                        "index_segments"))
    return StepOutcome("compact", status, True, [], errors, notes=notes, metrics=metrics, summary=summary,
                       plan=plan, result=r)


# -------------------------------------------------------------------------------------- catchup


def catchup_outcome(plan: catchup.CatchupPlan, r: catchup.CatchupResult | None) -> StepOutcome:
    if r is None:
        metrics = {"indexes": len(plan.indexes), "to_optimize": len(plan.to_optimize),
                   "max_gap": max([rc.gap for i in plan.indexes for rc in i.regions] or [0]),
                   "table_version": plan.table_version}
        status = StepStatus.PLANNED if plan.to_optimize else StepStatus.NOTHING_TO_DO
        summary = f"optimize {', '.join(plan.to_optimize) or 'nothing'}"
        return StepOutcome("catchup", status, False, metrics=metrics, summary=summary, plan=plan)
    rows = r.rows
    metrics = {"indexes": len(r.indexes), "max_gap": max([row.gap for row in rows] or [0]),
               "not_caught_up": len(r.not_caught_up),
               "unindexed_rows_after": sum(o.unindexed_rows_after or 0 for o in r.indexes),
               "table_version": r.table_version, "duration_s": round(r.duration_s, 3)}
    for o in r.indexes:
        metrics[f"gap/{o.name}"] = max([row.gap for row in rows if row.index_name == o.name] or [0])
    errors = [f"index {name}: {err}" for name, err in r.errors.items()]
    status = (StepStatus.PARTIAL if errors else StepStatus.OK if any(o.optimized for o in r.indexes)
              else StepStatus.NOTHING_TO_DO)
    return StepOutcome("catchup", status, True, [], errors, metrics=metrics,
                       summary=_fields(metrics, ("indexes", "max_gap")), plan=plan, result=r)


# ------------------------------------------------------------------------------------- snapshot


def snapshot_outcome(r: snapshot.SnapshotResult) -> StepOutcome:
    """The index builder has no separate plan: a dry run's result is what it would write."""
    failures = list(r.failures)
    metrics = {"num_regions": r.num_regions, "hints_updated": len(r.hints_updated), "regions_failed": len(failures),
               "committed": int(bool(r.committed)), "attempts": r.attempts, "duration_s": round(r.duration_s, 2),
               "table_version": r.table_version}
    summary = f"num regions {r.num_regions}, storage {r.storage}, hints updated {len(r.hints_updated)}"
    if r.dry_run:
        return StepOutcome("index", StepStatus.PLANNED, False, failures, metrics=metrics, summary=summary, plan=r)
    status = StepStatus.PARTIAL if failures else StepStatus.OK if r.committed else StepStatus.NOTHING_TO_DO
    return StepOutcome("index", status, True, failures, metrics=metrics, summary=summary, result=r)


# ------------------------------------------------------------------------------------------- gc


def gc_dry_metrics(r: gc.GcResult) -> dict[str, int]:
    """What a dry run would delete, per kind (`would_delete/<kind>/items|objects|bytes`), base
    versions of the cleanup included, and the totals."""
    plan = r.plan
    out: dict[str, int] = {"objects": plan.objects, "bytes": plan.bytes,
                           "retained_base_versions": len(plan.retained_versions),
                           "regions_failed": len(plan.region_errors)}
    for kind in gc.KINDS:
        items = [i for i in plan.items if i.kind == kind]
        out |= {f"would_delete/{kind}/items": len(items),
                f"would_delete/{kind}/objects": sum(len(i.keys) for i in items),
                f"would_delete/{kind}/bytes": sum(i.bytes for i in items)}
    base = plan.base_cleanup
    out |= {f"would_delete/{gc.BASE_VERSION}/items": len(base.versions) if base else 0,
            f"would_delete/{gc.BASE_VERSION}/objects": sum(base.files.values()) if base else 0,
            f"would_delete/{gc.BASE_VERSION}/bytes": base.bytes if base else 0}
    return out


def gc_metrics(r: gc.GcResult) -> dict[str, float]:
    md: dict[str, float] = {
        "objects_deleted": r.deleted_objects, "bytes_reclaimed": r.bytes_reclaimed,
        "generations_deleted": r.counts().get("generation", 0), "manifest_commits": r.manifest_commits,
        "regions_failed": len(r.region_errors), "duration_s": round(r.plan_seconds + r.execute_seconds, 2),
        "retained_base_versions": r.retained_versions, "leaked_objects_deleted": r.leaked_objects,
        "leaked_bytes_reclaimed": r.leaked_bytes,
    }
    for h in r.holds:  # what GC keeps, per reason
        md[f"held_bytes/{h.reason}"] = h.bytes
    return md


def gc_notes(r: gc.GcResult) -> list[str]:
    """What GC did or kept that a person should know and that is not a failure."""
    notes = []
    if r.base_cleanup and "error" in r.base_cleanup:
        what, then = ("cannot be planned", "plans") if r.dry_run else ("failed", "collected")
        notes.append(f"base table: cleanup {what} ({r.base_cleanup['error']}); "
                     f"GC {then} as if every version were retained")
    for rid, through in sorted(r.stale_discarded.items()):
        notes.append(f"region {rid}: generations through {through}, written before the MemWAL initialization, "
                     "discarded after the grace (gc.discard_stale_after_seconds)")
    if r.dry_run and r.plan is not None:
        notes += _orphans_not_due(r.plan)
    if r.plan is not None and not r.plan.config.base_cleanup and any(h.reason == "time_travel" for h in r.holds):
        notes.append(f"no base-version cleanup is configured: {r.retained_versions} retained base-table versions "
                     "keep merged generations forever, and every GC pass reads all of them (set "
                     "gc.cleanup_base_versions_older_than_seconds or gc.cleanup_base_versions_retain)")
    return notes


def _orphans_not_due(plan: gc.GcPlan) -> list[str]:
    """A dry run sweeps every region for orphan directories; a real run sweeps a region once per
    `gc.full_scan_interval_seconds`, so one made before a region's next sweep leaves its orphans."""
    interval = plan.config.full_scan_interval_seconds
    out = []
    for rid, rp in sorted(plan.regions.items()):
        n = sum(1 for i in rp.items if i.kind == gc.ORPHAN)
        if n and not history.due(rp.orphans_before, plan.planned_at, interval):
            at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(rp.orphans_before + interval))
            out.append(f"region {rid}: {n} orphan directories are taken by its next sweep, due at {at} "
                       "(a run sweeps a region once per gc.full_scan_interval_seconds; a run before then leaves them)")
    return out


def gc_outcome(r: gc.GcResult) -> StepOutcome:
    failures = list(r.failures)
    notes = gc_notes(r)
    if r.dry_run:
        metrics = gc_dry_metrics(r)
        summary = f"would delete {metrics['objects']} objects, {size(metrics['bytes'])}"
        status = StepStatus.PLANNED if r.plan.items or r.plan.base_cleanup else StepStatus.NOTHING_TO_DO
        return StepOutcome("gc", status, False, failures, notes=notes, metrics=metrics, summary=summary,
                           plan=r.plan, result=r)
    metrics = gc_metrics(r)
    kept = ", ".join(f"{k} {n}" for k, n in sorted((str(k), n) for k, n in r.kept.items()))
    summary = _fields(metrics | {"kept": f"({kept})" if kept else "nothing"},
                      ("objects_deleted", "bytes_reclaimed", "generations_deleted", "leaked_objects_deleted", "kept",
                       "retained_base_versions"))
    removed = r.deleted_objects or (r.base_cleanup or {}).get("old_versions")
    status = StepStatus.PARTIAL if failures else StepStatus.OK if removed else StepStatus.NOTHING_TO_DO
    return StepOutcome("gc", status, True, failures, notes=notes, metrics=metrics, summary=summary,
                       plan=r.plan, result=r)
