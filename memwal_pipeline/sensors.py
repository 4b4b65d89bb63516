"""The manifest sensor: one per table, cheap on unchanged regions, nothing left waiting.

A tick is three steps (`memwal_pipeline/sensor/`):
- `observe` does all the reading (the sensor's memory in the instance's key-value rows, a
  listing of `_mem_wal/`, one HEAD per unchanged region, merge progress, runs in flight, the
  newest base_table materialization) into a frozen `Observation`;
- `decide` is a pure function of that observation, the cursor and `SensorOptions`: per
  region a verdict (request a merge, in flight, backing off, stuck, retire, unreadable), one
  merge run for every requested region, new and retired partitions, maintenance after a
  merge; its docstring states the "nothing waits forever" guarantee, which its tests check;
- a small merge the tick decided on runs in the tick itself when the table's Connect server
  is up (`sensor/tick_merge.py`: no run launch); anything it does not finish goes to a run;
- `emit` turns the decision into Dagster's run requests, dynamic-partition requests,
  observations, log lines and cursor, and writes the memory back.

The cursor holds an epoch, the maintenance watermark and a digest, so each tick stores well
under 2 KB whatever the number of regions (`liveness` says why the per-region state is not in
the cursor and how retries are paced).
"""

from __future__ import annotations

import time

from dagster import (
    DefaultScheduleStatus,
    DefaultSensorStatus,
    DynamicPartitionsDefinition,
    RunRequest,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    schedule,
    sensor,
)

from memwal_core.state.store import TableLocation

from . import pools
from .assets import TableKeys
from .config import TableConfig
from .freshness import refresh_seconds
from .partitions import index_partitions, index_range_tags
from .sensor import decide, emit, observe, tick_merge
from .sensor.decide import DOWNTIME_INTERVALS, VERIFY_EVERY
from .sensor.observation import Cursor
from .sensor.observe import SensorError, Watched

__all__ = ["DOWNTIME_INTERVALS", "VERIFY_EVERY", "Cursor", "SensorError", "build_maintenance_schedule", "build_sensor",
           "evaluate_tick"]


def evaluate_tick(context: SensorEvaluationContext, cfg: TableConfig, partitions: DynamicPartitionsDefinition,
                  merge_job_name: str, maintenance_job_name: str, loc: TableLocation, now: float | None = None,
                  index_parts: DynamicPartitionsDefinition | None = None) -> SensorResult | SkipReason:
    """One tick of `cfg`'s sensor at `now` (default: the clock): observe, decide, emit."""
    now = time.time() if now is None else now
    if pools.ensure_limit(context.instance, cfg.pool):
        context.log.info(f"{cfg.name}: pool {cfg.pool} had no limit in this Dagster instance: set to "
                         f"{pools.POOL_LIMIT} (one run of the table at a time; memwal_pipeline/pools.py)")
    index_parts = index_parts or index_partitions(cfg.name)
    cursor = Cursor.parse(context.cursor)
    keys = TableKeys(cfg.name)
    watched = Watched(cfg.name, loc, partitions.name, merge_job_name, maintenance_job_name,
                      keys.asset("base_table"), keys.asset("garbage"))
    seen, memory = observe.observe(context.instance, watched, cursor, cfg.sensor, now)
    decision = decide.decide(seen, cursor, cfg.sensor, idle_every=refresh_seconds(cfg))
    in_tick = (tick_merge.merge_in_tick(cfg, loc, decision.merge, holder=f"sensor {cfg.name}_manifest_sensor",
                                        log=context.log)
               if decision.merge is not None else None)
    upkeep = (observe.index_partitions(context.instance, index_parts.name, loc)
              if decision.maintenance is not None else None)
    return emit.emit(context, cfg, seen, decision, memory, partitions=partitions, merge_job=merge_job_name,
                     maintenance_job=maintenance_job_name, indexes=index_parts, index_upkeep=upkeep,
                     in_tick=in_tick)


def build_sensor(cfg: TableConfig, partitions: DynamicPartitionsDefinition, merge_job, maintenance_job,
                 indexes: DynamicPartitionsDefinition | None = None):
    keys = TableKeys(cfg.name)
    indexes = indexes or index_partitions(cfg.name)

    @sensor(name=f"{cfg.name}_manifest_sensor", minimum_interval_seconds=cfg.sensor.interval_seconds,
            default_status=DefaultSensorStatus.RUNNING, jobs=[merge_job, maintenance_job],
            required_resource_keys={keys.table_resource},
            description=f"Watches the region manifests of {cfg.name}: new regions become partitions, new "
                        "flushed generations get merge runs, merges are followed by maintenance.")
    def manifest_sensor(context: SensorEvaluationContext):
        loc = getattr(context.resources, keys.table_resource).location()
        return evaluate_tick(context, cfg, partitions, merge_job.name, maintenance_job.name, loc, index_parts=indexes)

    return manifest_sensor


def build_maintenance_schedule(cfg: TableConfig, maintenance_job, indexes: DynamicPartitionsDefinition | None = None):
    """Maintenance without merges (orphans, WAL hints, retention), over every index partition
    the sensor keeps (a schedule cannot add partitions; `index_catchup` catches up every index
    anyway and the next maintenance request by the sensor adds the missing partitions)."""
    indexes = indexes or index_partitions(cfg.name)

    @schedule(name=f"{cfg.name}_maintenance_schedule", job=maintenance_job,
              cron_schedule=cfg.schedule.maintenance_cron, default_status=DefaultScheduleStatus.RUNNING,
              description="Periodic maintenance even without merges (orphans, WAL hints, retention).")
    def maintenance_schedule(context: ScheduleEvaluationContext) -> RunRequest:
        pools.ensure_limit(context.instance, cfg.pool)
        return RunRequest(tags={"memwal/table": cfg.name, **index_range_tags(context.instance, indexes)})

    return maintenance_schedule
