"""Which region value may be trusted (memwal_core.state.region_values), read from the MemWAL
index's stored format (memwal_core.state.memwal_index).

The index is a real Lance file here (encoded and decoded through pylance); tables, merges and
GC over real regions are in test_snapshot.py, tests/wall/ and test_gc.py.
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import memwal_index, region, routing
from memwal_core.state.region_values import (
    FieldValues, SourceKind, ValueSource, pinned_values, snapshot_field_values, spec_field_ids, value_owners,
)

A, B, C, D, E, F = (str(uuid.UUID(int=i, version=4)) for i in range(1, 7))


def bucket_spec() -> pb.RegionSpec:
    spec = pb.RegionSpec(spec_id=1)
    f = spec.fields.add(field_id="bucket", source_ids=[0], transform="bucket", result_type="int32")
    f.parameters.add(key="num_buckets", value="8")
    return spec


def manifest(rid: str, *, spec_id: int = 1, gens: tuple[int, ...] = (1, 2)) -> region.RegionManifest:
    msg = pb.RegionManifest(version=3, writer_epoch=2, replay_after_wal_entry_position=4,
                            wal_entry_position_last_seen=5, current_generation=max(gens) + 1,
                            region_spec_id=spec_id)
    msg.region_id.uuid = uuid.UUID(rid).bytes
    for g in gens:
        msg.flushed_generations.add(generation=g, path=f"{g:08x}_gen_{g}")
    return region.RegionManifest(rid, 3, msg)


def stored_index() -> pa.Table:
    """An index with one row per source, through a real Lance file (inline bytes)."""
    rows = [memwal_index.IndexRow(manifest(A), {"bucket": 1}, "manifest"),
            memwal_index.IndexRow(manifest(B), {"bucket": 2}, "derived:gen_2"),
            memwal_index.IndexRow(manifest(C), {"bucket": 3}, "provisional:gen_1"),
            memwal_index.IndexRow(manifest(D), {}, "unknown"),
            memwal_index.IndexRow(manifest(E, spec_id=0), {}, "none"),
            memwal_index.IndexRow(manifest(F), {"bucket": 6}, None)]  # another builder: no label
    tbl = memwal_index.snapshot_table(rows, [bucket_spec()])
    back = memwal_index.decode_lance_file(memwal_index.encode_lance_file(tbl))
    assert back.equals(tbl)
    return back


@pytest.mark.parametrize("label, kind, generation, trusted, pinned", [
    ("manifest", SourceKind.MANIFEST, None, True, False),
    ("derived:gen_7", SourceKind.DERIVED, 7, True, True),
    ("derived:unsharded", SourceKind.UNSHARDED, None, True, False),
    ("provisional:gen_2", SourceKind.PROVISIONAL, 2, False, False),
    ("none", SourceKind.NONE, None, False, False),
    ("unknown", SourceKind.UNKNOWN, None, False, False),
])
def test_each_stored_label_names_its_source_and_whether_it_is_trusted(label, kind, generation, trusted, pinned):
    src = ValueSource.parse(label)
    assert (src.kind, src.generation, src.trusted, src.pinned) == (kind, generation, trusted, pinned)
    assert src.label == str(src) == label  # written back exactly as read


@pytest.mark.parametrize("label", ["derived:gen_x", "derived", "provisional:gen_", "Manifest", "merged:gen_3", ""])
def test_a_label_this_version_does_not_know_is_never_trusted(label):
    src = ValueSource.parse(label)
    assert src.kind is SourceKind.UNKNOWN and not src.trusted and not src.shown and not src.pinned


def test_a_row_without_a_label_holds_the_recorded_value_of_the_spec():
    src = ValueSource.parse(None)
    assert src.kind is SourceKind.UNLABELLED and src.trusted and src.label is None


def test_provisional_values_are_shown_but_never_trusted():
    tbl = stored_index()
    assert snapshot_field_values(tbl) == {A: {"bucket": 1}, B: {"bucket": 2}, C: {"bucket": 3}, F: {"bucket": 6}}
    assert snapshot_field_values(tbl, authoritative=True) == {A: {"bucket": 1}, B: {"bucket": 2}, F: {"bucket": 6}}


def test_only_values_of_merged_generations_are_reused_by_the_next_build():
    assert pinned_values(stored_index()) == {
        B: (1, FieldValues({"bucket": 2}, ValueSource(SourceKind.DERIVED, 2)))}


def test_an_index_without_the_source_column_is_trusted_as_recorded_and_pins_nothing():
    tbl = stored_index().drop_columns([memwal_index.SOURCE_COLUMN])
    assert snapshot_field_values(tbl, authoritative=True) == {
        A: {"bucket": 1}, B: {"bucket": 2}, C: {"bucket": 3}, F: {"bucket": 6}}
    assert pinned_values(tbl) == {}


def test_stored_rows_read_back_are_written_again_unchanged():
    """A region the builder cannot load keeps its stored row: read back and written again, the
    row must be the same bytes' worth of columns."""
    tbl = stored_index()
    rows = memwal_index.index_rows(tbl)
    assert set(rows) == {A, B, C, D, E, F}
    assert [g.generation for g in rows[B].manifest.generations] == [1, 2]
    assert (rows[B].values, rows[B].source, rows[F].source) == ({"bucket": 2}, "derived:gen_2", None)
    assert memwal_index.snapshot_table(list(rows.values()), [bucket_spec()]).equals(tbl)


def test_a_value_another_region_holds_is_owned_by_it():
    specs = {1: bucket_spec()}
    recorded = snapshot_field_values(stored_index(), authoritative=True)
    assert spec_field_ids(specs, {"bucket": 2}) == ["bucket"] and spec_field_ids(specs, {"other": 1}) is None
    owners = value_owners(recorded, specs, {A: {"bucket": 1}})  # A's own value is the caller's
    assert owners == {routing.value_key([2]): B, routing.value_key([6]): F}
