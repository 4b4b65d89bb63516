"""What GC keeps between passes (`jobs/gc/history.py`, `leak_refs.py`, `region_cache.py`) is a
pure cache: whatever happened to the table, the summaries or the regions since it was written,
a plan made with it decides exactly what a plan that reads every manifest, WAL entry and
manifest version again decides (the same items, kept counters, limits, holds and retained
versions), and a pass reads only what it does not know yet."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta

import lance
import pytest
from lance.mem_wal import CompactedSsTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.gc_passes import (COLLECT, KEEP, KEEP_SCANNING, assert_keeps_more, assert_same_decision, decision,
                               forget_process, history_table as _history, mark_merged, new_table)
from support.helpers import wait_flushed

from memwal_core.jobs import gc
from memwal_core.jobs.gc import fact_segments, fact_table, history, leak_refs, listed as listing, plan, region_cache, retention
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.jobs.gc.holds import Bound, KeepReason
from memwal_core.state import layout, region, sealed, table, wal
from memwal_core.state.store import open_store
from memwal_core.tools import demo

SUMMARIES = (layout.GC_VERSIONS_KEY, layout.GC_REFS_KEY)


def overwrite(loc) -> None:
    """A new lifetime: the overwrite drops the MemWAL index, which is initialized again."""
    lance.write_dataset(table.open_dataset(loc).to_table(), loc.lance_uri, mode="overwrite")
    table.open_dataset(loc).initialize_mem_wal(bucket_column="id", num_buckets=2)


def garble(loc, key: str, how: str) -> None:
    raw = loc.store.get(key)
    if how == "truncate":
        loc.store.put(key, raw[: len(raw) // 2])
    elif how == "bytes":
        loc.store.put(key, b"\x00\xff not json")
    elif raw.find(b"\n") < 0:  # valid JSON, a body changed without its checksum: a lower merge progress, a forged run
        doc = json.loads(raw)
        doc["body"] = doc["body"].replace("1", "2", 1)
        loc.store.put(key, json.dumps(doc).encode())
    else:  # the same in a record with raw bytes (`sealed.seal_blob`): its last byte changed
        loc.store.put(key, raw[:-1] + bytes([raw[-1] ^ 1]))


# ------------------------------------------------------------------------------------------------
# The property: random histories, GC passes among them, the cached plan always equals a full read.

OPS = st.lists(st.sampled_from(["write", "write", "merge", "config", "gc_collect", "gc_keep", "cleanup_elsewhere",
                                "garble", "drop_summaries", "drop_sealed", "overwrite", "recreate"]),
               min_size=4, max_size=9)


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, garbling=st.sampled_from(["truncate", "bytes", "body"]), which=st.integers(0, 3),
       tail=st.sampled_from([(fact_segments.TAIL_MAX, fact_segments.TAIL_KEEP), (4, 2), (3, 1)]))
def test_cached_plan_equals_full_read_over_random_histories(ops, garbling, which, tail):
    """(With a short summary tail, the older versions sealed every few passes.)"""
    root = tempfile.mkdtemp(prefix="memwal-gc-summaries-")
    shipped = fact_segments.TAIL_MAX, fact_segments.TAIL_KEEP
    fact_segments.TAIL_MAX, fact_segments.TAIL_KEEP = tail
    try:
        loc, w = new_table(os.path.join(root, "t"))
        for op in ops:
            if op == "write":
                w.write_round(12, puts_per_batch=50)
            elif op == "merge":
                mark_merged(loc, w.regions.values())
            elif op == "config":
                table.open_dataset(loc).update_config({"k": str(time.time())})
            elif op in ("gc_collect", "gc_keep"):
                forget_process()
                gc.run_gc(loc, COLLECT if op == "gc_collect" else KEEP)
            elif op == "cleanup_elsewhere":  # another process's cleanup, GC not told
                table.open_dataset(loc).cleanup_old_versions(older_than=timedelta(0), retain_versions=2,
                                                             error_if_tagged_old_versions=False)
            elif op == "garble":
                keys = [k for k in SUMMARIES + tuple(o.key for d in (layout.GC_REGIONS_DIR, fact_segments.DIR)
                                                     for o in loc.store.list(d)) if loc.store.exists(k)]
                if keys:
                    garble(loc, keys[which % len(keys)], garbling)
            elif op == "drop_summaries":
                loc.store.delete_many(list(SUMMARIES))
            elif op == "drop_sealed":  # the summary names a sealed object that is gone
                loc.store.delete_many([o.key for o in loc.store.list(fact_segments.DIR)])
            elif op == "overwrite":  # a new lifetime: the MemWAL index dropped, initialized again
                overwrite(loc)
            elif op == "recreate":  # the table removed and created again at the same URI, _memwal/ left
                for d in ("_versions", "data", "_transactions", "_deletions", "_indices"):
                    shutil.rmtree(os.path.join(loc.lance_uri, d), ignore_errors=True)
                loc, w = new_table(loc.lance_uri)
            for config in (KEEP, COLLECT):
                assert_same_decision(loc, config)
    finally:
        fact_segments.TAIL_MAX, fact_segments.TAIL_KEEP = shipped
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Each invalidation on its own.


def test_a_pass_reads_only_what_it_does_not_know(tmp_path):
    loc, w = _history(tmp_path)
    forget_process()
    plan = gc.plan_gc(loc, KEEP)  # between full scans: `_versions/` is not listed, no leak scan
    assert plan.history.read == 0 and plan.history.known == len(plan.retained_versions) > 3
    assert not plan.history.listed and plan.leak_scan["skipped"] and plan.leak_scan["next_scan_in_seconds"] > 0
    forget_process()
    plan = gc.plan_gc(loc, KEEP, full_scan=True)
    assert plan.history.read == 0 and plan.history.listed
    assert plan.leak_scan["manifests_read"] == 0
    w.write_round(12, puts_per_batch=50)
    mark_merged(loc, w.regions.values())
    forget_process()
    plan = gc.plan_gc(loc, KEEP)
    assert plan.history.read == 1 and not plan.history.listed  # the merge commit, found by probing
    assert table.open_dataset(loc).version in plan.retained_versions
    forget_process()
    plan = gc.plan_gc(loc, KEEP, full_scan=True)
    assert plan.history.read == 1  # the writers commit no table version
    assert plan.leak_scan["manifests_read"] == 1
    # The WAL entries and manifest versions of earlier passes are not read again.
    reads: dict[str, int] = {}
    orig_get, orig_head = loc.store.get, loc.store.head

    def counting(fn, kind):
        def wrapped(key, *a, **k):
            if "/wal/" in key or "/manifest/" in key:
                reads[kind] = reads.get(kind, 0) + 1
            return fn(key, *a, **k)
        return wrapped

    forget_process()
    gc.run_gc(loc, KEEP)  # learns the new ones
    loc.store.get, loc.store.head = counting(orig_get, "get"), counting(orig_head, "head")
    forget_process()
    gc.plan_gc(loc, KEEP)
    wal_entries = sum(1 for rid in w.regions.values() for _ in loc.store.list(layout.wal_dir(rid)))
    # per region: the latest manifest, its hint, the WAL tail probe, the anchors, the holes below
    assert sum(reads.values()) <= 12 * len(w.regions) < wal_entries + 12 * len(w.regions)
    assert_same_decision(loc, KEEP)


def test_versions_cleaned_up_by_another_process(tmp_path):
    loc, _ = _history(tmp_path, cycles=4)
    before = gc.plan_gc(loc, KEEP).retained_versions
    table.open_dataset(loc).cleanup_old_versions(older_than=timedelta(0), retain_versions=2)
    plan = assert_same_decision(loc, KEEP)
    assert plan.retained_versions == before[-2:]
    assert plan.history.read == 0  # nothing new: the removed versions simply stop counting
    # The time-travel bound rises with the versions gone, as a full read says.
    assert assert_same_decision(loc, COLLECT).items


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_commit_landing_while_gc_cleans_up_is_what_the_pass_plans_on(tmp_path, monkeypatch, dry_run):
    """Another client commits after the pass read the table and before Lance's base-version
    cleanup (a dry run: its explanation), which judges the versions against that newer commit:
    the version the pass read first is among those removed, so the pass reads the table again
    (without: a dry run failed, "removes the latest table version", and a real run planned on a
    version gone)."""
    import memwal_core.jobs.gc.run as gc_run

    loc, _ = _history(tmp_path, cycles=2)
    time.sleep(1.5)  # every version older than the cleanup's age below
    name = "plan_base_cleanup" if dry_run else "cleanup_base_versions"
    real = getattr(gc_run, name)

    def commit_first(loc, config):
        lance.dataset(loc.lance_uri).update_config({"app.note": "committed meanwhile"})
        return real(loc, config)

    monkeypatch.setattr(gc_run, name, commit_first)
    first = table.open_dataset(loc).version
    forget_process()
    r = gc.run_gc(loc, gc.GcOptions(cleanup_base_versions_older_than_seconds=1, cleanup_base_versions_floor_seconds=0),
                  dry_run=dry_run)
    assert not r.region_errors
    assert r.plan.table_version == table.open_dataset(loc).version == first + 1
    if dry_run:  # the explanation judged the versions against the newer commit
        assert first in r.plan.base_cleanup.versions
    else:
        assert first not in {v["version"] for v in lance.dataset(loc.lance_uri).versions()}


def test_a_run_over_some_regions_plans_them_as_the_whole_run_does(tmp_path):
    """`run_gc(regions=...)`: the named regions are planned from the pass's one read of the
    table, exactly as a run over every region plans them; an id that is not a region of the
    table is reported as a failed region and nothing is collected for it."""
    loc, w = _history(tmp_path, cycles=3)
    rid = sorted(w.regions.values())[0]
    missing = "00000000-0000-4000-8000-000000000000"
    forget_process()
    whole = gc.plan_gc(loc, COLLECT)
    forget_process()
    some = gc.plan_gc(loc, COLLECT, regions=[rid, missing])
    assert set(some.regions) == {rid, missing}
    assert some.regions[rid].items == whole.regions[rid].items and some.regions[rid].limit == whole.regions[rid].limit
    assert some.regions[missing].failure is not None and not some.regions[missing].items
    assert some.leaked == []  # the leak scan is a whole-table step


def test_table_overwritten_with_a_new_lifetime(tmp_path):
    loc, w = _history(tmp_path)
    overwrite(loc)
    plan = assert_same_decision(loc, KEEP)
    assert plan.history.read == 2
    assert_same_decision(loc, COLLECT)


def test_table_recreated_at_the_same_uri(tmp_path):
    """Same version numbers, new manifests: neither summary is taken for them."""
    loc, w = _history(tmp_path, cycles=4)
    old = gc.plan_gc(loc, KEEP).retained_versions
    for d in ("_versions", "data", "_transactions", "_deletions", "_indices"):
        shutil.rmtree(os.path.join(loc.lance_uri, d), ignore_errors=True)
    time.sleep(0.01)  # a different modification time on a local disk (whole-second stores: the test below)
    loc, w = new_table(loc.lance_uri)
    forget_process()
    plan = assert_same_decision(loc, KEEP)
    assert plan.retained_versions == old[:2] and plan.history.read == 2
    assert not leak_refs.usable(leak_refs.load(loc), history.list_versions(loc))


def test_table_recreated_within_the_stores_time_resolution(tmp_path):
    """A store whose times have whole seconds (S3) can list a re-created table's manifests with
    the old keys, sizes and times (sizes often match: they differ only by a varint). The newest
    manifest the summary vouches for is read each pass and its commit time told apart, so no
    summary (versions, leak references, regions) is taken for the new table."""
    from dataclasses import replace

    loc, w = _history(tmp_path, cycles=3)
    gc.run_gc(loc, KEEP)
    old = history.decode(loc.store.get(layout.GC_VERSIONS_KEY))
    for d in ("_versions", "data", "_transactions", "_deletions", "_indices"):
        shutil.rmtree(os.path.join(loc.lance_uri, d), ignore_errors=True)
    loc, w = new_table(loc.lance_uri)
    listed = history.list_versions(loc)
    assert set(listed) <= set(old)
    # What that store shows: the old summary's entries with the new manifests' sizes and times.
    loc.store.put(layout.GC_VERSIONS_KEY, history.encode(
        {v: f._replace(size=listed[v].size, mtime=listed[v].mtime) if v in listed else f for v, f in old.items()}))
    forget_process()
    plan = gc.plan_gc(loc, COLLECT)
    assert plan.history.recreated and plan.history.summary.startswith("ignored:")
    assert plan.history.read == len(listed)
    live = {o.key for o in loc.store.list("data")}
    assert not live & {i.path for i in plan.items if i.kind == "leaked"}, "live files of the new table planned"
    assert_same_decision(loc, COLLECT)


@pytest.mark.parametrize("how", ["truncate", "bytes", "body"])
@pytest.mark.parametrize("key", [layout.GC_VERSIONS_KEY, layout.GC_REFS_KEY, "region"])
def test_a_corrupt_summary_is_read_around_and_written_again(tmp_path, key, how):
    loc, w = _history(tmp_path)
    if key == "region":
        key = layout.gc_region_cache_key(sorted(w.regions.values())[0])
    garble(loc, key, how)
    plan = assert_same_decision(loc, KEEP)
    if key == layout.GC_VERSIONS_KEY:
        assert plan.history.summary.startswith("ignored") and plan.history.read == len(plan.retained_versions)
    forget_process()
    gc.run_gc(loc, KEEP_SCANNING)  # the leak references are read (and written) only by a leak scan
    good = loc.store.get(key)
    if key == layout.GC_REFS_KEY:  # written again, whole
        json.loads(json.loads(good)["body"])
    else:
        sealed.unseal_blob(good, history.FORMAT if key == layout.GC_VERSIONS_KEY else region_cache.FORMAT)
    if key == layout.GC_VERSIONS_KEY:
        assert history.decode(good)
    elif key == layout.GC_REFS_KEY:
        assert leak_refs.RefsSummary.decode(good).versions
    else:
        assert region_cache.RegionCache.decode(good, key.rsplit("/", 1)[-1][:-5]).wal


def test_a_version_summary_entry_is_used_only_for_that_manifest(tmp_path):
    """An entry whose manifest is not the listed one (another size or time) is read again: a
    summary cannot make GC take a version's merge progress from another manifest."""
    loc, w = _history(tmp_path)
    facts, _ = history.load_summary(loc)
    v = max(v for v, f in facts.items() if f.merged)
    forged = dict(facts)
    forged[v] = history.VersionFacts(v, facts[v].size, facts[v].mtime - 1, facts[v].stamp,
                                     {rid: 10**6 for rid in facts[v].merged})
    loc.store.put(layout.GC_VERSIONS_KEY, history.encode(forged))
    plan = assert_same_decision(loc, COLLECT)
    assert plan.history.read == 1


def test_region_recreated_under_the_same_id(tmp_path):
    """The region's WAL and manifests removed and written again by a new writer: the cache's
    anchors no longer match, so nothing of it is used (merged progress would make the region
    corrupt: the table never merged it)."""
    loc, w = _history(tmp_path, merge=False)
    rid = sorted(w.regions.values())[0]
    assert region_cache.load(loc.store, rid).wal
    shutil.rmtree(os.path.join(loc.lance_uri, layout.region_dir(rid)))
    time.sleep(0.01)
    w.write_round(200, puts_per_batch=5)  # other entries at the cached positions (epochs, sentinels)
    w.write_round(12, puts_per_batch=50)
    assert_same_decision(loc, KEEP)
    assert_same_decision(loc, COLLECT)


def test_a_failed_delete_leaves_the_region_read_in_full(tmp_path):
    """While GC's intent marker stands (a delete that may have stopped part-way), the region's
    cache is not used."""
    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    loc.store.put(layout.gc_pending_key(rid), b"x")
    for p in sorted(region_cache.load(loc.store, rid).wal)[1:3]:  # survivors: a delete that stopped
        os.unlink(os.path.join(loc.lance_uri, layout.wal_key(rid, p)))
    assert_same_decision(loc, COLLECT)


def test_nothing_old_enough_skips_lances_cleanup(tmp_path, monkeypatch):
    """Lance's cleanup reads every manifest: it is not run when no retained version is old enough
    for it to remove (by age or count, it removes only versions older than the age)."""
    loc, _ = _history(tmp_path)
    from memwal_core.jobs.gc import run

    calls = []
    real = run.cleanup_base_versions
    monkeypatch.setattr(run, "cleanup_base_versions", lambda *a, **k: calls.append(1) or real(*a, **k))
    forget_process()
    r = gc.run_gc(loc, KEEP)
    assert not calls and r.base_cleanup["old_versions"] == 0
    r = gc.run_gc(loc, COLLECT)
    assert calls and r.base_cleanup["old_versions"] > 0


def test_a_region_cache_is_used_only_while_its_anchors_hold(tmp_path):
    """A cache whose lowest WAL entry or lowest manifest version is not the object it recorded
    (another size or time: deleted by someone else, written again) is not used, even when it
    parses and its checksum holds; while they hold, it is what the pass knows."""
    loc, w = _history(tmp_path, cycles=4, merge=False)
    rid = sorted(w.regions.values())[0]
    good = region_cache.load(loc.store, rid)
    assert good.wal and good.manifests is not None
    forged = region_cache.RegionCache(rid, {p: region_cache.wal.WalEntryMeta(p, 99, None, True, 1) for p in good.wal},
                                      set(), good.wal_anchor, dict(good.manifests))
    p, size, mtime = good.wal_anchor
    forged.wal_anchor = (p, size, mtime + 1)
    region_cache.save(loc.store, forged)
    assert_same_decision(loc, KEEP)
    forged.wal_anchor = good.wal_anchor  # anchored: taken as known (the trust the anchor buys)
    region_cache.save(loc.store, forged)
    now = time.time()
    forget_process()
    kept = gc.plan_gc(loc, KEEP, now=now).regions[rid].kept
    assert kept[gc.KeepReason.WAL_FENCE_SENTINEL] >= len(good.wal) - 1


# ------------------------------------------------------------------------------------------------
# Between full scans: versions found by probing, removals by a check of the oldest and newest
# known version, the whole table listed once per `full_scan_interval_seconds`.


def _version_manifest(loc, v: int) -> str:
    return next(k for k in table.manifest_keys(v) if loc.store.exists(k))


def test_a_cleanup_that_left_the_oldest_version_is_seen_at_the_next_listing(tmp_path):
    """A tagged oldest version survives Lance's cleanup of the ones after it: the probe does not
    notice, so the removed versions still hold their generations (GC keeps more) until the next
    listing, after `full_scan_interval_seconds`."""
    loc, w = _history(tmp_path, cycles=4)
    oldest = min(gc.plan_gc(loc, KEEP).retained_versions)
    table.open_dataset(loc).tags.create("keep", oldest)
    table.open_dataset(loc).cleanup_old_versions(older_than=timedelta(0), retain_versions=2,
                                                 error_if_tagged_old_versions=False)
    now = time.time()
    forget_process()
    between = gc.plan_gc(loc, COLLECT, now=now)
    forget_process()
    full = gc.plan_gc(loc, COLLECT, now=now, use_summary=False)
    assert not between.history.listed and len(between.retained_versions) > len(full.retained_versions) == 3
    assert_keeps_more(between, full)
    forget_process()
    later = gc.plan_gc(loc, COLLECT, now=now + COLLECT.full_scan_interval_seconds + 1)
    assert later.history.listed and decision(later)["retained"] == full.retained_versions
    assert_same_decision(loc, COLLECT)


def test_lances_cleanup_of_the_oldest_versions_is_seen_at_once(tmp_path):
    loc, w = _history(tmp_path, cycles=4)
    table.open_dataset(loc).cleanup_old_versions(older_than=timedelta(0), retain_versions=2)
    forget_process()
    plan = gc.plan_gc(loc, KEEP)
    assert plan.history.listed and len(plan.retained_versions) == 2  # the oldest known is gone: listed
    assert_same_decision(loc, COLLECT)


def test_memwals_base_cleanup_is_listed_in_the_same_pass(tmp_path):
    loc, w = _history(tmp_path, cycles=4)
    forget_process()
    r = gc.run_gc(loc, COLLECT)
    assert r.base_cleanup["old_versions"] > 0 and r.plan.history.listed
    assert r.retained_versions == len(table.open_dataset(loc).versions()) == 3
    w.write_round(12, puts_per_batch=50)
    mark_merged(loc, w.regions.values())
    plan = assert_same_decision(loc, KEEP)
    forget_process()
    between = gc.plan_gc(loc, KEEP)
    assert not between.history.listed and between.retained_versions == plan.retained_versions


@pytest.mark.parametrize("longer", [False, True])
def test_a_table_recreated_is_seen_by_the_probe(tmp_path, longer):
    """The newest known version is read again each pass: a table created again at this URI has
    none there (shorter) or another manifest (as long or longer): then `_versions/` is listed."""
    loc, w = _history(tmp_path, cycles=2)
    top = max(gc.plan_gc(loc, KEEP).retained_versions)
    for d in ("_versions", "data", "_transactions", "_deletions", "_indices"):
        shutil.rmtree(os.path.join(loc.lance_uri, d), ignore_errors=True)
    time.sleep(0.01)
    loc, w = new_table(loc.lance_uri)
    while longer and table.open_dataset(loc).version <= top:
        table.open_dataset(loc).update_config({"k": str(time.time())})
    forget_process()
    plan = gc.plan_gc(loc, KEEP)
    assert plan.history.listed
    assert plan.retained_versions == [v["version"] for v in table.open_dataset(loc).versions()]
    assert_same_decision(loc, KEEP)
    assert_same_decision(loc, COLLECT)


def test_a_missing_version_below_the_latest_makes_the_pass_list(tmp_path):
    """The probe stops at the first missing version; when the table's latest is above it (a
    version removed since, a gap), `_versions/` is listed so that no newer version is missed."""
    loc, w = _history(tmp_path, cycles=2)
    top = max(gc.plan_gc(loc, KEEP).retained_versions)
    for _ in range(2):
        table.open_dataset(loc).update_config({"k": str(time.time())})
    os.unlink(os.path.join(loc.lance_uri, _version_manifest(loc, top + 1)))
    forget_process()
    plan = gc.plan_gc(loc, KEEP)
    assert plan.history.listed and top + 2 in plan.retained_versions and top + 1 not in plan.retained_versions
    assert_same_decision(loc, KEEP)


def test_the_newest_known_version_is_compared_with_its_manifest(tmp_path):
    """A summary row for the newest known version that is not its manifest's (another merge
    progress) makes the pass ignore the summary, even between listings."""
    loc, w = _history(tmp_path)
    summary = history.decode_summary(loc.store.get(layout.GC_VERSIONS_KEY))
    top = max(summary.facts)
    assert summary.facts[top].merged
    forged = dict(summary.facts)
    forged[top] = history.VersionFacts(top, forged[top].size, forged[top].mtime, forged[top].stamp,
                                       {rid: 10**6 for rid in forged[top].merged})
    loc.store.put(layout.GC_VERSIONS_KEY, history.encode(forged, time.time(), time.time()))
    forget_process()
    plan = gc.plan_gc(loc, COLLECT)
    assert plan.history.listed and plan.history.summary.startswith("ignored")
    assert plan.history.read == len(plan.retained_versions)
    assert_same_decision(loc, COLLECT)


def test_between_full_scans_a_pass_lists_no_table_directory(loc):
    """Local and on S3 (moto), where a HEAD may give a time less precisely than a listing: a pass
    between full scans takes every known version from the summary, reads only the new one, and
    lists neither `_versions/` nor a leak directory."""
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=5, key_space=10**6, max_memtable_rows=1000)
    for _ in range(2):
        w.write_round(12, puts_per_batch=50)
        mark_merged(loc, w.regions.values())
        forget_process()
        gc.run_gc(loc, KEEP)
    table.open_dataset(loc).update_config({"k": "v"})
    listed = []
    real_list = loc.store.list
    loc.store.list = lambda prefix: listed.append(prefix) or real_list(prefix)
    forget_process()
    r = gc.run_gc(loc, KEEP)
    loc.store.list = real_list
    h = r.plan.history
    assert h.summary == "used" and not h.listed and h.read == 1 and r.leak_scan["skipped"]
    assert not {p.split("/")[0] for p in listed} & {"_versions", "data", "_deletions", "_transactions", "_indices"}
    assert table.open_dataset(loc).version in r.plan.retained_versions
    assert_same_decision(loc, KEEP)


def test_manifest_versions_walked_up_from_the_lowest_left(tmp_path):
    """The region cache keeps only the lowest manifest version left at or below the retention
    cut; a pass walks up from it to the first version young enough to stay, and decides as a
    pass that walks every version down: with the split between old and young anywhere, and
    after the old ones went."""
    loc, w = _history(tmp_path, cycles=6, merge=False)
    rid = sorted(w.regions.values())[0]
    assert len(region_cache.load(loc.store, rid).manifests) == 1
    mtimes = sorted(o.mtime for o in loc.store.list(layout.manifest_dir(rid)) if o.key.endswith(layout.MANIFEST_SUFFIX))
    assert len(mtimes) > 8
    keep2 = dataclasses.replace(KEEP, manifest_retention=2)
    for split in (mtimes[1], mtimes[len(mtimes) // 2], mtimes[-4]):
        for now in (split + 3600 - 1e-3, split + 3600 + 1e-3):
            forget_process()
            cached = gc.plan_gc(loc, keep2, now=now)
            forget_process()
            full = gc.plan_gc(loc, keep2, now=now, use_summary=False)
            assert decision(cached)["items"] == decision(full)["items"] and cached.kept == full.kept
    cfg = dataclasses.replace(keep2, manifest_min_age_seconds=time.time() - mtimes[len(mtimes) // 2])
    forget_process()
    r = gc.run_gc(loc, cfg)
    assert any(i.kind == "manifest" for i in r.deleted)
    w.write_round(12, puts_per_batch=50)
    assert_same_decision(loc, cfg)
    low = min(region_cache.load(loc.store, rid).manifests)
    os.unlink(os.path.join(loc.lance_uri, layout.manifest_key(rid, low + 1)))  # missing on the way up
    all_old = dataclasses.replace(cfg, manifest_min_age_seconds=0)
    now = time.time()
    forget_process()
    cached = gc.plan_gc(loc, all_old, now=now)
    forget_process()
    full = gc.plan_gc(loc, all_old, now=now, use_summary=False)
    assert decision(cached)["items"] == decision(full)["items"]  # walked down to the hole, as a full read
    deleted = {i.number for i in cached.items if i.kind == "manifest" and i.region_id == rid}
    assert deleted and low not in deleted and min(deleted) == low + 2


# ------------------------------------------------------------------------------------------------
# What keeps a pass's cost flat as the retained history grows, and when it must not be trusted:
# the settled run of kept WAL entries (`region_cache.Settled`) and the text of its rows, the
# summaries written by appending to their text (`history.encode`), the generations held counted
# by runs (`plan._classify_runs`) and the retention's bounds over distinct merge states.


def _settled(loc, rid) -> region_cache.Settled:
    c = region_cache.load(loc.store, rid)
    assert c is not None and c.settled is not None, "a pass that kept every older entry records its run"
    return c.settled


def _forge(loc, rid, **changes) -> None:
    c = region_cache.load(loc.store, rid)
    c.settled = dataclasses.replace(c.settled, **changes)
    assert region_cache.save(loc.store, c)


def _wal_kept(loc, config, rid) -> dict:
    forget_process()
    return {k: v for k, v in gc.plan_gc(loc, config).regions[rid].kept.items() if k.value.startswith("wal:")}


def test_a_settled_run_is_counted_without_classifying_its_entries(tmp_path):
    """While the limit stays below the run's lowest generation and the current epoch above its
    epochs, the run is taken as the cache says: forged counts show up in the plan (the trust it
    buys), and the true ones equal a full read."""
    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    forget_process()
    gc.run_gc(loc, KEEP)  # a second pass: the run recorded by the first is used and extended
    s = _settled(loc, rid)
    assert s.top > s.bottom and s.sentinels and s.kept
    assert_same_decision(loc, KEEP)
    _forge(loc, rid, sentinels=s.top - s.bottom, kept=0, min_gen=None)
    kept = _wal_kept(loc, KEEP, rid)
    assert kept[KeepReason.WAL_FENCE_SENTINEL] >= s.top - s.bottom
    assert KeepReason.WAL_GENERATION_KEPT not in kept or kept[KeepReason.WAL_GENERATION_KEPT] < s.kept


def test_a_settled_run_is_walked_again_once_the_limit_reaches_it(tmp_path):
    """Base versions cleaned up raise the limit into the run: its entries are classified again, as
    a full read does (a forged run, trusted while every version was retained, shows other counts)."""
    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    s = _settled(loc, rid)
    _forge(loc, rid, sentinels=s.top - s.bottom - 1, kept=1, min_gen=1, max_epoch=0)  # the limit will be >= 1
    forget_process()
    assert gc.plan_gc(loc, COLLECT).regions[rid].limit == 0  # every version retained: the run is trusted
    assert gc.cleanup_base_versions(loc, COLLECT)["old_versions"] > 0
    decided = assert_same_decision(loc, COLLECT)  # the forged counts would differ from a full read
    assert decided.regions[rid].limit >= 1
    forget_process()
    gc.run_gc(loc, COLLECT)
    assert_same_decision(loc, KEEP)
    assert_same_decision(loc, COLLECT)


def test_a_settled_run_of_the_current_epoch_is_not_trusted(tmp_path):
    """A run that holds an entry of the current writer epoch (kept as such, not by its
    generation) is classified again: counted as the cache says it would show other reasons."""
    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    s = _settled(loc, rid)
    epoch = region.load_latest(loc.store, rid).writer_epoch
    _forge(loc, rid, sentinels=s.top - s.bottom, kept=0, min_gen=None, max_epoch=epoch)
    assert_same_decision(loc, KEEP)
    kept = _wal_kept(loc, KEEP, rid)
    assert kept.get(KeepReason.WAL_GENERATION_KEPT, 0) > 0


def test_a_garbled_settled_run_drops_the_cache(tmp_path):
    """A run whose counts do not add up to its positions, or whose top is not a known entry, makes
    the cache unusable (the region is read in full), never a skip."""
    loc, w = _history(tmp_path, cycles=3)
    rid = sorted(w.regions.values())[0]
    c = region_cache.load(loc.store, rid)
    for bad in (dataclasses.replace(c.settled, sentinels=c.settled.sentinels + 1),
                dataclasses.replace(c.settled, top=max(c.rows) + 5,
                                    bottom=max(c.rows) + 5 - (c.settled.top - c.settled.bottom))):
        c.settled = bad
        loc.store.put(layout.gc_region_cache_key(rid), c.encode())
        assert region_cache.load(loc.store, rid) is None
        assert_same_decision(loc, KEEP)


# ------------------------------------------------------------------------------------------------
# The version summary as columns (`fact_table.py`)

U64 = 2**64
_merged = st.one_of(st.none(), st.dictionaries(st.sampled_from(["a", "b", "c", "r-é"]),
                                               st.one_of(st.integers(0, 5), st.just(U64 - 2)), max_size=3))
_fact = st.builds(lambda v, size, mtime, stamp, merged: history.VersionFacts(v, size, mtime, stamp, merged),
                  st.integers(1, 40), st.sampled_from([0, 1, 600, U64 - 1]),
                  st.floats(0, 2e9, allow_nan=False), st.one_of(st.none(), st.floats(0, 2e9, allow_nan=False),
                                                                st.integers(0, 2**40)), _merged)


@settings(max_examples=200, deadline=None)
@given(first=st.lists(_fact, max_size=25), more=st.lists(_fact, max_size=10), drop=st.sets(st.integers(1, 40)))
def test_the_version_summary_holds_exactly_the_facts_given(first, more, drop):
    """Encoded and decoded, grown by newer versions (appended) or by any versions (replacing the
    rows of equal ones), and with versions left out, the columns hold exactly the facts of a plain
    map, to the bit of every number and the regions each merge state names (absent is not 0)."""
    plain = {f.version: f for f in first}
    table = fact_table.FactTable.of(first)
    assert table == plain and list(table) == sorted(plain)
    decoded = history.decode(history.encode(table, 1.0, None))
    assert decoded == plain and all(decoded[v].merged == plain[v].merged for v in plain)
    grown = table.grown(more)
    assert grown == plain | {f.version: f for f in more}
    top = max(plain, default=0)
    above = [f._replace(version=f.version + top) for f in more]
    assert table.grown(above) == plain | {f.version: f for f in above}
    kept = grown.select(i for i, v in enumerate(grown.versions) if v not in drop)
    assert kept == {v: f for v, f in grown.items() if v not in drop}
    assert history.decode(history.encode(kept)) == kept
    # Versions with equal merge states share one map: the retention looks at the distinct states.
    shared = {}
    for f in table.values():
        if f.merged is not None:
            assert shared.setdefault(frozenset(f.merged.items()), f.merged) is f.merged


@pytest.mark.parametrize("fact", [
    history.VersionFacts(0, 1, 1.0, None, None),            # no version 0
    history.VersionFacts(U64, 1, 1.0, None, None),          # past u64
    history.VersionFacts(1, -1, 1.0, None, None),           # a negative size
    history.VersionFacts(1, 1, 1.0, None, {"a": -1}),       # a negative generation
    history.VersionFacts(1, 1, 1.0, None, {"a": U64}),      # past u64
    history.VersionFacts(1, 1, float("nan"), None, None),   # what `from_json` would refuse
    history.VersionFacts(1, 1, 1.0, float("inf"), None),
])
def test_facts_no_summary_can_hold_are_refused_and_the_summary_not_written(tmp_path, fact, caplog):
    with pytest.raises(ValueError):
        history.encode({fact.version: fact})
    loc = open_store(str(tmp_path / "t"))
    history.save_summary(loc, history.VersionHistory(tail={fact.version: fact}, changed=True))
    assert not loc.store.exists(layout.GC_VERSIONS_KEY) and "could not write" in caplog.text


def test_a_merged_generation_at_the_u64_limit_is_held_one_below(tmp_path):
    """A retained version whose MemWAL index records a region merged through u64::MAX (the one
    value a state's cell cannot hold: it marks a region the state does not name) is summarized
    one below it, which only keeps more; GC plans and runs on such a table as on any other."""
    loc, w = _history(tmp_path)
    odd = "00000000-0000-4000-8000-00000000dead"
    ds = table.open_dataset(loc)
    empty = ds.to_table(limit=0)
    ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all() \
        .mark_sstables_as_compacted([CompactedSsTable(odd, U64 - 1)]).execute(empty)
    assert table.read_memwal_state(loc).merged[odd] == U64 - 1
    forget_process()
    gc.run_gc(loc, KEEP)
    newest = history.decode(loc.store.get(layout.GC_VERSIONS_KEY))[table.open_dataset(loc).version]
    assert newest.merged[odd] == U64 - 2
    assert_same_decision(loc, KEEP)
    assert_same_decision(loc, COLLECT)


_COLUMNS = ("versions", "sizes", "mtimes", "stamps", "state_of", "matrix")


def _columns(**change):
    """A summary of 8 versions (5 merge states over region "a") with `change` made to its map
    (count, regions, states) or to its columns' bytes (by name), its checksum made anew."""
    facts = [history.VersionFacts(v, 600 + v, 1.7e9 + v, 1.7e9 + v, {"a": v // 2}) for v in range(1, 9)]
    d, blob = sealed.unseal_blob(history.encode(fact_table.FactTable.of(facts)), history.FORMAT)
    blob = bytes(blob)
    cols = dict(zip(_COLUMNS, [blob[i * 64:(i + 1) * 64] for i in range(5)] + [blob[320:]]))
    for k, v in change.items():
        if k in cols:
            cols[k] = v
        else:
            d["facts"][k] = v
    return sealed.seal_blob(d, b"".join(cols[k] for k in _COLUMNS), history.FORMAT)


def _packed(code, values):
    from array import array
    return array(code, values).tobytes() if sys.byteorder == "little" else _swapped(array(code, values))


def _swapped(a):
    a.byteswap()
    return a.tobytes()


@pytest.mark.parametrize("change", [
    {"count": 9}, {"count": -1}, {"count": "8"}, {"states": 3}, {"states": -1}, {"regions": ["a", "b"]},
    {"versions": _packed("Q", [1, 2, 3, 4, 5, 6, 8, 7])},       # out of order
    {"versions": _packed("Q", [1, 2, 3, 4, 5, 6, 7, 7])},       # twice
    {"versions": _packed("Q", [0, 2, 3, 4, 5, 6, 7, 8])},       # version 0
    {"state_of": _packed("q", [0, 0, 1, 1, 2, 2, 3, 9])},       # a state not in the matrix
    {"state_of": _packed("q", [0, 0, 1, 1, 2, 2, 3, -2])},
    {"mtimes": _packed("d", [float("nan")] * 8)},
    {"stamps": _packed("d", [float("inf")] * 8)},
    {"sizes": b"short"}, {"sizes": _packed("Q", range(9))}, {"matrix": _packed("Q", [1, 2, 3])[:-4]},
    {"regions": ["b", "a"]}, {"regions": ["a", "a"]}, {"regions": "a"},
    {"state_of": _packed("q", [0, 0, 1, 1, 2, 2, 3, 3])},       # a state no version has (the fifth)
])
def test_a_summary_whose_columns_do_not_add_up_is_refused(change):
    with pytest.raises(ValueError):
        history.decode(_columns(**change))
    assert len(history.decode(_columns())) == 8


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_summary_of_an_earlier_format_is_read_around_and_written_again(tmp_path, fmt):
    """A summary written as rows of JSON numbers (format 1) or as base64 columns inside the JSON
    (format 2) is no summary: every retained manifest is read once, and the summary is written
    again as raw columns."""
    loc, w = _history(tmp_path)
    facts, _ = history.load_summary(loc)
    rows = [[v, f.size, f.mtime, f.stamp, 0] for v, f in facts.items()]
    body = ({"states": [{}], "versions": rows} if fmt == 1
            else {"facts": {"count": len(rows), "regions": [], "versions": "AA==", "states": ""}})
    loc.store.put(layout.GC_VERSIONS_KEY, sealed.seal_body(json.dumps(
        {"leaks_at": None, "listed_at": None, **body}), fmt))
    plan = assert_same_decision(loc, KEEP)
    assert plan.history.summary.startswith(f"ignored: format {fmt}") and plan.history.read == len(facts)
    forget_process()
    gc.run_gc(loc, KEEP)
    assert history.decode(loc.store.get(layout.GC_VERSIONS_KEY)) == facts


def test_the_region_cache_keeps_settled_rows_as_text_until_one_is_looked_up(tmp_path):
    """The rows of settled runs are carried over as the text they were read as, with the rows that
    joined the run appended, while none of them is looked up; once one is (or a position of theirs
    is deleted or found missing) every row is written again. Each result decodes to exactly the
    rows it holds."""
    loc = open_store(str(tmp_path / "t"))
    rid = "00000000-0000-4000-8000-000000000001"
    meta = lambda p, e=1: wal.WalEntryMeta(p, e, None if p % 2 else p // 2, p % 2 == 1, 100 + p)  # noqa: E731
    loc.store.put(layout.wal_key(rid, 1), b"x")
    first = region_cache.RegionCache(rid, {p: meta(p) for p in range(1, 11)}, {20}, (1, 1, 1.0),
                                     settled=region_cache.Settled(8, 0, 4, 4, 1, 1))
    checked = region_cache.Checked(loc.store, region_cache.RegionCache.decode(first.encode(), rid))
    checked._wal_ok = True
    base = region_cache.after_pass(checked, rid, {}, set(), {}, set(), region_cache.Settled(8, 0, 4, 4, 1, 1))
    assert base.cold_top == 8
    rows = {p: meta(p) for p in range(1, 11)}
    cases = [({11: meta(11), 12: meta(12)}, set(), region_cache.Settled(10, 0, 5, 5, 1, 1), True),
             ({11: meta(11)}, set(), None, True),
             ({5: meta(5)}, set(), None, False),  # looked up: decoded
             ({}, {4}, None, False), ({6: None}, set(), None, False), ({7: meta(7, e=2)}, set(), None, False)]
    for metas, deleted, settled, as_text in cases:
        old = region_cache.RegionCache.decode(base.encode(), rid)
        assert old._cold is not None
        checked = region_cache.Checked(loc.store, old)
        checked._wal_ok = True
        for p in metas:
            if p <= old.cold_top:
                assert checked.wal_meta(p)[0]  # what the scan does before it reads an entry
        new = region_cache.after_pass(checked, rid, metas, deleted, {}, set(), settled)
        assert (new._cold is not None) == as_text
        expect = rows | {p: m for p, m in metas.items() if m is not None}
        expect = {p: m for p, m in expect.items() if p not in deleted and metas.get(p, 0) is not None}
        again = region_cache.RegionCache.decode(new.encode(), rid)
        assert again.cold_top == max(8, settled.top if settled else 0) and again._cold is not None
        assert again.wal == expect and again == new


def test_settled_rows_that_are_not_the_recorded_ones_drop_the_cache(tmp_path):
    """A text of settled rows that does not hold as many rows as recorded, or holds one above its
    top, is found when it is decoded: the cache is then not used (the region is read in full)."""
    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    forget_process()
    gc.run_gc(loc, KEEP)
    good = region_cache.load(loc.store, rid)
    assert good.cold_top and good._cold_n
    key = layout.gc_region_cache_key(rid)
    d, blob = sealed.unseal_blob(loc.store.get(key), region_cache.FORMAT)
    top, n, _ = d["cold"]
    text = bytes(blob).decode()
    rows = json.loads(text)
    swapped = json.dumps([[top + 50] + rows[0][1:]] + rows[1:], separators=(",", ":"))  # passes the cheap checks
    for cold in ([top, n + 1, text], [top - 1, n, text], [top, n, swapped]):
        loc.store.put(key, sealed.seal_blob(d | {"cold": [*cold[:2], len(cold[2])]}, cold[2].encode(),
                                            region_cache.FORMAT))
        c = region_cache.load(loc.store, rid)
        if c is not None:  # found only once decoded: then the WAL part is not used
            assert cold[2] == swapped
            checked = region_cache.Checked(loc.store, c)
            assert checked.wal_meta(1) == (False, None) and not checked.wal_ok()
        assert_same_decision(loc, KEEP)


# ------------------------------------------------------------------------------------------------
# Generations held, counted by runs; bounds over distinct merge states


def _ctx(tmp_path, retained=None) -> plan._Context:
    loc = open_store(str(tmp_path / "t"))
    return plan._Context(loc, gc.GcOptions(), 0.0, {}, {}, [], retained)


@settings(max_examples=150, deadline=None)
@given(gens=st.one_of(st.lists(st.integers(1, 60), unique=True, max_size=40),
                     st.tuples(st.integers(1, 60), st.integers(0, 80)).map(lambda t: list(range(t[0], t[0] + t[1])))),
       bounds=st.lists(st.tuples(st.sampled_from([KeepReason.GENERATION_NOT_MERGED, KeepReason.GENERATION_INDEX_BEHIND,
                                                  KeepReason.GENERATION_TIME_TRAVEL, KeepReason.GENERATION_UNVERIFIED]),
                                 st.integers(0, 70)), min_size=1, max_size=5),
       current=st.integers(1, 70))
def test_generations_counted_by_runs_as_one_at_a_time(tmp_path_factory, gens, bounds, current):
    """The same holds (bound, count, bytes, highest, in order) and kept counters, for any bounds
    and any listed generations (only the held ones: the collectable prefix is deleted by both),
    runs of consecutive ones summed by checked chunks (`listed.py`) too."""
    tmp = tmp_path_factory.mktemp("runs")
    rid = "00000000-0000-4000-8000-000000000002"
    msg = pb.RegionManifest(version=1, current_generation=current)
    for g in sorted(gens):
        msg.flushed_generations.add(generation=g, path=f"0000000a_gen_{g}", in_memory_bytes=g * 10 + 1, physical_rows=1)
    m = region.RegionManifest(rid, 1, msg, msg.SerializeToString())
    gen_bounds = [Bound(r, g) for r, g in bounds]
    limit = min(b.generation for b in gen_bounds)
    out = []
    for classify in ("each", "runs", "chunks"):
        rp = plan.RegionGcPlan(rid)
        holds: dict = {}
        listed = listing.listed(m, {})
        if classify == "each":
            plan._classify_each(_ctx(tmp), rp, m, listed.each(), gen_bounds, limit, None, 0, holds)
        else:
            if classify == "chunks":
                listed = listing.listed(m, listed.chunks)
            plan._classify_runs(_ctx(tmp), rp, m, listed, gen_bounds, limit, holds)
        out.append(([dataclasses.astuple(h) for h in holds.values()], dict(rp.kept), rp.trim))
    assert out[0] == out[1] == out[2]


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.booleans(), st.booleans()),
                     min_size=1, max_size=30),
       gen=st.integers(0, 7), gone=st.sets(st.integers(1, 30)), before=st.integers(1, 32), split=st.integers(0, 30))
def test_bounds_over_distinct_states_as_over_every_version(rows, gen, gone, before, split):
    """A region's time-travel bound (value and version), `held_until` and the lowest progress
    below a version equal the per-version definitions, over the columns of a table (a state
    shared or repeated, versions without an index or a commit time, versions left out), and
    with the oldest `split` versions sealed (counted by their aggregates, read when needed)."""
    facts = []
    for v, (a, b, indexed, stamped) in enumerate(rows, start=1):
        m = ({"r": a, "s": b} if a else {"s": b}) if indexed else None
        facts.append(history.VersionFacts(v, 1, 1.0, 1000.0 + v if stamped else None, m))
    every = fact_table.FactTable.of(facts)
    with tempfile.TemporaryDirectory() as d:
        hist = history.VersionHistory(tail=every)
        if 0 < split < len(every):
            loc = open_store(d)
            part, raw = fact_segments.seal(every.select(range(split)))
            loc.store.put(part.key, raw)
            hist = history.VersionHistory(tail=every.select(range(split, len(every))), sealed=part, loc=loc)
        for h in (hist, _sealed_with_gaps(d, every, split, gone)):
            for v in range(len(facts) + 2):  # what the lifetime check asks (aggregates, else facts)
                f = h.get(v) if h is not None else None
                if h is not None:
                    assert h.indexed(v) == (None if f is None else f.merged is not None)
                    assert f is None or f == every[v]
        r = retention.from_history(hist, frozenset(gone))
        states = {f.version: f.merged for f in facts if f.merged is not None and f.version not in gone}
        stamps = {f.version: f.stamp for f in facts}
        assert r.versions == [f.version for f in facts if f.version not in gone]
        assert len(r.versions) == len(facts) - len(gone & set(range(1, len(facts) + 1)))
        for rid in ("r", "s", "t"):
            if not states:
                assert r.bound(rid) is None
                continue
            lowest = min(m.get(rid, 0) for m in states.values())
            assert r.bound(rid) == Bound(KeepReason.GENERATION_TIME_TRAVEL, lowest,
                                         table_version=min(v for v, m in states.items() if m.get(rid, 0) == lowest))
            needing = [v for v, m in states.items() if m.get(rid, 0) < gen]
            until = stamps[max(needing)] + 5 if needing and stamps[max(needing)] is not None else None
            assert r.held_until(rid, gen, timedelta(seconds=5)) == until
            older = [m.get(rid, 0) for v, m in states.items() if v < before]
            assert r.lowest_before(rid, before) == (min(older) if older else None)


def _sealed_with_gaps(d, every, split, gone):
    """A history whose first `split` versions, less `gone`, are sealed (None: nothing to seal)."""
    older = every.select(i for i in range(min(split, len(every) - 1)) if every.versions[i] not in gone)
    if not len(older):
        return None
    loc = open_store(os.path.join(d, "gaps"))
    part, raw = fact_segments.seal(older)
    loc.store.put(part.key, raw)
    return history.VersionHistory(tail=every.select(range(min(split, len(every) - 1), len(every))), sealed=part,
                                  loc=loc)


def test_the_table_is_opened_at_the_newest_known_version_only_while_it_is_the_latest(tmp_path):
    """GC opens the table by the version its probe found newest (one manifest read, where
    opening the latest lists `_versions/`); a version committed since, or a hint no version
    answers (a table re-created shorter), opens the latest as before."""
    loc, w = _history(tmp_path, cycles=1)
    latest = table.open_dataset(loc).version
    assert table.open_latest(loc, latest).version == latest
    assert table.open_latest(loc, None).version == latest
    assert table.open_latest(loc, latest - 1).version == latest  # a version landed above the hint
    assert table.open_latest(loc, latest + 5).version == latest  # no such version (re-created shorter)
    w.write_round(12, puts_per_batch=50)
    mark_merged(loc, w.regions.values())
    forget_process()
    res = gc.run_gc(loc, KEEP)
    assert res.plan.table_version == latest + 1 and res.plan.history.summary == "used"


# ------------------------------------------------------------------------------------------------
# The older versions sealed apart from the summary's tail.


def _sealed_objects(loc) -> list[str]:
    return [o.key for o in loc.store.list(fact_segments.DIR)]


def test_older_versions_are_sealed_and_read_only_when_asked(tmp_path, monkeypatch):
    """Past `TAIL_MAX` versions the summary keeps its newest `TAIL_KEEP` as columns and seals the
    older ones in an object of their own; a pass between listings plans from the summary's tail
    and the sealed part's aggregates without reading that object, and decides as a full read
    does. Sealing again replaces the object (the earlier one is removed)."""
    monkeypatch.setattr(fact_segments, "TAIL_MAX", 4)
    monkeypatch.setattr(fact_segments, "TAIL_KEEP", 2)
    loc, w = _history(tmp_path, cycles=4)
    forget_process()
    gc.run_gc(loc, KEEP)
    first = _sealed_objects(loc)
    summary = history.decode_summary(loc.store.get(layout.GC_VERSIONS_KEY))
    assert len(first) == 1 and summary.sealed is not None and summary.sealed.key == first[0]
    assert len(summary.facts) == 2 and summary.sealed.count + 2 == len(table.open_dataset(loc).versions())
    reads = []
    monkeypatch.setattr(fact_segments, "unseal", lambda part, raw, f=fact_segments.unseal: reads.append(part) or f(part, raw))
    quiet = 0
    for _ in range(4):
        w.write_round(12, puts_per_batch=50)
        mark_merged(loc, sorted(w.regions.values()))
        forget_process()
        before, n = _sealed_objects(loc), len(reads)
        r = gc.run_gc(loc, KEEP)
        assert not r.plan.history.listed and r.plan.history.read >= 1
        if _sealed_objects(loc) == before:  # not sealed again: the sealed versions were not read
            assert len(reads) == n, "a pass between listings read the sealed versions"
            quiet += 1
    assert 0 < quiet < 4 and reads  # sealing again reads them once
    assert len(r.plan.retained_versions) == len(table.open_dataset(loc).versions())
    assert _sealed_objects(loc) != first and len(_sealed_objects(loc)) == 1  # sealed again; the earlier one gone
    assert_same_decision(loc, KEEP)
    assert_same_decision(loc, COLLECT)
    assert reads  # the full-scan plans read them


@pytest.mark.parametrize("damage", ["gone", "garbled", "another"])
def test_a_sealed_object_that_cannot_be_read_is_read_around(tmp_path, monkeypatch, damage, caplog):
    """A sealed object that is gone, garbled, or not the one the summary names (its bytes are not
    its name's) is read around: the versions it held are read from their manifests, the decision
    is a full read's, and the next pass seals them again."""
    monkeypatch.setattr(fact_segments, "TAIL_MAX", 4)
    monkeypatch.setattr(fact_segments, "TAIL_KEEP", 2)
    loc, w = _history(tmp_path, cycles=4)
    forget_process()
    gc.run_gc(loc, KEEP)
    key = _sealed_objects(loc)[0]
    if damage == "gone":
        loc.store.delete_many([key])
    elif damage == "garbled":
        garble(loc, key, "body")
    else:  # another table's sealed facts under this name
        other, _ = _history(tmp_path / "other", cycles=4)
        forget_process()
        gc.run_gc(other, KEEP)
        loc.store.put(key, other.store.get(_sealed_objects(other)[0]))
    assert_same_decision(loc, KEEP)
    assert "could not be used" in caplog.text
    if damage != "garbled":  # a pass between listings that needs the sealed facts seals them again
        forget_process()
        h = history.read_history(loc, interval=3600)
        assert not h.listed and not h.changed and h.sealed is not None
        assert len(h.full()) == h.count and h.changed
        history.save_summary(loc, h)
        part = history.decode_summary(loc.store.get(layout.GC_VERSIONS_KEY)).sealed
        assert _sealed_objects(loc) == [part.key]  # the same facts: the same name, its bytes good again
        assert len(fact_segments.unseal(part, loc.store.get(part.key))) == part.count
    forget_process()
    gc.run_gc(loc, KEEP_SCANNING)  # a listing pass: the versions read again, sealed again
    assert len(_sealed_objects(loc)) == 1
    part = history.decode_summary(loc.store.get(layout.GC_VERSIONS_KEY)).sealed
    assert fact_segments.unseal(part, loc.store.get(part.key))
    assert_same_decision(loc, COLLECT)


def _region_state(loc, rid: str) -> tuple[int, int]:
    """What a live writer changes in its region: the manifest version, the WAL entries."""
    return region.load_latest(loc.store, rid).version, len(list(loc.store.list(layout.wal_dir(rid))))


def _same_decision_once_settled(loc, rid: str, writer, config: gc.GcOptions = KEEP) -> None:
    """`assert_same_decision` on a state the live writer is not changing: its plans are made one
    after the other, and a flush landing between them (the writer flushes in the background)
    would compare two states. Waits for the flushes to finish, and compares again when the
    region changed during the comparison."""
    deadline = time.monotonic() + 60
    while True:
        wait_flushed([writer], 60)
        before = _region_state(loc, rid)
        try:
            assert_same_decision(loc, config)
        except AssertionError:
            if _region_state(loc, rid) == before or time.monotonic() > deadline:
                raise
            continue
        return


def test_a_long_lived_writers_run_is_taken_from_its_first_entry(tmp_path, monkeypatch):
    """GC keeps the current writer epoch's entries; a long-lived writer's run grows with every
    flush. The next pass takes the run from the first position the last one found (no
    bisection), the region cache keeps no row per entry of the run, and the decision is a full
    read's. Once another writer fences it, the run is classified like any other."""
    loc, w = _history(tmp_path, cycles=2)
    value, rid = sorted(w.regions.items(), key=lambda x: x[1])[0]
    keys = [k for k, v in zip(range(5000, 8000), w.region_value(list(range(5000, 8000)))) if v == value]
    told = []
    monkeypatch.setattr(region_cache.Checked, "epoch_run",
                        lambda self, epoch, f=region_cache.Checked.epoch_run: told.append(f(self, epoch)) or told[-1])
    with table.open_dataset(loc).mem_wal_writer(rid, max_memtable_rows=8) as writer:
        for i in range(6):
            for j in range(3):
                writer.put(demo.rows_table([demo.row(k, 100 + i) for k in keys[(3 * i + j) * 4:(3 * i + j + 1) * 4]]))
            forget_process()
            gc.run_gc(loc, KEEP)
            epoch = region.load_latest(loc.store, rid).writer_epoch
            c = region_cache.load(loc.store, rid)
            if c.epoch_run is not None:
                assert c.epoch_run[1] == epoch
                assert not [p for p, r in c.rows.items() if r[1] == epoch and p > c.epoch_run[0]]
            _same_decision_once_settled(loc, rid, writer)
    assert any(p is not None for p in told), "no pass took the run from the cache"
    assert len(region_cache.load(loc.store, rid).rows) < 8
    w.write_round(12, puts_per_batch=50)  # a new writer: the run is of an older epoch now
    mark_merged(loc, sorted(w.regions.values()))
    forget_process()
    gc.run_gc(loc, KEEP)
    assert_same_decision(loc, KEEP)
    assert_same_decision(loc, COLLECT)


def test_a_recreated_tables_summary_takes_its_sealed_object_with_it(tmp_path, monkeypatch):
    """The table removed and created again at the same URI (`_memwal/` left): the summary of the
    old table is ignored, and its sealed object is removed once the new table's summary is
    written; the decision is a full read's."""
    monkeypatch.setattr(fact_segments, "TAIL_MAX", 4)
    monkeypatch.setattr(fact_segments, "TAIL_KEEP", 2)
    loc, w = _history(tmp_path, cycles=4)
    old = _sealed_objects(loc)
    assert old
    for d in ("_versions", "data", "_transactions", "_deletions", "_indices"):
        shutil.rmtree(os.path.join(loc.lance_uri, d), ignore_errors=True)
    loc, w = new_table(loc.lance_uri)
    assert_same_decision(loc, KEEP)
    forget_process()
    gc.run_gc(loc, KEEP)
    assert not set(old) & set(_sealed_objects(loc))
    assert_same_decision(loc, COLLECT)


def test_an_idle_regions_hold_is_ended_from_the_aggregates(tmp_path, monkeypatch):
    """A region whose last merge is older than the summary's tail (its table versions sealed,
    while another region keeps committing) has its time-travel hold's end told by the sealed
    part's aggregates: passes between listings do not read the sealed object for it."""
    monkeypatch.setattr(fact_segments, "TAIL_MAX", 4)
    monkeypatch.setattr(fact_segments, "TAIL_KEEP", 2)
    loc, w = new_table(str(tmp_path / "t"))
    w.write_round(12, puts_per_batch=50)
    mark_merged(loc, w.regions.values())
    busy = sorted(w.regions.values())[0]
    forget_process()
    gc.run_gc(loc, KEEP)
    reads = []
    monkeypatch.setattr(fact_segments, "unseal", lambda p, raw, f=fact_segments.unseal: reads.append(p) or f(p, raw))
    quiet = 0
    for _ in range(6):
        w.write_round(12, puts_per_batch=50)
        mark_merged(loc, [busy])
        forget_process()
        n, before = len(reads), _sealed_objects(loc)
        r = gc.run_gc(loc, KEEP)
        assert not r.plan.history.listed
        quiet += len(reads) == n or _sealed_objects(loc) != before  # sealing again reads them
    assert quiet == 6, "a pass between listings read the sealed versions for an idle region's hold"
    assert_same_decision(loc, KEEP)


def test_a_run_start_among_the_settled_rows_is_not_kept(tmp_path, caplog):
    """A pass that does not keep the current epoch's entries settles rows of that epoch; a later
    pass that keeps them finds the run starting among those rows: that start is not recorded (the
    cache would be refused on read), and the next passes use the cache."""
    loc, w = _history(tmp_path, cycles=2)
    value, rid = sorted(w.regions.items(), key=lambda x: x[1])[0]
    keys = [k for k, v in zip(range(5000, 8000), w.region_value(list(range(5000, 8000)))) if v == value]
    off = dataclasses.replace(KEEP, keep_current_epoch_wal=False)
    with table.open_dataset(loc).mem_wal_writer(rid, max_memtable_rows=8) as writer:
        for i in range(4):
            for j in range(3):
                writer.put(demo.rows_table([demo.row(k, 100 + i) for k in keys[(3 * i + j) * 4:(3 * i + j + 1) * 4]]))
            forget_process()
            gc.run_gc(loc, off if i < 2 else KEEP)
            assert region_cache.load(loc.store, rid) is not None
            _same_decision_once_settled(loc, rid, writer, off if i < 2 else KEEP)
    assert "a bad current epoch run" not in caplog.text


@pytest.mark.parametrize("record", [
    b"[" * 200_000 + b"\nx",                                    # deep nesting before any checksum
    b"[" * 200_000,
    b'{"format": 3, "sha256": "0", "body": 5}',                 # no raw bytes
    b"\x00" * 10,
    b"{" + b" " * 10_000 + b"\n",                               # a header line past its bound
])
def test_hostile_records_are_read_around(tmp_path, record):
    """Whatever bytes a cache holds, reading it raises nothing but a ValueError, and a pass reads
    around it."""
    loc, w = _history(tmp_path, cycles=2)
    rid = sorted(w.regions.values())[0]
    for key, fmt in ((layout.GC_VERSIONS_KEY, history.FORMAT), (layout.gc_region_cache_key(rid), region_cache.FORMAT)):
        with pytest.raises(ValueError):
            sealed.unseal_blob(record, fmt)
        loc.store.put(key, record)
    loc.store.put(layout.GC_REFS_KEY, record)
    assert history.load_summary(loc)[1].startswith("ignored") and region_cache.load(loc.store, rid) is None
    assert_same_decision(loc, KEEP)


@pytest.mark.parametrize("change", [
    {"states": 2**70}, {"states": 10**12}, {"states": 9},
])
def test_a_summary_with_more_states_than_versions_is_refused(change):
    with pytest.raises(ValueError):
        history.decode(_columns(**change))


def test_a_sealed_part_with_a_time_past_any_float_is_refused():
    good = fact_segments.seal(fact_table.FactTable.of(
        [history.VersionFacts(v, 1, 1.0, 1.0e9 + v, {"a": v}) for v in range(1, 5)]))[0].to_json()
    assert fact_segments.SealedPart.from_json(good)
    for bad in ({"min_stamp": 10**400}, {"min_stamp": 5}, {"last_indexed": [4, 10**400]}, {"top": {"a": [1, 9, None]}},
                {"lowest": {"a": [1, 0]}}, {"key": "_memwal/gc_versions/../x.bin"}):
        with pytest.raises(ValueError):
            fact_segments.SealedPart.from_json(good | bad)


def test_a_sealed_object_left_by_a_crash_is_removed_by_the_next_listing(tmp_path, monkeypatch):
    """A crash between writing a sealed object and the summary naming it leaves an object no
    summary names: a pass that lists `_versions/` removes it, and keeps the one named."""
    monkeypatch.setattr(fact_segments, "TAIL_MAX", 4)
    monkeypatch.setattr(fact_segments, "TAIL_KEEP", 2)
    loc, w = _history(tmp_path, cycles=4)
    named = _sealed_objects(loc)
    stray = f"{fact_segments.DIR}/{'0' * 32}.bin"
    loc.store.put(stray, b"left by a crash")
    forget_process()
    gc.run_gc(loc, KEEP)  # between listings: left alone
    assert stray in _sealed_objects(loc)
    forget_process()
    gc.run_gc(loc, KEEP_SCANNING)
    assert _sealed_objects(loc) == [history.decode_summary(loc.store.get(layout.GC_VERSIONS_KEY)).sealed.key]
    assert named and stray not in _sealed_objects(loc)
    assert_same_decision(loc, COLLECT)
