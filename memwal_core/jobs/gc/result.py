"""What a GC pass did: `GcResult` (deleted, kept and why, region failures, costs)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from memwal_core.failures import RegionFailure
from memwal_core.jobs.gc.holds import GcHold, KeepReason, readable
from memwal_core.jobs.gc.items import GENERATION, KINDS, LEAKS_KEY, MANIFEST, ORPHAN, WAL, GcItem
from memwal_core.jobs.gc.plan import GcPlan
from memwal_core.units import size


@dataclass
class GcResult:
    table_uri: str
    deleted: list[GcItem] = field(default_factory=list)
    deleted_objects: int = 0
    bytes_reclaimed: int = 0
    kept: dict[KeepReason, int] = field(default_factory=dict)
    manifest_commits: int = 0
    skipped: list[GcItem] = field(default_factory=list)  # planned, not deleted on re-check
    # Regions GC could not plan or execute (nothing more is deleted there this pass), and a
    # failed leak scan under the region id `LEAKS_KEY`.
    failures: list[RegionFailure] = field(default_factory=list)
    base_cleanup: dict[str, Any] | None = None
    plan_seconds: float = 0.0
    execute_seconds: float = 0.0
    holds: list[GcHold] = field(default_factory=list)  # what the plan kept and why (see GcHold)
    # Base-table versions the plan read (each one a reader may time-travel to): every GC pass
    # reads them all, so this is what its cost grows with (`gc.cleanup_base_versions_*` bounds it).
    retained_versions: int = 0
    dry_run: bool = False
    plan: GcPlan | None = None  # what was planned (a dry run's answer: its items would be deleted)
    # Leaked base-table files deleted (objects, bytes; also in `deleted` as kind "leaked") and
    # what finding them cost (`gc/leaks.py`: manifests read, files listed, seconds).
    leaked_objects: int = 0
    leaked_bytes: int = 0
    leak_scan: dict[str, Any] = field(default_factory=dict)
    # Stale regions discarded after `discard_stale_after_seconds`: region -> generations through.
    stale_discarded: dict[str, int] = field(default_factory=dict)

    @property
    def region_errors(self) -> dict[str, str]:
        """Region id (or `LEAKS_KEY`) -> what went wrong, as the failures say it."""
        return {f.region_id: f.reason for f in self.failures}

    def counts(self) -> dict[str, int]:
        c = collections.Counter(i.kind for i in self.deleted)
        return {k: c.get(k, 0) for k in KINDS}

    def metrics(self) -> dict[str, int | float]:
        """The numbers the `garbage` asset shows (and plots: bytes held per hold)."""
        counts = self.counts()
        out: dict[str, int | float] = {
            "objects_deleted": self.deleted_objects, "bytes_reclaimed": self.bytes_reclaimed,
            "generations_deleted": counts[GENERATION], "wal_entries_deleted": counts[WAL],
            "manifests_deleted": counts[MANIFEST], "orphans_deleted": counts[ORPHAN],
            "leaked_objects_deleted": self.leaked_objects, "leaked_bytes_reclaimed": self.leaked_bytes,
            "manifest_commits": self.manifest_commits, "regions_failed": len(self.failures),
            "retained_base_versions": self.retained_versions,
            "base_versions_cleaned": int((self.base_cleanup or {}).get("old_versions", 0)),
            "kept": sum(self.kept.values()),
            "duration_s": round(self.plan_seconds + self.execute_seconds, 2),
        }
        if self.dry_run and self.plan is not None:
            out |= {"objects_planned": self.plan.objects, "bytes_planned": self.plan.bytes}
        for h in self.holds:
            out[f"held_bytes/{h.reason}"] = h.bytes
        return out

    def summary(self) -> str:
        """One line for a person."""
        c = self.counts()
        if self.dry_run and self.plan is not None:
            head = f"gc dry run: would delete {self.plan.objects} objects ({size(self.plan.bytes)})"
        else:
            head = (f"gc: deleted {self.deleted_objects} objects ({size(self.bytes_reclaimed)}: {c[GENERATION]} "
                    f"generations, {c[WAL]} WAL entries, {c[MANIFEST]} manifest versions, {c[ORPHAN]} orphans, "
                    f"{self.leaked_objects} leaked files), {self.manifest_commits} manifest commits")
        held = sum(h.generations for h in self.holds)
        tail = f"; keeps {held} generations ({', '.join(h.reason for h in self.holds)})" if held else ""
        regions = [f for f in self.failures if f.region_id != LEAKS_KEY]
        if regions:
            tail += f"; {len(regions)} regions failed"
        if len(regions) != len(self.failures):
            tail += "; leaked files not collected"
        return head + tail

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": self.table_uri, "deleted": self.counts(), "deleted_objects": self.deleted_objects,
            "bytes_reclaimed": self.bytes_reclaimed, "kept": readable(self.kept),
            "manifest_commits": self.manifest_commits, "region_errors": self.region_errors,
            "failures": [f.to_dict() for f in self.failures],
            "skipped": [i.to_dict() for i in self.skipped], "base_cleanup": self.base_cleanup,
            "plan_seconds": round(self.plan_seconds, 3), "execute_seconds": round(self.execute_seconds, 3),
            "retained_versions": self.retained_versions,
            "leaked_objects": self.leaked_objects, "leaked_bytes": self.leaked_bytes,
            "leak_scan": dict(self.leak_scan),
            "stale_discarded": dict(self.stale_discarded),
            "items": [i.to_dict() for i in self.deleted],
            **({"dry_run": True, "planned": [i.to_dict() for i in self.plan.items]}
               if self.dry_run and self.plan is not None else {}),
        }

