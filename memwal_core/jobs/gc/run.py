"""`run_gc`: one GC pass. Expired stale regions are discarded, the base table's old versions
cleaned up (when configured), then GC plans and executes. A dry run is the same path with
execution off."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from memwal_core.errors import one_line
from memwal_core.jobs.gc.base_cleanup import BaseCleanupPlan, cleanup_base_versions, plan_base_cleanup
from memwal_core.jobs.gc import history
from memwal_core.jobs.gc.execute import execute_gc
from memwal_core.jobs.gc.plan import plan_gc
from memwal_core.jobs.gc.result import GcResult
from memwal_core.options import GcOptions
from memwal_core.state import lease, lifecycle
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.gc")

# The lifecycle record (`state/lifecycle.py`) tells a new process up to which table version the
# MemWAL initialization was verified; the merger advances it with its commits. GC advances it too
# once it is this many versions behind (a table merged elsewhere, or compacted and indexed often).
LIFECYCLE_REFRESH = 64


@lease.step("gc")
def run_gc(loc: TableLocation, config: GcOptions | None = None, *, regions: list[str] | None = None,
           dry_run: bool = False, progress: Callable[[str], None] | None = None) -> GcResult:
    """Base-version cleanup (when configured), plan, execute. A dry run is the same path with
    execution off: the cleanup is planned instead (Lance's explanation) and GC planned as if
    those versions were gone; `result.plan` lists what would be deleted."""
    config = config or GcOptions()
    # The retained versions first: what they say of the MemWAL index answers the lifetime check,
    # which so reads only the versions committed since (their manifests grow with the table).
    known = _versions(loc, config, dry_run, leaks=regions is None)
    indexed = _indexed(known)
    # The table and its regions are read and judged once, for the three steps that need them
    # (the table opened at the newest version the history found, when it is still the newest).
    newest = known.newest() if known is not None else None
    view = lifecycle.assess_table(loc, max_workers=config.max_workers, indexed=indexed, newest_known=newest)
    discarded, committed = _discard_expired(loc, config, dry_run, view)
    if committed:  # a discard commit landed (or may have): what was read is out of date
        view = lifecycle.assess_table(loc, max_workers=config.max_workers, indexed=indexed)
    base, base_plan, known = _clean_base(loc, config, dry_run, progress, view=view, known=known)
    if base_plan is not None or (base is not None and (base.get("old_versions") or "error" in base)):
        # Lance's cleanup removed (a dry run: would remove) versions judged against the latest
        # version it saw, which may be newer than the one read above (and that one may be gone).
        # Not fed the versions read before it: those it removed read as not retained, as ever
        # (this process verified the lifetime up to the first read: only later versions are read).
        view = lifecycle.assess_table(loc, max_workers=config.max_workers)
    t0 = time.monotonic()
    # A dry run lists the whole table (and scans for leaked files) whenever it runs: it is asked
    # what GC would collect; `leak_scan` says when the real runs scan next.
    plan = plan_gc(loc, config, regions=regions, base_cleanup=base_plan, history=known, full_scan=dry_run,
                   view=view)
    plan_s = time.monotonic() - t0
    if progress:
        progress(f"plan: {plan.objects} objects, {plan.bytes / 1e6:.1f} MB, {len(plan.failures)} region errors")
    if dry_run:
        result = GcResult(plan.table_uri, kept=plan.kept, failures=list(plan.failures), dry_run=True,
                          leak_scan=dict(plan.leak_scan))
    else:
        result = execute_gc(loc, plan)
        if plan.lifecycle is not None:  # regions classified for the first time: not again next pass;
            # the versions verified since the record, every LIFECYCLE_REFRESH versions
            lifecycle.save(loc, plan.lifecycle, verdicts_only=True, refresh_after=LIFECYCLE_REFRESH)
    if base is not None and "error" not in base:  # as the plan read them, right after the cleanup
        base["versions_after"] = len(plan.retained_versions)
        base["versions_before"] = base["versions_after"] + base["old_versions"]
    result.base_cleanup = base
    result.plan = plan
    result.retained_versions = len(plan.retained_versions)
    result.plan_seconds = plan_s
    result.holds = plan.holds
    result.stale_discarded = discarded
    return result


def _indexed(known: history.VersionHistory | None) -> lifecycle.Indexed | None:
    """Whether a version `known` holds carries the MemWAL index (its merge progress is None
    exactly when it has none: `history.VersionFacts`); None for a version it does not hold, which
    the lifetime check then reads. Facts `history.py` vouches for: of this table's manifests."""
    return None if known is None else known.indexed


def _clean_base(loc: TableLocation, config: GcOptions, dry_run: bool, progress: Callable[[str], None] | None,
                view: lifecycle.TableAssessment, known: history.VersionHistory | None
                ) -> tuple[dict[str, Any] | None, BaseCleanupPlan | None, history.VersionHistory | None]:
    """The base-version cleanup (a dry run: its plan, for GC to plan as if it had run): what it
    did for the result (None: not configured, or skipped; `error`: it failed, and GC plans on
    every version as retained, which stays safe), and `known`, the retained versions read earlier
    in the pass, marked to be listed again when the cleanup removed some; they also tell that no
    version is old enough for it (Lance's cleanup reads every manifest)."""
    if not (config.base_cleanup and (dry_run or _record_stale(loc, view.lifecycle))):
        return None, None, known
    base_plan: BaseCleanupPlan | None = None
    try:
        if not dry_run and known is not None and _nothing_old_enough(known, config):
            log.info("base-version cleanup not run: no retained version is older than %s",
                     config.base_cleanup_older_than)
            return {"old_versions": 0, "bytes_removed": 0}, None, known
        if dry_run:
            base_plan = plan_base_cleanup(loc, config)
            base = {"dry_run": True, "old_versions": len(base_plan.versions), "bytes_removed": base_plan.bytes}
        else:
            if known is not None:  # what it removes is seen by listing again (also after a failure)
                known.must_list = True
            base = cleanup_base_versions(loc, config)
            if known is not None and base["old_versions"] == 0:
                known.must_list = False
        if progress:
            progress(f"base table: {base['old_versions']} old versions "
                     f"{'would be cleaned up' if dry_run else 'cleaned up'}")
    except Exception as e:  # noqa: BLE001 - planning below stays safe: it reads what is retained
        base = {"error": one_line(e)}
        log.warning("base table version cleanup failed, collecting without it: %s", base["error"])
    return base, base_plan, known


def _versions(loc: TableLocation, config: GcOptions, dry_run: bool, leaks: bool) -> history.VersionHistory | None:
    """The retained versions (`history.py`; listed as the plan would list them), or None when
    they cannot be read (the lifetime check reads the manifests, the cleanup runs, the plan
    reads the versions again)."""
    try:
        return history.read_history(loc, max_workers=config.max_workers,
                                    interval=0.0 if dry_run else config.full_scan_interval_seconds,
                                    for_leaks=leaks and config.collect_leaked_files)
    except Exception as e:  # noqa: BLE001 - only an optimization; planning reads them again
        log.info("retained versions not read at the start of the pass: %s", one_line(e))
        return None


def _nothing_old_enough(known: history.VersionHistory, config: GcOptions) -> bool:
    """Whether no retained version is older than the cleanup's age: then Lance's cleanup, which
    reads every manifest, would remove no version (by age and by count alike it removes only
    versions older than that), and is not run. The unreferenced files it would also remove once a
    week old are GC's leak scan's (`leaks.py`)."""
    older_than = config.base_cleanup_older_than
    stamps = np.frombuffer(known.tail.stamps, dtype=np.float64)  # NaN: a version without a commit time
    part = known.sealed  # the older versions: their oldest commit time, and whether one has none
    if older_than is None or not len(stamps) or np.isnan(stamps).any() or (part is not None and (
            part.no_stamp or part.min_stamp is None)):
        return False
    oldest = stamps.min() if part is None else min(stamps.min(), part.min_stamp)
    return bool(oldest > time.time() - older_than.total_seconds())


def _record_stale(loc: TableLocation, lc: lifecycle.Lifecycle) -> bool:
    """Record the MemWAL initialization and the stale-region verdicts before the base-version
    cleanup: the versions around the initialization are its only evidence, and once cleaned up
    an unrecorded initialization is unknown (nothing would be judged stale), or worse, an older
    record is trusted across the versions cleaned up (its lifetime's regions judged current).
    Recorded also when no region was judged stale: a region that could not be read now is
    classified later against the recorded initialization. Nothing to record when the record
    already has this initialization and these verdicts. False: the record could not be
    written, so the cleanup waits for the next run."""
    try:
        if lc.stale or lc.new_verdicts:
            lifecycle.save(loc, lc, strict=True)
        return True
    except Exception as e:  # noqa: BLE001 - the cleanup must not erase the only evidence
        log.warning("base-version cleanup skipped: the stale-region verdicts could not be recorded first: %s",
                    one_line(e))
        return False


def _discard_expired(loc: TableLocation, config: GcOptions, dry_run: bool,
                     view: lifecycle.TableAssessment) -> tuple[dict[str, int], bool]:
    """Discard the stale regions reported for longer than `discard_stale_after_seconds`
    (region -> generations discarded through; a dry run says which it would), and whether the
    table may have changed since `view` (a discard committed, or failed part-way)."""
    if config.discard_stale_after_seconds is None:
        return {}, False
    try:
        out = lifecycle.discard(loc, None, dry_run=dry_run, by="grace",
                                only_older_than=config.discard_stale_after_seconds, assessed=view)
    except Exception as e:  # noqa: BLE001 - GC proceeds; the stale regions stay held
        log.warning("discarding expired stale regions failed: %s", one_line(e))
        return {}, not dry_run
    return out.discarded, bool(out.discarded) and not dry_run
