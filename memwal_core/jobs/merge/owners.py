"""Which value each region's rows must route to during one merge run, and who owns each value.

Built once per run from authoritative state (`state/region_values.py`: expected values, the
MemWAL snapshot and the durable value records, merged generations), then grown only by
`establish`: a region with no authoritative value adopts its first routed generation's
(unanimous) value, unless another region owns it. Never when that value may have been recorded
and lost: a region whose value record is garbled, or one with merge progress while the MemWAL
lifetime is unknown and value records exist (GC may have trimmed its merged generations on a
record's word), is walled instead, and no region establishes a value while a garbled region's
is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.spark import tasks as sparkpath
from memwal_core.state import layout, lifecycle, region, routing, value_records
from memwal_core.state.memwal_index import SnapshotError
from memwal_core.state.region_values import (
    current_regions, read_recorded, trusted_values, unrecorded_owners, value_owners,
)
from memwal_core.state.store import TableLocation
from memwal_core.state.table import MemWalState


def routing_check(m: region.RegionManifest, specs: dict, lance_schema) -> sparkpath.RoutingCheck | None:
    """How the tasks check a region's rows (None: a manual or unsharded region, nothing to route)."""
    spec_pb = specs.get(m.message.region_spec_id)
    if spec_pb is None:
        return None
    rs = routing.RegionSpec.from_proto(spec_pb)
    if any(f.transform == routing.UNSHARDED for f in rs.fields):
        return None
    return sparkpath.RoutingCheck(rs.to_lance(), tuple(sorted(routing.source_columns_for(rs, lance_schema).items())))


@dataclass
class RegionOwnership:
    """`routes`: how each planned region's rows route (None: nothing to route); `own`: region ->
    its value (`value_key`); `owners`: value -> the region that owns it (any region)."""

    routes: dict[str, sparkpath.RoutingCheck | None] = field(default_factory=dict)
    own: dict[str, str] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)

    def establish(self, rid: str, stats: list[sparkpath.GenerationStats]) -> RegionFailure | None:
        """Adopt a region's value from its first routed generation (unanimous) when nothing
        authoritative gave one, unless another region owns that value (then the failure that
        stops the region); kept for the rest of the run, so later batches and re-reads check
        against it."""
        if rid in self.own or not self.routes.get(rid):
            return None
        first = sparkpath.first_routed_value(stats)
        if first is None:
            return None
        generation, value = first
        owner = self.owners.get(value)
        if owner is not None and owner != rid:
            return RegionFailure(rid, generation, f"region {rid}: generation {generation}: its rows route to region "
                                 f"value {value}, which region {owner} owns; the spec requires mutually exclusive "
                                 "regions", permanent=True)
        self.own[rid] = value
        self.owners[value] = rid
        return None


def ownership_for_run(loc: TableLocation, state: MemWalState, ds, pk: list[str],
                      manifests: dict[str, region.RegionManifest], merged: dict[str, int],
                      expected_values: dict[str, dict], stale: lifecycle.Lifecycle | None
                      ) -> tuple[RegionOwnership, list[RegionFailure]]:
    """The run's ownership for the planned regions (`manifests`: as loaded now), and the regions
    that cannot be merged without what could not be read: every routed region without an
    expected value when the MemWAL snapshot or the value records cannot be read (this run); a
    routed region whose value record is garbled and that nothing else gives a value (a wall
    until the record is repaired, `garbled_wall`); a routed region with merge progress that
    nothing gives a value while the MemWAL lifetime is unknown and value records exist
    (`lifetime_wall`); and, while a garbled region's value is unknown, the routed regions that
    would establish their value (it cannot be checked against it)."""
    specs = {s.spec_id: s for s in state.details.region_specs}
    out = RegionOwnership(routes={rid: routing_check(m, specs, ds.lance_schema) for rid, m in manifests.items()})
    failures: list[RegionFailure] = []
    routed = {r: m for r, m in manifests.items() if out.routes.get(r)}
    try:
        # Read once: values and other regions' owners (the snapshot, and the durable records of the
        # lifetime the plan read, for what the snapshot does not record).
        recorded = read_recorded(loc, state, stale.init if stale else None, current_regions(loc, manifests))
        values = trusted_values(loc, state, ds, routed, pk, expected_values, recorded.values, stale)
        out.owners = value_owners(recorded.values, specs, values)
        unknown = {rid: why for rid, why in recorded.garbled.items() if rid not in values}
        if any(rid not in values for rid in routed):  # a region will establish its value: against every owner
            others = unrecorded_owners(loc, state, ds, pk, specs, recorded.values, routed, stale)
            out.owners.update(others)
            unknown = {rid: why for rid, why in unknown.items() if rid not in set(others.values())}
        lost = _lifetime_lost(loc, stale, [rid for rid in routed if rid not in values])
        for rid in sorted(routed):
            if rid in values:
                continue
            at = merged.get(rid, 0) + 1
            if rid in unknown:
                failures.append(garbled_wall(rid, at, unknown[rid]))
            elif lost and state.merged.get(rid, 0) > 0:
                failures.append(lifetime_wall(rid, at))
            elif unknown:
                failures.append(RegionFailure(
                    rid, at, f"region {rid}: its value would be established from its rows from generation {at} "
                    f"on, but the value of region(s) {', '.join(sorted(unknown))} is unknown (garbled value "
                    "record), so no check can tell that they do not own it; waits until their record is "
                    "repaired", permanent=False))
    except SnapshotError as e:  # recorded values exist but cannot be read: nothing to check by
        failures = [RegionFailure(rid, merged.get(rid, 0) + 1, f"region {rid}: the recorded region values "
                                  f"are unreadable ({e}); not merging routed regions without them",
                                  permanent=False)
                    for rid in routed if not expected_values.get(rid)]
        values = dict(expected_values)
    for rid, check in out.routes.items():
        if check and rid in values:
            out.own[rid] = sparkpath.value_key([values[rid].get(f) for f in check.field_ids])
    out.owners.update({v: rid for rid, v in out.own.items()})
    return out, failures


def garbled_wall(rid: str, generation: int, why: str) -> RegionFailure:
    """The wall of a routed region whose value record is garbled and that nothing else gives a
    value (no inline snapshot records it, no merged generation is left: GC trimmed them on the
    record's word). Its next rows must not vouch for themselves; it stands until the record is
    repaired (a wall is looked at again every run)."""
    key = why.split(":", 1)[0]
    return RegionFailure(rid, generation, f"region {rid}: its value record is garbled ({why}) and nothing else "
                         "gives its value, so its rows cannot be checked; not merged. Repair: the index builder "
                         "rewrites the record when it reads the value from a durable source (a merged generation "
                         "still listed, the region manifest's entries); if none is left, the value is lost: "
                         f"delete {key} by hand, and the merger establishes the value from the region's next "
                         "generation (unanimous, not owned by another region)", permanent=True)


def _lifetime_lost(loc: TableLocation, stale: lifecycle.Lifecycle | None, establishing: list[str]) -> bool:
    """Whether regions about to establish their value may have had their merged generations
    trimmed on the word of a value record that cannot be matched now: the MemWAL lifetime is
    unknown (`_memwal/lifecycle.json` lost or garbled, the versions around the initialization
    cleaned up) and the table holds value records of some lifetime. A table without records
    (one from before them, or with inline snapshots only) is never affected."""
    init = stale.init if stale is not None else None
    if not establishing or (init is not None and init.known):
        return False
    try:
        return value_records.any_recorded(loc)
    except Exception as e:  # noqa: BLE001 - cannot tell: as unreadable recorded values
        raise SnapshotError(f"the region value records ({layout.VALUE_RECORDS_DIR}) cannot be listed: "
                            f"{one_line(e)}") from None


def lifetime_wall(rid: str, generation: int) -> RegionFailure:
    """The wall of a routed region with merge progress and no trusted value while the lifetime
    is unknown and value records exist (`_lifetime_lost`): GC may have trimmed its merged
    generations on a record's word, so its next rows must not vouch for themselves."""
    return RegionFailure(
        rid, generation, f"region {rid}: the MemWAL lifetime is unknown ({layout.LIFECYCLE_KEY} is missing or "
        "garbled and the table versions that would show the initialization were cleaned up), so the value records "
        f"under {layout.VALUE_RECORDS_DIR}/ cannot be matched to it, and nothing else gives the region's value "
        f"(no snapshot records it, its merged generations are collected): its value is not established from "
        f"generation {generation}'s rows; not merged. Repair: restore {layout.LIFECYCLE_KEY} from a copy; or, "
        "knowing the region's value, merge with it given (execute_merge(expected_values=...)); or, if the records "
        f"belong to an earlier lifetime only, delete {layout.VALUE_RECORDS_DIR}/ by hand", permanent=True)
