"""Run tags memwal sets or reads.

Dagster runs one run over a range of partitions (a single-run backfill) when the run carries
the two partition-range tags below; its docs and the sensor examples name these tags, but
`dagster` 1.13 exports no constant for them (only `dagster._core.storage.tags`, a private
module). `tests/test_pipeline.py` checks them through the public `RunRequest.partition_key_range`.
"""

from __future__ import annotations

PARTITION_RANGE_START = "dagster/asset_partition_range_start"
PARTITION_RANGE_END = "dagster/asset_partition_range_end"
# A single-region merge run's region value (`bucket=2`): region partitions are keyed by UUID.
REGION_VALUE_TAG = "memwal/region_value"


def partition_range(first: str, last: str) -> dict[str, str]:
    """Tags of a run over the partitions from `first` to `last` (in the definition's order)."""
    return {PARTITION_RANGE_START: first, PARTITION_RANGE_END: last}
