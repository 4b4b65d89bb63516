"""The Dagster layer at scale and when things go wrong: per-region materializations, bounded
metadata at 3,000 regions, idle maintenance that commits nothing, a stuck region that is visible,
GC holds that say what they keep, tables sharing a Connect server. Real tables, real
`materialize` / jobs in process."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from dagster import AssetCheckSeverity, AssetKey, AssetPartitionStatus, DagsterInstance, MetadataValue, materialize
from support.tables import cfg_for, make_table, rows

from memwal_core.jobs import catchup, gc
from memwal_core.observe import status
from memwal_core.state import layout, region, table
from memwal_core.tools import demo
from memwal_pipeline import failures
from memwal_pipeline import metadata as bounded
from memwal_pipeline.assets import catchup_markdown, holds_markdown
from memwal_pipeline.checks import lag_report
from memwal_pipeline.definitions import build_definitions, table_definitions
from memwal_pipeline.tags import PARTITION_RANGE_END, PARTITION_RANGE_START


@pytest.fixture
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def _range(regions):
    return {PARTITION_RANGE_START: regions[0], PARTITION_RANGE_END: regions[-1]}


def _failed_partitions(instance, td, key):
    keys = instance.get_dynamic_partitions(td.partitions.name)
    by = instance.get_status_by_partition(key, keys, td.partitions) or {}
    return {k for k, v in by.items() if v == AssetPartitionStatus.FAILED}


def test_range_run_materializes_only_regions_that_merged(table_loc, instance, spark):
    """A run over 5 regions where 2 flushed records 2 materializations, each with
    that region's own numbers (not the run's totals)."""
    demo.create_table(table_loc, sharding="bucket", num_buckets=5, base_rows=10)
    w = demo.Workload(table_loc, seed=3, key_space=300, max_memtable_rows=50)
    w.write_round(150, puts_per_batch=10)
    td = table_definitions(cfg_for(table_loc))
    regions = sorted(w.regions.values())
    instance.add_dynamic_partitions(td.partitions.name, regions)
    by = {a.key.path[-1]: a for a in td.assets}
    assert materialize([by["base_table"]], instance=instance, resources=td.resources, tags=_range(regions)).success
    # Only the first and the last region flush again.
    changed = {regions[0]: 2, regions[-1]: 1}
    for rid, n in changed.items():
        value = next(v for v, r in w.regions.items() if r == rid)
        keys = [k for k in range(1000, 3000) if w.region_value([k])[0] == value][:4]
        for i in range(n):
            with w.dataset().mem_wal_writer(rid) as writer:
                writer.put(demo.rows_table([demo.row(k, 50 + i) for k in keys]))
    r = materialize([by["base_table"]], instance=instance, resources=td.resources, tags=_range(regions))
    assert r.success
    mats = {m.partition: m.metadata for m in r.asset_materializations_for_node(by["base_table"].op.name)}
    assert set(mats) == set(changed)
    for rid, n in changed.items():
        md = mats[rid]
        top = max(g.generation for g in region.load_latest(table_loc.store, rid).generations)
        assert md["generations_merged"].value == n and md["merged_generation"].value == top
        assert md["pending_generations"].value == 0 and md["rows_read"].value == 4 * n
        assert md["run/regions"].value == 2  # the run planned 5 regions; 2 had something to merge
    assert _failed_partitions(instance, td, by["base_table"].key) == set()
    # The run's totals: one observation of the asset, not copied onto each region's event.
    (obs,) = r.asset_observations_for_node(by["base_table"].op.name)
    assert obs.partition is None and obs.metadata["generations_merged"].value == 3
    assert obs.metadata["regions"].value == 5 and obs.metadata["regions_merged"].value == 2
    # A run where nothing happened records nothing.
    r = materialize([by["base_table"]], instance=instance, resources=td.resources, tags=_range(regions))
    assert r.success and r.asset_materializations_for_node(by["base_table"].op.name) == []
    assert r.asset_observations_for_node(by["base_table"].op.name)[0].metadata["generations_merged"].value == 0


def _wrong_schema(table_loc, rid: str, key: int) -> int:
    """A generation the merger refuses every time: its columns differ from the base table's."""
    import pyarrow as pa
    from support.helpers import plant_generation

    wrong = pa.table({"id": pa.array([key], pa.int64()), "n": pa.array([1], pa.int64()),
                      "other": pa.array(["x"]), "_tombstone": pa.array([False])})
    return plant_generation(table_loc, rid, wrong)


def test_stuck_region_fails_its_partition_and_merge_lag(table_loc, tmp_path, spark, monkeypatch):
    """A region the merger refuses fails the merge run (naming region,
    generation, reason) and only its partition; `merge_lag` fails with ERROR once it is stuck,
    and `memwal status` exits non-zero."""
    # Per-partition planned events: Dagster marks a failed run's unmaterialized partitions failed.
    monkeypatch.setenv("DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS", "false")
    w = make_table(table_loc, regions=3, rounds=1)
    home = tmp_path / "home"
    home.mkdir()
    instance = DagsterInstance.local_temp(str(home))
    cfg = cfg_for(table_loc)
    td = table_definitions(cfg)
    defs = build_definitions([cfg])
    regions = sorted(w.regions.values())
    instance.add_dynamic_partitions(td.partitions.name, regions)
    victim_value, victim = sorted(w.regions.items())[0]
    key = next(k for k in range(1000, 3000) if w.region_value([k])[0] == victim_value)
    bad = _wrong_schema(table_loc, victim, key)
    merge_job = defs.resolve_job_def("t_merge")
    lag_job = defs.resolve_job_def("t_checks")
    asset_key = AssetKey(["t", "base_table"])
    stuck_seen = None
    for attempt in range(1, cfg.sensor.merge_attempts + 1):
        out = merge_job.execute_in_process(instance=instance, tags=_range(regions), raise_on_error=False)
        assert not out.success
        step_failure = next(e for e in out.all_events if e.is_step_failure)
        err = step_failure.step_failure_data.error
        while err.cause is not None:
            err = err.cause
        msg = err.message
        assert victim in msg and f"generation {bad}" in msg and "columns differ" in msg, msg
        # Every other region of the range is recorded (merged, or nothing to merge): only the
        # stuck region's partition is failed.
        mats = {m.partition for m in out.asset_materializations_for_node("t__base_table")}
        assert mats == set(regions) - {victim}
        assert _failed_partitions(instance, td, asset_key) == {victim}
        tags = instance.get_run_by_id(out.run_id).tags
        assert tags[failures.FAILED_TAG] == "true" and victim in tags[failures.FAILURES_TAG]
        checks = lag_job.execute_in_process(instance=instance, raise_on_error=False)
        lag = next(c for c in checks.get_asset_check_evaluations() if c.check_name == "merge_lag")
        if not lag.passed:
            stuck_seen = attempt
            break
    assert stuck_seen is not None, "merge_lag never reported the stuck region"
    assert lag.severity == AssetCheckSeverity.ERROR
    (entry,) = lag.metadata["stuck"].value
    assert entry["region"] == victim and entry["generation"] == bad and "columns differ" in entry["reason"]
    assert victim in (lag.description or "")
    # Known stuck: the next run over the range no longer fails the others' run; the region's
    # partition stays failed and its generations stay unmerged.
    out = merge_job.execute_in_process(instance=instance, tags=_range(regions), raise_on_error=False)
    assert out.success
    assert _failed_partitions(instance, td, asset_key) == {victim}
    assert table.read_memwal_state(table_loc).merged[victim] == bad - 1
    # `memwal status` reads the same instance (DAGSTER_HOME) and exits non-zero.
    from memwal_pipeline import cli

    monkeypatch.setenv("DAGSTER_HOME", str(home))
    assert cli.main(["status", table_loc.lance_uri]) == 1
    instance.dispose()


def test_metadata_per_event_is_bounded_at_3000_regions():
    """Every check's and asset's metadata stays under 4 KB at 3,000 regions."""
    n = 3000
    ids = [str(uuid.UUID(int=i + 1)) for i in range(n)]
    regs = [status.RegionStatus(rid, 5, 1, 9, [7, 8], 6, [7, 8] if i % 2 else [], 100, 1000,
                                float(i) * 1.234567 if i % 2 else 0.0,
                                "manifest cannot be decoded: " + "x" * 200 if i % 97 == 0 else None)
            for i, rid in enumerate(ids)]
    st = status.TableStatus("t", 9, regs, [])
    stuck = [failures.StuckRegion(rid, 7, "generation 7 has 3 rows that route to another region " * 5, 3, True)
             for rid in ids[:500]]
    passed, severity, md = lag_report(st, 600.0, stuck)
    assert not passed and severity == AssetCheckSeverity.ERROR
    assert bounded.encoded_size(md) <= 4096, bounded.encoded_size(md)
    worst = md["worst_regions"].value
    assert len(worst) == bounded.TOP_N and all(w["age_s"] > 0 for w in worst)
    assert worst[0]["age_s"] == round(2999 * 1.234567, 1)  # rounded, the oldest first
    crows = [catchup.CatchupRow("id_btree", ids[i], True, i % 7, 6, max(0, 6 - i % 7), i % 7 >= 6, None, None)
             for i in range(n)]
    text = catchup_markdown(crows)
    assert len(text.encode()) <= 4096 and f"{sum(1 for r in crows if r.gap == 0)} of {n} regions caught up" in text
    holds = [gc.GcHold("time_travel", 9000, 10**9, n, 1.8e9), gc.GcHold("not_merged", 3000, 10**8, n)]
    assert len(holds_markdown(holds).encode()) <= 1024
    errors = {rid: "region " + rid + ": " + "y" * 300 for rid in ids}
    assert bounded.encoded_size({"errors": MetadataValue.json(bounded.top(errors))}) <= 4096
    kept = bounded.fit(errors)  # errors a reader needs verbatim (the CLI prints them): whole, within budget
    assert bounded.encoded_size({"errors": MetadataValue.json(kept)}) <= 4096
    assert kept[bounded.MORE] > 2900 and all(kept[k] == errors[k] for k in kept if k != bounded.MORE)


def test_idle_maintenance_commits_nothing(table_loc, instance, spark):
    """Once merged and maintained, further maintenance runs on an idle table add no
    table version and no region manifest version."""
    w = make_table(table_loc, regions=3, rounds=1)
    cfg = cfg_for(table_loc)
    defs = build_definitions([cfg])
    regions = sorted(w.regions.values())
    td = table_definitions(cfg)
    instance.add_dynamic_partitions(td.partitions.name, regions)
    assert defs.resolve_job_def("t_merge").execute_in_process(instance=instance, tags=_range(regions)).success
    maint = defs.resolve_job_def("t_maintenance")
    # The first run snapshots, catches up and collects (GC commits trimmed manifests); the
    # second snapshots the trimmed manifests. From then on the table is idle.
    for _ in range(2):
        assert maint.execute_in_process(instance=instance).success

    def versions():
        return (table.open_dataset(table_loc).version,
                {rid: region.load_latest(table_loc.store, rid).version for rid in regions})

    before = versions()
    for _ in range(2):
        out = maint.execute_in_process(instance=instance)
        assert out.success
        assert versions() == before
    md = out.asset_materializations_for_node("t__memwal_index")[0].metadata
    assert md["committed"].value is False and md["table_version"].value == before[0]
    assert rows(table_loc) == w.expected()
    # A real change (a flush) is snapshotted again.
    value, rid = sorted(w.regions.items())[0]
    keys = [k for k in range(1000, 3000) if w.region_value([k])[0] == value][:2]
    with w.dataset().mem_wal_writer(rid) as writer:
        writer.put(demo.rows_table([demo.row(k, 5) for k in keys]))
    assert maint.execute_in_process(instance=instance).success
    assert table.open_dataset(table_loc).version > before[0]


def test_checks_job_runs_exclusivity_and_gc_consistency_reports_unreadable(table_loc, instance):
    """`region_exclusivity` belongs to a job (and a schedule); gc_consistency fails on
    a region whose manifest does not load instead of skipping it."""
    w = make_table(table_loc, regions=3, rounds=1)
    cfg = cfg_for(table_loc)
    defs = build_definitions([cfg])
    assert {s.name for s in defs.schedules} >= {"t_checks_schedule", "t_maintenance_schedule"}
    out = defs.resolve_job_def("t_checks").execute_in_process(instance=instance)
    names = {c.check_name: c for c in out.get_asset_check_evaluations()}
    assert set(names) == {"region_exclusivity", "merge_lag", "mergeable"} and names["region_exclusivity"].passed
    assert names["mergeable"].passed
    bad = sorted(w.regions.values())[1]
    latest = region.load_latest(table_loc.store, bad)
    table_loc.store.put(layout.manifest_key(bad, latest.version + 1), b"\xff\xff garbage")
    from memwal_core.observe import checks as core_checks

    unreadable: dict = {}
    assert core_checks.missing_generations(table_loc, unreadable) == {}
    assert set(unreadable) == {bad}
    out = defs.resolve_job_def("t_maintenance").execute_in_process(instance=instance, raise_on_error=False)
    gcc = next(c for c in out.get_asset_check_evaluations() if c.check_name == "gc_consistency")
    assert not gcc.passed and gcc.severity == AssetCheckSeverity.ERROR
    assert bad in gcc.metadata["region_errors"].value


def test_gc_holds_say_what_is_kept_and_until_when(table_loc, spark):
    """The plan says which generations GC keeps for time travel (until when), for a
    lagging index, and unmerged."""
    w = make_table(table_loc, regions=2, rounds=2)
    from memwal_core.jobs import merge

    merge.merge(table_loc, spark)
    week = timedelta(days=7)
    plan = gc.plan_gc(table_loc, gc.GcOptions(cleanup_base_versions_older_than_seconds=week.total_seconds()))
    holds = {h.reason: h for h in plan.holds}
    # The version written before the merge (merged = {}) is retained and reads every generation;
    # the btree index has not caught up either, but the first bound named wins per generation.
    assert set(holds) <= {"time_travel", "index_behind:id_btree"} and holds
    total = sum(h.generations for h in holds.values())
    assert total == sum(len(region.load_latest(table_loc.store, rid).generations) for rid in w.regions.values())
    catchup.run_catchup(table_loc)
    plan = gc.plan_gc(table_loc, gc.GcOptions(cleanup_base_versions_older_than_seconds=week.total_seconds()))
    (tt,) = plan.holds
    assert tt.reason == "time_travel" and tt.bytes > 0 and tt.regions == 2
    newest_needing = max(v["timestamp"] for v in table.open_dataset(table_loc).versions()
                         if v["version"] < table.open_dataset(table_loc).version)
    assert tt.until is not None and tt.until <= newest_needing.timestamp() + week.total_seconds() + 1
    assert "until 20" in tt.describe()
    assert plan.to_dict()["holds"][0]["reason"] == "time_travel"
    # The shipped cleanup (a week) gives the hold an end; with the cleanup off it has none, and says so.
    (tt,) = gc.plan_gc(table_loc).holds
    assert tt.until is not None and tt.until <= newest_needing.timestamp() + week.total_seconds() + 1
    (tt,) = gc.plan_gc(table_loc, gc.GcOptions(cleanup_base_versions_older_than_seconds=None)).holds
    assert tt.until is None and "no cleanup configured" in tt.describe()
    # Unmerged generations are held as such.
    value, rid = sorted(w.regions.items())[0]
    keys = [k for k in range(1000, 3000) if w.region_value([k])[0] == value][:2]
    with w.dataset().mem_wal_writer(rid) as writer:
        writer.put(demo.rows_table([demo.row(k, 5) for k in keys]))
    holds = {h.reason: h for h in gc.plan_gc(table_loc).holds}
    assert holds["not_merged"].generations == 1 and holds["not_merged"].regions == 1


def test_orphan_grace_default_is_a_day():
    assert gc.GcOptions().orphan_grace_seconds >= 24 * 3600


def test_spark_connect_settings_apply_per_session_or_are_refused(tmp_path, monkeypatch):
    """Tables sharing one Connect server each get their own `memwal.*` settings
    (the server drops non-Spark keys at start); a different master or a fixed setting the
    server lacks is refused loudly, at load time where possible.

    Runs in a pytest of its own: a Connect session switches pyspark in the whole process to
    Connect mode (`SPARK_CONNECT_MODE_ENABLED`), which would break the suite's local session
    for every later test."""
    import os
    import subprocess
    import sys

    if os.environ.get("MEMWAL_CONNECT_TEST_PROCESS") != "1":
        me = f"{os.path.abspath(__file__)}::test_spark_connect_settings_apply_per_session_or_are_refused"
        # os._exit: the Connect client leaves non-daemon threads that would keep the process
        # alive after the test; output to a file, not a pipe a grandchild could hold open.
        log = tmp_path / "connect-test.log"
        with open(log, "w") as f:
            code = subprocess.run(
                [sys.executable, "-c", "import os, sys, pytest; "
                 f"os._exit(pytest.main(['-q', '-p', 'no:cacheprovider', {me!r}]))"],
                env={**os.environ, "MEMWAL_CONNECT_TEST_PROCESS": "1"}, stdout=f, stderr=subprocess.STDOUT,
                timeout=500, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).returncode
        text = log.read_text()
        assert code == 0 and "1 passed" in text, text[-5000:]
        return
    import socket

    from dagster import build_resources

    from memwal_core.jobs.merge import merge_tasks
    from memwal_core.options import SparkOptions
    from memwal_core.spark import connect as spark_connect
    from memwal_pipeline.config import ConfigError, TableConfig
    from memwal_pipeline.resources import spark_resource

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = f"sc://127.0.0.1:{port}"
    monkeypatch.setenv("MEMWAL_STATE_DIR", str(tmp_path / "state"))

    def cfg(name, master="local[1]", **conf):
        return TableConfig(name=name, uri=str(tmp_path / name), spark=SparkOptions(
            master=master, connect=remote, conf={k.replace("__", "."): v for k, v in conf.items()}))

    a = cfg("a", memwal__merge__partitions="3", spark__sql__shuffle__partitions="5")
    b = cfg("b", memwal__merge__partitions="5")
    with pytest.raises(ConfigError, match="different masters"):
        build_definitions([a, cfg("c", master="local[2]")])
    try:
        with build_resources({"s": spark_resource(a)}) as ra, build_resources({"s": spark_resource(b)}) as rb:
            sa, sb = ra.s.spark_session, rb.s.spark_session
            assert merge_tasks(sa) == 3 and merge_tasks(sb) == 5  # each table its own setting
            assert sa.conf.get("spark.sql.shuffle.partitions") == "5"
            assert sa.range(4).count() == 4
        # A master (or a fixed setting) the running server was not started with: refused.
        for other in (cfg("d", master="local[2]"), cfg("e", spark__executor__memory="3g")):
            with pytest.raises(spark_connect.ConnectConfMismatch, match="started with other settings"):
                with build_resources({"s": spark_resource(other)}) as rd:
                    rd.s.spark_session  # noqa: B018 - creating the session is the test
    finally:
        spark_connect.stop_server(remote, state_dir=tmp_path / "state")


def test_merge_lag_reports_regions_the_sensor_gave_up_on(table_loc, instance):
    """The sensor's retry cap (liveness.stuck_regions) shows in merge_lag as ERROR too."""
    import json

    from memwal_pipeline import liveness

    w = make_table(table_loc, regions=2, rounds=1)
    cfg = cfg_for(table_loc)
    defs = build_definitions([cfg])
    rid = sorted(w.regions.values())[0]
    instance.run_storage.set_cursor_values({liveness._stuck_key("t"): json.dumps(
        {rid: {"generation": 1, "attempts": 3, "since": 0}})})
    out = defs.resolve_job_def("t_checks").execute_in_process(instance=instance, raise_on_error=False)
    lag = next(c for c in out.get_asset_check_evaluations() if c.check_name == "merge_lag")
    assert not lag.passed and lag.severity == AssetCheckSeverity.ERROR
    (entry,) = lag.metadata["stuck"].value
    assert entry["region"] == rid and entry["failed_runs"] == 3 and "sensor gave up" in entry["reason"]
