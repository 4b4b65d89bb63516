"""Execute a merge plan: flushed generations -> base table, in order, with atomic progress.

Per batch (`attempt.py`): Spark reads the generations and keeps the newest row per primary
key (`spark/tasks.py`); the result streams into **one** `merge_insert` that upserts the live
rows, deletes the tombstoned keys and records each region's highest merged generation, all in
one commit (`commit.py`), verified right after (`verify.py`). A region's first generation that
cannot be merged is a wall for the rest of the run (`walls.py`). The run holds the table lease;
it starts by settling the commits an earlier run may have left unverified (`unverified.py`).
"""

from __future__ import annotations

import logging
import time

from memwal_core.jobs.merge import unverified
from memwal_core.jobs.merge.attempt import merge_batch
from memwal_core.jobs.merge.exclusivity import KeyLedger
from memwal_core.jobs.merge.owners import ownership_for_run
from memwal_core.jobs.merge.plan import MergePlan, plan_merge
from memwal_core.jobs.merge.result import MergeResult
from memwal_core.jobs.merge.run import BaseTable, DroppedColumns, PlanOutlived, Run
from memwal_core.jobs.merge.walls import Walls
from memwal_core.jobs.progress import MergeProgress, ProgressFn, report
from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.options import MergeOptions
from memwal_core.state import lease, lifecycle, region
from memwal_core.state import walls as records
from memwal_core.state.store import TableLocation
from memwal_core.state.table import open_dataset, read_memwal_state

log = logging.getLogger("memwal.merge")


@lease.step("merge")
def execute_merge(loc: TableLocation, plan: MergePlan, spark, *, max_attempts: int = 5,
                  progress: ProgressFn | None = None, expected_values: dict[str, dict] | None = None) -> MergeResult:
    """Merge every batch of `plan`: one Spark job and one commit per batch (normally).

    Each region's value (what its rows must route to) comes from authoritative state
    (`state.region_values.trusted_values`): `expected_values` (region id -> {field id: value}) if given, else
    the MemWAL snapshot, else its oldest merged generation, else the run's first routed
    generation (unanimous, not owned by another region).
    """
    t0 = time.monotonic()
    ds = open_dataset(loc)
    base = BaseTable.of(loc, ds)  # a table that cannot be merged into: say so first
    result = MergeResult(plan.table_uri)
    recorded = records.load(loc.store)
    walls = Walls.start(plan, recorded)
    unverified.settle(loc, base, walls, plan.merged, set(plan.pending))
    keys = KeyLedger.start(base.pk, recorded, set(plan.pending))
    outlived = _outlived(loc, plan, ds.version)
    for rid in sorted(plan.pending) if outlived else []:
        walls.stop(RegionFailure(rid, plan.merged.get(rid, 0) + 1, f"region {rid}: {outlived}", permanent=False))
    if plan.batches and not outlived:
        run = _start(loc, plan, spark, ds, base, walls, keys, result, max_attempts, expected_values or {})
        try:
            _merge_batches(run, plan, progress)
        except PlanOutlived as e:
            outlived = str(e)
            log.error("merge stopped: %s", outlived)
            for rid in sorted(plan.pending):
                walls.stop(RegionFailure(rid, plan.merged.get(rid, 0) + 1, f"region {rid}: {outlived}",
                                         permanent=False), quiet=True)
    merged = read_memwal_state(loc).merged
    walls.lift(merged)
    walls.report(result)
    walls.record(loc, plan, recorded, merged, keys.evidence)
    if plan.lifecycle is not None and not outlived:  # the plan's stale-region verdicts (the planner only reads)
        lifecycle.save(loc, plan.lifecycle)
    result.duration_s = time.monotonic() - t0
    result.table_version = open_dataset(loc).version if plan.batches else plan.table_version
    return result


def _outlived(loc: TableLocation, plan: MergePlan, version: int) -> str | None:
    """Why `plan` belongs to an earlier lifetime of the table (None: it does not).

    A plan made before the table was overwritten and MemWAL initialized again lists the old
    regions' generations as pending with no stale verdict (they were not stale then): executed
    as it is, it would bring the replaced table's rows into the new one and record their
    progress. So the run checks, under the lease, that the lifetime the plan was made in is
    still the current one; otherwise nothing of the plan is merged and the next run re-plans
    (where the old regions are judged stale)."""
    known = plan.lifecycle.init if plan.lifecycle is not None else None
    try:
        now = lifecycle.outlived(loc, plan.table_version, known, version)
    except Exception as e:  # noqa: BLE001 - cannot tell: merging nothing is the safe answer
        return f"the table's MemWAL initialization cannot be read ({one_line(e)}); nothing merged in this run"
    if now is None:
        return None
    return (f"this merge was planned at table version {plan.table_version}, before {now.describe()}; "
            "nothing of the plan is merged (the next run plans against the current table)")


def _start(loc: TableLocation, plan: MergePlan, spark, ds, base: BaseTable, walls: Walls, keys: KeyLedger,
           result: MergeResult, max_attempts: int, expected_values: dict[str, dict]) -> Run:
    """The run's shared parts, each complete: region values from the state at `ds`, and a wall
    for every planned region that cannot be merged without what could not be read now."""
    state = read_memwal_state(loc, ds.version)
    loaded = region.load_many(loc.store, sorted(plan.pending))
    for rid, got in loaded.items():
        if not got.ok:  # loaded when planned, not now: no routing to check it by
            walls.stop(RegionFailure(rid, plan.merged.get(rid, 0) + 1, got.message, permanent=got.permanent))
    ownership, failures = ownership_for_run(loc, state, ds, list(base.pk), loaded.manifests, plan.merged,
                                            expected_values, plan.lifecycle)
    for failure in failures:
        walls.stop(failure)
    return Run(base, spark, merge_tasks(spark), max_attempts, walls, ownership, keys, DroppedColumns(base), result,
               lambda version: _outlived(loc, plan, version))


def _merge_batches(run: Run, plan: MergePlan, progress: ProgressFn | None) -> None:
    """Each batch in turn, reporting `MergeProgress` before and after it."""
    totals = {"batches": len(plan.batches), "generations": sum(len(b.generations) for b in plan.batches),
              "bytes": sum(b.bytes for b in plan.batches), "regions": len(plan.pending)}
    gens_merged = bytes_merged = 0
    for n, batch in enumerate(plan.batches, 1):
        here = {"batch": n, "batch_generations": len(batch.generations), "batch_bytes": batch.bytes,
                "batch_regions": len({g.region_id for g in batch.generations}), **totals}
        report(progress, MergeProgress(**here, generations_merged=gens_merged, bytes_merged=bytes_merged,
                                       finished=False))
        merge_batch(run, batch)
        for g in batch.generations:  # each generation is in one batch: count what committed
            r = run.result.regions.get(g.region_id)
            if r is not None and g.generation in r.generations_merged:
                gens_merged += 1
                bytes_merged += g.bytes
        report(progress, MergeProgress(**here, generations_merged=gens_merged, bytes_merged=bytes_merged,
                                       finished=True))


def merge_tasks(spark) -> int:
    """Spark tasks per merge batch (each takes whole regions): `memwal.merge.partitions` if
    set, else the session's shuffle partitions (`local[*]`: the core count) capped at 64."""
    explicit = spark.conf.get("memwal.merge.partitions", None)
    if explicit:
        return max(1, int(explicit))
    return max(1, min(64, int(spark.conf.get("spark.sql.shuffle.partitions", "8"))))


@lease.step("merge")
def merge(loc: TableLocation, spark, options: MergeOptions | None = None, *, budget_bytes: int | None = None,
          max_generations: int | None = None, regions: list[str] | None = None,
          progress: ProgressFn | None = None) -> MergeResult:
    """Plan and execute in one call (what the CLI and the Dagster asset run)."""
    plan = plan_merge(loc, options, budget_bytes=budget_bytes, max_generations=max_generations, regions=regions)
    return execute_merge(loc, plan, spark, progress=progress)
