"""base_table's freshness: Dagster's policy, and the sensor's record that an idle table is current.

Dagster's `FreshnessPolicy.time_window` measures the time since the asset's last
materialization, nothing else. A table nobody writes to has nothing to merge, so no merge run
materializes `base_table`, and the table would read "late" although its base table holds every
flushed generation. The manifest sensor already knows when that is so (every region merged to
its newest flushed generation), and it records it: one table-wide `base_table` materialization
marked `recorded_by: IDLE_RECORD`, at most every `refresh_seconds` (half the freshness window),
only on ticks where nothing is pending, requested, in flight, stuck or unreadable.

Such a record is not a merge: the sensor's maintenance watermark skips it
(`sensor/observe.maintenance`), so an idle table gets no maintenance run per record.
"""

from __future__ import annotations

from datetime import timedelta

from dagster import AssetKey, AssetMaterialization, FreshnessPolicy, MetadataValue

from .config import TableConfig

IDLE_RECORD = "sensor: nothing to merge, every flushed generation is in the base table"
MIN_WINDOW_S = 60.0  # Dagster's smallest freshness window


def window_seconds(cfg: TableConfig) -> float:
    return max(MIN_WINDOW_S, float(cfg.slo.merge_lag_seconds))


def merge_freshness(cfg: TableConfig) -> FreshnessPolicy:
    """base_table goes stale when it was not materialized for `slo.merge_lag_seconds` (at least
    a minute): by a merge, or by the sensor's record that the table is idle and current."""
    return FreshnessPolicy.time_window(fail_window=timedelta(seconds=window_seconds(cfg)))


def refresh_seconds(cfg: TableConfig) -> float:
    """How often the sensor records an idle table as current: half the window, so a sensor
    interval shorter than that keeps it fresh without an event every tick."""
    return window_seconds(cfg) / 2


def idle_record(base_table: AssetKey, regions: int) -> AssetMaterialization:
    """The table-wide record that the base table is current (no partition: it is about all of them)."""
    return AssetMaterialization(asset_key=base_table, metadata={
        "recorded_by": MetadataValue.text(IDLE_RECORD),
        "pending_generations": MetadataValue.int(0),
        "regions": MetadataValue.int(regions)})


def is_idle_record(materialization: AssetMaterialization | None) -> bool:
    if materialization is None:
        return False
    value = materialization.metadata.get("recorded_by")
    return getattr(value, "value", value) == IDLE_RECORD
