"""memwal.proto is wire-compatible with what pylance 14 writes.

Every region manifest pylance writes, and the MemWAL index details of the base table in every
state we can drive pylance into, decode with memwal's messages and re-encode to identical
bytes -- also after unknown fields are discarded, so every byte is a declared field. Values are
compared with what pylance itself reports.
"""

from __future__ import annotations

import os
import uuid

import lance
import pyarrow as pa
import pytest
from lance.dataset import LanceOperation
from lance.mem_wal import CompactedSsTable

from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, region, table, wal
from memwal_core.state.store import open_store
from memwal_core.tools import demo


def roundtrip(cls, raw: bytes):
    msg = cls.FromString(raw)
    assert msg.SerializeToString() == raw
    stripped = cls.FromString(raw)
    stripped.DiscardUnknownFields()
    assert stripped.SerializeToString() == raw, "pylance wrote a field memwal.proto does not declare"
    return msg


# =========================================================================== region manifests
def _write(loc, sharding: str) -> demo.Workload:
    kw = {"num_buckets": 3} if sharding == "bucket" else {}
    identity = sharding == "identity"
    demo.create_table(loc, sharding=sharding, base_rows=4 if identity else 20, **kw)
    w = demo.Workload(loc, seed=7, key_space=4 if identity else 300, max_memtable_rows=10)
    for _ in range(2):  # every region re-opened: epoch 2, fence sentinel
        w.write_round(40 if identity else 30, delete=0.1, absent_delete=0.0, puts_per_batch=5)
    return w


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    out = {}
    for sharding in ["bucket", "identity", "unsharded", "manual"]:
        loc = open_store(str(tmp_path_factory.mktemp(sharding) / "t"))
        out[sharding] = (loc, _write(loc, sharding))
    return out


@pytest.mark.parametrize("sharding", ["bucket", "identity", "unsharded", "manual"])
def test_every_region_manifest_round_trips(tables, sharding):
    loc, w = tables[sharding]
    rids = region.list_regions(loc.store).region_ids
    assert sorted(rids) == sorted(w.regions.values()) and rids
    spec_ids = {s.spec_id for s in table.read_memwal_state(loc).details.region_specs}
    n_files = 0
    saw = {"epoch>=2": False, "2+ generations": False, "sentinel": False,
           "deletes": False}
    for rid in rids:
        files = [o for o in loc.store.list(layout.manifest_dir(rid)) if o.key.endswith(".binpb")]
        versions = sorted(layout.parse_bitrev(o.key.rsplit("/", 1)[1]) for o in files)
        assert versions == list(range(1, len(versions) + 1))
        prev_epoch = 0
        for v in versions:
            raw = loc.store.get(layout.manifest_key(rid, v))
            msg = roundtrip(pb.RegionManifest, raw)
            n_files += 1
            assert msg.version == v
            assert msg.region_id.uuid == uuid.UUID(rid).bytes
            assert msg.status == pb.ACTIVE and not msg.region_field_entries
            assert (msg.region_spec_id in spec_ids) if sharding != "manual" else msg.region_spec_id == 0
            assert msg.writer_epoch >= prev_epoch
            prev_epoch = msg.writer_epoch
            assert [g.generation for g in msg.flushed_generations] == list(range(1, msg.current_generation))
            for g in msg.flushed_generations:
                layout.validate_generation_path(g.path, g.generation)
                assert g.physical_rows > 0 and g.in_memory_bytes > 0 and g.primary_key_bytes > 0
            assert region.decode_manifest(rid, v, raw).message == msg
            saw["epoch>=2"] |= msg.writer_epoch >= 2
            saw["2+ generations"] |= len(msg.flushed_generations) >= 2
        tail = wal.probe_tail(loc.store, rid, 1)
        saw["sentinel"] |= any(wal.read_entry_meta(loc.store, rid, p).fence_sentinel
                               for p in range(1, tail + 1))
        saw["deletes"] |= any(pa.ipc.open_stream(loc.store.get(layout.wal_key(rid, p))).read_all()
                              .column("_tombstone").to_pylist().count(True)
                              for p in range(1, tail + 1)
                              if not wal.read_entry_meta(loc.store, rid, p).fence_sentinel)
    assert all(saw.values()), saw
    assert n_files >= 4 * len(rids)


def test_manifest_fields_survive_memwal_reencoding(tables):
    """A manifest memwal re-encodes after editing a field equals pylance's bytes plus that edit:
    field order and widths are Lance's, so pylance's own decoder sees the same message."""
    loc, w = tables["bucket"]
    rid = sorted(w.regions.values())[0]
    cur = region.load_latest(loc.store, rid)
    msg = pb.RegionManifest.FromString(cur.raw)
    msg.wal_entry_position_last_seen = 2**40 + 3  # a multi-byte varint
    again = pb.RegionManifest.FromString(msg.SerializeToString())
    assert again.wal_entry_position_last_seen == 2**40 + 3
    again.wal_entry_position_last_seen = cur.message.wal_entry_position_last_seen
    assert again.SerializeToString() == cur.raw


# =========================================================================== MemWAL index details
def check_details(loc) -> table.MemWalState:
    """Round-trip the full details and compare them with every view pylance gives."""
    ds = lance.dataset(loc.lance_uri)
    state = table.read_memwal_state(loc, ds.version)
    assert state.table_version == ds.version
    d = roundtrip(pb.MemWalIndexDetails, state.raw_details)
    assert d == state.details
    assert state.index.index_details.type_url == "/lance.table.MemWalIndexDetails"

    stats = ds.index_statistics("__lance_mem_wal")
    assert stats["num_shards"] == d.num_regions
    assert stats["num_compacted_sstables"] == len(d.merged_generations)
    assert stats["num_shard_specs"] == len(d.region_specs)
    assert stats["num_maintained_indexes"] == len(d.maintained_indexes)
    assert stats["num_index_catchup_entries"] == len(d.index_catchup)

    view = ds.mem_wal_index_details()
    assert view["num_shards"] == d.num_regions
    assert view["maintained_indexes"] == list(d.maintained_indexes)
    assert d.HasField("maintain_all_indexes")  # pylance always writes it (presence matters)
    assert view["maintain_all_indexes"] == d.maintain_all_indexes
    assert view["writer_config_defaults"] == {p.key: p.value for p in d.writer_config_defaults}
    assert len(d.writer_config_defaults) == len(view["writer_config_defaults"])  # no duplicate keys
    specs = [{"spec_id": s.spec_id,
              "fields": [{"field_id": f.field_id, "source_ids": list(f.source_ids),
                          "transform": f.transform if f.HasField("transform") else None,
                          "expression": f.expression if f.HasField("expression") else None,
                          "result_type": f.result_type,
                          "parameters": {p.key: p.value for p in f.parameters}} for f in s.fields]}
             for s in d.region_specs]
    assert view["sharding_specs"] == specs

    # Where the version was committed by a CreateIndex, the transaction carries the same bytes.
    tx = ds.read_transaction(ds.version)
    if isinstance(tx.operation, LanceOperation.CreateIndex):
        mine = [i for i in tx.operation.new_indices if i.name == "__lance_mem_wal"]
        if mine:
            assert mine[0].index_details == ("/lance.table.MemWalIndexDetails", state.raw_details)
    return state


@pytest.mark.parametrize("sharding,num_regions", [("bucket", 4), ("identity", 0), ("unsharded", 1),
                                                  ("manual", 0)])
def test_details_of_a_fresh_table(tmp_path, sharding, num_regions):
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding=sharding, num_buckets=4, base_rows=3)
    state = check_details(loc)
    d = state.details
    assert d.num_regions == num_regions
    assert d.maintain_all_indexes is True and not d.maintained_indexes
    assert not d.merged_generations and not d.index_catchup and not d.HasField("inline_snapshots")
    tx = lance.dataset(loc.lance_uri).read_transaction(state.table_version)
    assert isinstance(tx.operation, LanceOperation.CreateIndex)  # the comparison above ran
    if sharding == "manual":
        assert not d.region_specs
    else:
        (spec,) = d.region_specs
        (f,) = spec.fields
        assert f.transform == sharding
        if sharding == "bucket":
            assert [(p.key, p.value) for p in f.parameters] == [("num_buckets", "4")]
            assert list(f.source_ids) == [0]


def _generation_rows(loc, rid: str, gen: region.Generation) -> pa.Table:
    path = os.path.join(loc.lance_uri, layout.generation_dir(rid, gen.path, gen.generation))
    t = lance.dataset(path).to_table()
    return t.filter(pa.compute.invert(t.column("_tombstone"))).drop_columns(["_tombstone"])


def _merge(loc, markers: dict[str, int], source: pa.Table) -> None:
    ds = lance.dataset(loc.lance_uri)
    (ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
       .mark_sstables_as_compacted([CompactedSsTable(r, g) for r, g in markers.items()])
       .execute(source))


def test_details_after_merges_with_markers(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    w = demo.Workload(loc, key_space=200, max_memtable_rows=20)
    w.write_round(60, puts_per_batch=10)
    w.write_round(60, puts_per_batch=10)
    a, b = sorted(w.regions.values())
    ma, mb = region.load_latest(loc.store, a), region.load_latest(loc.store, b)
    assert len(ma.generations) >= 2 and len(mb.generations) >= 2

    _merge(loc, {a: 1}, _generation_rows(loc, a, ma.generations[0]))
    s1 = check_details(loc)
    assert s1.merged == {a: 1}

    # Two regions in one commit, one of them moving on.
    src = pa.concat_tables([_generation_rows(loc, a, ma.generations[1]),
                            _generation_rows(loc, b, mb.generations[0])])
    _merge(loc, {a: 2, b: 1}, src)
    s2 = check_details(loc)
    assert s2.merged == {a: 2, b: 1} and s2.table_version == s1.table_version + 1
    # Everything but merge progress is unchanged by merges.
    for s in (s1, s2):
        d = pb.MemWalIndexDetails()
        d.CopyFrom(s.details)
        del d.merged_generations[:]
        base = pb.MemWalIndexDetails()
        base.CopyFrom(s1.details)
        del base.merged_generations[:]
        assert d == base

    _merge(loc, {b: 2}, pa.Table.from_pylist([], schema=demo.SCHEMA))  # an empty source works
    assert check_details(loc).merged == {a: 2, b: 2}
    # Older states still read and round-trip.
    assert table.read_memwal_state(loc, s1.table_version).raw_details == s1.raw_details


def test_details_after_optimize_indices_record_catchup(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="unsharded", base_rows=20, btree_index=True)
    w = demo.Workload(loc, key_space=100, max_memtable_rows=20)
    w.write_round(40, puts_per_batch=10)
    (rid,) = w.regions.values()
    m = region.load_latest(loc.store, rid)
    _merge(loc, {rid: 1}, _generation_rows(loc, rid, m.generations[0]))
    assert check_details(loc).catchup == {}
    lance.dataset(loc.lance_uri).optimize.optimize_indices(index_names=["id_btree"])
    state = check_details(loc)
    assert state.catchup == {"id_btree": {rid: 1}}
    assert state.merged == {rid: 1}
    assert state.gating_indexes(["id_btree", "__lance_mem_wal"]) == ["id_btree"]  # maintain_all


def test_details_with_maintained_indexes_and_writer_defaults(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    ds = lance.write_dataset(demo.rows_table([demo.row(i, 0) for i in range(10)]), loc.lance_uri)
    ds.create_scalar_index("id", "BTREE", name="id_btree")
    ds.create_scalar_index("n", "BTREE", name="n_btree")
    ds.initialize_mem_wal(bucket_column="id", num_buckets=2, maintained_indexes=["n_btree", "id_btree"],
                          durable_write=True, max_memtable_rows=100, max_wal_flush_interval_ms=50)
    state = check_details(loc)
    d = state.details
    assert list(d.maintained_indexes) == ["n_btree", "id_btree"]
    assert d.HasField("maintain_all_indexes") and d.maintain_all_indexes is False
    defaults = {p.key: p.value for p in d.writer_config_defaults}
    assert defaults["durable_write"] == "true" and defaults["max_memtable_rows"] == "100"
    assert defaults["max_wal_flush_interval_ms"] == "50"
    assert len(defaults) > 3  # pylance records every writer knob, in its own (hash) order
    assert state.gating_indexes(["id_btree", "n_btree", "other"]) == ["id_btree", "n_btree"]

    # A writer uses those defaults, and the details still round-trip after a flush and a merge.
    rid = str(uuid.uuid4())
    with lance.dataset(loc.lance_uri).mem_wal_writer(rid) as w:
        w.put(demo.rows_table([demo.row(i, 1) for i in range(100, 130)]))
    m = region.load_latest(loc.store, rid)
    _merge(loc, {rid: 1}, _generation_rows(loc, rid, m.generations[0]))
    after = check_details(loc)
    assert after.merged == {rid: 1}
    # Same map; a commit that rewrites the details may write it in another (hash) order.
    assert {p.key: p.value for p in after.details.writer_config_defaults} == defaults

    # An empty maintained list is kept as such (maintain nothing), distinct from maintain_all.
    loc2 = open_store(str(tmp_path / "t2"))
    demo.create_table(loc2, sharding="manual", maintained_indexes=[], btree_index=True)
    d2 = check_details(loc2).details
    assert not d2.maintained_indexes and d2.HasField("maintain_all_indexes") and not d2.maintain_all_indexes
