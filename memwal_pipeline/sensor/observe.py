"""Everything one sensor tick reads, and nothing it decides: the object store, the table and the
Dagster instance, into one frozen `Observation`.

The reads are the cheap ones a tick on an unchanged table needs, and the others only when the
rules say they matter (the predicates live in `decide`):
1. the sensor's memory (`liveness.SensorState`, the instance's key-value rows);
2. a listing of `_mem_wal/` (one request) to find the regions; with no region at all, a check
   that the table exists (a missing table is an error, not an idle table);
3. one HEAD per region at its remembered version + 1, or from its version hint for the
   regions `decide.recheck` names (all after downtime, else a rotating slice: GC may have
   collected a remembered version meanwhile); regions whose version moved are read;
4. the MemWAL index's merge progress and the merge runs in flight, when a region changed or
   still has something to merge or retire (`decide.needs_progress`); the readable region
   values then, for the observations of changed regions;
5. the permanent refusals the merger recorded (one listing), when a region the sensor requested
   a merge for still waits and is due again (`decide.needs_walls`): the first refusal stops
   the retries;
6. the gating indexes' recorded catch-up, when a sealed region merged to its end might retire;
7. whether a maintenance run is queued, and the newest base_table materialization.
The table's base-table indexes are read only on ticks that request maintenance
(`index_partitions`, after the decision).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, DagsterRunStatus, RunsFilter

from memwal_core.jobs.catchup import base_indexes
from memwal_core.observe import status
from memwal_core.options import SensorOptions
from memwal_core.state import region
from memwal_core.state import walls as recorded_walls
from memwal_core.state.store import TableLocation
from memwal_core.state.table import MemWalState, TableError, open_dataset, read_memwal_state

from .. import liveness
from ..freshness import is_idle_record
from ..partitions import RegionLabels
from ..tags import PARTITION_RANGE_END, PARTITION_RANGE_START
from . import decide
from .observation import Cursor, Maintenance, Observation, Probe, RunCover, Wall

log = logging.getLogger("memwal.sensor")

IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED]
QUEUED = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED]


class SensorError(RuntimeError):
    """The sensor cannot watch the table at all (shown as a failed tick)."""


@dataclass(frozen=True)
class Watched:
    """What one table's sensor watches: the table, its merge partitions, its two jobs and the
    asset whose materializations are followed by maintenance."""

    table: str
    loc: TableLocation
    partitions: str       # the merge partitions' definition name
    merge_job: str
    maintenance_job: str
    base_table: AssetKey
    garbage: AssetKey | None = None  # the maintenance job's last asset (None: not followed)


def observe(instance: DagsterInstance, w: Watched, cursor: Cursor, options: SensorOptions,
            now: float) -> tuple[Observation, liveness.SensorState]:
    """The tick's observation, and the sensor's memory it was read from (emit stores it back)."""
    state = liveness.SensorState.load(instance, w.table, cursor.epoch)
    listing = region.list_regions(w.loc.store)
    if not listing.region_ids:
        try:  # no region at all: make sure there is a table, or say that there is none
            open_dataset(w.loc)
        except TableError as e:
            raise SensorError(f"{w.table}: {e}") from None
    base = Observation(w.table, now, dict(state.regions), state.last_tick, state.ticks,
                       tuple(listing.region_ids), tuple(listing.skipped))
    active = base.active
    recheck = decide.recheck(active, state.last_tick, state.ticks, now, float(options.interval_seconds))
    memwal_state = functools.cache(lambda: read_memwal_state(w.loc))
    merged_once = functools.cache(lambda: memwal_state().merged)  # a property that decodes: read once
    seen = status.observe_regions(w.loc, {rid: (state.get(rid).version if state.get(rid) else None)
                                          for rid in active}, merged_once, verify=recheck)
    probes = {rid: _probe(o) for rid, o in seen.items()}
    progress = decide.needs_progress(base.memory, probes)
    changed = sorted(rid for rid, o in seen.items() if o.changed)
    merged = dict(merged_once()) if progress else None
    due = progress and decide.needs_walls(base.memory, probes, now, decide.policy_of(options))
    recorded = walls_of(w.loc) if due else None
    named = changed + sorted(recorded or ())
    labels = RegionLabels.load(w.loc, memwal_state()) if named else None  # one snapshot read
    candidates = decide.retire_candidates(base.memory, probes, merged) if merged is not None else []
    return Observation(
        w.table, now, base.memory, state.last_tick, state.ticks, base.listed, base.skipped, recheck, probes,
        partitions=tuple(instance.get_dynamic_partitions(w.partitions)),  # insertion order
        merged=merged,
        in_flight=in_flight_runs(instance, w.merge_job) if progress else (),
        catchup=gating_catchup(w.loc, memwal_state()) if candidates else None,
        maintenance=maintenance(instance, w, cursor.maintained_after),
        walls=recorded,
        statuses={rid: seen[rid].status for rid in changed},
        labels={rid: labels.label(rid) for rid in named} if labels else {},
    ), state


def walls_of(loc: TableLocation) -> dict[str, Wall] | None:
    """The permanent refusals the merger recorded (one listing of `_memwal/walls/`); None when
    they cannot be read (the regions are then retried as usual, up to `merge_attempts`)."""
    try:
        return {rid: Wall(rec.generation, rec.reason) for rid, rec in recorded_walls.read_all(loc.store).items()
                if rec.failure.permanent}
    except Exception as e:  # noqa: BLE001 - never stops the tick: the retry cap still holds
        log.warning("recorded merge refusals unreadable (%s): regions are retried up to the attempt limit", e)
        return None


def _probe(o: status.RegionObservation) -> Probe:
    if not o.ok:
        return Probe(o.region_id, o.version, error=o.error)
    if not o.changed:
        return Probe(o.region_id, o.version)
    return Probe(o.region_id, o.version, True, o.manifest.top_generation, o.manifest.sealed)


def in_flight_runs(instance: DagsterInstance, merge_job: str) -> tuple[RunCover, ...]:
    """The merge runs queued, starting or running, with the partition or range each covers."""
    runs = instance.get_runs(filters=RunsFilter(job_name=merge_job, statuses=IN_FLIGHT))
    return tuple(RunCover(run.tags.get("dagster/partition") or run.tags.get("memwal/region"),
                          run.tags.get(PARTITION_RANGE_START), run.tags.get(PARTITION_RANGE_END)) for run in runs)


def gating_catchup(loc: TableLocation, mstate: MemWalState) -> dict[str, dict[str, int]]:
    """Per index gating GC, its recorded catch-up per region (an index without a record: empty)."""
    names = [i["name"] for i in open_dataset(loc, mstate.table_version).list_indices()]
    catchup = mstate.catchup
    return {name: dict(catchup.get(name, {})) for name in mstate.gating_indexes(names)}


IDLE_RECORDS_SEEN = 20  # base_table records read past the watermark when the newest is an idle record


def maintenance(instance: DagsterInstance, w: Watched, watermark: int = 0) -> Maintenance:
    """One read of the newest base_table materialization; when that is the sensor's idle record
    (`freshness.py`), a second read of those past `watermark` (the last maintained-after merge)
    finds the newest merge among them: a record is never taken for a merge."""
    queued = bool(instance.get_runs(filters=RunsFilter(job_name=w.maintenance_job, statuses=QUEUED), limit=1))
    records = instance.fetch_materializations(w.base_table, limit=1).records
    ever = w.garbage is None or bool(instance.fetch_materializations(w.garbage, limit=1).records)
    if not records:
        return Maintenance(queued, 0, ever)
    newest = records[0]
    if not is_idle_record(newest.asset_materialization):
        return Maintenance(queued, newest.storage_id, ever, newest.timestamp)
    past = instance.fetch_materializations(AssetRecordsFilter(w.base_table, after_storage_id=watermark),
                                           limit=IDLE_RECORDS_SEEN).records
    merges = [r for r in past if not is_idle_record(r.asset_materialization)]
    return Maintenance(queued, merges[0].storage_id if merges else 0, ever, newest.timestamp,
                       idle_record=0 if merges else newest.storage_id)


def index_partitions(instance: DagsterInstance, partitions: str, loc: TableLocation) -> decide.IndexPartitions:
    """The index partitions a maintenance run spans, matched to the table's base-table indexes
    (one dataset open: only on ticks that request maintenance)."""
    current = base_indexes(open_dataset(loc))
    return decide.index_partitions(current, list(instance.get_dynamic_partitions(partitions)))
