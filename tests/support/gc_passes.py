"""Helpers for GC passes over a history without Spark (tests/test_gc_summaries.py and
bench/gc_history.py): a commit that records generations as merged, and forgetting what this
process learned, as every GC run in a new process would; and the plans' comparison with a full
read (tests/test_gc_summaries.py, test_gc_generation_list.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

import pyarrow as pa
from lance.mem_wal import CompactedSsTable

from memwal_core.jobs import gc
from memwal_core.jobs.gc import leaks
from memwal_core.state import lifecycle, region, table
from memwal_core.state.store import open_store
from memwal_core.tools import demo


def mark_merged(loc, regions: Iterable[str]) -> None:
    """One commit recording every flushed generation of `regions` as merged (the merger's
    bookkeeping, without rows)."""
    ds = table.open_dataset(loc)
    merged = table.read_memwal_state(loc, ds.version).merged
    marks = [CompactedSsTable(rid, g) for rid in sorted(regions)
             if (g := region.load_latest(loc.store, rid).current_generation - 1) > merged.get(rid, 0)]
    if marks:
        empty = pa.table({f.name: pa.array([], f.type) for f in ds.schema}, schema=ds.schema)
        ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all() \
            .mark_sstables_as_compacted(marks).execute(empty)


def forget_process() -> None:
    """A new process: nothing learned in memory."""
    leaks._REFS.clear()
    lifecycle._SEEN.clear()


# GC that collects: every base version but the newest few cleaned up, manifests and leaks at any age.
COLLECT = gc.GcOptions(cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0,
                       cleanup_base_versions_retain=3, manifest_retention=2, manifest_min_age_seconds=0,
                       orphan_grace_seconds=0, leaked_file_grace_seconds=0)
KEEP = gc.GcOptions()  # the shipped retention: nothing is old enough, every version holds its generations
KEEP_SCANNING = gc.GcOptions(full_scan_interval_seconds=0)  # and every pass a full scan


def new_table(path: str, regions: int = 2):
    loc = open_store(path)
    demo.create_table(loc, sharding="bucket", num_buckets=regions, base_rows=20)
    return loc, demo.Workload(loc, seed=5, key_space=10**6, max_memtable_rows=1000)


def decision(plan: gc.GcPlan) -> dict:
    return {"items": sorted(json.dumps(i.to_dict(), sort_keys=True) for i in plan.items),
            "kept": dict(plan.kept), "limits": {r: p.limit for r, p in plan.regions.items()},
            "retained": plan.retained_versions, "holds": plan.holds, "errors": plan.region_errors}


def assert_same_decision(loc, config: gc.GcOptions) -> gc.GcPlan:
    """The plan with what earlier passes learned equals the plan that reads everything again, when
    it lists the table (a full scan: `full_scan_interval_seconds` passed); between full scans
    (versions probed, no leak scan) it deletes no more (`assert_keeps_more`)."""
    now = time.time()
    forget_process()
    between = gc.plan_gc(loc, config, now=now)
    forget_process()
    cached = gc.plan_gc(loc, config, now=now, full_scan=True)
    forget_process()
    full = gc.plan_gc(loc, config, now=now, use_summary=False)
    assert decision(cached) == decision(full)
    assert_keeps_more(between, full)
    return cached


def assert_keeps_more(between: gc.GcPlan, full: gc.GcPlan) -> None:
    """A plan made between full scans keeps at least what a full read keeps: every version the
    full read retains, limits no higher, a subset of its items (no leaked file without a scan);
    with the same versions, the same decision on the regions."""
    assert set(between.retained_versions) >= set(full.retained_versions)
    assert all(between.regions[r].limit <= p.limit for r, p in full.regions.items() if not p.error)
    # Orphans only where the sweep was due (once per interval, as the leak scan).
    unswept = {r for r, p in between.regions.items() if not p.orphans_swept}
    regional = lambda plan: {json.dumps(i.to_dict(), sort_keys=True) for i in plan.items  # noqa: E731
                             if i.kind != "leaked" and not (i.kind == gc.ORPHAN and i.region_id in unswept)}
    assert regional(between) <= regional(full)
    assert not any(i.kind == gc.ORPHAN and i.region_id in unswept for i in between.items)
    assert {i.path for i in between.leaked} <= {i.path for i in full.leaked}
    if between.retained_versions == full.retained_versions:
        assert regional(between) == regional(full) and between.holds == full.holds
    if between.leak_scan.get("skipped"):
        assert not between.leaked


def history_table(tmp_path, cycles: int = 3, merge: bool = True):
    """A table with `cycles` rounds of flushes (each recorded merged), and one GC pass that wrote
    the summaries."""
    loc, w = new_table(str(tmp_path / "t"))
    for _ in range(cycles):
        w.write_round(12, puts_per_batch=50)
        if merge:
            mark_merged(loc, w.regions.values())
    forget_process()
    gc.run_gc(loc, KEEP)  # writes the summaries
    return loc, w
