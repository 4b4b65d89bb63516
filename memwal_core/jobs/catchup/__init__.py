"""Base-table index catch-up (moved into a package; see execute.py)."""

from .execute import (
    CatchupPlan,
    CatchupResult,
    CatchupRow,
    IndexOutcome,
    IndexPlan,
    RegionCatchup,
    base_indexes,
    execute_catchup,
    plan_catchup,
    region_progress,
    run_catchup,
    unindexed_rows,
)

__all__ = ["CatchupPlan", "CatchupResult", "CatchupRow", "IndexOutcome", "IndexPlan", "RegionCatchup",
           "base_indexes", "execute_catchup", "plan_catchup", "region_progress", "run_catchup", "unindexed_rows"]
