"""What the catch-up will do: every base index (or the named ones), behind or not, and why.
Planning reads and changes nothing."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from memwal_core.options import CatchupOptions
from memwal_core.state import table
from memwal_core.state.store import TableLocation

from .indexes import RegionCatchup, base_indexes, index_type, region_progress, unindexed_rows

log = logging.getLogger("memwal.catchup")


@dataclass
class IndexPlan:
    name: str
    index_type: str
    gating: bool  # its catch-up gates GC
    recorded: bool  # present in index_catchup
    unindexed_rows: int | None
    regions: list[RegionCatchup]
    optimize: bool
    reason: str

    @property
    def caught_up(self) -> bool:
        return all(r.caught_up for r in self.regions) and not self.unindexed_rows


@dataclass
class CatchupPlan:
    table_version: int
    merged: dict[str, int]
    gating_indexes: list[str]
    indexes: list[IndexPlan]
    missing_gating: list[str]  # gating names with no such index on the table
    options: CatchupOptions = field(default_factory=CatchupOptions)

    @property
    def to_optimize(self) -> list[str]:
        return [i.name for i in self.indexes if i.optimize]

    @property
    def summary(self) -> str:
        if not self.indexes:
            return "no base-table indexes"
        todo = [f"{i.name} ({i.reason})" for i in self.indexes if i.optimize]
        return ("optimize " + ", ".join(todo)) if todo else f"{len(self.indexes)} index(es) up to date"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["to_optimize"] = self.to_optimize
        d["summary"] = self.summary
        return d


def plan_catchup(loc: TableLocation, index_names: list[str] | None = None,
                 options: CatchupOptions | None = None) -> CatchupPlan:
    """What the rebuild will do: every base index (or `index_names`), behind or not, and why
    (`options`: how the executor rebuilds them, carried in the plan)."""
    ds = table.open_dataset(loc)
    state = table.read_memwal_state(loc, ds.version)
    existing = base_indexes(ds)
    gating = state.gating_indexes(list(existing))
    names = sorted(existing) if index_names is None else list(index_names)
    unknown = [n for n in names if n not in existing]
    if unknown:
        raise table.TableError(f"table {loc.lance_uri} has no index named {', '.join(unknown)} "
                               f"(indexes: {', '.join(sorted(existing)) or 'none'})")
    plans = []
    for name in names:
        regions = region_progress(state, name)
        unindexed = unindexed_rows(ds, name)
        behind = [r for r in regions if not r.caught_up]
        if unindexed:
            reason = f"{unindexed} unindexed rows"
        elif behind:
            reason = (f"catch-up behind merge progress in {len(behind)} region(s)"
                      if name in state.catchup else "no index_catchup recorded yet")
        else:
            reason = "up to date"
        plans.append(IndexPlan(name, index_type(ds, name, existing[name]), name in gating,
                               name in state.catchup, unindexed, regions,
                               optimize=bool(unindexed) or bool(behind) or unindexed is None,
                               reason=reason if unindexed is not None else "statistics unavailable"))
    missing = sorted(set(gating) - set(existing))
    for name in missing:
        log.warning("maintained index %s does not exist on table %s: counted as not caught up",
                    name, loc.lance_uri)
    return CatchupPlan(ds.version, state.merged, gating, plans, missing, options or CatchupOptions())
