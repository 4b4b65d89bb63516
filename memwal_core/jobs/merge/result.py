"""What a merge run did, per region and in total; and the errors that end a run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from memwal_core.errors import MemwalError
from memwal_core.failures import RegionFailure

# How the reason of a failed commit verification starts: later runs keep the region stopped.
COMMIT_CHECK_FAILED = "commit verification failed"


class MergeError(MemwalError):
    """A merge run cannot go on (a batch lost too many commit races, a key not expressible)."""


@dataclass
class RegionMergeResult:
    region_id: str
    generations_merged: list[int] = field(default_factory=list)
    merged_generation: int = 0
    rows_read: int = 0
    bytes_read: int = 0
    skipped_generations: list[int] = field(default_factory=list)  # already merged by another merger
    offending_keys: int = 0
    failure: RegionFailure | None = None  # why the region stopped (its wall), if it did

    @property
    def error(self) -> str | None:
        return self.failure.reason if self.failure else None

    @property
    def wall(self) -> int | None:
        """The first generation not merged in this run (see `walls.Walls`)."""
        return self.failure.generation if self.failure else None

    @property
    def permanent(self) -> bool:
        """The wall stays until the region is repaired (stuck)."""
        return bool(self.failure and self.failure.permanent)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "failure"}
        return {**d, "error": self.error, "wall": self.wall, "permanent": self.permanent,
                "failure": self.failure.to_dict() if self.failure else None}


@dataclass
class MergeResult:
    table_uri: str
    regions: dict[str, RegionMergeResult] = field(default_factory=dict)
    commits: int = 0
    conflicts: int = 0
    rows_upserted: int = 0
    rows_deleted: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    duration_s: float = 0.0
    table_version: int = 0

    @property
    def failures(self) -> list[RegionFailure]:
        """Regions not merged as far as planned, each with its wall."""
        return [r.failure for _, r in sorted(self.regions.items()) if r.failure is not None]

    @property
    def region_errors(self) -> dict[str, str]:
        """Regions not merged as far as planned: region id -> why."""
        return {f.region_id: f.reason for f in self.failures}

    @property
    def stuck_regions(self) -> dict[str, str]:
        """Regions behind a permanent wall: nothing merges there until they are repaired."""
        return {f.region_id: f.reason for f in self.failures if f.permanent}

    @property
    def generations_merged(self) -> int:
        return sum(len(r.generations_merged) for r in self.regions.values())

    def metrics(self) -> dict[str, int | float]:
        return {"generations_merged": self.generations_merged, "commits": self.commits,
                "conflicts": self.conflicts, "rows_upserted": self.rows_upserted, "rows_deleted": self.rows_deleted,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "regions_merged": sum(1 for r in self.regions.values() if r.generations_merged),
                "regions_failed": len(self.failures), "regions_stuck": len(self.stuck_regions),
                "duration_s": round(self.duration_s, 3), "table_version": self.table_version}

    def summary(self) -> str:
        m = self.metrics()
        text = (f"merged {m['generations_merged']} generations of {m['regions_merged']} regions in "
                f"{self.commits} commits (+{self.rows_upserted} -{self.rows_deleted} rows)")
        if self.failures:
            text += f"; {len(self.failures)} regions stopped ({len(self.stuck_regions)} stuck)"
        return text

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "regions"}
        d["regions"] = {rid: r.to_dict() for rid, r in self.regions.items()}
        d["generations_merged"] = self.generations_merged
        d["region_errors"] = self.region_errors
        d["stuck_regions"] = self.stuck_regions
        return d
