"""Dagster definitions: one asset graph, sensor, jobs and schedule per configured table.

`defs` is the code location: `workspace.yaml` (`dagster dev -w workspace.yaml`, `make ui`) and
the dg project (`dg dev`, `dg check defs`; `[tool.dg]` in pyproject.toml) both load it. Its
tables are the `MemWalTable` components of the defs folder (`memwal_pipeline/defs/<table>/
defs.yaml`) plus the tables of memwal.yaml (`MEMWAL_CONFIG`, or memwal.yaml at the repo root when
it exists): one schema, and a table configured in both is refused. The CLI materializes the same
assets in process (`table_definitions`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dagster import (
    AssetSelection,
    ComponentTree,
    DefaultScheduleStatus,
    Definitions,
    DynamicPartitionsDefinition,
    ScheduleDefinition,
    define_asset_job,
    definitions,
    in_process_executor,
)

from . import pools
from .assets import TableKeys, build_assets
from .checks import build_checks
from .config import DEFAULT_CONFIG, REPO_ROOT, TableConfig, TableSpec, check_connect_servers, check_tables, load_config  # noqa: F401
from .partitions import index_partitions
from .resources import spark_resource, table_resource
from .sensors import build_maintenance_schedule, build_sensor

# A run over a partition range makes Dagster store one "materialization planned" event per
# partition of the range at run creation (~35 ms each on SQLite: 3,000 regions cost ~100 s
# before the run starts, docs/benchmarks.md §9). With this setting Dagster stores one event per
# run instead; the price is that a failed run no longer marks its partitions failed (the run's
# failure and `merge_lag` name the region instead). Read where runs are created: set it in the
# daemon's and webserver's environment too (`make ui` does; see docs/operations.md).
PLANNED_EVENTS_ENV = "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS"
os.environ.setdefault(PLANNED_EVENTS_ENV, "true")

# The jobs run their steps in the run's own process: the default multiprocess executor starts
# a second Python process per step, which imports Dagster and memwal and loads the code
# location again (seconds per run, docs/benchmarks.md §6), and the steps of a table's runs are
# sequential anyway (one pool, one Spark session shared by the maintenance steps).
EXECUTOR = in_process_executor

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
        partitions_def=partitions, tags={"memwal/table": cfg.name}, executor_def=EXECUTOR,
        description=f"Merge flushed generations of {cfg.name} into its base table (one run per region, "
                    "or many regions in one run as a backfill).")
    maintenance_job = define_asset_job(
        f"{cfg.name}_maintenance",
        selection=AssetSelection.assets(keys.asset("base_compaction"), keys.asset("memwal_index"),
                                        keys.asset("index_catchup"), keys.asset("garbage"))
        | AssetSelection.checks(by_name["merge_lag"]),
        tags={"memwal/table": cfg.name}, executor_def=EXECUTOR,
        description="After merges and hourly: compact the base table when its health asks for it, snapshot "
                    "region manifests into the MemWAL index, catch indexes up, collect garbage; checks merge "
                    "lag (stuck regions), catch-up gap and GC consistency.")
    checks_job = define_asset_job(
        f"{cfg.name}_checks", selection=AssetSelection.checks(by_name["region_exclusivity"], by_name["merge_lag"],
                                                              by_name["mergeable"]),
        tags={"memwal/table": cfg.name}, executor_def=EXECUTOR,
        description="Scheduled health checks: region exclusivity (reads pending rows), merge lag, and what "
                    "would stop a merge (mergeable).")
    checks_schedule = ScheduleDefinition(name=f"{cfg.name}_checks_schedule", job=checks_job,
                                         cron_schedule=CHECKS_CRON, default_status=DefaultScheduleStatus.RUNNING,
                                         description="Region exclusivity and merge lag, every hour at :30.")
    sensor = build_sensor(cfg, partitions, merge_job, maintenance_job, indexes)
    schedule = build_maintenance_schedule(cfg, maintenance_job, indexes)
    resources = {keys.table_resource: table_resource(cfg), keys.spark_resource: spark_resource(cfg)}
    return TableDefs(cfg, partitions, assets, checks, merge_job, maintenance_job, sensor, schedule, resources,
                     checks_job, checks_schedule, indexes)


def build_definitions(tables: list[TableConfig]) -> Definitions:
    check_tables(tables)
    pools.warn_if_unlimited([t.pool for t in tables])  # runs of one table apart: memwal_pipeline/pools.py
    parts = [table_definitions(t) for t in tables]
    return Definitions(
        assets=[a for p in parts for a in p.assets],
        asset_checks=[c for p in parts for c in p.checks],
        jobs=[j for p in parts for j in (p.merge_job, p.maintenance_job, p.checks_job)],
        sensors=[p.sensor for p in parts],
        schedules=[s for p in parts for s in (p.schedule, p.checks_schedule)],
        resources={k: v for p in parts for k, v in p.resources.items()},
    )


DEFS_FOLDER = Path(__file__).resolve().parent / "defs"


def project_tree() -> ComponentTree | None:
    """The dg project of this checkout (`[tool.dg]` in the repo's pyproject.toml, the defs folder
    `memwal_pipeline/defs`); None for an installed wheel, which carries no defs folder."""
    if not DEFS_FOLDER.is_dir() or not (REPO_ROOT / "pyproject.toml").is_file():
        return None
    return ComponentTree.for_project(path_within_project=REPO_ROOT)


def config_tables() -> list[TableConfig]:
    """memwal.yaml's tables: the file `MEMWAL_CONFIG` names (it must exist), else the repo's
    memwal.yaml when there is one."""
    if os.environ.get("MEMWAL_CONFIG") or DEFAULT_CONFIG.is_file():
        return load_config()
    return []


def location_definitions() -> Definitions:
    """The defs folder's `MemWalTable` components and memwal.yaml's tables, checked together
    (a table configured in both places would get two pools)."""
    tree = project_tree()
    from_file = config_tables()
    if tree is None:
        return build_definitions(from_file)
    components = [c.table_config() for c in tree.get_all_components(TableSpec)]
    check_tables(components + from_file, "defs folder and memwal.yaml")
    return Definitions.merge(tree.build_defs(), build_definitions(from_file))


@definitions
def defs() -> Definitions:
    """The code location's definitions, built when Dagster loads them, never at import: the CLI
    and any other importer of this module work without a config file (`memwal maintain URI`
    from any directory after a plain `pip install`)."""
    return location_definitions()
