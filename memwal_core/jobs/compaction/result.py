"""What a compaction run did, in the shape every service's result has (`failures`, `metrics`,
`summary`, `to_dict`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memwal_core.failures import RegionFailure

from .health import TableHealth


@dataclass
class CompactionResult:
    table_uri: str
    status: str  # "healthy, skipped" | "compacted" | "gave up: ..." | "nothing to rewrite" | "indexes merged" | ...
    health_before: TableHealth
    health_after: TableHealth | None = None
    tasks: int = 0
    attempts: int = 0
    conflicts: int = 0
    fragments_removed: int = 0
    fragments_added: int = 0
    indexed_first: list[str] = field(default_factory=list)  # caught up before the rewrite
    segments_merged: dict[str, int] = field(default_factory=dict)
    retrained: list[str] = field(default_factory=list)
    catchup_restored: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # index -> why its optimize failed
    duration_s: float = 0.0
    table_version: int = 0

    @property
    def committed(self) -> bool:
        return self.fragments_removed > 0 or bool(self.segments_merged) or bool(self.retrained)

    @property
    def gave_up(self) -> bool:
        """Every attempt lost its commit race (nothing of the rewrite is visible)."""
        return self.status.startswith("gave up")

    @property
    def failures(self) -> list[RegionFailure]:
        """Always empty: compaction rewrites the whole base table and never stops a region. What
        can go wrong is table-wide (`gave_up`) or per index (`errors`)."""
        return []

    def metrics(self) -> dict[str, int | float]:
        """The numbers the UI plots: health after (and before), the rewrite, segments per index."""
        before, after = self.health_before, self.health_after or self.health_before
        out: dict[str, int | float] = {
            "fragments": after.fragments,
            "small_fragments": after.small_fragments,
            "deleted_row_ratio": round(after.deleted_row_ratio, 4),
            "deletion_file_ratio": round(after.deletion_file_ratio, 4),
            "index_segments": sum(after.index_segments.values()),
            "fragments_before": before.fragments,
            "bytes_before": before.bytes,
            "bytes_after": after.bytes,
            "tasks": self.tasks,
            "conflicts": self.conflicts,
            "fragments_removed": self.fragments_removed,
            "fragments_added": self.fragments_added,
            "index_errors": len(self.errors),
            "duration_s": round(self.duration_s, 3),
            "table_version": self.table_version,
        }
        for name, n in sorted(after.index_segments.items()):
            out[f"segments/{name}"] = n
        return out

    def summary(self) -> str:
        """One line: what happened, and what did not."""
        parts = [self.status]
        if self.fragments_removed:
            parts.append(f"{self.fragments_removed} fragments -> {self.fragments_added} in {self.tasks} tasks")
        if self.conflicts:
            parts.append(f"{self.conflicts} commit conflict(s) over {self.attempts} attempt(s)")
        if self.segments_merged:
            parts.append("index segments merged: " + ", ".join(f"{n} ({s})" for n, s in self.segments_merged.items()))
        if self.retrained:
            parts.append("retrained: " + ", ".join(self.retrained))
        if self.errors:
            parts.append("failed: " + "; ".join(f"index {n}: {e}" for n, e in sorted(self.errors.items())))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["committed"] = self.committed
        d["summary"] = self.summary()
        return d
