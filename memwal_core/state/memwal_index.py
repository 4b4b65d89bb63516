"""The MemWAL index's region snapshot on disk: its schema, its Lance-file encoding, where it lives.

The `__lance_mem_wal` index details carry a snapshot of every region manifest (spec "MemWAL
Index"): one row per region, `SNAPSHOT_COLUMNS` plus one `region_field_{field_id}` column per
field of the region specs (typed by the field's `result_type`), encoded as a Lance file. Up to a
threshold of regions the file's bytes are inline in `inline_snapshots`; above it the file is
`_indices/{index uuid}/index.lance` beside the table and the details hold no inline bytes.

memwal adds one column, `_region_field_source`: a label saying where each row's values came
from (`state/region_values.py` owns those labels and which of them may be trusted; here they are
opaque strings). A reader that does not know the column ignores it.

This module is the format only: the index builder (`jobs/snapshot`) writes it, and every job
that needs a recorded region value (merge, GC, the checks) reads it through `read_snapshot`.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from lance.file import LanceFileReader, LanceFileWriter

from memwal_core import faults
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import region, table
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.memwal_index")

SNAPSHOT_FILE = "index.lance"
REGION_FIELD_PREFIX = "region_field_"
SOURCE_COLUMN = "_region_field_source"

FLUSHED_TYPE = pa.list_(pa.struct([("generation", pa.uint64()), ("path", pa.string())]))
SNAPSHOT_COLUMNS = [
    pa.field("region_id", pa.binary(16), nullable=False),
    pa.field("version", pa.uint64(), nullable=False),
    pa.field("region_spec_id", pa.uint32(), nullable=False),
    pa.field("writer_epoch", pa.uint64(), nullable=False),
    pa.field("replay_after_wal_entry_position", pa.uint64(), nullable=False),
    pa.field("wal_entry_position_last_seen", pa.uint64(), nullable=False),
    pa.field("current_generation", pa.uint64(), nullable=False),
    pa.field("flushed_generations", FLUSHED_TYPE),
]


class SnapshotError(table.TableError):
    """The snapshot could not be committed or read."""


class SnapshotNotFound(SnapshotError):
    """The MemWAL index holds no readable region snapshot."""


# --------------------------------------------------------------------------------------------
# Region field values


def result_arrow_type(result_type: str) -> pa.DataType:
    """Arrow type of a region field's `result_type` ('int32', 'utf8', 'large_utf8', 'boolean', ...)."""
    try:
        return pa.type_for_alias(result_type.strip().lower())
    except (ValueError, KeyError, AttributeError):
        log.warning("unknown region field result_type %r; storing the value as a string", result_type)
        return pa.string()


def decode_field_value(raw: bytes, typ: pa.DataType) -> Any:
    """A `region_field_entries` value (bytes) as a Python value of `typ`.

    pylance 14 never writes these entries, so the encoding is memwal's reading of the spec:
    little-endian fixed-width for numbers, one byte for booleans, UTF-8 for strings.
    """
    if pa.types.is_integer(typ):
        if len(raw) not in (1, 2, 4, 8):
            raise ValueError(f"{len(raw)} bytes for an integer")
        return int.from_bytes(raw, "little", signed=pa.types.is_signed_integer(typ))
    if pa.types.is_boolean(typ):
        if len(raw) != 1:
            raise ValueError(f"{len(raw)} bytes for a boolean")
        return raw != b"\x00"
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return raw.decode("utf-8")
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ):
        return bytes(raw)
    if pa.types.is_float32(typ) and len(raw) == 4:
        return struct.unpack("<f", raw)[0]
    if pa.types.is_float64(typ) and len(raw) == 8:
        return struct.unpack("<d", raw)[0]
    raise ValueError(f"cannot decode a {typ} region value from {len(raw)} bytes")


def _typed_array(vals: list, typ: pa.DataType) -> pa.Array:
    """A region field column of `typ`; a value that does not fit the type is stored as null."""
    try:
        return pa.array(vals, typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        out = []
        for v in vals:
            try:
                out.append(pa.scalar(v).cast(typ).as_py() if v is not None else None)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                out.append(None)
        return pa.array(out, typ)


# --------------------------------------------------------------------------------------------
# Schema and rows


def _field_columns(specs: list[pb.RegionSpec]) -> list[pa.Field]:
    cols: dict[str, pa.Field] = {}
    for spec in sorted(specs, key=lambda s: s.spec_id):
        for f in spec.fields:
            name = REGION_FIELD_PREFIX + f.field_id
            if name not in cols:
                cols[name] = pa.field(name, result_arrow_type(f.result_type))
            elif cols[name].type != result_arrow_type(f.result_type):
                log.warning("region field %r has result types %s and %s in different specs; "
                            "the snapshot column keeps %s", f.field_id, cols[name].type,
                            f.result_type, cols[name].type)
    return list(cols.values())


def snapshot_schema(specs: list[pb.RegionSpec]) -> pa.Schema:
    return pa.schema(SNAPSHOT_COLUMNS + _field_columns(specs) + [pa.field(SOURCE_COLUMN, pa.string())])


@dataclass(frozen=True)
class IndexRow:
    """One region's row: its manifest (as snapshotted), its field values, and the label of
    where they came from (None: a row without `_region_field_source`)."""

    manifest: region.RegionManifest
    values: dict[str, Any]
    source: str | None


def snapshot_table(rows: list[IndexRow], specs: list[pb.RegionSpec]) -> pa.Table:
    """The snapshot rows (sorted by region id) as an Arrow table of `snapshot_schema(specs)`."""
    schema = snapshot_schema(specs)
    rows = sorted(rows, key=lambda r: r.manifest.region_id)
    msgs = [r.manifest.message for r in rows]
    data: dict[str, list] = {
        "region_id": [uuid.UUID(r.manifest.region_id).bytes for r in rows],
        "version": [r.manifest.version for r in rows],
        "region_spec_id": [m.region_spec_id for m in msgs],
        "writer_epoch": [m.writer_epoch for m in msgs],
        "replay_after_wal_entry_position": [m.replay_after_wal_entry_position for m in msgs],
        "wal_entry_position_last_seen": [m.wal_entry_position_last_seen for m in msgs],
        "current_generation": [m.current_generation for m in msgs],
        "flushed_generations": [[{"generation": g.generation, "path": g.path}
                                 for g in m.flushed_generations] for m in msgs],
    }
    arrays = [pa.array(data[f.name], f.type) for f in SNAPSHOT_COLUMNS]
    for f in schema:
        if not f.name.startswith(REGION_FIELD_PREFIX):
            continue
        fid = f.name[len(REGION_FIELD_PREFIX):]
        arrays.append(_typed_array([r.values.get(fid) for r in rows], f.type))
    arrays.append(pa.array([r.source for r in rows], pa.string()))
    return pa.Table.from_arrays(arrays, schema=schema)


def _region_id(raw: bytes) -> str:
    return str(uuid.UUID(bytes=raw))


def field_values(tbl: pa.Table) -> dict[str, tuple[str | None, dict[str, Any]]]:
    """Region id -> (source label, {field id: value} without nulls), for every row of `tbl`."""
    field_cols = [c for c in tbl.column_names if c.startswith(REGION_FIELD_PREFIX)]
    has_source = SOURCE_COLUMN in tbl.column_names
    out: dict[str, tuple[str | None, dict[str, Any]]] = {}
    for r in tbl.select(["region_id"] + field_cols + ([SOURCE_COLUMN] if has_source else [])).to_pylist():
        if r["region_id"] is None:
            continue
        vals = {c[len(REGION_FIELD_PREFIX):]: r[c] for c in field_cols if r[c] is not None}
        out[_region_id(r["region_id"])] = (r.get(SOURCE_COLUMN) if has_source else None, vals)
    return out


def index_rows(tbl: pa.Table) -> dict[str, IndexRow]:
    """The rows of a stored snapshot as `IndexRow`s, their manifests rebuilt from the columns
    (the snapshotted fields only: enough to write the row again unchanged)."""
    field_cols = [c for c in tbl.column_names if c.startswith(REGION_FIELD_PREFIX)]
    out: dict[str, IndexRow] = {}
    for r in tbl.to_pylist():
        if r.get("region_id") is None:
            continue
        rid = _region_id(r["region_id"])
        msg = pb.RegionManifest(
            version=r["version"], writer_epoch=r["writer_epoch"],
            replay_after_wal_entry_position=r["replay_after_wal_entry_position"],
            wal_entry_position_last_seen=r["wal_entry_position_last_seen"],
            current_generation=r["current_generation"], region_spec_id=r["region_spec_id"])
        msg.region_id.uuid = r["region_id"]
        for g in r["flushed_generations"] or []:
            msg.flushed_generations.add(generation=g["generation"], path=g["path"])
        values = {c[len(REGION_FIELD_PREFIX):]: r[c] for c in field_cols if r[c] is not None}
        out[rid] = IndexRow(region.RegionManifest(rid, r["version"], msg), values, r.get(SOURCE_COLUMN))
    return out


# --------------------------------------------------------------------------------------------
# The Lance file: inline bytes or an external file


def encode_lance_file(tbl: pa.Table) -> bytes:
    """The bytes of a Lance file holding `tbl` (written to a local temp file, then read)."""
    with tempfile.TemporaryDirectory(prefix="memwal-snapshot-") as d:
        path = os.path.join(d, SNAPSHOT_FILE)
        with LanceFileWriter(path, tbl.schema) as w:
            if tbl.num_rows:
                w.write_batch(tbl)
        with open(path, "rb") as f:
            return f.read()


def decode_lance_file(raw: bytes) -> pa.Table:
    with tempfile.TemporaryDirectory(prefix="memwal-snapshot-") as d:
        path = os.path.join(d, SNAPSHOT_FILE)
        with open(path, "wb") as f:
            f.write(raw)
        return LanceFileReader(path).read_all().to_table()


def external_key(index_uuid: str) -> str:
    """Store key of the external snapshot file of the MemWAL index with uuid `index_uuid`."""
    return f"_indices/{index_uuid}/{SNAPSHOT_FILE}"


def write_external(loc: TableLocation, tbl: pa.Table, index_uuid: str) -> int:
    """Write the snapshot through Lance (table storage options, so S3 works); returns its size."""
    faults.op(f"lance_write {external_key(index_uuid)}")  # reliability tests: a crash point
    w = LanceFileWriter(loc.child_uri(external_key(index_uuid)), tbl.schema,
                        storage_options=loc.storage_options or None)
    with w:
        if tbl.num_rows:
            w.write_batch(tbl)
    size = w.size_bytes
    if size is None:
        info = loc.store.head(external_key(index_uuid))
        size = info.size if info else 0
    return int(size)


def read_snapshot(loc: TableLocation, state: table.MemWalState | None = None) -> pa.Table:
    """The region snapshot stored in the MemWAL index of `state` (default: latest version).

    Raises `SnapshotNotFound` when none was built yet, `SnapshotError` when one exists but
    cannot be read."""
    if state is None:
        state = table.read_memwal_state(loc)
    d = state.details
    if d.HasField("inline_snapshots"):
        try:
            return decode_lance_file(d.inline_snapshots)
        except Exception as e:  # noqa: BLE001
            raise SnapshotError(f"table {loc.lance_uri} version {state.table_version}: inline "
                                f"region snapshot is not a readable Lance file: {e}") from None
    index_uuid = str(uuid.UUID(bytes=state.index.uuid.uuid))
    key = external_key(index_uuid)
    if not loc.store.exists(key):
        raise SnapshotNotFound(f"table {loc.lance_uri} version {state.table_version}: the MemWAL "
                               f"index has no inline snapshot and no {key} (no snapshot built yet)")
    try:
        return LanceFileReader(loc.child_uri(key), storage_options=loc.storage_options or None
                               ).read_all().to_table()
    except Exception as e:  # noqa: BLE001
        raise SnapshotError(f"table {loc.lance_uri}: region snapshot {key} is unreadable: {e}") from None


__all__ = ["SNAPSHOT_FILE", "REGION_FIELD_PREFIX", "SOURCE_COLUMN", "SNAPSHOT_COLUMNS", "SnapshotError",
           "SnapshotNotFound", "IndexRow", "result_arrow_type", "decode_field_value", "snapshot_schema",
           "snapshot_table", "field_values", "index_rows", "encode_lance_file", "decode_lance_file",
           "external_key", "write_external", "read_snapshot"]
