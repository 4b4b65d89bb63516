"""Tables written by LanceDB 0.40 (it bundles Lance 13): memwal maintains them, and after every
step both LanceDB's LSM read (`tbl.search().use_lsm(True)`) and pylance's LSM scanner
(`observe.reader`) equal the model of what LanceDB wrote; LanceDB keeps writing afterwards.

What LanceDB does differently (checked here): the key is stored as
`lance-schema:unenforced-primary-key:position`, WAL entries carry no `generation`, shard ids are
fixed UUIDv5 names (`bucket-N`, `identity-<bytes>`, `unsharded`), one shard per table handle
(a handle change is a flush, a new epoch and a fence sentinel), an identity spec records
`field_id: 'bucket'` and `num_shards: 0`.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import uuid

import lance
import lancedb
import pyarrow as pa
import pytest
from lance.mem_wal import evaluate_sharding_spec
from support.lancedb_table import SCHEMA, LdbTable, as_model, bucket_of, rows

from memwal_core.jobs import catchup, compaction, gc, merge, snapshot
from memwal_core.observe import blockers
from memwal_core.options import GcOptions
from memwal_core.state import region, routing, table, wal
from memwal_core.state.store import open_store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------
# One place for the key, the region spec and the maintained indexes (no Spark)


def test_primary_key_forms_and_order(tmp_path):
    """LanceDB's ':position' form, pylance's 'true' form, and a composite ':position' key (LanceDB
    0.40 refuses compound keys, Lance 13/14 files may carry one) ordered by position, not by column
    order; the hand parser agrees with pylance's accessor."""
    db = lancedb.connect(str(tmp_path / "db"))
    t = db.create_table("t", data=rows([1], "x"), schema=SCHEMA)
    with pytest.raises(ValueError, match="compound primary keys are not supported"):
        t.set_unenforced_primary_key(["k", "id"])
    t.set_unenforced_primary_key("id")
    ds = lance.dataset(str(tmp_path / "db" / "t.lance"))
    assert dict(ds.schema.field("id").metadata) == {b"lance-schema:unenforced-primary-key:position": b"1"}
    assert table.primary_key(ds) == ["id"] == table.pk_from_metadata(ds.schema)

    pos = "lance-schema:unenforced-primary-key:position"
    composite = pa.schema([pa.field("a", pa.int64(), nullable=False, metadata={pos: "2"}),
                           pa.field("c", pa.int64()),
                           pa.field("b", pa.string(), nullable=False, metadata={pos: "1"})])
    ds2 = lance.write_dataset(pa.table({"a": [1], "c": [2], "b": ["x"]}, schema=composite), str(tmp_path / "c"))
    assert table.primary_key(ds2) == ["b", "a"] == table.pk_from_metadata(ds2.schema)
    # pylance's form: field order.
    flagged = pa.schema([pa.field(n, pa.int64(), nullable=False, metadata={"lance-schema:unenforced-primary-key": "true"})
                         for n in ("y", "x")])
    ds3 = lance.write_dataset(pa.table({"y": [1], "x": [2]}, schema=flagged), str(tmp_path / "p"))
    assert table.primary_key(ds3) == ["y", "x"] == table.pk_from_metadata(ds3.schema)
    # No key at all: refused with the reason.
    db.create_table("nokey", data=pa.table({"a": [1]}))
    with pytest.raises(table.NoPrimaryKey, match="has no primary key"):
        table.primary_key(lance.dataset(str(tmp_path / "db" / "nokey.lance")))


@pytest.mark.parametrize("spec", ["bucket", "identity", "unsharded"])
def test_specs_routing_and_index_details(tmp_path, spec):
    """The region spec and maintained indexes LanceDB records read the same through memwal's
    decoder as through pylance's accessor; memwal's routing equals
    `evaluate_sharding_spec` on the spec as LanceDB wrote it (identity: field_id 'bucket');
    the shard ids are LanceDB's fixed UUIDv5 names."""
    t = LdbTable(str(tmp_path / "db"), spec, index=True)
    ids = list(range(100, 160))
    t.upsert(ids, "w")
    t.flush()
    ds = table.open_dataset(t.loc)
    state = table.read_memwal_state(t.loc, ds.version)
    lance_view = ds.mem_wal_index_details()
    assert list(state.details.maintained_indexes) == lance_view["maintained_indexes"] == ["v_idx"]
    assert state.gating_indexes([i["name"] for i in ds.list_indices()]) == ["v_idx"]
    assert state.details.num_regions == lance_view["num_shards"]
    (pspec,) = lance_view["sharding_specs"]
    (mspec,) = state.details.region_specs
    assert [(f.field_id, list(f.source_ids), f.transform, f.result_type) for f in mspec.fields] == \
        [(f["field_id"], f["source_ids"], f["transform"], f["result_type"]) for f in pspec["fields"]]
    ours = routing.RegionSpec.from_proto(mspec)
    batch = rows(ids, "w").to_batches()[0]
    got = routing.evaluate_region_spec(ours, batch, routing.source_columns_for(ours, ds.lance_schema))
    exp = evaluate_sharding_spec(batch, ours.to_lance(), ds.lance_schema)
    assert got.equals(pa.Table.from_batches([exp])) or all(
        got.column(i).combine_chunks().equals(exp.column(i)) for i in range(exp.num_columns))
    # Shard ids are fixed names, the same in every table written with the same spec.
    other = LdbTable(str(tmp_path / "db2"), spec)
    other.upsert(ids, "w")
    other.flush()
    rids = set(region.list_regions(t.loc.store).region_ids)
    assert rids == set(region.list_regions(other.loc.store).region_ids)
    assert len(rids) == {"bucket": 4, "identity": 3, "unsharded": 1}[spec]
    t.check("writes")
    assert blockers.merge_blockers(t.loc) == []


# ----------------------------------------------------------------------------------------
# memwal maintains what LanceDB wrote (library calls, the shared Spark session)


def _gc_options() -> GcOptions:
    return GcOptions(cleanup_base_versions_older_than_seconds=None, manifest_min_age_seconds=0, orphan_grace_seconds=0, cleanup_base_versions_retain=1,
                     keep_current_epoch_wal=False, cleanup_base_versions_floor_seconds=0)  # one process


@pytest.mark.parametrize("spec", ["bucket", "identity", "unsharded"])
def test_memwal_maintains_lancedb_table(tmp_path, spark, spec):
    t = LdbTable(str(tmp_path / "db"), spec, index=spec == "unsharded")
    t.upsert(list(range(20, 80)), "a")  # overwrites base rows 20..29
    t.reopen()  # new handle: flush, new epoch, fence sentinel
    t.upsert(list(range(60, 120, 2)), "b")
    t.flush()
    t.check("writes")
    wal_before = t.wal_entries()

    r = merge.merge(t.loc, spark)
    assert not r.region_errors and r.commits >= 1
    t.check("merge")
    assert merge.plan_merge(t.loc).batches == []
    # The base table alone now holds what LanceDB wrote.
    assert as_model(table.open_dataset(t.loc).to_table()) == t.expected()

    compaction.compact(t.loc, spark)
    t.check("compaction")
    catchup.run_catchup(t.loc)
    t.check("catch-up")
    if spec == "unsharded":  # the maintained index caught up with every merged generation
        state = table.read_memwal_state(t.loc)
        assert state.catchup["v_idx"] == state.merged
    snapshot.build_snapshot(t.loc)
    t.check("MemWAL index")
    res = gc.run_gc(t.loc, _gc_options())
    assert not res.region_errors
    assert any(i.kind == gc.WAL for i in res.deleted)
    t.check("GC")
    assert t.wal_entries() < wal_before
    # What stays: fence sentinels and each region's tail.
    for rid in region.list_regions(t.loc.store).region_ids:
        assert glob.glob(os.path.join(t.loc.lance_uri, "_mem_wal", rid, "wal", "*.arrow"))

    # LanceDB keeps writing (its old handle too) and reading after memwal touched the table.
    t.upsert(list(range(100, 140)), "c")
    t.flush()
    t.check("LanceDB writes after maintenance")
    t.reopen()
    t.upsert([1, 2, 3], "d")
    t.flush()
    r = merge.merge(t.loc, spark)
    assert not r.region_errors
    gc.run_gc(t.loc, _gc_options())
    t.check("second pass")
    assert as_model(table.open_dataset(t.loc).to_table()) == t.expected()


def test_gc_keeps_unmerged_entries_without_generation(tmp_path, spark):
    """WAL entries that name no generation: only those the manifest history places in merged
    (and collectable) generations go; with generations still pending, the entries above the
    covered position stay, and a later merge + GC takes them."""
    t = LdbTable(str(tmp_path / "db"), "unsharded")
    for n in range(4):  # four generations of one region, each from its own handle
        t.upsert(list(range(n * 10, n * 10 + 10)), f"g{n}")
        t.reopen()
    (rid,) = region.list_regions(t.loc.store).region_ids
    m = region.load_latest(t.loc.store, rid)
    assert m.top_generation >= 4
    plan = merge.plan_merge(t.loc, max_generations=2)
    plan.batches = plan.batches[:1]  # the first batch only: generations 1 and 2
    r = merge.execute_merge(t.loc, plan, spark)
    assert not r.region_errors
    merged = table.read_memwal_state(t.loc).merged[rid]
    assert 1 <= merged < m.top_generation
    pos, _ = gc.covered_position(t.loc.store, rid, m, merged)
    assert 0 < pos < m.message.replay_after_wal_entry_position
    before = {p for p in range(1, 200) if t.loc.store.exists(f"_mem_wal/{rid}/wal/{format(p, '064b')[::-1]}.arrow")}
    gc.run_gc(t.loc, _gc_options())
    after = {p for p in range(1, 200) if t.loc.store.exists(f"_mem_wal/{rid}/wal/{format(p, '064b')[::-1]}.arrow")}
    gone = before - after
    assert gone and max(gone) <= pos  # nothing above the covered position
    assert {p for p in before if p > pos} <= after
    t.check("partial merge + GC")
    while merge.plan_merge(t.loc).batches:
        assert not merge.merge(t.loc, spark).region_errors
    gc.run_gc(t.loc, _gc_options())
    t.check("full merge + GC")
    assert len(after) > t.wal_entries()
    assert as_model(table.open_dataset(t.loc).to_table()) == t.expected()


def test_gc_reads_each_wal_entry_once_and_the_next_pass_reads_few(tmp_path, spark, monkeypatch):
    """GC decides entries without a generation by position: one pass reads each entry's metadata
    at most once, and the next pass, with nothing new, does not read the WAL again (it stops at
    the hole the first one left), so a table's GC cost does not grow with its history."""
    import collections

    t = LdbTable(str(tmp_path / "db"), "bucket", buckets=2)
    for n in range(3):
        t.upsert(list(range(n * 40, n * 40 + 40)), f"g{n}", per_call=5)
        t.reopen()
    while merge.plan_merge(t.loc).batches:
        assert not merge.merge(t.loc, spark).region_errors
    snapshot.build_snapshot(t.loc)  # the regions' values recorded: their merged generations are collectable
    reads: collections.Counter = collections.Counter()
    read = wal.read_entry_meta

    def counted(store, rid, position):
        reads[(rid, position)] += 1
        return read(store, rid, position)

    monkeypatch.setattr(wal, "read_entry_meta", counted)
    res = gc.run_gc(t.loc, _gc_options())
    assert not res.region_errors
    deleted = [i for i in res.deleted if i.kind == gc.WAL]
    assert len(deleted) >= 20 and max(reads.values()) == 1
    first = sum(reads.values())
    assert first >= len(deleted)
    reads.clear()
    res = gc.run_gc(t.loc, _gc_options())
    assert not res.region_errors and not [i for i in res.deleted if i.kind == gc.WAL]
    assert sum(reads.values()) <= 2 * len(region.list_regions(t.loc.store).region_ids) < first / 4, reads
    t.check("two GC passes")


# ----------------------------------------------------------------------------------------
# What stops a merge is reported before a run is spent on it


def test_mixed_writers_are_flagged(tmp_path):
    """LanceDB upserts beside a pylance writer on one bucket spec: two regions hold one bucket
    value. `memwal status` exits 1 naming both regions; the `mergeable` check fails."""
    t = LdbTable(str(tmp_path / "db"), "bucket", buckets=2)
    ids0 = [i for i in range(200, 260) if bucket_of(i, 2) == 0][:5]
    t.upsert(ids0, "ldb")
    t.flush()
    ds = table.open_dataset(t.loc)
    foreign = str(uuid.uuid4())
    with ds.mem_wal_writer(foreign, max_memtable_rows=100) as w:
        w.put(rows(ids0[:2], "py"))
    found = blockers.merge_blockers(t.loc)
    assert [b.kind for b in found] == [blockers.SHARED_VALUE]
    assert foreign in found[0].regions and len(found[0].regions) == 2
    out = subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", "status", t.loc.lance_uri],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "MERGE BLOCKED (shared_value)" in out.stdout and foreign in out.stdout

    from dagster import DagsterInstance
    from support.tables import cfg_for

    from memwal_pipeline.definitions import build_definitions

    defs = build_definitions([cfg_for(t.loc)])
    with DagsterInstance.ephemeral() as instance:
        res = defs.resolve_job_def("t_checks").execute_in_process(instance=instance, raise_on_error=False)
    ev = {c.check_name: c for c in res.get_asset_check_evaluations()}
    assert not ev["mergeable"].passed
    assert ev["mergeable"].metadata["kinds"].value == [blockers.SHARED_VALUE]


def test_no_usable_key_is_flagged(tmp_path):
    """A LanceDB table whose key was never declared cannot be merged: status says so up front."""
    db = lancedb.connect(str(tmp_path / "db"))
    tbl = db.create_table("t", data=rows([1, 2], "base"), schema=SCHEMA)
    ds = lance.dataset(str(tmp_path / "db" / "t.lance"))
    ds.initialize_mem_wal(unsharded=True)
    loc = open_store(str(tmp_path / "db" / "t.lance"))
    found = blockers.merge_blockers(loc)
    assert [b.kind for b in found] == [blockers.NO_PRIMARY_KEY], found
    assert "has no primary key" in found[0].message
    del tbl


def test_unknown_feature_is_flagged(tmp_path):
    """A table a newer Lance marked with a feature flag memwal does not know: status reports the
    refusal (the same `read_memwal_state` check the merger runs) instead of a healthy table."""
    from support.lance_manifest import set_feature_flags

    t = LdbTable(str(tmp_path / "db"), "unsharded")
    t.upsert([1, 2], "x")
    t.flush()
    assert blockers.merge_blockers(t.loc) == []
    set_feature_flags(t.loc, writer=1 | 512)
    found = blockers.merge_blockers(t.loc)
    assert [b.kind for b in found] == [blockers.TABLE_REFUSED]
    assert "writer_feature_flags" in found[0].message and "512" in found[0].message


# ----------------------------------------------------------------------------------------
# One `memwal maintain` over a few thousand LanceDB upserts


def test_memwal_maintain_cli_thousands_of_upserts(tmp_path):
    """Over 3,000 LanceDB upserts over four shards, through five table handles (ten rows a WAL
    entry): one `memwal maintain` leaves the base table equal to what LanceDB wrote and nothing
    to merge, and reclaims every WAL entry but fence sentinels, the current epoch's and the tail."""
    t = LdbTable(str(tmp_path / "db"), "bucket", buckets=4, base=200)
    rng = __import__("random").Random(7)
    upserts = 0
    for rnd in range(5):  # several handles: several epochs per shard
        ids = sorted({rng.randrange(3000) for _ in range(700)})
        t.upsert(ids, f"r{rnd}_", per_call=10)
        upserts += len(ids)
        t.reopen()
    t.flush()
    assert upserts >= 3000 and len(t.expected()) > 2000
    t.check("writes")
    before = t.wal_entries()
    out = subprocess.run(
        [sys.executable, "-m", "memwal_pipeline.cli", "maintain", t.loc.lance_uri, "--spark-master", "local[2]",
         "--base-versions-older-than", "0", "--base-versions-floor", "0", "--json"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report is not None
    after = t.wal_entries()
    print(f"\n[lancedb] WAL entries before {before}, after {after}")
    # Every entry left is a fence sentinel, an entry of the region's current writer epoch (kept by
    # default: `keep_current_epoch_wal`) or its tail: every other data entry was reclaimed.
    for rid in region.list_regions(t.loc.store).region_ids:
        epoch = region.load_latest(t.loc.store, rid).writer_epoch
        positions = sorted(int(os.path.basename(f)[:-6][::-1], 2)
                           for f in glob.glob(os.path.join(t.loc.lance_uri, "_mem_wal", rid, "wal", "*.arrow")))
        for p in positions[:-1]:
            e = wal.read_entry_meta(t.loc.store, rid, p)
            assert e.fence_sentinel or e.writer_epoch == epoch, (rid, p, e)
    assert before > 150 and after < before / 2
    assert as_model(table.open_dataset(t.loc).to_table()) == t.expected()
    assert merge.plan_merge(t.loc).batches == []
    t.check("memwal maintain")
    t.upsert([5, 6, 7], "after")
    t.flush()
    t.check("LanceDB writes after memwal maintain")


# ----------------------------------------------------------------------------------------
# covered_position: decided from the manifest history, never more than is covered


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from memwal_core.proto import memwal_pb2 as pb  # noqa: E402
from memwal_core.state import layout  # noqa: E402


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=1, max_size=25),
       gone=st.integers(0, 30), holes=st.sets(st.integers(1, 30), max_size=4), bound=st.integers(0, 12),
       data=st.data())
def test_covered_position_is_never_past_what_is_collectable(tmp_path_factory, steps, gone, holes, bound, data):
    """Manifest histories: each version either flushes a generation (advancing replay_after past
    the entries written since) or does not (a claim, a GC trim); a prefix of versions collected,
    some versions in the middle missing or unreadable (a failed delete). The position found is
    replay_after of a version whose flushed generations are all <= bound; with no hole it is the
    newest such version's."""
    loc = open_store(str(tmp_path_factory.mktemp("cov")))
    rid = str(uuid.uuid4())
    versions: list[tuple[int, int]] = []  # (current_generation, replay_after) per version
    cur, replay, pos = 1, 0, 0
    for flush, writes in steps:
        pos += writes
        if flush and pos > replay:
            cur, replay = cur + 1, pos
        versions.append((cur, replay))
    latest = len(versions)
    for v, (cg, ra) in enumerate(versions, start=1):
        if v < latest and (v <= gone or v in holes):
            if data.draw(st.booleans()):  # missing, or there but unreadable
                continue
            loc.store.put(layout.manifest_key(rid, v), b"\xff garbage")
            continue
        msg = pb.RegionManifest(version=v, writer_epoch=1, replay_after_wal_entry_position=ra,
                                current_generation=cg, region_id=pb.Uuid(uuid=uuid.UUID(rid).bytes))
        loc.store.put(layout.manifest_key(rid, v), msg.SerializeToString())
    m = region.load_version(loc.store, rid, latest)
    got, v = gc.covered_position(loc.store, rid, m, bound)
    if v is None:
        assert got == 0
    else:
        assert versions[v - 1] == (region.load_version(loc.store, rid, v).current_generation, got)
        assert versions[v - 1][0] - 1 <= bound  # every entry <= got is in a generation <= bound
    qualifying = [i for i, (cg, _) in enumerate(versions, start=1) if cg - 1 <= bound]
    readable = {i for i in range(1, latest + 1) if i == latest or not (i <= gone or i in holes)}
    if not holes and qualifying and max(qualifying) in readable:
        assert v == max(qualifying)
