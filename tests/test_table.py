"""memwal_core.state.table: reading the full MemWAL index details and replacing them safely.

The guarded replacement is tested against the hazards it exists for: a CreateIndex built from a
stale read silently erases merge progress that pylance recorded in between, and a commit that
overwrites the version a concurrent merge took loses that merge altogether.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import lance
import pyarrow as pa
import pytest
from lance.dataset import Index, LanceOperation
from lance.mem_wal import CompactedSsTable

from memwal_core.observe import reader
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import exclusive_commit, layout, region, table
from memwal_core.state.store import open_store
from memwal_core.tools import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCS = os.path.join(ROOT, "tests", "procs")


def rows(first: int, n: int, version: int):
    return demo.rows_table([demo.row(k, version) for k in range(first, first + n)])


def generation_rows(loc, rid: str, gen: region.Generation) -> pa.Table:
    t = lance.dataset(os.path.join(loc.lance_uri, layout.generation_dir(rid, gen.path, gen.generation))).to_table()
    return t.filter(pa.compute.invert(t.column("_tombstone"))).drop_columns(["_tombstone"])


def merge(loc, rid: str, gen: region.Generation) -> None:
    (lance.dataset(loc.lance_uri).merge_insert("id").when_matched_update_all()
     .when_not_matched_insert_all().mark_sstables_as_compacted([CompactedSsTable(rid, gen.generation)])
     .execute(generation_rows(loc, rid, gen)))


def lsm(loc) -> dict:
    return {r["id"]: r for r in reader.lsm_table(loc).to_pylist()}


def memwal_indices(loc) -> list:
    return [i for i in lance.dataset(loc.lance_uri).list_indices() if i["name"] == table.MEMWAL_INDEX_NAME]


@pytest.fixture
def written(table_loc):
    """A manual-sharding table whose one region has three flushed generations (no merge yet)."""
    ds = demo.create_table(table_loc, sharding="manual", base_rows=10)
    rid = str(uuid.uuid4())
    with ds.mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(0, 10, 1))      # overwrites the base rows
        w.put(rows(100, 10, 1))
        w.put(rows(105, 10, 2))
    model = {k: demo.row(k, 1) for k in list(range(0, 10)) + list(range(100, 105))}
    model.update({k: demo.row(k, 2) for k in range(105, 115)})
    m = region.load_latest(table_loc.store, rid)
    assert [g.generation for g in m.generations] == [1, 2, 3]
    return table_loc, rid, model


# =========================================================================== reading
def test_primary_key(table_loc, tmp_path):
    ds = demo.create_table(table_loc)
    assert table.primary_key(ds) == ["id"]
    pk = {"lance-schema:unenforced-primary-key": "true"}
    schema = pa.schema([pa.field("a", pa.string(), nullable=False, metadata=pk), pa.field("v", pa.int64()),
                        pa.field("b", pa.int32(), nullable=False, metadata=pk)])
    ds2 = lance.write_dataset(pa.table({"a": ["x"], "v": [1], "b": [2]}, schema=schema), str(tmp_path / "t2"))
    assert table.primary_key(ds2) == ["a", "b"]


def test_manifest_keys_are_the_files_lance_writes(written):
    loc, _, _ = written
    ds = lance.dataset(loc.lance_uri)
    for v in range(1, ds.version + 1):
        v2, v1 = table.manifest_keys(v)
        assert loc.store.exists(v2) and not loc.store.exists(v1)
        assert table.parse_index_section(table.read_manifest_bytes(loc, v), "t")[0] == v


def test_read_memwal_state_with_v1_manifest_names(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    ds = lance.write_dataset(rows(0, 5, 0), loc.lance_uri, enable_v2_manifest_paths=False)
    ds.initialize_mem_wal(unsharded=True)
    ds = lance.dataset(loc.lance_uri)
    assert loc.store.exists(f"_versions/{ds.version}.manifest")
    state = table.read_memwal_state(loc)
    assert state.table_version == ds.version and state.details.num_regions == 1


def test_read_memwal_state_versions_and_properties(written):
    loc, rid, _ = written
    before = table.read_memwal_state(loc)
    m = region.load_latest(loc.store, rid)
    merge(loc, rid, m.generations[0])
    after = table.read_memwal_state(loc)
    assert after.table_version == before.table_version + 1
    assert before.merged == {} and after.merged == {rid: 1}
    assert table.read_memwal_state(loc, before.table_version).raw_details == before.raw_details
    assert after.index.name == table.MEMWAL_INDEX_NAME
    assert str(uuid.UUID(bytes=after.index.uuid.uuid)) == memwal_indices(loc)[0]["uuid"]
    with pytest.raises(table.TableError, match="version 999 not found"):
        table.read_memwal_state(loc, 999)


# =========================================================================== guarded replacement
def _replace_op(read: table.MemWalState, details: pb.MemWalIndexDetails):
    """The same CreateIndex guarded_replace_details builds, for committing it unguarded."""
    old = Index(uuid=str(uuid.UUID(bytes=read.index.uuid.uuid)), name=table.MEMWAL_INDEX_NAME, fields=[],
                dataset_version=read.index.dataset_version, fragment_ids=set(),
                index_version=read.index.index_version)
    new = Index(uuid=str(uuid.uuid4()), name=table.MEMWAL_INDEX_NAME, fields=[],
                dataset_version=read.table_version, fragment_ids=set(), index_version=read.index.index_version,
                index_details=(table.MEMWAL_TYPE_URL, details.SerializeToString()))
    return LanceOperation.CreateIndex(new_indices=[new], removed_indices=[old])


def test_guarded_replace_loses_race_to_a_merge_and_unguarded_erases_it(written):
    loc, rid, model = written
    stale = table.read_memwal_state(loc)
    gens = region.load_latest(loc.store, rid).generations
    merge(loc, rid, gens[0])  # lands between our read and our commit
    merged_version = lance.dataset(loc.lance_uri).version
    assert merged_version == stale.table_version + 1
    progress = table.read_memwal_state(loc)
    assert progress.merged == {rid: 1}
    versions_before = sorted(os.listdir(os.path.join(loc.lance_uri, "_versions")))

    new_details = pb.MemWalIndexDetails()
    new_details.CopyFrom(stale.details)
    new_details.snapshot_ts_millis = 1_700_000_000_000

    with pytest.raises(table.LostRace) as e:
        table.guarded_replace_details(loc, stale, new_details)
    assert loc.lance_uri in str(e.value) and str(stale.table_version) in str(e.value)
    # Nothing was committed; merge progress is intact.
    assert lance.dataset(loc.lance_uri).version == merged_version
    assert sorted(os.listdir(os.path.join(loc.lance_uri, "_versions"))) == versions_before
    assert table.read_memwal_state(loc).raw_details == progress.raw_details
    assert lsm(loc) == model

    # The same commit, unguarded, is accepted by Lance and erases the merge progress.
    ds = lance.LanceDataset.commit(loc.lance_uri, _replace_op(stale, new_details),
                                   read_version=stale.table_version)
    assert ds.version == merged_version + 1
    erased = table.read_memwal_state(loc)
    assert erased.details.snapshot_ts_millis == 1_700_000_000_000
    assert erased.merged == {}  # generation 1's merge is no longer recorded
    assert ds.index_statistics(table.MEMWAL_INDEX_NAME)["num_compacted_sstables"] == 0


def test_guarded_replace_from_a_fresh_read(written):
    loc, rid, model = written
    gens = region.load_latest(loc.store, rid).generations
    merge(loc, rid, gens[0])
    base_rows = lance.dataset(loc.lance_uri).to_table().sort_by("id")
    fresh = table.read_memwal_state(loc)
    details = pb.MemWalIndexDetails()
    details.CopyFrom(fresh.details)
    details.snapshot_ts_millis = 1_700_000_000_123
    details.num_regions = 5

    v = table.guarded_replace_details(loc, fresh, details)
    assert v == fresh.table_version + 1
    ds = lance.dataset(loc.lance_uri)
    assert ds.version == v
    assert ds.to_table().sort_by("id") == base_rows  # data untouched
    state = table.read_memwal_state(loc)
    assert state.raw_details == details.SerializeToString()
    assert state.merged == {rid: 1}
    assert ds.index_statistics(table.MEMWAL_INDEX_NAME)["num_shards"] == 5
    assert ds.mem_wal_index_details()["num_shards"] == 5
    (idx,) = memwal_indices(loc)  # the old index entry was replaced, not duplicated
    assert idx["uuid"] != str(uuid.UUID(bytes=fresh.index.uuid.uuid))
    assert lsm(loc) == model

    # Writers keep working: the old region re-opened and a new one.
    with ds.mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(200, 4, 3))
        w.delete(pa.table({"id": pa.array([100], pa.int64())}))  # keys stay in their region
    rid2 = str(uuid.uuid4())
    with lance.dataset(loc.lance_uri).mem_wal_writer(rid2, max_memtable_rows=10) as w:
        w.put(rows(300, 3, 3))
    model.update({k: demo.row(k, 3) for k in list(range(200, 204)) + list(range(300, 303))})
    model.pop(100)
    assert region.load_latest(loc.store, rid).writer_epoch == 2
    assert lsm(loc) == model

    # A later merge marker keeps the replaced fields.
    merge(loc, rid, gens[1])
    later = table.read_memwal_state(loc)
    assert later.merged == {rid: 2}
    assert later.details.snapshot_ts_millis == 1_700_000_000_123 and later.details.num_regions == 5
    assert lance.dataset(loc.lance_uri).index_statistics(table.MEMWAL_INDEX_NAME)["num_shards"] == 5
    assert lsm(loc) == model


def test_two_guarded_replacements_from_one_read(written):
    loc, _, _ = written
    read = table.read_memwal_state(loc)
    first, second = pb.MemWalIndexDetails(), pb.MemWalIndexDetails()
    first.CopyFrom(read.details)
    second.CopyFrom(read.details)
    first.snapshot_ts_millis, second.snapshot_ts_millis = 1, 2
    assert table.guarded_replace_details(loc, read, first) == read.table_version + 1
    with pytest.raises(table.LostRace):
        table.guarded_replace_details(loc, read, second)
    assert table.read_memwal_state(loc).details.snapshot_ts_millis == 1
    assert lance.dataset(loc.lance_uri).version == read.table_version + 1


def test_merge_after_replacement_still_checks_staleness(written):
    """Marker checks keep working on replaced details: a stale marker is refused."""
    loc, rid, _ = written
    gens = region.load_latest(loc.store, rid).generations
    merge(loc, rid, gens[1])  # generations 1 and 2 merged at once (marker 2)
    fresh = table.read_memwal_state(loc)
    details = pb.MemWalIndexDetails()
    details.CopyFrom(fresh.details)
    details.snapshot_ts_millis = 42
    table.guarded_replace_details(loc, fresh, details)
    with pytest.raises(Exception, match="Stale SSTable compaction"):
        merge(loc, rid, gens[0])
    assert table.read_memwal_state(loc).merged == {rid: 2}


# =========================================================================== never overwrites a commit
def test_guarded_replace_never_overwrites_a_concurrent_merge(table_loc, tmp_path):
    """A merger in another process records generations 1..N while the details are replaced over
    and over from fresh reads: every generation it recorded is in some table version.

    Through a `commit_lock` (Lance: HEAD the manifest path, then a plain put) a merge whose
    manifest landed between the two was overwritten, its rows and its progress in no version
    (tests/procs/lance_commit_lock_overwrite.py); large details make that window wide, so this
    failed in most runs then. The replacement now takes its version with put-if-absent."""
    loc = table_loc
    first = demo.create_table(loc, sharding="unsharded", base_rows=5).version
    rid, key, count = str(uuid.uuid4()), 10_000, 60
    go = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, os.path.join(PROCS, "snapshot_merger.py"), loc.lance_uri, rid,
                             str(key), "1", str(count), str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    replaced, lost = 0, 0
    try:
        go.touch()
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            read = table.read_memwal_state(loc)
            details = pb.MemWalIndexDetails()
            details.CopyFrom(read.details)
            details.inline_snapshots = b"\0" * 16_000  # a slower manifest write: a wider window
            details.snapshot_ts_millis = replaced + 1
            try:
                table.guarded_replace_details(loc, read, details)
                replaced += 1
            except table.LostRace:
                lost += 1
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["merged"] == list(range(1, count + 1))
    recorded, rows_seen = set(), set()
    for v in range(first, lance.dataset(loc.lance_uri).version + 1):
        recorded.add(table.read_memwal_state(loc, v).merged.get(rid, 0))
        marker = lance.dataset(loc.lance_uri, version=v).to_table(columns=["n"], filter=f"id = {key}")
        rows_seen.update(marker.column("n").to_pylist())
    assert replaced >= 10 and lost >= 1, (replaced, lost)
    overwritten = sorted(set(range(1, count + 1)) - recorded)
    assert not overwritten, f"merges of generations {overwritten} are in no table version"
    assert rows_seen == set(range(1, count + 1))
    assert table.read_memwal_state(loc).merged == {rid: count}


def test_guarded_replace_refuses_a_version_taken_while_it_built(written, monkeypatch):
    """A merge committed after the replacement's manifest was built, before it is published:
    the replacement is refused (LostRace), the merge's version stays as the merge wrote it, and
    no transaction file of the refused commit is left."""
    loc, rid, model = written
    read = table.read_memwal_state(loc)
    gens = region.load_latest(loc.store, rid).generations
    details = pb.MemWalIndexDetails()
    details.CopyFrom(read.details)
    details.snapshot_ts_millis = 7
    txns_before = set(os.listdir(os.path.join(loc.lance_uri, "_transactions")))
    real_op = exclusive_commit.faults.op

    def merge_first(kind: str, torn=None) -> None:
        if kind.startswith("lance_commit memwal_index"):
            merge(loc, rid, gens[0])  # takes version read + 1 first
        real_op(kind, torn)

    monkeypatch.setattr(exclusive_commit.faults, "op", merge_first)
    with pytest.raises(table.LostRace):
        table.guarded_replace_details(loc, read, details)
    monkeypatch.undo()
    after = table.read_memwal_state(loc)
    assert after.table_version == read.table_version + 1 and after.merged == {rid: 1}
    assert after.details.snapshot_ts_millis == read.details.snapshot_ts_millis
    txns = set(os.listdir(os.path.join(loc.lance_uri, "_transactions"))) - txns_before
    assert len(txns) == 1  # the merge's own
    model.update({r["id"]: r for r in generation_rows(loc, rid, gens[0]).to_pylist()})
    assert lsm(loc) == model


def test_exclusive_commit_on_a_v1_named_table_publishes_only_the_transaction_and_the_manifest(tmp_path):
    """A table with Lance's V1 manifest naming (`_versions/N.manifest`): the commit takes version
    N+1 under that naming and adds exactly one transaction file and one manifest; a second
    commit from the same read version is refused and leaves nothing behind."""
    uri = str(tmp_path / "v1")
    lance.write_dataset(pa.table({"id": [1, 2]}), uri, enable_v2_manifest_paths=False)
    loc = open_store(uri)

    def files() -> set[str]:
        return {os.path.relpath(os.path.join(d, n), uri) for d, _, ns in os.walk(uri) for n in ns}

    def config(value: str):
        return LanceOperation.UpdateConfig(config_updates=LanceOperation.UpdateMap({"memwal.test": value}))

    before = files()
    assert exclusive_commit.commit_next_version(loc, 1, config("a"), "test") == 2
    added = files() - before
    assert os.path.join("_versions", "2.manifest") in added
    assert [f for f in added if f.startswith("_transactions")] and len(added) == 2, added
    ds = lance.dataset(uri)
    assert ds.version == 2 and ds.config()["memwal.test"] == "a"

    before = files()
    with pytest.raises(exclusive_commit.CommitRefused):
        exclusive_commit.commit_next_version(loc, 1, config("b"), "test")
    assert files() == before
    assert lance.dataset(uri).config()["memwal.test"] == "a" and lance.dataset(uri).version == 2
