"""The merge service: flushed generations -> base table, in order, with atomic progress.

`plan_merge` (plan.py) decides which generations merge in which batches; `execute_merge`
(execute.py) merges them, batch by batch (attempt.py), one verified commit each (commit.py,
verify.py), behind each region's wall (walls.py); `merge` does both. Results: result.py.
"""

from memwal_core.jobs.merge import verify
from memwal_core.jobs.merge.attempt import Committed, Retry, RetryReason
from memwal_core.jobs.merge.execute import execute_merge, merge, merge_tasks
from memwal_core.jobs.merge.owners import RegionOwnership, routing_check
from memwal_core.jobs.merge.plan import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_MAX_GENERATIONS,
    MergeBatch,
    MergePlan,
    PlannedGeneration,
    plan_merge,
)
from memwal_core.jobs.merge.result import (
    COMMIT_CHECK_FAILED,
    MergeError,
    MergeResult,
    RegionMergeResult,
)
from memwal_core.jobs.merge.walls import Walls
from memwal_core.state.keys import delete_predicate, quote_column, refuse_unsupported_keys

__all__ = [
    "COMMIT_CHECK_FAILED", "DEFAULT_BUDGET_BYTES", "DEFAULT_MAX_GENERATIONS", "Committed",
    "MergeBatch", "MergeError", "MergePlan", "MergeResult", "PlannedGeneration", "RegionMergeResult",
    "RegionOwnership", "Retry", "RetryReason", "Walls", "delete_predicate", "execute_merge", "merge", "merge_tasks",
    "plan_merge", "quote_column", "refuse_unsupported_keys", "routing_check", "verify",
]
