"""Dagster definitions: one asset graph, sensor, jobs and schedule per configured table.

Loaded by `workspace.yaml` (`dagster dev -w workspace.yaml`, `make ui`) and by the CLI, which
materializes the same assets in process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dagster import (
    AssetSelection,
    DefaultScheduleStatus,
    Definitions,
    DynamicPartitionsDefinition,
    ScheduleDefinition,
    define_asset_job,
    definitions,
)

from .assets import TableKeys, build_assets
from .checks import build_checks
from .config import ConfigError, TableConfig, load_config
from .partitions import index_partitions
from .resources import spark_resource, table_resource
from .sensors import build_maintenance_schedule, build_sensor

# A run over a partition range makes Dagster store one "materialization planned" event per
# partition of the range at run creation (~35 ms each on SQLite: 3,000 regions cost ~100 s
# before the run starts, docs/benchmarks.md §9). With this setting Dagster stores one event per
# run instead; the price is that a failed run no longer marks its partitions failed (the run's
# failure and `merge_lag` name the region instead). Read where runs are created: set it in the
# daemon's and webserver's environment too (`make ui` does; see README).
PLANNED_EVENTS_ENV = "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS"
os.environ.setdefault(PLANNED_EVENTS_ENV, "true")

# Scheduled checks (region exclusivity reads rows of pending generations: hourly, off the hour
# the maintenance schedule uses).
CHECKS_CRON = "30 * * * *"


@dataclass
class TableDefs:
    cfg: TableConfig
    partitions: DynamicPartitionsDefinition
    assets: list
    checks: list
    merge_job: object
    maintenance_job: object
    sensor: object
    schedule: ScheduleDefinition
    resources: dict
    checks_job: object = None
    checks_schedule: ScheduleDefinition | None = None
    index_partitions: DynamicPartitionsDefinition | None = None  # index_catchup: one per base-table index

    def checks_for(self, asset_key) -> list:
        """The asset checks that target `asset_key` (to materialize an asset with its checks)."""
        return [c for c in self.checks if any(k.asset_key == asset_key for k in c.check_keys)]


def table_definitions(cfg: TableConfig) -> TableDefs:
    keys = TableKeys(cfg.name)
    partitions = DynamicPartitionsDefinition(name=keys.partitions)
    indexes = index_partitions(cfg.name)
    assets = build_assets(cfg, partitions, indexes)
    checks = build_checks(cfg, f"{cfg.name}_merge")
    by_name = {next(iter(c.check_keys)).name: c for c in checks}
    # The merge job carries no check: checks read every region, a merge run only its own.
    merge_job = define_asset_job(
        f"{cfg.name}_merge", selection=AssetSelection.assets(keys.asset("base_table")).without_checks(),
        partitions_def=partitions, tags={"memwal/table": cfg.name},
        description=f"Merge flushed generations of {cfg.name} into its base table (one run per region, "
                    "or many regions in one run as a backfill).")
    maintenance_job = define_asset_job(
        f"{cfg.name}_maintenance",
        selection=AssetSelection.assets(keys.asset("base_compaction"), keys.asset("memwal_index"),
                                        keys.asset("index_catchup"), keys.asset("garbage"))
        | AssetSelection.checks(by_name["merge_lag"]),
        tags={"memwal/table": cfg.name},
        description="After merges and hourly: compact the base table when its health asks for it, snapshot "
                    "region manifests into the MemWAL index, catch indexes up, collect garbage; checks merge "
                    "lag (stuck regions), catch-up gap and GC consistency.")
    checks_job = define_asset_job(
        f"{cfg.name}_checks", selection=AssetSelection.checks(by_name["region_exclusivity"], by_name["merge_lag"]),
        tags={"memwal/table": cfg.name},
        description="Scheduled health checks: region exclusivity (reads pending rows) and merge lag.")
    checks_schedule = ScheduleDefinition(name=f"{cfg.name}_checks_schedule", job=checks_job,
                                         cron_schedule=CHECKS_CRON, default_status=DefaultScheduleStatus.RUNNING,
                                         description="Region exclusivity and merge lag, every hour at :30.")
    sensor = build_sensor(cfg, partitions, merge_job, maintenance_job, indexes)
    schedule = build_maintenance_schedule(cfg, maintenance_job, indexes)
    resources = {keys.table_resource: table_resource(cfg), keys.spark_resource: spark_resource(cfg)}
    return TableDefs(cfg, partitions, assets, checks, merge_job, maintenance_job, sensor, schedule, resources,
                     checks_job, checks_schedule, indexes)


def check_connect_servers(tables: list[TableConfig]) -> None:
    """Tables sharing a Spark Connect URL share its server, whose master is fixed at start:
    refuse different masters at load time (per-session settings are fine; other fixed settings
    are checked against the running server by `spark_connect.apply_session_conf`)."""
    by_url: dict[str, TableConfig] = {}
    for t in tables:
        if not t.spark.connect:
            continue
        first = by_url.setdefault(t.spark.connect, t)
        if first.spark.master != t.spark.master:
            raise ConfigError(f"tables {first.name!r} and {t.name!r} share the Spark Connect server "
                              f"{t.spark.connect} but ask for different masters ({first.spark.master!r}, "
                              f"{t.spark.master!r}); one server runs one master: give one of them its own "
                              "spark.connect port")


def build_definitions(tables: list[TableConfig]) -> Definitions:
    check_connect_servers(tables)
    parts = [table_definitions(t) for t in tables]
    return Definitions(
        assets=[a for p in parts for a in p.assets],
        asset_checks=[c for p in parts for c in p.checks],
        jobs=[j for p in parts for j in (p.merge_job, p.maintenance_job, p.checks_job)],
        sensors=[p.sensor for p in parts],
        schedules=[s for p in parts for s in (p.schedule, p.checks_schedule)],
        resources={k: v for p in parts for k, v in p.resources.items()},
    )


@definitions
def defs() -> Definitions:
    """The code location's definitions, built when Dagster loads them, never at import: the CLI
    and any other importer of this module work without a config file (`memwal maintain URI`
    from any directory after a plain `pip install`)."""
    return build_definitions(load_config())
