"""What will stop a merge, found before a run is spent on it.

The merger refuses a table without a usable primary key, a table with features memwal does not
know, a table with stable row ids, and a generation whose rows belong to a region value another
region already holds (two writers that do not share region ids: e.g. LanceDB's fixed
`bucket-N` shard ids beside pylance's random ones give two regions per bucket value, and both
LSM readers return duplicates). Each of these is a `MergeBlocker` here, read from committed
state with the merger's own rules (`table.primary_key`, `table.read_memwal_state`,
`region_values.derive_region_fields`), so `memwal status` and the `mergeable` Dagster check say
so while nothing has been attempted.

Other conditions (stale regions, ...) plug in through `EXTRA_SOURCES`: a callable
`(loc, ds, state, manifests) -> list[MergeBlocker]` appended there is consulted too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from memwal_core.state import lifecycle, region, table
from memwal_core.state.region_values import current_regions, derive_region_fields, read_recorded, region_specs
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.blockers")

NO_PRIMARY_KEY = "no_primary_key"
TABLE_REFUSED = "table_refused"  # unknown features, stable row ids, no MemWAL index, unreadable
SHARED_VALUE = "shared_value"


@dataclass(frozen=True)
class MergeBlocker:
    kind: str
    message: str
    regions: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message, "regions": list(self.regions)}


Source = Callable[..., list[MergeBlocker]]
EXTRA_SOURCES: list[Source] = []


def merge_blockers(loc: TableLocation) -> list[MergeBlocker]:
    """Every condition found that will stop the merger (table-wide ones first)."""
    try:
        ds = table.open_dataset(loc)
        state = table.read_memwal_state(loc, ds.version)  # refuses unknown feature flags
        table.refuse_stable_row_ids(ds)
    except table.TableError as e:
        return [MergeBlocker(TABLE_REFUSED, str(e))]
    out: list[MergeBlocker] = []
    try:
        pk = table.primary_key(ds)
    except table.NoPrimaryKey as e:
        out.append(MergeBlocker(NO_PRIMARY_KEY, str(e)))
        pk = []
    manifests = region.load_many(loc.store, region.list_regions(loc.store).region_ids).manifests
    out += shared_values(loc, ds, state, manifests, pk)
    for source in EXTRA_SOURCES:
        out += source(loc, ds, state, manifests)
    return out


def shared_values(loc: TableLocation, ds, state: table.MemWalState,
                  manifests: dict[str, region.RegionManifest], pk: list[str]) -> list[MergeBlocker]:
    """Region values held by more than one sharded region (recorded in the MemWAL snapshot or the
    durable record of the lifetime, or derived from the region's oldest generation with live
    rows: one small read per region neither records). Unsharded and manual regions route
    nothing, as in the merger."""
    specs = region_specs(state)
    sharded = {sid for sid, sp in specs.items() if sp.sharded}
    try:
        init = lifecycle.assess(loc, {}, current_version=state.table_version, record=False).init
        recorded = read_recorded(loc, state, init, current_regions(loc, manifests)).values
    except Exception as e:  # noqa: BLE001 - unreadable snapshot: derive every value
        log.warning("MemWAL index snapshot unreadable (%s): deriving region values from rows", e)
        recorded = {}
    merged = state.merged
    by_value: dict[tuple, list[str]] = {}
    for rid, m in sorted(manifests.items()):
        sid = m.message.region_spec_id
        if sid not in sharded:
            continue
        vals = recorded.get(rid)
        if not vals:
            fv = derive_region_fields(loc, specs[sid], ds.lance_schema, pk, m, merged=merged.get(rid, 0))
            vals = fv.values
        if vals:
            key = (sid, tuple(sorted((k, repr(v)) for k, v in vals.items())))
            by_value.setdefault(key, []).append(rid)
    out = []
    for (sid, items), rids in sorted(by_value.items()):
        if len(rids) > 1:
            value = ", ".join(f"{k}={v}" for k, v in items)
            out.append(MergeBlocker(
                SHARED_VALUE,
                f"regions {', '.join(rids)} all hold region value ({value}) of spec {sid}: two writers wrote "
                "one value under different region ids (e.g. LanceDB and pylance writers on one table); readers "
                "see duplicate keys and the merger refuses the later region's generations",
                tuple(rids)))
    return out
