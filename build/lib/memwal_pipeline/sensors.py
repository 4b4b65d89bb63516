"""The manifest sensor: one per table, cheap on unchanged regions, jobs in dependency order.

Cursor (JSON): manifest version per region, plus the storage id of the last base_table
materialization that maintenance was requested for. A tick:
1. lists `_mem_wal/` (one request) to find new regions, which become partitions
   (returned as dynamic-partition requests);
2. HEAD-probes each known region at cursor version + 1 (one request per unchanged region; no
   listing of manifest directories);
3. for regions whose manifest moved, reads it and the merged progress, records an observation
   of `region_generations`, and requests **one** merge run for all regions with new flushed
   generations: one region's partition (run_key `region:generation`), or the partition range
   from the first to the last of several (run_key: their `region:generation` pairs), so a tick
   never launches the same merge twice and a busy table is merged in one Spark job per tick.
   A region whose merge run is still queued is left to that run: it plans when it starts, so
   it takes the new generation along (runs never pile up, however fast writers flush);
4. when no merge is being requested, no maintenance run is queued, and base_table
   materialized since the last maintenance request, requests the maintenance job
   (memwal_index -> index_catchup -> garbage), whose run_key is that materialization, so
   maintenance follows merges exactly once.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

from dagster import (
    AssetObservation,
    DagsterRunStatus,
    DefaultSensorStatus,
    DynamicPartitionsDefinition,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from memwal_core import region, status
from memwal_core.table import read_memwal_state

from .assets import TableKeys, region_metadata
from .config import TableConfig


def _probe(store, rids: list[str], known: dict[str, int]) -> dict[str, int | Exception]:
    def one(rid: str) -> int | Exception:
        try:
            return region.probe_latest_version(store, rid, known.get(rid), start_exists=rid in known)
        except Exception as e:  # noqa: BLE001 - one broken region must not stop the others
            return e

    if not rids:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(rids))) as pool:
        return dict(zip(rids, pool.map(one, rids)))


def _queued_runs(instance, job_name: str) -> list:
    """Runs of `job_name` that are queued and not yet started (one indexed query)."""
    return instance.get_runs(filters=RunsFilter(job_name=job_name,
                                                statuses=[DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED]))


def _queued_merge_regions(instance, merge_job_name: str, order: list[str], pos: dict[str, int]) -> set[str]:
    """Regions that a queued, not yet started merge run will merge (its partition or range);
    `pos` is each region's index in the partition `order`."""
    covered: set[str] = set()
    for run in _queued_runs(instance, merge_job_name):
        one = run.tags.get("dagster/partition") or run.tags.get("memwal/region")
        lo, hi = run.tags.get(ASSET_PARTITION_RANGE_START_TAG), run.tags.get(ASSET_PARTITION_RANGE_END_TAG)
        if one:
            covered.add(one)
        elif lo in pos and hi in pos:
            covered.update(order[pos[lo]:pos[hi] + 1])
    return covered


def _merge_request(cfg: TableConfig, job_name: str, merges: list[tuple[str, int]], pos: dict[str, int]) -> RunRequest:
    """One run for every region that needs a merge this tick.

    One region: its partition, run_key `region:generation`. Several: one run over the range of
    partitions from the first to the last of them (a range may include regions with nothing
    to merge, which cost a plan and nothing else), so a busy table is merged in one Spark job
    and as few commits as the budget allows, instead of one queued run per region; its
    run_key lists the `region:generation` pairs (digested past a few).
    """
    tags = {"memwal/table": cfg.name}
    if len(merges) == 1:
        rid, top = merges[0]
        return RunRequest(run_key=f"{rid}:{top}", job_name=job_name, partition_key=rid,
                          tags={**tags, "memwal/region": rid, "memwal/generation": str(top)})
    merges = sorted(merges, key=lambda m: pos[m[0]])
    pairs = [f"{rid}:{top}" for rid, top in merges]
    run_key = ",".join(pairs) if len(pairs) <= 4 else (
        f"{pairs[0]},...({len(pairs)} regions) {hashlib.sha1(','.join(pairs).encode()).hexdigest()[:16]}")
    return RunRequest(run_key=run_key, job_name=job_name,
                      tags={**tags, "memwal/regions": str(len(merges)),
                            ASSET_PARTITION_RANGE_START_TAG: merges[0][0], ASSET_PARTITION_RANGE_END_TAG: merges[-1][0]})


def evaluate_tick(context: SensorEvaluationContext, cfg: TableConfig, partitions: DynamicPartitionsDefinition,
                  merge_job_name: str, maintenance_job_name: str, loc) -> SensorResult | SkipReason:
    keys = TableKeys(cfg.name)
    cursor = json.loads(context.cursor) if context.cursor else {}
    known: dict[str, int] = cursor.get("versions", {})
    listing = region.list_regions(loc.store)
    for name, reason in listing.skipped:
        context.log.warning(f"{cfg.name}: skipping _mem_wal/{name}: {reason}")
    partition_order = list(context.instance.get_dynamic_partitions(partitions.name))  # insertion order
    existing = set(partition_order)
    new_partitions = [rid for rid in listing.region_ids if rid not in existing]

    latest = _probe(loc.store, listing.region_ids, known)
    changed = {rid: v for rid, v in latest.items() if not isinstance(v, Exception) and v != known.get(rid)}
    for rid, err in latest.items():
        if isinstance(err, Exception):
            context.log.error(f"{cfg.name}: region {rid}: {err}")

    run_requests: list[RunRequest] = []
    events = []
    if changed:
        merged = read_memwal_state(loc).merged

        def load(item: tuple[str, int]):
            rid, version = item
            try:
                return status.region_status(loc, region.load_version(loc.store, rid, version), merged.get(rid, 0))
            except Exception as e:  # noqa: BLE001 - reported, the others proceed
                return e

        with ThreadPoolExecutor(max_workers=min(16, len(changed))) as pool:
            loaded = list(pool.map(load, sorted(changed.items())))
        order = [*partition_order, *new_partitions]
        pos = {rid: i for i, rid in enumerate(order)}
        waiting = _queued_merge_regions(context.instance, merge_job_name, order, pos)
        merges: list[tuple[str, int]] = []
        for (rid, version), st in zip(sorted(changed.items()), loaded):
            if isinstance(st, Exception):
                context.log.error(f"{cfg.name}: region {rid}: {st}")
                continue
            known[rid] = version
            events.append(AssetObservation(asset_key=keys.asset("region_generations"), partition=rid,
                                           metadata=region_metadata(st)))
            if st.pending_generations and rid in waiting:
                # A run of this region that has not started yet plans when it starts, so it
                # merges this generation too: another run would only queue up behind it.
                context.log.info(f"{cfg.name}: region {rid}: generation {st.pending_generations[-1]} "
                                 "left to the merge run already queued")
            elif st.pending_generations:
                merges.append((rid, st.pending_generations[-1]))
        if merges:
            run_requests.append(_merge_request(cfg, merge_job_name, merges, pos))

    maint_after = cursor.get("maintained_after", 0)
    if not run_requests and not _queued_runs(context.instance, maintenance_job_name):
        records = context.instance.fetch_materializations(keys.asset("base_table"), limit=1).records
        if records and records[0].storage_id > maint_after:
            maint_after = records[0].storage_id
            run_requests.append(RunRequest(run_key=f"maintenance:{maint_after}", job_name=maintenance_job_name,
                                           tags={"memwal/table": cfg.name}))

    new_cursor = json.dumps({"versions": known, "maintained_after": maint_after}, sort_keys=True)
    if not (run_requests or events or new_partitions) and new_cursor == (context.cursor or ""):
        return SkipReason(f"{cfg.name}: {len(listing.region_ids)} regions unchanged")
    return SensorResult(
        run_requests=run_requests,
        dynamic_partitions_requests=[partitions.build_add_request(new_partitions)] if new_partitions else [],
        asset_events=events,
        cursor=new_cursor,
    )


def build_sensor(cfg: TableConfig, partitions: DynamicPartitionsDefinition, merge_job, maintenance_job):
    keys = TableKeys(cfg.name)

    @sensor(name=f"{cfg.name}_manifest_sensor", minimum_interval_seconds=cfg.sensor_interval_seconds,
            default_status=DefaultSensorStatus.RUNNING, jobs=[merge_job, maintenance_job],
            required_resource_keys={keys.table_resource},
            description=f"Watches the region manifests of {cfg.name}: new regions become partitions, new "
                        "flushed generations get merge runs, merges are followed by maintenance.")
    def manifest_sensor(context: SensorEvaluationContext):
        loc = getattr(context.resources, keys.table_resource).location()
        return evaluate_tick(context, cfg, partitions, merge_job.name, maintenance_job.name, loc)

    return manifest_sensor
