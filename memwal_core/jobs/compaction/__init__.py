"""Base-table compaction and index-segment merging (moved into a package; see execute.py)."""

from memwal_core.options import CompactionOptions

from .execute import (
    CompactionPlan,
    CompactionResult,
    IndexHealth,
    TableHealth,
    TaskConfig,
    bounded_plan,
    compact,
    discard_rewrites,
    execute_compaction,
    execute_tasks,
    is_vector,
    plan_compaction,
    read_health,
    restore_catchup,
    run_rewrites,
    withdrawn_catchup,
)

__all__ = ["CompactionOptions", "CompactionPlan", "CompactionResult", "IndexHealth", "TableHealth", "TaskConfig", "bounded_plan",
           "compact", "discard_rewrites", "execute_compaction", "execute_tasks", "is_vector", "plan_compaction",
           "read_health", "restore_catchup", "run_rewrites", "withdrawn_catchup"]
