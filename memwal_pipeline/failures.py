"""Merge failures per region, recorded on the failed run and read back by checks and `status`.

A merge run that leaves a region unmerged (the merger refused a generation: a *wall*, or a
transient error it gave up on) fails, and before failing it tags its own run with what
failed, per region (`memwal_core.failures.RegionFailure`, the one failure type):
`memwal/failed = true` (to filter on) and `memwal/merge_failures` (JSON, bounded; tags written
by earlier versions, with short keys, still read). Readers look at the most recent failed runs
only (`RECENT_RUNS`), one query, so the cost does not grow with the number of regions or runs.

A region is **stuck** when, since it last merged past the failing generation, its latest
failure was permanent (a wall) or it failed in `sensor.merge_attempts` runs: the threshold at
which the sensor stops requesting merges of it, so the check, the sensor and `memwal status`
call the same regions stuck.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from memwal_core.failures import RegionFailure
from memwal_core.options import SensorOptions

FAILED_TAG = "memwal/failed"
FAILURES_TAG = "memwal/merge_failures"
RECENT_RUNS = 50  # failed runs read by a check
MAX_TAGGED_REGIONS = 20
MAX_ERROR_CHARS = 300


REPAIR_PERMANENT = ("Repair: rewrite the generation's directory with rows that belong to this region (same "
                    "generation number), or discard a stale region (`memwal regions discard`); then materialize "
                    "the region's base_table partition (the sensor does not retry a permanent refusal)")
REPAIR_TRANSIENT = "The sensor requests the region again after a backoff, up to sensor.merge_attempts runs"


def explain(failure: RegionFailure, label: str | None = None) -> str:
    """A failure as a person reads it: region id and value, generation, permanence, reason, and
    the repair (unless the reason names its own)."""
    name = f"region {failure.region_id}" + (f" ({label})" if label else "")
    at = f" at generation {failure.generation}" if failure.generation is not None else ""
    reason = failure.reason.removeprefix(f"region {failure.region_id}: ").rstrip(". ")
    kind = "permanent" if failure.permanent else "transient"
    repair = "" if "Repair:" in reason else " " + (REPAIR_PERMANENT if failure.permanent else REPAIR_TRANSIENT)
    return f"{name}{at} ({kind}): {reason}.{repair}"


def tagged(failure: RegionFailure) -> dict[str, Any]:
    """A failure as the run tag records it (its reason cut to `MAX_ERROR_CHARS`: tags are bounded)."""
    return replace(failure, reason=failure.reason[:MAX_ERROR_CHARS]).to_dict()


def from_tag(d: dict[str, Any]) -> RegionFailure:
    """A failure read back from a run tag, as written now or by earlier versions (`r`, `g`, `p`,
    `e`; `p` None, "unclassified", reads as transient)."""
    if "r" in d:
        g = d.get("g")
        return RegionFailure(str(d["r"]), None if g is None else int(g), str(d.get("e", "")), bool(d.get("p")))
    return RegionFailure.from_dict(d)


def run_tags(failures: list[RegionFailure]) -> dict[str, str]:
    """Tags for the failed run (bounded: the first `MAX_TAGGED_REGIONS` regions)."""
    return {FAILED_TAG: "true",
            FAILURES_TAG: json.dumps([tagged(f) for f in failures[:MAX_TAGGED_REGIONS]], separators=(",", ":"))}


@dataclass
class RegionHistory:
    failures: list[RegionFailure] = field(default_factory=list)  # newest first
    run_ids: list[str] = field(default_factory=list)

    @property
    def latest(self) -> RegionFailure:
        return self.failures[0]


def recent_failures(instance, job_name: str | None = None, limit: int = RECENT_RUNS,
                    regions: Iterable[str] | None = None) -> dict[str, RegionHistory]:
    """Region -> its failures in the `limit` most recent failed merge runs (newest first)."""
    from dagster import DagsterRunStatus, RunsFilter

    wanted = set(regions) if regions is not None else None
    records = instance.get_run_records(
        RunsFilter(job_name=job_name, statuses=[DagsterRunStatus.FAILURE], tags={FAILED_TAG: "true"}),
        limit=limit)
    out: dict[str, RegionHistory] = {}
    for rec in records:  # newest first
        raw = rec.dagster_run.tags.get(FAILURES_TAG)
        try:
            items = [from_tag(d) for d in json.loads(raw)] if raw else []
        except (ValueError, KeyError, TypeError):
            continue
        for f in items:
            if wanted is not None and f.region_id not in wanted:
                continue
            h = out.setdefault(f.region_id, RegionHistory())
            h.failures.append(f)
            h.run_ids.append(rec.dagster_run.run_id)
    return out


@dataclass(frozen=True)
class StuckRegion:
    region_id: str
    generation: int | None
    reason: str
    failed_runs: int
    permanent: bool

    def describe(self, label: str | None = None) -> str:
        """One line; `label`: the region's value (`bucket=2`), shown next to its id."""
        name = f"region {self.region_id}" + (f" ({label})" if label else "")
        at = f" at generation {self.generation}" if self.generation is not None else ""
        why = "permanent merge refusal" if self.permanent else f"stuck after {self.failed_runs} failed merge runs"
        return f"{name}{at}: {why}: {_without_region(self.reason, self.region_id)}"


def _without_region(text: str, region_id: str) -> str:
    """The core's messages start with `region <id>: `; do not say it twice."""
    return text.removeprefix(f"region {region_id}: ")


def stuck_regions(history: dict[str, RegionHistory], merged: dict[str, int],
                  stuck_after: int | None = None) -> list[StuckRegion]:
    """Regions whose failures still hold: not merged past the failing generation since.
    `stuck_after`: the table's `sensor.merge_attempts` (default: its default).

    Failures of a region are counted newest first while their generation is still unmerged
    (`merged[region] < generation`); a failure without a generation always counts.
    """
    stuck_after = SensorOptions().merge_attempts if stuck_after is None else stuck_after
    out = []
    for rid, h in sorted(history.items()):
        current = [f for f in h.failures if f.generation is None or merged.get(rid, 0) < f.generation]
        if not current:
            continue
        latest = current[0]
        if latest.permanent or len(current) >= stuck_after:
            out.append(StuckRegion(rid, latest.generation, latest.reason, len(current), latest.permanent))
    return out
