"""GC leftovers and mismatches, on real pylance tables.

- Survivors of a partly failed S3 DeleteObjects batch (WAL entries, old manifest versions) sit
  below a hole in the positions GC walks; a later run must still collect them.
- A percent-encoded S3 prefix means the same objects to memwal as to Lance.
- A region whose recorded merge progress is ahead of its `current_generation` (directory reset,
  UUID reused) is refused by GC and shown by status, instead of having each new generation
  collected as soon as it is flushed.
"""

from __future__ import annotations

import html
import re
import shutil
import uuid

import lance
import pyarrow as pa
from support.s3proxy import S3Proxy

from memwal_core.jobs import gc, merge, snapshot
from memwal_core.observe import reader, status
from memwal_core.state import layout, region, table
from memwal_core.state.lance_mem_wal import merged_markers
from memwal_core.state.store import make_s3_client, open_store
from memwal_core.tools import demo

FAST = gc.GcOptions(manifest_retention=2, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                   cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0, keep_current_epoch_wal=False)


def _as_dict(t: pa.Table) -> dict:
    return {r["id"]: r for r in t.to_pylist()}


def test_survivors_of_a_partly_failed_delete_batch_are_collected_later(moto_server, s3_bucket, spark):
    """On moto behind the fault-injecting proxy: S3 answers GC's DeleteObjects with per-key
    errors for some keys (which stay on the server) below keys it deleted; that run reports the
    region; the next run plans those survivors and deletes them."""
    bucket, options = s3_bucket
    raw = make_s3_client(options)
    with S3Proxy(moto_server.endpoint) as proxy:
        loc = open_store(f"s3://{bucket}/t", {**options, "aws_endpoint": proxy.endpoint})
        demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
        w = demo.Workload(loc, seed=7, key_space=200, max_memtable_rows=20)
        for _ in range(3):
            w.write_round(60, overwrite=0.3, delete=0.05, puts_per_batch=10)
        assert not merge.merge(loc, spark).region_errors
        snapshot.build_snapshot(loc)  # region values recorded: GC may trim merged generations
        w.write_round(20, puts_per_batch=10)

        gc.cleanup_base_versions(loc, FAST)
        plan = gc.plan_gc(loc, FAST)
        assert not plan.region_errors and not plan.regions[next(iter(plan.regions))].leftover_scan
        survivors: dict[str, bytes] = {}  # full S3 key -> bytes
        hit_regions = set()
        for kind in (gc.WAL, gc.MANIFEST):
            by_region: dict[str, list[gc.GcItem]] = {}
            for i in sorted((i for i in plan.items if i.kind == kind), key=lambda i: i.number):
                by_region.setdefault(i.region_id, []).append(i)
            deep = {rid: lst for rid, lst in by_region.items() if len(lst) >= 3}
            assert deep, f"the workload must give GC several {kind} items in a region"
            for rid, lst in deep.items():
                hit_regions.add(rid)
                for i in (lst[0], lst[len(lst) // 2]):  # below keys of the same batch that go
                    full = f"t/{i.keys[0]}"
                    survivors[full] = raw.get_object(Bucket=bucket, Key=full)["Body"].read()

        def refuse_some(_req, body: bytes, payload: bytes) -> bytes | None:
            keys = [html.unescape(k) for k in re.findall(r"<Key>(.*?)</Key>", body.decode())]
            failed = [k for k in keys if k in survivors]
            if not failed:
                return None
            for k in failed:  # the server kept them
                raw.put_object(Bucket=bucket, Key=k, Body=survivors[k])
            errors = "".join(f"<Error><Key>{html.escape(k)}</Key><Code>InternalError</Code>"
                             "<Message>We encountered an internal error. Please try again.</Message></Error>"
                             for k in failed)
            return (b'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult '
                    b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">' + errors.encode() + b"</DeleteResult>")

        proxy.after(lambda r: r.kind == "delete_batch", refuse_some, count=1000)
        res = gc.execute_gc(loc, plan)
        proxy.clear_faults()
        assert set(res.region_errors) == hit_regions, res.region_errors
        assert all("delete_objects failed" in e for e in res.region_errors.values())
        assert all(raw.head_object(Bucket=bucket, Key=k) for k in survivors)
        # Keys above the survivors in the same batches did go: the walks meet a hole first.
        assert proxy.count("delete_batch") >= 1

        again = gc.plan_gc(loc, FAST)
        assert not again.region_errors
        assert {rid for rid, rp in again.regions.items() if rp.leftover_scan} == hit_regions
        planned = {f"t/{k}" for i in again.items for k in i.keys}
        assert set(survivors) <= planned, sorted(set(survivors) - planned)
        res = gc.execute_gc(loc, again)
        assert not res.region_errors
        left = {o["Key"] for o in raw.list_objects_v2(Bucket=bucket, Prefix="t/").get("Contents", [])}
        assert not set(survivors) & left
        assert not [k for k in left if k.startswith(f"t/{layout.GC_PENDING_DIR}/")], "intent markers left"
        # Nothing a reader or writer needs went with them.
        assert _as_dict(reader.lsm_table(loc)) == w.expected()
        w.write_round(20, puts_per_batch=10)
        assert _as_dict(reader.lsm_table(loc)) == w.expected()
        third = gc.plan_gc(loc, FAST)
        assert not any(rp.leftover_scan for rp in third.regions.values())
        assert not {f"t/{k}" for i in third.items for k in i.keys} & set(survivors)


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
    assert not st.region_errors and st.pending_generations > 0
    plan = gc.plan_gc(loc, FAST)
    assert not plan.region_errors and set(plan.regions) == set(regions)
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
    assert rid in plan.region_errors and "current_generation" in plan.region_errors[rid]
    assert not plan.regions[rid].items and not plan.regions[rid].trim
    res = gc.run_gc(loc, FAST)
    assert rid in res.region_errors and not [i for i in res.deleted if i.region_id == rid]
    gen_dir = layout.generation_dir(rid, m.generations[0].path, 1)
    assert any(True for _ in loc.store.list(gen_dir)), "the new generation 1 was deleted"

    st = status.table_status(loc)
    assert "current_generation" in st.region_errors[rid]
    assert [g.generation for g in region.pending_generations(m, 0)] == [1]  # the region itself is fine
