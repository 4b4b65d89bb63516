"""Base-table index catch-up and the recorded `index_catchup` (spec "Base Table Index Builder").

For every base-table index except `__lance_mem_wal`, `optimize_indices(index_names=[name])`
adds the merged data to the index incrementally: `retrain=False` keeps the IVF centroids and
PQ/SQ codebooks (the spec requires a stable codebook once MemWAL is enabled), and leaving
`num_indices_to_merge` unset appends a delta segment. pylance 14 then records
`index_catchup[name][region] = merged_generations[region]` in that same commit by itself; this
service never writes catch-up, it reads the recorded progress back and reports it per index and
region next to the merged generation, the gap and the unindexed rows before and after.

`indexes.py` reads an index's recorded catch-up per region; `plan.py` decides which indexes to
optimize and why; `execute.py` optimizes them (`CatchupOptions`: retrain, segments to merge)
and reads the catch-up back; `result.py` holds what was done, its numbers and one line.

Observed on pylance 14.0.2 (tests/test_catchup.py keeps these honest):
- `optimize_indices` on an index with nothing to add and catch-up already equal to merged
  commits nothing; with catch-up behind it commits (even with 0 unindexed rows, e.g. after a
  merge of an empty generation) and records catch-up.
- At commit time Lance (re)derives catch-up for *every* index that covers all fragments, not
  only the one optimized.
- `ds.index_statistics(name)["num_unindexed_rows"]` (same dict as `ds.stats.index_stats`).

Gating (`MemWalState.gating_indexes`): the indexes named in `maintained_indexes`, or all when
`maintain_all_indexes`, gate GC; a gating index missing from `index_catchup` (or a region
missing under it) is reported as not caught up. (The Rust docs say an index absent from the
list is "assumed caught up"; for GC memwal takes the safe reading.)
"""

from memwal_core.options import CatchupOptions

from .execute import execute_catchup, run_catchup
from .indexes import RegionCatchup, base_indexes, index_type, region_progress, unindexed_rows
from .plan import CatchupPlan, IndexPlan, plan_catchup
from .result import CatchupResult, CatchupRow, IndexOutcome

__all__ = ["CatchupOptions", "CatchupPlan", "CatchupResult", "CatchupRow", "IndexOutcome", "IndexPlan",
           "RegionCatchup", "base_indexes", "execute_catchup", "index_type", "plan_catchup", "region_progress",
           "run_catchup", "unindexed_rows"]
