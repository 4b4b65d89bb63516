"""The one boundary between the spec's words and pylance 14's MemWAL names.

| spec (memwal)        | pylance 14                      |
|----------------------|---------------------------------|
| region               | shard                           |
| flushed generation   | SSTable                         |
| merged_generations   | compacted_sstables              |
| region spec          | sharding spec                   |

Everything else in memwal speaks the spec's words and calls these helpers.
"""

from __future__ import annotations

from typing import Iterable

import lance
import pyarrow as pa
from lance.mem_wal import CompactedSsTable, LsmScanner, ShardSnapshot

STALE_MERGE_MARKER = "Stale SSTable compaction"  # Lance's refusal when progress is already ahead


def merged_markers(progress: dict[str, int]) -> list[CompactedSsTable]:
    """Markers recording `merged_generations[region] = generation`, atomically with a merge."""
    return [CompactedSsTable(region_id, gen) for region_id, gen in sorted(progress.items())]


def is_stale_merge(error: BaseException) -> bool:
    """Lance refused a marker at or below recorded progress: another merger already won."""
    return STALE_MERGE_MARKER in str(error)


def is_commit_conflict(error: BaseException) -> bool:
    """A commit lost to another commit (a stale merge marker, Lance's commit conflict or
    preemption): the caller re-reads and retries (merge, compaction) or reports the lost race
    (the MemWAL index replace); anything else is a real failure. The one place memwal reads
    Lance's conflict errors, so a change in their wording is fixed once."""
    if not isinstance(error, OSError):
        return False
    msg = str(error).lower()
    return is_stale_merge(error) or "conflict" in msg or "preempted" in msg


def region_snapshot(region_id: str, current_generation: int,
                    generations: Iterable[tuple[int, str]], spec_id: int = 0) -> ShardSnapshot:
    """pylance's snapshot of one region for LSM reads (only pass generations to be read)."""
    snap = ShardSnapshot(region_id).with_current_generation(current_generation)
    if spec_id:
        snap = snap.with_spec_id(spec_id)
    for gen, path in generations:
        snap = snap.with_sstable(gen, path)
    return snap


def lsm_read(ds: lance.LanceDataset, snapshots: list[ShardSnapshot]) -> pa.Table:
    """Newest row per primary key across the base table and the given generations."""
    return LsmScanner.from_snapshots(ds, snapshots).to_table()


def sharding_specs(ds: lance.LanceDataset) -> list[dict]:
    """Region specs as pylance reports them (its dict form)."""
    details = ds.mem_wal_index_details() or {}
    return list(details.get("sharding_specs", []))
