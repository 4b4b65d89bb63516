"""The merger's Spark data path pieces, against a real local SparkSession."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from memwal_core.errors import MemwalError
from memwal_core.spark import results
from memwal_core.spark import tasks as sp


def test_pack_regions_keeps_regions_whole_and_balances_bytes():
    # (region index, generation, uri, bytes): region 0 is as heavy as 1 + 2 + 3 together.
    gens = [(0, g, f"r0/{g}", 300) for g in (3, 1, 2)]
    gens += [(r, g, f"r{r}/{g}", 100) for r in (1, 2, 3) for g in (1, 2, 3)]
    groups = sp.pack_regions(gens, 2)
    assert len(groups) == 2
    regions = [r for group in groups for r, _ in group]
    assert sorted(regions) == [0, 1, 2, 3]  # every region exactly once, never split
    loads = sorted(sum(300 if r == 0 else 100 for r, gs in group for _ in gs) for group in groups)
    assert loads == [900, 900]
    for group in groups:
        for r, gs in group:
            assert [g for g, _ in gs] == [1, 2, 3] and all(u == f"r{r}/{g}" for g, u in gs)
    assert len(sp.pack_regions(gens, 64)) == 4  # never more tasks than regions
    assert sp.pack_regions([], 4) == ()


def _gen(ids: list[int], vals: list[str], dead=None) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "v": vals,
                     sp.TOMBSTONE: pa.array(dead or [False] * len(ids))})


def test_newest_rows_later_generation_then_later_position_wins():
    gens = [_gen([1, 2, 3], ["g1", "g1", "g1"]),
            _gen([1, 1, 3], ["g2-a", "g2-b", "g2"], dead=[False, False, True]),
            _gen([], []),
            _gen([2], ["g4"])]
    got = {r["id"]: (r["v"], r[sp.TOMBSTONE]) for r in sp.newest_rows(gens, ["id"]).to_pylist()}
    assert got == {1: ("g2-b", False), 2: ("g4", False), 3: ("g2", True)}


def _stats(gen: int, routes=(), error=None, permanent=True) -> sp.GenerationStats:
    return sp.GenerationStats(0, gen, 1, 1, tuple((sp.value_key(v), c) for v, c in routes), error, permanent)


def test_generation_stats_cross_from_task_to_driver_unchanged():
    """The one encoding (task) and decoding (driver) of a stats row give back the same stats."""
    for s in (_stats(3, [([5], 10), (["a", None], 2)]), _stats(4, error="columns differ: extra ['x']"),
              _stats(5, error="unreadable after 3 tries: OSError: gone", permanent=False), _stats(6)):
        assert sp.GenerationStats.from_row(s.region, s.generation, s.rows, s.bytes, s.info) == s


def test_first_refused_reports_the_first_bad_generation_and_all_stray_rows():
    ok = [_stats(1, [([5], 10)]), _stats(2, [([5], 4)])]
    assert sp.first_refused(ok, None) is None
    # Stray rows in generations 3 and 4: refused from 3, both counted; the own value is the
    # first (unanimous) generation's, 5.
    rows = ok + [_stats(4, [([5], 1), ([6], 2)]), _stats(3, [([5], 9), ([7], 3)])]
    r = sp.first_refused(rows, None)
    assert (r.generation, r.offending_rows) == (3, 5) and "5 rows route to another region" in r.reason
    # The values the stray rows route to, most rows first: what a person checks the writer against.
    assert "(region value [5]; they route to [7] (3 rows), [6] (2 rows))" in r.reason
    assert r.permanent and r.region_id == "" and r.reason.startswith("generation 3: ")
    named = sp.first_refused(rows, None, "r1")  # the driver names the region: one failure type from here on
    assert (named.region_id, named.generation, named.offending_rows) == ("r1", 3, 5)
    assert named.reason == f"region r1: {r.reason}" and named.describe().startswith("region r1 at generation 3")
    # A known own value wins: a generation whose rows all route elsewhere is refused.
    r = sp.first_refused(ok, sp.value_key([6]))
    assert (r.generation, r.offending_rows) == (1, 14)
    # An unreadable generation is refused with its error, stray rows after it still counted.
    r = sp.first_refused(ok + [_stats(3, error="ValueError: columns differ"), _stats(4, [([6], 2)])], None)
    assert r.generation == 3 and "columns differ" in r.reason and r.offending_rows == 2


def test_first_refused_never_takes_a_majority_vote_for_an_unknown_region_value():
    # No known value and the first routed generation is split 9:3: no majority is trusted.
    r = sp.first_refused([_stats(1, [([5], 9), ([7], 3)]), _stats(2, [([5], 4)])], None)
    assert r.generation == 1 and r.offending_rows == 3 and "not established" in r.reason


def test_first_refused_keeps_transient_read_failures_apart():
    r = sp.first_refused([_stats(1, [([5], 2)]), _stats(2, error="unreadable after 3 tries", permanent=False)],
                         None)
    assert r.generation == 2 and not r.permanent


def test_shared_keys_names_the_regions_and_counts():
    assert sp.shared_keys([(0, pa.table({"id": [1, 2]})), (1, pa.table({"id": [3]}))], ["id"]) == ({}, 0)
    got = sp.shared_keys([(0, pa.table({"id": [1, 2]})), (1, pa.table({"id": [2, 3]})),
                          (2, pa.table({"id": [4]})), (1, pa.table({"id": [1]}))], ["id"])
    assert got == ({0: 2, 1: 2}, 2)
    two = [(0, pa.table({"a": [1, 1], "b": ["x", "y"]})), (3, pa.table({"a": [1], "b": ["y"]}))]
    assert sp.shared_keys(two, ["a", "b"]) == ({0: 1, 3: 1}, 1)
    assert sp.shared_keys([], ["id"]) == ({}, 0)


def test_merge_job_returns_the_writers_newest_rows(table_loc, spark, monkeypatch):
    """The Spark job alone (no commit): one stats row per generation, and the newest live rows
    and tombstoned keys of every region equal what the pylance writers left."""
    from memwal_core.jobs import merge
    from memwal_core.state import layout, region, table
    from memwal_core.tools import demo

    demo.create_table(table_loc, sharding="bucket", num_buckets=3, base_rows=20)
    w = demo.Workload(table_loc, seed=5, key_space=300, max_memtable_rows=40)
    for _ in range(3):
        w.write_round(150, overwrite=0.3, delete=0.05)
    plan = merge.plan_merge(table_loc)
    (batch,) = plan.batches
    ds = table.open_dataset(table_loc)
    state = table.read_memwal_state(table_loc, ds.version)
    specs = {s.spec_id: s for s in state.details.region_specs}
    rids = sorted({g.region_id for g in batch.generations})
    index = {r: i for i, r in enumerate(rids)}
    manifests = region.load_many(table_loc.store, rids).manifests
    cfg = sp.ReadConfig(pk=("id",), columns=tuple(f.name for f in ds.schema), storage_options=(),
                        routing=tuple((index[r], merge.routing_check(manifests[r], specs, ds.lance_schema))
                                      for r in rids))
    gens = [(index[g.region_id], g.generation,
             table_loc.child_uri(layout.generation_dir(g.region_id, g.path, g.generation)), g.bytes)
            for g in batch.generations]
    assert len(gens) >= 6 and len(rids) == 3

    read = results.read
    files: list[str] = []

    def spy(directory, name):  # which result files the driver read, and from where
        files.append(os.path.join(directory, name))
        return read(directory, name)

    monkeypatch.setattr(results, "read", spy)
    # Rows through files (the local master's default) and through Spark (`off`, as on a cluster):
    # one task for all regions, uneven groups, one task per region.
    for setting, tasks in [(s, t) for s in ("auto", "off") for t in (1, 2, 8)]:
        spark.conf.set(results.RESULT_FILES_KEY, setting)
        files.clear()
        try:
            out = sp.read_and_dedup(spark, gens, cfg, tasks)
        finally:
            spark.conf.unset(results.RESULT_FILES_KEY)
        if setting == "auto":  # one file per region and kind, in the job's directory, removed after it
            assert len(files) == len(out.live) + len(out.deleted) >= len(rids)
            assert len({os.path.dirname(f) for f in files}) == 1
            assert not os.path.exists(os.path.dirname(files[0]))
        else:
            assert files == []
        assert sorted((s.region, s.generation) for s in out.stats) == sorted((r, g) for r, g, _, _ in gens)
        assert all(s.error is None and s.rows > 0 and s.routes for s in out.stats)
        assert out.shared == {} and out.shared_keys == 0
        live = sorted(pa.concat_tables(out.live).to_pylist(), key=lambda r: r["id"])
        deleted = {r["id"] for r in pa.concat_tables(out.deleted).to_pylist()}
        model = w.expected()
        # Every key written since the base table: newest value, or deleted.
        assert live and all(model[r["id"]] == r for r in live)
        assert deleted and not (deleted & set(model))
        assert len({r["id"] for r in live}) == len(live)


def test_result_files_are_read_by_name_only(tmp_path):
    t = pa.table({"id": pa.array([3, 1, 2], pa.int64()), "v": ["c", "a", "b"]})
    name = results.write(str(tmp_path), t, max_chunksize=2)
    assert results.read(str(tmp_path), name).equals(t)
    (tmp_path / "x.arrow").write_bytes(b"")
    for bad in ("../" + name, "/etc/passwd", "x.arrow", name + "/..", ""):
        with pytest.raises(ValueError, match="no merge task writes"):
            results.read(str(tmp_path), bad)


def test_result_rows_outlive_their_directory_and_the_ledger_keeps_keys_of_its_own(tmp_path):
    """The driver maps a task's result file and removes the job's directory while the batch is
    committed: the rows stay readable. The cross-batch key ledger copies the keys, so a run of
    many batches does not keep every batch's rows (their mapped files) alive through a slice."""
    from memwal_core.jobs.merge.exclusivity import KeyLedger

    t = pa.table({"id": pa.array(range(50_000), pa.int64()), "s": [f"row {i}" for i in range(50_000)]})
    d = tmp_path / "job"
    d.mkdir()
    got = results.read(str(d), results.write(str(d), t, max_chunksize=4096))
    shutil.rmtree(d)
    assert got.equals(t)
    ledger = KeyLedger(("id",))
    ledger.remember(sp.Deduped([], [got], [], [0], []), {0: "r"})
    ((rid, keys),) = ledger.seen
    assert rid == "r" and keys.equals(t.select(["id"]))
    mapped = {(b.address, b.address + b.size) for c in got.columns for ch in c.chunks for b in ch.buffers() if b}
    kept = [b.address for ch in keys.column("id").chunks for b in ch.buffers() if b]
    assert kept and not any(lo <= a < hi for a in kept for lo, hi in mapped)


def test_a_dead_drivers_result_directory_is_swept_once_idle(tmp_path):
    """What a driver that died during a job left is removed by a later merge on the machine:
    only when its process is gone and the directory has been idle an hour."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid now names no process (unless reused at once: then it is left, as alive)
    old = time.time() - results.SWEEP_AFTER_S - 60

    def made(name: str, age: float | None = old) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "0123456789abcdef0123456789abcdef.arrow").write_bytes(b"rows")
        if age is not None:
            os.utime(d, (age, age))
        return str(d)

    dead_old = made(f"{results.PREFIX}{gone.pid}-abc")
    dead_young = made(f"{results.PREFIX}{gone.pid}-def", age=None)
    mine = made(f"{results.PREFIX}{os.getpid()}-ghi")
    other = made("memwal-merge-notapid-x")
    assert results.sweep(str(tmp_path)) == [dead_old]
    assert not os.path.exists(dead_old)
    assert all(os.path.isdir(d) for d in (dead_young, mine, other))


def test_result_files_setting_is_checked(spark):
    spark.conf.set(results.RESULT_FILES_KEY, "yes")
    try:
        with pytest.raises(ValueError, match="expected 'auto' or 'off'"):
            with results.job_directory(spark):
                pass
    finally:
        spark.conf.unset(results.RESULT_FILES_KEY)
    with results.job_directory(spark) as d:  # the suite's session: local[*]
        assert d is not None and os.path.isdir(d) and os.path.basename(d).startswith(f"{results.PREFIX}{os.getpid()}-")
    assert not os.path.exists(d)


def test_a_running_jobs_directory_is_never_swept(tmp_path):
    """The job's lock protects its directory where its process cannot be seen (another PID
    namespace sharing the temporary directory): a gone pid and an hour idle are not enough."""
    import fcntl

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    d = tmp_path / f"{results.PREFIX}{gone.pid}-live"
    d.mkdir()
    old = time.time() - results.SWEEP_AFTER_S - 60
    os.utime(d, (old, old))
    fd = os.open(d, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # what `job_directory` holds while its job runs
        assert results.sweep(str(tmp_path)) == [] and d.is_dir()
    finally:
        os.close(fd)
    assert results.sweep(str(tmp_path)) == [str(d)] and not d.exists()


def _read_stats(region: int, t: pa.Table, generation: int = 1) -> sp.GenerationStats:
    return sp.GenerationStats(region, generation, t.num_rows, t.nbytes)


def test_rows_go_through_spark_when_their_file_cannot_be_written(tmp_path):
    """A full or missing temporary directory costs the faster path, not the merge: the task
    returns that region's rows as blobs, and the driver takes each row as it came."""
    gen = _gen([1, 2, 3], ["a", "b", "c"], dead=[False, True, False])
    cfg = sp.ReadConfig(pk=("id",), columns=("id", "v"), storage_options=(), routing=(),
                        result_dir=str(tmp_path / "missing"))
    out = sp._merge_region(cfg, 0, [(gen, _read_stats(0, gen))], None)
    kinds, info = out.column("kind").to_pylist(), out.column("info").to_pylist()
    assert kinds == ["stats", "live", "del"] and info[1:] == ["", ""]
    got = sp._collect(pa.Table.from_batches([out]), str(tmp_path), ["id"])
    assert got.live[0].to_pylist() == [{"id": 1, "v": "a"}, {"id": 3, "v": "c"}]
    assert got.deleted[0].to_pylist() == [{"id": 2}]

    ok = dataclasses.replace(cfg, result_dir=str(tmp_path))
    out = sp._merge_region(ok, 0, [(gen, _read_stats(0, gen))], None)
    assert [n for n in out.column("info").to_pylist()[1:] if n.endswith(".arrow")] and not any(
        out.column("blob").to_pylist()[1:])
    files = sp._collect(pa.Table.from_batches([out]), str(tmp_path), ["id"])
    assert files.live[0].equals(got.live[0]) and files.deleted[0].equals(got.deleted[0])


def test_a_task_output_with_fewer_rows_than_it_says_is_refused(tmp_path):
    t = pa.table({"id": pa.array([1, 2], pa.int64())})
    row = sp._output_batch(0, [("del", -1, sp.to_blob(t), 3, t.nbytes, "")])
    with pytest.raises(MemwalError, match="2 del rows arrived, the task wrote 3"):
        sp._collect(pa.Table.from_batches([row]), None, ["id"])


def test_a_job_that_fails_half_way_leaves_no_result_files(spark):
    """A task wrote its files, then the job failed (a later task, the driver's read): the
    directory goes with the failure, and the next job starts in a new one."""
    with pytest.raises(RuntimeError, match="half-way"):
        with results.job_directory(spark) as d:
            results.write(d, pa.table({"id": pa.array([1], pa.int64())}), max_chunksize=10)
            raise RuntimeError("the job failed half-way")
    assert not os.path.exists(d)
    with results.job_directory(spark) as again:
        assert again != d and os.listdir(again) == []
