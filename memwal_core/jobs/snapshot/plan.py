"""What the next index build would write, read without writing anything: `plan_snapshot`.

The plan reads the MemWAL index of the latest table version, lists the regions and loads their
latest manifests in parallel, judges which generations predate the MemWAL initialization
(`state/lifecycle.py`: never published, never used for a value), probes each region's WAL tail
beyond its hint, and takes each region's field values (`state/region_values.py`: reused from the
lifetime's durable record, `state/value_records.py`, or from the previous snapshot when pinned,
else read from the manifest or derived from rows). A region that cannot be read is a
`RegionFailure`; the previous snapshot's row for it is in `previous`, so the build keeps it
rather than hiding the region's unmerged generations from readers.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import lance
import pyarrow as pa

from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.jobs.snapshot.hints import probe_hint
from memwal_core.options import SnapshotOptions
from memwal_core.state import lifecycle, memwal_index, region, routing, table, value_records
from memwal_core.state.region_values import (
    NO_FIELDS, UNKNOWN, FieldValues, ValueSource, derive_region_fields, field_types, pinned_values, region_specs,
)
from memwal_core.state.store import TableLocation

STEP = "snapshot"
log = logging.getLogger("memwal.snapshot")


@dataclass
class RegionRow:
    """One region's row as this build makes it: its manifest (stale generations left out) and
    its field values."""

    manifest: region.RegionManifest
    fields: FieldValues

    def index_row(self) -> memwal_index.IndexRow:
        return memwal_index.IndexRow(self.manifest, self.fields.values, self.fields.source.label)


@dataclass
class SnapshotPlan:
    table_uri: str
    table_version: int  # the version read
    snapshot_ts_millis: int
    options: SnapshotOptions
    derive_fields: bool
    rows: dict[str, RegionRow]  # region -> its row from this read
    previous: dict[str, RegionRow]  # the stored snapshot's rows: a failed region keeps its own
    failures: dict[str, RegionFailure]  # regions this read could not snapshot
    hints: dict[str, int]  # region -> WAL position observed beyond its hint (execution raises it)
    hint_errors: dict[str, str]  # failed WAL probes (best effort)
    skipped_dirs: list[tuple[str, str]]
    # What the execution builds on: the state read, each region's manifest as loaded (a hint is
    # committed on top of it, stale generations included) and the stale-generation verdicts.
    state: table.MemWalState = field(repr=False)
    manifests: dict[str, region.RegionManifest] = field(repr=False)
    lifecycle: lifecycle.Lifecycle = field(repr=False)
    # The values this build reuses (region -> (spec id), values), the durable records of the
    # lifetime it read, and the regions whose record and previous snapshot disagree (why).
    reuse: dict[str, tuple[int, FieldValues]] = field(default_factory=dict, repr=False)
    recorded: dict[str, value_records.ValueRecord] = field(default_factory=dict, repr=False)
    value_conflicts: dict[str, str] = field(default_factory=dict)
    # Spec id -> field id -> the Arrow type its values are recorded as (`field_types`).
    field_types: dict[int, dict[str, pa.DataType]] = field(default_factory=dict, repr=False)

    def kept(self, failures: dict[str, RegionFailure]) -> dict[str, RegionRow]:
        """The previous rows of the failed regions (a region no longer listed has none)."""
        return {rid: row for rid, row in self.previous.items() if rid in failures}

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table_uri, "table_version": self.table_version, "regions": len(self.rows),
                "region_field_sources": {rid: str(r.fields.source) for rid, r in sorted(self.rows.items())},
                "hints": dict(sorted(self.hints.items())), "hint_errors": dict(self.hint_errors),
                "failures": [self.failures[rid].to_dict() for rid in sorted(self.failures)],
                "regions_kept": {rid: r.manifest.version for rid, r in sorted(self.kept(self.failures).items())},
                "skipped_dirs": [list(s) for s in self.skipped_dirs],
                "value_conflicts": dict(sorted(self.value_conflicts.items())),
                "inline_threshold": self.options.inline_threshold}


def previous_snapshot(loc: TableLocation, state: table.MemWalState) -> pa.Table | None:
    """The stored snapshot of `state`, or None when there is none or it cannot be read."""
    try:
        prev = memwal_index.read_snapshot(loc, state)
    except memwal_index.SnapshotError:
        return None
    return prev if "region_id" in prev.column_names else None


def previous_rows(prev: pa.Table | None) -> dict[str, RegionRow]:
    """The previous snapshot's rows as `RegionRow`s, to keep a region this build cannot load.

    A reader of the index builds its view from these rows; dropping a region because its
    manifest failed to load once would hide its unmerged generations from every such reader.
    A row without a source label is carried as `unknown` (memwal cannot vouch for it)."""
    if prev is None:
        return {}
    return {rid: RegionRow(r.manifest, FieldValues(dict(r.values), ValueSource.parse(r.source) if r.source
                                                   else UNKNOWN))
            for rid, r in memwal_index.index_rows(prev).items()}


def reused_values(pinned: dict[str, tuple[int, FieldValues]], recorded: dict[str, value_records.ValueRecord]
                  ) -> tuple[dict[str, tuple[int, FieldValues]], dict[str, str]]:
    """The values a build reuses instead of deriving them: a region's durable record of this
    lifetime, else the previous snapshot's pinned value; and the regions whose two disagree
    (why). A region's value never changes, so one of them is wrong: the build publishes no value
    for such a region (`unknown`, the problem said) and reports it; the record, written first and
    perhaps relied on by GC already, stays the value readers of recorded values get."""
    reuse = dict(pinned)
    conflicts: dict[str, str] = {}
    for rid, rec in recorded.items():
        src = ValueSource.parse(rec.source)
        if not src.durable:
            continue
        spec_id, before = pinned.get(rid, (None, None))
        if before is not None and spec_id == rec.spec_id and not rec.same_value(spec_id, before.values):
            conflicts[rid] = (f"region {rid}: its value record holds {value_records.value_text(rec.values)} "
                              f"({rec.source}) but the previous MemWAL snapshot "
                              f"{value_records.value_text(before.values)} ({before.source}): a region's value never "
                              "changes; the record stands, the index gets no value for the region until an "
                              "operator repairs it")
            reuse[rid] = (rec.spec_id, FieldValues({}, UNKNOWN, conflicts[rid]))
            continue
        reuse[rid] = (rec.spec_id, FieldValues(dict(rec.values), src))
    return reuse, conflicts


def region_fields(loc: TableLocation, specs: dict[int, routing.RegionSpec], ds: lance.LanceDataset,
                  pk: list[str], m: region.RegionManifest, merged: int, *, derive: bool,
                  reuse: dict[str, tuple[int, FieldValues]] | None = None) -> FieldValues:
    """The field values of one region's row: none for a manual region, the pinned value of the
    previous snapshot for the same spec, else read from the manifest or derived from rows."""
    spec_id = m.message.region_spec_id
    if spec_id == 0:
        return FieldValues({}, NO_FIELDS)
    if spec_id not in specs:
        return FieldValues({}, UNKNOWN, f"region spec {spec_id} is not in the MemWAL index")
    if reuse and m.region_id in reuse and reuse[m.region_id][0] == spec_id:
        return reuse[m.region_id][1]
    if not derive:
        return FieldValues({}, UNKNOWN)
    try:
        return derive_region_fields(loc, specs[spec_id], ds.lance_schema, pk, m, merged=merged)
    except Exception as e:  # noqa: BLE001 - a value we cannot derive is not fatal
        return FieldValues({}, UNKNOWN, f"{type(e).__name__}: {e}")


@dataclass
class _Read:
    row: RegionRow | None = None
    failure: RegionFailure | None = None
    hint: int | None = None
    hint_error: str | None = None


def plan_snapshot(loc: TableLocation, options: SnapshotOptions | None = None, *, max_workers: int = 16,
                  update_hints: bool = True, derive_fields: bool = True) -> SnapshotPlan:
    """Read everything the next build writes (see the module docstring). Writes nothing.

    `update_hints`: probe the WAL tails (the execution raises the hints found behind them).
    `derive_fields`: derive region values from rows where neither the manifest nor the
    previous snapshot gives one."""
    options = options or SnapshotOptions()
    ds = table.open_dataset(loc)
    state = table.read_memwal_state(loc, ds.version)
    prev = previous_snapshot(loc, state)
    ts_millis = int(time.time() * 1000)
    listing = region.list_regions(loc.store)
    loaded = region.load_many(loc.store, listing.region_ids, max_workers=max_workers)
    # Generations from before the MemWAL initialization are never published as unmerged data
    # (nor used for a region value): readers of the snapshot would read rows the overwrite replaced.
    stale = lifecycle.assess(loc, loaded.manifests, current_version=state.table_version, record=False)
    recorded = _records(loc, stale.init, loaded.manifests, max_workers) if derive_fields else {}
    reuse, conflicts = reused_values(pinned_values(prev), recorded) if derive_fields else ({}, {})
    specs = region_specs(state)
    try:
        pk = table.primary_key(ds)
    except table.NoPrimaryKey:
        pk = []

    def one(rid: str) -> _Read:
        got = loaded[rid]
        if not got.ok:
            return _Read(failure=RegionFailure(rid, None, got.message, got.permanent, STEP))
        if rid in stale.errors:
            return _Read(failure=RegionFailure(rid, None, stale.errors[rid], False, STEP))
        out = _Read()
        if update_hints:
            out.hint, out.hint_error = probe_hint(loc, got.manifest)
        m = lifecycle.without_stale(got.manifest, stale.verdict(rid))
        out.row = RegionRow(m, region_fields(loc, specs, ds, pk, m, state.merged.get(rid, 0),
                                             derive=derive_fields, reuse=reuse))
        return out

    ids = listing.region_ids
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(ids) or 1))) as pool:
        reads = dict(zip(ids, pool.map(one, ids)))
    return SnapshotPlan(
        table_uri=loc.lance_uri, table_version=state.table_version, snapshot_ts_millis=ts_millis,
        options=options, derive_fields=derive_fields,
        rows={rid: r.row for rid, r in reads.items() if r.row is not None},
        previous=previous_rows(prev),
        failures={rid: r.failure for rid, r in reads.items() if r.failure is not None},
        hints={rid: r.hint for rid, r in reads.items() if r.hint is not None},
        hint_errors={rid: r.hint_error for rid, r in reads.items() if r.hint_error},
        skipped_dirs=list(listing.skipped), state=state, manifests=loaded.manifests, lifecycle=stale,
        reuse=reuse, recorded=recorded, value_conflicts={rid: c for rid, c in conflicts.items() if rid in reads},
        field_types={sid: field_types(spec, ds.lance_schema, ds.schema) for sid, spec in specs.items()})


def _records(loc: TableLocation, init: lifecycle.Initialization | None, manifests: dict[str, region.RegionManifest],
             max_workers: int) -> dict[str, value_records.ValueRecord]:
    """The durable records of the lifetime for `manifests`' regions; none when they cannot be
    read (logged): the build then derives values as without them, and writing a value checks it
    against the record on the store anyway (put-if-absent)."""
    try:
        return value_records.read(loc, init, manifests, max_workers=max_workers).values
    except Exception as e:  # noqa: BLE001 - not fatal: see above
        log.warning("region value records unreadable (%s); values derived without them", one_line(e))
        return {}
