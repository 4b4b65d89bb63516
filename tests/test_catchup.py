"""Base-index rebuild and recorded catch-up (memwal_core.jobs.catchup) on a real pylance table.

The table has a BTREE and an IVF_PQ index; regions are written by pylance's ShardWriter and
their flushed generations merged into the base table with merge markers, as the merger does.
"""

from __future__ import annotations

import json
import uuid

import lance
import numpy as np
import pyarrow as pa
import pytest
from lance.mem_wal import CompactedSsTable, evaluate_sharding_spec

from memwal_core.jobs import catchup
from memwal_core.options import CatchupOptions
from memwal_core.state import layout, region, table

PK = {b"lance-schema:unenforced-primary-key": b"true"}
DIM = 8
SCHEMA = pa.schema([
    pa.field("id", pa.int64(), nullable=False, metadata=PK),
    pa.field("n", pa.int64()),
    pa.field("v", pa.list_(pa.float32(), DIM)),
])


def rows(ids, n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    ids = list(ids)
    vec = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(len(ids) * DIM, dtype=np.float32)), DIM)
    return pa.table({"id": pa.array(ids, pa.int64()), "n": pa.array([n] * len(ids), pa.int64()), "v": vec},
                    schema=SCHEMA)


def make_table(loc, *, maintained: list[str] | None = None) -> None:
    ds = lance.write_dataset(rows(range(300), 0, 1), loc.lance_uri, schema=SCHEMA)
    ds.create_scalar_index("id", "BTREE", name="id_idx")
    ds.create_index("v", "IVF_PQ", name="v_idx", num_partitions=2, num_sub_vectors=2)
    kw = {} if maintained is None else {"maintained_indexes": maintained}
    lance.dataset(loc.lance_uri).initialize_mem_wal(bucket_column="id", num_buckets=2, **kw)


def write_regions(loc, keys: list[int], n: int, regions: dict[int, str]) -> None:
    """One flushed generation per touched region (rows routed exactly as Lance routes)."""
    ds = lance.dataset(loc.lance_uri)
    spec = ds.mem_wal_index_details()["sharding_specs"][0]
    batch = pa.record_batch([pa.array(keys, pa.int64())], names=["id"])
    buckets = evaluate_sharding_spec(batch, spec, ds.lance_schema).column(0).to_pylist()
    by_bucket: dict[int, list[int]] = {}
    for k, b in zip(keys, buckets):
        by_bucket.setdefault(b, []).append(k)
    for b, ks in sorted(by_bucket.items()):
        rid = regions.setdefault(b, str(uuid.uuid4()))
        with ds.mem_wal_writer(rid, max_memtable_rows=1000) as w:
            w.put(rows(ks, n, n * 100 + b))


def merge_generation(loc, rid: str, generation: int, *, empty: bool = False) -> None:
    """Merge one flushed generation into the base table, marking it merged (as the merger does)."""
    m = region.load_latest(loc.store, rid)
    g = next(g for g in m.generations if g.generation == generation)
    src = lance.dataset(loc.child_uri(layout.generation_dir(rid, g.path, g.generation))).to_table()
    assert not any(src.column("_tombstone").to_pylist())
    src = src.drop_columns(["_tombstone"])
    if empty:
        src = src.slice(0, 0)
    (lance.dataset(loc.lance_uri).merge_insert("id").when_matched_update_all()
     .when_not_matched_insert_all()
     .mark_sstables_as_compacted([CompactedSsTable(rid, generation)]).execute(src))


def write_and_merge(loc, keys: list[int], n: int, regions: dict[int, str]) -> None:
    """Round `n`: one generation per touched region (`write_regions`), each merged."""
    write_regions(loc, keys, n, regions)
    for rid in regions.values():
        merge_generation(loc, rid, n)


def centroids(loc) -> list:
    return lance.dataset(loc.lance_uri).index_statistics("v_idx")["indices"][0]["centroids"]


def by_index(result: catchup.CatchupResult) -> dict[str, catchup.IndexOutcome]:
    return {o.name: o for o in result.indexes}


def test_rebuild_catches_up_btree_and_ivf_pq(table_loc):
    loc = table_loc
    make_table(loc, maintained=["id_idx"])
    regions: dict[int, str] = {}
    write_regions(loc, list(range(280, 340)), 1, regions)  # updates and inserts
    write_regions(loc, list(range(340, 380)), 2, regions)
    assert len(regions) == 2
    for rid in regions.values():
        merge_generation(loc, rid, 1)
    codebook = centroids(loc)

    plan = catchup.plan_catchup(loc)
    assert plan.gating_indexes == ["id_idx"] and plan.missing_gating == []
    assert sorted(plan.to_optimize) == ["id_idx", "v_idx"]
    for ip in plan.indexes:
        assert ip.unindexed_rows and ip.unindexed_rows > 0 and not ip.recorded and not ip.caught_up
        assert {r.region_id: (r.merged_generation, r.caught_up_generation, r.gap)
                for r in ip.regions} == {rid: (1, None, 1) for rid in regions.values()}

    result = catchup.execute_catchup(loc, plan)
    assert result.errors == {} and result.not_caught_up == []
    for name, o in by_index(result).items():
        assert o.optimized and o.caught_up
        assert o.unindexed_rows_before > 0 and o.unindexed_rows_after == 0
    assert {(r.index_name, r.region_id): (r.caught_up_generation, r.merged_generation, r.gap)
            for r in result.rows} == {(i, rid): (1, 1, 0) for i in ("id_idx", "v_idx")
                                      for rid in regions.values()}
    assert centroids(loc) == codebook  # incremental: the IVF/PQ model is kept
    assert lance.dataset(loc.lance_uri).index_statistics("v_idx")["num_indices"] == 2  # a delta
    state = table.read_memwal_state(loc)
    assert state.catchup == {i: {rid: 1 for rid in regions.values()} for i in ("id_idx", "v_idx")}

    # generation 2 of one region merged: both behind there by one; rebuild only the BTREE
    rid = regions[sorted(regions)[0]]
    merge_generation(loc, rid, 2)
    plan = catchup.plan_catchup(loc)
    lag = {ip.name: {r.region_id: r.gap for r in ip.regions} for ip in plan.indexes}
    assert lag["id_idx"][rid] == 1 and lag["v_idx"][rid] == 1
    result = catchup.run_catchup(loc, ["id_idx"])
    assert [o.name for o in result.indexes] == ["id_idx"] and result.indexes[0].caught_up
    state = table.read_memwal_state(loc)
    assert state.catchup["id_idx"][rid] == 2 and state.catchup["v_idx"][rid] == 1
    assert result.not_caught_up == []  # v_idx does not gate GC here
    full = catchup.run_catchup(loc)
    o = by_index(full)
    assert o["id_idx"].optimized is False and o["v_idx"].optimized and o["v_idx"].caught_up
    assert table.read_memwal_state(loc).catchup["v_idx"][rid] == 2
    assert centroids(loc) == codebook


def test_empty_merge_and_up_to_date(table_loc):
    loc = table_loc
    make_table(loc)  # maintain_all_indexes: both indexes gate
    regions: dict[int, str] = {}
    write_regions(loc, [1000, 1001, 1002, 1003], 1, regions)
    rid = regions[sorted(regions)[0]]
    merge_generation(loc, rid, 1, empty=True)  # progress recorded, no new rows
    plan = catchup.plan_catchup(loc)
    assert plan.gating_indexes == ["id_idx", "v_idx"]
    for ip in plan.indexes:
        assert ip.unindexed_rows == 0 and ip.optimize and ip.reason == "no index_catchup recorded yet"
    before = catchup.CatchupResult(plan, [], plan.table_version, 0.0)
    assert before.rows == []
    result = catchup.execute_catchup(loc, plan)
    # pylance commits (and records catch-up) even though there was nothing to index, and that
    # one commit records every index that covers all fragments: the second one is skipped
    assert result.not_caught_up == [] and result.table_version == plan.table_version + 1
    assert [(o.name, o.optimized) for o in result.indexes] == [("id_idx", True), ("v_idx", False)]
    assert table.read_memwal_state(loc).catchup == {"id_idx": {rid: 1}, "v_idx": {rid: 1}}
    again = catchup.plan_catchup(loc)
    assert again.to_optimize == [] and all(ip.reason == "up to date" for ip in again.indexes)
    v = lance.dataset(loc.lance_uri).version
    catchup.execute_catchup(loc, again)
    assert lance.dataset(loc.lance_uri).version == v  # nothing to do: nothing committed


def test_gating_index_missing_is_not_caught_up(table_loc):
    loc = table_loc
    make_table(loc, maintained=["id_idx", "v_idx"])
    regions: dict[int, str] = {}
    write_regions(loc, [500, 501, 502], 1, regions)
    rid = next(iter(regions.values()))
    merge_generation(loc, rid, 1)
    lance.dataset(loc.lance_uri).drop_index("v_idx")
    result = catchup.run_catchup(loc)
    assert [o.name for o in result.indexes] == ["id_idx"]
    assert result.missing_gating == ["v_idx"]
    assert result.not_caught_up == [("v_idx", rid)]
    # What the step outcome shows: the lag counted, named in one line, serializable.
    assert result.failures == [] and result.metrics()["not_caught_up"] == 1
    assert "behind: v_idx" in result.summary() and "maintained but missing: v_idx" in result.summary()
    assert json.loads(json.dumps(result.to_dict()))["not_caught_up"] == [["v_idx", rid]]
    with pytest.raises(table.TableError, match="no index named nope"):
        catchup.plan_catchup(loc, ["nope"])


def segments(loc, name: str) -> int:
    return lance.dataset(loc.lance_uri).index_statistics(name)["num_indices"]


def test_catchup_options_travel_with_the_plan(table_loc):
    """`num_indices_to_merge` set in the plan's options folds the new rows and the existing
    delta into one segment; without it each catch-up appends a delta; an override at execute
    time applies too."""
    loc = table_loc
    make_table(loc, maintained=["id_idx"])
    regions: dict[int, str] = {}
    write_and_merge(loc, list(range(280, 340)), 1, regions)
    catchup.run_catchup(loc)
    assert segments(loc, "v_idx") == 2  # the trained segment and one delta
    write_and_merge(loc, list(range(340, 380)), 2, regions)
    plan = catchup.plan_catchup(loc, ["v_idx"], CatchupOptions(num_indices_to_merge=2))
    assert plan.options.num_indices_to_merge == 2 and json.dumps(plan.to_dict())
    result = catchup.execute_catchup(loc, plan)
    assert segments(loc, "v_idx") == 1 and result.not_caught_up == []
    assert result.metrics()["optimized"] == 1 and result.metrics()["gap/v_idx"] == 0
    write_and_merge(loc, list(range(380, 400)), 3, regions)
    catchup.run_catchup(loc, ["v_idx"])  # default options: a delta
    assert segments(loc, "v_idx") == 2
    write_and_merge(loc, list(range(400, 420)), 4, regions)
    catchup.run_catchup(loc, ["v_idx"], num_indices_to_merge=2)
    assert segments(loc, "v_idx") == 1


def test_catchup_settings_in_memwal_yaml_reach_the_step(table_loc, tmp_path):
    """`catchup:` in memwal.yaml is read like every other section (a typo gets a did-you-mean)
    and reaches the step runner the Dagster asset and the CLI share: its plan carries the
    setting, and a catch-up with `num_indices_to_merge: 2` folds the new rows and the existing
    delta into one segment."""
    from memwal_pipeline.config import ConfigError, load_config

    from memwal_core.steps.runner import StepOptions, run_step

    loc = table_loc
    path = tmp_path / "memwal.yaml"
    path.write_text(f"tables:\n  - {{name: t, uri: {loc.lance_uri}, catchup: {{num_indices_to_merj: 2}}}}\n")
    with pytest.raises(ConfigError, match="catchup: unknown key 'num_indices_to_merj'.*num_indices_to_merge"):
        load_config(path)
    path.write_text(f"tables:\n  - {{name: t, uri: {loc.lance_uri}, catchup: {{num_indices_to_merge: 2}}}}\n")
    (cfg,) = load_config(path)
    assert cfg.catchup == CatchupOptions(num_indices_to_merge=2)
    make_table(loc, maintained=["id_idx"])
    regions: dict[int, str] = {}
    for n in (1, 2):
        write_and_merge(loc, list(range(280 + 60 * n, 340 + 60 * n)), n, regions)
        if n == 1:
            catchup.run_catchup(loc, ["v_idx"])  # Lance's default: a delta segment
            assert segments(loc, "v_idx") == 2
    planned = run_step("catchup", loc, StepOptions.of(cfg), execute=False)
    assert planned.plan.options.num_indices_to_merge == 2
    outcome = run_step("catchup", loc, StepOptions.of(cfg))
    assert not outcome.errors and segments(loc, "v_idx") == 1, outcome.summary


def test_retrain_never_touches_an_index_the_memtables_maintain(table_loc):
    """`catchup: {retrain: true}` (a setting of the table now) retrains only indexes no MemTable
    maintains: a maintained index's IVF centroids and PQ codebook stay (the spec requires them
    stable once MemWAL is enabled), and it is caught up as usual."""
    loc = table_loc
    make_table(loc, maintained=["v_idx"])
    regions: dict[int, str] = {}
    write_and_merge(loc, list(range(280, 380)), 1, regions)
    codebook = centroids(loc)
    result = catchup.run_catchup(loc, retrain=True)
    assert result.errors == {} and by_index(result)["v_idx"].caught_up
    assert centroids(loc) == codebook
