"""Dagster idioms of the asset graph: the freshness policy on base_table, readable
region partitions (`region_value`), per-index catch-up state (`index_catchup` partitioned by
base-table index, kept current by the sensor), the partition-range tags checked through
Dagster's public API, and why resources stay per-table keys. Real tables, real Dagster."""

from __future__ import annotations

from datetime import timedelta

import pytest
from dagster import (
    AssetKey,
    ConfigurableResource,
    DagsterInstance,
    DagsterInvalidDefinitionError,
    Definitions,
    MaterializeResult,
    PartitionKeyRange,
    RunRequest,
    asset,
    build_schedule_context,
)
from support.sensor_ticks import run_requests, tick
from support.tables import cfg_for, make_table

from memwal_core.options import SloOptions
from memwal_core.state import table
from memwal_core.tools import demo
from memwal_pipeline.definitions import build_definitions, table_definitions
from memwal_pipeline.partitions import (
    NOT_RECORDED,
    UNSHARDED,
    RegionLabels,
    format_value,
)
from memwal_pipeline.tags import partition_range


@pytest.fixture
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def test_partition_range_tags_are_the_ones_dagster_reads():
    """The tag names memwal writes by hand are the ones Dagster turns into a partition range."""
    assert RunRequest(tags=partition_range("a", "b")).partition_key_range == PartitionKeyRange("a", "b")


def test_base_table_freshness_from_merge_lag_slo(table_loc):
    for slo, window in ((600.0, 600.0), (5.0, 60.0)):  # Dagster's smallest window is one minute
        cfg = cfg_for(table_loc, slo=SloOptions(merge_lag_seconds=slo))
        defs = build_definitions([cfg])
        specs = {s.key: s for s in defs.resolve_all_asset_specs()}
        policy = specs[AssetKey(["t", "base_table"])].freshness_policy
        assert policy is not None and policy.fail_window.to_timedelta() == timedelta(seconds=window)
        assert specs[AssetKey(["t", "garbage"])].freshness_policy is None


class Res(ConfigurableResource):
    uri: str


def test_per_table_resource_keys_are_required():
    """Why assets use `required_resource_keys`: a typed parameter's name is its key, and two
    tables binding the same key to different values is refused, even asset by asset."""

    def build(name: str):
        @asset(key=[name, "x"], resource_defs={"table": Res(uri=name)})
        def x(table: Res) -> MaterializeResult:
            return MaterializeResult(metadata={"uri": table.uri})

        return x

    with pytest.raises(DagsterInvalidDefinitionError, match="Conflicting versions of resource with key 'table'"):
        Definitions(assets=[build("a"), build("b")]).resolve_implicit_global_asset_job_def()


def test_region_labels():
    assert format_value({"bucket": 3}) == "bucket=3"
    assert format_value({"b": "x", "a": 1}) == "a=1, b=x"
    labels = RegionLabels({"r1": {"bucket": 2}})
    assert labels.label("r1") == "bucket=2" and labels.label("r2") == NOT_RECORDED
    assert RegionLabels({}, unsharded=True).label("r9") == UNSHARDED


def test_index_partitions_region_values_and_per_index_catchup(table_loc, instance, spark):
    """The sensor keeps one `index_catchup` partition per base-table index and runs maintenance
    over all of them; each records its own gap; a new index gets a partition, a dropped one
    loses it; region observations carry the region's value."""
    w = make_table(table_loc, regions=3)
    cfg = cfg_for(table_loc)
    td = table_definitions(cfg)
    defs = build_definitions([cfg])
    idx_key = AssetKey(["t", "index_catchup"])

    evaluations = []

    def drive(cursor, ticks=4):
        """Ticks, each followed by the runs it requested; the maintenance requests' tags."""
        maint_tags = []
        for _ in range(ticks):
            result, cursor = tick(defs, td, instance, cursor)
            reqs = run_requests(result)
            if not reqs:
                break
            for req in reqs:
                if req.job_name == "t_maintenance":
                    maint_tags.append(dict(req.tags))
                out = defs.resolve_job_def(req.job_name).execute_in_process(
                    instance=instance, partition_key=req.partition_key, tags=req.tags)
                assert out.success
                evaluations.extend(out.get_asset_check_evaluations())
        return cursor, maint_tags

    cursor, maint = drive(None)
    assert instance.get_dynamic_partitions(td.index_partitions.name) == ["id_btree"]
    assert maint and maint[-1]["dagster/asset_partition_range_start"] == "id_btree"
    rec = instance.fetch_materializations(idx_key, limit=1).records[0]
    mat = rec.asset_materialization
    assert mat.partition == "id_btree"
    md = mat.metadata
    assert md["gating"].value is True and md["caught_up"].value is True and md["gap"].value == 0
    assert md["exists"].value is True and "region_gaps" in md and md["run/indexes"].value == 1
    assert instance.get_materialized_partitions(idx_key) == {"id_btree"}

    # A flush in one region: its materialization names its value (the snapshot knows it by now).
    value, rid = min(w.regions.items())
    keys = [k for k in range(300, 600) if w.region_value([k])[0] == value][:3]
    with w.dataset().mem_wal_writer(rid) as writer:
        writer.put(demo.rows_table([demo.row(k, 9) for k in keys]))
    # A second index appears, the first one is dropped: the next maintenance request follows.
    ds = table.open_dataset(table_loc)
    ds.create_scalar_index("n", "BTREE", name="n_btree")
    table.open_dataset(table_loc).drop_index("id_btree")
    cursor, maint = drive(cursor)
    obs = instance.fetch_materializations(AssetKey(["t", "region_generations"]), limit=20).records
    mine = [o.asset_materialization for o in obs if o.asset_materialization.partition == rid]
    assert mine and mine[0].metadata["region_value"].value == f"bucket={value}"
    assert instance.get_dynamic_partitions(td.index_partitions.name) == ["n_btree"]
    assert maint and maint[-1]["dagster/asset_partition_range_end"] == "n_btree"
    assert instance.get_materialized_partitions(idx_key) >= {"n_btree"}
    rec = instance.fetch_materializations(idx_key, limit=1).records[0].asset_materialization
    assert rec.partition == "n_btree" and rec.metadata["gap"].value == 0
    assert rec.metadata["gating"].value is True  # maintain_all_indexes: every index gates GC
    # The merged region's own materialization names its value too.
    base = instance.fetch_materializations(AssetKey(["t", "base_table"]), limit=1).records[0].asset_materialization
    assert base.partition == rid and base.metadata["region_value"].value == f"bucket={value}"
    # catchup_gap reports per index.
    ev = [e for e in evaluations if e.check_name == "catchup_gap"][-1]
    assert ev.passed and ev.metadata["gap/n_btree"].value == 0 and "gap/id_btree" not in ev.metadata



def test_maintenance_schedule_spans_index_partitions(table_loc, tmp_path):
    td = table_definitions(cfg_for(table_loc))
    with DagsterInstance.local_temp(str(tmp_path)) as inst:  # a schedule context needs an instance ref
        # Each context is closed: its `instance` is a second instance opened from `inst`'s ref,
        # which would otherwise stay open (SQLite connections, Dagster's current defs-state
        # storage) until garbage collection, in whatever test runs then.
        with build_schedule_context(instance=inst) as ctx:
            (req,) = td.schedule.evaluate_tick(ctx).run_requests
        assert req.partition_key_range is None  # no index partition yet: a table-wide record
        inst.add_dynamic_partitions(td.index_partitions.name, ["a_idx", "b_idx"])
        with build_schedule_context(instance=inst) as ctx:
            (req,) = td.schedule.evaluate_tick(ctx).run_requests
        assert req.partition_key_range == PartitionKeyRange("a_idx", "b_idx")


def test_status_shows_each_regions_value_and_lag(table_loc):
    """`memwal status` (a subprocess, as a person runs it) shows each region's value next to
    its id and a lag column: the age of its oldest unmerged generation."""
    import os
    import subprocess
    import sys

    from memwal_core.jobs import snapshot
    from support.tables import make_table

    w = make_table(table_loc, regions=2, rounds=1)
    snapshot.build_snapshot(table_loc)  # records the region values
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    out = subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", "status", table_loc.lance_uri],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("region "))
    assert header.split() == ["region", "value", "manifest", "epoch", "merged", "pending", "rows", "lag"], header
    for value, rid in w.regions.items():
        (row,) = [ln for ln in lines if ln.startswith(rid)]
        cells = row.split()
        assert cells[1] == f"bucket={value}", row
        assert cells[-1].endswith(("s", "m", "h", "d")) and cells[-1] != "-", row  # pending: a lag


def test_single_region_merge_run_carries_the_region_value(table_loc, instance):
    """Region partitions stay keyed by UUID (`partitions.py` says why); a merge run over one
    region names its value in a tag the runs list shows, read from the MemWAL index snapshot."""
    from memwal_core.jobs import snapshot
    from memwal_pipeline.tags import REGION_VALUE_TAG

    w = make_table(table_loc, regions=1, rounds=1)
    snapshot.build_snapshot(table_loc)  # records the region's value
    cfg = cfg_for(table_loc)
    td, defs = table_definitions(cfg), build_definitions([cfg])
    data, _ = tick(defs, td, instance)
    (req,) = [r for r in run_requests(data) if r.job_name == "t_merge"]
    ((value, rid),) = w.regions.items()
    assert req.partition_key == rid  # the key: the region's UUID
    assert req.tags[REGION_VALUE_TAG] == f"bucket={value}" and req.tags["memwal/region"] == rid
