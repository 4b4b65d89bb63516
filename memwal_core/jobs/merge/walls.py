"""The walls of one merge run: per region, the first generation not merged in this run, and why.

A wall is a `RegionFailure`. Merge progress never passes it: every later generation of the
region waits too, across all batches and retries of the run. A permanent wall (a refused
generation, a corrupt manifest, rows a commit got wrong) stays until the region is repaired
and is recorded for later runs and readers (`state/walls.py`); a transient one (a read that
failed after retries, a lost race) stops the region for this run only.

`Walls` is the one owner of that bookkeeping: `stop` (the lowest wall wins), `refuse` (what
the Spark tasks refused), `in_order` (no hole in a region's progress), `lift` (transient walls
another merger merged past), and the record written at the end of the run (`record`) or at
once (`stop_recorded`, for verdicts that must survive a crash).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.jobs.merge.result import COMMIT_CHECK_FAILED, MergeResult, RegionMergeResult
from memwal_core.spark import tasks as sparkpath
from memwal_core.state import walls as records
from memwal_core.state.store import TableLocation

if TYPE_CHECKING:
    from memwal_core.jobs.merge.plan import MergePlan, PlannedGeneration

log = logging.getLogger("memwal.merge")


@dataclass(frozen=True)
class Evidence:
    """Keys a region must not merge: another region's merged rows hold them."""

    shared_keys: pa.Table | None
    other_region: str | None


class Walls:
    """The run's walls (see the module docstring)."""

    def __init__(self) -> None:
        self._walls: dict[str, RegionFailure] = {}
        self._offending: dict[str, int] = {}   # region -> most offending rows any of its failures counted
        self._stopped: set[str] = set()        # every region ever stopped (reported, lifted or not)

    @classmethod
    def start(cls, plan: "MergePlan", recorded: records.RecordedWalls) -> "Walls":
        """The walls a run starts with: the plan's, a failed commit verification's (recorded by
        an earlier run: the region was merged over wrong rows), and a wall for every planned
        region whose record could not be read (it may hold such a verdict)."""
        book = cls()
        for failure in plan.walls.values():
            book.stop(failure, quiet=True)  # the planner logged them
        for rid in sorted(plan.pending):
            unknown = recorded.unknown(rid)
            if unknown is not None:
                book.stop(RegionFailure(rid, plan.merged.get(rid, 0) + 1, f"region {rid}: {unknown}; not merged "
                                        "until its wall record can be read (it may stop the region)", permanent=False))
            rec = recorded.records.get(rid)
            if rec is not None and rec.reason.startswith(COMMIT_CHECK_FAILED):
                book.stop(rec.failure)
        return book

    def stop(self, failure: RegionFailure, *, quiet: bool = False) -> None:
        """Record a wall; the lowest one wins (progress can never pass it)."""
        rid = failure.region_id
        self._stopped.add(rid)
        self._offending[rid] = max(self._offending.get(rid, 0), failure.offending_rows)
        old = self._walls.get(rid)
        if old is not None and old.lowest(failure) is old:
            return
        self._walls[rid] = failure
        if not quiet:
            log.error("%s; %s", failure.reason, "the region is stuck until it is repaired" if failure.permanent
                      else f"merging stops before generation {failure.generation} in this run")

    def stop_recorded(self, loc: TableLocation, failures: list[RegionFailure]) -> bool:
        """Stop and record each permanent failure now, not with the run's walls at its end: a
        merger killed later in the run would otherwise leave no trace. False: a record could
        not be written (the caller keeps what lets a later run find the verdict again)."""
        written = True
        for f in failures:
            self.stop(f)
            try:
                records.write(loc.store, records.WallRecord(f, time.time()))
            except Exception as e:  # noqa: BLE001 - written again with the run's walls at its end
                written = False
                log.error("region %s: could not record its wall now: %s", f.region_id, one_line(e))
        return written

    def refuse(self, stats: list[sparkpath.GenerationStats], own: dict[int, str], region_index: dict[int, str]
               ) -> dict[str, int]:
        """Stop each region at the first generation its Spark task refused (`first_refused`,
        the task's own rule, so driver and task agree). Returns region -> the generation its
        task stopped deduplicating at (one past its last generation when nothing was refused)."""
        by_region: dict[int, list[sparkpath.GenerationStats]] = {}
        for s in stats:
            by_region.setdefault(s.region, []).append(s)
        cut: dict[str, int] = {}
        for ridx, rows in sorted(by_region.items()):
            rid = region_index[ridx]
            refusal = sparkpath.first_refused(rows, own.get(ridx), rid)
            cut[rid] = refusal.generation if refusal else max(s.generation for s in rows) + 1
            if refusal is not None:
                self.stop(refusal)
        return cut

    def failure(self, rid: str) -> RegionFailure | None:
        return self._walls.get(rid)

    def below(self, rid: str, generation: int) -> bool:
        """True when the region's wall is below `generation`."""
        w = self._walls.get(rid)
        return w is not None and w.generation is not None and w.generation < generation

    def open(self, g: "PlannedGeneration") -> bool:
        """False for a generation at or past its region's wall."""
        w = self._walls.get(g.region_id)
        return w is None or (w.generation is not None and g.generation < w.generation)

    def in_order(self, gens: list["PlannedGeneration"], merged: dict[str, int]) -> list["PlannedGeneration"]:
        """Each region's open generations that continue its progress without a hole (the wall's
        last line of defence: progress is set to the highest generation committed, so a hole
        would be recorded as merged); a hole is a transient wall."""
        out = []
        for rid in sorted({g.region_id for g in gens}):
            want = merged.get(rid, 0) + 1
            for g in sorted((g for g in gens if g.region_id == rid and self.open(g)), key=lambda g: g.generation):
                if g.generation != want:
                    self.stop(RegionFailure(rid, want, f"region {rid}: generation {want} was not merged before "
                                            f"generation {g.generation} in this run", permanent=False))
                    break
                out.append(g)
                want += 1
        return out

    def lift(self, merged: dict[str, int]) -> None:
        """Forget transient walls another merger has merged past (they stop nothing any more and
        would report a merged region as failed); a permanent wall stays reported: it is a
        verdict on the generation's contents."""
        for rid, w in list(self._walls.items()):
            if not w.permanent and w.generation is not None and w.generation <= merged.get(rid, 0):
                log.info("region %s: generation %d was merged by another merger; its wall is lifted", rid, w.generation)
                del self._walls[rid]

    def report(self, result: MergeResult) -> None:
        """Each stopped region's wall (None when lifted) and offending rows, into the result."""
        for rid in sorted(self._stopped):
            r = result.regions.setdefault(rid, RegionMergeResult(rid))
            r.failure = self._walls.get(rid)
            r.offending_keys = max(r.offending_keys, self._offending.get(rid, 0))

    def record(self, loc: TableLocation, plan: "MergePlan", recorded: records.RecordedWalls, merged: dict[str, int],
               evidence: dict[str, Evidence]) -> None:
        """Record this run's permanent walls and delete the records of regions merged past theirs
        or looked at without being refused (records that could not be read are left alone).
        Failing to write is logged: the result reports the walls all the same."""
        old = recorded.records
        looked = set(plan.pending) | set(plan.walls)
        stale = [rid for rid, rec in old.items()
                 if merged.get(rid, 0) >= rec.generation or (rid in looked and rid not in self._walls)]
        try:
            records.clear(loc.store, stale)
            for rid, w in sorted(self._walls.items()):
                if not w.permanent:
                    continue
                ev = evidence.get(rid)
                if ev is None and rid in old and rid not in stale:
                    ev = Evidence(old[rid].shared_keys, old[rid].other_region)
                records.write(loc.store, records.WallRecord(w, time.time(), ev.shared_keys if ev else None,
                                                            ev.other_region if ev else None))
        except Exception as e:  # noqa: BLE001
            log.warning("could not record walls: %s: %s", type(e).__name__, e)
