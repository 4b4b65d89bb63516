"""What an index build did: `SnapshotResult`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memwal_core.failures import RegionFailure


@dataclass
class SnapshotResult:
    num_regions: int
    storage: str  # 'inline' | 'external' | 'none' (dry run)
    hints_updated: dict[str, tuple[int, int]]  # region -> (old hint, new hint)
    # region -> error: its previous row is kept when there is one; a region whose value record
    # disagrees with the value read has its row, without a value
    region_errors: dict[str, str]
    table_version: int  # the version committed (dry run: the version read)
    duration_s: float
    index_uuid: str | None = None
    external_key: str | None = None  # store key of the external snapshot file
    hint_errors: dict[str, str] = field(default_factory=dict)  # best-effort hint commits that failed
    region_field_sources: dict[str, str] = field(default_factory=dict)  # region -> `ValueSource` label
    region_field_problems: dict[str, str] = field(default_factory=dict)
    skipped_dirs: list[tuple[str, str]] = field(default_factory=list)
    attempts: int = 1  # commit attempts (1 = no lost race)
    snapshot_ts_millis: int = 0
    dry_run: bool = False
    regions_kept: dict[str, int] = field(default_factory=dict)  # failed region -> manifest version of its kept row
    committed: bool = False  # False: dry run, or the snapshot was unchanged (nothing committed)
    # The failures behind `region_errors` (the same regions), with their permanence.
    region_failures: dict[str, RegionFailure] = field(default_factory=dict)

    @property
    def inline(self) -> bool:
        return self.storage == "inline"

    @property
    def external(self) -> bool:
        return self.storage == "external"

    @property
    def failures(self) -> list[RegionFailure]:
        """Regions this build could not snapshot (each keeps its previous row when it had one)."""
        return [self.region_failures[rid] for rid in sorted(self.region_failures)]

    def metrics(self) -> dict[str, int | float]:
        return {"num_regions": self.num_regions, "hints_updated": len(self.hints_updated),
                "hint_errors": len(self.hint_errors), "regions_failed": len(self.region_errors),
                "regions_kept": len(self.regions_kept), "attempts": self.attempts,
                "committed": int(self.committed), "table_version": self.table_version,
                "duration_s": round(self.duration_s, 3)}

    def summary(self) -> str:
        if self.dry_run:
            what = f"would snapshot {self.num_regions} regions (dry run, table version {self.table_version})"
        elif self.committed:
            what = (f"snapshot of {self.num_regions} regions committed ({self.storage}) as table version "
                    f"{self.table_version}")
        else:
            what = f"snapshot of {self.num_regions} regions unchanged (table version {self.table_version})"
        notes = [f"{n} {label}" for n, label in ((len(self.hints_updated), "WAL hints raised"),
                                                 (len(self.region_errors), "regions failed"),
                                                 (len(self.regions_kept), "previous rows kept")) if n]
        return what + (f"; {', '.join(notes)}" if notes else "")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["region_failures"] = [f.to_dict() for f in self.failures]
        d["summary"] = self.summary()
        return d
