"""Health checks over a table's committed state (used by the Dagster asset checks and tests).

- exclusivity: rows of each region's pending generations route to one region value, and no
  two regions hold the same value (the spec's mutually exclusive regions);
- missing generations: every generation a region manifest lists exists on disk (a reader
  fails on a listed generation whose directory is gone);
- stale regions: data from before the MemWAL initialization (after an overwrite), which is
  never merged until discarded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lance

from memwal_core.jobs import merge
from memwal_core.observe.status import _GEN_MANIFEST
from memwal_core.spark import tasks as spark
from memwal_core.state import layout, lifecycle, region, table
from memwal_core.state.memwal_index import SnapshotError
from memwal_core.state.region_values import current_regions, read_recorded, trusted_values
from memwal_core.state.store import TableLocation
from memwal_core.state.table import NoPrimaryKey, open_dataset, primary_key, read_memwal_state


@dataclass
class ExclusivityReport:
    regions_checked: int = 0
    rows_checked: int = 0
    region_values: dict[str, str] = field(default_factory=dict)  # region -> JSON of its value
    mixed: dict[str, int] = field(default_factory=dict)  # region -> rows outside its majority value
    shared: dict[str, list[str]] = field(default_factory=dict)  # value -> regions holding it
    region_errors: dict[str, str] = field(default_factory=dict)  # regions that could not be checked

    @property
    def ok(self) -> bool:
        return not (self.mixed or self.shared or self.region_errors)


def check_exclusivity(loc: TableLocation, *, max_generations_per_region: int = 8) -> ExclusivityReport:
    """Route the rows of each region's oldest pending generations (bounded per region).

    The same rules as the merger's (`spark.first_refused`): live rows only (a tombstone carries
    just its key, NULL elsewhere), checked against the region's trusted value
    (`region_values.trusted_values`: the MemWAL index or the durable record of the lifetime, else
    its oldest merged generation, else its first routed generation), never a majority.
    """
    ds = open_dataset(loc)
    state = read_memwal_state(loc, ds.version)
    specs = {s.spec_id: s for s in state.details.region_specs}
    merged = state.merged
    report = ExclusivityReport()
    loaded = region.load_many(loc.store, region.list_regions(loc.store).region_ids)
    routes: dict[str, spark.RoutingCheck | None] = {}
    manifests = loaded.manifests
    report.region_errors.update(loaded.region_errors)
    for rid, m in sorted(manifests.items()):
        try:
            routes[rid] = merge.routing_check(m, specs, ds.lance_schema)
        except Exception as e:  # noqa: BLE001 - reported per region
            report.region_errors[rid] = f"region {rid}: {type(e).__name__}: {e}"
    routes = {rid: conf for rid, conf in routes.items() if conf}  # manual or unsharded: nothing to route
    try:
        pk = primary_key(ds)
    except NoPrimaryKey:
        pk = []
    try:
        init = lifecycle.assess(loc, {}, current_version=ds.version, record=False).init
        recorded = read_recorded(loc, state, init, current_regions(loc, manifests))
        values = trusted_values(loc, state, ds, {rid: manifests[rid] for rid in routes}, pk, {}, recorded.values)
    except (SnapshotError, lifecycle.LifecycleUnreadable) as e:  # recorded values exist but cannot be read
        report.region_errors.update({rid: f"region {rid}: {e}" for rid in routes})
        return report
    for rid, why in sorted(recorded.garbled.items()):  # the merger walls such a region: unknown value
        if rid in routes and rid not in values:
            report.region_errors[rid] = f"region {rid}: its value record is garbled ({why})"
    for rid, conf in sorted(routes.items()):
        if rid in report.region_errors:
            continue
        m = manifests[rid]
        own = spark.value_key([values[rid].get(f) for f in conf.field_ids]) if rid in values else None
        pending = [g for g in m.generations if g.generation > merged.get(rid, 0)][:max_generations_per_region]
        wanted = {c for _, c in conf.source_columns} | set(pk) | {spark.TOMBSTONE}
        stats: list[spark.GenerationStats] = []
        try:
            for g in pending:
                uri = loc.child_uri(layout.generation_dir(rid, g.path, g.generation))
                gen_ds = lance.dataset(uri, storage_options=loc.storage_options or None)
                rows = gen_ds.to_table(columns=[c for c in gen_ds.schema.names if c in wanted])
                report.rows_checked += rows.num_rows
                stats.append(spark.GenerationStats(0, g.generation, rows.num_rows, rows.nbytes,
                                                   spark.route_counts(rows, conf, tuple(pk))))
        except Exception as e:  # noqa: BLE001 - reported per region
            report.region_errors[rid] = f"region {rid}: {type(e).__name__}: {e}"
            continue
        report.regions_checked += 1
        refusal = spark.first_refused(stats, own)
        if own is None:
            first = spark.first_routed_value(stats)
            own = first[1] if first else None
        if own is not None:
            report.region_values[rid] = own
        if refusal is not None:
            report.mixed[rid] = max(1, refusal.offending_rows)
    by_value: dict[str, list[str]] = {}
    for rid, v in report.region_values.items():
        by_value.setdefault(v, []).append(rid)
    report.shared = {v: rids for v, rids in by_value.items() if len(rids) > 1}
    return report


def missing_generations(loc: TableLocation, region_errors: dict[str, str] | None = None) -> dict[str, list[int]]:
    """Region -> listed generations whose directory (its Lance manifest) is not on disk.

    Regions whose manifest does not load cannot be checked: they are added to `region_errors`
    (region -> error) when a dict is given, so a caller can report them as failing.
    """
    out: dict[str, list[int]] = {}
    loaded = region.load_many(loc.store, region.list_regions(loc.store).region_ids)
    if region_errors is not None:
        region_errors.update(loaded.region_errors)
    for rid, m in loaded.manifests.items():
        for g in m.generations:
            try:
                key = f"{layout.generation_dir(rid, g.path, g.generation)}/{_GEN_MANIFEST}"
            except layout.UnsafePath:
                out.setdefault(rid, []).append(g.generation)
                continue
            if not loc.store.exists(key):
                out.setdefault(rid, []).append(g.generation)
    return out


@dataclass
class StaleReport:
    """Regions with data from before the MemWAL initialization (`state/lifecycle.py`)."""

    initialization: str
    regions: dict[str, str] = field(default_factory=dict)       # region -> the refusal, with the repair
    generations: dict[str, list[int]] = field(default_factory=dict)  # region -> stale generations listed
    discard_at: dict[str, float] = field(default_factory=dict)  # region -> when GC discards it (grace)
    region_errors: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.regions and not self.region_errors


def stale_regions(loc: TableLocation, grace_seconds: float | None = None) -> StaleReport:
    """What the merger refuses as stale and GC keeps (read only: nothing is recorded)."""
    a = lifecycle.assess_table(loc, record=False)
    lc, reads = a.lifecycle, a.reads
    merged = table.read_memwal_state(loc).merged  # after the verdicts: a discard in between is seen whole
    init = lc.init.describe() if lc.init and lc.init.known else "unknown (not in the retained table history)"
    out = StaleReport(init, region_errors=dict(lc.errors))
    for rid, m in sorted(reads.manifests.items()):
        done = merged.get(rid, 0)
        if lc.verdict(rid) is None or not lc.blocks(rid, done):
            continue
        listed = [g.generation for g in m.generations]
        out.regions[rid] = lc.message(rid, done, listed)
        out.generations[rid] = lc.stale_pending(rid, done, listed)
        if grace_seconds is not None and not lc.verdict(rid).open:
            out.discard_at[rid] = lc.verdict(rid).detected_at + grace_seconds
    return out
