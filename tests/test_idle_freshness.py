"""An idle table reads fresh: the manifest sensor records that its base table is current
(`memwal_pipeline/freshness.py`), and Dagster's own freshness daemon evaluates base_table's
policy on what the sensor recorded. A table with generations waiting gets no such record.
Real tables, real sensor ticks, Dagster's freshness daemon (its clock set by Dagster's
`freeze_time`, as a test cannot wait out a freshness window)."""

from __future__ import annotations

import time

import pytest
from dagster import AssetKey
from dagster._core.definitions.freshness import FreshnessState
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.test_utils import InProcessTestWorkspaceLoadTarget, freeze_time, instance_for_test
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._daemon.freshness import FreshnessDaemon
from support.sensor_ticks import run_requests, tick
from support.tables import cfg_for

from memwal_core.options import SloOptions
from memwal_core.tools import demo
from memwal_pipeline.definitions import build_definitions, table_definitions
from memwal_pipeline.freshness import IDLE_RECORD, is_idle_record, refresh_seconds

BASE = AssetKey(["t", "base_table"])
SLO = 120.0  # the freshness window; the sensor records an idle table every 60 s


@pytest.fixture
def instance(tmp_path):
    """An instance on disk: the freshness daemon's workspace hands it to its code location."""
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home")) as inst:
        yield inst


def _freshness(instance, defs_file) -> FreshnessState:
    """base_table's freshness as Dagster's freshness daemon evaluates it, on its clock."""
    target = InProcessTestWorkspaceLoadTarget(InProcessCodeLocationOrigin(
        LoadableTargetOrigin(python_file=str(defs_file), attribute="defs"), location_name="memwal"))
    with WorkspaceProcessContext(instance, target) as ctx:
        list(FreshnessDaemon().run_iteration(ctx))
    return instance.get_freshness_state_records([BASE])[BASE].freshness_state


def _defs_file(tmp_path, loc):
    f = tmp_path / "defs_file.py"
    f.write_text("from memwal_core.options import SloOptions\n"
                 "from memwal_pipeline.config import TableConfig\n"
                 "from memwal_pipeline.definitions import build_definitions\n"
                 f"defs = build_definitions([TableConfig(name='t', uri={loc.lance_uri!r}, "
                 f"slo=SloOptions(merge_lag_seconds={SLO}))])\n")
    return f


def _records(instance):
    return instance.fetch_materializations(BASE, limit=100).records


def test_idle_table_reads_fresh_and_gets_no_maintenance_per_record(table_loc, instance, tmp_path):
    demo.create_table(table_loc, sharding="bucket", num_buckets=3, base_rows=10)  # nobody writes
    cfg = cfg_for(table_loc, slo=SloOptions(merge_lag_seconds=SLO))
    assert refresh_seconds(cfg) == SLO / 2
    td, defs = table_definitions(cfg), build_definitions([cfg])
    defs_file = _defs_file(tmp_path, table_loc)
    t0 = time.time()

    with freeze_time(t0):
        data, cursor = tick(defs, td, instance, now=t0)
    # The first tick: the table is current (nothing to merge), and this instance never maintained
    # it: one maintenance run (the first one), and no idle record on the same tick.
    assert [r.job_name for r in run_requests(data)] == ["t_maintenance"]
    assert _records(instance) == []
    with freeze_time(t0 + 1):
        data, cursor = tick(defs, td, instance, cursor, now=t0 + 1)
    assert run_requests(data) == []
    [rec] = _records(instance)
    assert rec.asset_materialization.partition is None and is_idle_record(rec.asset_materialization)
    assert rec.asset_materialization.metadata["recorded_by"].value == IDLE_RECORD
    with freeze_time(t0 + 2):
        assert _freshness(instance, defs_file) == FreshnessState.PASS

    # Within half the window: nothing more is recorded (no event every tick).
    with freeze_time(t0 + 30):
        data, cursor = tick(defs, td, instance, cursor, now=t0 + 30)
    assert len(_records(instance)) == 1 and run_requests(data) == []

    # Past the window without a tick: late, as Dagster measures it (what a sensor that is off shows).
    with freeze_time(t0 + SLO + 5):
        assert _freshness(instance, defs_file) == FreshnessState.FAIL
        data, cursor = tick(defs, td, instance, cursor, now=t0 + SLO + 5)
        # The sensor records the idle table as current again: fresh, and still no maintenance run
        # (a record is not a merge; the watermark moved past the first one).
        assert run_requests(data) == []
        assert len(_records(instance)) == 2
        assert _freshness(instance, defs_file) == FreshnessState.PASS
    with freeze_time(t0 + SLO + 10):
        data, cursor = tick(defs, td, instance, cursor, now=t0 + SLO + 10)
    assert run_requests(data) == [] and len(_records(instance)) == 2


def test_table_with_unmerged_generations_gets_no_idle_record(table_loc, instance):
    demo.create_table(table_loc, sharding="bucket", num_buckets=2, base_rows=10)
    w = demo.Workload(table_loc, seed=3, key_space=100, max_memtable_rows=20)
    w.write_round(40, overwrite=0.2, delete=0.0, puts_per_batch=10)  # flushed, not merged
    cfg = cfg_for(table_loc, slo=SloOptions(merge_lag_seconds=SLO))
    td, defs = table_definitions(cfg), build_definitions([cfg])
    t0 = time.time()
    cursor = None
    for dt in (0, 1, SLO, 2 * SLO):
        data, cursor = tick(defs, td, instance, cursor, now=t0 + dt)
        assert any(r.job_name == "t_merge" for r in run_requests(data)) or dt > 0
    assert not any(is_idle_record(r.asset_materialization) for r in _records(instance))
