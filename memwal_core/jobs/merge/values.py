"""Region values as the merger trusts them: what each region's rows must route to, and which
region owns each value. (Moved here unchanged from the merge module; `state/region_values.py`
is to own the trusted-value rule for every job.)"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from memwal_core.jobs import snapshot
from memwal_core.spark import tasks as sparkpath
from memwal_core.state import lifecycle, region
from memwal_core.state.store import TableLocation
from memwal_core.state.table import MemWalState

log = logging.getLogger("memwal.merge")


def _owners(recorded: dict[str, dict], specs: dict, values: dict[str, dict]) -> dict[str, str]:
    """Region value -> region, over every region the snapshot knows (pending or not): a new
    region may not adopt a value another region already holds (this run's own values are added
    by the caller)."""
    owners: dict[str, str] = {}
    for rid, vals in recorded.items():
        if rid in values:
            continue
        fields = _spec_field_ids(specs, vals)
        if fields:
            owners[sparkpath.value_key([vals.get(f) for f in fields])] = rid
    return owners


def _unrecorded_owners(loc: TableLocation, state: MemWalState, ds, pk: list[str], specs: dict,
                       recorded: dict[str, dict], routed: dict[str, region.RegionManifest],
                       stale: lifecycle.Lifecycle | None = None) -> dict[str, str]:
    """Region value -> region, for regions with merge progress that no snapshot records yet and
    that have nothing pending in this run (before the first snapshot, or merged since the last).

    Their values come from their merged generations (GC keeps those until a snapshot records
    the value: `gc.unrecorded_regions`). Without this, a new region could adopt the value of a
    region merged earlier, and two regions would write one value."""
    others = [rid for rid, g in state.merged.items() if g > 0 and rid not in recorded and rid not in routed
              and not (stale and stale.discarded_only(rid, g))]
    if not others:
        return {}
    reads = region.load_many(loc.store, others)
    derived = region_values(loc, state, ds, reads.manifests, pk, {}, recorded, stale)
    for rid in sorted(set(others) - set(derived)):
        why = reads.region_errors.get(rid) or "no value derived from its merged generations"
        log.warning("region %s: merged, not in a MemWAL snapshot (%s): a new region's value cannot be "
                    "checked against it", rid, why)
    return _owners(derived, specs, {})


def _spec_field_ids(specs: dict, vals: dict) -> list[str] | None:
    """The field ids of the one region spec whose fields are exactly `vals`' keys (values from
    a snapshot row carry no spec id here)."""
    for spec_pb in specs.values():
        ids = [f.field_id for f in spec_pb.fields]
        if ids and set(ids) == set(vals):
            return ids
    return None


def region_values(loc: TableLocation, state: MemWalState, ds, manifests: dict[str, region.RegionManifest],
                  pk: list[str], expected: dict[str, dict],
                  recorded: dict[str, dict] | None = None,
                  stale: lifecycle.Lifecycle | None = None) -> dict[str, dict]:
    """Region id -> {field id: value}: what each region's rows must route to.

    Authoritative only: `expected`, then the value recorded in the MemWAL snapshot (reused by
    every later snapshot, so it never changes), then the oldest *merged* generation still
    listed whose live rows all agree (a generation the merger already accepted; never one it is
    about to check, which after GC trimmed the merged ones would be the pending ones). A region
    with none of these is checked by its first routed generation being unanimous and its value
    not owned by another region (`_Run.establish`). Stale generations (`stale`: data from before
    the MemWAL initialization, discarded or not) are no authority: they are left out.
    """
    if stale is not None:
        manifests = {rid: lifecycle.without_stale(m, stale.verdict(rid)) for rid, m in manifests.items()}
    out = {rid: expected[rid] for rid in manifests if rid in expected}
    missing = [rid for rid in manifests if rid not in out]
    if missing:
        known = snapshot.recorded_values(loc, state) if recorded is None else recorded
        out.update({rid: known[rid] for rid in missing if rid in known})
    specs = {s.spec_id: snapshot.spec_from_pb(s) for s in state.details.region_specs}
    merged = state.merged
    todo = [rid for rid in manifests if rid not in out and merged.get(rid, 0) > 0
            and manifests[rid].message.region_spec_id in specs]

    def derive(rid: str):
        m = manifests[rid]
        try:
            return snapshot.derive_region_fields(loc, specs[m.message.region_spec_id], ds.lance_schema, pk, m,
                                                 upto=merged[rid])
        except Exception as e:  # noqa: BLE001 - no value: the task's unanimity rule applies
            log.info("region %s: no region value derived (%s)", rid, e)
            return None

    if todo:
        with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
            for rid, fv in zip(todo, pool.map(derive, todo)):
                if fv is not None and fv.values and fv.source.startswith(("derived", "manifest")):
                    out[rid] = fv.values
    return out
