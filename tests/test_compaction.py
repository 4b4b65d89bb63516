"""Base-table compaction and index-segment merging (memwal_core.jobs.compaction) on real tables.

A *fragmented* table: a base written 10 rows per fragment with deleted rows (deletion files),
MemWAL on top, a btree index that MemTables maintain, and a backlog written by pylance's
ShardWriters and merged by the real Spark merger (each merge commit adds a fragment and
deletion files). Compaction tasks run in the shared local Spark session.
"""

from __future__ import annotations

import json

import lance
import numpy as np
import pyarrow as pa
import pytest

from memwal_core.jobs import catchup, compaction, merge
from memwal_core.observe import reader
from memwal_core.options import CompactionOptions, from_mapping
from memwal_core.state import table
from memwal_core.tools import demo

DIM = 8


def as_dict(t: pa.Table) -> dict:
    return {r["id"]: r for r in t.to_pylist()}


def fragmented_table(loc, *, rounds: int = 3, seed: int = 5) -> demo.Workload:
    """30 base fragments (10 rows each, every 7th row deleted), MemWAL with 2 bucket regions and
    a maintained btree, then `rounds` of writes, each merged by the Spark merger."""
    data = demo.rows_table([demo.row(i, 0) for i in range(300)])
    ds = lance.write_dataset(data, loc.lance_uri, schema=demo.SCHEMA, max_rows_per_file=10,
                             storage_options=loc.storage_options or None)
    ds.delete("id % 7 = 0")
    ds.create_scalar_index("id", "BTREE", name="id_btree")
    ds.initialize_mem_wal(bucket_column="id", num_buckets=2, maintained_indexes=["id_btree"])
    return demo.Workload(loc, seed=seed, key_space=400, max_memtable_rows=40)


def write_and_merge(w: demo.Workload, spark, rounds: int) -> None:
    for _ in range(rounds):
        w.write_round(60, overwrite=0.4, delete=0.1, puts_per_batch=10)
        assert not merge.merge(w.loc, spark).region_errors


def test_health_thresholds_and_plan_without_spark(table_loc):
    w = fragmented_table(table_loc)
    h = compaction.read_health(table_loc)
    assert h.fragments == 30 and h.small_fragments == 30 and h.physical_rows == 300
    assert h.deleted_rows == 43 and h.fragments_with_deletions == 30 and not h.stable_row_ids
    assert [i.name for i in h.indexes] == ["id_btree"] and h.indexes[0].gating and h.index_segments == {"id_btree": 1}
    plan = compaction.plan_compaction(table_loc)
    assert any("small fragments" in r for r in plan.reasons) and not any("deleted rows" in r for r in plan.reasons)
    deletes = compaction.plan_compaction(table_loc, CompactionOptions(min_deleted_rows=40))
    assert any("deleted rows 43/300" in r for r in deletes.reasons)
    assert plan.tasks >= 1 and plan.source_fragments == 30 and plan.source_bytes > 0
    # Bounded per run in bytes: at most about eight fragments' data files in one plan (the
    # table is small enough to keep fully compacted, which is not bounded: turned off here).
    per_fragment = max(sum(f.file_size_bytes for f in fr.metadata.files)
                       for fr in table.open_dataset(table_loc).get_fragments())
    small = compaction.plan_compaction(table_loc, CompactionOptions(max_bytes_per_run=8 * per_fragment,
                                                                    cheap_rewrite_bytes=0))
    assert 2 <= small.source_fragments <= 8 and small.source_bytes <= 8 * per_fragment
    assert plan.full and plan.source_fragments == 30  # kept fully compacted: the whole table
    # Under the thresholds: healthy, nothing planned, nothing runs (no Spark needed).
    lax = CompactionOptions(max_fragments=100, max_small_fragments=100, max_small_fragment_share=1.0,
                            max_deleted_row_ratio=0.5, cheap_rewrite_bytes=0)
    plan = compaction.plan_compaction(table_loc, lax)
    assert plan.healthy and plan.summary == "healthy, skipped" and plan.tasks == 0
    version = table.open_dataset(table_loc).version
    r = compaction.execute_compaction(table_loc, plan, None)
    assert r.status == "healthy, skipped" and not r.committed
    assert table.open_dataset(table_loc).version == version
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    with pytest.raises(ValueError, match="compaction: unknown key 'max_fragmentz'.*'max_fragments'"):
        from_mapping(CompactionOptions, {"max_fragmentz": 3}, "compaction")
    assert from_mapping(CompactionOptions, {"max_fragments": "5", "retrain_vector_indexes": True},
                        "compaction").max_fragments == 5
    cheap = from_mapping(CompactionOptions, {"cheap_rewrite_bytes": "16MB"}, "compaction")
    assert cheap.cheap_rewrite_bytes == 16 << 20


def test_compaction_in_spark_keeps_progress_restores_catchup_and_time_travel(table_loc, spark):
    w = fragmented_table(table_loc)
    write_and_merge(w, spark, 3)
    catchup.run_catchup(table_loc)
    ds = table.open_dataset(table_loc)
    before = table.read_memwal_state(table_loc)
    assert before.catchup["id_btree"] == before.merged  # caught up before compaction
    old_version, old_rows = ds.version, as_dict(ds.to_table())
    h0 = compaction.read_health(table_loc)
    assert h0.fragments == 33 and h0.deleted_rows > 43

    r = compaction.compact(table_loc, spark)
    assert r.status == "compacted" and r.conflicts == 0 and r.attempts == 1
    assert r.fragments_removed == 33 and r.fragments_added == 1
    # What the step outcome shows: health before and after, the rewrite, one line.
    m = r.metrics()
    assert (m["fragments_before"], m["fragments"], m["fragments_removed"], m["segments/id_btree"]) == (33, 1, 33, 1)
    assert r.failures == [] and r.summary().startswith("compacted; 33 fragments -> 1 in ")
    assert json.loads(json.dumps(r.to_dict()))["summary"] == r.summary()
    h1 = r.health_after
    assert h1.fragments == 1 and h1.deleted_rows == 0 and h1.fragments_with_deletions == 0  # deletions materialized
    assert h1.live_rows == h0.live_rows and h1.bytes < h0.bytes
    after = table.read_memwal_state(table_loc)
    assert after.merged == before.merged  # merge progress carried over
    assert after.catchup == before.catchup and r.catchup_restored == ["id_btree"]
    # What Lance does on its own (kept honest here): the Rewrite commit withdrew index_catchup;
    # memwal's restore (the next commit) re-recorded it.
    rewrite = table.read_memwal_state(table_loc, after.table_version - 1)
    assert rewrite.merged == before.merged and rewrite.catchup == {}
    assert table.open_dataset(table_loc).index_statistics("id_btree")["num_unindexed_rows"] == 0
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    assert as_dict(reader.lsm_table(table_loc)) == w.expected()
    # Time travel: the version before compaction still reads as it did.
    assert as_dict(table.open_dataset(table_loc, version=old_version).to_table()) == old_rows
    # A second run: healthy now, skipped, no commit.
    r2 = compaction.compact(table_loc, spark)
    assert r2.status == "healthy, skipped" and table.open_dataset(table_loc).version == after.table_version
    # Merging on top of the compacted table still works and the LSM read stays right.
    write_and_merge(w, spark, 1)
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()


def test_small_table_is_kept_fully_compacted_and_its_newest_fragment_folded_in(table_loc, spark):
    """Under every ratio threshold, a table of at most `cheap_rewrite_bytes` is still compacted
    whenever it has a second fragment or a deletion file: each costs a small table's scans
    30-40 %. The merge's own fragment is not indexed yet (catch-up follows compaction), so the
    index is caught up first and that fragment is folded in: one fragment, no deletion file,
    progress and catch-up intact, base == model. Off (0) or on a bigger table: skipped."""
    demo.create_table(table_loc, sharding="bucket", num_buckets=2, base_rows=500, btree_index=True,
                      maintained_indexes=["id_btree"])
    w = demo.Workload(table_loc, seed=13, key_space=5000, max_memtable_rows=100)
    w.write_round(60, overwrite=0.5, delete=0.1, puts_per_batch=10)
    assert not merge.merge(table_loc, spark).region_errors
    h = compaction.read_health(table_loc)
    assert h.fragments == 2 and h.fragments_with_deletions == 1 and h.unindexed_rows > 0
    assert h.reasons(CompactionOptions()) == []  # no ratio threshold fires
    for off in (CompactionOptions(cheap_rewrite_bytes=0), CompactionOptions(cheap_rewrite_bytes=h.bytes - 1)):
        assert compaction.plan_compaction(table_loc, off).summary == "healthy, skipped"
    version = table.open_dataset(table_loc).version
    plan = compaction.plan_compaction(table_loc)
    assert plan.full and plan.index_first == ["id_btree"] and not plan.healthy
    assert "kept fully compacted" in plan.reasons[0] and plan.summary.startswith("catch up id_btree first")
    assert table.open_dataset(table_loc).version == version  # planning changed nothing
    before = table.read_memwal_state(table_loc)

    r = compaction.execute_compaction(table_loc, plan, spark)
    assert r.status == "compacted" and r.indexed_first == ["id_btree"] and not r.errors
    assert r.catchup_restored == ["id_btree"]
    after = r.health_after
    assert (after.fragments, after.fragments_with_deletions, after.unindexed_rows) == (1, 0, 0)
    state = table.read_memwal_state(table_loc)
    assert state.merged == before.merged and state.catchup["id_btree"] == state.merged
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    assert as_dict(reader.lsm_table(table_loc)) == w.expected()
    # Nothing left to do: the next run is skipped without a commit.
    v = table.open_dataset(table_loc).version
    assert compaction.compact(table_loc, spark).status == "healthy, skipped"
    assert table.open_dataset(table_loc).version == v
    # A delete-only change leaves just a deletion file on the one fragment: materialized too.
    w.write_round(20, overwrite=0.0, delete=1.0, puts_per_batch=10)
    assert not merge.merge(table_loc, spark).region_errors
    h = compaction.read_health(table_loc)
    assert h.fragments_with_deletions == 1 and h.reasons(CompactionOptions()) == []
    r = compaction.compact(table_loc, spark)
    assert r.status == "compacted" and r.health_after.fragments_with_deletions == 0
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()


def test_small_table_without_an_index_is_kept_fully_compacted(table_loc, spark):
    """The cheap rule on a table with no index at all: nothing to catch up first, the plain
    rewrite folds every fragment and deletion file in over several merge cycles."""
    demo.create_table(table_loc, sharding="bucket", num_buckets=2, base_rows=300)
    w = demo.Workload(table_loc, seed=21, key_space=3000, max_memtable_rows=50)
    for cycle in range(3):
        w.write_round(40, overwrite=0.5, delete=0.2, puts_per_batch=10)
        assert not merge.merge(table_loc, spark).region_errors
        h = compaction.read_health(table_loc)
        assert h.fragments == 2 and h.unindexed_rows == 0 and h.reasons(CompactionOptions()) == []
        before = table.read_memwal_state(table_loc).merged
        plan = compaction.plan_compaction(table_loc)
        assert plan.full and plan.index_first == [] and "kept fully compacted" in plan.reasons[0], cycle
        r = compaction.execute_compaction(table_loc, plan, spark)
        assert r.status == "compacted" and r.indexed_first == [] and not r.errors
        assert (r.health_after.fragments, r.health_after.fragments_with_deletions) == (1, 0)
        assert table.read_memwal_state(table_loc).merged == before
        assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()


def test_small_table_of_300_fragments_is_fully_compacted_in_one_pass(table_loc, spark):
    """A 3,000-row table in 300 fragments, every one with a deletion file, and a merge on top:
    it is under `cheap_rewrite_bytes`, so one pass leaves one fragment and no deletion file
    (the per-run bound is in bytes, and a table kept fully compacted is rewritten whole),
    with merge progress and the model intact."""
    data = demo.rows_table([demo.row(i, 0) for i in range(3000)])
    ds = lance.write_dataset(data, table_loc.lance_uri, schema=demo.SCHEMA, max_rows_per_file=10)
    ds.delete("id % 7 = 0")
    ds.create_scalar_index("id", "BTREE", name="id_btree")
    ds.initialize_mem_wal(bucket_column="id", num_buckets=2, maintained_indexes=["id_btree"])
    w = demo.Workload(table_loc, seed=9, key_space=4000, max_memtable_rows=40)
    w.write_round(60, overwrite=0.4, delete=0.1, puts_per_batch=10)
    assert not merge.merge(table_loc, spark).region_errors
    h = compaction.read_health(table_loc)
    assert h.fragments == 301 and h.fragments_with_deletions >= 300 and h.bytes < CompactionOptions().cheap_rewrite_bytes
    before = table.read_memwal_state(table_loc).merged
    r = compaction.compact(table_loc, spark)
    assert r.status == "compacted" and not r.errors, r.summary()
    assert (r.health_after.fragments, r.health_after.fragments_with_deletions, r.health_after.unindexed_rows) == (1, 0, 0)
    assert table.read_memwal_state(table_loc).merged == before
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    index_lookups_agree(table_loc, w.expected())


def test_merged_fragments_each_in_its_own_index_segment_are_compacted(table_loc, spark):
    """A catch-up that appends a delta segment per merge (`num_indices_to_merge: 0`) gives every
    merged fragment its own index coverage, and Lance compacts only fragments with the same
    coverage: a trigger fires, Lance plans nothing, and every pass would say "healthy, skipped"
    while fragments pile up. The plan merges those indexes' segments first, then compacts: one
    fragment, no deletion file, progress and catch-up intact, lookups through both indexes right."""
    demo.create_table(table_loc, sharding="bucket", num_buckets=2, base_rows=500, btree_index=True,
                      maintained_indexes=["id_btree"])
    table.open_dataset(table_loc).create_scalar_index("n", "BITMAP", name="n_bitmap")
    w = demo.Workload(table_loc, seed=29, key_space=5000, max_memtable_rows=100)
    for _ in range(2):
        w.write_round(40, overwrite=0.4, delete=0.1, puts_per_batch=10)
        assert not merge.merge(table_loc, spark).region_errors
        assert not catchup.run_catchup(table_loc, num_indices_to_merge=0).errors
    h = compaction.read_health(table_loc)
    assert (h.fragments, h.unindexed_rows, h.index_segments) == (3, 0, {"id_btree": 3, "n_bitmap": 3})
    # What Lance plans as is: each fragment rewritten alone (its deletions materialized), none combined.
    lance_plan = compaction.bounded_plan(table.open_dataset(table_loc), CompactionOptions(), full=True)
    assert [len(t.fragments) for t in lance_plan.tasks] in ([], [1], [1, 1], [1, 1, 1])
    before = table.read_memwal_state(table_loc)
    plan = compaction.plan_compaction(table_loc)
    assert not plan.healthy and plan.index_first == [] and plan.segments_first == {"id_btree": 3, "n_bitmap": 3}
    assert plan.summary.startswith("merge index segments of id_btree (3), n_bitmap (3) first"), plan.summary
    r = compaction.execute_compaction(table_loc, plan, spark)
    assert r.status == "compacted" and not r.errors and r.segments_merged == {"id_btree": 3, "n_bitmap": 3}, r.summary()
    after = r.health_after
    assert (after.fragments, after.fragments_with_deletions, after.unindexed_rows) == (1, 0, 0)
    assert after.index_segments == {"id_btree": 1, "n_bitmap": 1}
    state = table.read_memwal_state(table_loc)
    assert state.merged == before.merged and state.catchup["id_btree"] == state.merged
    model = w.expected()
    assert as_dict(table.open_dataset(table_loc).to_table()) == model
    index_lookups_agree(table_loc, model)
    ds = table.open_dataset(table_loc)
    assert as_dict(ds.to_table(filter="n = 0")) == {k: v for k, v in model.items() if v["n"] == 0}


def test_merge_landing_between_plan_and_commit_is_retried(table_loc, spark):
    w = fragmented_table(table_loc)
    write_and_merge(w, spark, 2)
    catchup.run_catchup(table_loc)
    plan = compaction.plan_compaction(table_loc)
    landed = []

    def concurrent_merge(attempt: int) -> None:
        if attempt == 1:  # a merger commits after our tasks ran and before our commit
            w.write_round(40, overwrite=0.5, delete=0.2, puts_per_batch=10)
            landed.append(merge.merge(table_loc, spark))

    r = compaction.execute_compaction(table_loc, plan, spark, before_commit=concurrent_merge)
    assert landed and landed[0].commits == 1
    assert r.conflicts == 1 and r.attempts == 2 and r.status == "compacted"
    state = table.read_memwal_state(table_loc)
    assert state.merged == {rid: g.merged_generation for rid, g in landed[0].regions.items()} | {
        rid: state.merged[rid] for rid in state.merged if rid not in landed[0].regions}
    assert all(state.merged[rid] == landed[0].regions[rid].merged_generation for rid in landed[0].regions)
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    # The merge's fragment is not indexed yet: Lance leaves it out of the rewrite (next run takes it).
    assert compaction.read_health(table_loc).fragments == 2


def test_gives_up_cleanly_when_every_attempt_loses(table_loc, spark):
    w = fragmented_table(table_loc)
    write_and_merge(w, spark, 1)
    catchup.run_catchup(table_loc)
    plan = compaction.plan_compaction(table_loc, CompactionOptions(max_attempts=1))
    frags = compaction.read_health(table_loc).fragments

    def concurrent_merge(_attempt: int) -> None:
        w.write_round(40, overwrite=0.5, delete=0.2, puts_per_batch=10)
        assert merge.merge(table_loc, spark).commits == 1

    r = compaction.execute_compaction(table_loc, plan, spark, before_commit=concurrent_merge)
    assert r.status.startswith("gave up") and r.conflicts == 1 and not r.committed
    assert r.gave_up and "1 commit conflict(s) over 1 attempt(s)" in r.summary()
    assert r.health_after.fragments == frags + 1  # the merge's fragment; nothing of the rewrite
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    assert as_dict(reader.lsm_table(table_loc)) == w.expected()
    # The next run compacts.
    assert compaction.compact(table_loc, spark).status == "compacted"
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()


# ------------------------------------------------------------------------------ index segments

VSCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False, metadata=demo.PK),
                     pa.field("v", pa.list_(pa.float32(), DIM))])


def vectors(lo: int, n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"id": pa.array(np.arange(lo, lo + n), pa.int64()),
                     "v": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * DIM, dtype=np.float32)), DIM)},
                    schema=VSCHEMA)


def vector_table(loc, maintained: list[str], deltas: int = 4):
    ds = lance.write_dataset(vectors(0, 512, 0), loc.lance_uri, schema=VSCHEMA)
    ds.create_index("v", "IVF_PQ", name="v_idx", num_partitions=2, num_sub_vectors=2)
    ds.initialize_mem_wal(bucket_column="id", num_buckets=2, maintained_indexes=maintained)
    for i in range(deltas):  # appended data, each caught up as a new delta segment
        lance.write_dataset(vectors(1000 + 100 * i, 100, i + 1), loc.lance_uri, mode="append")
        lance.dataset(loc.lance_uri).optimize.optimize_indices(index_names=["v_idx"])


def test_index_segments_merged_past_threshold(table_loc):
    vector_table(table_loc, maintained=["v_idx"])
    h = compaction.read_health(table_loc)
    (v,) = h.indexes
    assert v.vector and v.gating and v.segments == 4 and v.drift_share > 0
    quiet = CompactionOptions(max_fragments=100, max_small_fragments=100, max_small_fragment_share=1.0,
                              cheap_rewrite_bytes=0)
    assert compaction.plan_compaction(table_loc, CompactionOptions(**{**quiet.__dict__, "max_index_segments": 4})).healthy
    o = CompactionOptions(**{**quiet.__dict__, "max_index_segments": 2})
    plan = compaction.plan_compaction(table_loc, o)
    # The 3 most recent segments: the first (trained) one stays apart, so drift stays visible.
    assert plan.merge_segments == {"v_idx": 3} and plan.tasks == 0
    r = compaction.execute_compaction(table_loc, plan, None)  # no data rewrite: no Spark needed
    assert r.segments_merged == {"v_idx": 3} and r.status == "indexes merged"
    assert r.health_after.index_segments == {"v_idx": 2}
    # Settled: two segments left, nothing more to merge even with the lowest threshold.
    assert compaction.plan_compaction(table_loc, CompactionOptions(**{**o.__dict__, "max_index_segments": 1})).healthy
    assert table.open_dataset(table_loc).count_rows() == 912


def test_vector_retrain_only_on_request_and_never_a_maintained_index(table_loc, tmp_path):
    quiet = dict(max_fragments=100, max_small_fragments=100, max_small_fragment_share=1.0,
                 retrain_drift_share=0.2, cheap_rewrite_bytes=0)
    vector_table(table_loc, maintained=["v_idx"])
    plan = compaction.plan_compaction(table_loc, CompactionOptions(**quiet))
    assert plan.retrain == [] and "on request" in plan.retrain_refused["v_idx"]
    plan = compaction.plan_compaction(table_loc, CompactionOptions(**quiet, retrain_vector_indexes=True))
    assert plan.retrain == [] and "stable codebook" in plan.retrain_refused["v_idx"]

    from memwal_core.state.store import open_store

    loc = open_store(str(tmp_path / "free"))
    vector_table(loc, maintained=[])
    plan = compaction.plan_compaction(loc, CompactionOptions(**quiet, retrain_vector_indexes=True))
    assert plan.retrain == ["v_idx"] and "v_idx" not in plan.merge_segments
    r = compaction.execute_compaction(loc, plan, None)
    assert r.retrained == ["v_idx"] and not r.errors
    assert r.health_after.index_segments == {"v_idx": 1} and r.health_after.indexes[0].drift_share == 0


# ------------------------------------------------------------------------------ stable row ids

def test_merger_refuses_stable_row_ids(table_loc):
    data = demo.rows_table([demo.row(i, 0) for i in range(20)])
    ds = lance.write_dataset(data, table_loc.lance_uri, schema=demo.SCHEMA, enable_stable_row_ids=True)
    ds.initialize_mem_wal(bucket_column="id", num_buckets=2)
    w = demo.Workload(table_loc, seed=3, key_space=50, max_memtable_rows=20)
    w.write_round(20)
    version = table.open_dataset(table_loc).version
    plan = merge.plan_merge(table_loc)
    assert plan.batches
    with pytest.raises(table.StableRowIds, match="stable row ids.*mint new row ids.*nothing was changed"):
        merge.execute_merge(table_loc, plan, None)
    assert table.open_dataset(table_loc).version == version
    assert table.read_memwal_state(table_loc).merged == {}
    assert compaction.read_health(table_loc).stable_row_ids


# ---------------------------------------------------------------------------- memwal maintain

def test_one_maintain_merges_and_compacts_a_fragmented_table_with_a_backlog(table_loc, spark, capsys):
    """The issue's "done when": a fragmented table with a backlog, one `memwal maintain`
    (in process, sharing the test's Spark session): merged, compacted to a small fraction of
    its fragments, deletion files materialized, progress and catch-up intact, base == model.
    `--dry-run` shows the compaction plan first and changes nothing; `--only compact` then
    reports the table healthy."""
    import json

    from memwal_pipeline import cli

    w = fragmented_table(table_loc)
    for _ in range(4):  # the backlog: 4 generations per region, not merged yet
        w.write_round(60, overwrite=0.4, delete=0.1, puts_per_batch=10)
    version = table.open_dataset(table_loc).version
    uri = table_loc.lance_uri

    assert cli.main(["maintain", uri, "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["steps"]["compact"]["plan"]
    assert plan["tasks"] >= 1 and plan["health"]["fragments"] == 30
    assert plan["summary"].startswith("compact 30 fragments")
    assert table.open_dataset(table_loc).version == version

    assert cli.main(["maintain", uri, "--spark-master", "local[2]", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["failed"] == []
    assert rep["steps"]["merge"]["metrics"]["generations_merged"] == 8
    c = rep["steps"]["compact"]["metrics"] | rep["steps"]["compact"]["result"]
    # 31 -> 1: the fragment this run's merge added is not indexed yet when compaction runs (catch-up
    # follows it) and Lance does not combine indexed with unindexed fragments, so compaction
    # catches the index up first and folds that fragment in too.
    assert c["status"] == "compacted" and c["fragments_before"] == 31 and c["fragments"] == 1
    assert c["indexed_first"] == ["id_btree"]
    assert c["deleted_row_ratio"] == 0 and c["deletion_file_ratio"] == 0 and rep["steps"]["compact"]["status"] == "ok"
    assert c["bytes_after"] < c["bytes_before"] and c["index_segments"] == 1 and c["segments"]["id_btree"] == 1
    h = compaction.read_health(table_loc)
    assert h.fragments == 1 and h.fragments_with_deletions == 0 and h.deleted_rows == 0
    state = table.read_memwal_state(table_loc)
    assert sorted(state.merged.values()) == [4, 4]
    assert state.catchup["id_btree"] == state.merged
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    assert as_dict(reader.lsm_table(table_loc)) == w.expected()

    assert cli.main(["maintain", uri, "--only", "compact", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    c = rep["steps"]["compact"]
    assert c["result"]["status"] == "healthy, skipped" and c["metrics"]["tasks"] == 0
    assert c["status"] == "nothing_to_do"


def test_base_compaction_asset_metadata_and_healthy_skip(table_loc, spark):
    """The Dagster asset on its own: numeric metadata the UI plots; 'healthy, skipped' when
    under the thresholds (it still materializes and reports the numbers)."""
    from dagster import DagsterInstance, FloatMetadataValue, IntMetadataValue, materialize

    from memwal_core.options import SparkOptions
    from memwal_pipeline.config import TableConfig
    from memwal_pipeline.definitions import table_definitions

    w = fragmented_table(table_loc)
    cfg = TableConfig(name="t", uri=table_loc.lance_uri, spark=SparkOptions(master="local[2]"),
                      compaction=CompactionOptions(max_small_fragments=8))
    td = table_definitions(cfg)
    (asset,) = [a for a in td.assets if a.key.path[-1] == "base_compaction"]
    with DagsterInstance.ephemeral() as instance:
        md = []
        for _ in range(2):
            r = materialize([asset], instance=instance, resources=td.resources)
            assert r.success
            md.append(r.asset_materializations_for_node(asset.op.name)[0].metadata)
    first, second = md
    assert first["status"].value == "compacted" and first["fragments_before"].value == 30
    assert first["fragments"].value == 1 and first["bytes_after"].value < first["bytes_before"].value
    for key in ("fragments", "small_fragments", "index_segments", "bytes_before", "bytes_after", "segments/id_btree"):
        assert isinstance(first[key], IntMetadataValue), key
    for key in ("deleted_row_ratio", "deletion_file_ratio"):
        assert isinstance(first[key], FloatMetadataValue), key
    assert first["deleted_row_ratio"].value == 0
    assert second["status"].value == "healthy, skipped" and second["tasks"].value == 0
    assert second["fragments"].value == 1
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    # An insert-only merge adds one unindexed fragment and no deletion file: Lance's plan has no
    # task until the index is caught up, so the asset must start Spark for the plan it makes after.
    w.key_space = 10**9  # new keys only: no row of the compacted fragment is replaced
    w.write_round(30, overwrite=0.0, delete=0.0, absent_delete=0.0, puts_per_batch=10)
    assert not merge.merge(table_loc, spark).region_errors
    plan = compaction.plan_compaction(table_loc, cfg.compaction)
    assert plan.tasks == 0 and plan.index_first == ["id_btree"] and plan.needs_spark
    with DagsterInstance.ephemeral() as instance:
        r = materialize([asset], instance=instance, resources=td.resources)
    assert r.success
    third = r.asset_materializations_for_node(asset.op.name)[0].metadata
    assert third["status"].value == "compacted" and third["indexed_first"].value == ["id_btree"]
    assert third["fragments_before"].value == 2 and third["fragments"].value == 1
    state = table.read_memwal_state(table_loc)
    assert state.catchup["id_btree"] == state.merged
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()


def test_compaction_on_s3(s3_table_loc, spark):
    """The same path against an S3-protocol server (moto): tasks open the table with the
    storage options they were given; progress kept, base == model."""
    w = fragmented_table(s3_table_loc)
    write_and_merge(w, spark, 1)
    before = table.read_memwal_state(s3_table_loc)
    r = compaction.compact(s3_table_loc, spark)
    # The merge's unindexed fragment is folded in after catching the index up (on S3 too).
    assert r.status == "compacted" and r.indexed_first == ["id_btree"]
    assert r.health_after.fragments == 1 and r.health_after.deleted_rows == 0
    assert table.read_memwal_state(s3_table_loc).merged == before.merged
    assert as_dict(table.open_dataset(s3_table_loc).to_table()) == w.expected()


def test_compaction_thresholds_per_table_in_config(tmp_path):
    import textwrap

    from memwal_pipeline.config import ConfigError, load_config

    cfg = tmp_path / "memwal.yaml"
    cfg.write_text(textwrap.dedent("""
        tables:
          - {name: a, uri: data/a, compaction: {max_small_fragments: 4, max_deleted_row_ratio: 0.2,
                                               retrain_vector_indexes: true}}
          - {name: b, uri: data/b}
    """))
    a, b = load_config(cfg)
    assert a.compaction.max_small_fragments == 4 and a.compaction.max_deleted_row_ratio == 0.2
    assert a.compaction.retrain_vector_indexes and b.compaction == CompactionOptions()
    cfg.write_text("tables:\n  - {name: a, uri: data/a, compaction: {max_small_fragment: 4}}\n")
    with pytest.raises(ConfigError, match="compaction: unknown key 'max_small_fragment'.*did you mean 'max_small_fragments'"):
        load_config(cfg)
    # The per-run bound is in bytes only: the count bound of earlier releases is refused, saying
    # what to set, rather than ignored (a bound an operator set that silently stopped bounding).
    cfg.write_text("tables:\n  - {name: a, uri: data/a, compaction: {max_fragments_per_run: 256}}\n")
    with pytest.raises(ConfigError, match="'max_fragments_per_run' is no longer a setting: .*max_bytes_per_run"):
        load_config(cfg)
    cfg.write_text("tables:\n  - {name: a, uri: data/a, compaction: {max_bytes_per_run: 2GB}}\n")
    assert load_config(cfg)[0].compaction.max_bytes_per_run == 2 << 30
    cfg.write_text("tables:\n  - {name: a, uri: data/a, compaction: {max_attempts: 0}}\n")
    with pytest.raises(ConfigError, match="max_attempts"):
        load_config(cfg)


def test_a_merge_read_before_a_compaction_rebases_on_it(table_loc, spark):
    """The other order: a `merge_insert` built on the version before a compaction commits after
    it. Lance rebases the Update on the Rewrite (no conflict): every update applied once, no
    duplicate keys, progress kept. (The merger treats a conflict as a retry anyway.)"""
    w = fragmented_table(table_loc)
    write_and_merge(w, spark, 1)
    merged = table.read_memwal_state(table_loc).merged
    stale = table.open_dataset(table_loc)
    src = demo.rows_table([demo.row(k, 777) for k in sorted(w.model)[:40]] + [demo.row(999_999, 777)])
    builder = stale.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
    assert compaction.compact(table_loc, spark).status == "compacted"
    stats = builder.execute(src)
    assert stats["num_updated_rows"] == 40 and stats["num_inserted_rows"] == 1
    for r in src.to_pylist():
        w.model[r["id"]] = r
    got = table.open_dataset(table_loc).to_table()
    assert got.num_rows == len(as_dict(got)) and as_dict(got) == w.model
    assert table.read_memwal_state(table_loc).merged == merged


# -------------------------------------------------------------------------- races, bounds, leftovers

def unreferenced_data_files(loc) -> set[str]:
    """Data files no retained table version references (what a lost rewrite would leave)."""
    ds = table.open_dataset(loc)
    referenced = {f"data/{f.path}" for v in ds.versions()
                  for frag in table.open_dataset(loc, version=v["version"]).get_fragments()
                  for f in frag.metadata.files}
    return {o.key for o in loc.store.list("data/")} - referenced


def index_lookups_agree(loc, model: dict) -> None:
    """Filtered reads (the btree answers them) return the model's rows: the index was remapped right."""
    ds = table.open_dataset(loc)
    for k in sorted(model)[:12]:
        assert ds.to_table(filter=f"id = {k}").to_pylist() == [model[k]], k


@pytest.mark.parametrize("racer", ["catchup", "snapshot", "compaction"])
def test_other_commits_between_plan_and_commit(table_loc, spark, racer):
    """Not only merges commit to the base table: an index catch-up (CreateIndex), a MemWAL
    snapshot (the MemWAL index) or a second compaction may land between our rewrite and our
    commit. Each ends in a right table: catch-up and a second Rewrite conflict (retried, then
    nothing left to rewrite), the snapshot is rebased over and kept, never overwritten."""
    from memwal_core.jobs import snapshot

    w = fragmented_table(table_loc)
    write_and_merge(w, spark, 2)
    if racer != "catchup":
        catchup.run_catchup(table_loc)
    before = table.read_memwal_state(table_loc)
    plan = compaction.plan_compaction(table_loc)
    if racer == "catchup":
        # As when the catch-up compaction runs first failed: the merges' fragments stay
        # unindexed, so the racing catch-up has something to commit.
        assert plan.index_first == ["id_btree"]
        plan.index_first = []
    raced = []

    def race(attempt: int) -> None:
        if attempt == 1:
            raced.append({"catchup": lambda: catchup.run_catchup(table_loc),
                          "snapshot": lambda: snapshot.build_snapshot(table_loc),
                          "compaction": lambda: compaction.compact(table_loc, spark)}[racer]())

    r = compaction.execute_compaction(table_loc, plan, spark, before_commit=race)
    assert not r.errors and r.status in ("compacted", "nothing to rewrite"), r.status
    state = table.read_memwal_state(table_loc)
    assert state.merged == before.merged
    assert compaction.read_health(table_loc).fragments <= 2
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    assert as_dict(reader.lsm_table(table_loc)) == w.expected()
    index_lookups_agree(table_loc, w.expected())
    if racer == "snapshot":
        assert raced[0].committed and r.conflicts == 0  # Lance rebased the Rewrite over it
        theirs = table.read_memwal_state(table_loc, raced[0].table_version).details
        assert (state.details.snapshot_ts_millis, state.details.inline_snapshots) == \
            (theirs.snapshot_ts_millis, theirs.inline_snapshots)
    else:
        assert r.conflicts == 1 and r.attempts == 2
    catchup.run_catchup(table_loc)
    state = table.read_memwal_state(table_loc)
    assert state.catchup["id_btree"] == state.merged
    assert not unreferenced_data_files(table_loc)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_merge_winning_every_attempt_gives_up_and_leaves_no_files(request, spark, where):
    """A merge lands before every one of `max_attempts` commits: three conflicts, then a clean
    give-up. The data files each lost rewrite wrote are deleted at once (Lance alone keeps
    never-referenced files for 7 days, whatever the retention), so a table whose compaction
    keeps losing does not pile up a rewrite per attempt."""
    loc = request.getfixturevalue("table_loc" if where == "local" else "s3_table_loc")
    w = fragmented_table(loc)
    write_and_merge(w, spark, 1)
    catchup.run_catchup(loc)
    plan = compaction.plan_compaction(loc, CompactionOptions(max_attempts=3))
    seen = []

    def concurrent_merge(attempt: int) -> None:
        seen.append(attempt)
        w.write_round(20, overwrite=0.5, delete=0.2, puts_per_batch=10)
        assert merge.merge(loc, spark).commits == 1

    r = compaction.execute_compaction(loc, plan, spark, before_commit=concurrent_merge)
    assert seen == [1, 2, 3] and (r.attempts, r.conflicts) == (3, 3) and r.status.startswith("gave up")
    assert not r.committed and not r.catchup_restored
    assert as_dict(table.open_dataset(loc).to_table()) == w.expected()
    assert not unreferenced_data_files(loc)


def test_gc_after_compaction_keeps_what_retained_versions_read(table_loc, spark):
    """GC's base-version cleanup after a compaction: a retained pre-compaction version still
    reads as it did; once only the latest is retained, every data file left is one it reads."""
    from memwal_core.jobs import gc
    from memwal_core.options import GcOptions

    w = fragmented_table(table_loc)
    write_and_merge(w, spark, 1)
    catchup.run_catchup(table_loc)
    ds = table.open_dataset(table_loc)
    old_version, old_rows = ds.version, as_dict(ds.to_table())
    assert compaction.compact(table_loc, spark).status == "compacted"
    keep = table.open_dataset(table_loc).version - old_version + 1
    gc.run_gc(table_loc, GcOptions(cleanup_base_versions_older_than_seconds=None, cleanup_base_versions_retain=keep, cleanup_base_versions_floor_seconds=0))
    assert old_version in [v["version"] for v in table.open_dataset(table_loc).versions()]
    assert as_dict(table.open_dataset(table_loc, version=old_version).to_table()) == old_rows
    gc.run_gc(table_loc, GcOptions(cleanup_base_versions_older_than_seconds=None, cleanup_base_versions_retain=1, cleanup_base_versions_floor_seconds=0))
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()
    assert as_dict(reader.lsm_table(table_loc)) == w.expected()
    assert not unreferenced_data_files(table_loc)


def test_bounded_runs_progress_and_deletion_only_trigger(table_loc, spark):
    """Per-run bounds hold when executed, not only planned (a bound below one task's size still
    progresses: at least two fragments); a table of large fragments whose only trouble is
    deleted rows is rewritten with its deletions materialized, progress kept."""
    w = fragmented_table(table_loc)
    sizes = [sum(f.file_size_bytes for f in fr.metadata.files) for fr in table.open_dataset(table_loc).get_fragments()]
    bounded = [CompactionOptions(max_bytes_per_run=sum(sizes[:5]), cheap_rewrite_bytes=0),
               CompactionOptions(max_bytes_per_run=1, cheap_rewrite_bytes=0)]
    removed = [compaction.compact(table_loc, spark, o).fragments_removed for o in bounded]
    assert removed == [5, 2]
    assert compaction.read_health(table_loc).fragments == 30 - 4 - 1
    assert as_dict(table.open_dataset(table_loc).to_table()) == w.expected()

    from memwal_core.state.store import open_store

    loc = open_store(table_loc.lance_uri + "-big")
    ds = lance.write_dataset(demo.rows_table([demo.row(i, 0) for i in range(3000)]), loc.lance_uri,
                             schema=demo.SCHEMA, max_rows_per_file=1000)
    ds.delete("id % 3 = 0")
    ds.create_scalar_index("id", "BTREE", name="id_btree")
    ds.initialize_mem_wal(bucket_column="id", num_buckets=2, maintained_indexes=["id_btree"])
    big = demo.Workload(loc, seed=5, key_space=4000, max_memtable_rows=40)
    big.write_round(40, overwrite=0.5, delete=0.2, puts_per_batch=10)
    assert not merge.merge(loc, spark).region_errors
    catchup.run_catchup(loc)
    o = CompactionOptions(min_deleted_rows=100, small_fragment_rows=30, max_small_fragments=100,
                          cheap_rewrite_bytes=0)
    before = table.read_memwal_state(loc)
    plan = compaction.plan_compaction(loc, o)
    assert [r.split(" ")[0] for r in plan.reasons] == ["deleted"] and plan.tasks >= 1
    r = compaction.execute_compaction(loc, plan, spark)
    assert r.status == "compacted" and r.health_after.deleted_rows == 0
    after = table.read_memwal_state(loc)
    assert after.merged == before.merged and after.catchup == before.catchup
    assert as_dict(table.open_dataset(loc).to_table()) == big.expected()
    index_lookups_agree(loc, big.expected())
    # Every row deleted: Lance drops the fragments; nothing to compact, nothing breaks.
    table.open_dataset(loc).delete("true")
    assert compaction.compact(loc, spark, o).status == "healthy, skipped"


def test_segment_merge_keeps_a_maintained_codebook(table_loc):
    """Merging a MemTable-maintained vector index's segments keeps its centroids (the spec's
    stable codebook): only the segment count changes."""
    import os

    vector_table(table_loc, maintained=["v_idx"])

    def centroids() -> list:
        os.environ.pop("LANCE_INCLUDE_VECTOR_CENTROIDS", None)
        return [i.get("centroids") for i in table.open_dataset(table_loc).index_statistics("v_idx")["indices"]]

    c0 = centroids()
    assert c0[0] is not None and len(c0) == 4
    o = CompactionOptions(max_fragments=100, max_small_fragments=100, max_small_fragment_share=1.0,
                          max_index_segments=2, cheap_rewrite_bytes=0)
    r = compaction.compact(table_loc, None, o)
    assert r.segments_merged == {"v_idx": 3} and centroids() == [c0[0], c0[0]]


def test_segment_merge_does_not_hide_vector_drift(table_loc):
    vector_table(table_loc, maintained=[])
    drift = compaction.read_health(table_loc).indexes[0].drift_share
    assert drift > 0.2
    o = CompactionOptions(max_fragments=100, max_small_fragments=100, max_small_fragment_share=1.0,
                          max_index_segments=2, cheap_rewrite_bytes=0)
    r = compaction.compact(table_loc, None, o)
    assert r.segments_merged == {"v_idx": 3} and r.health_after.index_segments == {"v_idx": 2}
    assert r.health_after.indexes[0].drift_share >= drift  # the codebook is still the one trained first
    plan = compaction.plan_compaction(table_loc, CompactionOptions(**{**o.__dict__, "retrain_drift_share": 0.2,
                                                                     "retrain_vector_indexes": True}))
    assert plan.retrain == ["v_idx"]


def test_maintain_dry_run_and_merge_on_a_stable_row_id_table(table_loc, spark, capsys):
    """`memwal maintain --dry-run` says the merge would be refused (not a batch plan that never
    runs); the real merge step fails with the reason and changes nothing."""
    import json

    from memwal_pipeline import cli

    ds = lance.write_dataset(demo.rows_table([demo.row(i, 0) for i in range(20)]), table_loc.lance_uri,
                             schema=demo.SCHEMA, enable_stable_row_ids=True)
    ds.initialize_mem_wal(bucket_column="id", num_buckets=2)
    demo.Workload(table_loc, seed=3, key_space=50, max_memtable_rows=20).write_round(20)
    version = table.open_dataset(table_loc).version
    assert cli.main(["maintain", table_loc.lance_uri, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "merge: refused: " in out and "stable row ids" in out and "batch of" not in out, out
    assert cli.main(["maintain", table_loc.lance_uri, "--dry-run", "--json"]) == 0
    refused = json.loads(capsys.readouterr().out)["steps"]["merge"]
    assert refused["status"] == "refused" and "stable row ids" in refused["error"]
    assert cli.main(["maintain", table_loc.lance_uri, "--only", "merge", "--spark-master", "local[2]",
                     "--json"]) == 1
    failed = json.loads(capsys.readouterr().out)["failed"]
    assert len(failed) == 1 and failed[0].startswith("merge: ") and "stable row ids" in failed[0], failed
    assert table.open_dataset(table_loc).version == version


def test_a_failing_compaction_does_not_stall_the_rest_of_maintenance(table_loc, spark, capsys):
    import os

    from dagster import DagsterInstance, materialize

    from memwal_core.options import SparkOptions
    from memwal_pipeline.config import TableConfig
    from memwal_pipeline.definitions import table_definitions

    fragmented_table(table_loc)
    frag = table.open_dataset(table_loc).get_fragments()[3].metadata.files[0].path
    os.remove(os.path.join(table_loc.lance_uri, "data", frag))  # the rewrite task of that fragment fails
    cfg = TableConfig(name="t", uri=table_loc.lance_uri, spark=SparkOptions(master="local[2]"))
    td = table_definitions(cfg)
    by = {a.key.path[-1]: a for a in td.assets}
    with DagsterInstance.ephemeral() as instance:
        r = materialize([by["base_compaction"], by["memwal_index"]], instance=instance, resources=td.resources,
                        raise_on_error=False)
        # Compaction failed and says so: its check is an ERROR, its status names the failure...
        (check,) = r.get_asset_check_evaluations()
        assert check.check_name == "compaction_ok" and not check.passed
        assert check.severity.value == "ERROR" and "error" in check.metadata
        (mat,) = r.asset_materializations_for_node(by["base_compaction"].op.name)
        assert mat.metadata["status"].value.startswith("failed: ")
        # ...and the steps after it were not skipped: the snapshot still ran.
        assert r.success and r.asset_materializations_for_node(by["memwal_index"].op.name)
    # The CLI says so too: the step's check failed, the exit code is not 0.
    import json

    from memwal_pipeline import cli

    assert cli.main(["maintain", table_loc.lance_uri, "--only", "compact", "--spark-master", "local[2]",
                     "--json"]) != 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["failed"]) == 1 and rep["failed"][0].startswith("compact: "), rep["failed"]
    assert rep["steps"]["compact"]["ok"] is False


def test_compaction_keeps_up_beside_a_merger_in_another_process(table_loc, spark, tmp_path):
    """A writer and merger loop in its own process (own Spark) while this one runs a
    compaction pass after each merge it sees land, as a maintenance run beside a merge run
    does. A table with a btree and a bitmap index, small enough to keep fully compacted: every
    pass reads the latest version (the other process's merge in it), catches the merge's
    fragment up and compacts it: one fragment, no deletion file after every pass, never
    "healthy, skipped" over a merged fragment. The table lease orders the two (a merge waits
    for a compaction and the other way round), so nothing is lost: at the end the base table
    equals the merger's model and merge progress is what it recorded."""
    import os
    import time

    from support.procs import PROCS, spawn

    from memwal_core.options import LeaseOptions

    demo.create_table(table_loc, sharding="bucket", num_buckets=2, base_rows=2000, btree_index=True,
                      maintained_indexes=["id_btree"])
    table.open_dataset(table_loc).create_scalar_index("n", "BITMAP", name="n_bitmap")
    rounds = 3
    ready, out, log = str(tmp_path / "ready"), str(tmp_path / "merger.json"), str(tmp_path / "merger.log")
    p = spawn([os.path.join(PROCS, "merge_loop.py"), table_loc.lance_uri, str(rounds), ready, out], log)
    passes = []
    try:
        seen = table.open_dataset(table_loc).version
        deadline = time.time() + 600
        while p.poll() is None:
            assert time.time() < deadline, "the merger did not finish"
            if table.open_dataset(table_loc).version == seen:
                time.sleep(0.2)
                continue
            r = compaction.compact(table_loc, spark, lease=LeaseOptions(wait_seconds=300))
            passes.append(r)
            seen = r.table_version
            time.sleep(1.0)  # the merger waits for the lease: let it take it before the next look
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, open(log).read()[-3000:]
    merger = json.load(open(out))
    summaries = [(r.status, r.health_before.table_version, r.health_before.fragments) for r in passes]
    merged_in = [r for r in passes if r.health_before.fragments > 1 or r.health_before.fragments_with_deletions]
    assert len(merged_in) >= 2, summaries
    for r in merged_in:
        assert r.status == "compacted" and not r.errors and r.conflicts == 0, summaries
        assert (r.health_after.fragments, r.health_after.fragments_with_deletions, r.health_after.unindexed_rows) == \
            (1, 0, 0), summaries
    final = compaction.compact(table_loc, spark)
    assert final.health_after.fragments == 1 and final.health_after.fragments_with_deletions == 0
    model = {int(k): v for k, v in merger["model"].items()}
    assert merger["commits"] >= rounds
    assert as_dict(table.open_dataset(table_loc).to_table()) == model
    assert json.loads(json.dumps(table.read_memwal_state(table_loc).merged)) == merger["merged"]
    index_lookups_agree(table_loc, model)
