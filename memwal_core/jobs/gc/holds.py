"""What GC keeps and why, as types: `KeepReason` (the key of every `kept` counter), `Bound` (one
limit on a region's collectable generations), `Hold` (one region's generations kept above one
bound) and `GcHold` (a hold summed over all regions: what `memwal status`, the `garbage` asset
and `--dry-run` show).

A region's generations are collectable up to the minimum of its bounds (merge progress, every
gating index's catch-up, every retained base-table version's merge progress, 0 while its routing
value is unrecorded, below the first generation of a merge commit not verified yet); a generation above one is held by the first bound it exceeds, so each
generation is counted once, under one reason."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from memwal_core.units import size


class KeepReason(enum.StrEnum):
    """Why GC keeps an object: `kind:why`, the readable key of the `kept` counters in JSON and
    metadata (a `StrEnum`, so it is its own string there). `kind` is the item kind it counts
    (`region` counts a whole region)."""

    # Generations, held above a bound (each one is also a `Hold`, named without the kind).
    GENERATION_NOT_MERGED = "generation:not_merged"  # pending; includes a region stuck behind a wall
    GENERATION_INDEX_BEHIND = "generation:index_behind"  # a gating index has not caught up
    GENERATION_TIME_TRAVEL = "generation:time_travel"  # a retained base-table version still reads them
    GENERATION_VALUE_UNRECORDED = "generation:value_unrecorded"  # routing value not recorded for good yet
    GENERATION_STALE = "generation:stale"  # data from before the MemWAL initialization, not discarded
    GENERATION_NOT_FLUSHED = "generation:not_flushed"  # listed at or above current_generation
    GENERATION_UNVERIFIED = "generation:unverified"  # in a merge commit not verified yet
    # Generations kept without a hold.
    GENERATION_SEALED = "generation:sealed"  # no manifest version may be written on a sealed region
    REGION_STALE = "region:stale"
    # WAL entries.
    WAL_TAIL = "wal:tail"
    WAL_UNCOVERED = "wal:uncovered"  # above replay_after
    WAL_CURRENT_EPOCH = "wal:current_epoch"
    WAL_UNREADABLE = "wal:unreadable"
    WAL_FENCE_SENTINEL = "wal:fence_sentinel"
    WAL_NO_GENERATION = "wal:no_generation"  # no generation in its metadata, above the covered position
    WAL_GENERATION_KEPT = "wal:generation_kept"  # its generation is kept
    # Region manifest versions.
    MANIFEST_LATEST = "manifest:latest"
    MANIFEST_RETENTION_COUNT = "manifest:retention_count"
    MANIFEST_YOUNG = "manifest:young"
    # Unlisted generation directories.
    ORPHAN_FLUSH_IN_PROGRESS = "orphan:flush_in_progress"
    ORPHAN_EMPTY = "orphan:empty"
    ORPHAN_YOUNG = "orphan:young"
    # Base-table files no retained version references.
    LEAKED_INDEX_REFERENCED = "leaked:index_referenced"
    LEAKED_UNKNOWN_NAME = "leaked:unknown_name"
    LEAKED_YOUNG = "leaked:young"

    @property
    def kind(self) -> str:
        return self.value.split(":", 1)[0]

    @property
    def short(self) -> str:
        """The reason without its kind: `time_travel` (what a hold is called)."""
        return self.value.split(":", 1)[1]


@dataclass(frozen=True)
class Bound:
    """One limit on a region's collectable generations: those above `generation` are kept for
    `reason`. `index`: the gating index behind (INDEX_BEHIND); `table_version`: the oldest
    retained base-table version with the lowest merge progress (TIME_TRAVEL)."""

    reason: KeepReason
    generation: int
    index: str | None = None
    table_version: int | None = None

    @property
    def name(self) -> str:
        """How a hold is named to a person: `time_travel`, `index_behind:<index>`, ..."""
        return self.reason.short + (f":{self.index}" if self.index is not None else "")


@dataclass
class Hold:
    """The generations of one region GC keeps above one bound: how many, their bytes (the
    manifests' `in_memory_bytes`, no listing) and the highest of them. `until` (time travel
    only): when the newest retained version still reading `highest` becomes old enough for the
    configured base-version cleanup; None when no cleanup is configured."""

    region_id: str
    bound: Bound
    generations: int = 0
    bytes: int = 0
    highest: int = 0
    until: float | None = None

    @property
    def reason(self) -> KeepReason:
        return self.bound.reason

    @property
    def name(self) -> str:
        return self.bound.name

    def add(self, generation: int, nbytes: int) -> None:
        self.generations += 1
        self.bytes += nbytes
        self.highest = max(self.highest, generation)


@dataclass(frozen=True)
class GcHold:
    """Generations GC keeps for one reason, over all regions. `reason` is the hold's name
    (`Bound.name`): `time_travel` (`until` = the latest end of the regions' holds),
    `index_behind:<index>`, `not_merged`, `value_unrecorded` (a sharded region's routing value
    is neither in a MemWAL index snapshot stored inline nor in the durable record of the lifetime:
    its merged generations are the merger's authority for it until the index builder, which runs
    before GC in the maintenance job, records it; `region_values.unrecorded_regions`), `stale`
    (a region with data from before the MemWAL initialization, not yet discarded), `not_flushed`,
    `unverified` (in a merge commit a crash left unverified: the next merge run derives the
    commit's keys from them to check it)."""

    reason: str
    generations: int
    bytes: int
    regions: int
    until: float | None = None

    @property
    def keep_reason(self) -> KeepReason:
        return KeepReason(f"generation:{self.reason.split(':', 1)[0]}")

    def describe(self) -> str:
        when = ""
        if self.keep_reason is KeepReason.GENERATION_TIME_TRAVEL:
            when = (f" until {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.until))}" if self.until
                    else " until old base-table versions are cleaned up (no cleanup configured)")
        return f"{self.generations} generations ({size(self.bytes)}) in {self.regions} regions: {self.reason}{when}"


def summarize_holds(holds: Iterable[Hold]) -> list[GcHold]:
    """Per hold name: generations, bytes, regions and (time travel) the latest end of the hold."""
    by_name: dict[str, list[Hold]] = {}
    for h in holds:
        by_name.setdefault(h.name, []).append(h)
    out = []
    for name in sorted(by_name):
        group = by_name[name]
        ends = [h.until for h in group if h.until is not None]
        out.append(GcHold(name, sum(h.generations for h in group), sum(h.bytes for h in group),
                          len({h.region_id for h in group}), max(ends) if ends else None))
    return out


def readable(kept: Mapping[KeepReason, int]) -> dict[str, int]:
    """A `kept` counter with plain string keys, sorted (for JSON and metadata)."""
    return {str(k): n for k, n in sorted(kept.items())}
