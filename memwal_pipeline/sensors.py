"""The manifest sensor: one per table, cheap on unchanged regions, jobs in dependency order.

Cursor (JSON): manifest version per region, plus the storage id of the last base_table
materialization that maintenance was requested for. A tick:
1. lists `_mem_wal/` (one request) to find new regions, which become partitions
   (returned as dynamic-partition requests);
2. HEAD-probes each known region at cursor version + 1 (one request per unchanged region; no
   listing of manifest directories);
3. for regions whose manifest moved, reads it and the merged progress, records an observation
   of `region_generations`, and requests a merge run with run_key `region:generation`, so a
   tick never launches the same merge twice;
4. when no merge is being requested and base_table materialized since the last maintenance
   request, requests the maintenance job (memwal_index -> index_catchup -> garbage), whose
   run_key is that materialization, so maintenance follows merges exactly once.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from dagster import (
    AssetObservation,
    DefaultSensorStatus,
    DynamicPartitionsDefinition,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

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


def evaluate_tick(context: SensorEvaluationContext, cfg: TableConfig, partitions: DynamicPartitionsDefinition,
                  merge_job_name: str, maintenance_job_name: str, loc) -> SensorResult | SkipReason:
    keys = TableKeys(cfg.name)
    cursor = json.loads(context.cursor) if context.cursor else {}
    known: dict[str, int] = cursor.get("versions", {})
    listing = region.list_regions(loc.store)
    for name, reason in listing.skipped:
        context.log.warning(f"{cfg.name}: skipping _mem_wal/{name}: {reason}")
    existing = set(context.instance.get_dynamic_partitions(partitions.name))
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
        for (rid, version), st in zip(sorted(changed.items()), loaded):
            if isinstance(st, Exception):
                context.log.error(f"{cfg.name}: region {rid}: {st}")
                continue
            known[rid] = version
            events.append(AssetObservation(asset_key=keys.asset("region_generations"), partition=rid,
                                           metadata=region_metadata(st)))
            if st.pending_generations:
                top = st.pending_generations[-1]
                run_requests.append(RunRequest(
                    run_key=f"{rid}:{top}", job_name=merge_job_name, partition_key=rid,
                    tags={"memwal/table": cfg.name, "memwal/region": rid, "memwal/generation": str(top)}))

    maint_after = cursor.get("maintained_after", 0)
    if not run_requests:
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
