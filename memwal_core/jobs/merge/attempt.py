"""One batch of a merge run: attempts until it is settled, each attempt one Spark read.

An attempt reads the batch's open generations (Spark), checks what it read and commits it. It
ends `Committed` (what could be committed is; the rest is behind walls) or `Retry(reason)`:
what it read cannot be committed as it is, for one of the `RetryReason`s. The loop around it
(`merge_batch`) proves it ends: each reason names the part of the batch's `Budget` its retry
must shrink (fewer open generations, the dropped columns looked up, fewer commit attempts
left), no part may grow (walls are only added within a batch; merge progress never
regresses), and the parts are bounded below, so the number of attempts is bounded by their
sum; `_check_progress` asserts it on every retry, and the loop is a `for` over that bound.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, fields

from memwal_core.jobs.merge import exclusivity
from memwal_core.jobs.merge.commit import commit_isolating
from memwal_core.jobs.merge.plan import MergeBatch, PlannedGeneration
from memwal_core.jobs.merge.result import MergeError, RegionMergeResult
from memwal_core.jobs.merge.run import Run, unmatched_fields
from memwal_core.spark import tasks as sparkpath
from memwal_core.state import layout
from memwal_core.state.table import read_memwal_state

log = logging.getLogger("memwal.merge")


class RetryReason(enum.Enum):
    """Why an attempt's read cannot be committed as it is."""

    MERGED_MEANWHILE = "another merger merged some of the generations during the read"
    DROPPED_COLUMNS = "generations hold columns the base table dropped: read again without them"
    SHARED_KEYS = "keys in several regions of the batch: those regions are walled"
    KEYS_MERGED_EARLIER = "keys another region merged (in this run, or recorded): the region is walled"
    STOPPED_BELOW_TASK = "a region was walled below where its task stopped: read again without those rows"
    COMMIT_LOST = "the commit lost a race, or is not in the latest version"

    @property
    def shrinks(self) -> str:
        """The part of the batch's `Budget` a retry for this reason must shrink."""
        return _SHRINKS[self]


_SHRINKS = {RetryReason.MERGED_MEANWHILE: "open_generations", RetryReason.DROPPED_COLUMNS: "dropped_unknown",
            RetryReason.SHARED_KEYS: "open_generations", RetryReason.KEYS_MERGED_EARLIER: "open_generations",
            RetryReason.STOPPED_BELOW_TASK: "open_generations", RetryReason.COMMIT_LOST: "commits_left"}


@dataclass(frozen=True)
class Committed:
    """The batch is settled: what could be committed is, the rest is behind walls."""


@dataclass(frozen=True)
class Retry:
    reason: RetryReason


@dataclass(frozen=True)
class Budget:
    """What a batch's attempts have left. Each retry shrinks the part its reason names and grows
    none; every part is >= 0, so a batch makes at most `total + 1` attempts."""

    open_generations: int  # generations of the batch not merged and not behind a wall
    dropped_unknown: int   # 1 until the base table's dropped columns are looked up
    commits_left: int      # commit attempts left before the run gives up

    @property
    def total(self) -> int:
        return self.open_generations + self.dropped_unknown + self.commits_left


def _check_progress(reason: RetryReason, before: Budget, after: Budget) -> None:
    """Raise unless the retry for `reason` shrank its part of the budget and grew none (an
    explicit raise, not `assert`: it holds under `python -O` too)."""
    grew = [f.name for f in fields(Budget) if getattr(after, f.name) > getattr(before, f.name)]
    if grew or getattr(after, reason.shrinks) >= getattr(before, reason.shrinks):
        raise AssertionError(f"merge retry {reason.name} made no progress: {before} -> {after}")


def merge_batch(run: Run, batch: MergeBatch) -> None:
    """Attempt the batch until it is settled (see the module docstring)."""
    merged: dict[str, int] | None = read_memwal_state(run.loc).merged
    run.walls.lift(merged)  # transient walls another merger merged past
    region_ids = sorted({g.region_id for g in batch.generations if run.walls.open(g)})
    index = {rid: i for i, rid in enumerate(region_ids)}
    for rid in region_ids:
        run.result.regions.setdefault(rid, RegionMergeResult(rid))
    conflicts = 0
    last: tuple[RetryReason, Budget] | None = None
    for _ in range(len(batch.generations) + 1 + run.max_attempts + 1):
        # The first attempt takes the progress read above; a retry reads it again (what a
        # retry is about may have moved it).
        merged = merged if merged is not None else read_memwal_state(run.loc).merged
        gens = _open(run, batch, merged)
        budget = Budget(len(gens), int(not run.dropped.known), run.max_attempts - conflicts)
        if last is not None:
            _check_progress(*last, budget)
        if not gens:
            return
        outcome = attempt(run, gens, index)
        if isinstance(outcome, Committed):
            return
        if outcome.reason is RetryReason.COMMIT_LOST:
            conflicts += 1
            run.result.conflicts += 1
            if conflicts >= run.max_attempts:
                raise MergeError(f"gave up merging a batch after {run.max_attempts} conflicting attempts")
            log.info("merge commit lost to another merger (attempt %d); re-reading progress", conflicts)
        else:
            log.info("re-reading the batch: %s", outcome.reason.value)
        last = (outcome.reason, budget)
        merged = None
    raise AssertionError("unreachable: every retry shrinks the batch's budget (`_check_progress`)")


def _open(run: Run, batch: MergeBatch, merged: dict[str, int]) -> list[PlannedGeneration]:
    """The batch's generations not merged yet and not behind a wall; the merged ones are
    reported as skipped (another merger merged them)."""
    out = []
    for g in batch.generations:
        if g.generation <= merged.get(g.region_id, 0):
            r = run.result.regions.setdefault(g.region_id, RegionMergeResult(g.region_id))
            if g.generation not in r.skipped_generations:
                r.skipped_generations.append(g.generation)
        elif run.walls.open(g):
            out.append(g)
    return out


def attempt(run: Run, gens: list[PlannedGeneration], index: dict[str, int]) -> Committed | Retry:
    """Read `gens` (one Spark job), check what was read, commit it (see the module docstring)."""
    region_index = {i: rid for rid, i in index.items()}
    own = {index[rid]: run.ownership.own[rid] for rid in {g.region_id for g in gens} if rid in run.ownership.own}
    deduped = _read(run, gens, index, own)
    # Progress is read again after the read: a generation another merger merged meanwhile may
    # be gone already (GC collects merged generations) and fail to read. It is skipped as
    # merged by the next attempt, not reported as broken.
    merged = read_memwal_state(run.loc).merged
    if any(g.generation <= merged.get(g.region_id, 0) for g in gens):
        return Retry(RetryReason.MERGED_MEANWHILE)
    if not run.dropped.known and unmatched_fields(deduped.stats):
        if unmatched_fields(deduped.stats) & set(run.dropped.look_up()):
            return Retry(RetryReason.DROPPED_COLUMNS)  # those columns are projected away
    cut = run.walls.refuse(deduped.stats, own, region_index)  # what the tasks refused
    for rid in sorted(cut):
        failure = run.ownership.establish(rid, [s for s in deduped.stats if s.region == index[rid]])
        if failure is not None:
            run.walls.stop(failure)
    if exclusivity.refuse_shared(deduped, gens, region_index, run.walls):
        return Retry(RetryReason.SHARED_KEYS)
    if exclusivity.refuse_across_batches(run.keys, run.walls, deduped, gens, region_index, merged):
        return Retry(RetryReason.KEYS_MERGED_EARLIER)
    gens = run.walls.in_order(gens, merged)
    if any(run.walls.below(rid, c) for rid, c in cut.items()):
        return Retry(RetryReason.STOPPED_BELOW_TASK)  # its task deduplicated rows past the wall
    if not gens:
        return Committed()
    return Committed() if commit_isolating(run, deduped, gens, index) else Retry(RetryReason.COMMIT_LOST)


def _read(run: Run, gens: list[PlannedGeneration], index: dict[str, int], own: dict[int, str]) -> sparkpath.Deduped:
    """One Spark job over `gens`: each region's newest rows, checked (`spark/tasks.py`)."""
    base = run.base
    cfg = sparkpath.ReadConfig(  # own values may have been established by an earlier attempt
        pk=base.pk, columns=base.columns, base_schema=base.schema,
        storage_options=tuple(sorted(run.loc.storage_options.items())),
        routing=tuple((index[rid], run.ownership.routes.get(rid)) for rid in sorted({g.region_id for g in gens})),
        own_values=tuple(sorted(own.items())), base_field_ids=base.field_ids, dropped_fields=run.dropped.fields)
    return sparkpath.read_and_dedup(
        run.spark, [(index[g.region_id], g.generation,
                     run.loc.child_uri(layout.generation_dir(g.region_id, g.path, g.generation)), g.bytes)
                    for g in gens], cfg, run.tasks)
