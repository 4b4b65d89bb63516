"""Write what a `SnapshotPlan` read: raise the WAL hints, commit the region snapshot.

1. per region whose WAL tail is newer than its hint (in parallel): commit a region manifest
   version that changes only that hint (best effort: a failure is logged and reported, never
   fatal); the row shows the manifest version committed;
2. record every `durable` value of a row (a merged generation's, the manifest's) that the
   lifetime's record does not hold yet, under `_memwal/` (`state/value_records.py`), before any
   commit publishes it: the snapshot may be an external file that the next commit changing the
   MemWAL index leaves behind, and GC trims the generations a value rests on once it is recorded.
   A failed write is logged (GC keeps the region's generations); a record holding another value
   is a permanent region error and the row gets no value;
3. build one snapshot row per region (`state/memwal_index.py`), keeping the previous row of a
   region that failed, and encode it as a Lance file: inline up to `inline_threshold` regions,
   else `_indices/{uuid}/index.lance`;
4. replace the `__lance_mem_wal` details through `table.guarded_replace_details`: the new
   details are a copy of the ones just read (every field, unknown ones included, byte for
   byte) with only `snapshot_ts_millis`, `num_regions` and `inline_snapshots` changed. A lost
   race (any commit since the read, e.g. a merge recording progress) re-reads the table and
   rebuilds the details from the fresh read, so merge progress and catch-up are never erased.

Commit retries re-read only the table (the rows do not depend on it unless the region specs
change, in which case the rows are valued again). An unchanged snapshot commits nothing: an
idle table gains no table version.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import lance
import pyarrow as pa

from memwal_core import faults
from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.jobs.snapshot.hints import raise_hint
from memwal_core.jobs.snapshot.plan import STEP, RegionRow, SnapshotPlan, plan_snapshot, region_fields
from memwal_core.jobs.snapshot.result import SnapshotResult
from memwal_core.options import SnapshotOptions
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import lease, lifecycle, memwal_index, region, table, value_records
from memwal_core.state.memwal_index import SnapshotError
from memwal_core.state.region_values import UNKNOWN, FieldValues, region_specs
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.snapshot")

DEFAULT_INLINE_THRESHOLD = SnapshotOptions().inline_threshold  # one default: memwal_core/options.py
VALUES_RECORDED = "snapshot.values_recorded"  # crash point: values recorded, snapshot not committed


@dataclass
class _Hints:
    """What raising the hints changed: the rows (newer manifests), failures and reports."""

    rows: dict[str, RegionRow]
    failures: dict[str, RegionFailure]
    updated: dict[str, tuple[int, int]]
    errors: dict[str, str]
    # Regions whose value record disagrees with the value read (why): their rows have no value.
    conflicts: dict[str, str] = field(default_factory=dict)


def _raise_hints(loc: TableLocation, plan: SnapshotPlan, max_workers: int) -> _Hints:
    """Commit every hint the plan found (best effort). A region whose manifest read turns out
    stale (`ManifestGap`) fails: its previous row is kept."""
    out = _Hints(dict(plan.rows), dict(plan.failures), {}, dict(plan.hint_errors), dict(plan.value_conflicts))
    todo = [rid for rid in plan.hints if rid in out.rows]

    def one(rid: str):
        try:
            return raise_hint(loc, plan.manifests[rid], plan.hints[rid])
        except region.ManifestGap as e:
            return e

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(todo) or 1))) as pool:
        for rid, got in zip(todo, pool.map(one, todo)):
            if isinstance(got, region.ManifestGap):
                out.failures[rid] = RegionFailure(rid, None, str(got), False, STEP)
                del out.rows[rid]
                continue
            m, hint, error = got
            out.rows[rid] = RegionRow(lifecycle.without_stale(m, plan.lifecycle.verdict(rid)), out.rows[rid].fields)
            if hint:
                out.updated[rid] = hint
            if error:
                out.errors[rid] = error
    return out


def _record_values(loc: TableLocation, plan: SnapshotPlan, hints: _Hints, max_workers: int) -> None:
    """Write the durable values of `hints.rows` that the lifetime's record does not hold yet (see
    the module docstring, step 2). A conflict takes the row's value away and is reported."""
    init = plan.lifecycle.init
    if not plan.derive_fields or init is None or not init.known:
        return
    todo = []
    for rid, row in hints.rows.items():
        fv, spec_id = row.fields, row.manifest.message.region_spec_id
        rec = plan.recorded.get(rid)
        if fv.source.durable and fv.values and not (rec is not None and rec.same_value(spec_id, fv.values)):
            todo.append((rid, spec_id, fv))

    def one(item: tuple[str, int, FieldValues]) -> str | None:
        rid, spec_id, fv = item
        try:
            value_records.write(loc, init, rid, spec_id, fv.values, fv.source.label or "",
                                plan.field_types.get(spec_id, {}))
        except value_records.ValueConflict as e:
            log.error("%s", e)
            return str(e)
        except Exception as e:  # noqa: BLE001 - not recorded: GC keeps what the value rests on
            log.warning("region %s: value not recorded (%s); GC keeps its merged generations", rid, one_line(e))
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(todo) or 1))) as pool:
        for (rid, _, _), conflict in zip(todo, pool.map(one, todo)):
            if conflict is not None:
                hints.conflicts[rid] = conflict
                hints.rows[rid] = RegionRow(hints.rows[rid].manifest, FieldValues({}, UNKNOWN, conflict))
    faults.point(VALUES_RECORDED)


def _result(plan: SnapshotPlan, hints: _Hints, *, dry_run: bool) -> SnapshotResult:
    """The result before any commit (storage 'none', the version read), failures logged."""
    kept = plan.kept(hints.failures)
    conflicts = {rid: RegionFailure(rid, None, why, True, STEP) for rid, why in hints.conflicts.items()
                 if rid in hints.rows}
    for rid, f in sorted(hints.failures.items()):
        if rid in kept:
            log.warning("region %s: %s; keeping its previous snapshot row (manifest version %d)",
                        rid, f.reason, kept[rid].manifest.version)
        else:
            log.warning("region %s left out of the snapshot (no previous row to keep): %s", rid, f.reason)
    return SnapshotResult(
        num_regions=len(hints.rows) + len(kept), storage="none", table_version=plan.table_version,
        duration_s=0.0, hints_updated=hints.updated,
        region_errors={rid: f.reason for rid, f in {**hints.failures, **conflicts}.items()},
        hint_errors=hints.errors,
        region_field_sources={rid: str(r.fields.source) for rid, r in hints.rows.items()},
        region_field_problems={rid: r.fields.problem for rid, r in hints.rows.items() if r.fields.problem},
        skipped_dirs=list(plan.skipped_dirs), snapshot_ts_millis=plan.snapshot_ts_millis, dry_run=dry_run,
        regions_kept={rid: row.manifest.version for rid, row in kept.items()},
        region_failures={**hints.failures, **conflicts})


@dataclass
class _Encoded:
    """The snapshot table for one set of region specs, and its bytes when stored inline."""

    specs_key: bytes
    rows: list[RegionRow]
    table: pa.Table
    inline: bytes | None


def _encode(loc: TableLocation, plan: SnapshotPlan, state: table.MemWalState, ds: lance.LanceDataset | None,
            rows: list[RegionRow], before: _Encoded | None,
            reuse: dict[str, tuple[int, FieldValues]] | None = None) -> _Encoded:
    """The table to commit over `state`: `before` when the region specs are the same, else the
    rows valued again under the specs of `state` (they changed since the plan read them), reusing
    `reuse` (recorded and pinned values, and no value for a conflict) as the plan did."""
    specs_key = b"".join(s.SerializeToString() for s in state.details.region_specs)
    if before is not None and before.specs_key == specs_key:
        return before
    if before is not None:
        specs = region_specs(state)
        try:
            pk = table.primary_key(ds)
        except table.NoPrimaryKey:
            pk = []
        rows = [RegionRow(r.manifest, region_fields(loc, specs, ds, pk, r.manifest,
                                                    state.merged.get(r.manifest.region_id, 0),
                                                    derive=plan.derive_fields, reuse=reuse))
                for r in before.rows]
    tbl = memwal_index.snapshot_table([r.index_row() for r in rows], list(state.details.region_specs))
    inline = memwal_index.encode_lance_file(tbl) if len(rows) <= plan.options.inline_threshold else None
    return _Encoded(specs_key, rows, tbl, inline)


def _commit(loc: TableLocation, state: table.MemWalState, enc: _Encoded, ts_millis: int) -> tuple[int, str] | None:
    """One guarded commit of the snapshot over `state`: (table version, index uuid), or None
    when it lost a race (its external file, if any, is deleted again)."""
    details = pb.MemWalIndexDetails()
    details.CopyFrom(state.details)  # configuration, merge progress, catch-up: as read
    details.snapshot_ts_millis = ts_millis
    details.num_regions = len(enc.rows)
    lease.fence(loc, "MemWAL index commit")  # before its external file: nothing left behind
    index_uuid = str(uuid.uuid4())
    files = None
    if enc.inline is not None:
        details.inline_snapshots = enc.inline
    else:
        details.ClearField("inline_snapshots")
        files = [(memwal_index.SNAPSHOT_FILE, memwal_index.write_external(loc, enc.table, index_uuid))]
    try:
        version = table.guarded_replace_details(loc, state, details, index_uuid=index_uuid, files=files)
    except table.LostRace as e:
        log.info("snapshot commit lost a race (%s); re-reading", e)
        if files:
            _delete_quietly(loc, memwal_index.external_key(index_uuid))
        return None
    except BaseException:
        if files:
            _delete_quietly(loc, memwal_index.external_key(index_uuid))
        raise
    return version, index_uuid


@lease.step("index")
def execute_snapshot(loc: TableLocation, plan: SnapshotPlan, *, max_attempts: int = 5,
                     max_workers: int = 16) -> SnapshotResult:
    """Raise the plan's hints and commit its snapshot (see the module docstring).

    The plan's rows are what it read: where other maintainers run, plan and execute under one
    hold of the table's lease (`lease.hold`), as `build_snapshot` does. Raises `SnapshotError`
    after `max_attempts` lost races against other table commits."""
    return _execute(loc, plan, max_attempts=max_attempts, max_workers=max_workers)


def _execute(loc: TableLocation, plan: SnapshotPlan, *, max_attempts: int, max_workers: int) -> SnapshotResult:
    t0 = time.monotonic()
    hints = _raise_hints(loc, plan, max_workers)
    _record_values(loc, plan, hints, max_workers)
    result = _result(plan, hints, dry_run=False)
    reuse = dict(plan.reuse)
    reuse.update({rid: (hints.rows[rid].manifest.message.region_spec_id, hints.rows[rid].fields)
                  for rid in hints.conflicts if rid in hints.rows})
    rows = list(hints.rows.values()) + list(plan.kept(hints.failures).values())
    state, ds, enc = plan.state, None, None
    for attempt in range(1, max_attempts + 1):
        if attempt > 1:
            time.sleep(random.uniform(0.005, 0.02) * attempt)
            ds = table.open_dataset(loc)
            state = table.read_memwal_state(loc, ds.version)
            _refuse_outlived(loc, plan, state.table_version)
        enc = _encode(loc, plan, state, ds, rows, enc, reuse)
        if snapshot_unchanged(loc, state, enc.table, inline=enc.inline is not None):
            result.storage = "inline" if state.details.HasField("inline_snapshots") else "external"
            result.snapshot_ts_millis = state.details.snapshot_ts_millis  # the time of the last change
            result.duration_s = time.monotonic() - t0
            log.info("MemWAL snapshot of %d regions unchanged; nothing committed (table version %d)",
                     len(rows), state.table_version)
            return result
        done = _commit(loc, state, enc, plan.snapshot_ts_millis)
        if done is None:
            continue
        result.table_version, result.index_uuid = done
        result.storage = "inline" if enc.inline is not None else "external"
        result.external_key = None if enc.inline is not None else memwal_index.external_key(result.index_uuid)
        result.attempts, result.committed = attempt, True
        result.duration_s = time.monotonic() - t0
        log.info("MemWAL snapshot of %d regions committed (%s) as table version %d in %.2fs",
                 len(rows), result.storage, result.table_version, result.duration_s)
        return result
    raise SnapshotError(f"table {loc.lance_uri}: gave up committing the MemWAL snapshot after "
                        f"{max_attempts} lost races with other commits (merges, index rebuilds); "
                        "nothing was replaced, run the builder again")


def _refuse_outlived(loc: TableLocation, plan: SnapshotPlan, version: int) -> None:
    """Raise when the table was overwritten and MemWAL initialized again since `plan` read it:
    its rows list the earlier lifetime's generations as unmerged (they were not stale then), and
    committed into the new lifetime's index they would publish rows the overwrite replaced."""
    now = lifecycle.outlived(loc, plan.table_version, plan.lifecycle.init, version)
    if now is not None:
        raise SnapshotError(f"table {loc.lance_uri}: this index build read table version {plan.table_version}, "
                            f"before {now.describe()}; nothing committed, build the index again")


@lease.step("index")
def build_snapshot(loc: TableLocation, options: SnapshotOptions | None = None, *,
                   inline_threshold: int | None = None, max_workers: int = 16, max_attempts: int = 5,
                   update_hints: bool = True, derive_fields: bool = True, dry_run: bool = False) -> SnapshotResult:
    """Plan and execute one index build: a new region snapshot in the MemWAL index.

    `inline_threshold` overrides `options.inline_threshold`. `dry_run` reads and reports without
    committing anything (no hint updates either). Raises `SnapshotError` after `max_attempts`
    lost races against other table commits."""
    t0 = time.monotonic()
    options = options or SnapshotOptions()
    if inline_threshold is not None:
        options = SnapshotOptions(inline_threshold=inline_threshold)
    plan = plan_snapshot(loc, options, max_workers=max_workers, update_hints=update_hints and not dry_run,
                         derive_fields=derive_fields)
    if not dry_run:
        return _execute(loc, plan, max_attempts=max_attempts, max_workers=max_workers)  # under this hold
    result = _result(plan, _Hints(dict(plan.rows), dict(plan.failures), {}, dict(plan.hint_errors),
                                  dict(plan.value_conflicts)), dry_run=True)
    result.duration_s = time.monotonic() - t0
    return result


def snapshot_unchanged(loc: TableLocation, state: table.MemWalState, tbl: pa.Table, *, inline: bool) -> bool:
    """Whether the MemWAL index of `state` already holds exactly the rows of `tbl` (same schema,
    same rows: region manifest versions included, so any region change shows), in the storage
    the threshold would choose. Unreadable or absent: changed (commit)."""
    if state.details.num_regions != tbl.num_rows or state.details.HasField("inline_snapshots") != inline:
        return False
    try:
        current = memwal_index.read_snapshot(loc, state)
    except SnapshotError:
        return False
    return current.schema.equals(tbl.schema) and current.equals(tbl)


def _delete_quietly(loc: TableLocation, key: str) -> None:
    try:
        loc.store.delete_many([key])
    except Exception as e:  # noqa: BLE001 - an orphan under _indices/ is harmless
        log.info("could not delete unused snapshot file %s (%s)", key, e)
