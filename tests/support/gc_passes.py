"""Helpers for GC passes over a history without Spark (tests/test_gc_summaries.py and
bench/gc_history.py): a commit that records generations as merged, and forgetting what this
process learned, as every GC run in a new process would."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
from lance.mem_wal import CompactedSsTable

from memwal_core.jobs.gc import leaks
from memwal_core.state import lifecycle, region, table


def mark_merged(loc, regions: Iterable[str]) -> None:
    """One commit recording every flushed generation of `regions` as merged (the merger's
    bookkeeping, without rows)."""
    ds = table.open_dataset(loc)
    merged = table.read_memwal_state(loc, ds.version).merged
    marks = [CompactedSsTable(rid, g) for rid in sorted(regions)
             if (g := region.load_latest(loc.store, rid).current_generation - 1) > merged.get(rid, 0)]
    if marks:
        empty = pa.table({f.name: pa.array([], f.type) for f in ds.schema}, schema=ds.schema)
        ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all() \
            .mark_sstables_as_compacted(marks).execute(empty)


def forget_process() -> None:
    """A new process: nothing learned in memory."""
    leaks._REFS.clear()
    lifecycle._SEEN.clear()
