"""GC's dry-run plan is made as if the base-table cleanup had run, so it is never executed.

`run_gc(dry_run=True)` exposes `result.plan`, a `GcPlan` built "as if" Lance's cleanup had
removed the old base-table versions. Those versions are still there: executing that plan
would delete generations a retained base version can still time-travel to, so `execute_gc`
refuses a plan made for a dry run.
"""

from __future__ import annotations

import time

import lance
import pytest
from support.helpers import tree

from memwal_core.jobs import gc, merge, snapshot
from memwal_core.state.store import open_store
from memwal_core.tools import demo


def test_a_dry_run_plan_is_refused_by_execute_gc(tmp_path, spark):
    root = str(tmp_path / "t")
    loc = open_store(root)
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=5, key_space=120, max_memtable_rows=20)
    for _ in range(3):
        w.write_round(40, overwrite=0.3, puts_per_batch=10)
        assert not merge.merge(loc, spark).region_errors
        snapshot.build_snapshot(loc)
    newest = max(v["timestamp"].timestamp() for v in lance.dataset(root).versions())
    time.sleep(max(0.0, newest + 1.5 - time.time()))
    cfg = gc.GcOptions(cleanup_base_versions_floor_seconds=0, cleanup_base_versions_older_than_seconds=1,
                       manifest_min_age_seconds=0)
    dry = gc.run_gc(loc, cfg, dry_run=True)
    now_plan = gc.plan_gc(loc, gc.GcOptions(manifest_min_age_seconds=0))  # the versions are still retained
    as_if = {i.path for i in dry.plan.items if i.kind == gc.GENERATION}
    today = {i.path for i in now_plan.items if i.kind == gc.GENERATION}
    assert as_if - today, "the dry run frees no generation beyond today's plan: nothing to show"
    before = tree(root)
    with pytest.raises(gc.GcError):
        gc.execute_gc(loc, dry.plan)
    assert tree(root) == before
