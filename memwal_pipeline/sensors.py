"""The manifest sensor: one per table, cheap on unchanged regions, nothing left waiting.

Per-region state (manifest version, newest generation, attempts) lives in the instance's
key-value store (`liveness.SensorState`); the cursor holds an epoch, the maintenance watermark
and a digest, so each tick stores well under 2 KB whatever the number of regions. A tick:
1. lists `_mem_wal/` (one request) to find new regions, which become partitions; with no
   region at all it checks that the table exists (a missing table is an error, not an idle
   table);
2. HEAD-probes each known region at its last version + 1 (one request per unchanged region).
   A cursor version can be collected by GC while the sensor is away, and then "version + 1 is
   missing" says nothing: after downtime (no tick for 3 intervals, or no state) every region
   is re-probed from its version hint (listing its manifest directory only when the hint is
   unusable or names a collected version), and a rotating 1/`VERIFY_EVERY` slice of regions
   is re-checked that way every tick, so one tick after downtime converges and a burst of
   commits between two ticks cannot hide a region for more than `VERIFY_EVERY` ticks;
3. reads regions whose manifest moved, records an observation of `region_generations`;
4. reconciles: every region with generations above its merged progress and no merge run
   queued, starting or running over its partition gets a request, within the retry policy
   (`liveness.RetryPolicy`: attempts counted while progress stays put, doubling backoff, a
   cap after which the region is *stuck*: logged, observed, no more automatic runs). All
   requests of a tick form **one** run (the partition, or the range from the first to the
   last region); run keys carry each region's generation, progress and attempt, so Dagster's
   run-key dedupe never swallows a retry;
5. retires sealed regions once merged and caught up (their partitions are deleted, unless a
   run still covers them);
6. when no merge is requested, no maintenance run is queued, and base_table materialized since
   the last maintenance request, requests the maintenance job (run_key: that materialization),
   over every index partition after bringing those up to date with the table's indexes
   (`index_catchup` has one partition per base-table index).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import uuid
from dataclasses import dataclass

from dagster import (
    MAX_RUNTIME_SECONDS_TAG,
    AssetObservation,
    DagsterRunStatus,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    DynamicPartitionsDefinition,
    MetadataValue,
    RunRequest,
    RunsFilter,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    schedule,
    sensor,
)

from memwal_core.jobs.catchup import base_indexes
from memwal_core.observe import status
from memwal_core.state import region
from memwal_core.state.table import TableError, open_dataset, read_memwal_state

from . import liveness
from .assets import TableKeys, region_metadata
from .config import TableConfig
from .partitions import RegionLabels, index_partitions, index_range_tags
from .tags import PARTITION_RANGE_END, PARTITION_RANGE_START, partition_range

VERIFY_EVERY = 16       # ticks per full rotation of hint re-checks
DOWNTIME_INTERVALS = 3  # no tick for this many intervals: re-check every region
IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED]


class SensorError(RuntimeError):
    """The sensor cannot watch the table at all (shown as a failed tick)."""


@dataclass
class Cursor:
    epoch: str
    maintained_after: int = 0
    digest: str = ""

    @classmethod
    def parse(cls, raw: str | None) -> "Cursor":
        data = json.loads(raw) if raw else {}
        # A cursor of the old format (one version per region) starts a fresh state: the first
        # tick re-probes every region from its hint, which is also what a reset cursor means.
        return cls(data.get("epoch") or uuid.uuid4().hex[:8], int(data.get("maintained_after", 0)),
                   data.get("state", ""))

    def dump(self) -> str:
        return json.dumps({"epoch": self.epoch, "maintained_after": self.maintained_after, "state": self.digest},
                          sort_keys=True)


def _runs(instance, job_name: str, statuses: list) -> list:
    return instance.get_runs(filters=RunsFilter(job_name=job_name, statuses=statuses))


def _queued_runs(instance, job_name: str) -> list:
    """Runs of `job_name` that are queued and not yet started (one indexed query)."""
    return _runs(instance, job_name, [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED])


def _in_flight_merge_regions(instance, merge_job_name: str, order: list[str], pos: dict[str, int]) -> set[str]:
    """Regions a queued, starting or running merge run covers (its partition or range); `pos`
    is each region's index in the partition `order`. A range whose first or last partition was
    deleted covers nothing: Dagster cannot launch it, so its regions are requested again."""
    covered: set[str] = set()
    for run in _runs(instance, merge_job_name, IN_FLIGHT):
        one = run.tags.get("dagster/partition") or run.tags.get("memwal/region")
        lo, hi = run.tags.get(PARTITION_RANGE_START), run.tags.get(PARTITION_RANGE_END)
        if one:
            covered.add(one)
        elif lo in pos and hi in pos:
            covered.update(order[pos[lo]:pos[hi] + 1])
    return covered


@dataclass(frozen=True)
class _Merge:
    region_id: str
    top: int       # newest flushed generation
    merged: int    # progress when requested
    attempt: int

    @property
    def key(self) -> str:
        return f"{self.region_id}:{self.top}@{self.merged}#{self.attempt}"


def _merge_request(cfg: TableConfig, job_name: str, merges: list[_Merge], pos: dict[str, int],
                   epoch: str) -> RunRequest:
    """One run for every region that needs a merge this tick.

    One region: its partition. Several: one run over the range of partitions from the first
    to the last of them (a range may include regions with nothing to merge, which cost a plan
    and nothing else), so a busy table is merged in one Spark job and as few commits as the
    budget allows, instead of one queued run per region. The run_key names each region's
    `region:generation@merged#attempt` (digested past a few) and the state epoch: a retry is a
    new key, so Dagster's run-key dedupe never swallows it.
    """
    # Run monitoring fails a run that outlives this; with the default run launcher it is the
    # only way a run whose worker died with its code server (daemon killed, host lost) stops
    # holding the pool; a worker killed alone is failed by the code server at once.
    tags = {"memwal/table": cfg.name, MAX_RUNTIME_SECONDS_TAG: str(int(cfg.sensor.merge_max_runtime_seconds))}
    if len(merges) == 1:
        m = merges[0]
        return RunRequest(run_key=f"{m.key}/{epoch}", job_name=job_name, partition_key=m.region_id,
                          tags={**tags, "memwal/region": m.region_id, "memwal/generation": str(m.top),
                                "memwal/attempt": str(m.attempt)})
    merges = sorted(merges, key=lambda m: pos[m.region_id])
    pairs = [m.key for m in merges]
    run_key = ",".join(pairs) if len(pairs) <= 4 else (
        f"{pairs[0]},...({len(pairs)} regions) {hashlib.sha1(','.join(pairs).encode()).hexdigest()[:16]}")
    return RunRequest(run_key=f"{run_key}/{epoch}", job_name=job_name,
                      tags={**tags, "memwal/regions": str(len(merges)),
                            "memwal/attempt": str(max(m.attempt for m in merges)),
                            PARTITION_RANGE_START: merges[0].region_id,
                            PARTITION_RANGE_END: merges[-1].region_id})


def _caught_up(mstate, indexes: list[str], rid: str, generation: int) -> bool:
    """Every index gating GC covers `generation` of the region (absent: not caught up)."""
    catchup = mstate.catchup
    return all(catchup.get(name, {}).get(rid, 0) >= generation for name in mstate.gating_indexes(indexes))


def index_upkeep(instance, indexes: DynamicPartitionsDefinition, loc) -> tuple[list, dict[str, str]]:
    """Dynamic-partition requests that make the index partitions the table's base-table indexes
    (new ones added, dropped ones deleted), and the tags of a run over all of them ({} when the
    table has none). One dataset open: only on ticks that request maintenance."""
    current = sorted(base_indexes(open_dataset(loc)))
    known = list(instance.get_dynamic_partitions(indexes.name))  # insertion order
    added = [n for n in current if n not in set(known)]
    dropped = [n for n in known if n not in set(current)]
    requests = ([indexes.build_add_request(added)] if added else []) + (
        [indexes.build_delete_request(dropped)] if dropped else [])
    order = [n for n in known if n not in set(dropped)] + added
    return requests, (partition_range(order[0], order[-1]) if order else {})


def evaluate_tick(context: SensorEvaluationContext, cfg: TableConfig, partitions: DynamicPartitionsDefinition,
                  merge_job_name: str, maintenance_job_name: str, loc, now: float | None = None,
                  index_parts: DynamicPartitionsDefinition | None = None) -> SensorResult | SkipReason:
    now = time.time() if now is None else now
    index_parts = index_parts or index_partitions(cfg.name)
    keys = TableKeys(cfg.name)
    cursor = Cursor.parse(context.cursor)
    state = liveness.SensorState.load(context.instance, cfg.name, cursor.epoch)
    policy = liveness.RetryPolicy(float(cfg.sensor.interval_seconds), cfg.sensor.merge_attempts,
                                  cfg.sensor.max_backoff_seconds)
    listing = region.list_regions(loc.store)
    for name, reason in listing.skipped:
        context.log.warning(f"{cfg.name}: skipping _mem_wal/{name}: {reason}")
    if not listing.region_ids:
        try:  # no region at all: make sure there is a table, or say that there is none
            open_dataset(loc)
        except TableError as e:
            raise SensorError(f"{cfg.name}: {e}") from None
    listed = set(listing.region_ids)
    state.forget([rid for rid in state.regions if rid not in listed])
    active = [rid for rid in listing.region_ids if not (state.get(rid) and state.get(rid).retired)]
    partition_order = list(context.instance.get_dynamic_partitions(partitions.name))  # insertion order
    existing = set(partition_order)
    new_partitions = [rid for rid in active if rid not in existing]

    downtime = state.last_tick is None or now - state.last_tick > DOWNTIME_INTERVALS * cfg.sensor.interval_seconds
    verify = set(active) if downtime else {rid for rid in active
                                           if liveness.verify_this_tick(rid, state.ticks, VERIFY_EVERY)}
    if downtime and state.last_tick is not None:
        context.log.info(f"{cfg.name}: no tick for {now - state.last_tick:.0f} s: re-checking every region's "
                         "latest manifest version (old versions may have been collected meanwhile)")
    memwal_state = functools.cache(lambda: read_memwal_state(loc))
    merged_once = functools.cache(lambda: memwal_state().merged)  # a property that decodes: read once
    observed = status.observe_regions(loc, {rid: (state.get(rid).version if state.get(rid) else None)
                                            for rid in active}, merged_once, verify=verify)
    failed = {rid for rid, o in observed.items() if not o.ok}
    for rid in sorted(failed):
        context.log.error(f"{cfg.name}: {observed[rid].error}")
    changed = {rid: o for rid, o in observed.items() if o.changed}

    events = []
    need_state = bool(changed) or any(
        st.pending or (st.sealed and not st.retired) for rid, st in state.regions.items() if rid in observed)
    mstate = memwal_state() if need_state else None
    merged = merged_once() if mstate is not None else {}
    if changed:
        labels = RegionLabels.load(loc, mstate)  # one snapshot read: the readable region values
        for rid, o in sorted(changed.items()):
            rs = state.put(rid)
            rs.version, rs.top, rs.sealed = o.version, o.manifest.top_generation, o.manifest.sealed
            events.append(AssetObservation(asset_key=keys.asset("region_generations"), partition=rid,
                                           metadata=region_metadata(o.status, labels.label(rid))))

    order = [*partition_order, *new_partitions]
    pos = {rid: i for i, rid in enumerate(order)}
    merges: list[_Merge] = []
    retire: list[str] = []
    if mstate is not None:
        in_flight = _in_flight_merge_regions(context.instance, merge_job_name, order, pos)
        indexes: list[str] | None = None  # base-table index names, read once if a sealed region needs them
        for rid in active:
            rs = state.get(rid)
            if rs is None or rid in failed:
                continue
            done = merged.get(rid, 0)
            liveness.observe_progress(rs, done)
            if rs.top <= done:
                if rs.sealed and rid not in in_flight:
                    if indexes is None:
                        indexes = [i["name"] for i in open_dataset(loc, mstate.table_version).list_indices()]
                    if _caught_up(mstate, indexes, rid, rs.top):
                        retire.append(rid)
                continue
            decision = policy.decide(rs, now, rid in in_flight)
            if decision == liveness.IN_FLIGHT:
                if rid in changed:
                    # A run that has not started yet plans when it starts and takes this
                    # generation along; a running one is followed by a request once it ends.
                    context.log.info(f"{cfg.name}: region {rid}: generation {rs.top} left to the merge run "
                                     "in flight")
            elif decision == liveness.REQUEST:
                rs.attempts += 1
                rs.last_request = now
                merges.append(_Merge(rid, rs.top, done, rs.attempts))
                if rs.attempts > 1:
                    context.log.warning(f"{cfg.name}: region {rid}: generations {done + 1}..{rs.top} still "
                                        f"unmerged after {rs.attempts - 1} merge run(s); requesting attempt "
                                        f"{rs.attempts} of {policy.max_attempts}")
            elif decision == liveness.STUCK and not rs.stuck_since:
                rs.stuck_since = now
                msg = (f"region {rid} is stuck at generation {done + 1}: {rs.attempts} merge runs made no "
                       "progress; no more automatic merge runs until its progress moves (see the merge "
                       "run logs, repair, then materialize its base_table partition)")
                context.log.error(f"{cfg.name}: {msg}")
                events.append(AssetObservation(asset_key=keys.asset("region_generations"), partition=rid,
                                               metadata={"stuck": MetadataValue.bool(True),
                                                         "stuck_generation": MetadataValue.int(done + 1),
                                                         "failed_attempts": MetadataValue.int(rs.attempts),
                                                         "reason": MetadataValue.text(msg)}))
    stuck = state.stuck()
    if stuck:
        context.log.warning(f"{cfg.name}: {len(stuck)} region(s) stuck: " + ", ".join(
            f"{rid} at generation {s['generation']}" for rid, s in list(stuck.items())[:5]))

    dynamic = []
    if retire:
        for rid in retire:
            state.get(rid).retired = True
            context.log.info(f"{cfg.name}: region {rid} is sealed, fully merged and caught up: retiring its "
                             "partition")
        gone = [rid for rid in retire if rid in existing]
        new_partitions = [rid for rid in new_partitions if rid not in set(retire)]
        if gone:
            dynamic.append(partitions.build_delete_request(gone))
    if new_partitions:
        dynamic.insert(0, partitions.build_add_request(new_partitions))

    run_requests: list[RunRequest] = []
    if merges:
        run_requests.append(_merge_request(cfg, merge_job_name, merges, pos, cursor.epoch))

    if not run_requests and not _queued_runs(context.instance, maintenance_job_name):
        records = context.instance.fetch_materializations(keys.asset("base_table"), limit=1).records
        if records and records[0].storage_id > cursor.maintained_after:
            cursor.maintained_after = records[0].storage_id
            index_requests, index_range = index_upkeep(context.instance, index_parts, loc)
            dynamic += index_requests
            run_requests.append(RunRequest(run_key=f"maintenance:{cursor.maintained_after}",
                                           job_name=maintenance_job_name,
                                           tags={"memwal/table": cfg.name, **index_range}))

    cursor.digest = state.save(now)
    new_cursor = cursor.dump()
    if not (run_requests or events or dynamic) and new_cursor == (context.cursor or ""):
        return SkipReason(f"{cfg.name}: {len(active)} regions unchanged ({len(verify)} re-checked against "
                          "their version hint)")
    return SensorResult(run_requests=run_requests, dynamic_partitions_requests=dynamic, asset_events=events,
                        cursor=new_cursor)


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
        return RunRequest(tags={"memwal/table": cfg.name, **index_range_tags(context.instance, indexes)})

    return maintenance_schedule
