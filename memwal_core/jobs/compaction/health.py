"""The base table's health: what compaction's triggers read.

Fragments, small fragments, deleted rows and bytes of the latest version, and per base-table
index its segments, unindexed rows and drift from its training (the rows outside its first,
trained segment). Read from the manifest and `index_statistics` only: no data file is opened.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

import lance

from memwal_core.jobs import catchup
from memwal_core.options import CompactionOptions
from memwal_core.state import table
from memwal_core.state.store import TableLocation
from memwal_core.units import size

log = logging.getLogger("memwal.compaction")

VECTOR_TYPES = ("IVF", "HNSW", "PQ", "SQ", "VECTOR")


@dataclass(frozen=True)
class IndexHealth:
    name: str
    index_type: str
    segments: int
    vector: bool
    gating: bool  # maintained by MemTables / gates GC
    indexed_rows: int
    unindexed_rows: int
    drift_share: float  # rows outside the first (trained) segment + unindexed, over all rows


@dataclass(frozen=True)
class TableHealth:
    table_version: int
    fragments: int
    small_fragments: int
    physical_rows: int
    deleted_rows: int
    fragments_with_deletions: int
    bytes: int
    stable_row_ids: bool
    indexes: tuple[IndexHealth, ...] = ()

    @property
    def live_rows(self) -> int:
        return self.physical_rows - self.deleted_rows

    @property
    def small_fragment_share(self) -> float:
        return self.small_fragments / self.fragments if self.fragments else 0.0

    @property
    def deleted_row_ratio(self) -> float:
        return self.deleted_rows / self.physical_rows if self.physical_rows else 0.0

    @property
    def deletion_file_ratio(self) -> float:
        return self.fragments_with_deletions / self.fragments if self.fragments else 0.0

    @property
    def index_segments(self) -> dict[str, int]:
        return {i.name: i.segments for i in self.indexes}

    @property
    def unindexed_rows(self) -> int:
        """Rows some index does not cover yet (the most of any index)."""
        return max((i.unindexed_rows for i in self.indexes), default=0)

    def cheap_reason(self, o: CompactionOptions) -> str | None:
        """Why a table small enough to keep fully compacted is not (None: it is, or too big)."""
        if not o.cheap_rewrite_bytes or self.bytes > o.cheap_rewrite_bytes:
            return None
        if self.fragments <= 1 and not self.fragments_with_deletions:
            return None
        return (f"{self.fragments} fragments, {self.fragments_with_deletions} with deletions, in a table of "
                f"{size(self.bytes)} <= cheap_rewrite_bytes {size(o.cheap_rewrite_bytes)}: kept fully compacted")

    def reasons(self, o: CompactionOptions) -> list[str]:
        """The data triggers that fire (empty: healthy)."""
        out = []
        if self.fragments > o.max_fragments and self.fragments >= 2:
            out.append(f"{self.fragments} fragments > {o.max_fragments}")
        if self.small_fragments > o.max_small_fragments:
            out.append(f"{self.small_fragments} small fragments > {o.max_small_fragments}")
        elif self.small_fragments >= max(2, o.min_small_fragments) and \
                self.small_fragment_share > o.max_small_fragment_share:
            out.append(f"small fragments {self.small_fragments}/{self.fragments} = "
                       f"{self.small_fragment_share:.2f} > {o.max_small_fragment_share}")
        if self.deleted_row_ratio > o.max_deleted_row_ratio and self.deleted_rows >= o.min_deleted_rows:
            out.append(f"deleted rows {self.deleted_rows}/{self.physical_rows} = "
                       f"{self.deleted_row_ratio:.2f} > {o.max_deleted_row_ratio}")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(small_fragment_share=round(self.small_fragment_share, 4),
                 deleted_row_ratio=round(self.deleted_row_ratio, 4),
                 deletion_file_ratio=round(self.deletion_file_ratio, 4))
        return d


def is_vector(index_type: str) -> bool:
    return any(t in index_type.upper() for t in VECTOR_TYPES)


def _statistics_without_centroids(ds: lance.LanceDataset, name: str) -> dict:
    """`index_statistics` without every centroid (memory; a warning). Lance reads the switch from
    the environment: set only for this call, so other readers of the statistics in the process
    (a user's, a test's) still get the centroids."""
    key = "LANCE_INCLUDE_VECTOR_CENTROIDS"
    before = os.environ.get(key)
    os.environ[key] = "false"
    try:
        return ds.index_statistics(name)
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _index_health(ds: lance.LanceDataset, gating: set[str]) -> list[IndexHealth]:
    out = []
    for name in sorted(catchup.base_indexes(ds)):
        try:
            s = _statistics_without_centroids(ds, name)
        except Exception as e:  # noqa: BLE001 - a statistics failure must not stop compaction
            log.warning("index %s: statistics unavailable (%s)", name, e)
            continue
        kind = str(s.get("index_type") or "")
        per_delta = [int(n) for n in (s.get("num_indexed_rows_per_delta") or [])]
        indexed = int(s.get("num_indexed_rows") or sum(per_delta))
        unindexed = int(s.get("num_unindexed_rows") or 0)
        total = indexed + unindexed
        drift = (sum(per_delta[1:]) + unindexed) / total if total else 0.0
        segments = int(s.get("num_segments") or s.get("num_indices") or len(per_delta) or 1)
        out.append(IndexHealth(name, kind, segments, is_vector(kind), name in gating, indexed, unindexed,
                               round(drift, 4)))
    return out


def read_health(loc: TableLocation, options: CompactionOptions | None = None,
                ds: lance.LanceDataset | None = None) -> TableHealth:
    """Fragments, small fragments, deletions, bytes and index segments of the latest version."""
    o = options or CompactionOptions()
    ds = ds or table.open_dataset(loc)
    fragments = small = physical = deleted = with_del = nbytes = 0
    for frag in ds.get_fragments():
        m = frag.metadata
        fragments += 1
        physical += m.physical_rows or 0
        if (m.physical_rows or 0) < o.small_fragment_rows:
            small += 1
        if m.deletion_file is not None:
            with_del += 1
            deleted += m.deletion_file.num_deleted_rows or 0
        nbytes += sum(f.file_size_bytes or 0 for f in m.files)
    try:
        gating = set(table.read_memwal_state(loc, ds.version).gating_indexes(list(catchup.base_indexes(ds))))
    except table.TableError:
        gating = set()
    return TableHealth(ds.version, fragments, small, physical, deleted, with_del, nbytes,
                       bool(ds.has_stable_row_ids), tuple(_index_health(ds, gating)))
