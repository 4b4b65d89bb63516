"""Where a region's field values come from, and which of them a job may trust.

A sharded region holds one region value (one value per field of its region spec); every row of
its generations must route to it, and no two regions may hold the same one. The merger checks
each pending generation against the region's value, GC keeps the generations that value rests
on, the checks and `memwal status` report regions that break it. Taking a wrong value for
trusted is a data-loss rule: a misrouted generation would be merged as if it belonged, and two
regions would hold one key. So every job asks this module, and only this module says which
value may be trusted.

**Sources** (`SourceKind`; stored in the MemWAL index's `_region_field_source` column as the
labels shown, see `state/memwal_index.py`):

- `manifest`: the region manifest's `region_field_entries` (pylance 14 never writes them, so
  today this is another writer's record). Trusted.
- `derived:gen_N`: the live rows of generation N, a *merged* generation, all route to it. Trusted:
  the merger accepted those rows (against the value it knew, or establishing a value no other
  region owns). Reused by every later index build (a region's value never changes), so once it
  is recorded (below) GC may trim generation N.
- `derived:unsharded`: every field is `unsharded` (value 0, no rows needed). Trusted.
- `provisional:gen_N`: the rows of generation N, not merged yet. Shown to readers (partition
  labels, status), never trusted: those are the rows the merger is about to check, and a
  misrouted generation would vouch for itself. Derived again by the next build.
- `none`: a manual region (spec 0): no fields, nothing to route. `unknown`: no value (no rows
  yet, rows that disagree, a spec or type memwal cannot evaluate, unreadable generations), and
  any label this version of memwal does not know: a newer builder's weaker source must never be
  taken for a trusted one.
- a row without a label (an index another builder wrote, without memwal's column) is the
  spec's recorded value: trusted, as the spec says.

**Recorded values** (`recorded_values`): the trusted rows of the MemWAL index's snapshot, and for
the regions it does not record so, the durable record of the current MemWAL lifetime
(`state/value_records.py`, under `_memwal/`). The index builder writes a `durable` value
(`manifest`, `derived:gen_N`: they never change within a lifetime) there before the snapshot
commit that publishes it, because a snapshot stored as an external file is left behind by
pylance at the next commit that changes the MemWAL index; a snapshot stored inline travels with
every commit. So a value counts as recorded for GC (`unrecorded_regions`) when an inline
snapshot or the durable record holds it, and the merger and the next index build read it from
either. The record of an earlier lifetime (an overwrite and a new `initialize_mem_wal` may shard
differently) is never used, nor any record while the initialization is unknown.

**The trusted value of a region** (`trusted_values`): the caller's `expected` value, else the
recorded value, else the value of its oldest *merged* generation still listed whose live rows
all agree. Never a pending generation's, never a stale one's (data
from before the MemWAL initialization, `state/lifecycle.py`). A region with none of these
establishes its value in the merger from its first routed generation (unanimous, not owned by
another region).

**Unreadable index or record.** `read_recorded` raises `SnapshotError` when an index exists but
cannot be read, and when the durable records cannot be listed or read (a store error): "nothing
recorded" would silently weaken the merger's check. A *garbled* record concerns its own region
only: `read_recorded` returns it apart (`RecordedValues.garbled`), and the merger walls that
region when nothing else gives its value, and holds back only the regions that would establish a
value while it is unknown (`jobs/merge/owners.py`); the others merge. GC, which only needs to
know what to *keep*, treats either as recording nothing (`unrecorded_regions`) and keeps more.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

import lance
import pyarrow as pa
import pyarrow.compute as pc

from memwal_core.errors import one_line
from memwal_core.state import layout, lifecycle, memwal_index, region, routing, table, value_records
from memwal_core.state.memwal_index import SnapshotError, SnapshotNotFound  # noqa: F401 - raised here
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.region_values")

TOMBSTONE = "_tombstone"
MAX_DERIVE_GENERATIONS = 3  # unmerged generations tried (ascending) to find live rows for a region value


# --------------------------------------------------------------------------------------------
# Value sources


class SourceKind(Enum):
    """Where a region's field values came from (module docstring: which ones are trusted)."""

    MANIFEST = "manifest"
    DERIVED = "derived"          # rows of a merged generation
    UNSHARDED = "unsharded"      # every field unsharded: 0, no rows needed
    PROVISIONAL = "provisional"  # rows of a generation not merged yet
    NONE = "none"                # manual region (spec 0): no fields
    UNKNOWN = "unknown"          # no value, or a label this version does not know
    UNLABELLED = "unlabelled"    # a stored row without a source label (another index builder)


_TRUSTED = frozenset({SourceKind.MANIFEST, SourceKind.DERIVED, SourceKind.UNSHARDED, SourceKind.UNLABELLED})
_PLAIN_LABELS = {"manifest": SourceKind.MANIFEST, "derived:unsharded": SourceKind.UNSHARDED,
                 "none": SourceKind.NONE, "unknown": SourceKind.UNKNOWN}
_GENERATION_KINDS = {"derived": SourceKind.DERIVED, "provisional": SourceKind.PROVISIONAL}


@dataclass(frozen=True)
class ValueSource:
    """A source kind, with the generation the values were read from for the row-derived kinds."""

    kind: SourceKind
    generation: int | None = None

    @property
    def trusted(self) -> bool:
        """Whether a job may route, merge or collect garbage by this value."""
        return self.kind in _TRUSTED

    @property
    def pinned(self) -> bool:
        """Whether the next index build reuses the value instead of deriving it again (a merged
        generation's value: it never changes, and GC may trim the generation once recorded)."""
        return self.kind is SourceKind.DERIVED

    @property
    def durable(self) -> bool:
        """Whether the value never changes within a MemWAL lifetime, so the index builder records
        it under `_memwal/` (`state/value_records.py`) before publishing it: a merged generation's
        value, or the region manifest's."""
        return self.kind in (SourceKind.DERIVED, SourceKind.MANIFEST)

    @property
    def shown(self) -> bool:
        """Whether the value is shown to readers at all (provisional ones are)."""
        return self.kind not in (SourceKind.NONE, SourceKind.UNKNOWN)

    @property
    def label(self) -> str | None:
        """The `_region_field_source` label stored in the MemWAL index."""
        if self.kind in _GENERATION_KINDS.values():
            return f"{self.kind.value}:gen_{self.generation}"
        if self.kind is SourceKind.UNSHARDED:
            return "derived:unsharded"
        return None if self.kind is SourceKind.UNLABELLED else self.kind.value

    def __str__(self) -> str:
        return self.label or self.kind.value

    @staticmethod
    def parse(label: str | None) -> "ValueSource":
        """The source a stored label names (an unrecognised label is `unknown`: not trusted)."""
        if label is None:
            return ValueSource(SourceKind.UNLABELLED)
        if label in _PLAIN_LABELS:
            return ValueSource(_PLAIN_LABELS[label])
        prefix, _, gen = label.partition(":gen_")
        if prefix in _GENERATION_KINDS and gen.isdigit():
            return ValueSource(_GENERATION_KINDS[prefix], int(gen))
        return ValueSource(SourceKind.UNKNOWN)


NO_FIELDS = ValueSource(SourceKind.NONE)
UNKNOWN = ValueSource(SourceKind.UNKNOWN)


@dataclass
class FieldValues:
    """A region's values (field id -> value; missing when unknown), their source, and why no
    value was found when that is worth reporting."""

    values: dict[str, Any]
    source: ValueSource
    problem: str | None = None


# --------------------------------------------------------------------------------------------
# Region specs


def region_specs(state: table.MemWalState) -> dict[int, routing.RegionSpec]:
    """Spec id -> region spec, as the MemWAL index of `state` defines them."""
    return {s.spec_id: routing.RegionSpec.from_proto(s) for s in state.details.region_specs}


def spec_field_ids(specs: dict, vals: dict) -> list[str] | None:
    """The field ids of the one region spec whose fields are exactly `vals`' keys (values from
    an index row carry no spec id here). `specs`: spec id -> protobuf or `routing.RegionSpec`."""
    for spec in specs.values():
        ids = [f.field_id for f in spec.fields]
        if ids and set(ids) == set(vals):
            return ids
    return None


def field_types(spec: routing.RegionSpec, lance_schema: Any, schema: pa.Schema) -> dict[str, pa.DataType]:
    """Field id -> the Arrow type of the field's values, what a value is recorded as
    (`state/value_records.py`). An identity field's is its source column's (its value is one of
    that column's values, and a result type may name a type `result_arrow_type` does not parse,
    e.g. a timestamp with a time zone); any other field's, the spec's result type (bucket and
    unsharded: int32)."""
    try:
        by_id = routing.source_columns_for(spec, lance_schema)
    except (ValueError, routing.UnsupportedTransform):
        by_id = {}
    out: dict[str, pa.DataType] = {}
    for f in spec.fields:
        name = f.params.get("column", "").strip() or (by_id.get(f.source_ids[0]) if f.source_ids else None)
        if f.transform == routing.IDENTITY and name and name in schema.names:
            out[f.field_id] = schema.field(name).type
        else:
            out[f.field_id] = memwal_index.result_arrow_type(f.result_type)
    return out


# --------------------------------------------------------------------------------------------
# Deriving a value from a region's manifest or rows


def _single_value(arr: pa.Array | pa.ChunkedArray) -> tuple[bool, Any]:
    if len(arr) == 0:
        return False, None
    if pc.count_distinct(arr, mode="all").as_py() != 1:
        return False, None
    return True, arr[0].as_py()


def _from_manifest(spec: routing.RegionSpec, m: region.RegionManifest) -> FieldValues | None:
    """The values of `region_field_entries` when they cover every field and decode."""
    types = {f.field_id: memwal_index.result_arrow_type(f.result_type) for f in spec.fields}
    entries = {e.field_id: e.value for e in m.message.region_field_entries}
    if not entries or not all(fid in entries for fid in types):
        return None
    try:
        return FieldValues({fid: memwal_index.decode_field_value(entries[fid], types[fid]) for fid in types},
                           ValueSource(SourceKind.MANIFEST))
    except ValueError as e:
        log.warning("region %s: undecodable region_field_entries (%s); deriving from rows", m.region_id, e)
        return None


def derive_region_fields(loc: TableLocation, spec: routing.RegionSpec, lance_schema: Any,
                         pk: list[str], m: region.RegionManifest, *, upto: int | None = None,
                         merged: int | None = None) -> FieldValues:
    """Region field values of one region, from its manifest or derived from its rows.

    `upto`: derive only from generations at or below it (the merger passes merge progress:
    generations it already accepted, never the ones it is about to check). `merged`: the
    region's merge progress; a value from a generation above it is provisional (shown to
    readers, never trusted by the merger or pinned for later builds), else derived. Rows that
    disagree give no value and a reported problem."""
    if not spec.fields:
        return FieldValues({}, NO_FIELDS)
    if (fv := _from_manifest(spec, m)) is not None:
        return fv
    if all(f.transform == routing.UNSHARDED for f in spec.fields):
        return FieldValues({f.field_id: 0 for f in spec.fields}, ValueSource(SourceKind.UNSHARDED))

    try:
        by_id = routing.source_columns_for(spec, lance_schema)
    except (ValueError, routing.UnsupportedTransform) as e:
        return FieldValues({}, UNKNOWN, f"region spec {spec.spec_id}: {e}")
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
            return FieldValues({}, UNKNOWN, f"gen {g.generation}: {e}")
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
            return FieldValues({}, UNKNOWN, msg)
        kind = SourceKind.PROVISIONAL if merged is not None and g.generation > merged else SourceKind.DERIVED
        return FieldValues(values, ValueSource(kind, g.generation))
    why = "; ".join(problems) if problems else "no flushed generation with rows yet"
    return FieldValues({}, UNKNOWN, None if not problems else why)


# --------------------------------------------------------------------------------------------
# Values recorded in the MemWAL index


def snapshot_field_values(tbl: pa.Table, *, authoritative: bool = False) -> dict[str, dict[str, Any]]:
    """Region id -> {field id: value} for the index rows whose value is shown.

    Rows without a value (`none`, `unknown`) are left out; with `authoritative`, every row whose
    source is not trusted too (`provisional`: a value read from a generation not merged yet,
    which is what the merger checks).
    """
    out: dict[str, dict[str, Any]] = {}
    for rid, (label, vals) in memwal_index.field_values(tbl).items():
        src = ValueSource.parse(label)
        if not src.shown or (authoritative and not src.trusted):
            continue
        if vals or label is not None:
            out[rid] = vals
    return out


@dataclass
class RecordedValues:
    """The trusted values recorded for a table's regions (region -> {field id: value}), and the
    regions whose value was recorded durably but cannot be read: their record is garbled
    (region -> its key and why). Such a region's value is unknown, not absent."""

    values: dict[str, dict[str, Any]]
    garbled: dict[str, str]


def current_regions(loc: TableLocation, manifests: dict[str, region.RegionManifest] | None = None
                    ) -> dict[str, int | None]:
    """Region -> its region spec id (None: its manifest cannot be read), for every region the
    table lists: the regions whose records matter (a record of a region gone stands for
    nothing). `manifests`: those already loaded."""
    manifests = manifests or {}
    listed = region.list_regions(loc.store).region_ids
    loaded = region.load_many(loc.store, [rid for rid in listed if rid not in manifests]).manifests
    loaded.update(manifests)
    return {rid: (loaded[rid].message.region_spec_id if rid in loaded else None) for rid in listed}


def read_recorded(loc: TableLocation, state: table.MemWalState, init: lifecycle.Initialization | None = None,
                  regions: dict[str, int | None] | None = None) -> RecordedValues:
    """Trusted region values recorded in the MemWAL index of `state` ({} when none was built yet),
    and for the regions it does not record so, in the durable records of the lifetime of `init`
    (none when `init` is None or unknown). The snapshot's value comes first: the index builder
    copies a recorded value into it, so the two only differ when another builder wrote the index.

    Records are read for `regions` only (region -> the spec id its manifest names, None: not
    known; None: every region the table lists, `current_regions`), and a record counts only for
    that spec (for any spec of the index when it is not known). A garbled record is returned in
    `garbled`, never raised: it concerns its own region only, and the caller stops that region
    (and what cannot be checked without its value), not the others.

    Raises `SnapshotError` when an index snapshot exists but cannot be read, and when the records
    (or the regions) cannot be listed or read: "nothing recorded" would silently weaken every
    routing check that relies on the recorded values."""
    try:
        out = snapshot_field_values(memwal_index.read_snapshot(loc, state), authoritative=True)
    except SnapshotNotFound:
        out = {}
    if init is None or not init.known:
        return RecordedValues(out, {})
    specs = region_specs(state)
    try:
        regions = current_regions(loc) if regions is None else regions
        records = value_records.read(loc, init, regions, skip=out)
    except Exception as e:  # noqa: BLE001 - the store: recorded values exist or not, unknown
        raise SnapshotError(f"table {loc.lance_uri}: the region value records ({layout.VALUE_RECORDS_DIR}) "
                            f"cannot be read: {one_line(e)}") from None
    garbled = {rid: f"{layout.value_record_key(init.table_version, rid)}: {why}"
               for rid, why in records.garbled.items()}
    for rid, rec in records.values.items():
        want = regions.get(rid)
        if rec.values and (rec.spec_id == want if want is not None else rec.spec_id in specs):
            out[rid] = dict(rec.values)
    return RecordedValues(out, garbled)


def recorded_values(loc: TableLocation, state: table.MemWalState,
                    init: lifecycle.Initialization | None = None) -> dict[str, dict[str, Any]]:
    """`read_recorded(...).values`, for the current regions: what readers (checks, status)
    compare rows with. A garbled record gives its region no value (logged by the read)."""
    return read_recorded(loc, state, init).values


def recorded_durably(loc: TableLocation, init: lifecycle.Initialization | None,
                     manifests: dict[str, region.RegionManifest]) -> dict[str, value_records.ValueRecord]:
    """The durable records of the lifetime of `init` for the regions of `manifests`, each for the
    region spec its manifest names ({} when `init` is None or unknown). Raises as
    `value_records.read` does; garbled records are left out (logged there)."""
    got = value_records.read(loc, init, manifests).values
    return {rid: rec for rid, rec in got.items()
            if rec.values and rec.spec_id == manifests[rid].message.region_spec_id}


def pinned_values(tbl: pa.Table | None) -> dict[str, tuple[int, FieldValues]]:
    """Region -> (spec id, values) of the index rows whose values a new build reuses (`pinned`)."""
    if tbl is None or memwal_index.SOURCE_COLUMN not in tbl.column_names:
        return {}
    out: dict[str, tuple[int, FieldValues]] = {}
    for rid, row in memwal_index.index_rows(tbl).items():
        src = ValueSource.parse(row.source)
        if src.pinned:
            out[rid] = (row.manifest.message.region_spec_id, FieldValues(dict(row.values), src))
    return out


def unrecorded_regions(loc: TableLocation, state: table.MemWalState, manifests: dict[str, region.RegionManifest],
                       init: lifecycle.Initialization | None = None) -> set[str]:
    """Sharded regions of `manifests` whose value neither an inline MemWAL snapshot of `state` nor
    the durable record of the lifetime of `init` holds as trusted (every sharded region when
    `init` is None or unknown and the snapshot is not inline). An unreadable snapshot or record
    records nothing (logged): the caller keeps what such a region's value rests on (GC: its
    merged generations).

    A snapshot stored as an external file (`_indices/{uuid}/index.lance`, more than
    `SnapshotOptions.inline_threshold` regions) does not count: it is found through the uuid of
    the index that wrote it, and pylance gives the MemWAL index a new uuid, without the file, at
    the next commit that changes it (a merge, an index catch-up, a new index). The durable record
    stands in for it: the index builder writes it before that snapshot's commit."""
    sharded = {sid for sid, spec in region_specs(state).items() if spec.sharded}
    need = {rid for rid, m in manifests.items() if m.message.region_spec_id in sharded}
    if need and state.details.HasField("inline_snapshots"):
        try:
            inline = snapshot_field_values(memwal_index.read_snapshot(loc, state), authoritative=True)
        except Exception as e:  # noqa: BLE001 - unreadable: nothing is recorded as far as GC may assume
            log.warning("MemWAL index snapshot unreadable (%s): its regions count as unrecorded", e)
            inline = {}
        need = {rid for rid in need if not inline.get(rid)}
    if need and init is not None and init.known:
        try:
            durable = recorded_durably(loc, init, {rid: manifests[rid] for rid in need})
        except Exception as e:  # noqa: BLE001 - unreadable: nothing is recorded as far as GC may assume
            log.warning("region value records unreadable (%s): their regions count as unrecorded", one_line(e))
            durable = {}
        need -= set(durable)
    return need


# --------------------------------------------------------------------------------------------
# The trusted value of each region, and who owns which value


def trusted_values(loc: TableLocation, state: table.MemWalState, ds, manifests: dict[str, region.RegionManifest],
                   pk: list[str], expected: dict[str, dict],
                   recorded: dict[str, dict] | None = None,
                   stale: lifecycle.Lifecycle | None = None) -> dict[str, dict]:
    """Region id -> {field id: value}: what each region's rows must route to.

    Trusted only: `expected`, then the recorded value (the MemWAL index, else the durable record
    of the lifetime of `stale.init`; reused by every later build, so it never changes;
    `recorded`, read here when not given), then the oldest
    *merged* generation still listed whose live rows all agree (a generation the merger already
    accepted; never one it is about to check, which after GC trimmed the merged ones would be
    the pending ones). A region with none of these is left out: the merger establishes it from
    its first routed generation (unanimous, not owned by another region). Stale generations
    (`stale`: data from before the MemWAL initialization, discarded or not) are no authority:
    they are left out.
    """
    if stale is not None:
        manifests = {rid: lifecycle.without_stale(m, stale.verdict(rid)) for rid, m in manifests.items()}
    out = {rid: expected[rid] for rid in manifests if rid in expected}
    missing = [rid for rid in manifests if rid not in out]
    if missing:
        known = recorded_values(loc, state, stale.init if stale else None) if recorded is None else recorded
        out.update({rid: known[rid] for rid in missing if rid in known})
    specs = region_specs(state)
    merged = state.merged
    todo = [rid for rid in manifests if rid not in out and merged.get(rid, 0) > 0
            and manifests[rid].message.region_spec_id in specs]

    def derive(rid: str) -> FieldValues | None:
        m = manifests[rid]
        try:
            return derive_region_fields(loc, specs[m.message.region_spec_id], ds.lance_schema, pk, m,
                                        upto=merged[rid])
        except Exception as e:  # noqa: BLE001 - no value: the task's unanimity rule applies
            log.info("region %s: no region value derived (%s)", rid, e)
            return None

    if todo:
        with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
            for rid, fv in zip(todo, pool.map(derive, todo)):
                if fv is not None and fv.values and fv.source.trusted:
                    out[rid] = fv.values
    return out


def value_owners(recorded: dict[str, dict], specs: dict, values: dict[str, dict]) -> dict[str, str]:
    """Region value (`routing.value_key`) -> region, over every region the index records
    (pending or not) other than those of `values`: a new region may not adopt a value another
    region already holds (the caller adds its own regions' values)."""
    owners: dict[str, str] = {}
    for rid, vals in recorded.items():
        if rid in values:
            continue
        fields = spec_field_ids(specs, vals)
        if fields:
            owners[routing.value_key([vals.get(f) for f in fields])] = rid
    return owners


def unrecorded_owners(loc: TableLocation, state: table.MemWalState, ds, pk: list[str], specs: dict,
                      recorded: dict[str, dict], routed: dict[str, region.RegionManifest],
                      stale: lifecycle.Lifecycle | None = None) -> dict[str, str]:
    """Region value -> region, for regions with merge progress that no index records yet and
    that are not in `routed` (before the first index build, or merged since the last).

    Their values come from their merged generations (GC keeps those until an index records
    the value: `unrecorded_regions`). Without this, a new region could adopt the value of a
    region merged earlier, and two regions would write one value."""
    others = [rid for rid, g in state.merged.items() if g > 0 and rid not in recorded and rid not in routed
              and not (stale and stale.discarded_only(rid, g))]
    if not others:
        return {}
    reads = region.load_many(loc.store, others)
    derived = trusted_values(loc, state, ds, reads.manifests, pk, {}, recorded, stale)
    for rid in sorted(set(others) - set(derived)):
        why = reads.region_errors.get(rid) or "no value derived from its merged generations"
        log.warning("region %s: merged, not in a MemWAL snapshot (%s): a new region's value cannot be "
                    "checked against it", rid, why)
    return value_owners(derived, specs, {})


__all__ = ["SourceKind", "ValueSource", "FieldValues", "NO_FIELDS", "UNKNOWN", "MAX_DERIVE_GENERATIONS",
           "SnapshotError", "SnapshotNotFound", "region_specs", "spec_field_ids", "field_types",
           "derive_region_fields", "snapshot_field_values", "RecordedValues", "current_regions", "read_recorded",
           "recorded_values", "recorded_durably", "pinned_values", "unrecorded_regions", "trusted_values",
           "value_owners", "unrecorded_owners"]
