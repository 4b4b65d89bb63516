"""MemWAL index builder: region snapshots and WAL-position hints (spec "MemWAL Index Builder").

One run:

1. read the MemWAL index of the latest table version (configuration, merge progress, catch-up);
2. list the regions, load their latest manifests in parallel (`region.load_many`); generations
   written before the MemWAL initialization (`state/lifecycle.py`) are left out of the rows;
3. per region (in parallel): probe the WAL tail after `wal_entry_position_last_seen`; where the
   tail is newer, commit a region manifest version that changes only that hint (best effort:
   a failure is logged and reported, never fatal); derive the region field values;
4. build one snapshot row per region (`SNAPSHOT_COLUMNS` + `region_field_{field_id}` per field
   of the region specs + `_region_field_source`), encode it as a Lance file: inline in
   `inline_snapshots` up to `inline_threshold` regions, else `_indices/{uuid}/index.lance`;
5. replace the `__lance_mem_wal` details through `table.guarded_replace_details`: the new
   details are a copy of the ones just read (every field, unknown ones included, byte for
   byte) with only `snapshot_ts_millis`, `num_regions` and `inline_snapshots` changed. A lost
   race (any commit since the read, e.g. a merge recording progress) re-reads the table and
   rebuilds the details from the fresh read, so merge progress and catch-up are never erased.

The region pass (3) runs once per build; commit retries re-read only the table (the rows do
not depend on it unless the region specs change, in which case the rows are rebuilt).

Region field values: pylance 14 never fills `region_field_entries`, so a value is taken from
the manifest when it is there, else derived from the region's rows (the lowest flushed
generation with live rows, read through Lance, evaluated with `memwal_core.state.routing`); rows that
disagree give no value and a reported problem. `_region_field_source` records where each row's
values came from: 'manifest', 'derived:gen_N' (a merged generation), 'provisional:gen_N' (one
not merged yet: shown to readers, not trusted by the merger, derived again by the next build),
'derived:unsharded' (no rows needed),
'none' (manual region, spec 0: no fields) or 'unknown'. Values derived by an earlier build are
reused from the previous snapshot (a region's value never changes), so repeated builds do not
re-read generations.
"""

from __future__ import annotations

import logging
import os
import random
import struct
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import lance
import pyarrow as pa
import pyarrow.compute as pc

from memwal_core import faults
from memwal_core.errors import one_line
from memwal_core.options import SnapshotOptions
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, lease, lifecycle, region, routing, table, wal
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.snapshot")

DEFAULT_INLINE_THRESHOLD = SnapshotOptions().inline_threshold  # one default: memwal_core/options.py
SNAPSHOT_FILE = "index.lance"
REGION_FIELD_PREFIX = "region_field_"
SOURCE_COLUMN = "_region_field_source"
TOMBSTONE = "_tombstone"
MAX_DERIVE_GENERATIONS = 3  # unmerged generations tried (ascending) to find live rows for a region value

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
# Result


@dataclass
class SnapshotResult:
    num_regions: int
    storage: str  # 'inline' | 'external' | 'none' (dry run)
    hints_updated: dict[str, tuple[int, int]]  # region -> (old hint, new hint)
    region_errors: dict[str, str]  # region -> error (its previous row is kept when there is one)
    table_version: int  # the version committed (dry run: the version read)
    duration_s: float
    index_uuid: str | None = None
    external_key: str | None = None  # store key of the external snapshot file
    hint_errors: dict[str, str] = field(default_factory=dict)  # best-effort hint commits that failed
    region_field_sources: dict[str, str] = field(default_factory=dict)
    region_field_problems: dict[str, str] = field(default_factory=dict)
    skipped_dirs: list[tuple[str, str]] = field(default_factory=list)
    attempts: int = 1  # commit attempts (1 = no lost race)
    snapshot_ts_millis: int = 0
    dry_run: bool = False
    regions_kept: dict[str, int] = field(default_factory=dict)  # failed region -> manifest version of its kept row
    committed: bool = False  # False: dry run, or the snapshot was unchanged (nothing committed)

    @property
    def inline(self) -> bool:
        return self.storage == "inline"

    @property
    def external(self) -> bool:
        return self.storage == "external"


# --------------------------------------------------------------------------------------------
# Region specs and region field values


def spec_from_pb(spec: pb.RegionSpec) -> routing.RegionSpec:
    """memwal's protobuf region spec -> `routing.RegionSpec`."""
    return routing.RegionSpec.from_proto(spec)


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


@dataclass
class FieldValues:
    values: dict[str, Any]  # field_id -> value (missing or None when unknown)
    source: str
    problem: str | None = None


def _single_value(arr: pa.Array | pa.ChunkedArray) -> tuple[bool, Any]:
    if len(arr) == 0:
        return False, None
    if pc.count_distinct(arr, mode="all").as_py() != 1:
        return False, None
    return True, arr[0].as_py()


def derive_region_fields(loc: TableLocation, spec: routing.RegionSpec, lance_schema: Any,
                         pk: list[str], m: region.RegionManifest, *, upto: int | None = None,
                         merged: int | None = None) -> FieldValues:
    """Region field values of one region, from its manifest or derived from its rows.

    `upto`: derive only from generations at or below it (the merger passes merge progress:
    generations it already accepted, never the ones it is about to check). `merged`: the
    region's merge progress; a value from a generation above it is 'provisional:gen_N' (shown
    to readers, never trusted by the merger or pinned for later builds), else 'derived:gen_N'."""
    if not spec.fields:
        return FieldValues({}, "none")
    types = {f.field_id: result_arrow_type(f.result_type) for f in spec.fields}
    entries = {e.field_id: e.value for e in m.message.region_field_entries}
    if entries and all(f.field_id in entries for f in spec.fields):
        try:
            return FieldValues({fid: decode_field_value(entries[fid], types[fid]) for fid in types},
                               "manifest")
        except ValueError as e:
            log.warning("region %s: undecodable region_field_entries (%s); deriving from rows",
                        m.region_id, e)
    if all(f.transform == routing.UNSHARDED for f in spec.fields):
        return FieldValues({f.field_id: 0 for f in spec.fields}, "derived:unsharded")

    try:
        by_id = routing.source_columns_for(spec, lance_schema)
    except (ValueError, routing.UnsupportedTransform) as e:
        return FieldValues({}, "unknown", f"region spec {spec.spec_id}: {e}")
    columns = set(by_id.values())
    columns.update(f.params["column"] for f in spec.fields if f.params.get("column", "").strip())
    key_only = columns <= set(pk)  # tombstone rows carry the key columns only

    problems = []
    # Every merged generation may be tried (the value must be found while one is listed: GC
    # keeps them until a snapshot records it), at most MAX_DERIVE_GENERATIONS of the others.
    accepted = upto if upto is not None else merged
    listed = [g for g in m.generations if upto is None or g.generation <= upto]
    older = [g for g in listed if accepted is not None and g.generation <= accepted]
    for g in older + [g for g in listed if g not in older][:MAX_DERIVE_GENERATIONS]:
        try:
            key = layout.generation_dir(m.region_id, g.path, g.generation)
            gen_ds = lance.dataset(loc.child_uri(key), storage_options=loc.storage_options or None)
            names = set(gen_ds.schema.names)
            cols = sorted(columns) + ([TOMBSTONE] if TOMBSTONE in names else [])
            rows = gen_ds.to_table(columns=cols)
        except Exception as e:  # noqa: BLE001 - a vanished (GC'd) or broken generation: try the next
            problems.append(f"gen {g.generation}: {one_line(e)}")
            continue
        if TOMBSTONE in rows.column_names:
            live = rows.filter(pc.invert(pc.fill_null(rows[TOMBSTONE], False)))
            rows = live if live.num_rows or not key_only else rows
        if rows.num_rows == 0:
            continue
        try:
            arrays = routing.field_values(spec, rows, by_id)
        except (ValueError, routing.UnsupportedTransform) as e:
            return FieldValues({}, "unknown", f"gen {g.generation}: {e}")
        values, disagree = {}, []
        for fid, arr in arrays.items():
            ok, v = _single_value(arr)
            if ok:
                values[fid] = v
            else:
                disagree.append(f"{fid}: {pc.count_distinct(arr, mode='all').as_py()} distinct values")
        if disagree:
            msg = (f"rows of generation {g.generation} disagree on the region value "
                   f"({'; '.join(disagree)}): misrouted rows")
            log.warning("region %s: %s", m.region_id, msg)
            return FieldValues({}, "unknown", msg)
        kind = "provisional" if merged is not None and g.generation > merged else "derived"
        return FieldValues(values, f"{kind}:gen_{g.generation}")
    why = "; ".join(problems) if problems else "no flushed generation with rows yet"
    return FieldValues({}, "unknown", None if not problems else why)


# --------------------------------------------------------------------------------------------
# Snapshot schema and encoding


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


@dataclass
class RegionRow:
    manifest: region.RegionManifest
    fields: FieldValues


def snapshot_table(rows: list[RegionRow], specs: list[pb.RegionSpec]) -> pa.Table:
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
        vals = [r.fields.values.get(fid) for r in rows]
        arrays.append(_typed_array(vals, f.type))
    arrays.append(pa.array([r.fields.source for r in rows], pa.string()))
    return pa.Table.from_arrays(arrays, schema=schema)


def _typed_array(vals: list, typ: pa.DataType) -> pa.Array:
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


def encode_lance_file(tbl: pa.Table) -> bytes:
    """The bytes of a Lance file holding `tbl` (written to a local temp file, then read)."""
    from lance.file import LanceFileWriter

    with tempfile.TemporaryDirectory(prefix="memwal-snapshot-") as d:
        path = os.path.join(d, SNAPSHOT_FILE)
        with LanceFileWriter(path, tbl.schema) as w:
            if tbl.num_rows:
                w.write_batch(tbl)
        with open(path, "rb") as f:
            return f.read()


def decode_lance_file(raw: bytes) -> pa.Table:
    from lance.file import LanceFileReader

    with tempfile.TemporaryDirectory(prefix="memwal-snapshot-") as d:
        path = os.path.join(d, SNAPSHOT_FILE)
        with open(path, "wb") as f:
            f.write(raw)
        return LanceFileReader(path).read_all().to_table()


def external_key(index_uuid: str) -> str:
    return f"_indices/{index_uuid}/{SNAPSHOT_FILE}"


def write_external(loc: TableLocation, tbl: pa.Table, index_uuid: str) -> int:
    """Write the snapshot through Lance (table storage options, so S3 works); returns its size."""
    from lance.file import LanceFileWriter

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
    """The region snapshot stored in the MemWAL index of `state` (default: latest version)."""
    from lance.file import LanceFileReader

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


def snapshot_field_values(tbl: pa.Table, *, authoritative: bool = False) -> dict[str, dict[str, Any]]:
    """Region id -> {field id: value} for the snapshot rows whose value is known.

    Rows with source 'unknown' are left out; with `authoritative`, 'provisional' ones too (a
    value read from a generation that was not merged yet, which is what the merger checks).
    """
    field_cols = [c for c in tbl.column_names if c.startswith(REGION_FIELD_PREFIX)]
    has_source = SOURCE_COLUMN in tbl.column_names
    out: dict[str, dict[str, Any]] = {}
    for r in tbl.select(["region_id"] + field_cols + ([SOURCE_COLUMN] if has_source else [])).to_pylist():
        src = r.get(SOURCE_COLUMN) if has_source else None
        if src in ("unknown", "none") or (authoritative and (src or "").startswith("provisional")):
            continue
        vals = {c[len(REGION_FIELD_PREFIX):]: r[c] for c in field_cols if r[c] is not None}
        if vals or src:
            out[str(uuid.UUID(bytes=r["region_id"]))] = vals
    return out


def recorded_values(loc: TableLocation, state: table.MemWalState) -> dict[str, dict[str, Any]]:
    """Region values recorded in the MemWAL snapshot of `state` ({} when none was built yet).

    Raises `SnapshotError` when a snapshot exists but cannot be read: "no snapshot" would
    silently weaken every routing check that relies on the recorded values."""
    try:
        return snapshot_field_values(read_snapshot(loc, state), authoritative=True)
    except SnapshotNotFound:
        return {}


def _previous_snapshot(loc: TableLocation, state: table.MemWalState) -> pa.Table | None:
    try:
        prev = read_snapshot(loc, state)
    except SnapshotError:
        return None
    return prev if "region_id" in prev.column_names else None


def _previous_field_values(prev: pa.Table | None) -> dict[str, tuple[int, FieldValues]]:
    """Derived values of the previous snapshot: region -> (spec id, values)."""
    if prev is None or SOURCE_COLUMN not in prev.column_names:
        return {}
    out: dict[str, tuple[int, FieldValues]] = {}
    field_cols = [c for c in prev.column_names if c.startswith(REGION_FIELD_PREFIX)]
    for r in prev.select(["region_id", "region_spec_id", SOURCE_COLUMN] + field_cols).to_pylist():
        src = r[SOURCE_COLUMN] or ""
        if not src.startswith("derived:gen_") or r["region_id"] is None:
            continue
        vals = {c[len(REGION_FIELD_PREFIX):]: r[c] for c in field_cols if r[c] is not None}
        out[str(uuid.UUID(bytes=r["region_id"]))] = (r["region_spec_id"], FieldValues(vals, src))
    return out


def _previous_rows(prev: pa.Table | None) -> dict[str, RegionRow]:
    """The previous snapshot's rows as `RegionRow`s, to keep a region this build cannot load.

    A reader of the index builds its view from these rows; dropping a region because its
    manifest failed to load once would hide its unmerged generations from every such reader.
    """
    if prev is None:
        return {}
    field_cols = [c for c in prev.column_names if c.startswith(REGION_FIELD_PREFIX)]
    out: dict[str, RegionRow] = {}
    for r in prev.to_pylist():
        if r.get("region_id") is None:
            continue
        rid = str(uuid.UUID(bytes=r["region_id"]))
        msg = pb.RegionManifest(
            version=r["version"], writer_epoch=r["writer_epoch"],
            replay_after_wal_entry_position=r["replay_after_wal_entry_position"],
            wal_entry_position_last_seen=r["wal_entry_position_last_seen"],
            current_generation=r["current_generation"], region_spec_id=r["region_spec_id"])
        msg.region_id.uuid = r["region_id"]
        for g in r["flushed_generations"] or []:
            msg.flushed_generations.add(generation=g["generation"], path=g["path"])
        values = {c[len(REGION_FIELD_PREFIX):]: r[c] for c in field_cols if r[c] is not None}
        out[rid] = RegionRow(region.RegionManifest(rid, r["version"], msg),
                             FieldValues(values, r.get(SOURCE_COLUMN) or "unknown"))
    return out


# --------------------------------------------------------------------------------------------
# The region pass


def _hint_mutation(observed: int) -> region.Mutation:
    def mutate(msg: pb.RegionManifest) -> bool:
        if msg.wal_entry_position_last_seen >= observed:
            return False
        msg.wal_entry_position_last_seen = observed
        return True

    return mutate


@dataclass
class _RegionOutcome:
    row: RegionRow | None = None
    error: str | None = None
    hint: tuple[int, int] | None = None
    hint_error: str | None = None


def refresh_hint(loc: TableLocation, m: region.RegionManifest, *,
                 max_attempts: int = 10) -> tuple[region.RegionManifest, tuple[int, int] | None, str | None]:
    """Probe the WAL tail after the hint; commit a raised hint where the tail is newer.

    Returns (latest manifest known, (old, new) if committed, error if the best-effort commit
    failed). Only `wal_entry_position_last_seen` changes, and only upwards.
    """
    if m.sealed:
        return m, None, None  # sealed: its last version stays the last one (writers never come back)
    old = m.message.wal_entry_position_last_seen
    try:
        observed = wal.probe_tail(loc.store, m.region_id, old + 1)
    except Exception as e:  # noqa: BLE001 - best effort
        log.info("region %s: WAL tail probe failed (%s)", m.region_id, e)
        return m, None, f"WAL probe: {type(e).__name__}: {e}"
    if observed <= old:
        return m, None, None
    try:
        committed = region.commit_next(loc.store, m, _hint_mutation(observed), max_attempts=max_attempts)
    except region.ManifestGap:
        raise  # not a hint problem: the manifest read is stale, the region cannot be snapshotted
    except Exception as e:  # noqa: BLE001 - best effort: log and carry on with what we read
        log.info("region %s: WAL hint not raised to %d (%s)", m.region_id, observed, e)
        return m, None, f"{type(e).__name__}: {e}"
    if committed is not None:
        return committed, (old, observed), None
    # Someone (a flushing writer) already committed a hint >= observed: show their version.
    try:
        return region.load_latest(loc.store, m.region_id, start=m.version), None, None
    except Exception:  # noqa: BLE001
        return m, None, None


def _region_pass(loc: TableLocation, state: table.MemWalState, ds: lance.LanceDataset, *,
                 max_workers: int, update_hints: bool, derive_fields: bool,
                 reuse: dict[str, tuple[int, FieldValues]]):
    listing = region.list_regions(loc.store)
    loaded = region.load_many(loc.store, listing.region_ids, max_workers=max_workers)
    # Generations from before the MemWAL initialization are never published as unmerged data
    # (nor used for a region value): readers of the snapshot would read rows the overwrite replaced.
    stale = lifecycle.assess(loc, loaded.manifests, current_version=state.table_version, record=False)
    specs = {s.spec_id: spec_from_pb(s) for s in state.details.region_specs}
    lance_schema = ds.lance_schema
    try:
        pk = table.primary_key(ds)
    except table.NoPrimaryKey:
        pk = []

    def one(rid: str) -> _RegionOutcome:
        got = loaded[rid]
        if not got.ok:
            return _RegionOutcome(error=got.message)
        if rid in stale.errors:
            return _RegionOutcome(error=stale.errors[rid])
        out = _RegionOutcome()
        m = got.manifest
        if update_hints:
            try:
                m, out.hint, out.hint_error = refresh_hint(loc, m)
            except region.ManifestGap as e:
                return _RegionOutcome(error=str(e))
        m = lifecycle.without_stale(m, stale.verdict(rid))
        spec_id = m.message.region_spec_id
        if spec_id == 0:
            fv = FieldValues({}, "none")
        elif spec_id not in specs:
            fv = FieldValues({}, "unknown", f"region spec {spec_id} is not in the MemWAL index")
        elif rid in reuse and reuse[rid][0] == spec_id:
            fv = reuse[rid][1]
        elif derive_fields:
            try:
                fv = derive_region_fields(loc, specs[spec_id], lance_schema, pk, m,
                                          merged=state.merged.get(rid, 0))
            except Exception as e:  # noqa: BLE001 - a value we cannot derive is not fatal
                fv = FieldValues({}, "unknown", f"{type(e).__name__}: {e}")
        else:
            fv = FieldValues({}, "unknown")
        out.row = RegionRow(m, fv)
        return out

    ids = listing.region_ids
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(ids) or 1))) as pool:
        outcomes = dict(zip(ids, pool.map(one, ids)))
    return listing, outcomes, stale


# --------------------------------------------------------------------------------------------
# The builder


@lease.step("index")
def build_snapshot(loc: TableLocation, *, inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
                   max_workers: int = 16, max_attempts: int = 5, update_hints: bool = True,
                   derive_fields: bool = True, dry_run: bool = False) -> SnapshotResult:
    """Build and commit a new region snapshot in the MemWAL index (see the module docstring).

    `dry_run` reads and reports without committing anything (no hint updates either).
    Raises `SnapshotError` after `max_attempts` lost races against other table commits.
    """
    t0 = time.monotonic()
    ds = table.open_dataset(loc)
    state = table.read_memwal_state(loc, ds.version)
    prev = _previous_snapshot(loc, state)
    reuse = _previous_field_values(prev) if derive_fields else {}
    ts_millis = int(time.time() * 1000)
    listing, outcomes, _ = _region_pass(loc, state, ds, max_workers=max_workers,
                                     update_hints=update_hints and not dry_run,
                                     derive_fields=derive_fields, reuse=reuse)
    rows = [o.row for o in outcomes.values() if o.row is not None]
    kept = {rid: row for rid, row in _previous_rows(prev).items() if outcomes.get(rid) and outcomes[rid].error}
    rows += kept.values()
    result = SnapshotResult(
        num_regions=len(rows), storage="none", table_version=state.table_version, duration_s=0.0,
        hints_updated={r: o.hint for r, o in outcomes.items() if o.hint},
        region_errors={r: o.error for r, o in outcomes.items() if o.error},
        hint_errors={r: o.hint_error for r, o in outcomes.items() if o.hint_error},
        region_field_sources={o.row.manifest.region_id: o.row.fields.source for o in outcomes.values() if o.row},
        region_field_problems={o.row.manifest.region_id: o.row.fields.problem
                               for o in outcomes.values() if o.row and o.row.fields.problem},
        skipped_dirs=list(listing.skipped), snapshot_ts_millis=ts_millis, dry_run=dry_run,
        regions_kept={rid: row.manifest.version for rid, row in kept.items()},
    )
    for rid, err in result.region_errors.items():
        if rid in kept:
            log.warning("region %s: %s; keeping its previous snapshot row (manifest version %d)",
                        rid, err, kept[rid].manifest.version)
        else:
            log.warning("region %s left out of the snapshot (no previous row to keep): %s", rid, err)
    if dry_run:
        result.duration_s = time.monotonic() - t0
        return result

    built_for: bytes | None = None
    tbl: pa.Table | None = None
    inline_bytes: bytes | None = None
    for attempt in range(1, max_attempts + 1):
        if attempt > 1:
            time.sleep(random.uniform(0.005, 0.02) * attempt)
            ds = table.open_dataset(loc)
            state = table.read_memwal_state(loc, ds.version)
        specs_key = b"".join(s.SerializeToString() for s in state.details.region_specs)
        if specs_key != built_for:  # first attempt, or the region specs changed meanwhile
            if built_for is not None:
                specs = {s.spec_id: spec_from_pb(s) for s in state.details.region_specs}
                rows = [RegionRow(r.manifest, _revalue(loc, r, specs, ds, derive_fields)) for r in rows]
            tbl = snapshot_table(rows, list(state.details.region_specs))
            inline_bytes = encode_lance_file(tbl) if len(rows) <= inline_threshold else None
            built_for = specs_key

        if snapshot_unchanged(loc, state, tbl, inline=inline_bytes is not None):
            # An idle table gains no table version: the stored snapshot already says this
            # (`snapshot_ts_millis` stays the time of the last change).
            result.storage = "inline" if state.details.HasField("inline_snapshots") else "external"
            result.snapshot_ts_millis = state.details.snapshot_ts_millis
            result.duration_s = time.monotonic() - t0
            log.info("MemWAL snapshot of %d regions unchanged; nothing committed (table version %d)",
                     len(rows), state.table_version)
            return result

        details = pb.MemWalIndexDetails()
        details.CopyFrom(state.details)  # configuration, merge progress, catch-up: as read
        details.snapshot_ts_millis = ts_millis
        details.num_regions = len(rows)
        lease.fence(loc, "MemWAL index commit")  # before its external file: nothing left behind
        index_uuid = str(uuid.uuid4())
        files = None
        if inline_bytes is not None:
            details.inline_snapshots = inline_bytes
        else:
            details.ClearField("inline_snapshots")
            files = [(SNAPSHOT_FILE, write_external(loc, tbl, index_uuid))]
        try:
            version = table.guarded_replace_details(loc, state, details, index_uuid=index_uuid,
                                                    files=files)
        except table.LostRace as e:
            log.info("snapshot commit attempt %d lost a race (%s); re-reading", attempt, e)
            if files:
                _delete_quietly(loc, external_key(index_uuid))
            continue
        except BaseException:
            if files:
                _delete_quietly(loc, external_key(index_uuid))
            raise
        result.storage = "inline" if inline_bytes is not None else "external"
        result.table_version = version
        result.index_uuid = index_uuid
        result.external_key = None if inline_bytes is not None else external_key(index_uuid)
        result.attempts = attempt
        result.committed = True
        result.duration_s = time.monotonic() - t0
        log.info("MemWAL snapshot of %d regions committed (%s) as table version %d in %.2fs",
                 len(rows), result.storage, version, result.duration_s)
        return result
    raise SnapshotError(f"table {loc.lance_uri}: gave up committing the MemWAL snapshot after "
                        f"{max_attempts} lost races with other commits (merges, index rebuilds); "
                        "nothing was replaced, run the builder again")


def snapshot_unchanged(loc: TableLocation, state: table.MemWalState, tbl: pa.Table, *, inline: bool) -> bool:
    """Whether the MemWAL index of `state` already holds exactly the rows of `tbl` (same schema,
    same rows: region manifest versions included, so any region change shows), in the storage
    the threshold would choose. Unreadable or absent: changed (commit)."""
    if state.details.num_regions != tbl.num_rows or state.details.HasField("inline_snapshots") != inline:
        return False
    try:
        current = read_snapshot(loc, state)
    except SnapshotError:
        return False
    return current.schema.equals(tbl.schema) and current.equals(tbl)


def _revalue(loc: TableLocation, r: RegionRow, specs: dict[int, routing.RegionSpec],
             ds: lance.LanceDataset, derive_fields: bool) -> FieldValues:
    spec_id = r.manifest.message.region_spec_id
    if spec_id == 0:
        return FieldValues({}, "none")
    if spec_id not in specs:
        return FieldValues({}, "unknown", f"region spec {spec_id} is not in the MemWAL index")
    if not derive_fields:
        return FieldValues({}, "unknown")
    try:
        pk = table.primary_key(ds)
    except table.NoPrimaryKey:
        pk = []
    return derive_region_fields(loc, specs[spec_id], ds.lance_schema, pk, r.manifest,
                                merged=table.read_memwal_state(loc, ds.version).merged.get(r.manifest.region_id, 0))


def _delete_quietly(loc: TableLocation, key: str) -> None:
    try:
        loc.store.delete_many([key])
    except Exception as e:  # noqa: BLE001 - an orphan under _indices/ is harmless
        log.info("could not delete unused snapshot file %s (%s)", key, e)
