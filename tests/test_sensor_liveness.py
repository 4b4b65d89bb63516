"""Liveness of the manifest sensor: nothing flushed waits forever.

Real pylance tables (`ShardWriter` via `demo.Workload`), real GC, real Dagster instances and
`build_sensor_context`; runs the sensor would have launched are created on the instance with
the request's tags and then cancelled, failed or started, as the daemon would see them.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from dagster import DagsterRunStatus, build_sensor_context
from support.helpers import tree
from support.sensor_ticks import run_requests, tick
from support.tables import cfg_for, make_table

from memwal_core.jobs import catchup, gc, snapshot
from memwal_core.options import GcOptions, SensorOptions
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, region, table
from memwal_core.state.store import open_store
from memwal_core.tools import demo
from memwal_pipeline import liveness
from memwal_pipeline.definitions import build_definitions, table_definitions
from memwal_pipeline.sensors import VERIFY_EVERY, SensorError, evaluate_tick

INTERVAL = 30  # the shipped sensor interval (cfg_for keeps it)


def merge_requests(data) -> list:
    return [r for r in run_requests(data) if r.job_name.endswith("_merge")]


def requested_regions(req, order: list[str]) -> list[str]:
    if req.partition_key:
        return [req.partition_key]
    lo, hi = req.tags["dagster/asset_partition_range_start"], req.tags["dagster/asset_partition_range_end"]
    return order[order.index(lo):order.index(hi) + 1]


def state_of(instance, cursor: str, name: str = "t") -> liveness.SensorState:
    return liveness.SensorState.load(instance, name, json.loads(cursor)["epoch"])


def launch(instance, defs, req, status=DagsterRunStatus.NOT_STARTED):
    """The run the daemon creates for `req` (NOT_STARTED stands for QUEUED: a QUEUED run needs a
    code-location origin; the sensor treats both alike)."""
    return instance.create_run_for_job(defs.resolve_job_def(req.job_name), tags=req.tags, status=status)


@pytest.fixture
def instance():
    from dagster import DagsterInstance

    with DagsterInstance.ephemeral() as inst:
        yield inst


def setup(table_loc, regions=2, **cfg_kw):
    w = make_table(table_loc, regions=regions, rounds=1)
    cfg = cfg_for(table_loc, **cfg_kw)
    return w, cfg, table_definitions(cfg), build_definitions([cfg])


# ------------------------------------------- after GC collected the cursor's versions
def collect_cursor_versions(w, table_loc, cfg, rid: str, cursor_version: int) -> int:
    """Writers go on, then GC (keeping 2 manifest versions) collects the cursor's next one."""
    for _ in range(3):
        w.write_round(90, overwrite=0.3, delete=0.05, puts_per_batch=10)
    gc.run_gc(table_loc, cfg.gc)
    assert not table_loc.store.exists(layout.manifest_key(rid, cursor_version + 1))
    latest = region.load_latest(table_loc.store, rid).version
    assert latest > cursor_version + 2
    # What the sensor used to do: probe cursor + 1, find nothing, call the region unchanged.
    assert region.probe_latest_version(table_loc.store, rid, cursor_version, start_exists=True) == cursor_version
    return latest


def test_sensor_after_downtime_finds_regions_whose_cursor_versions_gc_collected(table_loc, instance):
    w, cfg, td, defs = setup(table_loc, gc=GcOptions(manifest_retention=2, manifest_min_age_seconds=0, orphan_grace_seconds=0, cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0))
    t0 = time.time()
    _, cursor = tick(defs, td, instance, now=t0)
    before = state_of(instance, cursor)
    rids = sorted(before.regions)
    collect_cursor_versions(w, table_loc, cfg, rids[0], before.get(rids[0]).version)
    latest = {rid: region.load_latest(table_loc.store, rid).version for rid in rids}
    # The daemon was down for longer than 3 intervals: one tick re-checks every region.
    data, cursor = tick(defs, td, instance, cursor, now=t0 + 10 * INTERVAL)
    after = state_of(instance, cursor)
    assert {rid: after.get(rid).version for rid in rids} == latest
    tops = {rid: region.load_latest(table_loc.store, rid).top_generation for rid in rids}
    assert {rid: after.get(rid).top for rid in rids} == tops
    (req,) = merge_requests(data)
    order = instance.get_dynamic_partitions(td.partitions.name)
    assert sorted(requested_regions(req, order)) == rids
    assert all(f"{rid}:{tops[rid]}@" in req.run_key for rid in rids)
    # The cursor stays small whatever the number of regions: the versions live in the KV store.
    assert len(cursor) < 200


def test_sensor_without_downtime_converges_within_a_verify_rotation(table_loc, instance):
    """GC configured with no minimum age can collect the cursor's next version between two
    ticks (a burst of commits): the rotating hint re-check finds it within VERIFY_EVERY ticks."""
    w, cfg, td, defs = setup(table_loc, regions=1, gc=GcOptions(manifest_retention=2, manifest_min_age_seconds=0, orphan_grace_seconds=0, cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0))
    t = time.time()
    _, cursor = tick(defs, td, instance, now=t)
    st = state_of(instance, cursor)
    (rid,) = st.regions
    latest = collect_cursor_versions(w, table_loc, cfg, rid, st.get(rid).version)
    seen = []
    for i in range(1, VERIFY_EVERY + 1):
        _, cursor = tick(defs, td, instance, cursor, now=t + i)  # ticks a second apart: no downtime
        seen.append(state_of(instance, cursor).get(rid).version)
        if seen[-1] == latest:
            break
    assert seen[-1] == latest, seen


def test_damaged_state_rows_cost_a_recheck_not_the_sensor(table_loc, instance):
    w, cfg, td, defs = setup(table_loc, regions=2)
    t = time.time()
    _, cursor = tick(defs, td, instance, now=t)
    st = state_of(instance, cursor)
    keys = {st._key(liveness.shard_of(rid)) for rid in st.regions} | {st._key("tick")}
    instance.run_storage.set_cursor_values({k: "{not json" for k in keys})
    data, cursor = tick(defs, td, instance, cursor, now=t + 1)
    after = state_of(instance, cursor)
    assert {rid: s.version for rid, s in after.regions.items()} == {rid: s.version for rid, s in st.regions.items()}
    assert after.last_tick == pytest.approx(t + 1, abs=0.01)


# ------------------------------------- runs that did not complete are requested again
def test_cancelled_and_failed_merge_runs_are_requested_again_until_the_cap(table_loc, instance):
    w, cfg, td, defs = setup(table_loc, regions=2, sensor=SensorOptions(merge_attempts=3))
    t = time.time()
    data, cursor = tick(defs, td, instance, now=t)
    (req1,) = merge_requests(data)
    order = instance.get_dynamic_partitions(td.partitions.name)
    rids = sorted(order)
    assert "#1/" in req1.run_key
    # Queued: nothing more is requested, however long it waits.
    run1 = launch(instance, defs, req1)
    data, cursor = tick(defs, td, instance, cursor, now=t + 100)
    assert merge_requests(data) == []
    # Cancelled while queued: requested again on the next tick past the backoff (attempt 2).
    instance.report_run_canceled(run1)
    data, cursor = tick(defs, td, instance, cursor, now=t + 101)
    (req2,) = merge_requests(data)
    assert sorted(requested_regions(req2, order)) == rids and "#2/" in req2.run_key
    assert req2.run_key != req1.run_key and req2.tags["memwal/attempt"] == "2"
    # Started: a running run covers its regions too.
    run2 = launch(instance, defs, req2, status=DagsterRunStatus.STARTED)
    data, cursor = tick(defs, td, instance, cursor, now=t + 300)
    assert merge_requests(data) == []
    # Failed: requested again after the doubled backoff (2 intervals after attempt 2).
    instance.report_run_failed(run2)
    data, cursor = tick(defs, td, instance, cursor, now=t + 301)
    (req3,) = merge_requests(data)
    assert "#3/" in req3.run_key
    instance.report_run_failed(launch(instance, defs, req3))
    data, cursor = tick(defs, td, instance, cursor, now=t + 301 + 4 * INTERVAL - 1)
    assert merge_requests(data) == [] and liveness.stuck_regions(instance, "t") == {}
    # The cap: 3 runs without progress. No more requests; the regions are stuck, visibly.
    data, cursor = tick(defs, td, instance, cursor, now=t + 301 + 4 * INTERVAL)
    assert merge_requests(data) == []
    stuck = liveness.stuck_regions(instance, "t")
    assert sorted(stuck) == rids and all(s["attempts"] == 3 and s["generation"] == 1 for s in stuck.values())
    obs = [e for e in data.asset_events if e.metadata.get("stuck")]
    assert sorted(e.partition for e in obs) == rids
    assert all(e.metadata["failed_attempts"].value == 3 for e in obs)
    for later in (1000, 100000):
        data, cursor = tick(defs, td, instance, cursor, now=t + later)
        assert merge_requests(data) == []
    # A new flush does not restart the retries of a stuck region either (its wall is still there).
    w.write_round(30)
    data, cursor = tick(defs, td, instance, cursor, now=t + 100001)
    assert merge_requests(data) == []


def test_progress_resets_attempts_and_unsticks_a_region(table_loc, instance, spark):
    w, cfg, td, defs = setup(table_loc, regions=2, sensor=SensorOptions(merge_attempts=1))
    t = time.time()
    data, cursor = tick(defs, td, instance, now=t)
    (req,) = merge_requests(data)
    instance.report_run_failed(launch(instance, defs, req))
    data, cursor = tick(defs, td, instance, cursor, now=t + INTERVAL)
    assert merge_requests(data) == [] and len(liveness.stuck_regions(instance, "t")) == 2
    # The operator repairs and merges by hand (a materialization of the partitions).
    assert defs.resolve_job_def(req.job_name).execute_in_process(instance=instance, tags=req.tags).success
    data, cursor = tick(defs, td, instance, cursor, now=t + INTERVAL + 1)
    assert merge_requests(data) == [] and liveness.stuck_regions(instance, "t") == {}
    # Progress moved, so the count starts over: the next flush gets attempt 1 at once.
    w.write_round(60)
    data, cursor = tick(defs, td, instance, cursor, now=t + INTERVAL + 2)
    (req,) = merge_requests(data)
    assert "#1/" in req.run_key


# --------------------------------------------------------- a missing table, deleted partitions
def test_sensor_errors_when_the_table_does_not_exist(tmp_path, instance):
    loc = open_store(str(tmp_path / "nope"))
    cfg = cfg_for(loc)
    td = table_definitions(cfg)
    ctx = build_sensor_context(instance=instance, resources=td.resources)
    with pytest.raises(SensorError, match=r"t: cannot open Lance table .*nope"):
        evaluate_tick(ctx, cfg, td.partitions, td.merge_job.name, td.maintenance_job.name, loc)


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_deleting_a_partition_under_a_queued_range_run_strands_nothing(table_loc, instance, which):
    """A deleted partition comes back at the end of the partition order; every region
    the queued range run can no longer merge is requested again, the others are left to it."""
    w, cfg, td, defs = setup(table_loc, regions=3)
    t = time.time()
    data, cursor = tick(defs, td, instance, now=t)
    (req,) = merge_requests(data)
    order = list(instance.get_dynamic_partitions(td.partitions.name))
    assert requested_regions(req, order) == order
    queued = launch(instance, defs, req)
    gone = {"first": order[0], "middle": order[1], "last": order[2]}[which]
    instance.delete_dynamic_partition(td.partitions.name, gone)
    data, cursor = tick(defs, td, instance, cursor, now=t + INTERVAL)
    assert gone in instance.get_dynamic_partitions(td.partitions.name)  # its directory is still there
    again = merge_requests(data)
    order = list(instance.get_dynamic_partitions(td.partitions.name))
    if which == "first":  # the range now ends before it starts: nothing is covered, all requested
        (again,) = again
        assert sorted(requested_regions(again, order)) == sorted(order)
    elif which == "middle":  # the range still covers the other two; the re-added one gets its own
        (again,) = again
        assert requested_regions(again, order) == [gone]
    else:  # back in the same place: the queued run still covers all three
        assert again == []
    # Whatever happens to the queued run (Dagster cannot launch it, say), the rest follows.
    instance.report_run_failed(queued)
    for r in merge_requests(data):
        instance.report_run_failed(launch(instance, defs, r))
    data, cursor = tick(defs, td, instance, cursor, now=t + 10 * INTERVAL)
    (last,) = merge_requests(data)
    assert sorted(requested_regions(last, order)) == sorted(order)


# --------------------------------------------------------------------- sealed regions
def seal(loc, rid: str) -> int:
    def mutate(m: pb.RegionManifest) -> bool:
        m.status = pb.SEALED
        return True

    return region.commit_next(loc.store, region.load_latest(loc.store, rid), mutate).version


def test_sealed_region_merged_to_the_end_never_rewritten_then_retired(table_loc, instance, spark):
    w, cfg, td, defs = setup(table_loc, regions=2)
    sealed_rid, other = sorted(w.regions.values())
    version = seal(table_loc, sealed_rid)
    # pylance refuses to claim it (so no new generation will ever come) ...
    with pytest.raises(OSError, match="sealed"):
        with w.dataset().mem_wal_writer(sealed_rid) as writer:
            writer.put(demo.rows_table([demo.row(k, 1) for k in range(900, 903)]))
    # ... and memwal commits nothing on it: neither a WAL hint nor a GC trim.
    with pytest.raises(region.SealedRegion):
        region.commit_next(table_loc.store, region.load_latest(table_loc.store, sealed_rid), lambda m: True)
    t = time.time()
    data, cursor = tick(defs, td, instance, now=t)
    (req,) = merge_requests(data)
    assert sealed_rid in req.run_key  # merged to the end like any other region
    assert defs.resolve_job_def(req.job_name).execute_in_process(instance=instance, tags=req.tags).success
    state = table.read_memwal_state(table_loc)
    top = region.load_latest(table_loc.store, sealed_rid).top_generation
    assert state.merged[sealed_rid] == top
    region_dir = os.path.join(table_loc.store.root, layout.region_dir(sealed_rid))
    before = tree(region_dir)
    snap = snapshot.build_snapshot(table_loc)
    assert sealed_rid not in snap.region_errors
    catchup.run_catchup(table_loc)
    r = gc.run_gc(table_loc, cfg.gc)
    assert sealed_rid not in r.region_errors  # GC plans no trim (no manifest version) on a sealed region
    assert not [i for i in r.deleted if i.region_id == sealed_rid and i.kind == gc.GENERATION]
    assert tree(region_dir) == before
    assert region.load_latest(table_loc.store, sealed_rid).version == version
    assert region.load_latest(table_loc.store, other).generations == []  # the other one collected
    # Merged and caught up: the next tick retires its partition, and later ticks leave it alone.
    data, cursor = tick(defs, td, instance, cursor, now=t + 1)
    assert sealed_rid not in instance.get_dynamic_partitions(td.partitions.name)
    assert other in instance.get_dynamic_partitions(td.partitions.name)
    assert state_of(instance, cursor).get(sealed_rid).retired
    loc = td.resources["t_table"].location()
    ctx = build_sensor_context(instance=instance, cursor=cursor, resources=td.resources)
    checked = liveness.verify_this_tick(other, state_of(instance, cursor).ticks, VERIFY_EVERY)
    loc.store.stats.clear()
    evaluate_tick(ctx, cfg, td.partitions, td.merge_job.name, td.maintenance_job.name, loc, now=t + 2)
    assert sealed_rid not in instance.get_dynamic_partitions(td.partitions.name)
    # Only the other region is probed: one HEAD (two, plus the hint GET, when re-checked).
    assert loc.store.stats["head"] == (2 if checked else 1)


# -------------------------------------------------------------- end to end, with a real daemon
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMWAL_SOAK"), reason="a real dagster-daemon for minutes: make soak")
def test_daemon_end_to_end_drains_after_cancel_kill_and_downtime(tmp_path):
    """bench/liveness_e2e.py: a real daemon, a cancelled queued merge run, a SIGKILLed running
    one, the daemon down while writers go on and GC collects the sensor's versions; the
    backlog drains, the LSM read equals the writers' model, runs never pile up."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(repo, "bench", "liveness_e2e.py"), "--duration", "120",
                          "--downtime", "30", "--workdir", str(tmp_path)],
                         cwd=repo, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT liveness_e2e ")]
    assert " killed=1 " in line and " cancelled=1 " in line and "drained_s=NO" not in line, line


# ------------------------------------------ a permanent refusal stops the retries at once
def test_a_permanent_refusal_stops_the_sensor_after_the_first_run(table_loc, instance, spark):
    """A generation the merger refuses permanently (its columns differ from the base table's):
    the sensor's first merge run fails with a Dagster `Failure` naming region, value,
    generation, reason and repair; the next tick, past any backoff, requests nothing more (no
    JVM started again up to the attempt limit) and reports the region stuck with the reason."""
    from support.helpers import plant_generation
    import pyarrow as pa

    w, cfg, td, defs = setup(table_loc, regions=2)
    t = time.time()
    data, cursor = tick(defs, td, instance, now=t)
    (req,) = merge_requests(data)
    assert defs.resolve_job_def(req.job_name).execute_in_process(instance=instance, tags=req.tags).success
    data, cursor = tick(defs, td, instance, cursor, now=t + 1)
    assert merge_requests(data) == []
    (maint,) = run_requests(data)  # records the region values in the MemWAL index
    assert defs.resolve_job_def(maint.job_name).execute_in_process(instance=instance, tags=maint.tags).success
    victim = sorted(instance.get_dynamic_partitions(td.partitions.name))[0]
    wrong = pa.table({"id": pa.array([5], pa.int64()), "n": pa.array([1], pa.int64()),
                      "other": pa.array(["x"]), "_tombstone": pa.array([False])})
    bad = plant_generation(table_loc, victim, wrong)
    data, cursor = tick(defs, td, instance, cursor, now=t + 2)
    (req,) = merge_requests(data)
    assert req.partition_key == victim and "#1/" in req.run_key
    out = defs.resolve_job_def(req.job_name).execute_in_process(instance=instance, tags=req.tags,
                                                                  partition_key=req.partition_key,
                                                                  raise_on_error=False)
    assert not out.success
    failure = next(e for e in out.all_events if e.is_step_failure).step_failure_data
    said = failure.user_failure_data.description
    assert f"region {victim} (bucket=" in said and f"at generation {bad} (permanent)" in said, said
    assert "columns differ from the base table" in said and "Repair:" in said, said
    # Past every backoff: no second run, the region is stuck at once, with the refusal's reason.
    for later in (t + 10 * INTERVAL, t + 10000):
        data, cursor = tick(defs, td, instance, cursor, now=later)
        assert merge_requests(data) == []
    stuck = liveness.stuck_regions(instance, "t")
    assert list(stuck) == [victim] and stuck[victim]["generation"] == bad and stuck[victim]["attempts"] == 1
    events = [e for e in instance.fetch_observations(td.assets[0].key, limit=50).records
              if e.partition_key == victim and "stuck" in e.asset_observation.metadata]
    (obs,) = events
    reason = obs.asset_observation.metadata["reason"].value
    assert "refused it permanently (generation" in reason and "columns differ" in reason and "repair" in reason
