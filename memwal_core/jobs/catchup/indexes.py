"""A base-table index's recorded catch-up, read back per region next to merged progress."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import lance

from memwal_core.state import table

log = logging.getLogger("memwal.catchup")


@dataclass(frozen=True)
class RegionCatchup:
    """One index's progress in one region."""

    index_name: str
    region_id: str
    merged_generation: int
    caught_up_generation: int | None  # None: not recorded for this index / region

    @property
    def gap(self) -> int:
        """Merged generations the index does not cover yet."""
        return max(0, self.merged_generation - (self.caught_up_generation or 0))

    @property
    def caught_up(self) -> bool:
        if self.caught_up_generation is None:
            return self.merged_generation == 0
        return self.caught_up_generation >= self.merged_generation


def region_progress(state: table.MemWalState, index_name: str) -> list[RegionCatchup]:
    """Per merged region: merged vs caught-up generation of `index_name` in `state`."""
    recorded = state.catchup.get(index_name, {})
    return [RegionCatchup(index_name, rid, merged, recorded.get(rid))
            for rid, merged in sorted(state.merged.items())]


def base_indexes(ds: lance.LanceDataset) -> dict[str, str]:
    """Base-table index name -> type URL, without `__lance_mem_wal`."""
    return {d.name: d.type_url for d in ds.describe_indices() if d.name != table.MEMWAL_INDEX_NAME}


def unindexed_rows(ds: lance.LanceDataset, name: str) -> int | None:
    try:
        return int(ds.index_statistics(name)["num_unindexed_rows"])
    except Exception as e:  # noqa: BLE001 - a statistics failure must not stop the rebuild
        log.warning("index %s: statistics unavailable (%s)", name, e)
        return None


def index_type(ds: lance.LanceDataset, name: str, type_url: str) -> str:
    try:
        return str(ds.index_statistics(name).get("index_type") or type_url)
    except Exception:  # noqa: BLE001
        return type_url
