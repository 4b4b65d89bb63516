"""Everything at once on one table: a pylance writer flushing continuously, two merger
processes, the MemWAL index builder (+ base-index catch-up) and GC, each looping.

Checked while they run (this process samples the table): merge progress and index catch-up
never decrease, neither in the latest state sampled over time nor from one table version to
the next (every version is read as soon as it appears, before GC's base-table cleanup may
remove it; the versions still retained at the end are read again). Checked at the end: no
process failed, a last merge makes the base table equal the writer's model (reported by the
writer process), the LSM read equals it too, and no listed generation is missing.

In the suite the writer runs 15 s (then the loops go on until each has done a full pass
over the writer's last flushes); `make soak` runs it for MEMWAL_SOAK_SECONDS (default 60).
"""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pytest
from support.procs import PROCS, spawn
from support.progress_monitor import ProgressMonitor

from memwal_core.jobs import catchup, gc, merge, snapshot
from memwal_core.observe import checks, reader
from memwal_core.state import table
from memwal_core.state.store import open_store
from memwal_core.tools import demo

SOAK = bool(os.environ.get("MEMWAL_SOAK"))
soak = pytest.mark.skipif(not SOAK, reason="soak variant: run with MEMWAL_SOAK=1 (make soak)")
LOOPS = ["merge", "merge", "index", "gc"]


def as_dict(t: pa.Table) -> dict:
    return {r["id"]: r for r in t.to_pylist()}


def _run(tmp_path, spark, seconds: float) -> None:
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=50, btree_index=True,
                      maintained_indexes=["id_btree"])
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    go, stop = str(ctl / "go"), str(ctl / "stop")
    writer_out = str(ctl / "writer.json")
    writer = spawn([os.path.join(PROCS, "reliability_writer.py"), loc.lance_uri, "7", go, writer_out],
                    str(ctl / "writer.log"))
    loops = []
    for i, job in enumerate(LOOPS):
        ready, out = str(ctl / f"ready{i}"), str(ctl / f"{job}{i}.json")
        p = spawn([os.path.join(PROCS, "reliability_loop.py"), job, loc.lance_uri, ready, go, stop, out],
                   str(ctl / f"{job}{i}.log"))
        loops.append((job, p, ready, out, str(ctl / f"{job}{i}.log")))
    t_start = time.time()
    try:
        deadline = time.time() + 240
        while not all(os.path.exists(r) for _, _, r, _, _ in loops):
            for job, p, _, _, log in loops:
                assert p.poll() is None, f"{job} died while starting: {open(log).read()[-3000:]}"
            assert time.time() < deadline, "loops did not get ready"
            time.sleep(0.2)
        ready_s = time.time() - t_start
        with open(go + ".tmp", "w") as f:
            f.write(str(time.time() + seconds))
        os.replace(go + ".tmp", go)
        t0 = time.time()
        monitor = ProgressMonitor(loc)
        while writer.poll() is None:
            monitor.sample()
            time.sleep(0.2)
        assert writer.returncode == 0, open(str(ctl / "writer.log")).read()[-3000:]
        written_s = time.time() - t0
        # Keep everything running until each merger has done a whole pass that started after
        # the writer's last flush, and the index builder and GC a whole pass after those.
        def after(i: int, t: float) -> bool:
            try:
                return float(open(loops[i][3] + ".pass").read().split()[1]) >= t
            except (OSError, IndexError, ValueError):
                return False

        t_end = time.time()
        while not all(after(i, t_end) for i, (job, *_) in enumerate(loops) if job == "merge"):
            assert all(p.poll() is None for _, p, *_ in loops), "a loop died"
            monitor.sample()
            time.sleep(0.2)
        t_merged = time.time() + 2.5  # GC's base cleanup keeps versions younger than 2 s
        while not all(after(i, t_merged) for i, (job, *_) in enumerate(loops) if job != "merge"):
            assert all(p.poll() is None for _, p, *_ in loops), "a loop died"
            monitor.sample()
            time.sleep(0.2)
        open(stop, "w").close()
        for job, p, _, _, log in loops:
            while p.poll() is None:
                monitor.sample()
                time.sleep(0.2)
            assert p.returncode == 0, f"{job}: {open(log).read()[-3000:]}"
        elapsed = time.time() - t0
        stopped_s = elapsed - written_s
    finally:
        open(stop, "w").close()
        for _, p, _, _, _ in loops + [("writer", writer, None, None, None)]:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.load(open(out)) for _, _, _, out, _ in loops]
    written = json.load(open(writer_out))
    model = {int(k): v for k, v in written["model"].items()}
    monitor.sample()
    monitor.final_check()

    # Last merge, catch-up and GC in this process; then the differential checks.
    t_final = time.time()
    assert not merge.merge(loc, spark).region_errors
    catchup.run_catchup(loc)
    final_gc = gc.run_gc(loc, gc.GcOptions(manifest_retention=3, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                                          cleanup_base_versions_older_than_seconds=0,
                                          cleanup_base_versions_floor_seconds=0))
    base = as_dict(table.open_dataset(loc).to_table())
    lsm = as_dict(reader.lsm_table(loc))
    missing = checks.missing_generations(loc)

    print(f"\n[concurrency] {elapsed:.0f} s: writer {written['batches']} batches, {written['reopens']} "
          f"writer re-opens, {len(model)} live keys, regions {len(written['regions'])}")
    for r in results:
        print(f"   {r['job']}: {r['passes']} passes, {r['stats']}, errors {len(r['errors'])}"
              + (f", kept in its last pass {r['last_kept']}" if "last_kept" in r else ""))
        for e in r["errors"][:5]:
            print(f"      {e}")
    print(f"   monitor: {monitor.samples} samples, {len(monitor.by_version)} table versions read "
          f"(latest {monitor.next_version - 1}; {len(monitor.missed)} cleaned up before read: "
          f"{monitor.missed[:10]}), {len(monitor.problems)} problems")
    print(f"   final: merged {table.read_memwal_state(loc).merged}, final GC deleted {final_gc.counts()} "
          f"kept {final_gc.kept}, region errors {final_gc.region_errors}, missing generations {missing}")
    print(f"   timings: JVMs ready after {ready_s:.0f} s, writer {written_s:.0f} s, loops stopped "
          f"{stopped_s:.0f} s later, final merge/catch-up/GC/checks {time.time() - t_final:.0f} s")

    assert not monitor.problems, monitor.problems[:10]
    assert all(not r["errors"] for r in results), [(r["job"], r["errors"][:5]) for r in results]
    merges = [r for r in results if r["job"] == "merge"]
    assert sum(r["stats"].get("commits", 0) for r in merges) > 0
    assert missing == {}
    assert not final_gc.region_errors
    assert base == model
    assert lsm == model
    # GC did collect while everything else ran (or the test would prove little).
    gcs = [r for r in results if r["job"] == "gc"][0]
    assert gcs["stats"].get("deleted_generation", 0) > 0


def test_everything_at_once(tmp_path, spark):
    _run(tmp_path, spark, 15)


@soak
@pytest.mark.slow
def test_everything_at_once_soak(tmp_path, spark):
    _run(tmp_path, spark, float(os.environ.get("MEMWAL_SOAK_SECONDS", 60)))


def test_generation_collected_under_a_stale_plan_is_skipped_not_an_error(tmp_path, spark):
    """Found by the soak run: merger A plans generation g; merger B merges g and GC collects its
    directory; A's read of g then fails. A must skip g as already merged, not report the region
    as broken ("generation g: Dataset ... was not found")."""

    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    w = demo.Workload(loc, seed=31, key_space=200, max_memtable_rows=30)
    w.write_round(80, overwrite=0.3, delete=0.05, puts_per_batch=10)
    stale = merge.plan_merge(loc)  # merger A's plan
    assert not merge.execute_merge(loc, merge.plan_merge(loc), spark).region_errors  # merger B
    snapshot.build_snapshot(loc)  # the index builder records region values: GC may trim merged generations
    res = gc.run_gc(loc, gc.GcOptions(manifest_min_age_seconds=0, orphan_grace_seconds=0, cleanup_base_versions_older_than_seconds=0,
                                      cleanup_base_versions_floor_seconds=0))
    assert res.counts()["generation"] == sum(len(b.generations) for b in stale.batches)
    result = merge.execute_merge(loc, stale, spark)  # merger A goes on with its plan
    assert result.region_errors == {}
    assert result.commits == 0
    assert sorted(g for r in result.regions.values() for g in r.skipped_generations) == \
        sorted(g.generation for b in stale.batches for g in b.generations)
    assert as_dict(table.open_dataset(loc).to_table()) == w.expected()
