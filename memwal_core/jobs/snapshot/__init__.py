"""The MemWAL index builder: region snapshots and WAL-position hints (spec "MemWAL Index Builder").

`plan_snapshot` reads (regions, stale generations, WAL tails, region values) and writes nothing;
`execute_snapshot` raises the WAL hints and commits the snapshot; `build_snapshot` does both
under one hold of the table's lease. The snapshot's on-disk format is `state/memwal_index.py`;
where region values come from and which are trusted, `state/region_values.py`.
"""

from memwal_core.jobs.snapshot.execute import (
    DEFAULT_INLINE_THRESHOLD, VALUES_RECORDED, build_snapshot, execute_snapshot, snapshot_unchanged,
)
from memwal_core.jobs.snapshot.hints import hint_mutation, probe_hint, raise_hint, refresh_hint
from memwal_core.jobs.snapshot.plan import RegionRow, SnapshotPlan, plan_snapshot
from memwal_core.jobs.snapshot.result import SnapshotResult
# The index format and the region values, for callers written against the builder's module
# (new code imports them from `memwal_core.state`).
from memwal_core.state.memwal_index import (
    REGION_FIELD_PREFIX, SOURCE_COLUMN, SnapshotError, SnapshotNotFound, external_key, read_snapshot,
    snapshot_schema,
)
from memwal_core.state.region_values import (
    MAX_DERIVE_GENERATIONS, FieldValues, derive_region_fields, recorded_values, snapshot_field_values,
)

_hint_mutation = hint_mutation  # the name tests of region manifests import

__all__ = [
    "DEFAULT_INLINE_THRESHOLD", "VALUES_RECORDED", "RegionRow", "SnapshotPlan", "SnapshotResult", "build_snapshot",
    "execute_snapshot", "plan_snapshot", "snapshot_unchanged", "hint_mutation", "probe_hint", "raise_hint",
    "refresh_hint",
    # re-exported from state
    "REGION_FIELD_PREFIX", "SOURCE_COLUMN", "SnapshotError", "SnapshotNotFound", "external_key", "read_snapshot",
    "snapshot_schema", "MAX_DERIVE_GENERATIONS", "FieldValues", "derive_region_fields", "recorded_values",
    "snapshot_field_values",
]
