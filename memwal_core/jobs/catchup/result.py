"""What a catch-up run did, in the shape every service's result has (`failures`, `metrics`,
`summary`, `to_dict`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memwal_core.failures import RegionFailure

from .indexes import RegionCatchup
from .plan import CatchupPlan


@dataclass(frozen=True)
class CatchupRow:
    """One row of the report: an index in a region."""

    index_name: str
    region_id: str
    gating: bool
    caught_up_generation: int | None
    merged_generation: int
    gap: int
    caught_up: bool
    unindexed_rows_before: int | None
    unindexed_rows_after: int | None


@dataclass
class IndexOutcome:
    name: str
    index_type: str
    gating: bool
    optimized: bool
    error: str | None
    unindexed_rows_before: int | None
    unindexed_rows_after: int | None
    regions: list[RegionCatchup]  # after

    @property
    def caught_up(self) -> bool:
        return self.error is None and all(r.caught_up for r in self.regions)


@dataclass
class CatchupResult:
    plan: CatchupPlan
    indexes: list[IndexOutcome]
    table_version: int  # latest version after the rebuilds
    duration_s: float
    missing_gating: list[str] = field(default_factory=list)

    @property
    def rows(self) -> list[CatchupRow]:
        out = []
        for o in self.indexes:
            for r in o.regions:
                out.append(CatchupRow(o.name, r.region_id, o.gating, r.caught_up_generation,
                                      r.merged_generation, r.gap, r.caught_up,
                                      o.unindexed_rows_before, o.unindexed_rows_after))
        return out

    @property
    def not_caught_up(self) -> list[tuple[str, str]]:
        """(index, region) pairs of gating indexes that still lag (GC must keep those gens)."""
        lag = [(r.index_name, r.region_id) for r in self.rows if r.gating and not r.caught_up]
        for name in self.missing_gating:
            lag.extend((name, rid) for rid in sorted(self.plan.merged))
        return lag

    @property
    def errors(self) -> dict[str, str]:
        return {o.name: o.error for o in self.indexes if o.error}

    @property
    def failures(self) -> list[RegionFailure]:
        """Always empty: catch-up works per index over the whole table and never stops a region
        (a lagging index only makes GC keep that region's generations, `not_caught_up`). What
        can go wrong is per index (`errors`)."""
        return []

    def metrics(self) -> dict[str, int | float]:
        """The numbers the UI plots: gaps (overall and per index), lag, unindexed rows."""
        rows = self.rows
        out: dict[str, int | float] = {
            "indexes": len(self.indexes),
            "optimized": sum(1 for o in self.indexes if o.optimized),
            "max_gap": max([r.gap for r in rows] or [0]),
            "not_caught_up": len(self.not_caught_up),
            "unindexed_rows_after": sum(o.unindexed_rows_after or 0 for o in self.indexes),
            "index_errors": len(self.errors),
            "duration_s": round(self.duration_s, 3),
            "table_version": self.table_version,
        }
        for o in self.indexes:
            out[f"gap/{o.name}"] = max([r.gap for r in o.regions] or [0])
        return out

    def summary(self) -> str:
        """One line: how many indexes were optimized, which still lag, which failed."""
        if not self.indexes and not self.missing_gating:
            return "no base-table indexes"
        optimized = sum(1 for o in self.indexes if o.optimized)
        parts = [f"{len(self.indexes)} index(es), {optimized} optimized"]
        lagging = sorted({name for name, _ in self.not_caught_up})
        parts.append("behind: " + ", ".join(lagging) if lagging else "every gating index caught up")
        if self.missing_gating:
            parts.append("maintained but missing: " + ", ".join(self.missing_gating))
        if self.errors:
            parts.append("failed: " + "; ".join(f"index {n}: {e}" for n, e in sorted(self.errors.items())))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(not_caught_up=[list(p) for p in self.not_caught_up], errors=self.errors, summary=self.summary())
        return d
