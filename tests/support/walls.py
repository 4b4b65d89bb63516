"""What the wall tests (tests/wall/) and the commit-verification tests share: the primary-key
field metadata, a GC that keeps nothing it may delete, merged progress, and a two-region table
with one pending commit whose first region's keys can be written twice behind memwal's back."""

from __future__ import annotations

import lance

from memwal_core.jobs import gc, merge
from memwal_core.state import layout, table
from memwal_core.tools import demo

PK = {b"lance-schema:unenforced-primary-key": b"true"}

# Every age and count at its lowest (the retention floor too): GC collects all it is allowed to.
AGGRESSIVE_GC = gc.GcOptions(manifest_retention=1, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                            cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_retain=1,
                            cleanup_base_versions_floor_seconds=0)


def merged(loc) -> dict[str, int]:
    """Merged progress per region, as the base table records it."""
    return table.read_memwal_state(loc).merged


def append_behind_memwal(loc, ids) -> int:
    """Rows written straight into the base table, bypassing memwal (a key already there is then
    twice); returns the new table version."""
    return lance.write_dataset(demo.rows_table([demo.row(i, 9) for i in ids]), loc.lance_uri, mode="append").version


def two_regions_merged_once(loc, spark) -> demo.Workload:
    """Two bucket regions over a 20-row base table, merged once, then one more round each
    (pending); returns the workload."""
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=3, key_space=20, max_memtable_rows=50)
    w.write_round(40, overwrite=0.0, delete=0.0)
    assert not merge.merge(loc, spark).region_errors
    w.write_round(40, overwrite=0.5, delete=0.0)
    return w


def two_regions_pending(loc, spark) -> tuple[demo.Workload, str, str, set[int]]:
    """`two_regions_merged_once`, planned as one batch (one commit) of both regions. Returns
    the workload, the two regions (`bad` sorts first) and the keys of the first region's
    pending rows."""
    w = two_regions_merged_once(loc, spark)
    plan = merge.plan_merge(loc)
    assert len(plan.pending) == 2 and len(plan.batches) == 1  # both regions in one commit
    bad, good = sorted(plan.pending)
    keys: set[int] = set()
    for g in plan.batches[0].generations:
        if g.region_id == bad:
            gen = lance.dataset(loc.child_uri(layout.generation_dir(bad, g.path, g.generation)))
            keys |= set(gen.to_table(columns=["id"]).column("id").to_pylist())
    return w, bad, good, keys
