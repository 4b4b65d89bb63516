"""Asset checks: region exclusivity, merge lag, catch-up gap, GC consistency.

Severity says what a failure means: WARN for lag over an SLO (it shows and alerts without
blocking maintenance of the healthy regions), ERROR when something will not fix itself: a
region stuck behind a merge refusal (or failing run after run), a listed generation missing
on disk, a region whose manifest cannot be read. Metadata is bounded (`metadata.py`): the
worst `TOP_N` regions, rounded numbers, whatever the number of regions.

Which job runs them (`definitions.py`): none runs in the merge job (it must stay cheap at
thousands of regions); `merge_lag`, `catchup_gap` and `gc_consistency` run with every
maintenance run (after merges, and on its schedule); `region_exclusivity` (it reads rows) and
`merge_lag` run in the table's scheduled checks job.
"""

from __future__ import annotations

from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue, asset_check

from memwal_core.observe import blockers, checks, status

from . import failures
from . import metadata as bounded
from .assets import TableKeys
from .config import TableConfig
from .partitions import RegionLabels


def lag_report(st: status.TableStatus, slo_s: float, stuck: list[failures.StuckRegion],
               n: int = bounded.TOP_N, labels: RegionLabels | None = None) -> tuple[bool, AssetCheckSeverity, dict]:
    # Stuck and unreadable regions carry a reason each: fewer of them fit in the bound.
    """merge_lag's verdict and bounded metadata (a pure function of the table status and the
    stuck regions, so its size can be tested at thousands of regions)."""
    age = st.oldest_pending_age_s or 0.0
    # Only regions with something pending are "worst": an age of 0 is not lag.
    worst = sorted(((r.oldest_pending_age_s, r.region_id, len(r.pending_generations)) for r in st.regions
                    if r.pending_generations and r.oldest_pending_age_s), reverse=True)[:n]
    over = sum(1 for r in st.regions if (r.oldest_pending_age_s or 0.0) > slo_s)
    stuck_ids = {s.region_id for s in stuck}  # a recorded wall shows in both: count it as stuck
    failed = {rid: e for rid, e in st.region_errors.items() if rid not in stuck_ids}
    passed = age <= slo_s and not failed and not stuck
    severity = AssetCheckSeverity.ERROR if (stuck or failed) else AssetCheckSeverity.WARN
    md = {
        "oldest_pending_age_s": MetadataValue.float(round(age, 1)),
        "slo_seconds": MetadataValue.float(round(slo_s, 1)),
        "pending_generations": MetadataValue.int(st.pending_generations),
        "regions_over_slo": MetadataValue.int(over),
        "worst_regions": MetadataValue.json([{"region": rid, "age_s": round(a, 1), "pending": p}
                                             for a, rid, p in worst]),
        "stuck_regions": MetadataValue.int(len(stuck)),
        "stuck": MetadataValue.json([{"region": s.region_id, "generation": s.generation,
                                      "failed_runs": s.failed_runs, "permanent": s.permanent,
                                      "reason": bounded.short(s.reason, 120)} for s in stuck[:n // 2]]
                                    + ([{bounded.MORE: len(stuck) - n // 2}] if len(stuck) > n // 2 else [])),
        "regions_failed": MetadataValue.int(len(failed)),
        "region_errors": MetadataValue.json(bounded.top(failed, n // 2, text_limit=100)),
    }
    labels = labels or RegionLabels()
    if stuck:
        md["description"] = MetadataValue.text(bounded.short("; ".join(s.describe(labels.label(s.region_id))
                                                                       for s in stuck[:2])))
    elif failed:
        md["description"] = MetadataValue.text(bounded.short(
            f"{len(failed)} region(s) cannot be read: " + "; ".join(list(failed.values())[:2])))
    elif not passed:
        md["description"] = MetadataValue.text(f"the oldest pending generation is {age:.0f} s old (SLO {slo_s:.0f} s); "
                                               f"{over} region(s) over the SLO")
    return passed, severity, md


def catchup_report(st: status.TableStatus, slo: int) -> AssetCheckResult:
    """catchup_gap's verdict: gating indexes over `slo` generations behind, each index's own gap."""
    gaps = {i.name: i.max_gap for i in st.indexes if i.gating}
    over = sorted((name for name, gap in gaps.items() if gap > slo), key=lambda n: (-gaps[n], n))
    md = {"max_gap": MetadataValue.int(max(gaps.values() or [0])),
          "gaps": MetadataValue.json(bounded.top(gaps, key=lambda kv: -kv[1])),
          "indexes_over_slo": MetadataValue.json(over[:bounded.TOP_N]),
          "slo_generations": MetadataValue.int(slo)}
    for i in sorted(st.indexes, key=lambda i: i.name)[:bounded.TOP_N * 2]:
        md[f"gap/{i.name}"] = MetadataValue.int(i.max_gap)
    desc = None
    if over:
        desc = bounded.short("; ".join(f"index {n} is {gaps[n]} generations behind (SLO {slo})" for n in over[:3]))
    return AssetCheckResult(passed=not over, severity=AssetCheckSeverity.WARN, metadata=md, description=desc)


def sensor_gave_up(instance, table: str, known: set[str], merged: dict[str, int]) -> list[failures.StuckRegion]:
    """Regions the sensor stopped retrying (`liveness.stuck_regions`: its retry cap), not
    already reported from the merge runs' own failures, and not merged past since."""
    try:
        from . import liveness
    except ImportError:  # an older tree without the sensor's liveness module
        return []
    out = []
    for rid, s in sorted(liveness.stuck_regions(instance, table).items()):
        gen = s.get("generation")
        if rid in known or (gen is not None and merged.get(rid, 0) >= gen):
            continue
        attempts = int(s.get("attempts", 0))
        out.append(failures.StuckRegion(rid, gen, f"the sensor gave up after {attempts} merge runs without "
                                                  "progress", attempts, False))
    return out


def build_checks(cfg: TableConfig, merge_job_name: str | None = None) -> list:
    """The table's asset checks. Long because it is their definitions, each a closure over the
    table's keys and settings; the verdicts are in `lag_report`, `catchup_report` and the core."""
    keys = TableKeys(cfg.name)
    res = {keys.table_resource}
    merge_job_name = merge_job_name or f"{cfg.name}_merge"

    def loc_of(context):
        return getattr(context.resources, keys.table_resource).location()

    @asset_check(asset=keys.asset("region_generations"), name="region_exclusivity", required_resource_keys=res,
                 description="Rows of each region's pending generations route to that region, and no two "
                             "regions hold the same region value.")
    def region_exclusivity(context) -> AssetCheckResult:
        r = checks.check_exclusivity(loc_of(context))
        # Misrouted rows or a shared value stop the merger at that generation: not self-healing.
        return AssetCheckResult(passed=r.ok, severity=AssetCheckSeverity.ERROR, metadata={
            "regions_checked": MetadataValue.int(r.regions_checked),
            "rows_checked": MetadataValue.int(r.rows_checked),
            "misrouted_rows": MetadataValue.int(sum(r.mixed.values())),
            "mixed_regions": MetadataValue.json(bounded.top(r.mixed, key=lambda kv: -kv[1])),
            "shared_values": MetadataValue.json(bounded.top({v: rids[:5] for v, rids in r.shared.items()})),
            "region_errors": MetadataValue.json(bounded.top(r.region_errors))})

    @asset_check(asset=keys.asset("base_table"), name="merge_lag", required_resource_keys=res,
                 description=f"The oldest pending generation is younger than {cfg.slo.merge_lag_seconds:.0f} s "
                             "(WARN), and no region is stuck: refused by the merger, or failing merge run "
                             f"after run ({cfg.sensor.merge_attempts} runs, sensor.merge_attempts: the sensor "
                             "stops requesting merges then), or unreadable (ERROR).")
    def merge_lag(context) -> AssetCheckResult:
        loc = loc_of(context)
        st = status.table_status(loc)
        merged = {r.region_id: r.merged_generation for r in st.regions}
        history = failures.recent_failures(context.instance, merge_job_name, regions=merged)
        stuck = failures.stuck_regions(history, merged, cfg.sensor.merge_attempts)
        stuck += sensor_gave_up(context.instance, cfg.name, {s.region_id for s in stuck}, merged)
        known = {s.region_id for s in stuck}  # walls the merger recorded (memwal_core.state.walls)
        stuck += [failures.StuckRegion(r.region_id, r.wall, r.error or "", 0, True) for r in st.regions
                  if r.wall is not None and r.region_id not in known]
        labels = RegionLabels.of(loc) if stuck else RegionLabels()
        for s in stuck:
            context.log.error(s.describe(labels.label(s.region_id)))
        passed, severity, md = lag_report(st, cfg.slo.merge_lag_seconds, stuck, labels=labels)
        desc = md.pop("description", None)
        return AssetCheckResult(passed=passed, severity=severity, metadata=md,
                                description=desc.value if desc else None)

    # One check over every index, not one per index partition: a check result names at most one
    # partition, and only in a run of a single partition (1.13: partitioned checks are a preview,
    # and `AssetCheckResult` has no partition), while maintenance catches up every index in one
    # run over the index range. So the verdict and the metadata are per index: `gap/<index>`
    # (plotted) and the indexes over the SLO by name.
    @asset_check(asset=keys.asset("index_catchup"), name="catchup_gap", required_resource_keys=res,
                 description=f"Every gating index is at most {cfg.slo.catchup_gap_generations} generations "
                             "behind the merged generation in every region (reported per index).")
    def catchup_gap(context) -> AssetCheckResult:
        st = status.table_status(loc_of(context), with_age=False)
        return catchup_report(st, cfg.slo.catchup_gap_generations)

    @asset_check(asset=keys.asset("garbage"), name="gc_consistency", required_resource_keys=res,
                 description="No generation listed in a region manifest is missing on disk, and every "
                             "region manifest can be read (a region that cannot be read cannot be checked).")
    def gc_consistency(context) -> AssetCheckResult:
        region_errors: dict[str, str] = {}
        missing = checks.missing_generations(loc_of(context), region_errors)
        said = sorted(region_errors.values())[:2]
        if missing:
            said.insert(0, f"listed generations missing on disk, by region: {dict(sorted(missing.items())[:5])}")
        return AssetCheckResult(passed=not missing and not region_errors, severity=AssetCheckSeverity.ERROR,
                                description=bounded.short("; ".join(said)) if said else None, metadata={
            "missing_generations": MetadataValue.int(sum(len(v) for v in missing.values())),
            "regions": MetadataValue.json(bounded.top({k: v[:10] for k, v in missing.items()})),
            "regions_failed": MetadataValue.int(len(region_errors)),
            "region_errors": MetadataValue.json(bounded.top(region_errors))})

    @asset_check(asset=keys.asset("base_table"), name="mergeable", required_resource_keys=res,
                 description="Nothing the merger refuses before merging: a usable primary key, known table "
                             "features, and no region value held by two regions (mixed writers).")
    def mergeable(context) -> AssetCheckResult:
        found = blockers.merge_blockers(loc_of(context))
        for b in found:
            context.log.error(f"merge blocked ({b.kind}): {b.message}")
        said = "; ".join(f"merge blocked ({b.kind}): {b.message}" for b in found[:2])
        return AssetCheckResult(passed=not found, severity=AssetCheckSeverity.ERROR,
                                description=bounded.short(said) if said else None, metadata={
            "blockers": MetadataValue.int(len(found)),
            "kinds": MetadataValue.json(sorted({b.kind for b in found})),
            "details": MetadataValue.json(bounded.top({f"{b.kind}:{i}": b.message for i, b in enumerate(found)}))})

    grace = cfg.gc.discard_stale_after_seconds

    # ERROR: the writes these regions hold were abandoned by an overwrite, and a writer that
    # re-opened one is blocked behind them. Nothing fixes that but a decision (discard, or write
    # the rows again), and GC makes the decision itself once the grace has passed.
    @asset_check(asset=keys.asset("garbage"), name="stale_regions", required_resource_keys=res,
                 description="No region holds generations written before the MemWAL initialization (an "
                             "overwrite and initialize_mem_wal again): they are never merged, GC keeps them "
                             "until `memwal regions discard`" + (f" or {grace / 86400:g} days after they were "
                                                                 "first reported" if grace is not None else ""))
    def stale_regions(context) -> AssetCheckResult:
        r = checks.stale_regions(loc_of(context), grace)
        for rid, msg in sorted(r.regions.items())[:bounded.TOP_N]:
            context.log.error(msg)
        first = next(iter(sorted(r.regions.values())), None)
        return AssetCheckResult(passed=r.ok, severity=AssetCheckSeverity.ERROR, metadata={
            "initialization": MetadataValue.text(r.initialization),
            "stale_regions": MetadataValue.int(len(r.regions)),
            "stale_generations": MetadataValue.int(sum(len(v) for v in r.generations.values())),
            "regions": MetadataValue.json(bounded.top({k: v[:10] for k, v in r.generations.items()})),
            "discard_at": MetadataValue.json(bounded.top({k: round(v) for k, v in r.discard_at.items()})),
            "regions_failed": MetadataValue.int(len(r.region_errors)),
            "region_errors": MetadataValue.json(bounded.top(r.region_errors))},
            description=bounded.short(first) if first else None)

    return [region_exclusivity, merge_lag, catchup_gap, gc_consistency, mergeable, stale_regions]
