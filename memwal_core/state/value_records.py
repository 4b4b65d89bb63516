"""The durable record of trusted region values, in storage memwal owns.

**Why.** The MemWAL index's snapshot records each sharded region's routing value, and GC trims
the merged generations a value rests on once it is recorded (`region_values.unrecorded_regions`).
A snapshot of more than `SnapshotOptions.inline_threshold` regions is a file,
`_indices/{uuid}/index.lance`, found through the uuid of the index that wrote it, and pylance gives
the index a new uuid, without the file, at the next commit that changes it (a merge, an index
catch-up, a new index). A value only in that file is then gone for the merger. These records live
under `_memwal/`, which no Lance commit touches, so a value recorded here stays readable whatever
the snapshot's storage.

**What.** One object per region and lifetime, `layout.value_record_key(init, region)`, written by
the index builder before the snapshot commit that publishes the value (a crash in between leaves a
record of a trusted value: every reader may use it), for the values that never change within a
lifetime (`region_values.ValueSource.durable`: read from a merged generation, or the region
manifest's entries). Written with put-if-absent and never replaced within its lifetime: a record
that disagrees with a value being recorded is a `ValueConflict` (the builder reports the region),
never overwritten.

**Lifetime.** A table overwritten and initialized again (`state/lifecycle.py`) may shard
differently, so a record of an earlier lifetime must never be used. The directory is named by the
initialization's table version and the record holds its `initialized_at` too; readers take only
records of the current `Initialization`, and none at all while it is unknown (`known` False: the
lifetime began before the retained history). A record of an earlier lifetime under the same
directory (a table re-created, its versions counted from 1 again) is replaced; one of a later
lifetime is left alone (the writer is the one behind).

**Format.** The sealed envelope (`state/sealed.py`) around JSON: region, initialization, region
spec id, source label, the values as an Arrow IPC stream of one row, each field typed as its
region spec field's values are (`region_values.field_types`: an identity field's source column
type, else the spec's result type; so every value comes back exactly as it went in), and as text
for people. A record that fails its checksum or does not parse is garbled: never trusted (its
region counts as unrecorded for GC, and the merger walls the region when nothing else gives its
value), and replaced by the next *durable* value the builder reads for the region (a merged
generation still listed, the region manifest's entries). After GC trimmed the merged generations
on the record's word there may be none: the value is lost, and only the operator deleting the
record by hand lets the region go on (its next generation then establishes the value).
"""

from __future__ import annotations

import base64
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable

import pyarrow as pa

from memwal_core.errors import MemwalError
from memwal_core.state import layout, sealed
from memwal_core.state.lifecycle import Initialization
from memwal_core.state.store import NotFound, TableLocation

log = logging.getLogger("memwal.value_records")

FORMAT = 1


class ValueConflict(MemwalError):
    """A region's record of this lifetime holds another value than the one being recorded."""


@dataclass(frozen=True)
class ValueRecord:
    """One region's trusted value in one lifetime (the initialization's version and time)."""

    region_id: str
    spec_id: int
    values: dict[str, Any]
    source: str  # the `_region_field_source` label the value was recorded with
    init_version: int
    initialized_at: float

    def of(self, init: Initialization) -> bool:
        """Whether the record belongs to the lifetime of `init`."""
        return init.known and self.init_version == init.table_version and self.initialized_at == init.initialized_at

    def same_value(self, spec_id: int, values: dict[str, Any]) -> bool:
        return self.spec_id == spec_id and value_text(self.values) == value_text(values)


def value_text(values: dict[str, Any]) -> str:
    """A region value as comparable text (`routing.value_key`'s rule: JSON, other types as str)."""
    return json.dumps(values, sort_keys=True, default=str)


def _values_ipc(values: dict[str, Any], types: dict[str, pa.DataType]) -> str:
    missing = sorted(set(values) - set(types))
    if missing:
        raise ValueError(f"no Arrow type for field(s) {', '.join(missing)}")
    tbl = pa.table({fid: pa.array([v], types[fid]) for fid, v in sorted(values.items())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, tbl.schema) as w:
        w.write_table(tbl)
    return base64.b64encode(sink.getvalue().to_pybytes()).decode()


def encode(rec: ValueRecord, types: dict[str, pa.DataType]) -> bytes:
    """The bytes of a record, each value stored as its field's Arrow type (`types`: field id ->
    type, `region_values.field_types`; a type guessed from the Python value would lose what it
    cannot show, e.g. the nanoseconds of a timestamp). Raises ValueError for a value that does not
    fit its type."""
    try:
        ipc = _values_ipc(rec.values, types)
    except (pa.ArrowException, TypeError, OverflowError, ValueError) as e:
        raise ValueError(f"region {rec.region_id}: value {value_text(rec.values)} cannot be recorded: {e}") from None
    return sealed.seal({"region_id": rec.region_id, "region_spec_id": rec.spec_id, "source": rec.source,
                        "initialization": {"table_version": rec.init_version, "initialized_at": rec.initialized_at},
                        "values": ipc, "value": value_text(rec.values)}, FORMAT)


def decode(raw: bytes, region_id: str) -> ValueRecord:
    """The record in `raw`, which must be `region_id`'s; ValueError (saying why) for anything else."""
    d = sealed.unseal(raw, FORMAT)
    try:
        init = d["initialization"]
        tbl = pa.ipc.open_stream(base64.b64decode(d["values"], validate=True)).read_all()
        rows = tbl.to_pylist()
        rec = ValueRecord(d["region_id"], int(d["region_spec_id"]), rows[0] if len(rows) == 1 else {},
                          str(d["source"]), int(init["table_version"]), float(init["initialized_at"]))
    except (KeyError, TypeError, ValueError, IndexError, pa.ArrowException) as e:
        raise ValueError(f"fields: {type(e).__name__}: {e}") from None
    if rec.region_id != region_id or len(rows) != 1:
        raise ValueError(f"records region {rec.region_id!r} with {len(rows)} rows, expected {region_id} and 1")
    return rec


@dataclass
class Records:
    """The records of one lifetime: usable ones, and the regions whose record is garbled (why)."""

    values: dict[str, ValueRecord] = field(default_factory=dict)
    garbled: dict[str, str] = field(default_factory=dict)


def read(loc: TableLocation, init: Initialization | None, region_ids: Iterable[str] | None = None,
         *, skip: Iterable[str] = (), max_workers: int = 16) -> Records:
    """The records of the lifetime of `init` (of `region_ids` only, when given; never of `skip`):
    one listing, then one read per record wanted. None at all when the initialization is unknown. A store that
    cannot be listed or read raises (`StoreError`): the caller decides whether "nothing recorded"
    is safe for it (GC's holds) or not (the merger's check)."""
    out = Records()
    if init is None or not init.known:
        return out
    listed = {rid for o in loc.store.list(layout.value_records_dir(init.table_version))
              if (rid := layout.value_record_region(o.key, init.table_version))}
    wanted = sorted((listed if region_ids is None else listed & set(region_ids)) - set(skip))

    def one(rid: str) -> tuple[str, ValueRecord | None, str | None]:
        try:
            rec = decode(loc.store.get(layout.value_record_key(init.table_version, rid)), rid)
        except NotFound:  # deleted since the listing: none
            return rid, None, None
        except ValueError as e:
            return rid, None, str(e)
        return rid, rec, None

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(wanted) or 1))) as pool:
        for rid, rec, why in pool.map(one, wanted):
            if why is not None:
                log.warning("region %s: its value record %s is garbled (%s); not trusted", rid,
                            layout.value_record_key(init.table_version, rid), why)
                out.garbled[rid] = why
            elif rec is not None and rec.of(init):
                out.values[rid] = rec
            elif rec is not None:
                log.info("region %s: value record of another lifetime (initialized at %s, not %s); not used",
                         rid, rec.initialized_at, init.initialized_at)
    return out


def any_recorded(loc: TableLocation) -> bool:
    """Whether the table holds a value record of any lifetime (one listing, stopped at the first
    object): a table with records whose lifetime became unknown may have had merged generations
    trimmed on their word. Raises `StoreError` when it cannot be listed."""
    return next(iter(loc.store.list(layout.VALUE_RECORDS_DIR)), None) is not None


def write(loc: TableLocation, init: Initialization, region_id: str, spec_id: int, values: dict[str, Any],
          source: str, types: dict[str, pa.DataType]) -> bool:
    """Record a region's trusted value for the lifetime of `init` (known), each field as its
    Arrow type in `types` (see `encode`). True when written,
    False when this lifetime's record already held it. Raises `ValueConflict` when this lifetime's
    record holds another value; replaces a garbled record and one of an earlier lifetime."""
    if not init.known:
        raise ValueError("no value record without a known MemWAL initialization")
    rec = ValueRecord(region_id, spec_id, dict(values), source, init.table_version, float(init.initialized_at))
    raw = encode(rec, types)
    key = layout.value_record_key(init.table_version, region_id)
    if loc.store.put_if_absent(key, raw):
        return True
    try:
        theirs = decode(loc.store.get(key), region_id)
    except NotFound:  # deleted meanwhile (by hand): created again
        return _put_if_absent(loc, key, raw, rec, init)
    except ValueError as e:
        log.warning("region %s: value record %s garbled (%s); replaced by %s (%s)", region_id, key, e,
                    value_text(values), source)
        loc.store.put(key, raw)
        return True
    if theirs.of(init):
        if theirs.same_value(spec_id, values):
            return False
        raise ValueConflict(f"region {region_id}: its value is recorded as {value_text(theirs.values)} "
                            f"(spec {theirs.spec_id}, {theirs.source}, {key}) in this MemWAL lifetime, but this "
                            f"index build reads {value_text(values)} (spec {spec_id}, {source}): a region's value "
                            "never changes; the record stands, the index gets no value for the region")
    if theirs.initialized_at > rec.initialized_at:
        log.warning("region %s: %s records a later MemWAL initialization (at %s) than this process's (at %s); "
                    "left alone", region_id, key, theirs.initialized_at, rec.initialized_at)
        return False
    log.info("region %s: replacing %s, a value record of an earlier lifetime", region_id, key)
    loc.store.put(key, raw)
    return True


def _put_if_absent(loc: TableLocation, key: str, raw: bytes, rec: ValueRecord, init: Initialization) -> bool:
    if loc.store.put_if_absent(key, raw):
        return True
    theirs = decode(loc.store.get(key), rec.region_id)
    if theirs.of(init) and theirs.same_value(rec.spec_id, rec.values):
        return False
    raise ValueConflict(f"region {rec.region_id}: {key} was written by another process meanwhile with "
                        f"{value_text(theirs.values)}; not overwritten")


__all__ = ["FORMAT", "ValueConflict", "ValueRecord", "Records", "value_text", "encode", "decode", "read",
           "any_recorded", "write"]
