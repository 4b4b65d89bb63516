"""A tick's decision as Dagster sees it: run requests, dynamic-partition requests, observations,
log lines, the cursor, or a skip reason; and the sensor's memory written back.

Nothing is decided here: every choice is in the `Decision`. What this adds is Dagster's shape
(tags, partition ranges, metadata values) and the one write of the tick, the memory rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from dagster import (
    MAX_RUNTIME_SECONDS_TAG,
    AssetMaterialization,
    AssetObservation,
    DynamicPartitionsDefinition,
    MetadataValue,
    RunRequest,
    SensorResult,
    SkipReason,
)

from .. import liveness
from ..assets import TableKeys, merge_region_metadata, region_metadata
from ..config import TableConfig
from ..freshness import idle_record
from ..partitions import NOT_RECORDED
from ..tags import PARTITION_RANGE_END, PARTITION_RANGE_START, REGION_VALUE_TAG, partition_range
from . import decide
from .observation import Observation
from .tick_merge import MERGED_BY, TickMerge


def merge_run(cfg: TableConfig, job_name: str, request: decide.MergeRequest,
              labels: Mapping[str, str] | None = None) -> RunRequest:
    """One run over the requested regions: the partition of one, or the range of several. The run
    of one region also carries its value (`memwal/region_value`, when the tick read it), which the
    runs list shows beside the partition's UUID."""
    # Run monitoring fails a run that outlives this; with the default run launcher it is the
    # only way a run whose worker died with its code server (daemon killed, host lost) stops
    # holding the pool; a worker killed alone is failed by the code server at once.
    tags = {"memwal/table": cfg.name, MAX_RUNTIME_SECONDS_TAG: str(int(cfg.sensor.merge_max_runtime_seconds)),
            "memwal/attempt": str(request.attempt)}
    if len(request.merges) == 1:
        m = request.merges[0]
        value = (labels or {}).get(m.region_id)
        value = None if value == NOT_RECORDED else value
        return RunRequest(run_key=request.run_key, job_name=job_name, partition_key=m.region_id,
                          tags={**tags, "memwal/region": m.region_id, "memwal/generation": str(m.top),
                                **({REGION_VALUE_TAG: value} if value else {})})
    return RunRequest(run_key=request.run_key, job_name=job_name,
                      tags={**tags, "memwal/regions": str(len(request.merges)),
                            PARTITION_RANGE_START: request.merges[0].region_id,
                            PARTITION_RANGE_END: request.merges[-1].region_id})


def observations(cfg: TableConfig, obs: Observation, d: decide.Decision) -> list:
    """The tick's asset events. `region_generations` holds data written outside Dagster (the
    writers flush generations), so, as Dagster records external data, the sensor reports each
    changed region as a materialization of its partition (its state: generations, lag, value).
    A region first seen already merged to its newest generation gets a `base_table`
    materialization saying so (a new instance of a maintained table shows it merged, not
    missing). An idle table gets the table-wide record that its base table is current
    (`freshness.py`). Each newly stuck region gets an observation with the reason."""
    keys = TableKeys(cfg.name)
    key = keys.asset("region_generations")
    out: list = [AssetMaterialization(asset_key=key, partition=rid, metadata=region_metadata(obs.statuses[rid],
                                                                                           obs.labels.get(rid)))
                 for rid in d.observed]
    for rid in d.add_partitions if obs.merged is not None else ():
        st, probe, merged = d.memory.get(rid), obs.probes.get(rid), obs.merged.get(rid, 0)
        if st is None or probe is None or not probe.ok or not merged or st.top > merged:
            continue
        md = {"merged_generation": MetadataValue.int(merged),
              "pending_generations": MetadataValue.int(0),
              "recorded_by": MetadataValue.text("sensor: merged before this instance first saw the region")}
        if rid in obs.labels:
            md["region_value"] = MetadataValue.text(obs.labels[rid])
        out.append(AssetMaterialization(asset_key=keys.asset("base_table"), partition=rid, metadata=md))
    if d.record_idle:
        out.append(idle_record(keys.asset("base_table"), len(d.regions)))
    for rid in d.became_stuck:
        st = d.memory[rid]
        out.append(AssetObservation(asset_key=key, partition=rid, metadata={
            "stuck": MetadataValue.bool(True), "stuck_generation": MetadataValue.int(st.base + 1),
            "failed_attempts": MetadataValue.int(st.attempts),
            "reason": MetadataValue.text(decide.stuck_reason(rid, st, (obs.walls or {}).get(rid),
                                                             obs.labels.get(rid))),
            **({"region_value": MetadataValue.text(obs.labels[rid])} if rid in obs.labels else {})}))
    return out


def merged_in_tick(cfg: TableConfig, obs: Observation, tm: TickMerge) -> list:
    """A `base_table` materialization per region the tick's own merge merged (as a run records
    it, plus `merged_by`), so the UI and maintenance see tick merges as they see runs."""
    key = TableKeys(cfg.name).asset("base_table")
    return [AssetMaterialization(asset_key=key, partition=rid, metadata={
        **merge_region_metadata(tm.outcome, rid, obs.labels.get(rid)),
        "merged_by": MetadataValue.text(MERGED_BY),
        "run/spark_attach_s": MetadataValue.float(round(tm.attach_s, 3))}) for rid in tm.merged]


def emit(context, cfg: TableConfig, obs: Observation, d: decide.Decision, state: liveness.SensorState, *,
         partitions: DynamicPartitionsDefinition, merge_job: str, maintenance_job: str,
         indexes: DynamicPartitionsDefinition,
         index_upkeep: decide.IndexPartitions | None, in_tick: TickMerge | None = None) -> SensorResult | SkipReason:
    """Log, store the memory, and return what Dagster applies (a skip when nothing changed).
    `in_tick`: the merge the tick ran itself; when clean (or still running from an earlier
    tick), the decided merge run is not requested."""
    for n in d.notices:
        getattr(context.log, n.level)(n.message)
    if in_tick is not None:
        shown = ", ".join(in_tick.regions[:5]) + (f" and {len(in_tick.regions) - 5} more" if len(in_tick.regions) > 5
                                                  else "")
        context.log.info(f"{cfg.name}: regions {shown}: {in_tick.reason}")
    dynamic = []
    if d.add_partitions:
        dynamic.append(partitions.build_add_request(list(d.add_partitions)))
    if d.delete_partitions:
        dynamic.append(partitions.build_delete_request(list(d.delete_partitions)))
    run_requests = [merge_run(cfg, merge_job, d.merge, obs.labels)] if d.merge and not (
        in_tick and (in_tick.clean or in_tick.busy)) else []
    if d.maintenance is not None:
        index_range: dict[str, str] = {}
        if index_upkeep is not None:
            if index_upkeep.add:
                dynamic.append(indexes.build_add_request(list(index_upkeep.add)))
            if index_upkeep.delete:
                dynamic.append(indexes.build_delete_request(list(index_upkeep.delete)))
            if index_upkeep.order:
                index_range = partition_range(index_upkeep.order[0], index_upkeep.order[-1])
        run_requests.append(RunRequest(run_key=f"maintenance:{d.maintenance}", job_name=maintenance_job,
                                       tags={"memwal/table": cfg.name, **index_range}))
    events = observations(cfg, obs, d) + (merged_in_tick(cfg, obs, in_tick) if in_tick is not None else [])
    state.regions = dict(d.memory)
    cursor = replace(d.cursor, digest=state.save(obs.now)).dump()
    if not (run_requests or events or dynamic) and cursor == (context.cursor or ""):
        return SkipReason(f"{cfg.name}: {len(d.regions)} regions unchanged ({len(obs.recheck)} re-checked against "
                          "their version hint)")
    return SensorResult(run_requests=run_requests, dynamic_partitions_requests=dynamic, asset_events=events,
                        cursor=cursor)
