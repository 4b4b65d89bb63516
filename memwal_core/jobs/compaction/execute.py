"""Execute a compaction plan: rewrite in Spark, commit on the driver, merge or retrain index
segments, restore the catch-up the Rewrite withdrew.

What a Rewrite commit does to MemWAL state (pylance 14.0.2, tests/test_compaction.py):
- `merged_generations` (pylance: `compacted_sstables`) is carried over unchanged.
- `index_catchup` is **withdrawn** (Lance withdraws catch-up whenever an index changes, and a
  Rewrite remaps every index), even though the remapped indexes still cover every row. An
  absent entry reads as "not caught up": safe for readers and GC (they keep reading / keeping
  the generations), but it would stall GC until the next catch-up. So right after the commit
  the executor restores it with `optimize_indices` on the withdrawn indexes (nothing to add;
  Lance re-derives catch-up in that commit). A crash in between leaves it to the next index
  catch-up, which always follows compaction in the pipeline.
- Compaction itself makes two commits: `ReserveFragments` (new fragment ids) and the Rewrite.
- A merge committed between plan and commit makes the Rewrite fail with a retryable commit
  conflict (even an insert-only merge: `merge_insert` is an Update). The executor re-plans
  from the new version and re-runs the tasks, up to `max_attempts`, then gives up cleanly:
  nothing of the failed attempt is visible, and the executor deletes its unreferenced data
  files at once (Lance's `cleanup_old_versions` would keep never-referenced files 7 days).
  The other order is harmless: a merge that read the table before a Rewrite and commits
  after it is rebased by Lance.
- Time travel: older versions keep their fragments until `cleanup_old_versions` removes them.

Lance compacts only fragments with the same index coverage, so the fragment the preceding merge
added (not indexed yet: catch-up follows compaction) would stay apart forever; when a compaction
runs and some index has unindexed rows, it **indexes first** (the catch-up that would follow it)
and plans after that, so the newest fragment is folded in too. Likewise, fragments each in a
delta segment of their own (a catch-up that appends segments) are never combined: then the
indexes' segments are merged first (`coverage_merges`) and the plan is made again.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from lance.optimize import Compaction

from memwal_core import faults
from memwal_core.errors import one_line
from memwal_core.jobs import catchup
from memwal_core.options import CompactionOptions
from memwal_core.state import lease, table
from memwal_core.state.lance_mem_wal import is_commit_conflict
from memwal_core.state.store import TableLocation

from .health import read_health
from .plan import CompactionPlan, bounded_plan, coverage_merges, plan_compaction
from .result import CompactionResult
from .rewrite import discard_rewrites, execute_tasks

log = logging.getLogger("memwal.compaction")


@lease.step("compact")
def execute_compaction(loc: TableLocation, plan: CompactionPlan, spark=None, *,
                       progress: Callable[[str], None] | None = None,
                       before_commit: Callable[[int], None] | None = None) -> CompactionResult:
    """Do what `plan` says: rewrite in Spark, commit on the driver, merge/retrain index
    segments, restore the catch-up the Rewrite withdrew.

    A commit conflict (a merge landed since the plan) re-plans from the new version and
    re-runs, up to `max_attempts` plans; then it gives up cleanly (status "gave up: ...").
    `before_commit(attempt)` runs after the Spark tasks and before each commit (tests land a
    concurrent merge there).
    """
    t0 = time.monotonic()
    o = plan.options
    say = progress or (lambda _m: None)
    result = CompactionResult(plan.table_uri, "healthy, skipped", plan.health)
    if plan.healthy:
        result.table_version = plan.table_version
        result.health_after = plan.health
        result.duration_s = time.monotonic() - t0
        return result
    before = table.read_memwal_state(loc, plan.table_version)
    if plan.needs_spark:
        if spark is None:
            raise ValueError("compaction has tasks to run but no Spark session was given")
        replanned = _rewrite(loc, plan, spark, result, say, before_commit)
        before = before if replanned is None else replanned
    for name, segments in plan.merge_segments.items():
        _optimize(loc, name, result, {"num_indices_to_merge": segments}, result.segments_merged, segments)
    for name in plan.retrain:
        _optimize(loc, name, result, {"retrain": True}, None, 0)
        if name not in result.errors:
            result.retrained.append(name)
    if o.restore_catchup and result.committed:
        result.catchup_restored = restore_catchup(loc, before, result.errors)
    if result.status in ("healthy, skipped", "nothing to rewrite") and result.committed:
        result.status = "indexes merged" if not result.retrained else "indexes retrained"
    ds = table.open_dataset(loc)
    result.table_version = ds.version
    result.health_after = read_health(loc, o, ds)
    result.duration_s = time.monotonic() - t0
    return result


def _rewrite(loc: TableLocation, plan: CompactionPlan, spark, result: CompactionResult,
             say: Callable[[str], None], before_commit: Callable[[int], None] | None) -> table.MemWalState | None:
    """The data rewrite: index first if the plan says so, then plan (again), run the tasks in
    Spark and commit, at most `max_attempts` times. Each attempt either commits (done), finds
    nothing to rewrite (done), or loses the commit race to a concurrent commit (its files are
    deleted; the next attempt plans from the newer version), so the loop ends after at most
    `max_attempts` rounds. Returns the MemWAL state the committed plan read (None: the plan's
    own), from which the withdrawn catch-up is restored."""
    o = plan.options
    before: table.MemWalState | None = None
    result.status = "nothing to rewrite"
    lance_plan = plan.lance_plan
    if plan.index_first:
        _index_first(loc, plan.index_first, result, say)
        lance_plan = None
    coverage_merged = bool(plan.segments_first)
    if plan.segments_first:
        _merge_for_coverage(loc, plan.segments_first, result, say)
        lance_plan = None
    while result.attempts < o.max_attempts:
        result.attempts += 1
        if lance_plan is None:  # after the catch-up, or a retry: plan from the latest version
            lance_plan, before = _plan_latest(loc, plan)
        if not coverage_merged and (plan.full or not lance_plan.tasks):
            # After the catch-up, the fragments it indexed may sit in a delta segment of their own.
            coverage_merged = True
            if _merge_for_coverage(loc, coverage_merges(read_health(loc, o)), result, say):
                lance_plan, before = _plan_latest(loc, plan)
        if not lance_plan.tasks:
            return before
        result.tasks = len(lance_plan.tasks)
        say(f"compaction: {len(lance_plan.tasks)} tasks over "
            f"{sum(len(t.fragments) for t in lance_plan.tasks)} fragments (attempt {result.attempts})")
        if _commit_attempt(loc, spark, lance_plan, result, before_commit):
            say(f"compaction: {result.fragments_removed} fragments -> {result.fragments_added}")
            return before
        lance_plan = None
        if result.attempts < o.max_attempts:
            log.info("compaction lost a commit race (attempt %d); planning again", result.attempts)
    result.status = (f"gave up: {result.conflicts} commit conflicts with concurrent commits "
                     "(merges); nothing of the rewrite is visible, the next run retries")
    log.warning("compaction of %s %s", loc.lance_uri, result.status)
    return before


def _plan_latest(loc: TableLocation, plan: CompactionPlan) -> tuple:
    """The bounded Lance plan of the latest version, and the MemWAL state it read."""
    ds = table.open_dataset(loc)
    return bounded_plan(ds, plan.options, plan.full), table.read_memwal_state(loc, ds.version)


def _merge_for_coverage(loc: TableLocation, segments: dict[str, int], result: CompactionResult,
                        say: Callable[[str], None]) -> bool:
    """Merge the segments of each index in `segments` (index -> segments) so the fragments
    they cover share one coverage and Lance can compact them together (see `coverage_merges`).
    True when some index was merged; a failure is recorded and the rewrite goes on without."""
    if not segments:
        return False
    say(f"compaction: merging index segments of {', '.join(segments)} first (Lance compacts only fragments "
        "with the same index coverage)")
    for name, n in segments.items():
        _optimize(loc, name, result, {"num_indices_to_merge": n}, result.segments_merged, n)
    return any(name in result.segments_merged for name in segments)


def _commit_attempt(loc: TableLocation, spark, lance_plan, result: CompactionResult,
                    before_commit: Callable[[int], None] | None) -> bool:
    """Run `lance_plan`'s tasks in Spark and commit the Rewrite. True: committed; False: a
    concurrent commit won the race (counted in `result.conflicts`, the rewrite's files deleted)."""
    rewrites = execute_tasks(spark, loc, lance_plan)
    if before_commit is not None:
        before_commit(result.attempts)
    ds = table.open_dataset(loc, version=lance_plan.read_version,
                            commit_lock=faults.commit_lock("compaction.during_commit"))
    faults.point("compaction.before_commit")
    lease.fence(loc, "compaction commit")
    try:
        metrics = Compaction.commit(ds, rewrites)
    except OSError as e:
        if not is_commit_conflict(e):
            raise
        result.conflicts += 1
        discard_rewrites(loc, rewrites)
        return False
    faults.point("compaction.after_commit")
    result.fragments_removed += metrics.fragments_removed
    result.fragments_added += metrics.fragments_added
    result.status = "compacted"
    return True


def _index_first(loc: TableLocation, names: list[str], result: CompactionResult,
                 say: Callable[[str], None]) -> None:
    """Catch up `names` so Lance can compact the newest (unindexed) fragments with the rest.

    A failing index is recorded and the compaction goes on: it then leaves the unindexed
    fragments apart, exactly as without this step.
    """
    say(f"compaction: catching up {', '.join(names)} first (Lance compacts only fragments with the same "
        "index coverage)")
    faults.point("compaction.before_index_first")
    r = catchup.run_catchup(loc, names)
    faults.point("compaction.after_index_first")
    result.indexed_first = [i.name for i in r.indexes if i.optimized and i.error is None]
    for name, err in r.errors.items():
        result.errors[name] = f"catch-up before compaction: {err}"
        log.warning("index %s: catch-up before compaction failed (%s); its unindexed fragments stay apart",
                    name, err)


def _optimize(loc: TableLocation, name: str, result: CompactionResult, kw: dict, record: dict | None,
              segments: int) -> None:
    try:
        lease.fence(loc, f"index {name} optimize")
        table.open_dataset(loc).optimize.optimize_indices(index_names=[name], **kw)
        if record is not None:
            record[name] = segments
    except Exception as e:  # noqa: BLE001 - one index failing does not stop the others
        result.errors[name] = one_line(e)
        log.warning("index %s: optimize_indices(%s) failed: %s", name, kw, result.errors[name])


def withdrawn_catchup(before: table.MemWalState, after: table.MemWalState) -> list[str]:
    """Indexes whose recorded catch-up is lower (or gone) in `after` for some region."""
    out = []
    for name, regions in before.catchup.items():
        now = after.catchup.get(name, {})
        if any(now.get(rid, 0) < g for rid, g in regions.items()):
            out.append(name)
    return sorted(out)


def restore_catchup(loc: TableLocation, before: table.MemWalState, errors: dict[str, str]) -> list[str]:
    """Re-record the catch-up a Rewrite withdrew (optimize_indices on those indexes only).

    A failure goes into `errors` (the result's: the asset's check and `memwal maintain` show
    it); the index catch-up that follows compaction in every pass retries it."""
    ds = table.open_dataset(loc)
    existing = catchup.base_indexes(ds)
    names = [n for n in withdrawn_catchup(before, table.read_memwal_state(loc, ds.version)) if n in existing]
    if not names:
        return []
    r = catchup.run_catchup(loc, names)
    for name, err in r.errors.items():
        errors[name] = f"restoring catch-up after the rewrite: {err}"
        log.warning("restoring catch-up of %s failed: %s", name, err)
    return [o.name for o in r.indexes if o.error is None]


@lease.step("compact")
def compact(loc: TableLocation, spark=None, options: CompactionOptions | None = None, **kw) -> CompactionResult:
    """Plan and execute in one call."""
    return execute_compaction(loc, plan_compaction(loc, options), spark, **kw)
