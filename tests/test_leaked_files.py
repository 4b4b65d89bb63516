"""Leaked base-table files of lost commits (memwal_core/jobs/gc/leaks.py), on real pylance tables,
local and on S3 (moto).

The lost commits are real: a compaction Rewrite preempted by a delete that landed between its
plan and its commit (pylance leaves the rewritten fragment "in place for GC"), a merge_insert and
a scalar-index build abandoned at their manifest commit (data, deletion and index files written,
no manifest). GC (grace 0) must delete exactly the files no retained version references, keep
them while younger than the grace, and leave every retained version reading as before.
"""

from __future__ import annotations

import contextlib
import time

import lance
import pyarrow as pa
import pytest
from lance.optimize import Compaction

from memwal_core.jobs import gc
from memwal_core.jobs.gc import leaks
from memwal_core.state.store import open_store
from memwal_core.tools import demo


def _ds(loc, **kw):
    return lance.dataset(loc.lance_uri, storage_options=loc.storage_options or None, **kw)


def _files(loc) -> set[str]:
    return {o.key for d in leaks.LEAK_DIRS for o in loc.store.list(d)}


def _contents(loc) -> dict[int, list]:
    return {v["version"]: sorted(_ds(loc, version=v["version"]).to_table().to_pylist(), key=lambda r: r["id"])
            for v in _ds(loc).versions()}


class Abandoned(Exception):
    pass


@contextlib.contextmanager
def _abandon(version: int):
    """A commit lock that gives up: the commit's files are written, its manifest never is."""
    raise Abandoned(f"commit of version {version} abandoned")
    yield


def _lose_commits(loc) -> None:
    ds = _ds(loc)
    rows = ds.to_table().slice(0, 4)
    # 1. a compaction Rewrite preempted by a delete committed between its plan and its commit
    plan = Compaction.plan(ds, {"target_rows_per_fragment": 1_000_000, "materialize_deletions": True})
    rewrites = [t.execute(ds) for t in plan.tasks]
    _ds(loc).delete("id = 50021")  # a row of the last insert: its fragment is being rewritten
    with pytest.raises(OSError, match="conflict"):
        Compaction.commit(ds, rewrites)
    # 2. an upsert (updates two fragments' rows, inserts two) abandoned at its manifest commit
    lost = _ds(loc, commit_lock=_abandon)
    new = rows.slice(1, 3).set_column(0, rows.schema.field(0), pa.array([90001, 90002, 90003], pa.int64()))
    with pytest.raises(OSError):
        lost.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(
            pa.concat_tables([rows.slice(1, 3), new]))
    # 3. an index build abandoned at its commit
    with pytest.raises(Exception):
        _ds(loc, commit_lock=_abandon).create_scalar_index("n", "BTREE")


def _pylance_references(loc) -> set[str]:
    """Data and deletion files of every retained version, through pylance's own API."""
    out = set()
    for v in _ds(loc).versions():
        for f in _ds(loc, version=v["version"]).get_fragments():
            md = f.metadata
            out |= {f"data/{d.path}" for d in md.data_files()}
            if md.deletion_file is not None:
                out.add(md.deletion_file.path(f.fragment_id))
    return out


def test_lost_commits_leave_files_that_gc_collects_exactly(loc):
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=30, btree_index=True)
    for i in range(3):  # more fragments: the compaction has something to rewrite
        rows = _ds(loc).to_table().slice(0, 3)
        _ds(loc).insert(rows.set_column(0, rows.schema.field(0),
                                        pa.array([50_000 + 10 * i + j for j in range(3)], pa.int64())))
    before = _files(loc)
    committed_before = _pylance_references(loc)
    _lose_commits(loc)
    contents = _contents(loc)
    referenced = _pylance_references(loc)
    new = _files(loc) - before
    # The parser agrees with pylance on data and deletion files of every retained version.
    parsed_files, parsed_uuids = leaks._references(loc, leaks._manifests(loc))
    assert {k for k in parsed_files if not k.startswith("_transactions/")} == referenced
    assert {k for k in parsed_files if k.startswith("_transactions/")} <= _files(loc)
    # Expected leaks, decided independently: new data/deletion files no version references,
    # new index files of no index the manifests list.
    expected = {k for k in new if k.split("/")[0] in ("data", "_deletions") and k not in referenced}
    expected_index = {k for k in new if k.startswith("_indices/") and k.split("/")[1] not in parsed_uuids}
    assert any(k.startswith("data/") for k in expected) and any(k.startswith("_deletions/") for k in expected)
    assert expected_index, "the abandoned index build wrote no file: the scenario changed"
    assert committed_before <= referenced | before

    young = gc.plan_gc(loc, gc.GcOptions(leaked_file_grace_seconds=3600, cleanup_base_versions_floor_seconds=0))
    assert not young.leaked and young.kept.get(gc.KeepReason.LEAKED_YOUNG, 0) >= len(expected) + len(expected_index)

    plan = gc.plan_gc(loc, gc.GcOptions(leaked_file_grace_seconds=0, cleanup_base_versions_floor_seconds=0))
    assert not plan.region_errors
    planned = {k for i in plan.leaked for k in i.keys}
    leaked_txn = {k for k in planned if k.startswith("_transactions/")}
    assert planned - leaked_txn == expected | expected_index
    assert not leaked_txn & parsed_files
    assert all("no retained version references" in i.reason for i in plan.leaked)
    r = gc.execute_gc(loc, plan)
    assert r.leaked_objects == len(planned) and r.leaked_bytes == sum(i.bytes for i in plan.leaked) > 0
    assert r.counts()["leaked"] == len(plan.leaked) and not r.region_errors
    assert not (_files(loc) & planned)
    assert _contents(loc) == contents  # every retained version reads as before
    again = gc.plan_gc(loc, gc.GcOptions(leaked_file_grace_seconds=0, cleanup_base_versions_floor_seconds=0),
                       full_scan=True)  # the scan that just ran is not due again for an interval
    assert not again.leaked and again.leak_scan["versions_read"] == len(contents)


def test_an_unplaceable_manifest_stops_the_leak_scan(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    rows = _ds(loc).to_table().slice(0, 2)
    with pytest.raises(OSError):
        _ds(loc, commit_lock=_abandon).insert(rows.set_column(0, rows.schema.field(0), pa.array([7, 8], pa.int64())))
    assert gc.plan_gc(loc, gc.GcOptions(leaked_file_grace_seconds=0, cleanup_base_versions_floor_seconds=0)).leaked
    loc.store.put("_versions/d1.manifest", b"not a manifest memwal can place")
    plan = gc.plan_gc(loc, gc.GcOptions(leaked_file_grace_seconds=0, cleanup_base_versions_floor_seconds=0))
    assert not plan.leaked and "d1.manifest" in plan.region_errors[gc.LEAKS_KEY]
    # The scan's failure fails the step like a region's (a failure under LEAKS_KEY), and says so.
    assert [(f.region_id, f.step) for f in plan.failures] == [(gc.LEAKS_KEY, "gc")]
    res = gc.run_gc(loc, gc.GcOptions(leaked_file_grace_seconds=0, cleanup_base_versions_floor_seconds=0))
    assert res.metrics()["regions_failed"] == 1 and "leaked files not collected" in res.summary()
    off = gc.plan_gc(loc, gc.GcOptions(leaked_file_grace_seconds=0, cleanup_base_versions_floor_seconds=0, collect_leaked_files=False))
    assert not off.leaked and gc.LEAKS_KEY not in off.region_errors


def test_a_leaked_file_is_collected_within_the_full_scan_interval(tmp_path):
    """The leak scan runs once per `full_scan_interval_seconds` (between, a pass deletes no
    leaked file); a file a lost commit leaves after a scan is collected by the first pass after
    the interval: within the grace (0 here) plus the interval, plus the time to that pass. A dry
    run scans whenever it runs."""
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    cfg = gc.GcOptions(leaked_file_grace_seconds=0, cleanup_base_versions_floor_seconds=0, full_scan_interval_seconds=6)
    first = gc.run_gc(loc, cfg)
    assert "skipped" not in first.leak_scan and not first.region_errors
    before = _files(loc)
    rows = _ds(loc).to_table().slice(0, 2)
    with pytest.raises(OSError):
        _ds(loc, commit_lock=_abandon).insert(rows.set_column(0, rows.schema.field(0), pa.array([7, 8], pa.int64())))
    leaked_at = time.time()
    leaked = _files(loc) - before
    assert any(k.startswith("data/") for k in leaked)
    dry = gc.run_gc(loc, cfg, dry_run=True)
    assert {k for i in dry.plan.leaked for k in i.keys} == leaked and dry.leak_scan["versions_read"] >= 1
    skipped = 0
    while True:
        r = gc.run_gc(loc, cfg)
        assert not r.region_errors
        if r.leak_scan.get("skipped"):
            skipped += 1
            assert leaked <= _files(loc) and not r.leaked_objects
            assert 0 <= r.leak_scan["next_scan_in_seconds"] <= cfg.full_scan_interval_seconds
            assert time.time() - leaked_at < cfg.full_scan_interval_seconds + 5
            time.sleep(0.5)
            continue
        break
    assert skipped and r.leaked_objects == len(leaked) and not leaked & _files(loc)
    assert time.time() - leaked_at <= cfg.leaked_grace + cfg.full_scan_interval_seconds + 5
    after = gc.run_gc(loc, cfg)
    assert after.leak_scan.get("skipped")  # the scan that collected was recorded


def test_a_scan_whose_deletes_failed_is_not_recorded_and_the_next_pass_scans_again(tmp_path, monkeypatch):
    """A pass whose leak deletes fail reports it (under `LEAKS_KEY`) and does not record its
    scan: the next pass scans again at once (not an interval later) and collects them."""
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    before = _files(loc)
    rows = _ds(loc).to_table().slice(0, 2)
    with pytest.raises(OSError):
        _ds(loc, commit_lock=_abandon).insert(rows.set_column(0, rows.schema.field(0), pa.array([7, 8], pa.int64())))
    leaked = _files(loc) - before
    assert any(k.startswith("data/") for k in leaked)
    cfg = gc.GcOptions(leaked_file_grace_seconds=0, cleanup_base_versions_floor_seconds=0)  # full scans hourly
    real = loc.store.delete_many

    def refusing(keys):
        keys = list(keys)
        if any(k in leaked for k in keys):
            raise OSError("the store refused the delete")
        return real(keys)

    monkeypatch.setattr(loc.store, "delete_many", refusing)
    failed = gc.run_gc(loc, cfg)
    assert "skipped" not in failed.leak_scan and gc.LEAKS_KEY in failed.region_errors
    assert leaked <= _files(loc)
    monkeypatch.undo()
    again = gc.run_gc(loc, cfg)
    assert "skipped" not in again.leak_scan and not again.region_errors
    assert again.leaked_objects == len(leaked) and not leaked & _files(loc)
    assert gc.run_gc(loc, cfg).leak_scan.get("skipped")  # that scan was recorded
