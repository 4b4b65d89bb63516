"""MemWAL index builder (memwal_core.jobs.snapshot) against real pylance tables.

Regions are either written by pylance's own ShardWriter (demo workload, other processes) or,
where many are needed, region manifests committed with memwal's own manifest writer.
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
from lance.mem_wal import CompactedSsTable
from support.gc_passes import mark_merged
from support.procs import reaped

from memwal_core import faults
from memwal_core.jobs import gc, snapshot
from memwal_core.observe import reader
from memwal_core.options import GcOptions, SnapshotOptions
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, lifecycle, memwal_index, region, region_values, table, value_records
from memwal_core.tools import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCS = os.path.join(ROOT, "tests", "procs")
SNAPSHOT_FIELDS = ("snapshot_ts_millis", "num_regions", "inline_snapshots")


# ---------------------------------------------------------------------------------------------
# helpers


def synth_region(store, rid: str, *, version: int = 1, epoch: int = 1, replay: int = 0,
                 last_seen: int = 0, current_generation: int = 1, gens: tuple = (),
                 spec_id: int = 1, entries: dict[str, bytes] | None = None) -> pb.RegionManifest:
    """A region manifest written with memwal's own writer (put-if-absent + version hint)."""
    msg = pb.RegionManifest(version=version, writer_epoch=epoch,
                            replay_after_wal_entry_position=replay,
                            wal_entry_position_last_seen=last_seen,
                            current_generation=current_generation, region_spec_id=spec_id)
    msg.region_id.uuid = uuid.UUID(rid).bytes
    for g in gens:
        msg.flushed_generations.add(generation=g, path=f"{g:08x}_gen_{g}", physical_rows=g)
    for fid, raw in (entries or {}).items():
        msg.region_field_entries.add(field_id=fid, value=raw)
    assert store.put_if_absent(layout.manifest_key(rid, version), msg.SerializeToString())
    region.write_version_hint(store, rid, version)
    return msg


def without_snapshot(details: pb.MemWalIndexDetails) -> bytes:
    d = pb.MemWalIndexDetails()
    d.CopyFrom(details)
    for f in SNAPSHOT_FIELDS:
        d.ClearField(f)
    return d.SerializeToString()


def assert_rows_equal_manifests(loc, tbl: pa.Table, specs) -> None:
    assert tbl.schema.equals(memwal_index.snapshot_schema(list(specs)))
    rows = {str(uuid.UUID(bytes=r["region_id"])): r for r in tbl.to_pylist()}
    ids = region.list_regions(loc.store).region_ids
    assert sorted(rows) == sorted(ids)
    for rid in ids:
        m = region.load_latest(loc.store, rid)
        r = rows[rid]
        assert r["version"] == m.version
        assert r["region_spec_id"] == m.message.region_spec_id
        assert r["writer_epoch"] == m.message.writer_epoch
        assert r["replay_after_wal_entry_position"] == m.message.replay_after_wal_entry_position
        assert r["wal_entry_position_last_seen"] == m.message.wal_entry_position_last_seen
        assert r["current_generation"] == m.message.current_generation
        assert r["flushed_generations"] == [{"generation": g.generation, "path": g.path}
                                            for g in m.message.flushed_generations]


def run_py(args: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kw)


# ---------------------------------------------------------------------------------------------
# rows, storage, configuration


@pytest.mark.parametrize("sharding", ["bucket", "identity", "unsharded"])
@pytest.mark.parametrize("n", [1, 100, 101])
def test_rows_equal_manifests_inline_and_external(table_loc, sharding, n):
    loc = table_loc
    demo.create_table(loc, sharding=sharding, num_buckets=4, base_rows=5)
    before = table.read_memwal_state(loc)
    for i in range(n):
        synth_region(loc.store, str(uuid.UUID(int=i + 1, version=4)), version=1 + i % 3,
                     epoch=1 + i % 5, replay=i, last_seen=i + 1, current_generation=1 + i % 4,
                     gens=tuple(range(1, 1 + i % 4)))
    result = snapshot.build_snapshot(loc)
    assert result.num_regions == n and not result.region_errors
    assert result.inline == (n <= 100) and result.external == (n > 100)
    state = table.read_memwal_state(loc)
    assert state.table_version == result.table_version == before.table_version + 1
    assert state.details.num_regions == n
    assert abs(state.details.snapshot_ts_millis - time.time() * 1000) < 60_000
    assert state.details.HasField("inline_snapshots") == (n <= 100)
    idx_uuid = str(uuid.UUID(bytes=state.index.uuid.uuid))
    assert idx_uuid == result.index_uuid
    if n > 100:
        assert result.external_key == f"_indices/{idx_uuid}/index.lance"
        assert loc.store.exists(result.external_key)
    # configuration, merge progress and catch-up exactly as read
    assert without_snapshot(state.details) == without_snapshot(before.details)
    tbl = memwal_index.read_snapshot(loc, state)
    assert tbl.num_rows == n
    assert_rows_equal_manifests(loc, tbl, state.details.region_specs)
    # the table stays usable by pylance: details, stats, a writer on a new region, a merge
    ds = lance.dataset(loc.lance_uri)
    assert ds.mem_wal_index_details()["num_shards"] == n
    assert lance.dataset(loc.lance_uri).index_statistics(table.MEMWAL_INDEX_NAME)["num_shards"] == n


def test_field_columns_types(table_loc):
    loc = table_loc
    sch = pa.schema([pa.field("id", pa.int64(), nullable=False, metadata=demo.PK),
                     pa.field("name", pa.string())])
    ds = lance.write_dataset(pa.table({"id": [1], "name": ["a"]}, schema=sch), loc.lance_uri)
    ds.initialize_mem_wal(identity_column="name")
    rid = str(uuid.uuid4())
    with lance.dataset(loc.lance_uri).mem_wal_writer(rid) as w:
        w.put(pa.table({"id": [5, 6], "name": ["zed", "zed"]}, schema=sch))
    snapshot.build_snapshot(loc)
    tbl = memwal_index.read_snapshot(loc)
    assert tbl.schema.field("region_field_bucket").type == pa.string()
    assert tbl.column("region_field_bucket").to_pylist() == ["zed"]
    assert tbl.column(memwal_index.SOURCE_COLUMN).to_pylist() == ["provisional:gen_1"]  # generation 1 is not merged yet


@pytest.mark.parametrize("sharding", ["bucket", "identity", "unsharded", "manual"])
def test_region_field_values_from_real_writers(table_loc, sharding):
    loc = table_loc
    demo.create_table(loc, sharding=sharding, num_buckets=4, base_rows=10)
    w = demo.Workload(loc, seed=3, key_space=6 if sharding == "identity" else 500,
                      max_memtable_rows=60)
    w.write_round(120, delete=0.05)
    w.write_round(60)
    result = snapshot.build_snapshot(loc)
    assert result.num_regions == len(w.regions) and not result.region_field_problems
    tbl = memwal_index.read_snapshot(loc)
    assert_rows_equal_manifests(loc, tbl, table.read_memwal_state(loc).details.region_specs)
    got = {str(uuid.UUID(bytes=r["region_id"])): r for r in tbl.to_pylist()}
    for value, rid in w.regions.items():
        r = got[rid]
        if sharding == "manual":
            assert r["region_spec_id"] == 0 and r[memwal_index.SOURCE_COLUMN] == "none"
            assert not [c for c in r if c.startswith(memwal_index.REGION_FIELD_PREFIX)]
        elif sharding == "unsharded":
            assert (r["region_field_bucket"], r[memwal_index.SOURCE_COLUMN]) == (0, "derived:unsharded")
        else:
            assert r["region_field_bucket"] == value
            assert r[memwal_index.SOURCE_COLUMN] == "provisional:gen_1"  # not merged yet
    expected = region_values.snapshot_field_values(tbl)
    if sharding == "manual":
        assert expected == {}
    else:
        assert expected == {rid: {"bucket": 0 if sharding == "unsharded" else value}
                            for value, rid in w.regions.items()}
    # a second build reuses the derived values (same sources, no problems)
    again = snapshot.build_snapshot(loc)
    assert again.region_field_sources == result.region_field_sources
    assert memwal_index.read_snapshot(loc).column("region_field_bucket" if sharding != "manual"
                                              else "region_id").equals(
        tbl.column("region_field_bucket" if sharding != "manual" else "region_id"))


def test_misrouted_rows_give_no_value(table_loc):
    loc = table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=4)
    w = demo.Workload(loc)
    keys = list(range(40))
    buckets = w.region_value(keys)
    assert len(set(buckets)) > 1
    rid = str(uuid.uuid4())
    with lance.dataset(loc.lance_uri).mem_wal_writer(rid) as writer:  # pylance does not check routing
        writer.put(demo.rows_table([demo.row(k, 1) for k in keys]))
    result = snapshot.build_snapshot(loc)
    assert result.region_field_sources[rid] == "unknown"
    assert "disagree" in result.region_field_problems[rid]
    assert memwal_index.read_snapshot(loc).column("region_field_bucket").to_pylist() == [None]


def test_value_from_manifest_entries_and_missing_generation(table_loc):
    loc = table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=8)
    a, b, c = (str(uuid.UUID(int=i, version=4)) for i in (1, 2, 3))
    synth_region(loc.store, a, entries={"bucket": (5).to_bytes(4, "little", signed=True)})
    synth_region(loc.store, b, gens=(1,))  # generation directory does not exist
    synth_region(loc.store, c)  # nothing flushed yet
    result = snapshot.build_snapshot(loc)
    assert result.region_field_sources == {a: "manifest", b: "unknown", c: "unknown"}
    assert b in result.region_field_problems and c not in result.region_field_problems
    vals = {str(uuid.UUID(bytes=r["region_id"])): r["region_field_bucket"]
            for r in memwal_index.read_snapshot(loc).to_pylist()}
    assert vals == {a: 5, b: None, c: None}


def test_broken_region_is_reported_and_left_out(table_loc):
    loc = table_loc
    demo.create_table(loc, sharding="bucket")
    good = [str(uuid.uuid4()) for _ in range(3)]
    for rid in good:
        synth_region(loc.store, rid)
    bad = str(uuid.uuid4())
    loc.store.put(layout.manifest_key(bad, 1), b"\xff\xff not a manifest")
    empty = str(uuid.uuid4())
    os.makedirs(os.path.join(loc.store.root, layout.region_dir(empty)))  # no manifest at all
    os.makedirs(os.path.join(loc.store.root, layout.MEM_WAL_DIR, "not-a-uuid"))
    result = snapshot.build_snapshot(loc)
    assert result.num_regions == 3
    assert set(result.region_errors) == {bad, empty}
    assert "cannot be decoded" in result.region_errors[bad]
    assert [n for n, _ in result.skipped_dirs] == ["not-a-uuid"]
    got = sorted(str(uuid.UUID(bytes=b)) for b in memwal_index.read_snapshot(loc).column("region_id").to_pylist())
    assert got == sorted(good)
    # the same two regions as typed failures, in every form a caller reads
    assert [f.region_id for f in result.failures] == sorted([bad, empty])
    assert all(f.step == "snapshot" and f.reason == result.region_errors[f.region_id] for f in result.failures)
    assert result.metrics()["regions_failed"] == 2 and "2 regions failed" in result.summary()
    assert [d["region"] for d in result.to_dict()["region_failures"]] == sorted([bad, empty])


def test_zero_regions_and_dry_run(table_loc):
    loc = table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=4)
    v0 = lance.dataset(loc.lance_uri).version
    dry = snapshot.build_snapshot(loc, dry_run=True)
    assert dry.dry_run and dry.storage == "none" and dry.table_version == v0 and "dry run" in dry.summary()
    assert lance.dataset(loc.lance_uri).version == v0
    with pytest.raises(memwal_index.SnapshotNotFound):  # pylance's initialize_mem_wal stores none
        memwal_index.read_snapshot(loc)
    result = snapshot.build_snapshot(loc)
    assert result.num_regions == 0 and result.inline
    state = table.read_memwal_state(loc)
    assert state.details.num_regions == 0 and state.details.HasField("inline_snapshots")
    tbl = memwal_index.read_snapshot(loc, state)
    assert tbl.num_rows == 0 and "region_field_bucket" in tbl.column_names


def test_configuration_merge_progress_and_catchup_kept(table_loc):
    loc = table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20, btree_index=True,
                      maintained_indexes=["id_btree"])
    w = demo.Workload(loc, max_memtable_rows=60)
    w.write_round(80)
    rid = sorted(w.regions.values())[0]
    ds = lance.dataset(loc.lance_uri)
    (ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
     .mark_sstables_as_compacted([CompactedSsTable(rid, 1)]).execute(demo.rows_table([demo.row(3, 9)])))
    lance.dataset(loc.lance_uri).optimize.optimize_indices(index_names=["id_btree"])
    before = table.read_memwal_state(loc)
    assert before.merged == {rid: 1} and before.catchup == {"id_btree": {rid: 1}}
    snapshot.build_snapshot(loc)
    snapshot.build_snapshot(loc, inline_threshold=0)
    after = table.read_memwal_state(loc)
    assert without_snapshot(after.details) == without_snapshot(before.details)
    assert list(after.details.maintained_indexes) == ["id_btree"]
    # a later merge marker still lands on top of our details
    ds = lance.dataset(loc.lance_uri)
    (ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
     .mark_sstables_as_compacted([CompactedSsTable(rid, 2)]).execute(demo.rows_table([demo.row(4, 9)])))
    final = table.read_memwal_state(loc)
    assert final.merged == {rid: 2} and final.details.num_regions == after.details.num_regions


def test_lost_race_rebuilds_from_fresh_read(table_loc, monkeypatch):
    """A merge committing between the builder's read and its commit: retry, progress kept."""
    loc = table_loc
    demo.create_table(loc, sharding="unsharded", base_rows=5)
    rid = str(uuid.uuid4())
    for i in range(101):
        synth_region(loc.store, str(uuid.UUID(int=1000 + i, version=4)))
    real = table.guarded_replace_details
    calls = []

    def merge_then_commit(loc_, read, details, **kw):
        calls.append(kw.get("index_uuid"))
        if len(calls) == 1:
            ds = lance.dataset(loc.lance_uri)
            (ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
             .mark_sstables_as_compacted([CompactedSsTable(rid, 4)])
             .execute(demo.rows_table([demo.row(1, 4)])))
        return real(loc_, read, details, **kw)

    monkeypatch.setattr(table, "guarded_replace_details", merge_then_commit)
    result = snapshot.build_snapshot(loc)
    assert result.attempts == 2 and result.external
    assert table.read_memwal_state(loc).merged == {rid: 4}
    # the first attempt's external file was removed, the second one is the index's
    assert not loc.store.exists(memwal_index.external_key(calls[0]))
    assert loc.store.exists(result.external_key)

    def always_lose(loc_, read, details, **kw):
        calls.append(kw.get("index_uuid"))
        raise table.LostRace("simulated")

    monkeypatch.setattr(table, "guarded_replace_details", always_lose)
    synth_region(loc.store, str(uuid.UUID(int=5000, version=4)))  # a change: an unchanged snapshot commits nothing
    calls.clear()
    with pytest.raises(memwal_index.SnapshotError, match="gave up .* after 3 lost races"):
        snapshot.build_snapshot(loc, max_attempts=3)
    assert len(calls) == 3 and not any(loc.store.exists(memwal_index.external_key(u)) for u in calls)


# ---------------------------------------------------------------------------------------------
# WAL hints


def test_plan_writes_nothing_and_execute_raises_the_hints_it_found(table_loc):
    loc = table_loc
    demo.create_table(loc, sharding="unsharded", base_rows=10)
    rid = str(uuid.uuid4())
    w = lance.dataset(loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=1000)
    try:
        for i in range(3):
            w.put(demo.rows_table([demo.row(100 + i, 1)]))
        time.sleep(0.3)
        m0 = region.load_latest(loc.store, rid)
        v0 = table.open_dataset(loc).version
        plan = snapshot.plan_snapshot(loc, SnapshotOptions(inline_threshold=0))
        assert plan.hints == {rid: 3} and set(plan.rows) == {rid} and not plan.failures
        assert plan.to_dict()["hints"] == {rid: 3}
        assert region.load_latest(loc.store, rid).version == m0.version  # planning wrote nothing
        assert table.open_dataset(loc).version == v0
        with pytest.raises(memwal_index.SnapshotNotFound):
            memwal_index.read_snapshot(loc)
        result = snapshot.execute_snapshot(loc, plan)
        assert result.hints_updated == {rid: (m0.message.wal_entry_position_last_seen, 3)}
        assert result.committed and result.external  # the plan's options: inline_threshold 0
        row = memwal_index.read_snapshot(loc).to_pylist()[0]
        assert (row["version"], row["wal_entry_position_last_seen"]) == (m0.version + 1, 3)
    finally:
        w.close()


def test_hint_raised_only_field_changed(table_loc):
    loc = table_loc
    demo.create_table(loc, sharding="unsharded", base_rows=10)
    rid = str(uuid.uuid4())
    w = lance.dataset(loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=1000)
    try:
        for i in range(4):
            w.put(demo.rows_table([demo.row(100 + i, 1)]))
        time.sleep(0.3)
        m0 = region.load_latest(loc.store, rid)
        result = snapshot.build_snapshot(loc)
        old, new = result.hints_updated[rid]
        assert old == m0.message.wal_entry_position_last_seen and new == 4
        m1 = region.load_latest(loc.store, rid)
        assert m1.version == m0.version + 1
        expect = pb.RegionManifest()
        expect.CopyFrom(m0.message)
        expect.version, expect.wal_entry_position_last_seen = m1.version, 4
        assert m1.message == expect  # writer_epoch and everything else untouched
        row = memwal_index.read_snapshot(loc).to_pylist()[0]
        assert (row["version"], row["wal_entry_position_last_seen"]) == (m1.version, 4)
        assert snapshot.build_snapshot(loc).hints_updated == {}  # nothing newer now
        w.put(demo.rows_table([demo.row(200, 1)]))
    finally:
        w.close()
    assert sorted(reader.lsm_table(loc).column("id").to_pylist()) == list(range(10)) + [100, 101, 102, 103, 200]


def test_writer_in_other_process_flushes_while_builder_runs(table_loc, tmp_path):
    """A pylance ShardWriter flushing in another process during repeated builds: no error, no loss."""
    loc = table_loc
    demo.create_table(loc, sharding="unsharded", base_rows=10)
    rid = str(uuid.uuid4())
    ready = tmp_path / "ready"
    proc = run_py([os.path.join(PROCS, "snapshot_writer.py"), loc.lance_uri, rid, "1000", "120", "3",
                   "12", "0.01", str(ready)])
    builds, hints, external = 0, 0, 0
    try:
        deadline = time.time() + 30
        while not ready.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        while proc.poll() is None and time.time() < deadline:
            r = snapshot.build_snapshot(loc, inline_threshold=0 if builds % 2 else 100)
            builds += 1
            hints += len(r.hints_updated)
            external += r.external
            assert not r.region_errors
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    written = json.loads(out.strip().splitlines()[-1])
    assert builds >= 5 and hints >= 1, (builds, hints)
    m = region.load_latest(loc.store, rid)
    assert m.writer_epoch == 1  # the builder never claims or bumps the epoch
    assert len(m.generations) >= 10  # the writer flushed many times meanwhile
    got = {r["id"]: r["n"] for r in reader.lsm_table(loc).to_pylist()}
    assert got == {**{k: 0 for k in range(10)}, **{k: written["version"] for k in written["keys"]}}
    final = snapshot.build_snapshot(loc)
    assert_rows_equal_manifests(loc, memwal_index.read_snapshot(loc), table.read_memwal_state(loc).details.region_specs)
    assert final.num_regions == 1


# ---------------------------------------------------------------------------------------------
# the race with mergers in other processes


def _check_version(loc, version: int, regions: dict[str, int]) -> dict[str, int]:
    """merged_generations at `version` equal the marker rows' generations (highest merged)."""
    state = table.read_memwal_state(loc, version)
    ds = lance.dataset(loc.lance_uri, version=version)
    markers = {r["id"]: r["n"] for r in ds.to_table(columns=["id", "n"],
                                                    filter=f"id IN ({','.join(map(str, regions.values()))})").to_pylist()}
    expect = {rid: markers[key] for rid, key in regions.items() if key in markers}
    assert state.merged == expect, f"version {version}: merged {state.merged} != merged data {expect}"
    return state.merged


def test_race_builder_vs_merger_processes(table_loc, tmp_path):
    loc = table_loc
    demo.create_table(loc, sharding="unsharded", base_rows=30)
    regions = {str(uuid.uuid4()): 10_000, str(uuid.uuid4()): 20_000}  # region -> marker key
    for rid in regions:
        synth_region(loc.store, rid, current_generation=500)
    go, pace = tmp_path / "go", tmp_path / "builder_commits"
    per_merger, want_commits = 150, 24  # the mergers wait for the builder (pace): >= 20 commits in the race
    seen: dict[str, int] = {}
    commits, gave_up, lost = [], 0, 0
    with reaped([run_py([os.path.join(PROCS, "snapshot_merger.py"), loc.lance_uri, rid, str(key), "1",
                         str(per_merger), str(go), str(pace), str(want_commits)])
                 for rid, key in regions.items()]) as procs:
        go.touch()
        deadline = time.time() + 90
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            try:
                r = snapshot.build_snapshot(loc, max_attempts=30,
                                            inline_threshold=0 if len(commits) % 3 == 0 else 100)
            except memwal_index.SnapshotError:
                gave_up += 1
                continue
            commits.append(r.table_version)
            pace.write_text(str(len(commits)))
            lost += r.attempts - 1
            merged = _check_version(loc, r.table_version, regions)
            for rid, g in merged.items():
                assert g >= seen.get(rid, 0), "merge progress went backwards"
                seen[rid] = g
        outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["merged"] == list(range(1, per_merger + 1))
    assert len(commits) >= 20 and lost >= 1, (len(commits), gave_up, lost)
    final = table.open_dataset(loc).version
    assert table.read_memwal_state(loc).merged == {rid: per_merger for rid in regions}
    # every version of the history: progress equals the data, never decreases
    prev: dict[str, int] = {}
    recorded: dict[str, set[int]] = {rid: set() for rid in regions}
    for v in range(1, final + 1):
        try:
            merged = _check_version(loc, v, regions)
        except table.MemWalNotInitialized:
            continue
        for rid, g in merged.items():
            assert g >= prev.get(rid, 0), f"version {v}: progress of {rid} decreased"
            recorded[rid].add(g)
        prev = merged
    # Each generation's merge_insert returned (or was refused as already recorded): the version
    # it committed records exactly that generation. One missing was overwritten by another commit.
    lost = {rid: sorted(set(range(1, per_merger + 1)) - gens) for rid, gens in recorded.items()}
    assert not any(lost.values()), f"merges in no table version: {lost}"
    print(f"race: {len(commits)} snapshot commits, {lost} lost races retried, {gave_up} give-ups, "
          f"{final} table versions")


# ---------------------------------------------------------------------------------------------
# S3


@pytest.mark.s3
def test_snapshot_on_s3_inline_and_external(s3_table_loc):
    loc = s3_table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=4, base_rows=5)
    w = demo.Workload(loc, max_memtable_rows=50)
    w.write_round(40)
    for i in range(3):
        synth_region(loc.store, str(uuid.UUID(int=77 + i, version=4)), last_seen=i)
    r1 = snapshot.build_snapshot(loc)
    assert r1.inline and r1.num_regions == len(w.regions) + 3
    r2 = snapshot.build_snapshot(loc, inline_threshold=2)
    assert r2.external and loc.store.exists(r2.external_key)
    state = table.read_memwal_state(loc)
    tbl = memwal_index.read_snapshot(loc, state)
    assert_rows_equal_manifests(loc, tbl, state.details.region_specs)
    by_rid = {str(uuid.UUID(bytes=r["region_id"])): r["region_field_bucket"] for r in tbl.to_pylist()}
    assert all(by_rid[rid] == value for value, rid in w.regions.items())


def test_unchanged_snapshot_commits_nothing(table_loc):
    """A build whose snapshot equals the stored one commits no table version."""
    loc = table_loc
    demo.create_table(loc, sharding="unsharded", base_rows=5)
    for i in range(3):
        synth_region(loc.store, str(uuid.UUID(int=2000 + i, version=4)))
    first = snapshot.build_snapshot(loc)
    assert first.committed
    again = snapshot.build_snapshot(loc)
    assert not again.committed and again.table_version == first.table_version
    assert table.open_dataset(loc).version == first.table_version
    synth_region(loc.store, str(uuid.UUID(int=3000, version=4)))  # a new region: a change
    third = snapshot.build_snapshot(loc)
    assert third.committed and third.table_version == first.table_version + 1 and third.num_regions == 4


# ---------------------------------------------------------------------------------------------
# durable records of region values (`state/value_records.py`)


# GC collects as soon as allowed: no age or grace, the base table's old versions cleaned first.
INT32 = {"bucket": pa.int32()}  # the Arrow type of a bucket field's value
GC_NOW = GcOptions(manifest_retention=3, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                   cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0)


def merged_bucket_table(loc, seed: int) -> demo.Workload:
    """Two bucket regions whose flushed generations are all recorded as merged (no rows moved)."""
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    w = demo.Workload(loc, seed=seed, key_space=100, max_memtable_rows=20)
    w.write_round(60, puts_per_batch=10)
    mark_merged(loc, w.regions.values())
    return w


def test_a_crash_between_recording_the_values_and_the_commit_leaves_them_usable(table_loc, monkeypatch):
    """The builder records the values before its commit. Stopped in between, the table is as it
    was and the records hold trusted values (each read from a merged generation): GC may trim
    those generations on their word, and the next build publishes the same values, from the
    records, though nothing is left to derive them from."""
    loc = table_loc
    w = merged_bucket_table(loc, seed=11)
    version = table.open_dataset(loc).version
    real_point = faults.point

    def crash(name: str) -> None:
        if name == snapshot.VALUES_RECORDED:
            raise RuntimeError("killed after recording the values")
        real_point(name)

    monkeypatch.setattr(faults, "point", crash)
    with pytest.raises(RuntimeError, match="killed"):
        snapshot.build_snapshot(loc, inline_threshold=0)
    monkeypatch.undo()
    assert table.open_dataset(loc).version == version  # nothing committed
    view = lifecycle.assess_table(loc)
    state, init = view.state, view.lifecycle.init
    records = value_records.read(loc, init).values
    assert set(records) == set(w.regions.values())
    ds = table.open_dataset(loc)
    spec = region_values.region_specs(state)[1]
    for rid, rec in records.items():
        fv = region_values.derive_region_fields(loc, spec, ds.lance_schema, ["id"], view.reads.manifests[rid],
                                                merged=state.merged[rid])
        assert fv.source.kind is region_values.SourceKind.DERIVED and fv.values == rec.values
        assert rec.source == fv.source.label and {w.regions[v] for v in fv.values.values()} == {rid}
    values = {rid: rec.values for rid, rec in records.items()}
    assert snapshot.recorded_values(loc, state, init) == values
    res = gc.run_gc(loc, GC_NOW)
    assert res.counts()["generation"] == sum(state.merged.values()) and not res.holds
    res = snapshot.build_snapshot(loc)
    assert res.committed and not res.region_errors
    assert {rid: res.region_field_sources[rid] for rid in values} == {rid: r.source for rid, r in records.items()}
    assert snapshot.recorded_values(loc, table.read_memwal_state(loc)) == values


def test_a_value_record_that_disagrees_is_a_region_error_never_overwritten(table_loc):
    """A region's value never changes within a lifetime, so a record holding another value than
    the one a build reads is reported (permanent), never overwritten, and the build publishes
    no value for the region in the index; the recorded value stands for the merger (GC may
    have trimmed what it rests on). Both ways: the record read with the plan disagrees with the
    previous snapshot, or another process recorded another value between plan and execution."""
    loc = table_loc
    w = merged_bucket_table(loc, seed=12)
    assert snapshot.build_snapshot(loc).committed
    init = lifecycle.assess_table(loc).lifecycle.init
    a, b = sorted(w.regions.values())
    value_of = {rid: v for v, rid in w.regions.items()}
    other = {"bucket": 1 - value_of[a]}
    key = layout.value_record_key(init.table_version, a)
    loc.store.delete_many([key])
    assert value_records.write(loc, init, a, 1, other, "derived:gen_1", INT32)
    res = snapshot.build_snapshot(loc)
    assert set(res.region_errors) == {a} and res.region_failures[a].permanent, res.region_errors
    assert "never changes" in res.region_errors[a]
    assert res.region_field_sources[a] == "unknown" and res.region_field_sources[b].startswith("derived:gen_")
    assert value_records.read(loc, init).values[a].values == other
    assert snapshot.recorded_values(loc, table.read_memwal_state(loc), init)[a] == other

    # Between plan and execution: the plan derives the value (no record, no previous value).
    loc.store.delete_many([key])
    w.write_round(20, puts_per_batch=10)  # a change, so the build commits
    plan = snapshot.plan_snapshot(loc)
    assert plan.rows[a].fields.source.durable and plan.rows[a].fields.values == {"bucket": value_of[a]}
    assert value_records.write(loc, init, a, 1, other, "derived:gen_1", INT32)
    res = snapshot.execute_snapshot(loc, plan)
    assert set(res.region_errors) == {a} and res.region_failures[a].permanent
    assert res.region_field_sources[a] == "unknown"
    assert value_records.read(loc, init).values[a].values == other
    assert a not in snapshot.recorded_values(loc, table.read_memwal_state(loc))  # the index holds no value


# Values of every type a region field can hold, extremes included: identity on any column type
# (pylance's `initialize_mem_wal` offers integers, booleans and strings; another writer's spec
# may name any type) and bucket (int32).
FIELD_VALUES: list[tuple[pa.DataType, list]] = [
    (pa.int8(), [-(2**7), 2**7 - 1]), (pa.int16(), [-(2**15), 2**15 - 1]), (pa.int32(), [-(2**31), 2**31 - 1]),
    (pa.int64(), [-(2**63), 2**63 - 1, 0]), (pa.uint8(), [2**8 - 1]), (pa.uint16(), [2**16 - 1]),
    (pa.uint32(), [2**32 - 1]), (pa.uint64(), [2**64 - 1, 2**63 + 5]), (pa.bool_(), [True, False]),
    (pa.utf8(), ["é", "日本語 \u0000 ✓", ""]), (pa.large_utf8(), ["x" * 3, "𝄞"]),
    (pa.binary(), [b"\x00\xff", b""]), (pa.large_binary(), [b"\x01"]),
    (pa.float32(), [0.1, -0.0, 3.4e38]), (pa.float64(), [-0.5, 1e308]), (pa.date32(), [-719162, 2932896]),
    (pa.timestamp("s"), [-62_135_596_800, 253_402_300_799]), (pa.timestamp("ms"), [1_700_000_000_123]),
    (pa.timestamp("us", "UTC"), [1_700_000_000_123_456]), (pa.timestamp("ns"), [1_700_000_000_123_456_789]),
    (pa.timestamp("ns", "America/New_York"), [1_700_000_000_123_456_789, -(2**62) - 1]),
    (pa.time32("ms"), [86_399_999]), (pa.time64("ns"), [86_399_999_999_999]),
    (pa.decimal128(10, 2), ["1.50", "-99999999.99"]), (pa.decimal128(38, 0), [str(10**38 - 1)]),
]


@pytest.mark.parametrize("typ,raw", FIELD_VALUES, ids=[str(t) for t, _ in FIELD_VALUES])
def test_a_value_record_gives_back_every_region_field_value_exactly(typ, raw):
    """A record stores each value as its field's Arrow type (`region_values.field_types`: an
    identity field's source column type, a bucket field's int32), so the value read back is the
    one recorded: equal, of the same Python type, with the same `value_key` the merger compares
    rows by (a timestamp[ns] stored as a guessed type came back in microseconds, and the merger
    would refuse every row of the region)."""
    import decimal

    from memwal_core.state import routing

    arr = pa.array([decimal.Decimal(v) for v in raw] if pa.types.is_decimal(typ) else raw, typ)
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("k", typ)])
    identity = routing.RegionSpec(1, (routing.RegionField("k", (1,), routing.IDENTITY, str(typ)),))
    bucket = routing.RegionSpec(2, (routing.RegionField("b", (1,), routing.BUCKET, "int32", (("num_buckets", "8"),)),))
    assert region_values.field_types(identity, schema, schema) == {"k": typ}
    assert region_values.field_types(bucket, schema, schema) == {"b": pa.int32()}
    rid = str(uuid.UUID(int=5, version=4))
    for v in arr:  # as the merger and the index builder read a value: the scalar of a row
        value = v.as_py()
        rec = value_records.ValueRecord(rid, 1, {"k": value}, "derived:gen_1", 4, 1700000000.25)
        got = value_records.decode(value_records.encode(rec, {"k": typ}), rid)
        assert got == rec and type(got.values["k"]) is type(value)
        assert routing.value_key([got.values["k"]]) == routing.value_key([value])
    for b in routing.bucket_values(arr, 8) if routing._hashable(typ) else []:
        rec = value_records.ValueRecord(rid, 2, {"b": b.as_py()}, "derived:gen_1", 4, 1700000000.25)
        assert value_records.decode(value_records.encode(rec, {"b": pa.int32()}), rid) == rec


def test_value_records_refuse_what_is_garbled_or_does_not_fit_its_type():
    """Anything not exactly a record of its region is refused; a value its field's type cannot
    hold is not recorded (GC then keeps what it rests on)."""
    rid = str(uuid.UUID(int=5, version=4))
    rec = value_records.ValueRecord(rid, 3, {"i": 7, "n": None}, "manifest", 4, 1700000000.25)
    types = {"i": pa.int64(), "n": pa.utf8()}
    raw = value_records.encode(rec, types)
    assert value_records.decode(raw, rid) == rec
    for bad in (raw[:-5], raw.replace(b'"format": 1', b'"format": 2'), b"", b"[]"):
        with pytest.raises(ValueError):
            value_records.decode(bad, rid)
    with pytest.raises(ValueError, match="expected"):
        value_records.decode(raw, str(uuid.UUID(int=6, version=4)))
    for wrong in ({"i": pa.int8(), "n": pa.utf8()}, {"i": pa.int64()}):
        with pytest.raises(ValueError, match="cannot be recorded"):
            value_records.encode(value_records.ValueRecord(rid, 3, {"i": 2**40, "n": None}, "manifest", 4, 1.0),
                                 wrong)
