"""GC leftovers and mismatches (#18.15, #18.17, #18.18), on real pylance tables.

- Survivors of a partly failed S3 DeleteObjects batch (WAL entries, old manifest versions) sit
  below a hole in the positions GC walks; a later run must still collect them.
- A percent-encoded S3 prefix means the same objects to memwal as to Lance.
- A region whose recorded merge progress is ahead of its `current_generation` (directory reset,
  UUID reused) is refused by GC and shown by status, instead of having each new generation
  collected as soon as it is flushed.
"""

from __future__ import annotations

import shutil
import uuid
from datetime import timedelta

import lance
import pyarrow as pa

from memwal_core import demo, gc, layout, merge, reader, region, status, table
from memwal_core.lance_mem_wal import merged_markers
from memwal_core.store import make_s3_client, open_store

FAST = gc.GcConfig(manifest_keep_versions=2, manifest_min_age_s=0, orphan_grace_s=0,
                   base_cleanup_older_than=timedelta(0), keep_current_epoch_wal=False)


def _as_dict(t: pa.Table) -> dict:
    return {r["id"]: r for r in t.to_pylist()}


def test_survivors_of_a_partly_failed_delete_batch_are_collected_later(s3_table_loc, spark):
    """On moto: GC deletes a batch, S3 keeps some of its keys (planted back exactly as a
    DeleteObjects answer with per-key errors leaves them: below keys that were deleted);
    the next run plans and deletes them."""
    loc = s3_table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=7, key_space=200, max_memtable_rows=20)
    for _ in range(3):
        w.write_round(60, overwrite=0.3, delete=0.05, puts_per_batch=10)
    assert not merge.merge(loc, spark).failed_regions
    w.write_round(20, puts_per_batch=10)

    gc.cleanup_base_versions(loc, FAST)
    plan = gc.plan_gc(loc, FAST)
    assert not plan.errors
    survivors: dict[str, bytes] = {}
    for kind in (gc.WAL, gc.MANIFEST):
        items = sorted((i for i in plan.items if i.kind == kind), key=lambda i: (i.region_id, i.number))
        by_region: dict[str, list[gc.GcItem]] = {}
        for i in items:
            by_region.setdefault(i.region_id, []).append(i)
        deep = [lst for lst in by_region.values() if len(lst) >= 3]
        assert deep, f"the workload must give GC several {kind} items in a region"
        for lst in deep:
            # The lowest and a middle one survive; the ones above them are deleted (the hole).
            for i in (lst[0], lst[len(lst) // 2]):
                survivors[i.keys[0]] = loc.store.get(i.keys[0])
    res = gc.execute_gc(loc, plan)
    assert not res.region_errors
    assert not any(loc.store.exists(k) for k in survivors)
    for key, data in survivors.items():  # what the failed part of the batch left
        loc.store.put(key, data)

    again = gc.plan_gc(loc, FAST)
    assert not again.errors
    planned = {k for i in again.items for k in i.keys}
    assert set(survivors) <= planned, sorted(set(survivors) - planned)
    res = gc.execute_gc(loc, again)
    assert not res.region_errors
    assert not any(loc.store.exists(k) for k in survivors)
    # Nothing a reader or writer needs went with them.
    assert _as_dict(reader.lsm_table(loc)) == w.expected()
    w.write_round(20, puts_per_batch=10)
    assert _as_dict(reader.lsm_table(loc)) == w.expected()
    # A third run with nothing left over plans no WAL entry or manifest twice.
    assert not {k for i in gc.plan_gc(loc, FAST).items for k in i.keys} & set(survivors)


def test_percent_encoded_s3_prefix_means_what_lance_means(s3_bucket):
    bucket, options = s3_bucket
    loc = open_store(f"s3://{bucket}/with%20space/t%2Bplus", options)
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    w = demo.Workload(loc, seed=3, key_space=50, max_memtable_rows=20)
    w.write_round(30, puts_per_batch=10)

    client = make_s3_client(options)
    lance_keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert all(k.startswith("with space/t+plus/") for k in lance_keys), sorted(lance_keys)[:3]
    memwal_keys = {f"with space/t+plus/{o.key}" for o in loc.store.list("")}
    assert memwal_keys == lance_keys

    regions = region.list_regions(loc.store).region_ids
    assert sorted(regions) == sorted(w.regions.values())
    st = status.table_status(loc)
    assert not st.failed_regions and st.pending_generations > 0
    plan = gc.plan_gc(loc, FAST)
    assert not plan.errors and set(plan.regions) == set(regions)
    assert _as_dict(reader.lsm_table(loc)) == w.expected()


def test_region_reset_with_progress_ahead_is_refused(table_loc):
    """Merge progress 3 recorded for a region whose directory is then reset: the new
    generation 1 must not be collected (nor shown as healthy)."""
    loc = table_loc
    demo.create_table(loc, sharding="manual", base_rows=5)
    rid = str(uuid.uuid4())
    ds = lance.dataset(loc.lance_uri)
    for gen in range(3):
        with ds.mem_wal_writer(rid, max_memtable_rows=10) as wr:
            wr.put(demo.rows_table([demo.row(100 + gen, 1)]))
    assert region.load_latest(loc.store, rid).current_generation == 4
    # Generations 1..3 merged (pylance's own marker; an empty source is allowed).
    empty = demo.rows_table([])
    lance.dataset(loc.lance_uri).merge_insert("id").when_matched_update_all().when_not_matched_insert_all() \
        .mark_sstables_as_compacted(merged_markers({rid: 3})).execute(empty)
    assert table.read_memwal_state(loc, lance.dataset(loc.lance_uri).version).merged[rid] == 3

    # The region directory is reset and a writer starts it again under the same UUID.
    shutil.rmtree(f"{loc.store.root}/{layout.region_dir(rid)}")
    with lance.dataset(loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=10) as wr:
        wr.put(demo.rows_table([demo.row(500, 2)]))
    m = region.load_latest(loc.store, rid)
    assert m.current_generation == 2 and [g.generation for g in m.generations] == [1]

    gc.cleanup_base_versions(loc, FAST)
    plan = gc.plan_gc(loc, FAST)
    assert rid in plan.errors and "current_generation" in plan.errors[rid]
    assert not plan.regions[rid].items and not plan.regions[rid].trim
    res = gc.run_gc(loc, FAST)
    assert rid in res.region_errors and not [i for i in res.deleted if i.region_id == rid]
    gen_dir = layout.generation_dir(rid, m.generations[0].path, 1)
    assert any(True for _ in loc.store.list(gen_dir)), "the new generation 1 was deleted"

    st = status.table_status(loc)
    assert "current_generation" in st.failed_regions[rid]
    assert [g.generation for g in region.pending_generations(m, 0)] == [1]  # the region itself is fine
