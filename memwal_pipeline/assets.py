"""One asset graph per table: region_generations -> base_table -> base_compaction -> index_catchup ->
memwal_index -> garbage (the issue's order: compaction right after the merge, the snapshot right
before GC, whose `value_unrecorded` hold it releases).

Each asset is a thin call into memwal_core (plan + execute) that turns the result into
numeric metadata the UI plots. Every asset that commits to the table runs in the table's
pool (limit 1 in dagster_home/dagster.yaml), so commits to one table are serialized within one
Dagster instance; each also holds the table's lease (`memwal_core/state/lease.py`) around its
plan and commits, which serializes it with every other maintainer (another instance, `memwal
maintain`, a library caller). A lease held past `lease.wait_seconds` skips the step: `status`
says "skipped: ... held by <holder> until <time>" and the steps after it still run.

Partitions (`partitions.py`): region_generations and base_table by region, index_catchup by
base-table index; the other assets are table-wide.

Resources are named per table (`{table}_table`, `{table}_spark`) and reached through
`required_resource_keys`, not typed parameters: a typed parameter's name *is* its resource key,
and one code location holds many tables, so every table's asset would ask for the same key
(`table`) with a different value. Dagster refuses that, also with asset-level `resource_defs`
("Conflicting versions of resource with key 'table' were provided to different assets"; tried
on 1.13.27). `_table` / `_spark` give the typed resource back.
"""

# No `from __future__ import annotations`: Dagster checks the `context` annotation by identity.
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    BackfillPolicy,
    DynamicPartitionsDefinition,
    FreshnessPolicy,
    MaterializeResult,
    MetadataValue,
    asset,
)

from memwal_core.errors import MemwalError, one_line
from memwal_core.jobs import catchup, compaction, gc, merge, snapshot
from memwal_core.observe import status
from memwal_core.state import lease, region
from memwal_core.state.keys import refuse_unsupported_keys
from memwal_core.state.table import open_dataset, primary_key, read_memwal_state

from . import failures
from . import metadata as bounded
from .config import TableConfig
from .partitions import RegionLabels, index_partitions
from .resources import MemWalSpark, TableResource

# BackfillPolicy.single_run is what the Spark merge wants; Dagster flags the parameter as beta.
warnings.filterwarnings("ignore", message=".*backfill_policy.*", category=Warning)


@dataclass(frozen=True)
class TableKeys:
    """Names of one table's Dagster objects (asset keys prefixed with the table name)."""

    name: str

    @property
    def table_resource(self) -> str:
        return f"{self.name}_table"

    @property
    def spark_resource(self) -> str:
        return f"{self.name}_spark"

    @property
    def partitions(self) -> str:
        return f"{self.name}_regions"

    def asset(self, short: str) -> AssetKey:
        return AssetKey([self.name, short])


def region_metadata(st: status.RegionStatus, value: str | None = None) -> dict[str, Any]:
    """A region's observed state; `value` is its readable routing value (`bucket=3`)."""
    md: dict[str, Any] = {
        "manifest_version": MetadataValue.int(st.manifest_version),
        "writer_epoch": MetadataValue.int(st.writer_epoch),
        "current_generation": MetadataValue.int(st.current_generation),
        "flushed_generations": MetadataValue.int(len(st.flushed_generations)),
        "merged_generation": MetadataValue.int(st.merged_generation),
        "pending_generations": MetadataValue.int(len(st.pending_generations)),
        "pending_rows": MetadataValue.int(st.pending_rows),
        "pending_bytes": MetadataValue.int(st.pending_bytes),
        "oldest_pending_age_s": MetadataValue.float(round(float(st.oldest_pending_age_s or 0.0), 3)),
    }
    if value is not None:
        md["region_value"] = MetadataValue.text(value)
    if st.error:
        md["error"] = MetadataValue.text(st.error)
    return md


def merge_freshness(cfg: TableConfig) -> FreshnessPolicy:
    """base_table goes stale when no region merged for `slo.merge_lag_seconds` (at least a minute:
    Dagster's smallest window). Dagster measures time since the last materialization of any
    region, so an idle table (nothing flushed) goes stale too; `merge_lag` is the exact measure
    (age of the oldest pending generation)."""
    return FreshnessPolicy.time_window(fail_window=timedelta(seconds=max(60.0, float(cfg.slo.merge_lag_seconds))))


class MergeFailed(Exception):
    """A merge run left regions unmerged; the message names each region, generation and reason."""


@dataclass
class MergeOutcome:
    """What one merge run did per region: which regions merged, which failed and why."""

    plan_merged: dict[str, int]  # merged generation per region when the run planned
    planned: dict[str, list[int]]  # pending generations per region when the run planned
    merged: list[str]  # regions that merged at least one generation in this run
    failures: list[failures.RegionFailure]
    regions: int = 0

    def merged_after(self, rid: str, result: merge.MergeResult | None = None) -> int:
        r = result.regions.get(rid) if result else None
        return max(self.plan_merged.get(rid, 0), r.merged_generation if r else 0)

    def region_metadata(self, rid: str, result: merge.MergeResult, value: str | None = None) -> dict[str, Any]:
        """The region's own numbers (plotted per partition) and a few facts of the run, labelled as such."""
        r = result.regions.get(rid)
        after = self.merged_after(rid, result)
        md = {} if value is None else {"region_value": MetadataValue.text(value)}
        return md | {
            "generations_merged": MetadataValue.int(len(r.generations_merged) if r else 0),
            "merged_generation": MetadataValue.int(after),
            "pending_generations": MetadataValue.int(sum(1 for g in self.planned.get(rid, []) if g > after)),
            "rows_read": MetadataValue.int(r.rows_read if r else 0),
            "bytes_read": MetadataValue.int(r.bytes_read if r else 0),
            "run/regions": MetadataValue.int(self.regions),
            "run/commits": MetadataValue.int(result.commits),
            "run/duration_s": MetadataValue.float(round(result.duration_s, 2)),
            "table_version": MetadataValue.int(result.table_version),
        }


def run_metadata(regions: list[str], result: merge.MergeResult, outcome: MergeOutcome) -> dict[str, Any]:
    """One merge run's totals (bounded: errors cut to the worst few)."""
    return {
        "regions": MetadataValue.int(len(regions)),
        "regions_merged": MetadataValue.int(len(outcome.merged)),
        "generations_merged": MetadataValue.int(result.generations_merged),
        "generations_pending": MetadataValue.int(sum(
            1 for rid, gens in outcome.planned.items() for g in gens if g > outcome.merged_after(rid, result))),
        "commits": MetadataValue.int(result.commits),
        "conflicts": MetadataValue.int(result.conflicts),
        "rows_upserted": MetadataValue.int(result.rows_upserted),
        "rows_deleted": MetadataValue.int(result.rows_deleted),
        "bytes_read": MetadataValue.int(result.bytes_read),
        "bytes_written": MetadataValue.int(result.bytes_written),
        "duration_s": MetadataValue.float(round(result.duration_s, 2)),
        "regions_failed": MetadataValue.int(len(outcome.failures)),
        "region_errors": MetadataValue.json(bounded.fit({f.region_id: f.error for f in outcome.failures})),
        "table_version": MetadataValue.int(result.table_version),
    }


def merge_outcome(plan: merge.MergePlan, result: merge.MergeResult) -> MergeOutcome:
    planned = plan.pending
    merged_after = {rid: max(plan.merged.get(rid, 0), r.merged_generation) for rid, r in result.regions.items()}
    pending_after = {rid: [g for g in gens if g > merged_after.get(rid, plan.merged.get(rid, 0))]
                     for rid, gens in planned.items()}
    merged = sorted(rid for rid, r in result.regions.items() if r.generations_merged)
    regions = len(set(planned) | set(result.regions))
    return MergeOutcome(dict(plan.merged), planned, merged, failures.from_merge_result(result, pending_after), regions)


def _known(f: failures.RegionFailure, history: failures.RegionHistory | None) -> bool:
    """A failure already reported: a wall at the same generation, or the same failure recorded
    in `STUCK_AFTER` failed runs (the region is stuck; `merge_lag` says so)."""
    if history is None:
        return False
    same = [h for h in history.failures if h.generation == f.generation]
    return (bool(f.permanent) and any(h.permanent for h in same)) or len(same) >= failures.STUCK_AFTER


def _table(context, keys: TableKeys) -> TableResource:
    """The table's resource (per-table key: see the module docstring)."""
    return getattr(context.resources, keys.table_resource)


def _spark(context, keys: TableKeys) -> MemWalSpark:
    return getattr(context.resources, keys.spark_resource)


def _location(context, keys: TableKeys):
    return _table(context, keys).location()


def _skipped(context, e: lease.LeaseHeld) -> dict[str, Any]:
    """A step another maintainer's lease kept from running: a warning and a `status` that says
    by whom and until when (not a failure: the next run does the work)."""
    context.log.warning(str(e))
    return {"status": MetadataValue.text(f"skipped: lease held by {e.record.describe()}")}


def _labels(loc) -> RegionLabels:
    try:
        return RegionLabels.load(loc, read_memwal_state(loc))
    except Exception:  # noqa: BLE001 - a label never fails a run that did its work
        return RegionLabels()


def build_assets(cfg: TableConfig, partitions: DynamicPartitionsDefinition,
                 indexes: DynamicPartitionsDefinition | None = None) -> list:
    keys = TableKeys(cfg.name)
    indexes = indexes or index_partitions(cfg.name)
    group = cfg.name
    table_res = {keys.table_resource}

    @asset(key=keys.asset("region_generations"), partitions_def=partitions, group_name=group, kinds={"lance"},
           required_resource_keys=table_res,
           description="Flushed generations of one region, observed from its latest manifest "
                       "(the manifest sensor records observations; materializing refreshes them).")
    def region_generations(context: AssetExecutionContext) -> MaterializeResult:
        loc = _location(context, keys)
        rid = context.partition_key
        m = region.load_latest(loc.store, rid)
        mstate = read_memwal_state(loc)
        st = status.region_status(loc, m, mstate.merged.get(rid, 0))
        value = RegionLabels.load(loc, mstate).label(rid)
        context.log.info(f"region {rid} ({value}): manifest v{m.version}, pending generations "
                         f"{st.pending_generations}")
        return MaterializeResult(metadata=region_metadata(st, value))

    @asset(key=keys.asset("base_table"), partitions_def=partitions, group_name=group, kinds={"lance", "spark"},
           deps=[region_generations], pool=cfg.pool, backfill_policy=BackfillPolicy.single_run(),
           output_required=False, required_resource_keys=table_res | {keys.spark_resource},
           freshness_policy=merge_freshness(cfg),
           description="The base table with the region's flushed generations merged in "
                       "(Spark dedup, one marked merge_insert per byte-bounded batch). A run over a "
                       "range of regions merges them in one Spark job and records a materialization "
                       "only for the regions it merged; it fails, naming region, generation and "
                       "reason, when a region could not be merged.")
    def base_table(context: AssetExecutionContext):
        loc = _location(context, keys)
        regions = list(context.partition_keys)
        ds = open_dataset(loc)  # a table without a primary key, or of a key type memwal cannot merge:
        refuse_unsupported_keys(ds.schema, primary_key(ds), loc.lance_uri)  # a clear error before any Spark
        try:
            with lease.hold(loc, "merge", cfg.lease, run_id=context.run_id):
                plan = merge.plan_merge(loc, budget_bytes=cfg.merge.budget_bytes,
                                        max_generations=cfg.merge.max_generations, regions=regions)
                # The lazy session starts only when there is something to merge (a JVM start is ~10 s).
                spark = _spark(context, keys).spark_session if plan.batches else None
                result = merge.execute_merge(loc, plan, spark, progress=context.log.info, lease=cfg.lease)
        except lease.LeaseHeld as e:  # no materialization: the sensor requests the regions again
            yield AssetObservation(asset_key=context.asset_key, metadata=_skipped(context, e))
            return
        outcome = merge_outcome(plan, result)
        labels = _labels(loc) if outcome.merged or outcome.failures else RegionLabels()
        for rid in outcome.merged:
            r = result.regions[rid]
            context.log.info(f"region {rid}: merged generations {r.generations_merged} "
                             f"(now at {outcome.merged_after(rid, result)})")
        context.log.info(f"merge run: {len(regions)} regions, {result.generations_merged} generations merged "
                         f"in {result.commits} commits, {len(outcome.failures)} regions failed, "
                         f"table version {result.table_version}")
        # The run's totals: one observation of the asset (no partition), not copied onto every
        # region's materialization (what `memwal maintain` reports for the merge step).
        yield AssetObservation(asset_key=context.asset_key, metadata=run_metadata(regions, result, outcome))
        failing = {f.region_id for f in outcome.failures}
        # A failing region gets no materialization even when it merged generations before its
        # wall (logged above): Dagster then shows its partition as failed.
        for rid in outcome.merged:
            if rid not in failing:
                yield AssetMaterialization(asset_key=context.asset_key, partition=rid,
                                           metadata=outcome.region_metadata(rid, result, labels.label(rid)))
        if not outcome.failures:
            return
        for f in outcome.failures:
            context.log.error(f.describe())
        history = failures.recent_failures(context.instance, context.job_name,
                                           regions=[f.region_id for f in outcome.failures])
        new = [f for f in outcome.failures if not _known(f, history.get(f.region_id))]
        if not new:
            # Every failure is a known one (a wall, or recorded STUCK_AFTER times already): the
            # partitions stay failed from before and `merge_lag` reports them; failing again
            # would only fail the other regions' runs.
            context.log.warning(f"{len(outcome.failures)} regions still cannot be merged (known, see merge_lag)")
            return
        # With one planned event per partition, Dagster marks failed the partitions this run
        # planned and did not materialize: record every region that is fine (merged, or nothing
        # to merge) so only the failing ones are. (With one planned event per run, see
        # definitions.PLANNED_EVENTS_ENV, no partition is marked and this costs nothing.)
        per_partition = not context.instance.event_log_storage.supports_partition_subset_in_asset_materialization_planned_events
        for rid in regions if per_partition else []:
            if rid not in failing and rid not in outcome.merged:
                yield AssetMaterialization(asset_key=context.asset_key, partition=rid,
                                           metadata=outcome.region_metadata(rid, result, labels.label(rid)))
        context.instance.add_run_tags(context.run_id, failures.run_tags(outcome.failures))
        shown = "; ".join(f.describe() for f in new[:5])
        more = f" (and {len(new) - 5} more)" if len(new) > 5 else ""
        raise MergeFailed(f"{len(new)} region(s) not merged: {shown}{more}")

    @asset(key=keys.asset("base_compaction"), kinds={"lance", "spark"}, deps=[base_table], group_name=group,
           pool=cfg.pool, required_resource_keys=table_res | {keys.spark_resource},
           check_specs=[AssetCheckSpec(
               "compaction_ok", asset=keys.asset("base_compaction"),
               description="ERROR when the compaction failed (the MemWAL index, catch-up and GC still ran "
                           "after it); WARN when an index could not be caught up or merged")],
           description="Base-table health: compacts small fragments and materializes deletions when a "
                       "threshold is passed (planned here, rewritten in Spark tasks, committed here; "
                       "bounded per run), merges index segments past their threshold; otherwise "
                       "reports 'healthy, skipped'. Merge progress and index catch-up are kept.")
    def base_compaction(context: AssetExecutionContext) -> MaterializeResult:
        # Compaction is the table's long-run health, not its correctness: when it fails, the
        # asset still materializes (its check fails) so that the MemWAL index, index catch-up
        # and GC after it in the maintenance job are not skipped run after run.
        loc = _location(context, keys)
        try:
            with lease.hold(loc, "compact", cfg.lease, run_id=context.run_id):
                plan = compaction.plan_compaction(loc, cfg.compaction)
                context.log.info(f"compaction plan: {plan.summary}")
                # The lazy session starts only when there are fragments to rewrite.
                spark = _spark(context, keys).spark_session if plan.needs_spark else None
                r = compaction.execute_compaction(loc, plan, spark, progress=context.log.info, lease=cfg.lease)
        except lease.LeaseHeld as e:
            return MaterializeResult(metadata=_skipped(context, e), check_results=[AssetCheckResult(
                check_name="compaction_ok", passed=True, metadata={"skipped": MetadataValue.text(str(e))})])
        except Exception as e:  # noqa: BLE001 - reported by the check, never stalls the rest
            # memwal's own refusals say what is wrong without their class name, as when they raised
            err = str(e).splitlines()[0] if isinstance(e, MemwalError) and str(e) else one_line(e)
            context.log.exception(f"compaction failed; the steps after it still run: {err}")
            return MaterializeResult(
                metadata={"status": MetadataValue.text(f"failed: {err}")},
                check_results=[AssetCheckResult(check_name="compaction_ok", passed=False,
                                                severity=AssetCheckSeverity.ERROR,
                                                metadata={"error": MetadataValue.text(err)})])
        for name, err in r.errors.items():
            context.log.error(f"index {name}: {err}")
        for name, why in plan.retrain_refused.items():
            context.log.warning(f"index {name}: not retrained: {why}")
        return MaterializeResult(
            metadata=compaction_metadata(plan, r),
            check_results=[AssetCheckResult(check_name="compaction_ok", passed=not r.errors,
                                            severity=AssetCheckSeverity.WARN,
                                            metadata={"errors": MetadataValue.json(r.errors)})])

    @asset(key=keys.asset("index_catchup"), kinds={"lance"}, deps=[base_compaction], group_name=group, pool=cfg.pool,
           partitions_def=indexes, backfill_policy=BackfillPolicy.single_run(),
           required_resource_keys=table_res,
           description="One partition per base-table index: the index brought up to date "
                       "(optimize_indices, codebooks kept) and its caught-up generation per region as "
                       "Lance recorded it (gap per region in the metadata). A maintenance run spans every "
                       "index partition; it catches up every index of the table, so GC downstream sees "
                       "all of them current.")
    def index_catchup(context: AssetExecutionContext) -> MaterializeResult:
        loc = _location(context, keys)
        # Every index, not only the run's partitions: an index created since the sensor's last
        # tick has no partition yet but gates GC all the same.
        try:
            with lease.hold(loc, "catchup", cfg.lease, run_id=context.run_id):
                r = catchup.run_catchup(loc, lease=cfg.lease)
        except lease.LeaseHeld as e:
            return MaterializeResult(metadata=_skipped(context, e))
        for name, err in r.errors.items():
            context.log.error(f"index {name}: {err}")
        if not (context.has_partition_key or context.has_partition_key_range):
            # A run without an index range (no index partition yet, or launched by hand): one
            # table-wide record, as before indexes had partitions.
            return MaterializeResult(metadata=catchup_summary(r))
        outcomes = {o.name: o for o in r.indexes}
        labels = _labels(loc)
        for name in context.partition_keys:
            o = outcomes.get(name)
            if o is None:
                context.log.warning(f"index {name} no longer exists on the table (its partition is removed "
                                    "by the sensor's next maintenance request)")
            context.add_asset_metadata(index_metadata(o, labels), partition_key=name)
        unpartitioned = sorted(set(outcomes) - set(context.partition_keys))
        if unpartitioned:
            context.log.info(f"caught up indexes without a partition yet (the sensor adds them): {unpartitioned}")
        return MaterializeResult(metadata={
            "run/indexes": MetadataValue.int(len(r.indexes)),
            "run/max_gap": MetadataValue.int(max([row.gap for row in r.rows] or [0])),
            "table_version": MetadataValue.int(r.table_version),
        })

    @asset(key=keys.asset("memwal_index"), kinds={"lance"}, deps=[index_catchup], group_name=group, pool=cfg.pool,
           required_resource_keys=table_res,
           description="Snapshot of every region manifest in the MemWAL index (inline up to the "
                       "threshold, else an external Lance file); refreshes each region's WAL hint.")
    def memwal_index(context: AssetExecutionContext) -> MaterializeResult:
        loc = _location(context, keys)
        try:
            with lease.hold(loc, "index", cfg.lease, run_id=context.run_id):
                r = snapshot.build_snapshot(loc, inline_threshold=cfg.snapshot.inline_threshold, lease=cfg.lease)
        except lease.LeaseHeld as e:
            return MaterializeResult(metadata=_skipped(context, e))
        for rid, err in r.region_errors.items():
            context.log.error(f"region {rid}: {err}")
        return MaterializeResult(metadata={
            "num_regions": MetadataValue.int(r.num_regions),
            "storage": MetadataValue.text(r.storage),
            "hints_updated": MetadataValue.int(len(r.hints_updated)),
            "regions_failed": MetadataValue.int(len(r.region_errors)),
            "region_errors": MetadataValue.json(bounded.fit(r.region_errors)),
            "committed": MetadataValue.bool(getattr(r, "committed", True)),
            "attempts": MetadataValue.int(r.attempts),
            "duration_s": MetadataValue.float(round(r.duration_s, 2)),
            "table_version": MetadataValue.int(r.table_version),
        })

    @asset(key=keys.asset("garbage"), kinds={"lance"}, deps=[memwal_index], group_name=group, pool=cfg.pool,
           required_resource_keys=table_res,
           description="Garbage collection: merged and caught-up generations, their WAL files, old "
                       "manifest versions and orphaned directories; never what a reader still needs.")
    def garbage(context: AssetExecutionContext) -> MaterializeResult:
        loc = _location(context, keys)
        try:
            with lease.hold(loc, "gc", cfg.lease, run_id=context.run_id):
                r = gc.run_gc(loc, cfg.gc, progress=context.log.info, lease=cfg.lease)
        except lease.LeaseHeld as e:
            return MaterializeResult(metadata=_skipped(context, e))
        for rid, err in r.region_errors.items():
            context.log.error(err if rid in err else f"region {rid}: {err}")
        counts = r.counts()
        holds = getattr(r, "holds", [])
        for h in holds:
            context.log.info(f"GC keeps {h.describe()}")
        for rid, through in sorted(r.stale_discarded.items()):
            context.log.warning(f"region {rid}: generations through {through}, written before the MemWAL "
                                f"initialization, discarded after the grace (gc.discard_stale_after_seconds)")
        if not cfg.gc.base_cleanup and any(h.reason == "time_travel" for h in holds):
            context.log.warning(
                f"no base-version cleanup is configured: {r.retained_versions} retained base-table versions "
                "keep merged generations forever, and every GC pass reads all of them (set "
                "gc.cleanup_base_versions_older_than_seconds or gc.cleanup_base_versions_retain)")
        md = {
            "objects_deleted": MetadataValue.int(r.deleted_objects),
            "bytes_reclaimed": MetadataValue.int(r.bytes_reclaimed),
            "generations_deleted": MetadataValue.int(counts.get("generation", 0)),
            "deleted": MetadataValue.json(counts),
            "kept": MetadataValue.json(bounded.top(r.kept, 20)),
            "held": MetadataValue.md(holds_markdown(holds)),
            "manifest_commits": MetadataValue.int(r.manifest_commits),
            "regions_failed": MetadataValue.int(len(r.region_errors)),
            "region_errors": MetadataValue.json(bounded.fit(r.region_errors)),
            "duration_s": MetadataValue.float(round(r.plan_seconds + r.execute_seconds, 2)),
            "retained_base_versions": MetadataValue.int(r.retained_versions),
            "leaked_objects_deleted": MetadataValue.int(r.leaked_objects),
            "leaked_bytes_reclaimed": MetadataValue.int(r.leaked_bytes),
            "leak_scan": MetadataValue.json(r.leak_scan),
        }
        for h in holds:  # plotted: what GC keeps, per reason
            md[f"held_bytes/{h.reason}"] = MetadataValue.int(h.bytes)
        return MaterializeResult(metadata=md)

    return [region_generations, base_table, base_compaction, index_catchup, memwal_index, garbage]


def compaction_metadata(plan: compaction.CompactionPlan, r: compaction.CompactionResult) -> dict[str, Any]:
    """Numbers the UI plots: health before and after, bytes, segments per index."""
    before, after = r.health_before, r.health_after or r.health_before
    md: dict[str, Any] = {
        "status": MetadataValue.text(r.status),
        "reasons": MetadataValue.json(plan.reasons),
        "fragments": MetadataValue.int(after.fragments),
        "small_fragments": MetadataValue.int(after.small_fragments),
        "deleted_row_ratio": MetadataValue.float(round(after.deleted_row_ratio, 4)),
        "deletion_file_ratio": MetadataValue.float(round(after.deletion_file_ratio, 4)),
        "index_segments": MetadataValue.int(sum(after.index_segments.values())),
        "fragments_before": MetadataValue.int(before.fragments),
        "bytes_before": MetadataValue.int(before.bytes),
        "bytes_after": MetadataValue.int(after.bytes),
        "tasks": MetadataValue.int(r.tasks),
        "conflicts": MetadataValue.int(r.conflicts),
        "fragments_removed": MetadataValue.int(r.fragments_removed),
        "fragments_added": MetadataValue.int(r.fragments_added),
        "indexed_first": MetadataValue.json(r.indexed_first),
        "catchup_restored": MetadataValue.json(r.catchup_restored),
        "errors": MetadataValue.json(r.errors),
        "duration_s": MetadataValue.float(round(r.duration_s, 3)),
        "table_version": MetadataValue.int(r.table_version),
    }
    for name, n in sorted(after.index_segments.items()):
        md[f"segments/{name}"] = MetadataValue.int(n)
    return md


def catchup_summary(r: catchup.CatchupResult) -> dict[str, Any]:
    """Every index in one record (a run without index partitions; what `memwal maintain` prints)."""
    rows = r.rows
    md: dict[str, Any] = {
        "indexes": MetadataValue.int(len(r.indexes)),
        "max_gap": MetadataValue.int(max([row.gap for row in rows] or [0])),
        "not_caught_up": MetadataValue.int(len(r.not_caught_up)),
        "unindexed_rows_after": MetadataValue.int(sum(o.unindexed_rows_after or 0 for o in r.indexes)),
        "catchup": MetadataValue.md(catchup_markdown(rows)),
    }
    for o in r.indexes:
        md[f"gap/{o.name}"] = MetadataValue.int(max([row.gap for row in rows if row.index_name == o.name] or [0]))
    return md


def index_metadata(o: catchup.IndexOutcome | None, labels: RegionLabels, n: int = bounded.TOP_N) -> dict[str, Any]:
    """One index's partition: its gap (plotted), how many regions lag, the `n` furthest behind
    with their region value (bounded), whether it gates GC. `None`: the index was dropped."""
    if o is None:
        return {"exists": MetadataValue.bool(False), "gap": MetadataValue.int(0)}
    behind = sorted((r for r in o.regions if r.gap > 0), key=lambda r: (-r.gap, r.region_id))
    md: dict[str, Any] = {
        "exists": MetadataValue.bool(True),
        "index_type": MetadataValue.text(o.index_type),
        "gating": MetadataValue.bool(o.gating),
        "caught_up": MetadataValue.bool(o.caught_up),
        "gap": MetadataValue.int(max([r.gap for r in o.regions] or [0])),
        "regions": MetadataValue.int(len(o.regions)),
        "regions_behind": MetadataValue.int(len(behind)),
        "optimized": MetadataValue.bool(o.optimized),
        "unindexed_rows_after": MetadataValue.int(o.unindexed_rows_after or 0),
        "region_gaps": MetadataValue.md(region_gaps_markdown(behind, labels, n)),
    }
    if o.error:
        md["error"] = MetadataValue.text(bounded.short(o.error))
    return md


def region_gaps_markdown(behind, labels: RegionLabels, n: int = bounded.TOP_N) -> str:
    if not behind:
        return "_caught up in every region_"
    lines = ["| region | value | caught up | merged | gap |", "|---|---|---|---|---|"]
    lines += [f"| {r.region_id} | {labels.label(r.region_id)} | {r.caught_up_generation} | {r.merged_generation} "
              f"| {r.gap} |" for r in behind[:n]]
    if len(behind) > n:
        lines.append(f"| … {len(behind) - n} more | | | | |")
    return "\n".join(lines)


def catchup_markdown(rows, n: int = bounded.TOP_N) -> str:
    """Per index: how many regions are caught up, then the `n` regions furthest behind (bounded)."""
    if not rows:
        return "_no base-table indexes_"
    lines = []
    for name in sorted({r.index_name for r in rows}):
        mine = [r for r in rows if r.index_name == name]
        behind = sorted((r for r in mine if r.gap > 0), key=lambda r: (-r.gap, r.region_id))
        gating = "gates GC" if any(r.gating for r in mine) else "does not gate GC"
        lines.append(f"**{name}** ({gating}): {len(mine) - len(behind)} of {len(mine)} regions caught up")
        if behind:
            lines += ["", "| region | caught up | merged | gap |", "|---|---|---|---|"]
            lines += [f"| {r.region_id} | {r.caught_up_generation} | {r.merged_generation} | {r.gap} |"
                      for r in behind[:n]]
            if len(behind) > n:
                lines.append(f"| … {len(behind) - n} more | | | |")
        lines.append("")
    return "\n".join(lines).strip()


def holds_markdown(holds) -> str:
    """What GC keeps and why (one line per reason: bounded)."""
    if not holds:
        return "_nothing held_"
    return "\n".join(f"- {h.describe()}" for h in holds)
