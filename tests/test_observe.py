"""`status.observe_regions`: the one call a watcher (the manifest sensor) makes to learn which
regions moved, on real pylance tables: cheap on unchanged regions, a broken region reported
and the others observed."""

from __future__ import annotations

from memwal_core.observe import status
from memwal_core.state import layout, region, table
from memwal_core.tools import demo


def _table(loc, regions=3):
    demo.create_table(loc, sharding="bucket", num_buckets=regions, base_rows=20)
    w = demo.Workload(loc, seed=3, key_space=200, max_memtable_rows=50)
    w.write_round(90, overwrite=0.3, delete=0.05, puts_per_batch=10)
    return w


class _Merged:
    """Merge progress as the caller reads it, counting the reads."""

    def __init__(self, loc):
        self.loc, self.calls = loc, 0

    def __call__(self):
        self.calls += 1
        return table.read_memwal_state(self.loc).merged


def test_first_look_reads_every_region_then_unchanged_regions_cost_one_head(table_loc):
    _table(table_loc)
    rids = region.list_regions(table_loc.store).region_ids
    merged = _Merged(table_loc)
    first = status.observe_regions(table_loc, dict.fromkeys(rids), merged)
    assert set(first) == set(rids) and merged.calls == 1
    for rid, o in first.items():
        latest = region.load_latest(table_loc.store, rid)
        assert o.ok and o.changed and o.version == latest.version
        assert o.status.region_id == rid and o.status.flushed_generations == [g.generation for g in latest.generations]
        assert o.status.pending_generations  # nothing merged yet

    known = {rid: o.version for rid, o in first.items()}
    table_loc.store.stats.clear()
    again = status.observe_regions(table_loc, known, merged)
    assert merged.calls == 1  # nothing moved: progress is not read
    assert all(o.ok and not o.changed and o.version == known[rid] for rid, o in again.items())
    assert table_loc.store.stats["head"] == len(rids) and not table_loc.store.stats["get"]


def test_a_moved_region_is_read_at_its_new_version(table_loc):
    w = _table(table_loc)
    rids = region.list_regions(table_loc.store).region_ids
    known = {rid: region.load_latest(table_loc.store, rid).version for rid in rids}
    w.write_round(90, overwrite=0.3, delete=0.05, puts_per_batch=10)
    moved = {rid for rid in rids if region.load_latest(table_loc.store, rid).version != known[rid]}
    assert moved
    got = status.observe_regions(table_loc, known, _Merged(table_loc))
    assert {rid for rid, o in got.items() if o.changed} == moved
    for rid in moved:
        assert got[rid].manifest.version == got[rid].version > known[rid]


def test_a_corrupt_region_is_an_error_and_the_others_are_observed(table_loc):
    _table(table_loc)
    bad, *good = sorted(region.list_regions(table_loc.store).region_ids)
    latest = region.load_latest(table_loc.store, bad)
    table_loc.store.put(layout.manifest_key(bad, latest.version + 1), b"\xff\xff garbage")
    got = status.observe_regions(table_loc, dict.fromkeys([bad, *good]), _Merged(table_loc))
    assert not got[bad].ok and got[bad].error.startswith(f"region {bad}: ") and "cannot be decoded" in got[bad].error
    assert got[bad].manifest is None and got[bad].status is None
    assert all(got[rid].ok and got[rid].changed for rid in good)


def test_a_verified_region_finds_versions_past_a_collected_one(table_loc):
    """A remembered version collected meanwhile: probing from it finds nothing new, the hint does."""
    w = _table(table_loc, regions=1)
    (rid,) = region.list_regions(table_loc.store).region_ids
    seen = region.load_latest(table_loc.store, rid).version
    for _ in range(2):
        w.write_round(90, overwrite=0.3, delete=0.05, puts_per_batch=10)
    latest = region.load_latest(table_loc.store, rid).version
    assert latest > seen + 1
    table_loc.store.delete_many([layout.manifest_key(rid, seen + 1)])  # as GC collects it
    blind = status.observe_regions(table_loc, {rid: seen}, _Merged(table_loc))
    assert blind[rid].version == seen and not blind[rid].changed
    verified = status.observe_regions(table_loc, {rid: seen}, _Merged(table_loc), verify={rid})
    assert verified[rid].version == latest and verified[rid].changed
