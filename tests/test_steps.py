"""The core step runner (`memwal_core.steps.run_step`) and its `StepOutcome`, without Dagster:
a dry run plans every step and changes nothing; a held lease skips a step (not a failure); a
step that raises fails in one line; a merge that leaves a region behind names it with the one
failure type; and the failures the Dagster layer tags its runs with read back, old tags too.

Real pylance tables and the test session's local Spark.
"""

from __future__ import annotations

import json

import pyarrow as pa
from support.helpers import plant_generation, tree

from memwal_core.failures import RegionFailure
from memwal_core.options import LeaseOptions
from memwal_core.state import lease, table
from memwal_core.steps import STEPS, StepOptions, StepStatus, run_step
from memwal_core.tools import demo
from memwal_pipeline import failures


def _table(loc, regions: int = 2) -> demo.Workload:
    demo.create_table(loc, sharding="bucket", num_buckets=regions, base_rows=10, btree_index=True)
    w = demo.Workload(loc, seed=4, key_space=60, max_memtable_rows=15)
    w.write_round(40, puts_per_batch=10)
    return w


def test_a_dry_run_plans_every_step_and_changes_nothing(table_loc):
    _table(table_loc)
    before = tree(table_loc.lance_uri)
    outcomes = [run_step(step, table_loc, StepOptions(), execute=False) for step in STEPS]
    assert tree(table_loc.lance_uri) == before
    by = {o.step: o for o in outcomes}
    assert [o.step for o in outcomes] == list(STEPS)
    assert all(not o.executed and not o.failed and o.error is None for o in outcomes), outcomes
    assert by["merge"].status is StepStatus.PLANNED and by["merge"].metrics["generations_planned"] > 0
    assert by["merge"].plan.batches and by["merge"].result is None
    report = json.loads(json.dumps([o.to_dict() for o in outcomes], default=str))
    assert all(d["schema_version"] == 2 and d["ok"] and not d["executed"] for d in report)
    assert report[0]["plan"]["batches"] and report[0]["status"] == "planned"


def test_a_held_lease_skips_the_step_and_is_not_a_failure(table_loc):
    _table(table_loc)
    version = table.open_dataset(table_loc).version
    other = lease.acquire(table_loc, "merge", LeaseOptions(ttl_seconds=120, wait_seconds=0), run_id="other-run")
    try:
        o = run_step("index", table_loc, StepOptions(lease=LeaseOptions(wait_seconds=0)), run_id="mine")
    finally:
        other.release()
    assert o.status is StepStatus.SKIPPED and not o.failed and o.executed
    assert o.error.startswith("lease held by ") and "(merge, run other-run)" in o.error
    assert table.open_dataset(table_loc).version == version
    o = run_step("index", table_loc)  # released: the snapshot commits
    assert o.status is StepStatus.OK and o.metrics["committed"] == 1
    assert table.open_dataset(table_loc).version == version + 1


def test_a_step_that_raises_fails_with_one_line_and_keeps_the_error(table_loc):
    """A plain Lance table (no MemWAL index): every step fails with memwal's own message, in one
    line, and the exception as raised for a caller that re-raises it."""
    import lance

    lance.write_dataset(demo.rows_table([demo.row(i, 0) for i in range(5)]), table_loc.lance_uri,
                        schema=demo.SCHEMA)
    for step in ("compact", "catchup", "index", "gc"):
        o = run_step(step, table_loc)
        assert o.status is StepStatus.FAILED and o.failed, o
        assert "has no MemWAL index" in o.error and "\n" not in o.error, o.error
        assert isinstance(o.exception, table.MemWalNotInitialized)
        assert o.problems == [o.error]
    # A dry run that cannot plan fails too (a refusal would not).
    assert run_step("gc", table_loc, execute=False).failed


def test_a_merge_that_leaves_a_region_behind_names_it(table_loc, spark):
    """One region's next generation has columns the base table lacks: the merge merges the other
    region, ends PARTIAL, and the outcome's failure names region, generation and permanence."""
    w = _table(table_loc)
    victim = sorted(w.regions.values())[0]
    wrong = pa.table({"id": pa.array([1], pa.int64()), "other": pa.array(["x"]), "_tombstone": pa.array([False])})
    bad = plant_generation(table_loc, victim, wrong)
    o = run_step("merge", table_loc, StepOptions(), lambda: spark)
    assert o.status is StepStatus.PARTIAL and o.failed and o.executed
    (f,) = o.failures
    assert (f.region_id, f.generation, f.permanent, f.step) == (victim, bad, True, "merge")
    assert "columns differ" in f.reason
    assert o.problems[0].startswith(f"region {victim}: ") and "columns differ" in o.problems[0]
    assert o.metrics["generations_merged"] > 0 and o.metrics["regions_failed"] == 1
    assert o.to_dict()["failures"][0]["region"] == victim
    assert table.read_memwal_state(table_loc).merged[victim] == bad - 1


def test_run_tags_hold_the_one_failure_type_and_old_tags_still_read():
    f = RegionFailure("r1", 7, "region r1: generation 7: " + "x" * 1000, True, "merge", 3)
    (back,) = [failures.from_tag(d) for d in json.loads(failures.run_tags([f])[failures.FAILURES_TAG])]
    assert (back.region_id, back.generation, back.permanent, back.offending_rows) == ("r1", 7, True, 3)
    assert back.reason == f.reason[:failures.MAX_ERROR_CHARS]
    old = failures.from_tag({"r": "r2", "g": 4, "p": None, "e": "region r2: unreadable"})
    assert old == RegionFailure("r2", 4, "region r2: unreadable", False)
    stuck = failures.stuck_regions({"r1": failures.RegionHistory([back], ["run"])}, {"r1": 6})
    assert [s.describe() for s in stuck] == [f"region r1 at generation 7: permanent merge refusal: generation 7: "
                                             f"{'x' * (failures.MAX_ERROR_CHARS - len('region r1: generation 7: '))}"]
