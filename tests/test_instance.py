"""The Dagster instance of `make ui` (dagster_home/dagster.yaml), loaded as Dagster loads it.

All state under DAGSTER_HOME whatever the working directory, tick retention set; a fresh
instance holds runs of one table in the queue from the very first dequeue pass (the queued-run
daemon's own selection logic, on a real SQLite instance).
"""

from __future__ import annotations

import os
import shutil

import pytest
from dagster import DagsterEvent, DagsterEventType, DagsterInstance, DagsterRunStatus

# Private on purpose, no public equivalent in dagster 1.13: this file drives the queued-run
# daemon's own dequeue logic and reads instance tick records, which need code-location origins,
# instigator/tick types and the daemon class.
from dagster._core.definitions.run_request import InstigatorType
from dagster._core.remote_origin import InProcessCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.scheduler.instigation import TickStatus
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

from memwal_pipeline.assets import TableKeys
from memwal_pipeline.config import single_table
from memwal_pipeline.definitions import build_definitions
from memwal_pipeline.tags import PARTITION_RANGE_END, PARTITION_RANGE_START

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YAML = os.path.join(REPO, "dagster_home", "dagster.yaml")


@pytest.fixture
def home_elsewhere(tmp_path, monkeypatch):
    """A copy of the repo's dagster.yaml as DAGSTER_HOME; the process runs in another directory."""
    home, cwd = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    cwd.mkdir()
    shutil.copy(YAML, home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.chdir(cwd)
    return home, cwd


def _queued(instance, job, tags, job_tags: bool = True):
    origin = InProcessCodeLocationOrigin(LoadableTargetOrigin(module_name="memwal_pipeline.definitions"),
                                         location_name="memwal")
    return instance.create_run_for_job(
        job, status=DagsterRunStatus.QUEUED, tags={**(job.tags if job_tags else {}), **tags},
        remote_job_origin=RemoteJobOrigin(RemoteRepositoryOrigin(origin, "__repository__"), job.name))


def test_instance_state_stays_under_dagster_home(home_elsewhere):
    home, cwd = home_elsewhere
    with DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("p", ["a"])
        instance.get_runs()
        assert instance.get_dynamic_partitions("p") == ["a"]
    assert os.listdir(cwd) == [], "the instance wrote into the working directory"
    assert {"history", "schedules"} <= set(os.listdir(home))
    # A second process started from yet another directory sees the same instance.
    os.chdir(home)
    with DagsterInstance.get() as instance:
        assert instance.get_dynamic_partitions("p") == ["a"]


def test_tick_retention_is_configured(home_elsewhere):
    with DagsterInstance.get() as instance:
        sensor = instance.get_tick_retention_settings(InstigatorType.SENSOR)
        schedule = instance.get_tick_retention_settings(InstigatorType.SCHEDULE)
    # Dagster's defaults keep sensor successes and every schedule tick forever (-1).
    assert all(days > 0 for days in sensor.values()), sensor
    assert all(days > 0 for days in schedule.values()), schedule
    assert sensor[TickStatus.SKIPPED] <= 7 and sensor[TickStatus.FAILURE] >= 30


def test_fresh_instance_holds_runs_of_one_table_from_the_first_run(home_elsewhere):
    """A range merge, two manual merges and a maintenance run queued on a fresh instance: the
    daemon's first pass launches one; nothing more while it runs; the next after it ends."""
    cfgs = [single_table("/nonexistent/t1", name="t1"), single_table("/nonexistent/t2", name="t2")]
    defs = build_definitions(cfgs)
    daemon = QueuedRunCoordinatorDaemon(interval_seconds=1)
    with DagsterInstance.get() as instance:
        config = instance.get_concurrency_config()
        merge, maint = defs.resolve_job_def("t1_merge"), defs.resolve_job_def("t1_maintenance")
        instance.add_dynamic_partitions(TableKeys("t1").partitions, ["a", "b", "c"])
        runs = [_queued(instance, merge, {PARTITION_RANGE_START: "a", PARTITION_RANGE_END: "c"}),
                _queued(instance, merge, {"dagster/partition": "a"}),
                _queued(instance, merge, {"dagster/partition": "b"}),
                _queued(instance, maint, {})]
        other = _queued(instance, defs.resolve_job_def("t2_maintenance"), {})
        assert runs[0].run_op_concurrency.all_pools == {"memwal_t1"}

        first = daemon._get_runs_to_dequeue(instance, config, None)
        # One run of t1 (the oldest) and the run of the other table, whose pool is its own.
        assert sorted(r.run_id for r in first) == sorted([runs[0].run_id, other.run_id])

        for r in first:
            instance.run_storage.handle_run_event(r.run_id, _event(r, "PIPELINE_STARTING"))
        assert daemon._get_runs_to_dequeue(instance, config, None) == []

        instance.run_storage.handle_run_event(runs[0].run_id, _event(runs[0], "PIPELINE_SUCCESS"))
        second = daemon._get_runs_to_dequeue(instance, config, None)
        assert [r.run_id for r in second] == [runs[1].run_id]


def test_pool_alone_holds_untagged_runs_once_initialized(home_elsewhere):
    """A run without the table tag (an asset materialized from the UI's asset graph) is held by
    the pool (run granularity) once Dagster has created the pool's default limit."""
    defs = build_definitions([single_table("/nonexistent/t1", name="t1")])
    daemon = QueuedRunCoordinatorDaemon(interval_seconds=1)
    with DagsterInstance.get() as instance:
        config = instance.get_concurrency_config()
        instance.event_log_storage.initialize_concurrency_limit_to_default("memwal_t1")
        maint = defs.resolve_job_def("t1_maintenance")
        a = _queued(instance, maint, {}, job_tags=False)
        b = _queued(instance, maint, {}, job_tags=False)
        first = daemon._get_runs_to_dequeue(instance, config, None)
        assert [r.run_id for r in first] == [a.run_id]
        instance.run_storage.handle_run_event(a.run_id, _event(a, "PIPELINE_STARTING"))
        assert daemon._get_runs_to_dequeue(instance, config, None) == []
        assert instance.get_run_by_id(b.run_id).status == DagsterRunStatus.QUEUED


def _event(run, kind: str):
    return DagsterEvent(DagsterEventType(kind).value, job_name=run.job_name)


def test_an_instance_without_memwal_settings_serializes_one_tables_runs(tmp_path, monkeypatch, caplog):
    """A Dagster instance of one's own (a dagster.yaml without `concurrency:`): loading the
    definitions warns that the table's pool is unlimited; the sensor's first tick gives it the
    shipped limit (1); then a maintenance run of the table waits while another run of the same
    table holds the pool's slot, and starts once it is freed (Dagster's own op-concurrency)."""
    import logging
    import threading
    import time

    from support.sensor_ticks import tick
    from support.tables import cfg_for, make_table

    from memwal_core.state.store import open_store
    from memwal_pipeline import pools
    from memwal_pipeline.definitions import table_definitions

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    loc = open_store(str(tmp_path / "table"))
    make_table(loc, regions=2, rounds=1)
    cfg = cfg_for(loc)
    with caplog.at_level(logging.WARNING, logger="memwal.pools"):
        defs = build_definitions([cfg])
    (said,) = [r.getMessage() for r in caplog.records if r.name == "memwal.pools"]
    assert "does not limit the pool(s) memwal_t" in said and "default_limit: 1" in said, said
    td = table_definitions(cfg)
    with DagsterInstance.get() as instance:
        assert instance.get_concurrency_config().pool_config.default_pool_limit is None  # Dagster's default
        assert pools.pool_limits(instance, ["memwal_t"])[0].limit is None
        tick(defs, td, instance)
        assert pools.pool_limits(instance, ["memwal_t"]) == [pools.PoolLimit("memwal_t", 1, "pool")]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="memwal.pools"):
            build_definitions([cfg])
        assert not [r for r in caplog.records if r.name == "memwal.pools"]
        # A limit set by the operator is never changed.
        instance.event_log_storage.set_concurrency_slots("memwal_t", 2)
        tick(defs, td, instance)
        assert pools.pool_limits(instance, ["memwal_t"])[0].limit == 2
        instance.event_log_storage.set_concurrency_slots("memwal_t", 1)

        # Another run of the table holds the slot: the maintenance run's steps wait for it.
        assert instance.event_log_storage.claim_concurrency_slot("memwal_t", "other-run", "t__base_table").is_claimed
        job = defs.resolve_job_def("t_maintenance")
        result = {}
        worker = threading.Thread(target=lambda: result.update(out=job.execute_in_process(instance=instance)))
        worker.start()
        time.sleep(8)
        (run,) = instance.get_runs()
        pooled = {"t__base_compaction", "t__index_catchup", "t__memwal_index", "t__garbage"}

        def pooled_starts() -> list[float]:
            return [e.timestamp for e in instance.all_logs(run.run_id)
                    if e.dagster_event and e.dagster_event.is_step_start and e.step_key in pooled]

        assert pooled_starts() == [] and worker.is_alive()
        freed_at = time.time()
        instance.event_log_storage.free_concurrency_slots_for_run("other-run")
        worker.join(300)
        assert not worker.is_alive() and result["out"].success
        starts = pooled_starts()
        assert len(starts) == len(pooled) and min(starts) >= freed_at
