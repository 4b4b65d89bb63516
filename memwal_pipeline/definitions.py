"""Dagster definitions: one asset graph, sensor, jobs and schedule per configured table.

Loaded by `workspace.yaml` (`dagster dev -w workspace.yaml`, `make ui`) and by the CLI, which
materializes the same assets in process.
"""

from __future__ import annotations

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
from .config import TableConfig, load_config
from .resources import spark_resource, table_resource
from .sensors import build_sensor


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

    def checks_for(self, asset_key) -> list:
        """The asset checks that target `asset_key` (to materialize an asset with its checks)."""
        return [c for c in self.checks if any(k.asset_key == asset_key for k in c.check_keys)]


def table_definitions(cfg: TableConfig) -> TableDefs:
    keys = TableKeys(cfg.name)
    partitions = DynamicPartitionsDefinition(name=keys.partitions)
    assets = build_assets(cfg, partitions)
    checks = build_checks(cfg)
    merge_job = define_asset_job(
        f"{cfg.name}_merge", selection=AssetSelection.assets(keys.asset("base_table")),
        partitions_def=partitions, tags={"memwal/table": cfg.name},
        description=f"Merge flushed generations of {cfg.name} into its base table (one run per region, "
                    "or many regions in one run as a backfill).")
    maintenance_job = define_asset_job(
        f"{cfg.name}_maintenance",
        selection=AssetSelection.assets(keys.asset("base_compaction"), keys.asset("memwal_index"),
                                        keys.asset("index_catchup"), keys.asset("garbage")),
        tags={"memwal/table": cfg.name},
        description=f"After merges: compact the base table when its health asks for it, snapshot region "
                    "manifests into the MemWAL index, catch indexes up, collect garbage.")
    sensor = build_sensor(cfg, partitions, merge_job, maintenance_job)
    schedule = ScheduleDefinition(name=f"{cfg.name}_maintenance_schedule", job=maintenance_job,
                                  cron_schedule=cfg.maintenance_cron, default_status=DefaultScheduleStatus.RUNNING,
                                  description="Periodic maintenance even without merges (orphans, WAL hints, retention).")
    resources = {keys.table_resource: table_resource(cfg), keys.spark_resource: spark_resource(cfg)}
    return TableDefs(cfg, partitions, assets, checks, merge_job, maintenance_job, sensor, schedule, resources)


def build_definitions(tables: list[TableConfig]) -> Definitions:
    parts = [table_definitions(t) for t in tables]
    return Definitions(
        assets=[a for p in parts for a in p.assets],
        asset_checks=[c for p in parts for c in p.checks],
        jobs=[j for p in parts for j in (p.merge_job, p.maintenance_job)],
        sensors=[p.sensor for p in parts],
        schedules=[p.schedule for p in parts],
        resources={k: v for p in parts for k, v in p.resources.items()},
    )


@definitions
def defs() -> Definitions:
    """The code location's definitions, built when Dagster loads them, never at import: the CLI
    and any other importer of this module work without a config file (`memwal maintain URI`
    from any directory after a plain `pip install`)."""
    return build_definitions(load_config())
