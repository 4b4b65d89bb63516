"""Leaked-file GC (memwal_core/jobs/gc/leaks.py, planned with the rest of GC) never deletes what a
table needs.

Real pylance tables, no mocks. Each test names the promise it checks: GC never deletes what a
retained version or an in-flight commit needs.
"""

from __future__ import annotations

import os
import shutil
import time

import lance
import pyarrow as pa
import pytest

from memwal_core.jobs import gc
from memwal_core.jobs.gc import leaks
from memwal_core.state import table
from memwal_core.state.store import open_store
from memwal_core.tools import demo


def _age(root: str, sub: str, seconds: float) -> None:
    """Make every file under root/sub `seconds` old (time passing, not a change of content)."""
    t = time.time() - seconds
    for d, _, files in os.walk(os.path.join(root, sub)):
        for f in files:
            os.utime(os.path.join(d, f), (t, t))


def test_a_table_recreated_at_the_same_uri_keeps_its_only_data_file(tmp_path):
    """The references of manifests are cached per process by (uri, key, size). A table dropped
    and created again at the same URI (a reset, a re-load) has a manifest at the same key, often
    of the same size: the cache then answers with the old table's files, and the new table's
    only data file (referenced by its only version) is planned as leaked once the grace passes."""
    path = str(tmp_path / "t")
    lance.write_dataset(pa.table({"a": [1, 2, 3]}), path)
    first = leaks.plan_leaks(open_store(path), time.time(), 86400)
    assert first.error is None and first.leaks == []
    shutil.rmtree(path)
    lance.write_dataset(pa.table({"a": [1, 2, 3]}), path)  # same rows: same manifest size
    _age(path, "", 2 * 86400)  # two days later, same long-lived process
    scan = leaks.plan_leaks(open_store(path), time.time(), 86400)
    assert scan.error is None
    referenced = {f"data/{f.data_files()[0].path}" for f in lance.dataset(path).get_fragments()}
    assert not referenced & {lk.key for lk in scan.leaks}, (
        f"the latest version's data files planned as leaked: {[lk.key for lk in scan.leaks]}")


def test_lowering_the_orphan_grace_does_not_delete_an_applications_commit_in_flight(tmp_path):
    """An application appends to the base table the distributed way (files first, commit at the
    end, 20 minutes later: a Spark or Ray job); it takes no memwal lease. An operator lowered
    `gc.orphan_grace_seconds` to 10 minutes to reclaim region orphan directories sooner (no
    refusal: unlike the retention floor, it has no floor). Leaked base-table files have their own
    grace (`gc.leaked_file_grace_seconds`, a week, never below the retention floor), so the job's
    data file stays and its commit reads; one set below the floor waits for the floor."""
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    ds = table.open_dataset(loc)
    before, read_version = ds.count_rows(), ds.version
    existing = set(os.listdir(os.path.join(loc.lance_uri, "data")))
    frags = lance.fragment.write_fragments(ds.to_table(limit=1), loc.lance_uri)
    new = sorted(set(os.listdir(os.path.join(loc.lance_uri, "data"))) - existing)
    assert new
    for f in new:  # the job's first output is 20 minutes old by now
        t = time.time() - 1200
        os.utime(os.path.join(loc.lance_uri, "data", f), (t, t))
    r = gc.run_gc(loc, gc.GcOptions(orphan_grace_seconds=600))
    lance.LanceDataset.commit(loc.lance_uri, lance.LanceOperation.Append(frags), read_version=read_version)
    deleted = [i.path for i in r.deleted if i.kind == gc.LEAKED]
    assert not deleted, f"GC deleted the in-flight commit's files: {deleted}"
    assert lance.dataset(loc.lance_uri).count_rows() == before + 1
    # A grace set below the retention floor still waits for the floor (a commit in flight).
    assert gc.GcOptions(leaked_file_grace_seconds=600).leaked_grace == gc.GcOptions().cleanup_base_versions_floor_seconds


def test_a_detached_version_is_read_as_retained_and_does_not_stop_collection(tmp_path):
    """Lance writes a detached commit's manifest as `_versions/d{n}.manifest`. The scan refused
    that name (fail closed), so one detached version stopped leaked-file collection for good;
    a detached manifest is a manifest: its files are referenced, the rest of the table's leaks
    are collected."""
    path = str(tmp_path / "t")
    lance.write_dataset(pa.table({"a": [1, 2, 3]}), path)
    frags = lance.fragment.write_fragments(pa.table({"a": [4]}), path)
    detached = lance.LanceDataset.commit(path, lance.LanceOperation.Append(frags), read_version=1, detached=True)
    lost = lance.fragment.write_fragments(pa.table({"a": [5]}), path)  # a commit that never happened
    _age(path, "", 2 * 86400)
    scan = leaks.plan_leaks(open_store(path), time.time(), 86400)
    assert scan.error is None, scan.error
    planned = {lk.key for lk in scan.leaks}
    assert {f"data/{f.path}" for fr in lost for f in fr.data_files()} <= planned  # the lost commit's file
    kept = {f"data/{f.data_files()[0].path}" for f in detached.get_fragments()}
    assert not kept & planned, f"the detached version's files planned as leaked: {kept & planned}"
