"""One sensor evaluation applied to a Dagster instance the way the sensor daemon applies it,
and the run requests it made."""

from __future__ import annotations

from dagster import SkipReason, build_sensor_context, partition_loading_context

from memwal_core.state import region
from memwal_pipeline.sensors import evaluate_tick


def tick(defs, td, instance, cursor=None, through_dagster=None, now=None):
    """One sensor evaluation, applied to the instance the way the sensor daemon applies it.

    Ticks that add or delete partitions call the sensor's body directly (Dagster's test-time
    `evaluate_tick` resolves partition keys before applying the partitions the same result
    adds, which the daemon does not); so do ticks at a given time `now`; other ticks go
    through the sensor definition.
    """
    ctx = build_sensor_context(instance=instance, cursor=cursor, definitions=defs, resources=td.resources)
    known = set(instance.get_dynamic_partitions(td.partitions.name))
    listed = set(region.list_regions(td.resources[f"{td.cfg.name}_table"].location().store).region_ids)
    if through_dagster is None:
        through_dagster = listed <= known and now is None
    if through_dagster:
        with partition_loading_context(dynamic_partitions_store=instance):
            data = defs.get_sensor_def(td.sensor.name).evaluate_tick(ctx)
    else:
        loc = td.resources[f"{td.cfg.name}_table"].location()
        data = evaluate_tick(ctx, td.cfg, td.partitions, td.merge_job.name, td.maintenance_job.name, loc, now=now)
        if isinstance(data, SkipReason):
            return _Skip(data.skip_message), cursor
    for req in data.dynamic_partitions_requests or []:
        if hasattr(req, "partition_keys") and type(req).__name__.startswith("Delete"):
            for key in req.partition_keys:
                instance.delete_dynamic_partition(req.partitions_def_name, key)
        else:
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    for ev in data.asset_events or []:
        instance.report_runless_asset_event(ev)
    return data, (data.cursor if data.cursor is not None else cursor)


class _Skip:
    """A skipped tick, shaped like a result with no run requests."""

    def __init__(self, message):
        self.skip_message = message
        self.run_requests = []


def run_requests(data):
    """The run requests of a tick's result (none for a skipped tick)."""
    return list(data.run_requests or [])
