"""Asset checks: region exclusivity, merge lag, catch-up gap, GC consistency.

WARN severity: a failing check shows in the UI (and alerts) without blocking maintenance of
the healthy regions; a broken region is already held back by the merger itself.
"""

from __future__ import annotations

from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue, asset_check

from memwal_core import checks, status

from .assets import TableKeys
from .config import TableConfig


def build_checks(cfg: TableConfig) -> list:
    keys = TableKeys(cfg.name)
    res = {keys.table_resource}

    def loc_of(context):
        return getattr(context.resources, keys.table_resource).location()

    @asset_check(asset=keys.asset("region_generations"), name="region_exclusivity", required_resource_keys=res,
                 description="Rows of each region's pending generations route to that region, and no two "
                             "regions hold the same region value.")
    def region_exclusivity(context) -> AssetCheckResult:
        r = checks.check_exclusivity(loc_of(context))
        return AssetCheckResult(passed=r.ok, severity=AssetCheckSeverity.WARN, metadata={
            "regions_checked": MetadataValue.int(r.regions_checked),
            "rows_checked": MetadataValue.int(r.rows_checked),
            "misrouted_rows": MetadataValue.int(sum(r.mixed.values())),
            "mixed_regions": MetadataValue.json(r.mixed),
            "shared_values": MetadataValue.json(r.shared),
            "errors": MetadataValue.json(r.errors)})

    @asset_check(asset=keys.asset("base_table"), name="merge_lag", required_resource_keys=res,
                 description=f"The oldest pending generation is younger than {cfg.merge_lag_slo_seconds:.0f} s.")
    def merge_lag(context) -> AssetCheckResult:
        st = status.table_status(loc_of(context))
        age = st.oldest_pending_age_s or 0.0
        worst = sorted(((r.oldest_pending_age_s or 0.0, r.region_id) for r in st.regions), reverse=True)[:5]
        return AssetCheckResult(passed=age <= cfg.merge_lag_slo_seconds and not st.failed_regions,
                                severity=AssetCheckSeverity.WARN, metadata={
                                    "oldest_pending_age_s": MetadataValue.float(age),
                                    "slo_seconds": MetadataValue.float(cfg.merge_lag_slo_seconds),
                                    "pending_generations": MetadataValue.int(st.pending_generations),
                                    "worst_regions": MetadataValue.json([{"region": r, "age_s": a} for a, r in worst]),
                                    "unreadable_regions": MetadataValue.json(st.failed_regions)})

    @asset_check(asset=keys.asset("index_catchup"), name="catchup_gap", required_resource_keys=res,
                 description=f"Every gating index is at most {cfg.catchup_gap_slo_generations} generations "
                             "behind the merged generation in every region.")
    def catchup_gap(context) -> AssetCheckResult:
        st = status.table_status(loc_of(context), with_age=False)
        gaps = {i.name: i.max_gap for i in st.indexes if i.gating}
        worst = max(gaps.values() or [0])
        return AssetCheckResult(passed=worst <= cfg.catchup_gap_slo_generations, severity=AssetCheckSeverity.WARN,
                                metadata={"max_gap": MetadataValue.int(worst), "gaps": MetadataValue.json(gaps),
                                          "slo_generations": MetadataValue.int(cfg.catchup_gap_slo_generations)})

    @asset_check(asset=keys.asset("garbage"), name="gc_consistency", required_resource_keys=res,
                 description="No generation listed in a region manifest is missing on disk.")
    def gc_consistency(context) -> AssetCheckResult:
        missing = checks.missing_generations(loc_of(context))
        return AssetCheckResult(passed=not missing, severity=AssetCheckSeverity.ERROR, metadata={
            "missing_generations": MetadataValue.int(sum(len(v) for v in missing.values())),
            "regions": MetadataValue.json(missing)})

    return [region_exclusivity, merge_lag, catchup_gap, gc_consistency]
