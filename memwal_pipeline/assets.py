"""One asset graph per table: region_generations -> base_table -> base_compaction -> index_catchup ->
memwal_index -> garbage (the issue's order: compaction right after the merge, the snapshot right
before GC, whose `value_unrecorded` hold it releases).

Each step asset is a thin adapter: it runs its step through the core runner
(`memwal_core.steps.run_step`: plan + execute under the table's lease) and turns the
`StepOutcome` into events: numeric metadata the UI plots (the outcome's metrics, plus a few
texts and bounded maps), check results, and a Dagster `Failure` for what failed. Every asset
that commits to the table runs in the table's pool (limit 1, set by the sensor when the
instance has none: `pools.py`), so runs of one table are serialized within one Dagster
instance; the lease the runner holds around plan and commits (`memwal_core/state/lease.py`) serializes it with every other
maintainer (another instance, `memwal maintain`, a library caller). A lease held past
`lease.wait_seconds` skips the step: `status` says "skipped: ... held by <holder> until <time>"
and the steps after it still run.

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
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

from dagster import (
    AssetCheckResult,
    Failure,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    BackfillPolicy,
    DynamicPartitionsDefinition,
    MaterializeResult,
    MetadataValue,
    asset,
)

from memwal_core.failures import RegionFailure
from memwal_core.jobs import catchup
from memwal_core.observe import status
from memwal_core.state import region
from memwal_core.state.table import read_memwal_state
from memwal_core.steps import StepOptions, StepOutcome, StepStatus, adapt, run_step

from . import failures
from . import metadata as bounded
from .config import TableConfig
from .freshness import merge_freshness
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


class MergeFailed(Failure):
    """A merge run left regions unmerged; the message names each region, generation and reason."""


def metric_values(outcome: StepOutcome) -> dict[str, Any]:
    """The outcome's numbers as metadata the UI plots (ints stay ints)."""
    return {k: MetadataValue.int(v) if isinstance(v, int) else MetadataValue.float(float(v))
            for k, v in outcome.metrics.items()}


def _reasons(failures: list[RegionFailure]) -> dict[str, str]:
    return {f.region_id: f.reason for f in failures}


def merge_region_metadata(outcome: StepOutcome, rid: str, value: str | None = None) -> dict[str, Any]:
    """A region's own numbers (plotted per partition) and a few facts of the run, labelled as such."""
    plan, result = outcome.plan, outcome.result
    r = result.regions.get(rid)
    after = adapt.merged_after(plan, result, rid)
    md = {} if value is None else {"region_value": MetadataValue.text(value)}
    return md | {
        "generations_merged": MetadataValue.int(len(r.generations_merged) if r else 0),
        "merged_generation": MetadataValue.int(after),
        "pending_generations": MetadataValue.int(sum(1 for g in plan.pending.get(rid, []) if g > after)),
        "rows_read": MetadataValue.int(r.rows_read if r else 0),
        "bytes_read": MetadataValue.int(r.bytes_read if r else 0),
        "run/regions": MetadataValue.int(outcome.metrics["regions_planned"]),
        "run/commits": MetadataValue.int(result.commits),
        "run/duration_s": MetadataValue.float(round(result.duration_s, 2)),
        "table_version": MetadataValue.int(result.table_version),
    }


def run_metadata(outcome: StepOutcome, regions: list[str]) -> dict[str, Any]:
    """One merge run's totals (bounded: errors cut to the worst few); `regions`: the run's."""
    return {"regions": MetadataValue.int(len(regions))} | metric_values(outcome) | {
        "region_errors": MetadataValue.json(bounded.fit(_reasons(outcome.failures)))}


def _known(f: RegionFailure, history: failures.RegionHistory | None, stuck_after: int) -> bool:
    """A failure already reported: a wall at the same generation, or the same failure recorded
    in `stuck_after` (`sensor.merge_attempts`) failed runs (the region is stuck; `merge_lag` says so)."""
    if history is None:
        return False
    same = [h for h in history.failures if h.generation == f.generation]
    return (f.permanent and any(h.permanent for h in same)) or len(same) >= stuck_after


def merge_failed(new: list[RegionFailure], labels: RegionLabels | None = None) -> MergeFailed:
    """The run's failure: the regions not merged, each with its value, generation, permanence,
    reason (offending rows and values as the merger counted them) and the repair; retried by a
    run retry policy only when one of them is transient."""
    labels = labels or RegionLabels()
    shown = "\n".join(f"- {failures.explain(f, labels.label(f.region_id))}" for f in new[:5])
    more = f"\n(and {len(new) - 5} more regions)" if len(new) > 5 else ""
    return MergeFailed(description=f"{len(new)} region(s) not merged:\n{shown}{more}",
                       metadata={"regions_failed": MetadataValue.int(len(new)),
                                 "region_values": MetadataValue.json(bounded.fit(
                                     {f.region_id: labels.label(f.region_id) for f in new})),
                                 "offending_rows": MetadataValue.int(sum(f.offending_rows for f in new)),
                                 "region_errors": MetadataValue.json(bounded.fit(_reasons(new)))},
                       allow_retries=not all(f.permanent for f in new))


def raise_if_failed(outcome: StepOutcome) -> None:
    """A step that failed or was refused fails its asset with a `Failure` that says why in
    memwal's words (the error as raised stays its cause, for the full trace)."""
    if outcome.status in (StepStatus.FAILED, StepStatus.REFUSED):
        error = outcome.error or f"{outcome.step} failed"
        md = {"step": MetadataValue.text(outcome.step), "status": MetadataValue.text(outcome.status.value)}
        if outcome.exception is not None:
            md["error_type"] = MetadataValue.text(type(outcome.exception).__name__)
        raise Failure(description=f"{outcome.step} {outcome.status.value}: {error}", metadata=md,
                      allow_retries=outcome.status is not StepStatus.REFUSED) from outcome.exception


def _table(context, keys: TableKeys) -> TableResource:
    """The table's resource (per-table key: see the module docstring)."""
    return getattr(context.resources, keys.table_resource)


def _spark(context, keys: TableKeys) -> MemWalSpark:
    return getattr(context.resources, keys.spark_resource)


def _location(context, keys: TableKeys):
    return _table(context, keys).location()


def _run(context, keys: TableKeys, cfg: TableConfig, step: str, *, spark: bool = False,
         regions: list[str] | None = None) -> StepOutcome:
    """Step `step` through the core runner, for this run (its id names the lease holder; the
    jobs' progress and the outcome go to the run's log). The Spark session starts only when
    the step has Spark work (a JVM start is ~10 s)."""
    provider = (lambda: _attach(context, keys)) if spark else None
    return run_step(step, _location(context, keys), StepOptions.of(cfg), provider, regions=regions,
                    run_id=context.run_id, progress=context.log.info)


SPARK_READY = "spark session ready in"  # bench/e2e.py reads this line for its latency breakdown


def _attach(context, keys: TableKeys):
    """The run's Spark session, and a log line saying how long it took to get (a JVM start, or
    a Connect session on a running server)."""
    t0 = time.monotonic()
    session = _spark(context, keys).spark_session
    context.log.info(f"{SPARK_READY} {time.monotonic() - t0:.2f} s")
    return session


def _skipped(context, outcome: StepOutcome) -> dict[str, Any]:
    """A step another maintainer's lease kept from running: a warning and a `status` that says
    by whom and until when (not a failure: the next run does the work)."""
    context.log.warning(str(outcome.exception or outcome.error))
    return {"status": MetadataValue.text(f"skipped: {outcome.error}")}


def _run_checked(context, keys: TableKeys, cfg: TableConfig, step: str, *, spark: bool = False,
                 regions: list[str] | None = None,
                 log_problems: bool = True) -> tuple[StepOutcome, dict[str, Any] | None]:
    """What every step asset does first: run the step; when another maintainer's lease kept it
    from running, return the skip's metadata (see `_skipped`) for the asset to record; when it
    failed or was refused, raise; otherwise log its problems (unless the asset reports them its
    own way) and return the outcome with no skip."""
    outcome = _run(context, keys, cfg, step, spark=spark, regions=regions)
    if outcome.status is StepStatus.SKIPPED:
        return outcome, _skipped(context, outcome)
    raise_if_failed(outcome)
    for line in outcome.problems if log_problems else []:
        context.log.error(line)
    return outcome, None


def _labels(loc) -> RegionLabels:
    return RegionLabels.of(loc)


def merge_events(context, loc, outcome: StepOutcome, regions: list[str], stuck_after: int) -> Iterator[Any]:
    """A merge run's events: the run's totals (one observation), one materialization per region
    it merged, and, when regions are left unmerged and not already known to be, the run's
    failure (tagged with the failures, so checks and `memwal status` find them).

    The totals are an observation of the asset (no partition), not copied onto every region's
    materialization. A failing region gets no materialization even when it merged generations
    before its wall: Dagster then shows its partition as failed."""
    result = outcome.result
    merged = sorted(rid for rid, r in result.regions.items() if r.generations_merged)
    labels = _labels(loc) if merged or outcome.failures else RegionLabels()
    for rid in merged:
        after = adapt.merged_after(outcome.plan, result, rid)
        context.log.info(f"region {rid} ({labels.label(rid)}): merged generations "
                         f"{result.regions[rid].generations_merged} (now at {after})")
    context.log.info(f"merge run: {len(regions)} regions, {result.generations_merged} generations merged "
                     f"in {result.commits} commits, {len(outcome.failures)} regions failed, "
                     f"table version {result.table_version}")
    yield AssetObservation(asset_key=context.asset_key, metadata=run_metadata(outcome, regions))
    failing = {f.region_id for f in outcome.failures}
    for rid in merged:
        if rid not in failing:
            yield AssetMaterialization(asset_key=context.asset_key, partition=rid,
                                       metadata=merge_region_metadata(outcome, rid, labels.label(rid)))
    if not outcome.failures:
        return
    for f in outcome.failures:
        context.log.error(failures.explain(f, labels.label(f.region_id)))
    history = failures.recent_failures(context.instance, context.job_name, regions=sorted(failing))
    new = [f for f in outcome.failures if not _known(f, history.get(f.region_id), stuck_after)]
    if not new:
        # Every failure is a known one (a wall, or recorded `stuck_after` times already): the
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
        if rid not in failing and rid not in merged:
            yield AssetMaterialization(asset_key=context.asset_key, partition=rid,
                                       metadata=merge_region_metadata(outcome, rid, labels.label(rid)))
    context.instance.add_run_tags(context.run_id, failures.run_tags(outcome.failures))
    raise merge_failed(new, labels)


def build_assets(cfg: TableConfig, partitions: DynamicPartitionsDefinition,
                 indexes: DynamicPartitionsDefinition | None = None) -> list:
    """The table's assets. Long because it is their definitions (decorators, descriptions), each a
    closure over the table's keys and settings; what they do is in the functions above."""
    keys = TableKeys(cfg.name)
    indexes = indexes or index_partitions(cfg.name)
    group = cfg.name
    table_res = {keys.table_resource}

    @asset(key=keys.asset("region_generations"), partitions_def=partitions, group_name=group, kinds={"lance"},
           required_resource_keys=table_res,
           description="Flushed generations of one region, written by the table's writers: the manifest "
                       "sensor records a materialization of the region's partition whenever its manifest "
                       "moves (generations, lag, region value); materializing reads it again.")
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
        regions = list(context.partition_keys)
        # merge_events logs the failures itself, with what Dagster does about them.
        outcome, skipped = _run_checked(context, keys, cfg, "merge", spark=True, regions=regions, log_problems=False)
        if skipped is not None:  # no materialization: the sensor requests the regions again
            yield AssetObservation(asset_key=context.asset_key, metadata=skipped)
            return
        yield from merge_events(context, _location(context, keys), outcome, regions, cfg.sensor.merge_attempts)

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
        outcome = _run(context, keys, cfg, "compact", spark=True)
        if outcome.status is StepStatus.SKIPPED:
            skipped = {"skipped": MetadataValue.text(str(outcome.exception))}
            return MaterializeResult(metadata=_skipped(context, outcome), check_results=[
                AssetCheckResult(check_name="compaction_ok", passed=True, metadata=skipped)])
        if outcome.status is StepStatus.FAILED:
            context.log.error(f"compaction failed; the steps after it still run: {outcome.error}")
            return MaterializeResult(
                metadata={"status": MetadataValue.text(f"failed: {outcome.error}")},
                check_results=[AssetCheckResult(check_name="compaction_ok", passed=False,
                                                severity=AssetCheckSeverity.ERROR, description=outcome.error,
                                                metadata={"error": MetadataValue.text(outcome.error or "")})])
        for line in outcome.errors:
            context.log.error(line)
        for note in outcome.notes:
            context.log.warning(note)
        errors = outcome.result.errors
        return MaterializeResult(
            metadata=compaction_metadata(outcome),
            check_results=[AssetCheckResult(check_name="compaction_ok", passed=not errors,
                                            severity=AssetCheckSeverity.WARN,
                                            description=bounded.short("; ".join(outcome.errors)) if errors else None,
                                            metadata={"errors": MetadataValue.json(errors)})])

    @asset(key=keys.asset("index_catchup"), kinds={"lance"}, deps=[base_compaction], group_name=group, pool=cfg.pool,
           partitions_def=indexes, backfill_policy=BackfillPolicy.single_run(),
           required_resource_keys=table_res,
           description="One partition per base-table index: the index brought up to date "
                       "(optimize_indices, codebooks kept) and its caught-up generation per region as "
                       "Lance recorded it (gap per region in the metadata). A maintenance run spans every "
                       "index partition; it catches up every index of the table, so GC downstream sees "
                       "all of them current.")
    def index_catchup(context: AssetExecutionContext) -> MaterializeResult:
        # Every index, not only the run's partitions: an index created since the sensor's last
        # tick has no partition yet but gates GC all the same.
        outcome, skipped = _run_checked(context, keys, cfg, "catchup")
        if skipped is not None:
            return MaterializeResult(metadata=skipped)
        r = outcome.result
        if not (context.has_partition_key or context.has_partition_key_range):
            # A run without an index range (no index partition yet, or launched by hand): one
            # table-wide record, as before indexes had partitions.
            return MaterializeResult(metadata=catchup_summary(outcome))
        outcomes = {o.name: o for o in r.indexes}
        labels = _labels(_location(context, keys))
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
            "run/indexes": MetadataValue.int(outcome.metrics["indexes"]),
            "run/max_gap": MetadataValue.int(outcome.metrics["max_gap"]),
            "table_version": MetadataValue.int(r.table_version),
        })

    @asset(key=keys.asset("memwal_index"), kinds={"lance"}, deps=[index_catchup], group_name=group, pool=cfg.pool,
           required_resource_keys=table_res,
           description="Snapshot of every region manifest in the MemWAL index (inline up to the "
                       "threshold, else an external Lance file); refreshes each region's WAL hint.")
    def memwal_index(context: AssetExecutionContext) -> MaterializeResult:
        outcome, skipped = _run_checked(context, keys, cfg, "index")
        if skipped is not None:
            return MaterializeResult(metadata=skipped)
        r = outcome.result
        return MaterializeResult(metadata=metric_values(outcome) | {
            "storage": MetadataValue.text(r.storage),
            "region_errors": MetadataValue.json(bounded.fit(_reasons(outcome.failures))),
            "committed": MetadataValue.bool(bool(r.committed)),
        })

    @asset(key=keys.asset("garbage"), kinds={"lance"}, deps=[memwal_index], group_name=group, pool=cfg.pool,
           required_resource_keys=table_res,
           description="Garbage collection: merged and caught-up generations, their WAL files, old "
                       "manifest versions and orphaned directories; never what a reader still needs.")
    def garbage(context: AssetExecutionContext) -> MaterializeResult:
        outcome, skipped = _run_checked(context, keys, cfg, "gc")
        if skipped is not None:
            return MaterializeResult(metadata=skipped)
        r = outcome.result
        for h in r.holds:
            context.log.info(f"GC keeps {h.describe()}")
        for note in outcome.notes:
            context.log.warning(note)
        return MaterializeResult(metadata=metric_values(outcome) | {
            "deleted": MetadataValue.json(r.counts()),
            "kept": MetadataValue.json(bounded.top(r.kept, 20)),
            "held": MetadataValue.md(holds_markdown(r.holds)),
            "region_errors": MetadataValue.json(bounded.fit(_reasons(outcome.failures))),
            "leak_scan": MetadataValue.json(r.leak_scan),
        })

    return [region_generations, base_table, base_compaction, index_catchup, memwal_index, garbage]


def compaction_metadata(outcome: StepOutcome) -> dict[str, Any]:
    """Numbers the UI plots (health before and after, bytes, segments per index) and what the
    compaction did."""
    plan, r = outcome.plan, outcome.result
    return {"status": MetadataValue.text(r.status), "reasons": MetadataValue.json(plan.reasons)} | \
        metric_values(outcome) | {
        "indexed_first": MetadataValue.json(r.indexed_first),
        "catchup_restored": MetadataValue.json(r.catchup_restored),
        "errors": MetadataValue.json(r.errors),
    }


def catchup_summary(outcome: StepOutcome) -> dict[str, Any]:
    """Every index in one record (a run without index partitions)."""
    return metric_values(outcome) | {"catchup": MetadataValue.md(catchup_markdown(outcome.result.rows))}


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
