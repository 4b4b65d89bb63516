"""Health checks over a table's committed state (used by the Dagster asset checks and tests).

- exclusivity: rows of each region's pending generations route to one region value, and no
  two regions hold the same value (the spec's mutually exclusive regions);
- missing generations: every generation a region manifest lists exists on disk (a reader
  fails on a listed generation whose directory is gone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import lance

from . import layout, region, routing
from .status import _GEN_MANIFEST
from .store import TableLocation
from .table import open_dataset, read_memwal_state


@dataclass
class ExclusivityReport:
    regions_checked: int = 0
    rows_checked: int = 0
    region_values: dict[str, str] = field(default_factory=dict)  # region -> JSON of its value
    mixed: dict[str, int] = field(default_factory=dict)  # region -> rows outside its majority value
    shared: dict[str, list[str]] = field(default_factory=dict)  # value -> regions holding it
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.mixed or self.shared or self.errors)


def check_exclusivity(loc: TableLocation, *, max_generations_per_region: int = 8) -> ExclusivityReport:
    """Route the rows of each region's newest pending generations (bounded per region)."""
    ds = open_dataset(loc)
    state = read_memwal_state(loc, ds.version)
    specs = {s.spec_id: s for s in state.details.region_specs}
    merged = state.merged
    report = ExclusivityReport()
    loaded = region.load_many(loc.store, region.list_regions(loc.store).region_ids)
    for rid, m in sorted(loaded.items()):
        if isinstance(m, Exception):
            report.errors[rid] = str(m)
            continue
        spec_pb = specs.get(m.message.region_spec_id)
        if spec_pb is None:
            continue  # manual region: no spec to route by
        spec = routing.RegionSpec.from_proto(spec_pb)
        if any(f.transform == routing.UNSHARDED for f in spec.fields):
            continue
        pending = [g for g in m.generations if g.generation > merged.get(rid, 0)][-max_generations_per_region:]
        counts: dict[str, int] = {}
        try:
            sources = routing.source_columns_for(spec, ds.lance_schema)
            for g in pending:
                uri = loc.child_uri(layout.generation_dir(rid, g.path, g.generation))
                rows = lance.dataset(uri, storage_options=loc.storage_options or None).to_table(
                    columns=sorted(set(sources.values())))
                values = routing.region_values(spec, rows, sources)
                report.rows_checked += rows.num_rows
                for v in values.to_pylist():
                    key = json.dumps([v[c] for c in values.column_names], default=str)
                    counts[key] = counts.get(key, 0) + 1
        except Exception as e:  # noqa: BLE001 - reported per region
            report.errors[rid] = f"region {rid}: {type(e).__name__}: {e}"
            continue
        report.regions_checked += 1
        if counts:
            own = max(counts, key=counts.get)
            report.region_values[rid] = own
            stray = sum(c for v, c in counts.items() if v != own)
            if stray:
                report.mixed[rid] = stray
    by_value: dict[str, list[str]] = {}
    for rid, v in report.region_values.items():
        by_value.setdefault(v, []).append(rid)
    report.shared = {v: rids for v, rids in by_value.items() if len(rids) > 1}
    return report


def missing_generations(loc: TableLocation) -> dict[str, list[int]]:
    """Region -> listed generations whose directory (its Lance manifest) is not on disk."""
    out: dict[str, list[int]] = {}
    loaded = region.load_many(loc.store, region.list_regions(loc.store).region_ids)
    for rid, m in loaded.items():
        if isinstance(m, Exception):
            continue
        for g in m.generations:
            try:
                key = f"{layout.generation_dir(rid, g.path, g.generation)}/{_GEN_MANIFEST}"
            except layout.UnsafePath:
                out.setdefault(rid, []).append(g.generation)
                continue
            if not loc.store.exists(key):
                out.setdefault(rid, []).append(g.generation)
    return out
