"""One merge commit: the batch's newest rows and tombstones in one `merge_insert`, with each
region's merged generation recorded by `mark_sstables_as_compacted` in the same commit.

Why one pass for deletes rather than a delete pass followed by the marked upsert: a delete
pass commits without progress, so if another merger merged a *newer* generation of the same
key in between (re-inserting it), our delete would remove that newer row and nothing would
bring it back: a lost write. In one pass the stale-marker check refuses the whole commit
instead. (It is also one commit instead of two; see docs/benchmarks.md.)

Every commit is verified (`verify.py`) right after it; a marker written before it
(`unverified.py`) lets the next run verify it when a crash comes in between.
"""

from __future__ import annotations

import logging
from typing import Iterator

import lance
import pyarrow as pa

from memwal_core import faults
from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.jobs.merge import unverified, verify
from memwal_core.jobs.merge.plan import PlannedGeneration
from memwal_core.jobs.merge.run import PlanOutlived, Run
from memwal_core.spark import tasks as sparkpath
from memwal_core.state import lease
from memwal_core.state.keys import delete_predicate
from memwal_core.state.lance_mem_wal import is_commit_conflict, merged_markers
from memwal_core.state.table import open_dataset

log = logging.getLogger("memwal.merge")


def commit_isolating(run: Run, deduped: sparkpath.Deduped, gens: list[PlannedGeneration],
                     index: dict[str, int]) -> bool:
    """Commit `gens` in one commit; if that fails for a reason other than a lost race, commit
    region by region so the failure stops only the region it belongs to. False: a commit lost
    a race (the caller re-reads progress and retries what is left)."""
    try:
        return _commit(run, deduped, gens, index)
    except (lease.LeaseLost, PlanOutlived):
        raise  # not this batch's fault: the whole step stops (another maintainer; a replaced table)
    except Exception as e:  # noqa: BLE001 - isolated below
        rids = sorted({g.region_id for g in gens})
        if len(rids) == 1:
            _commit_failed(run, rids[0], gens, e)
            return True
        log.warning("a commit of %d regions failed (%s: %s); committing them one by one",
                    len(rids), type(e).__name__, e)
    for rid in rids:
        mine = [g for g in gens if g.region_id == rid]
        try:
            if not _commit(run, deduped.only({index[rid]}), mine, index):
                return False
        except (lease.LeaseLost, PlanOutlived):
            raise
        except Exception as e:  # noqa: BLE001 - this region only
            _commit_failed(run, rid, mine, e)
    return True


def _commit_failed(run: Run, rid: str, gens: list[PlannedGeneration], e: Exception) -> None:
    run.walls.stop(RegionFailure(rid, min(g.generation for g in gens), f"region {rid}: commit failed: {one_line(e)}",
                                 permanent=False))


def _progress(gens: list[PlannedGeneration]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in gens:
        out[g.region_id] = max(out.get(g.region_id, 0), g.generation)
    return out


def _commit(run: Run, deduped: sparkpath.Deduped, gens: list[PlannedGeneration], index: dict[str, int]) -> bool:
    """Commit exactly `gens` from their deduplicated rows and verify the commit: True (committed;
    regions whose rows it got wrong are walled), or False on a lost race."""
    loc, pk = run.loc, list(run.base.pk)
    deleted = pa.concat_tables(deduped.deleted) if deduped.deleted else None
    progress = _progress(gens)
    ds = open_dataset(loc, commit_lock=faults.commit_lock("merge.during_commit"))
    outlived = run.outlived(ds.version)  # an overwrite after the run began: Lance refuses the
    if outlived:                         # commit only if it lands after this read
        raise PlanOutlived(outlived)
    schema = pa.schema([ds.schema.field(c) for c in run.base.columns])
    builder = ds.merge_insert(pk).when_matched_update_all().when_not_matched_insert_all()
    if deleted is not None and deleted.num_rows:
        builder = builder.when_not_matched_by_source_delete(delete_predicate(deleted, pk))
    builder = builder.mark_sstables_as_compacted(merged_markers(progress))
    source = pa.RecordBatchReader.from_batches(schema, _cast_stream(deduped.live, schema))
    faults.point("merge.before_commit")
    read_version = ds.version  # Lance records the version it rebased onto, not this one
    pending = unverified.record(loc, read_version, gens)
    lease.fence(loc, "merge commit")
    try:
        stats = builder.execute(source)
    except OSError as e:
        if is_commit_conflict(e):
            unverified.clear(loc, pending)
            return False
        raise  # the marker stays: if the commit landed all the same, the next run verifies it
    faults.point("merge.after_commit")
    regions = {index[rid]: rid for rid in progress}
    if not _verified(run, deduped, gens, regions, ds.version, pending):
        return False
    run.keys.remember(deduped, regions)
    _count(run, deduped, gens, index, stats, ds)
    log.info("merged %d generations of %d regions: +%d upserted, -%d deleted, progress %s "
             "(read version %d, committed version %d)",
             len(gens), len(progress), stats["num_inserted_rows"] + stats["num_updated_rows"],
             stats["num_deleted_rows"], progress, read_version, ds.version)
    return True


def _verified(run: Run, deduped: sparkpath.Deduped, gens: list[PlannedGeneration], regions: dict[int, str],
              version: int, pending: unverified.PendingCommit) -> bool:
    """Check the commit (`verify.py`). False: it is not in the latest version (its generations
    are still pending: merged again). True otherwise; the regions whose keys it got wrong stop
    for good (recorded now: a merger killed later in the run must not leave them unmarked),
    and when it could not be checked at all its regions stop for this run and the marker
    stays, so the next run checks it."""
    loc, pk, progress, types = run.loc, list(run.base.pk), _progress(gens), run.base.key_types
    origins = [(regions[r], t.select(pk).cast(types))
               for tables, owners in ((deduped.live, deduped.live_region), (deduped.deleted, deduped.deleted_region))
               for t, r in zip(tables, owners) if r in regions]
    upserted = pa.concat_tables([t.select(pk).cast(types) for t in deduped.live]) if deduped.live \
        else types.empty_table()
    deleted = pa.concat_tables(deduped.deleted) if deduped.deleted else None
    try:
        check = verify.verify_commit(loc, version, progress, upserted, deleted, pk)
    except Exception as e:  # noqa: BLE001 - the commit did happen: not a failed commit, not a retry
        log.error("merge commit version %d could not be verified (%s); its regions stop for this run and the next "
                  "run verifies it", version, one_line(e))
        for rid, p in sorted(progress.items()):
            run.walls.stop(RegionFailure(rid, p + 1, f"region {rid}: merge commit version {version} could not be "
                                         f"verified: {one_line(e)}; not merged on before it is", permanent=False))
        return True
    if not check.landed:  # nothing of it is in the latest version: the generations are still pending
        log.warning("merge commit version %d is not in the latest version %d (%s); merging the batch again",
                    check.version, check.latest, check.describe())
        unverified.clear(loc, pending)
        return False
    if check.bad_rows:
        by_region = {rid: sorted(g.generation for g in gens if g.region_id == rid) for rid in progress}
        wrong = verify.regions_with_bad_keys(check, origins, pk)
        if not run.walls.stop_recorded(loc, verify.bad_commit_failures(check, by_region, wrong)):
            return True  # the marker stays: the next run finds the wrong rows again
    else:
        log.debug("merge commit version %d verified in %.3f s", check.version, check.seconds)
    unverified.clear(loc, pending)
    return True


def _count(run: Run, deduped: sparkpath.Deduped, gens: list[PlannedGeneration], index: dict[str, int],
           stats: dict, ds: lance.LanceDataset) -> None:
    """Count the commit `ds` now holds (merge_insert moved it to the committed version)."""
    result = run.result
    result.commits += 1
    result.rows_upserted += stats["num_inserted_rows"] + stats["num_updated_rows"]
    result.rows_deleted += stats["num_deleted_rows"]
    result.bytes_written += _bytes_written(ds, ds.version)
    by_gen = {(s.region, s.generation): s for s in deduped.stats}
    for g in gens:
        r = result.regions[g.region_id]
        r.generations_merged.append(g.generation)
        r.merged_generation = max(r.merged_generation, g.generation)
        s = by_gen.get((index[g.region_id], g.generation))
        if s is not None:
            r.rows_read += s.rows
            r.bytes_read += s.bytes
            result.bytes_read += s.bytes


def _cast_stream(tables: Iterator[pa.Table], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    for t in tables:
        yield from t.select(schema.names).cast(schema).to_batches()


def _bytes_written(ds: lance.LanceDataset, version: int) -> int:
    txn = ds.read_transaction(version)
    op = getattr(txn, "operation", None)
    frags = list(getattr(op, "new_fragments", []) or [])
    return sum((f.file_size_bytes or 0) for frag in frags for f in frag.files)
