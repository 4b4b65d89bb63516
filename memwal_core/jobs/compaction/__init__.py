"""Base-table compaction and index-segment merging (the table's long-run health).

Every merge commit adds a fragment and deletion files to older fragments; every incremental
index catch-up may add a delta index segment. Scans, point lookups and the merger's own
`merge_insert` get slower as they pile up. This service reads the table's **health**
(`health.py`: fragments, small fragments, deleted rows, index segments), decides from the
thresholds of `CompactionOptions` whether anything is worth doing, and does it:

- **Plan** (`plan.py`) on the driver with `lance.optimize.Compaction.plan`, bounded per run
  (`bounded_plan` excludes fragments past `max_bytes_per_run`: one run never holds the
  table's pool for long; a table kept fully compacted is rewritten whole).
- **Rewrite** (`rewrite.py`) the `CompactionTask`s in Spark tasks (the merger's distribution
  story: only DataFrame APIs, so Spark Connect and clusters work the same).
- **Commit** (`execute.py`) on the driver with `Compaction.commit` (a Lance *Rewrite*),
  re-planning after a lost commit race, then restore the catch-up the Rewrite withdrew.
- **Result** (`result.py`): what was done, its numbers, one line for a person.

A table of at most `cheap_rewrite_bytes` is kept **fully compacted**: any second fragment or
deletion file is rewritten away on the next run (every deletion file materialized), because on
a small table each costs its scans 30-40 % (docs/benchmarks.md §7), more than the rewrite.

Index segments: an index with more segments than `max_index_segments` is merged with
`optimize_indices(num_indices_to_merge=N)` (centroids and codebooks kept); a vector index
keeps its first, trained segment apart (it settles at 2 segments), so its drift stays
visible. A vector index whose data drifted from its training (rows outside its first
segment plus unindexed rows, as a share of all rows) past `retrain_drift_share` is retrained
only on request (`retrain_vector_indexes`), and never an index the MemTables maintain: the
spec requires a stable codebook once MemWAL is enabled (switching codebooks is a migration to
a new index).
"""

from memwal_core.options import CompactionOptions

from .execute import compact, execute_compaction, restore_catchup, withdrawn_catchup
from .health import IndexHealth, TableHealth, is_vector, read_health
from .plan import CompactionPlan, bounded_plan, plan_compaction
from .result import CompactionResult
from .rewrite import TaskConfig, discard_rewrites, execute_tasks, run_rewrites

__all__ = ["CompactionOptions", "CompactionPlan", "CompactionResult", "IndexHealth", "TableHealth", "TaskConfig",
           "bounded_plan", "compact", "discard_rewrites", "execute_compaction", "execute_tasks", "is_vector",
           "plan_compaction", "read_health", "restore_catchup", "run_rewrites", "withdrawn_catchup"]
