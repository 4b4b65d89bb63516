"""The merger against real pylance tables, a real local SparkSession, and real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import lance
import pyarrow as pa
import pytest
from support.helpers import plant_generation
from support.procs import reaped

from memwal_core.jobs import merge
from memwal_core.observe import reader
from memwal_core.state import region, table
from memwal_core.tools import demo

PROCS = os.path.join(os.path.dirname(__file__), "procs")


def as_dict(t: pa.Table) -> dict:
    return {r["id"]: r for r in t.to_pylist()}


def base_rows(loc) -> dict:
    return as_dict(table.open_dataset(loc).to_table())


def lsm_rows(loc) -> dict:
    return as_dict(reader.lsm_table(loc))


@pytest.mark.parametrize("seed", [1, 2])
def test_randomized_differential(table_loc, spark, seed):
    """Merges interleaved with writes: every LSM read and finally the base table equal the model."""
    demo.create_table(table_loc, sharding="bucket", num_buckets=5, base_rows=40)
    w = demo.Workload(table_loc, seed=seed, key_space=400, max_memtable_rows=40)
    progress_seen: dict[str, int] = {}
    for step in range(3):
        for _ in range(2):
            w.write_round(150, overwrite=0.3, delete=0.05, absent_delete=0.02, puts_per_batch=15)
        budget = [10_000, 10**9][step % 2]  # alternate several small commits and one big one
        result = merge.merge(table_loc, spark, budget_bytes=budget)
        assert not result.region_errors
        assert result.commits >= 1
        assert lsm_rows(table_loc) == w.expected()
        merged = table.read_memwal_state(table_loc).merged
        for rid, g in merged.items():
            assert g >= progress_seen.get(rid, 0)  # progress never regresses
        progress_seen = merged
    # Everything flushed is merged: the base table alone is the model.
    assert merge.plan_merge(table_loc).batches == []
    assert base_rows(table_loc) == w.expected()
    for rid in w.regions.values():
        latest = region.load_latest(table_loc.store, rid)
        assert merged[rid] == max(g.generation for g in latest.generations)


def test_batches_respect_budget_and_order(table_loc, spark):
    demo.create_table(table_loc, sharding="bucket", num_buckets=3)
    w = demo.Workload(table_loc, seed=7, key_space=200, max_memtable_rows=30)
    for _ in range(4):
        w.write_round(90, overwrite=0.5, puts_per_batch=10)
    plan = merge.plan_merge(table_loc, budget_bytes=6_000, max_generations=4)
    assert len(plan.batches) > 2
    seen: dict[str, int] = {}
    for b in plan.batches:
        assert len(b.generations) <= 4
        assert b.bytes <= 6_000 or len(b.generations) == 1
        for g in b.generations:  # ascending per region across and within batches
            assert g.generation > seen.get(g.region_id, 0)
            seen[g.region_id] = g.generation
    versions_before = table.open_dataset(table_loc).version
    result = merge.execute_merge(table_loc, plan, spark)
    assert result.commits == len(plan.batches)
    assert table.open_dataset(table_loc).version == versions_before + len(plan.batches)
    assert base_rows(table_loc) == w.expected()
    assert result.generations_merged == sum(len(b.generations) for b in plan.batches)
    assert result.rows_upserted > 0 and result.bytes_read > 0 and result.bytes_written > 0


def test_a_backlog_within_the_budget_is_one_batch_whatever_its_generation_count(table_loc, spark):
    """Batches are sized by bytes: 300 small generations (more than any count cap memwal had) fit
    the default budget, so they are one batch, one Spark job and one commit; a `max_generations`
    the caller sets (an older config's key) still caps the count."""
    demo.create_table(table_loc, sharding="bucket", num_buckets=2)
    w = demo.Workload(table_loc, seed=5, key_space=400, max_memtable_rows=2)
    w.write_round(600, overwrite=0.3, puts_per_batch=2)
    plan = merge.plan_merge(table_loc)
    total = sum(len(b.generations) for b in plan.batches)
    assert total > 256 and plan.max_generations is None
    assert len(plan.batches) == 1 and len(plan.batches[0].generations) == total
    capped = merge.plan_merge(table_loc, max_generations=100)
    assert [len(b.generations) for b in capped.batches] == [100] * (total // 100) + ([total % 100] if total % 100 else [])
    before = table.open_dataset(table_loc).version
    result = merge.execute_merge(table_loc, plan, spark)
    assert result.commits == 1 and result.generations_merged == total
    assert table.open_dataset(table_loc).version == before + 1
    assert base_rows(table_loc) == w.expected()
    assert table.read_memwal_state(table_loc).merged == {
        rid: max(g.generation for g in region.load_latest(table_loc.store, rid).generations) for rid in w.regions.values()}


def test_rerun_is_noop_and_skips_merged(table_loc, spark):
    demo.create_table(table_loc, sharding="unsharded", base_rows=10)
    w = demo.Workload(table_loc, seed=3, key_space=50)
    w.write_round(60)
    plan = merge.plan_merge(table_loc)
    first = merge.execute_merge(table_loc, plan, spark)
    assert first.commits == 1
    # Executing the same (now stale) plan again merges nothing twice: generations are skipped.
    version = table.open_dataset(table_loc).version
    again = merge.execute_merge(table_loc, plan, spark)
    assert again.commits == 0
    assert all(r.skipped_generations for r in again.regions.values())
    assert table.open_dataset(table_loc).version == version
    assert base_rows(table_loc) == w.expected()


def _spawn_merger(uri: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(PROCS, "merge_proc.py"), uri, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def test_two_merger_processes(table_loc, spark, tmp_path):
    demo.create_table(table_loc, sharding="bucket", num_buckets=4, base_rows=20)
    w = demo.Workload(table_loc, seed=11, key_space=300, max_memtable_rows=30)
    for _ in range(3):
        w.write_round(120, overwrite=0.4, delete=0.05, puts_per_batch=10)
    # Both mergers start merging together, once both JVMs are up (each says so in its ready file).
    ready, go = [str(tmp_path / f"ready{i}") for i in range(2)], str(tmp_path / "go")
    with reaped([_spawn_merger(table_loc.lance_uri, "--budget", "8000", "--ready", r, "--go", go)
                 for r in ready]) as procs:
        deadline = time.monotonic() + 300
        while not all(os.path.exists(r) for r in ready):
            for p, r in zip(procs, ready):
                assert p.poll() is None or os.path.exists(r), p.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the mergers' JVMs did not start"
            time.sleep(0.05)
        open(go, "w").close()
        outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["region_errors"] == {}
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert sum(r["commits"] for r in results) >= 1
    assert base_rows(table_loc) == w.expected()
    merged = table.read_memwal_state(table_loc).merged
    for rid in w.regions.values():
        assert merged[rid] == max(g.generation for g in region.load_latest(table_loc.store, rid).generations)


CRASH_POINTS = ["merge.before_commit", "merge.during_commit", "merge.after_commit"]


def test_crash_then_rerun_converges(tmp_path, spark):
    """A merger killed before, during and right after its commit; each rerun converges.

    The three crashing processes run at once (one JVM start of wall time instead of three).
    """
    from memwal_core.state.store import open_store

    cases = []
    for i, point in enumerate(CRASH_POINTS):
        loc = open_store(str(tmp_path / f"t{i}"))
        demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=30)
        w = demo.Workload(loc, seed=5 + i, key_space=200, max_memtable_rows=40)
        for _ in range(2):
            w.write_round(100, overwrite=0.4, delete=0.05, puts_per_batch=10)
        cases.append((point, loc, w, _spawn_merger(loc.lance_uri, env={"MEMWAL_CRASH_AT": point})))
    for point, loc, w, p in cases:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 137, f"{point}: {err[-3000:]}"
        merged = table.read_memwal_state(loc).merged
        if point == "merge.after_commit":
            assert merged, point  # the commit landed before the crash
        else:
            assert merged == {}, point  # nothing committed, not even half
        assert lsm_rows(loc) == w.expected(), point  # the table is correct right after the crash
        result = merge.merge(loc, spark)
        assert not result.region_errors
        assert base_rows(loc) == w.expected(), point
        assert merge.plan_merge(loc).batches == []


def test_misrouted_rows_are_refused_and_others_proceed(table_loc, spark):
    demo.create_table(table_loc, sharding="bucket", num_buckets=4)
    w = demo.Workload(table_loc, seed=21, key_space=200)
    w.write_round(120)
    victim, other_value = sorted(w.regions.items())[0][1], sorted(w.regions)[1]
    # pylance does not check routing: write keys of another bucket into the victim region.
    stray = [k for k in range(1000, 2000) if w.region_value([k])[0] == other_value][:7]
    with w.dataset().mem_wal_writer(victim) as writer:
        writer.put(demo.rows_table([demo.row(k, 99) for k in stray]))
    bad_gen = max(g.generation for g in region.load_latest(table_loc.store, victim).generations)
    result = merge.merge(table_loc, spark)
    r = result.regions[victim]
    assert r.offending_keys == 7
    assert f"generation {bad_gen}" in r.error and "route to another region" in r.error
    assert bad_gen not in r.generations_merged
    assert r.merged_generation == bad_gen - 1  # everything before the bad generation is merged
    others = [rid for rid in w.regions.values() if rid != victim]
    assert all(result.regions[rid].error is None and result.regions[rid].generations_merged for rid in others)
    assert table.read_memwal_state(table_loc).merged[victim] == bad_gen - 1
    assert all(k not in base_rows(table_loc) for k in stray)


def test_a_new_region_may_not_take_the_value_of_a_merged_region_before_any_snapshot(table_loc, spark):
    """Region exclusivity before the first MemWAL snapshot records any value. Regions A0/A1 are
    merged and have nothing pending; writers that lost their region ids then start new regions
    B0/B1 for the same bucket values. A's values are known from A's merged generations (GC
    keeps them until a snapshot records the values), so B is refused, not merged next to A:
    two regions writing one value would make the order of their writes undefined. Found by a
    benchmark script that restarted its writers."""
    demo.create_table(table_loc, sharding="bucket", num_buckets=2, base_rows=50)
    a = demo.Workload(table_loc, seed=1, key_space=500, max_memtable_rows=50)
    a.write_round(40, overwrite=0.0, delete=0.0, puts_per_batch=10)
    assert not merge.merge(table_loc, spark).region_errors
    model = a.expected()
    b = demo.Workload(table_loc, seed=2, key_space=500, max_memtable_rows=50)
    b.write_round(40, overwrite=0.0, delete=0.0, puts_per_batch=10)
    assert not set(b.regions.values()) & set(a.regions.values())
    version = table.open_dataset(table_loc).version
    r = merge.merge(table_loc, spark)
    assert set(r.region_errors) == set(b.regions.values()), r.region_errors
    for rid, err in r.region_errors.items():
        value = next(v for v, x in b.regions.items() if x == rid)
        assert f"which region {a.regions[value]} owns" in err, err
    assert table.open_dataset(table_loc).version == version
    assert set(table.read_memwal_state(table_loc).merged) == set(a.regions.values())
    assert base_rows(table_loc) == model


def test_keys_shared_by_regions_refuse_those_regions_only(table_loc, spark):
    """Without a sharding spec nothing routes rows, so two writers can put the same key into two
    regions; which row is newest is then unknowable. Those two regions are refused, a third
    region with its own keys is merged."""
    import uuid

    demo.create_table(table_loc, sharding="manual", base_rows=5)
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    ds = lance.dataset(table_loc.lance_uri)
    for rid, keys in ((a, [100, 101, 102]), (b, [102, 103]), (c, [200, 201])):
        with ds.mem_wal_writer(rid, max_memtable_rows=100) as w:
            w.put(demo.rows_table([demo.row(k, 1) for k in keys]))
    result = merge.merge(table_loc, spark)
    for rid, other in ((a, b), (b, a)):
        r = result.regions[rid]
        assert "1 primary keys also appear in another region" in r.error and other in r.error, r.error
        assert r.generations_merged == [] and r.offending_keys == 1
    assert result.regions[c].error is None and result.regions[c].generations_merged == [1]
    assert table.read_memwal_state(table_loc).merged == {c: 1}
    assert set(base_rows(table_loc)) == {0, 1, 2, 3, 4, 200, 201}


def test_schema_mismatch_generation_is_refused(table_loc, spark):
    demo.create_table(table_loc, sharding="unsharded")
    w = demo.Workload(table_loc, seed=4, key_space=100)
    w.write_round(40)
    rid = next(iter(w.regions.values()))
    wrong = pa.table({"id": pa.array([5000], pa.int64()), "n": pa.array([1], pa.int64()),
                      "other": pa.array(["x"]), "_tombstone": pa.array([False])})
    gen = plant_generation(table_loc, rid, wrong)
    result = merge.merge(table_loc, spark)
    err = result.regions[rid].error
    assert f"generation {gen}" in err and "columns differ" in err and "other" in err
    assert table.read_memwal_state(table_loc).merged[rid] == gen - 1
    assert 5000 not in base_rows(table_loc)


def test_table_without_primary_key_is_a_clear_error(tmp_path, spark):
    from memwal_core.state.store import open_store

    loc = open_store(str(tmp_path / "nopk"))
    ds = lance.write_dataset(pa.table({"id": pa.array([1], pa.int64())}), loc.lance_uri)
    ds.initialize_mem_wal(unsharded=True)
    with pytest.raises(table.NoPrimaryKey, match="no primary key"):
        merge.merge(loc, spark)


def test_delete_predicate_literals():
    keys = pa.table({"k": pa.array(["a", "it's"])})
    assert merge.delete_predicate(keys, ["k"]) == "k IN ('a', 'it''s')"
    both = pa.table({"a": pa.array([1, 2], pa.int64()), "b": pa.array([True, False])})
    assert merge.delete_predicate(both, ["a", "b"]) == "(a = 1 AND b = true) OR (a = 2 AND b = false)"
    # Any column name is quoted rather than refused (a table with such a key merges: tests/wall/test_wall_refusals.py).
    assert merge.delete_predicate(keys.rename_columns(["bad `col"]), ["bad `col"]) == "`bad ``col` IN ('a', 'it''s')"
