"""The Dagster layer on real tables: definitions, the manifest sensor, materialize, end to end."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    EnvVar,
    SkipReason,
    build_sensor_context,
    materialize,
)
from support.sensor_ticks import run_requests, tick
from support.tables import cfg_for, make_table, rows

from memwal_core.options import GcOptions
from memwal_core.state import layout, region, table
from memwal_core.tools import demo
from memwal_pipeline.config import load_config
from memwal_pipeline.definitions import build_definitions, table_definitions
from memwal_pipeline.sensors import evaluate_tick
from memwal_pipeline.tags import PARTITION_RANGE_END, PARTITION_RANGE_START

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def test_config_file_two_tables_and_secret_env(tmp_path, monkeypatch):
    cfg = tmp_path / "memwal.yaml"
    cfg.write_text(textwrap.dedent("""
        tables:
          - name: a
            uri: data/a
          - name: b
            uri: s3://bucket/b
            storage_options: {aws_endpoint: "http://127.0.0.1:1", aws_access_key_id: key}
            secrets: {aws_secret_access_key: B_SECRET}
            spark: {master: "sc://127.0.0.1:15002"}
            slo: {merge_lag_seconds: 5}
    """))
    tables = load_config(cfg)
    assert [t.name for t in tables] == ["a", "b"]
    assert tables[0].uri == str(tmp_path / "data" / "a")
    assert tables[1].secrets == {"aws_secret_access_key": "B_SECRET"}
    defs = build_definitions(tables)
    keys = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    for t in ("a", "b"):
        for a in ("region_generations", "base_table", "base_compaction", "memwal_index", "index_catchup", "garbage"):
            assert f"{t}/{a}" in keys
    assert {s.name for s in defs.sensors} == {"a_manifest_sensor", "b_manifest_sensor"}
    # The secret is resolved from the environment at run time, never read from the file.
    monkeypatch.setenv("B_SECRET", "s3cr3t")
    res = table_definitions(tables[1]).resources["b_table"]
    assert "s3cr3t" not in cfg.read_text()
    assert isinstance(res.aws_secret_access_key, EnvVar)  # the name only; resolved at run time
    live = res.process_config_and_initialize()
    assert live.location().storage_options["aws_secret_access_key"] == "s3cr3t"


def test_config_refuses_secrets_in_file(tmp_path):
    from memwal_pipeline.config import ConfigError

    cfg = tmp_path / "memwal.yaml"
    cfg.write_text("tables:\n  - name: x\n    uri: s3://b/x\n    storage_options: {aws_secret_access_key: oops}\n")
    with pytest.raises(ConfigError, match="secrets"):
        load_config(cfg)


def test_config_spark_connect_for_runs(tmp_path):
    """`spark.connect`: runs are Connect clients of a server that runs `spark.master`."""
    from memwal_pipeline.config import ConfigError
    from memwal_pipeline.resources import spark_resource

    cfg = tmp_path / "memwal.yaml"
    cfg.write_text("tables:\n  - name: x\n    uri: data/x\n"
                   "    spark: {master: 'local[3]', connect: 'sc://127.0.0.1:15999', conf: {a.b: '1'}}\n"
                   "  - name: y\n    uri: data/y\n")
    x, y = load_config(cfg)
    assert x.spark.connect == "sc://127.0.0.1:15999" and y.spark.connect is None
    assert spark_resource(x).spark_config == {"spark.remote": "sc://127.0.0.1:15999", "memwal.connect.autostart": "true",
                                              "spark.master": "local[3]", "a.b": "1"}
    assert spark_resource(y).spark_config == {"spark.master": "local[*]"}
    cfg.write_text("tables:\n  - name: x\n    uri: data/x\n    spark: {connect: 'localhost:15002'}\n")
    with pytest.raises(ConfigError, match=r"spark.connect must be a Spark Connect URL"):
        load_config(cfg)
    # The shipped demo table (a MemWalTable component): runs share one long-lived local server.
    from dagster import ComponentTree

    from memwal_pipeline.component import MemWalTable

    (shipped,) = ComponentTree.for_project(path_within_project=Path(REPO)).get_all_components(MemWalTable)
    assert shipped.spark.connect == "sc://127.0.0.1:15002" and shipped.spark.master == "local[*]"


def test_definitions_validate_cli():
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dagster"), "definitions", "validate",
                          "-w", "workspace.yaml"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_sensor_partitions_requests_and_quiet_ticks(table_loc, instance, spark):
    w = make_table(table_loc, regions=3)
    td = table_definitions(cfg_for(table_loc))
    defs = build_definitions([td.cfg])
    result, cursor = tick(defs, td, instance)
    # Every region became a partition, and one merge run covers them all: the partition range
    # from the first to the last, its run_key naming each region's newest generation.
    order = instance.get_dynamic_partitions(td.partitions.name)
    assert sorted(order) == sorted(w.regions.values())
    reqs = run_requests(result)
    assert len(reqs) == 1 and reqs[0].job_name == "t_merge" and reqs[0].partition_key is None
    assert reqs[0].tags[PARTITION_RANGE_START] == order[0]
    assert reqs[0].tags[PARTITION_RANGE_END] == order[-1]
    tops = {rid: max(g.generation for g in region.load_latest(table_loc.store, rid).generations) for rid in order}
    # run_key: each region's region:generation@merged#attempt, and the sensor state's epoch.
    epoch = json.loads(cursor)["epoch"]
    assert reqs[0].run_key == ",".join(f"{rid}:{tops[rid]}@0#1" for rid in order) + f"/{epoch}"
    # region_generations (written by the table's writers) is recorded per partition: not "Missing".
    assert instance.get_materialized_partitions(AssetKey(["t", "region_generations"])) == set(order)
    # The run is executed; the next tick requests maintenance after it, the one after nothing.
    job = defs.resolve_job_def(reqs[0].job_name)
    assert job.execute_in_process(instance=instance, tags=reqs[0].tags).success
    result2, cursor2 = tick(defs, td, instance, cursor)
    assert [r.job_name for r in run_requests(result2)] == ["t_maintenance"]
    result2, cursor2 = tick(defs, td, instance, cursor2)
    assert run_requests(result2) == [] and result2.skip_message
    # A new generation in one region: exactly one new merge request, for that region.
    victim = sorted(w.regions.items())[0]
    with w.dataset().mem_wal_writer(victim[1]) as writer:
        keys = [k for k in range(300, 600) if w.region_value([k])[0] == victim[0]][:3]
        writer.put(demo.rows_table([demo.row(k, 7) for k in keys]))
    result3, cursor3 = tick(defs, td, instance, cursor2)
    reqs3 = run_requests(result3)
    assert [r.partition_key for r in reqs3] == [victim[1]]
    top = max(g.generation for g in region.load_latest(table_loc.store, victim[1]).generations)
    merged = table.read_memwal_state(table_loc).merged[victim[1]]
    assert reqs3[0].run_key == f"{victim[1]}:{top}@{merged}#1/{epoch}"

    # That run is queued, not started, when the writer flushes again: it will plan when it
    # starts and take the new generation along, so no second run is queued behind it.
    from dagster import DagsterRunStatus

    # (NOT_STARTED: a QUEUED run needs a code-location origin; the sensor treats both alike.)
    queued = instance.create_run_for_job(defs.resolve_job_def("t_merge"), tags=reqs3[0].tags,
                                         status=DagsterRunStatus.NOT_STARTED)

    def flush(version: int) -> int:
        with w.dataset().mem_wal_writer(victim[1]) as writer:
            writer.put(demo.rows_table([demo.row(k, version) for k in keys]))
        return max(g.generation for g in region.load_latest(table_loc.store, victim[1]).generations)

    flush(8)
    result4, cursor4 = tick(defs, td, instance, cursor3)
    assert [r for r in run_requests(result4) if r.job_name == "t_merge"] == []
    # The queued run is cancelled: the region is requested again (attempt 2, a new run_key)
    # once the backoff after the first request (one interval) has passed, not before.
    instance.report_run_canceled(queued)
    top5 = flush(9)
    result5, cursor5 = tick(defs, td, instance, cursor4)
    assert [r for r in run_requests(result5) if r.job_name == "t_merge"] == []
    import time as _time

    result6, _ = tick(defs, td, instance, cursor5, now=_time.time() + td.cfg.sensor.interval_seconds + 1)
    assert [(r.partition_key, r.run_key) for r in run_requests(result6) if r.job_name == "t_merge"] == [
        (victim[1], f"{victim[1]}:{top5}@{merged}#2/{epoch}")]


def test_sensor_tick_cost_on_unchanged_regions(table_loc, instance):
    make_table(table_loc, regions=4, rounds=1)
    cfg = cfg_for(table_loc)
    td = table_definitions(cfg)
    defs = build_definitions([cfg])
    _, cursor = tick(defs, td, instance)
    loc = td.resources["t_table"].location()
    ctx = build_sensor_context(instance=instance, cursor=cursor, resources=td.resources)
    # Ticks after the first: one HEAD per region, plus a GET of the version hint (and a HEAD
    # of the version it names) for the rotating slice of regions re-checked this tick.
    from memwal_pipeline import liveness
    from memwal_pipeline.sensors import VERIFY_EVERY

    rids = region.list_regions(loc.store).region_ids
    for _ in range(3):
        n = liveness.SensorState.load(instance, cfg.name, json.loads(cursor)["epoch"]).ticks
        checked = sum(liveness.verify_this_tick(r, n, VERIFY_EVERY) for r in rids)
        loc.store.stats.clear()
        result = evaluate_tick(ctx, cfg, td.partitions, "t_merge", "t_maintenance", loc)
        assert isinstance(result, SkipReason)
        assert loc.store.stats["list"] == 1  # `_mem_wal/` only
        assert loc.store.stats["head"] == 4 + checked  # one probe per region
        # + the table manifest's MemWAL index: every region has unmerged generations, so the
        # tick reconciles them against merged progress (a table with nothing pending skips it).
        assert loc.store.stats["get"] == checked + 1


def test_sensor_reports_corrupt_region_and_continues(table_loc, instance):
    w = make_table(table_loc, regions=3, rounds=1)
    bad = sorted(w.regions.values())[0]
    latest = region.load_latest(table_loc.store, bad)
    table_loc.store.put(layout.manifest_key(bad, latest.version + 1), b"\xff\xff garbage")
    td = table_definitions(cfg_for(table_loc))
    defs = build_definitions([td.cfg])
    result, _ = tick(defs, td, instance)
    (req,) = run_requests(result)
    good = sorted(set(w.regions.values()) - {bad})
    assert sorted(p.split(":")[0] for p in req.run_key.split(",")) == good


def test_gc_without_base_version_cleanup_warns_what_it_keeps_forever(table_loc, instance, spark):
    """GC with the base-version cleanup turned off (`null`) keeps every retained version's
    generations and reads every version each pass: the garbage asset says so (a WARNING in the
    run's log, with the count it plots). With a cleanup (the shipped default of a week, by age,
    or by count alone) it does not; the default keeps the young versions' generations and says
    until when."""
    w = make_table(table_loc, regions=2, rounds=1)
    fast = dict(manifest_min_age_seconds=0, orphan_grace_seconds=0)
    retain_only = GcOptions(cleanup_base_versions_older_than_seconds=None, cleanup_base_versions_retain=1,
                            cleanup_base_versions_floor_seconds=0, **fast)
    off = GcOptions(cleanup_base_versions_older_than_seconds=None, **fast)
    # (options, warns, collects): None is cfg_for's cleanup of every version (no floor).
    for gc_options, warns, collects in ((off, True, False), (GcOptions(**fast), False, False), (None, False, True),
                                        (retain_only, False, True)):
        td = table_definitions(cfg_for(table_loc, **({"gc": gc_options} if gc_options else {})))
        instance.add_dynamic_partitions(td.partitions.name, sorted(w.regions.values()))
        by = {a.key.path[-1]: a for a in td.assets}
        w.write_round(40, puts_per_batch=10)
        regions = sorted(w.regions.values())
        assert materialize([by["base_table"]], instance=instance, resources=td.resources,
                           tags={PARTITION_RANGE_START: regions[0], PARTITION_RANGE_END: regions[-1]}).success
        r = materialize([by["index_catchup"], by["memwal_index"], by["garbage"]], instance=instance,
                        resources=td.resources)
        md = r.asset_materializations_for_node(by["garbage"].op.name)[0].metadata
        versions = len(table.open_dataset(table_loc).versions())
        assert md["retained_base_versions"].value == versions
        said = [e.user_message for e in instance.all_logs(r.run_id) if e.level == logging.WARNING
                and "no base-version cleanup is configured" in e.user_message]
        assert len(said) == warns, said
        if warns:
            assert f"{versions} retained base-table versions" in said[0]
        if collects:
            assert md["generations_deleted"].value > 0 and versions == 1
        else:
            assert md["generations_deleted"].value == 0 and versions > 1
            held = md["held"].value
            assert ("no cleanup configured" in held) == warns and ("until 20" in held) != warns, held
    assert rows(table_loc) == w.expected()


def test_materialize_each_asset_and_multi_region_backfill(table_loc, instance, spark):
    w = make_table(table_loc, regions=3)
    td = table_definitions(cfg_for(table_loc))
    regions = sorted(w.regions.values())
    instance.add_dynamic_partitions(td.partitions.name, regions)
    by = {a.key.path[-1]: a for a in td.assets}
    r = materialize([by["region_generations"]], partition_key=regions[0], instance=instance, resources=td.resources)
    md = r.asset_materializations_for_node(by["region_generations"].op.name)[0].metadata
    assert md["pending_generations"].value == 2 and md["merged_generation"].value == 0
    # A backfill over all regions: one run, one Spark job, one commit within the budget.
    version = table.open_dataset(table_loc).version
    r = materialize([by["base_table"]], instance=instance, resources=td.resources,
                    tags={PARTITION_RANGE_START: regions[0], PARTITION_RANGE_END: regions[-1]})
    assert r.success
    mats = r.asset_materializations_for_node(by["base_table"].op.name)
    # One materialization per region that merged, with that region's own numbers; the run's
    # facts are labelled `run/`.
    assert sorted(m.partition for m in mats) == regions
    assert all(m.metadata["generations_merged"].value == 2 for m in mats)
    assert all(m.metadata["pending_generations"].value == 0 for m in mats)
    assert all(m.metadata["run/regions"].value == 3 and m.metadata["run/commits"].value == 1 for m in mats)
    assert table.open_dataset(table_loc).version == version + 1
    assert rows(table_loc) == w.expected()
    for step in ("memwal_index", "index_catchup", "garbage"):
        r = materialize([by[step], *td.checks_for(by[step].key)], instance=instance, resources=td.resources)
        assert r.success, step
    md = r.asset_materializations_for_node(by["garbage"].op.name)[0].metadata
    assert md["generations_deleted"].value == 6
    assert md["retained_base_versions"].value == len(table.open_dataset(table_loc).versions())  # plotted
    check_results = r.get_asset_check_evaluations()
    assert check_results and all(c.passed for c in check_results)
    assert rows(table_loc) == w.expected()


def test_end_to_end_sensor_drives_everything(table_loc, instance, spark):
    w = make_table(table_loc, regions=3)
    cfg = cfg_for(table_loc)
    td = table_definitions(cfg)
    defs = build_definitions([cfg])
    cursor = None
    for _ in range(6):  # sensor ticks, each followed by the runs it requested
        result, cursor = tick(defs, td, instance, cursor)
        reqs = run_requests(result)
        if not reqs:
            break
        for req in reqs:
            job = defs.resolve_job_def(req.job_name)
            out = job.execute_in_process(instance=instance, partition_key=req.partition_key, tags=req.tags)
            assert out.success
    state = table.read_memwal_state(table_loc)
    assert rows(table_loc) == w.expected()
    for rid in w.regions.values():
        m = region.load_latest(table_loc.store, rid)
        assert m.generations == []  # merged, caught up and collected
        assert state.merged[rid] == m.current_generation - 1
    assert state.details.num_regions == 3  # snapshotted
    assert all(g == state.merged[rid] for rid, g in state.catchup["id_btree"].items())
    mats = instance.fetch_materializations(AssetKey(["t", "garbage"]), limit=1).records
    assert mats, "maintenance ran after the merges"


def test_a_new_instance_of_a_maintained_table_shows_every_asset_recorded(table_loc, instance, spark):
    """A table maintained elsewhere (`memwal maintain`, another instance), then a fresh Dagster
    instance: the sensor's first tick records every region's partition of region_generations
    and of base_table (merged before it was seen) and requests one maintenance run; after it,
    no asset of the table is "Missing", and no further maintenance is requested."""
    from dagster import DagsterInstance

    w = make_table(table_loc, regions=2, rounds=1)
    cfg = cfg_for(table_loc)
    td = table_definitions(cfg)
    defs = build_definitions([cfg])
    with DagsterInstance.ephemeral() as elsewhere:  # maintained by someone else's instance
        _drive(defs, td, elsewhere)
    data, cursor = tick(defs, td, instance)
    assert run_requests(data) == []
    data, cursor = tick(defs, td, instance, cursor)  # after the partitions' events are recorded
    reqs = run_requests(data)
    assert [r.job_name for r in reqs] == ["t_maintenance"]
    order = instance.get_dynamic_partitions(td.partitions.name)
    assert sorted(order) == sorted(w.regions.values())
    for short in ("region_generations", "base_table"):
        assert instance.get_materialized_partitions(AssetKey(["t", short])) == set(order), short
    base = instance.fetch_materializations(AssetKey(["t", "base_table"]), limit=1).records[0].asset_materialization
    assert base.metadata["region_value"].value.startswith("bucket=")
    assert base.metadata["merged_generation"].value == table.read_memwal_state(table_loc).merged[base.partition]
    assert defs.resolve_job_def("t_maintenance").execute_in_process(instance=instance, tags=reqs[0].tags).success
    for short in ("base_compaction", "index_catchup", "memwal_index", "garbage"):
        assert instance.fetch_materializations(AssetKey(["t", short]), limit=1).records, short
    data, cursor = tick(defs, td, instance, cursor)
    assert run_requests(data) == []


def _drive(defs, td, instance, ticks: int = 6) -> None:
    """Sensor ticks, each followed by the runs it requested, until it requests nothing."""
    cursor = None
    for _ in range(ticks):
        result, cursor = tick(defs, td, instance, cursor)
        reqs = run_requests(result)
        if not reqs:
            return
        for req in reqs:
            out = defs.resolve_job_def(req.job_name).execute_in_process(
                instance=instance, partition_key=req.partition_key, tags=req.tags)
            assert out.success


def test_merge_through_long_lived_spark_connect_server(table_loc, tmp_path):
    """`spark.master = sc://127.0.0.1:PORT`: run processes are thin clients of one server that
    memwal starts on first use and that stays up for the next run."""
    import socket

    from memwal_core.spark import connect as spark_connect

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = f"sc://127.0.0.1:{port}"
    env = {**os.environ, "MEMWAL_STATE_DIR": str(tmp_path / "state")}
    w = make_table(table_loc, regions=2, rounds=1)
    proc = os.path.join(os.path.dirname(__file__), "procs", "connect_merge.py")
    try:
        for _ in range(2):  # the second run finds the server already up
            out = subprocess.run([sys.executable, proc, table_loc.lance_uri, remote], env=env,
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            assert spark_connect.listening("127.0.0.1", port)
            assert rows(table_loc) == w.expected()
            w.write_round(60)
    finally:
        spark_connect.stop_server(remote, state_dir=tmp_path / "state")


def test_materialize_with_a_hostile_region_merges_indexes_and_collects_the_others(table_loc, instance, spark):
    """A region whose manifest is out of range (current_generation 2^64-1) through Dagster: the
    merge run fails naming it, the others are merged, the index keeps its previous row, GC
    collects the others and leaves it alone."""
    from memwal_core.jobs import snapshot

    w = make_table(table_loc, regions=3, rounds=1)
    td = table_definitions(cfg_for(table_loc))
    regions = sorted(w.regions.values())
    bad, good = regions[0], regions[1:]
    instance.add_dynamic_partitions(td.partitions.name, regions)
    by = {a.key.path[-1]: a for a in td.assets}
    assert materialize([by["memwal_index"]], instance=instance, resources=td.resources).success
    prev = {str(uuid.UUID(bytes=r["region_id"])): r for r in snapshot.read_snapshot(table_loc).to_pylist()}
    m = region.load_latest(table_loc.store, bad)
    msg = region.pb.RegionManifest()
    msg.CopyFrom(m.message)
    msg.current_generation = 2**64 - 1
    table_loc.store.put(layout.manifest_key(bad, m.version), msg.SerializeToString())
    bad_files = {k for k in _files(table_loc) if f"/{bad}/" in f"/{k}"}

    r = materialize([by["base_table"]], instance=instance, resources=td.resources, raise_on_error=False,
                    tags={PARTITION_RANGE_START: regions[0], PARTITION_RANGE_END: regions[-1]})
    said = " ".join(e.user_message for e in instance.all_logs(r.run_id) if e.level >= logging.ERROR)
    assert f"region {bad}" in said and "current_generation = 18446744073709551615 is out of range" in said
    merged = table.read_memwal_state(table_loc).merged
    assert all(merged.get(rid, 0) > 0 for rid in good) and merged.get(bad, 0) == 0
    r = materialize([by["index_catchup"], by["memwal_index"], by["garbage"]], instance=instance,
                    resources=td.resources, raise_on_error=False)
    mats = {e.asset_key.path[-1]: e for e in r.get_asset_materialization_events()}
    idx_md = mats["memwal_index"].event_specific_data.materialization.metadata
    assert "current_generation" in idx_md["region_errors"].value[bad]
    now = {str(uuid.UUID(bytes=r["region_id"])): r for r in snapshot.read_snapshot(table_loc).to_pylist()}
    assert now[bad]["flushed_generations"] == prev[bad]["flushed_generations"]  # kept for readers
    gc_md = mats["garbage"].event_specific_data.materialization.metadata
    assert "current_generation" in gc_md["region_errors"].value[bad]
    assert gc_md["generations_deleted"].value > 0  # the others collected
    assert {k for k in _files(table_loc) if f"/{bad}/" in f"/{k}"} == bad_files  # the bad region untouched


def _files(loc) -> set[str]:
    return {o.key for o in loc.store.list("")}
