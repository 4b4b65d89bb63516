"""Which value each region's rows must route to during one merge run, and who owns each value.

Built once per run from authoritative state (`state/region_values.py`: expected values, the
MemWAL snapshot and the durable value records, merged generations), then grown only by
`establish`: a region with no authoritative value adopts its first routed generation's
(unanimous) value, unless another region owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memwal_core.failures import RegionFailure
from memwal_core.spark import tasks as sparkpath
from memwal_core.state import lifecycle, region, routing
from memwal_core.state.memwal_index import SnapshotError
from memwal_core.state.region_values import recorded_values, trusted_values, unrecorded_owners, value_owners
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
    that cannot be merged without what could not be read (the MemWAL snapshot or the durable
    records of region values: every routed region without an expected value stops for this run)."""
    specs = {s.spec_id: s for s in state.details.region_specs}
    out = RegionOwnership(routes={rid: routing_check(m, specs, ds.lance_schema) for rid, m in manifests.items()})
    failures: list[RegionFailure] = []
    routed = {r: m for r, m in manifests.items() if out.routes.get(r)}
    try:
        # Read once: values and other regions' owners (the snapshot, and the durable records of the
        # lifetime the plan read, for what the snapshot does not record).
        recorded = recorded_values(loc, state, stale.init if stale else None)
        values = trusted_values(loc, state, ds, routed, pk, expected_values, recorded, stale)
        out.owners = value_owners(recorded, specs, values)
        if any(rid not in values for rid in routed):  # a region will establish its value: against every owner
            out.owners.update(unrecorded_owners(loc, state, ds, pk, specs, recorded, routed, stale))
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
