"""The merger's Spark data path pieces, against a real local SparkSession."""

from __future__ import annotations

import pyarrow as pa
import pytest

from memwal_core import spark as sp


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8, 64])
def test_hash_slots_land_in_their_spark_partition(spark, parts):
    """Each key partition goes to its own Spark partition, so stage 2's work is balanced."""
    from pyspark.sql import functions as F

    slots = sp.hash_slots(parts)
    assert len(set(slots)) == parts
    df = spark.createDataFrame([(v,) for v in slots], "slot int").repartition(parts, "slot")
    got = {r.slot: r.pid for r in df.select("slot", F.spark_partition_id().alias("pid")).collect()}
    assert got == {v: p for p, v in enumerate(slots)}


def test_key_partition_is_deterministic_and_spread():
    ints = pa.table({"id": pa.array(range(-5000, 5000), pa.int64())})
    a = sp.key_partition(ints, ["id"], 8)
    assert (a == sp.key_partition(ints, ["id"], 8)).all()
    counts = [int((a == p).sum()) for p in range(8)]
    assert min(counts) > 1000, counts  # ~1,250 each
    # Same key, same partition, whatever the table around it (what stage 2 relies on).
    sub = ints.slice(1234, 10)
    assert (sp.key_partition(sub, ["id"], 8) == a[1234:1244]).all()
    # Other key shapes take the generic path, also deterministic.
    strs = pa.table({"k": [f"k{i}" for i in range(1000)], "j": pa.array(range(1000), pa.int32())})
    assert (sp.key_partition(strs, ["k", "j"], 4) == sp.key_partition(strs, ["k", "j"], 4)).all()
    nulls = pa.table({"id": pa.array([1, None, 3], pa.int64())})
    assert sp.key_partition(nulls, ["id"], 4).shape == (3,)


def _blob(gen: int, region: int, ids: list[int], vals: list[str], ords: list[int], dead=None) -> pa.Table:
    n = len(ids)
    return pa.table({"id": pa.array(ids, pa.int64()), "v": vals,
                     sp.TOMBSTONE: pa.array(dead or [False] * n),
                     sp.ORD_COL: pa.array(ords, pa.uint64()),
                     sp.GEN_COL: pa.array([gen] * n, pa.int64()),
                     sp.REGION_COL: pa.array([region] * n, pa.int32())})


def test_newest_per_key_orders_by_generation_then_position():
    # Blobs arrive in any order; within a blob the row position decides (here out of order).
    blobs = [_blob(3, 0, [1, 2], ["g3-late", "g3"], [9, 1]),
             _blob(1, 0, [1, 2, 3], ["g1", "g1", "g1"], [0, 1, 2]),
             _blob(3, 0, [], [], []),
             _blob(2, 0, [1, 1, 3], ["g2-a", "g2-b", "g2"], [5, 7, 6], dead=[False, False, True])]
    # gen 3 rows are given as positions 9 (id 1) and 1 (id 2): both newest for their key.
    newest, shared = sp.newest_per_key(blobs, ["id"])
    got = {r["id"]: (r["v"], r[sp.TOMBSTONE]) for r in newest.to_pylist()}
    assert got == {1: ("g3-late", False), 2: ("g3", False), 3: ("g2", True)}
    assert shared.num_rows == 0
    # Same generation, positions decide: id 1 written twice in gen 2 (positions 5 then 7).
    newest, _ = sp.newest_per_key([_blob(2, 0, [1, 1], ["second", "first"], [7, 5])], ["id"])
    assert newest.column("v").to_pylist() == ["second"]


def test_dedup_partition_reports_keys_shared_by_regions():
    blobs = [_blob(1, 0, [1, 2], ["a", "b"], [0, 1]), _blob(1, 1, [2, 3], ["c", "d"], [0, 1])]
    batch = pa.record_batch({"blob": pa.array([sp.to_blob(b) for b in blobs], pa.binary())})
    out = pa.Table.from_batches(list(sp.dedup_partition(("id",), iter([batch]))))
    dups = [r for r in out.to_pylist() if r["kind"] == "dups"]
    assert len(dups) == 1 and dups[0]["rows"] == 1


def test_one_job_path_equals_the_cached_two_job_path(table_loc, spark):
    """`read_and_dedup` (the common case) and `read_batch` + `dedup_batch` (the careful path)
    give the same stats and the same newest rows for the same generations."""
    from memwal_core import demo, layout, merge, region, routing, table

    demo.create_table(table_loc, sharding="bucket", num_buckets=3, base_rows=20)
    w = demo.Workload(table_loc, seed=5, key_space=300, max_memtable_rows=40)
    for _ in range(3):
        w.write_round(150, overwrite=0.3, delete=0.05)
    plan = merge.plan_merge(table_loc)
    (batch,) = plan.batches
    ds = table.open_dataset(table_loc)
    state = table.read_memwal_state(table_loc, ds.version)
    specs = {s.spec_id: routing.RegionSpec.from_proto(s).to_lance() for s in state.details.region_specs}
    rids = sorted({g.region_id for g in batch.generations})
    index = {r: i for i, r in enumerate(rids)}
    manifests = region.load_many(table_loc.store, rids)
    cfg = sp.ReadConfig(pk=("id",), columns=tuple(f.name for f in ds.schema), parts=3, storage_options=(),
                        routing=tuple((index[r], merge._routing_config(r, manifests, specs, ds.lance_schema))
                                      for r in rids))
    tasks = [(i, index[g.region_id], g.generation,
              table_loc.child_uri(layout.generation_dir(g.region_id, g.path, g.generation)))
             for i, g in enumerate(batch.generations)]
    assert len(tasks) >= 6

    stats1, one = sp.read_and_dedup(spark, tasks, cfg)
    read = sp.read_batch(spark, tasks, cfg)
    try:
        two = sp.dedup_batch(spark, read.stage1, ["id"], 3)
        stats2 = read.stats
    finally:
        read.release()

    def key(s):
        return (s["region"], s["generation"], s["rows"], s["bytes"], s["info"])

    assert sorted(map(key, stats1)) == sorted(map(key, stats2)) and len(stats1) == len(tasks)

    def rows(tables):
        return sorted(pa.concat_tables(tables).to_pylist(), key=lambda r: r["id"]) if tables else []

    assert rows(one.live) == rows(two.live) and rows(one.deleted) == rows(two.deleted)
    assert one.dups == two.dups == []
    # And they are what the writers left: newest value per key, deletes as tombstones.
    model = w.expected()
    assert rows(one.live) and all(model[r["id"]] == r for r in rows(one.live))
    assert rows(one.deleted) and not ({r["id"] for r in rows(one.deleted)} & set(model))
