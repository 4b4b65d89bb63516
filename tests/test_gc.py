"""The garbage collector against real pylance tables, real merges (Spark) and real index rebuilds.

Every test checks both sides: what GC must delete is gone, and everything a reader (LSM read
through pylance, time travel) or a writer (fencing, re-opening a region) still needs is there.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from datetime import timedelta

import lance
import pyarrow as pa
import pytest
from support.helpers import tree

from memwal_core.jobs import catchup, gc, merge, snapshot
from memwal_core.observe import reader
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, lifecycle, region, region_values, routing, table, value_records, wal
from memwal_core.state.lifecycle import Initialization
from memwal_core.state.lance_mem_wal import lsm_read
from memwal_core.state.store import open_store
from memwal_core.tools import demo

PROCS = os.path.join(os.path.dirname(__file__), "procs")

# Collect as soon as allowed: no age or grace, and the base table's old versions cleaned first.
FAST = gc.GcOptions(manifest_retention=3, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                   cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0)


# ---------------------------------------------------------------------------------- helpers

def as_dict(t: pa.Table) -> dict:
    return {r["id"]: r for r in t.to_pylist()}


def lsm_rows(loc) -> dict:
    return as_dict(reader.lsm_table(loc))



def wal_positions(loc, rid: str) -> list[int]:
    d = os.path.join(loc.store.root, layout.wal_dir(rid))
    return sorted(layout.parse_bitrev(f) for f in os.listdir(d)) if os.path.isdir(d) else []


def sentinels(loc, rid: str) -> set[int]:
    return {p for p in wal_positions(loc, rid) if wal.read_entry_meta(loc.store, rid, p).fence_sentinel}


def manifest_versions(loc, rid: str) -> list[int]:
    d = os.path.join(loc.store.root, layout.manifest_dir(rid))
    return sorted(v for v in (layout.parse_bitrev(f) for f in os.listdir(d)) if v)


def assert_listed_exist(loc) -> None:
    """No generation a region manifest lists is missing on disk (and each opens with Lance)."""
    for rid in region.list_regions(loc.store).region_ids:
        m = region.load_latest(loc.store, rid)
        for g in m.generations:
            key = layout.generation_dir(rid, g.path, g.generation)
            assert os.path.isdir(os.path.join(loc.store.root, key)), f"listed {key} is missing"
            lance.dataset(loc.child_uri(key)).count_rows()


def check_plan(loc, plan: gc.GcPlan) -> None:
    """An independent reading of the spec, applied to every item before it is executed."""
    ds = table.open_dataset(loc)
    state = table.read_memwal_state(loc, ds.version)
    gating = state.gating_indexes(list(catchup.base_indexes(ds)))
    retained = []
    for v in ds.versions():
        try:
            retained.append(table.read_memwal_state(loc, v["version"]).merged)
        except table.MemWalNotInitialized:
            pass
    manifests = {rid: region.load_latest(loc.store, rid) for rid in {i.region_id for i in plan.items}}
    for item in plan.items:
        rid = item.region_id
        m = manifests[rid]
        rdir = layout.region_dir(rid)
        assert all(layout.is_inside(k, rdir) for k in item.keys), item
        if item.kind == gc.GENERATION:
            g = item.number
            assert g <= state.merged.get(rid, 0), item
            assert all(g <= state.catchup.get(i, {}).get(rid, 0) for i in gating), item
            assert all(g <= merged.get(rid, 0) for merged in retained), item
        elif item.kind == gc.WAL:
            e = wal.read_entry_meta(loc.store, rid, item.number)
            assert not e.fence_sentinel and e.generation is not None, item
            assert item.number <= m.message.replay_after_wal_entry_position, item
            assert item.number < max(wal_positions(loc, rid)), item  # never the tail
            assert e.generation <= plan.regions[rid].limit, item
            if plan.config.keep_current_epoch_wal:
                assert e.writer_epoch < m.writer_epoch, item
        elif item.kind == gc.MANIFEST:
            assert item.number <= m.version - plan.config.manifest_retention, item
        else:
            name = item.path.rsplit("/", 1)[-1]
            assert name not in {g.path for g in m.generations} and item.number < m.current_generation, item


def put(writer, model: dict, first: int, n: int, version: int) -> None:
    rows = [demo.row(k, version) for k in range(first, first + n)]
    writer.put(demo.rows_table(rows))
    model.update({r["id"]: r for r in rows})


# ------------------------------------------------------------------------- shared template

@pytest.fixture(scope="module")
def merged_template(tmp_path_factory, spark):
    """A table with 4 regions: two rounds of writes merged, one more round pending.

    Tests copy it (a local Lance table copies with its relative paths) instead of merging again.
    """
    root = str(tmp_path_factory.mktemp("gc_template") / "t")
    loc = open_store(root)
    demo.create_table(loc, sharding="bucket", num_buckets=4, base_rows=30)
    w = demo.Workload(loc, seed=99, key_space=300, max_memtable_rows=30)
    for _ in range(2):
        w.write_round(100, overwrite=0.3, delete=0.05, puts_per_batch=10)
    assert not merge.merge(loc, spark).region_errors
    snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
    w.write_round(60, overwrite=0.3, puts_per_batch=10)
    return root, w.expected(), dict(w.regions)


def copy_template(merged_template, tmp_path):
    root, model, regions = merged_template
    dst = str(tmp_path / "t")
    shutil.copytree(root, dst)
    return open_store(dst), dict(model), regions


# ----------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("seed", [1, 2])
def test_randomized_interleaving(tmp_path, spark, seed):
    """Writes, merges, index rebuilds and GC interleaved: reads always equal the model."""
    rng = random.Random(seed)
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=30, btree_index=True)
    w = demo.Workload(loc, seed=seed, key_space=300, max_memtable_rows=30)
    deleted: collections.Counter = collections.Counter()
    for step in range(4):
        w.write_round(90, overwrite=0.3, delete=0.05, absent_delete=0.02, puts_per_batch=10)
        if step % 2 == 0 or rng.random() < 0.4:
            assert not merge.merge(loc, spark).region_errors
            snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
        if rng.random() < 0.6:
            catchup.run_catchup(loc)
        cfg = gc.GcOptions(manifest_retention=rng.choice([1, 3, 10]), manifest_min_age_seconds=0,
                          orphan_grace_seconds=0, keep_current_epoch_wal=rng.random() < 0.5)
        if rng.random() < 0.75:
            gc.cleanup_base_versions(loc, replace(cfg, cleanup_base_versions_older_than_seconds=0,
                                                      cleanup_base_versions_floor_seconds=0))
        keep = {rid: (sentinels(loc, rid), max(wal_positions(loc, rid))) for rid in w.regions.values()}
        before = tree(loc.store.root)
        plan = gc.plan_gc(loc, cfg)
        assert tree(loc.store.root) == before, "planning (a dry run) must touch nothing"
        assert not plan.region_errors
        check_plan(loc, plan)
        if rng.random() < 0.4:  # writers flush between plan and execute: the trim re-applies
            w.write_round(30, overwrite=0.3, puts_per_batch=10)
        result = gc.execute_gc(loc, plan)
        assert not result.region_errors and not result.skipped
        assert sorted(i.path for i in result.deleted) == sorted(i.path for i in plan.items)
        assert result.bytes_reclaimed == plan.bytes
        deleted.update(result.counts())
        assert lsm_rows(loc) == w.expected(), f"step {step}"
        assert_listed_exist(loc)
        for rid, (fences, tail) in keep.items():
            on_disk = set(wal_positions(loc, rid))
            assert fences <= on_disk and tail in on_disk  # fencing and the next position survive
        for item in plan.items:
            for k in item.keys:
                assert not os.path.exists(os.path.join(loc.store.root, k))
    assert deleted["generation"] > 0 and deleted["wal"] > 0 and deleted["manifest"] > 0, deleted
    # Everything merged, caught up and cleaned: only generations above the limit are left.
    assert not merge.merge(loc, spark).region_errors
    snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
    catchup.run_catchup(loc)
    gc.run_gc(loc, FAST)
    state = table.read_memwal_state(loc)
    for rid in w.regions.values():
        assert region.load_latest(loc.store, rid).generations == []
        assert state.merged[rid] >= 1
    assert as_dict(table.open_dataset(loc).to_table()) == w.expected() == lsm_rows(loc)


def test_time_travel_keeps_generations_until_version_cleanup(tmp_path, spark):
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=5, key_space=200, max_memtable_rows=30)
    w.write_round(80, overwrite=0.3, delete=0.05, puts_per_batch=10)
    merge.merge(loc, spark)
    snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
    first = gc.run_gc(loc, FAST)  # only the latest version is retained now
    assert first.counts()["generation"] > 0
    w.write_round(80, overwrite=0.3, delete=0.05, puts_per_batch=10)

    old_version = table.open_dataset(loc).version
    old_state = table.read_memwal_state(loc, old_version)
    old_manifests = region.load_many(loc.store, region.list_regions(loc.store).region_ids).manifests
    old_model = w.expected()
    needed = {(rid, g.generation) for rid, m in old_manifests.items() for g in m.generations
              if g.generation > old_state.merged.get(rid, 0)}
    assert needed

    merge.merge(loc, spark)
    snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
    w.write_round(40, puts_per_batch=10)
    keep_old = replace(FAST, cleanup_base_versions_older_than_seconds=None)  # the old version stays retained
    retained = len(lance.dataset(loc.lance_uri).versions())
    res = gc.run_gc(loc, keep_old)
    assert res.counts()["generation"] == 0 and res.retained_versions == retained > 1
    assert res.kept.get(gc.KeepReason.GENERATION_TIME_TRAVEL, 0) >= len(needed)
    # Each region's time-travel hold names the retained version that reads its generations, up to
    # the highest of them; no cleanup is configured, so the hold has no end.
    travel = {rid: h for rid, rp in res.plan.regions.items() for h in rp.holds
              if h.reason is gc.KeepReason.GENERATION_TIME_TRAVEL}
    assert {h.bound.table_version for h in travel.values()} == {old_version}
    for rid in {r for r, _ in needed}:
        assert travel[rid].highest >= max(g for r, g in needed if r == rid) and travel[rid].until is None
        assert travel[rid].bound.generation == old_state.merged.get(rid, 0)
    old_ds = lance.dataset(loc.lance_uri, version=old_version)
    assert as_dict(lsm_read(old_ds, reader.pending_snapshots(old_state, old_manifests))) == old_model
    assert lsm_rows(loc) == w.expected()

    res = gc.run_gc(loc, FAST)  # option 5: the old version is cleaned up, then its generations go
    assert res.base_cleanup["versions_after"] == res.retained_versions == 1
    assert res.base_cleanup["versions_before"] == retained == res.base_cleanup["old_versions"] + 1
    gone = {(i.region_id, i.number) for i in res.deleted if i.kind == gc.GENERATION}
    assert needed <= gone
    assert lsm_rows(loc) == w.expected()
    assert_listed_exist(loc)


def test_index_catchup_gates_generations(tmp_path, spark):
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20, btree_index=True,
                      maintained_indexes=["id_btree"])
    w = demo.Workload(loc, seed=8, key_space=200, max_memtable_rows=30)
    w.write_round(80, overwrite=0.3, puts_per_batch=10)
    merge.merge(loc, spark)
    snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
    merged1 = table.read_memwal_state(loc).merged
    res = gc.run_gc(loc, FAST)  # the index has not caught up: nothing merged may go
    assert res.counts()["generation"] == 0
    assert res.kept[gc.KeepReason.GENERATION_INDEX_BEHIND] == sum(merged1.values())
    assert {h.reason: h.generations for h in res.holds}["index_behind:id_btree"] == sum(merged1.values())

    catchup.run_catchup(loc)
    w.write_round(80, overwrite=0.3, puts_per_batch=10)
    merge.merge(loc, spark)  # merged moves on, catch-up stays at merged1
    snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
    state = table.read_memwal_state(loc)
    assert state.catchup["id_btree"] == merged1 != state.merged
    res = gc.run_gc(loc, FAST)
    gone = collections.defaultdict(set)
    for i in res.deleted:
        if i.kind == gc.GENERATION:
            gone[i.region_id].add(i.number)
    assert dict(gone) == {rid: set(range(1, g + 1)) for rid, g in merged1.items()}
    assert res.kept[gc.KeepReason.GENERATION_INDEX_BEHIND] == sum(state.merged[r] - merged1[r] for r in merged1)
    behind = [h for rp in res.plan.regions.values() for h in rp.holds if h.bound.index == "id_btree"]
    assert {(h.region_id, h.bound.generation) for h in behind} == {(r, g) for r, g in merged1.items()
                                                                   if state.merged[r] > g}
    assert lsm_rows(loc) == w.expected()
    assert_listed_exist(loc)


def test_orphans_grace_and_flush_in_progress(merged_template, tmp_path):
    loc, model, regions = copy_template(merged_template, tmp_path)
    rid = sorted(regions.values())[0]
    m = region.load_latest(loc.store, rid)
    rdir = layout.region_dir(rid)
    old = time.time() - 7200

    def orphan(name: str, age: float | None) -> str:
        d = f"{rdir}/{name}"
        for f in ("data/a.lance", "_versions/1.manifest"):
            loc.store.put(f"{d}/{f}", b"x" * 100)
            if age is not None:
                os.utime(os.path.join(loc.store.root, d, f), (age, age))
        return d

    young = orphan("0000000a_gen_1", None)
    stale = orphan("0000000b_gen_1", old)
    flushing = orphan(f"0000000c_gen_{m.current_generation}", old)  # a flush in progress
    bogus = orphan(f"tmp_gen_{m.current_generation - 1}", old)  # any *_gen_* name counts
    # (the default grace is 24 h); every pass sweeps (by default, once per full scan interval)
    cfg = gc.GcOptions(manifest_min_age_seconds=10**9, orphan_grace_seconds=3600, full_scan_interval_seconds=0)
    plan = gc.plan_gc(loc, cfg)
    orphans = {i.path for i in plan.items if i.kind == gc.ORPHAN}
    assert orphans == {stale, bogus}
    assert plan.kept[gc.KeepReason.ORPHAN_YOUNG] == 1 and plan.kept[gc.KeepReason.ORPHAN_FLUSH_IN_PROGRESS] == 1
    gc.execute_gc(loc, plan)
    exists = lambda d: os.path.isdir(os.path.join(loc.store.root, d))  # noqa: E731
    assert exists(young) and exists(flushing) and not exists(stale) and not exists(bogus)
    # Grace 0 takes the young one too, never the one being flushed.
    gc.run_gc(loc, replace(cfg, orphan_grace_seconds=0))
    assert not exists(young) and exists(flushing)
    assert lsm_rows(loc) == model

    # Listed between plan and execute (the Paimon race): the re-read manifest saves it.
    racer = orphan("0000000d_gen_1", old)
    plan = gc.plan_gc(loc, cfg)
    assert [i.path for i in plan.items if i.kind == gc.ORPHAN] == [racer]

    def list_it(msg: pb.RegionManifest) -> bool:
        msg.flushed_generations.add(generation=1, path="0000000d_gen_1")
        return True

    region.commit_next(loc.store, region.load_latest(loc.store, rid), list_it)
    res = gc.execute_gc(loc, plan)
    assert [i.path for i in res.skipped] == [racer] and exists(racer)


def test_unsafe_generation_paths_delete_nothing_outside(merged_template, tmp_path):
    loc, model, regions = copy_template(merged_template, tmp_path)
    rids = sorted(regions.values())
    outside = tmp_path / "t" / "x"  # where _mem_wal/{rid}/../../x points
    absolute = tmp_path / "abs"
    for d in (outside, absolute):
        d.mkdir()
        (d / "canary").write_text("keep me")
    bad = {rids[0]: "../../x", rids[1]: str(absolute)}
    for rid, path in bad.items():
        def corrupt(msg: pb.RegionManifest, path=path) -> bool:
            msg.flushed_generations[0].path = path
            return True
        region.commit_next(loc.store, region.load_latest(loc.store, rid), corrupt)
    before = {rid: tree(os.path.join(loc.store.root, layout.region_dir(rid))) for rid in bad}
    res = gc.run_gc(loc, FAST)
    assert (outside / "canary").read_text() == "keep me" and (absolute / "canary").exists()
    for rid, path in bad.items():
        err = res.region_errors[rid]
        assert rid in err and "corrupt manifest" in err and repr(path) in err
        assert tree(os.path.join(loc.store.root, layout.region_dir(rid))) == before[rid]
    # A corrupt manifest stays so until repaired: the failure says it is permanent.
    assert {f.region_id: (f.permanent, f.step, f.generation) for f in res.failures} == {
        rid: (True, "gc", None) for rid in bad}
    others = {i.region_id for i in res.deleted if i.kind == gc.GENERATION}
    assert others == set(rids[2:])


def test_unreadable_manifest_is_reported_and_untouched(merged_template, tmp_path):
    loc, model, regions = copy_template(merged_template, tmp_path)
    rids = sorted(regions.values())
    victim = rids[0]
    latest = region.load_latest(loc.store, victim).version
    with open(os.path.join(loc.store.root, layout.manifest_key(victim, latest)), "wb") as f:
        f.write(b"\x00\xffnot a manifest")
    vdir = os.path.join(loc.store.root, layout.region_dir(victim))
    before = tree(vdir)
    res = gc.run_gc(loc, FAST)
    assert victim in res.region_errors[victim] and "cannot be decoded" in res.region_errors[victim]
    assert [(f.region_id, f.permanent) for f in res.failures] == [(victim, True)]
    assert res.metrics()["regions_failed"] == 1 and "1 regions failed" in res.summary()
    assert tree(vdir) == before
    assert {i.region_id for i in res.deleted if i.kind == gc.GENERATION} == set(rids[1:])


def test_result_metrics_and_summary_say_what_was_deleted_and_kept(merged_template, tmp_path):
    """`metrics()` counts what the result lists as deleted and held; `summary()` is one line."""
    loc, _, _ = copy_template(merged_template, tmp_path)
    res = gc.run_gc(loc, FAST)
    m, c = res.metrics(), res.counts()
    assert m["objects_deleted"] == res.deleted_objects == sum(len(i.keys) for i in res.deleted)
    assert m["generations_deleted"] == c[gc.GENERATION] > 0 and m["manifests_deleted"] == c[gc.MANIFEST] > 0
    assert (m["wal_entries_deleted"], m["orphans_deleted"]) == (c[gc.WAL], c[gc.ORPHAN])
    assert m["bytes_reclaimed"] == sum(i.bytes for i in res.deleted) and m["regions_failed"] == len(res.failures) == 0
    assert m["kept"] == sum(res.kept.values()) > 0 and all(isinstance(v, (int, float)) for v in m.values())
    assert res.holds, "the template's last round is pending: its generations are held"
    assert {k.removeprefix("held_bytes/"): v for k, v in m.items() if k.startswith("held_bytes/")} == {
        h.reason: h.bytes for h in res.holds}
    text = res.summary()
    assert "\n" not in text and f"deleted {res.deleted_objects} objects" in text
    assert f"keeps {sum(h.generations for h in res.holds)} generations" in text
    dry = gc.run_gc(loc, FAST, dry_run=True)
    assert dry.metrics()["objects_planned"] == dry.plan.objects and "would delete" in dry.summary()


def test_keep_reasons_and_holds_are_typed_and_sum_per_name():
    """A keep reason is `kind:why` (its own string in JSON); holds of several regions sum per
    name (a gating index's name is part of it) and a time-travel hold ends when the last one does."""
    K = gc.KeepReason
    assert {k.kind for k in K} == set(gc.KINDS) | {"region"} and len({k.value for k in K}) == len(K)
    assert json.dumps({K.WAL_TAIL: 1}) == '{"wal:tail": 1}'

    def travel(rid, version, until):
        return gc.Hold(rid, gc.Bound(K.GENERATION_TIME_TRAVEL, 3, table_version=version), 2, 100, 5, until)

    holds = [travel("a", 7, 1000.0), travel("b", 8, 2000.0), travel("c", 8, None),
             gc.Hold("a", gc.Bound(K.GENERATION_INDEX_BEHIND, 1, index="i1"), 1, 10, 2),
             gc.Hold("b", gc.Bound(K.GENERATION_INDEX_BEHIND, 1, index="i2"), 4, 40, 5),
             gc.Hold("b", gc.Bound(K.GENERATION_NOT_MERGED, 5), 1, 1, 6)]
    got = {h.reason: h for h in gc.summarize_holds(holds)}
    assert list(got) == ["index_behind:i1", "index_behind:i2", "not_merged", "time_travel"]
    assert got["time_travel"] == gc.GcHold("time_travel", 6, 300, 3, 2000.0)
    assert got["index_behind:i2"] == gc.GcHold("index_behind:i2", 4, 40, 1, None)
    assert got["index_behind:i1"].keep_reason is K.GENERATION_INDEX_BEHIND
    assert "until 1970-01-01 00:33 UTC" in got["time_travel"].describe() and "until" not in got["not_merged"].describe()
    h = gc.Hold("a", gc.Bound(K.GENERATION_NOT_MERGED, 0))
    h.add(3, 10)
    h.add(2, 5)
    assert (h.generations, h.bytes, h.highest, h.name) == (2, 15, 3, "not_merged")


def test_crash_between_manifest_commit_and_delete(merged_template, tmp_path):
    loc, model, regions = copy_template(merged_template, tmp_path)
    gc.cleanup_base_versions(loc, FAST)
    expected_gone = {(i.region_id, i.path) for i in gc.plan_gc(loc, FAST).items if i.kind == gc.GENERATION}
    assert expected_gone
    p = subprocess.run([sys.executable, os.path.join(PROCS, "gc_proc.py"), loc.lance_uri, "--grace", "0",
                        "--min-age", "0", "--keep", "3"],
                       env={**os.environ, "MEMWAL_CRASH_AT": gc.CRASH_AFTER_MANIFEST_COMMIT},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 137, p.stderr[-3000:]
    leftovers = {(rid, path) for rid, path in expected_gone
                 if os.path.isdir(os.path.join(loc.store.root, path))
                 and path.rsplit("/", 1)[-1] not in {g.path for g in region.load_latest(loc.store, rid).generations}}
    assert leftovers  # unlisted, not deleted: the crash window
    assert lsm_rows(loc) == model  # the table reads correctly right after the crash
    assert_listed_exist(loc)
    # With the default grace the leftovers are young orphans and stay; with grace 0 they go (at
    # the next sweep: here at once, every pass sweeping).
    res = gc.run_gc(loc, replace(FAST, orphan_grace_seconds=3600))
    assert not {(i.region_id, i.path) for i in res.deleted} & leftovers
    res = gc.run_gc(loc, replace(FAST, full_scan_interval_seconds=0))
    assert {(i.region_id, i.path) for i in res.deleted if i.kind == gc.ORPHAN} >= leftovers
    assert not any(os.path.isdir(os.path.join(loc.store.root, path)) for _, path in expected_gone)
    assert lsm_rows(loc) == model
    assert_listed_exist(loc)


def _writer(loc, rid):
    return lance.dataset(loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=100)


@pytest.mark.parametrize("keep_current_epoch", [True, False])
def test_stale_writer_stays_fenced_after_gc(tmp_path, spark, keep_current_epoch):
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="unsharded", base_rows=10)
    model = as_dict(table.open_dataset(loc).to_table())
    rid = str(uuid.uuid4())
    with _writer(loc, rid) as w0:  # epoch 1
        put(w0, model, 100, 5, 1)
    a = _writer(loc, rid)  # epoch 2: its next WAL position will be B's fence sentinel
    put(a, model, 200, 3, 2)
    b = _writer(loc, rid)  # epoch 3: fences A, replays A's entry
    put(b, model, 300, 3, 3)
    b.close()
    with _writer(loc, rid) as c:  # epoch 4 (current): B's sentinel is not of the current epoch
        put(c, model, 400, 3, 4)
    fences = sentinels(loc, rid)
    assert len(fences) == 3
    assert not merge.merge(loc, spark).region_errors
    snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
    res = gc.run_gc(loc, replace(FAST, keep_current_epoch_wal=keep_current_epoch))
    assert res.counts()["wal"] > 0 and res.counts()["generation"] > 0
    with pytest.raises(OSError, match="fenced"):
        a.put(demo.rows_table([demo.row(900, 9)]))
    assert fences <= set(wal_positions(loc, rid))
    tail_before = max(wal_positions(loc, rid))
    try:
        a.close()
    except OSError:
        pass
    # A new writer after GC: next WAL positions continue past everything, data readable.
    with _writer(loc, rid) as d:
        put(d, model, 500, 4, 5)
    assert min(set(wal_positions(loc, rid)) - fences - {tail_before}) > tail_before
    assert lsm_rows(loc) == model
    assert_listed_exist(loc)


def test_writer_reopening_after_gc_appends_past_covered_positions(tmp_path, spark):
    """GC keeps the highest WAL position. A writer re-opening the region finds its next position
    from the hinted entry, else from the highest file: with the tail gone pylance 14.0.2 puts its
    fence sentinel at position 1 (below a live predecessor's next slot, so no collision) and
    only its data lands past `replay_after`. Here a writer then crashes; nothing is lost."""
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="unsharded", base_rows=5)
    model = as_dict(table.open_dataset(loc).to_table())
    rid = str(uuid.uuid4())
    with _writer(loc, rid) as w:  # one memtable, flushed at close: covers every entry
        for i in range(5):
            put(w, model, 100 + 5 * i, 5, 1)
    replay_after = region.load_latest(loc.store, rid).message.replay_after_wal_entry_position
    assert wal_positions(loc, rid) == list(range(1, replay_after + 1)) and replay_after >= 4
    merge.merge(loc, spark)
    snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
    res = gc.run_gc(loc, replace(FAST, keep_current_epoch_wal=False))
    assert res.counts()["wal"] == replay_after - 1  # all but the tail
    assert wal_positions(loc, rid) == [replay_after]
    p = subprocess.run([sys.executable, os.path.join(PROCS, "crash_writer.py"), loc.lance_uri, rid,
                        "700", "6", "7"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    model.update({k: demo.row(k, 7) for k in range(700, 706)})
    assert min(set(wal_positions(loc, rid)) - {replay_after}) > replay_after
    with _writer(loc, rid):  # replays the crashed writer's entries and flushes them
        pass
    assert lsm_rows(loc) == model


def test_pylance_fencing_relies_on_the_successor_sentinel(table_loc):
    """Why GC keeps every fence sentinel: without it a fenced writer's put succeeds (silently
    into a covered position that no replay reads). Watch this when pylance changes."""
    loc = table_loc
    demo.create_table(loc, sharding="unsharded", base_rows=1)
    rid = str(uuid.uuid4())
    a = _writer(loc, rid)
    a.put(demo.rows_table([demo.row(1, 1)]))
    before = set(wal_positions(loc, rid))
    b = _writer(loc, rid)
    (fence,) = set(wal_positions(loc, rid)) - before
    assert wal.read_entry_meta(loc.store, rid, fence).fence_sentinel
    b.put(demo.rows_table([demo.row(2, 2)]))
    b.close()
    os.unlink(os.path.join(loc.store.root, layout.wal_key(rid, fence)))
    a.put(demo.rows_table([demo.row(3, 3)]))  # accepted: the fence is gone
    assert fence in wal_positions(loc, rid)
    assert fence <= region.load_latest(loc.store, rid).message.replay_after_wal_entry_position
    with pytest.raises(OSError, match="fenced"):
        a.close()  # only the flush's manifest check notices


def test_manifest_retention_and_version_hint(table_loc):
    loc = table_loc
    demo.create_table(loc, sharding="unsharded", base_rows=5)
    rid = str(uuid.uuid4())
    model = as_dict(table.open_dataset(loc).to_table())
    for i in range(6):
        with _writer(loc, rid) as w:
            put(w, model, 100 + 10 * i, 3, i)
    latest = region.load_latest(loc.store, rid).version
    assert latest >= 10
    cfg = gc.GcOptions(manifest_retention=4, manifest_min_age_seconds=3600)
    plan = gc.plan_gc(loc, cfg)
    assert not plan.items and plan.kept[gc.KeepReason.MANIFEST_YOUNG] == latest - 4
    # A stale hint pointing at a version about to be deleted gets rewritten first.
    region.write_version_hint(loc.store, rid, 2)
    res = gc.run_gc(loc, replace(cfg, manifest_min_age_seconds=0))
    assert sorted(i.number for i in res.deleted) == list(range(1, latest - 3))
    assert manifest_versions(loc, rid) == list(range(latest - 3, latest + 1))
    assert region.read_version_hint(loc.store, rid) == latest
    assert region.load_latest(loc.store, rid).version == latest
    # A second run finds the prefix already gone (HEAD probes stop at the first missing one; the
    # directory is listed below that hole only after a delete that did not finish).
    loc.store.stats.clear()
    assert not gc.plan_gc(loc, replace(cfg, manifest_min_age_seconds=0)).items
    # regions, GC's intent markers, the markers of unverified merge commits; the retained base
    # versions are probed (jobs/gc/history.py), not listed, and neither the leaked-file scan nor
    # the orphan sweep (the region directory) is due (the run above did both)
    assert loc.store.stats["list"] == 3
    # A full scan: the region directory (the orphan sweep), the retained base versions
    # (_versions/, which the leaked-file scan starts from); and the leaked-file scan
    # (jobs/gc/leaks.py): _versions/ again (versions committed meanwhile), data/, _deletions/,
    # _transactions/, _indices/
    loc.store.stats.clear()
    assert not gc.plan_gc(loc, replace(cfg, manifest_min_age_seconds=0), full_scan=True).items
    assert loc.store.stats["list"] == 3 + 1 + 1 + 5
    # Without the hint: memwal lists, pylance still opens, writes and flushes.
    os.unlink(os.path.join(loc.store.root, layout.version_hint_key(rid)))
    assert region.load_latest(loc.store, rid).version == latest
    with _writer(loc, rid) as w:
        put(w, model, 900, 3, 9)
    m = region.load_latest(loc.store, rid)
    assert m.version > latest and m.writer_epoch == 7
    assert lsm_rows(loc) == model


def test_plan_to_dict_is_json(merged_template, tmp_path):
    loc, _, _ = copy_template(merged_template, tmp_path)
    plan = gc.plan_gc(loc, FAST)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["counts"]["manifest"] > 0 and d["retained_versions"] and not d["region_errors"] and not d["failures"]
    assert d["kept"] == {k.value: n for k, n in plan.kept.items()} and "manifest:latest" in d["kept"]
    before = tree(loc.store.root)
    res = gc.run_gc(loc, FAST, dry_run=True)
    # A dry run plans the base-version cleanup (Lance explains it) instead of running it.
    assert res.deleted == [] and res.base_cleanup["dry_run"] and res.plan.base_cleanup.versions
    assert tree(loc.store.root) == before
    d = json.loads(json.dumps(res.to_dict()))
    assert d["dry_run"] and len(d["planned"]) == len(res.plan.items)


def test_gc_on_s3(s3_table_loc, spark):
    """The same collection on an S3-protocol server: listings, batched deletes, conditional puts."""
    loc = s3_table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=13, key_space=200, max_memtable_rows=30)
    for _ in range(2):
        w.write_round(80, overwrite=0.3, delete=0.05, puts_per_batch=10)
    assert not merge.merge(loc, spark).region_errors
    snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
    w.write_round(40, puts_per_batch=10)
    res = gc.run_gc(loc, FAST)
    assert not res.region_errors
    assert res.counts()["generation"] > 0 and res.counts()["manifest"] > 0
    assert loc.store.stats["delete_batch"] >= 1
    for i in res.deleted:
        assert not any(True for _ in loc.store.list(i.path)) if i.kind == gc.GENERATION else \
            not loc.store.exists(i.path)
    for rid in w.regions.values():
        m = region.load_latest(loc.store, rid)
        assert region.read_version_hint(loc.store, rid) == m.version
        for g in m.generations:
            lance.dataset(loc.child_uri(layout.generation_dir(rid, g.path, g.generation)),
                          storage_options=loc.storage_options).count_rows()
    assert lsm_rows(loc) == w.expected()


def _external_snapshot_left_behind(tmp_path, seed: int = 5):
    """A bucketed table whose region values an external snapshot recorded, then a merge commit
    that left the snapshot file behind (pylance gives the MemWAL index a new uuid without it).
    Merge progress is committed without rows (`mark_merged`): what GC keeps is checked, not reads."""
    from support.gc_passes import mark_merged

    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=seed, key_space=200, max_memtable_rows=30)
    w.write_round(80, overwrite=0.3, puts_per_batch=10)
    mark_merged(loc, w.regions.values())
    assert snapshot.build_snapshot(loc, inline_threshold=0).external
    values = snapshot.recorded_values(loc, table.read_memwal_state(loc))  # the external file, readable now
    assert set(values) == set(w.regions.values())
    w.write_round(40, puts_per_batch=10)
    mark_merged(loc, w.regions.values())  # the next commit that changes the MemWAL index
    assert snapshot.recorded_values(loc, table.read_memwal_state(loc)) == {}  # the snapshot alone: gone
    return loc, w, values


def test_the_value_record_stands_in_for_an_external_snapshot_the_next_commit_left_behind(tmp_path):
    """pylance gives the MemWAL index a new uuid, without the external snapshot file the old one
    had, at the next commit that changes the index (a merge, an index catch-up, a new index).
    The index builder wrote each value it published to the lifetime's record under `_memwal/`
    first, so GC collects the merged generations all the same, and the merger and the next
    build still read the values (nothing is left to derive them from). Without the record the
    external snapshot never stands in: GC keeps the generations (found by the harness soak: GC
    planned while an external snapshot was readable, an index catch-up committed meanwhile)."""
    from support.gc_passes import mark_merged

    loc, w, values = _external_snapshot_left_behind(tmp_path)
    init = lifecycle.assess_table(loc).lifecycle.init
    assert init.known
    records = value_records.read(loc, init)
    assert not records.garbled and {rid: r.values for rid, r in records.values.items()} == values
    assert all(r.source.startswith("derived:gen_") for r in records.values.values())
    state = table.read_memwal_state(loc)
    assert snapshot.recorded_values(loc, state, init) == values
    res = gc.run_gc(loc, FAST)
    assert res.counts()["generation"] == sum(state.merged.values()) and not res.holds
    assert not any(g.generation <= state.merged[rid] for rid in values
                   for g in region.load_latest(loc.store, rid).generations)
    # What the merger routes by: the recorded values, though no merged generation is left.
    ds = table.open_dataset(loc)
    view = lifecycle.assess_table(loc)
    manifests = {rid: view.reads.manifests[rid] for rid in values}
    assert region_values.trusted_values(loc, view.state, ds, manifests, table.primary_key(ds), {},
                                        stale=view.lifecycle) == values
    res = snapshot.build_snapshot(loc, inline_threshold=0)  # reuses the records
    assert {rid: res.region_field_sources[rid] for rid in values} == \
        {rid: r.source for rid, r in records.values.items()}
    assert snapshot.recorded_values(loc, table.read_memwal_state(loc)) == values

    # Without the records, the external snapshot alone is left behind again and counts for nothing.
    shutil.rmtree(os.path.join(loc.lance_uri, layout.VALUE_RECORDS_DIR))
    w.write_round(40, puts_per_batch=10)
    mark_merged(loc, w.regions.values())
    assert snapshot.recorded_values(loc, table.read_memwal_state(loc), init) == {}
    listed = {rid: len(region.load_latest(loc.store, rid).generations) for rid in values}
    res = gc.run_gc(loc, FAST)
    assert res.counts()["generation"] == 0 and [h.reason for h in res.holds] == ["value_unrecorded"]
    assert {rid: len(region.load_latest(loc.store, rid).generations) for rid in values} == listed


def test_a_garbled_value_record_is_never_trusted(tmp_path):
    """A record that fails its checksum stands in for nothing: GC keeps that region's merged
    generations, the merger's read of recorded values gives the region no value and says its
    record is garbled (the merger walls it rather than route it by its pending rows), and the
    next index build, deriving the value again from those kept generations, replaces the
    record; then GC collects them."""
    loc, w, values = _external_snapshot_left_behind(tmp_path, seed=6)
    init = lifecycle.assess_table(loc).lifecycle.init
    bad, good = sorted(values)
    key = layout.value_record_key(init.table_version, bad)
    raw = bytearray(loc.store.get(key))
    raw[raw.index(b"region_spec_id") + 18] ^= 1  # one byte of the body: the checksum no longer matches
    loc.store.put(key, bytes(raw))
    assert set(value_records.read(loc, init).garbled) == {bad}
    state = table.read_memwal_state(loc)
    got = region_values.read_recorded(loc, state, init)
    assert set(got.garbled) == {bad} and key in got.garbled[bad] and got.values == {good: values[good]}
    listed = len(region.load_latest(loc.store, bad).generations)
    res = gc.run_gc(loc, FAST)
    assert [(h.reason, h.regions) for h in res.holds] == [("value_unrecorded", 1)]
    assert res.counts()["generation"] == state.merged[good]
    assert len(region.load_latest(loc.store, bad).generations) == listed
    res = snapshot.build_snapshot(loc, inline_threshold=0)
    assert res.region_field_sources[bad].startswith("derived:gen_") and not res.region_errors
    assert value_records.read(loc, init).values[bad].values == values[bad]
    assert snapshot.recorded_values(loc, table.read_memwal_state(loc), init) == values
    res = gc.run_gc(loc, FAST)
    assert res.counts()["generation"] == state.merged[bad] and not res.holds


def _ownership(loc, regions):
    """The merger's routing authority for a run planned over `regions` (what `execute_merge` starts with)."""
    from memwal_core.jobs.merge.owners import ownership_for_run

    ds = table.open_dataset(loc)
    state = table.read_memwal_state(loc, ds.version)
    lc = lifecycle.assess(loc, {}, current_version=ds.version, record=False)
    manifests = {rid: region.load_latest(loc.store, rid) for rid in regions}
    own, failures = ownership_for_run(loc, state, ds, ["id"], manifests, state.merged, {}, lc)
    return own, {f.region_id: f for f in failures}


def test_a_garbled_value_record_stops_its_own_region_only(tmp_path):
    """GC trimmed both regions' merged generations on their records' word, then one record goes
    bad: nothing repairs it (the next build derives only a provisional value, which is not
    recorded). The merger walls that region (permanent, naming the file and the repair) and
    merges the other by its recorded value; a garbled record of a region the table no longer
    has stops nothing; a region that would establish its value waits while the garbled one's
    value is unknown; once the operator deletes the record, both establish as before records."""
    loc, w, values = _external_snapshot_left_behind(tmp_path, seed=8)
    res = gc.run_gc(loc, FAST)
    assert not res.holds and res.counts()["generation"] == sum(table.read_memwal_state(loc).merged.values())
    init = lifecycle.assess_table(loc).lifecycle.init
    bad, good = sorted(values)
    key = layout.value_record_key(init.table_version, bad)
    raw = bytearray(loc.store.get(key))
    raw[raw.index(b"region_spec_id") + 18] ^= 1
    loc.store.put(key, bytes(raw))
    w.write_round(40, puts_per_batch=10)  # pending generations in both regions

    own, failures = _ownership(loc, values)
    assert set(failures) == {bad} and failures[bad].permanent
    assert key in failures[bad].reason and "delete" in failures[bad].reason
    assert own.own[good] == routing.value_key([values[good]["bucket"]]) and bad not in own.own

    ghost = str(uuid.UUID(int=0xDEAD, version=4))  # no such region
    loc.store.put(layout.value_record_key(init.table_version, ghost), b"garbage")
    assert set(_ownership(loc, values)[1]) == {bad}

    loc.store.delete_many([layout.value_record_key(init.table_version, good)])  # good would establish now
    own, failures = _ownership(loc, values)
    assert set(failures) == {bad, good} and failures[bad].permanent and not failures[good].permanent
    assert bad in failures[good].reason and "unknown" in failures[good].reason
    res = snapshot.build_snapshot(loc, inline_threshold=0)  # nothing durable to rewrite the record from
    assert {res.region_field_sources[rid].split(":")[0] for rid in values} == {"provisional"}
    assert set(value_records.read(loc, init, values).garbled) == {bad}
    assert set(_ownership(loc, values)[1]) == {bad, good}

    loc.store.delete_many([key])  # the operator's repair: the value is lost, the next rows establish it
    own, failures = _ownership(loc, values)
    assert failures == {} and own.own == {}


def test_a_lost_lifetime_walls_the_regions_whose_value_only_a_record_held(tmp_path):
    """GC trimmed the merged generations on the value records' word, then `_memwal/lifecycle.json`
    is garbled and the versions around the initialization are cleaned up: the lifetime is
    unknown, so no record can be matched to it, and nothing else gives the regions' values. The
    merger does not establish them from their next rows (which would vouch for themselves): it
    walls each such region, saying why and what the operator can do. A table without any value
    record behaves as before records existed: its regions establish their values."""
    from support.gc_passes import forget_process

    loc, w, values = _external_snapshot_left_behind(tmp_path, seed=9)
    res = gc.run_gc(loc, FAST)
    assert not res.holds and len(table.open_dataset(loc).versions()) == 1
    loc.store.put(layout.LIFECYCLE_KEY, b"{garbled")
    forget_process()
    assert not lifecycle.assess_table(loc, record=False).lifecycle.init.known
    w.write_round(40, puts_per_batch=10)  # pending generations in both regions
    own, failures = _ownership(loc, values)
    assert set(failures) == set(values) and all(f.permanent for f in failures.values())
    for f in failures.values():
        assert "unknown" in f.reason and layout.LIFECYCLE_KEY in f.reason and layout.VALUE_RECORDS_DIR in f.reason
    assert own.own == {}

    shutil.rmtree(os.path.join(loc.lance_uri, layout.VALUE_RECORDS_DIR))  # no record at all: as before them
    own, failures = _ownership(loc, values)
    assert failures == {} and own.own == {}


def test_no_value_record_is_used_while_the_initialization_is_unknown(tmp_path):
    """A table whose MemWAL initialization lies before its retained history (its versions
    cleaned up, no lifecycle record) cannot tell its lifetime from an earlier one: no record is
    read or written, and GC keeps the merged generations an external snapshot recorded."""
    from support.gc_passes import forget_process

    loc, w, values = _external_snapshot_left_behind(tmp_path, seed=7)
    ds = table.open_dataset(loc)
    ds.cleanup_old_versions(older_than=timedelta(0))
    assert [v["version"] for v in ds.versions()] == [ds.version]
    loc.store.delete_many([layout.LIFECYCLE_KEY])
    forget_process()
    init = lifecycle.assess_table(loc, record=False).lifecycle.init
    assert not init.known
    known = Initialization(init.table_version, 1.0, None, init.table_version)  # a record in its directory
    value_records.write(loc, known, sorted(values)[0], 1, {"bucket": 0}, "derived:gen_1", {"bucket": pa.int32()})
    assert value_records.read(loc, init).values == {}
    state = table.read_memwal_state(loc)
    assert snapshot.recorded_values(loc, state, init) == {}
    assert region_values.unrecorded_regions(loc, state, lifecycle.assess_table(loc).reads.manifests, init) \
        == set(values)
    res = gc.run_gc(loc, FAST)
    assert res.counts()["generation"] == 0 and [h.reason for h in res.holds] == ["value_unrecorded"]
    before = sorted(o.key for o in loc.store.list(layout.VALUE_RECORDS_DIR))
    res = snapshot.build_snapshot(loc, inline_threshold=0)
    assert all(res.region_field_sources[rid].startswith("derived:gen_") for rid in values)
    assert sorted(o.key for o in loc.store.list(layout.VALUE_RECORDS_DIR)) == before  # none written


def test_merged_generations_stay_until_a_snapshot_records_the_region_value(tmp_path, spark):
    """Without a recorded routing value the merged generations are the merger's only authority
    for what a region owns (a generation whose rows all route elsewhere is refused against
    them): GC keeps them, says why, and collects them once the index builder recorded it."""
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=21, key_space=200, max_memtable_rows=30)
    w.write_round(80, overwrite=0.3, puts_per_batch=10)
    assert not merge.merge(loc, spark).region_errors
    merged = table.read_memwal_state(loc).merged
    res = gc.run_gc(loc, FAST)
    assert res.counts()["generation"] == 0
    assert res.kept[gc.KeepReason.GENERATION_VALUE_UNRECORDED] == sum(merged.values())
    assert [h.reason for h in res.holds] == ["value_unrecorded"]
    snapshot.build_snapshot(loc)
    res = gc.run_gc(loc, FAST)
    assert res.counts()["generation"] == sum(merged.values()) and not res.holds
    assert lsm_rows(loc) == w.expected()

    # An unreadable snapshot records nothing as far as GC may assume; the lifetime's value
    # records still do (the builder wrote them before its commits). Without them, the next
    # merge's generations are held until a readable snapshot is built again (never trimmed on a guess).
    w.write_round(60, overwrite=0.3, puts_per_batch=10)
    assert not merge.merge(loc, spark).region_errors
    snapshot.build_snapshot(loc, inline_threshold=0)  # external: a file that can go bad
    state = table.read_memwal_state(loc)
    key = snapshot.external_key(str(uuid.UUID(bytes=state.index.uuid.uuid)))
    assert loc.store.exists(key)
    with open(os.path.join(loc.lance_uri, key), "wb") as f:
        f.write(b"not a lance file")
    with pytest.raises(snapshot.SnapshotError):
        snapshot.recorded_values(loc, table.read_memwal_state(loc))
    view = lifecycle.assess_table(loc)
    assert region_values.unrecorded_regions(loc, view.state, view.reads.manifests, view.lifecycle.init) == set()
    shutil.rmtree(os.path.join(loc.lance_uri, layout.VALUE_RECORDS_DIR))
    assert region_values.unrecorded_regions(loc, view.state, view.reads.manifests, view.lifecycle.init) \
        == set(w.regions.values())
    listed = {rid: len(region.load_latest(loc.store, rid).generations) for rid in w.regions.values()}
    res = gc.run_gc(loc, FAST)
    assert res.counts()["generation"] == 0 and [h.reason for h in res.holds] == ["value_unrecorded"]
    assert {rid: len(region.load_latest(loc.store, rid).generations) for rid in w.regions.values()} == listed
    assert lsm_rows(loc) == w.expected()
    snapshot.build_snapshot(loc)
    res = gc.run_gc(loc, FAST)
    assert res.counts()["generation"] == sum(listed.values()) and not res.holds
    assert lsm_rows(loc) == w.expected()

    # An unsharded table has no region value to lose: nothing is held for it.
    loc2 = open_store(str(tmp_path / "u"))
    demo.create_table(loc2, sharding="unsharded", base_rows=20)
    w2 = demo.Workload(loc2, seed=22, key_space=200, max_memtable_rows=30)
    w2.write_round(60, puts_per_batch=10)
    assert not merge.merge(loc2, spark).region_errors
    assert gc.run_gc(loc2, FAST).counts()["generation"] > 0
