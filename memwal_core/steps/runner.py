"""Run one maintenance step on one table: plan it and, unless it is a dry run, execute it.

`run_step` is the one way a step runs, whoever asks: the Dagster assets call it and turn its
`StepOutcome` into events; `memwal maintain` materializes those assets (and so runs it too),
and its `--dry-run` calls it with `execute=False`, which plans with the same options and
commits nothing. Every step that commits holds the table's lease around its plan and its
commits (`state/lease.py`); a lease another maintainer holds past `lease.wait_seconds` skips
the step (not a failure: the next run does the work). A step that raises ends FAILED with its
error in one line; an interrupt (KeyboardInterrupt) is not caught.

The outcome is also reported to the process's progress listeners (`jobs/progress.py`) as the
step's last event: that is how `memwal maintain` learns the outcome of a step that runs inside
an asset it materializes in process.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from memwal_core.errors import MemwalError, one_line
from memwal_core.jobs import catchup, compaction, gc, merge, snapshot
from memwal_core.jobs.progress import ProgressFn, report
from memwal_core.options import (
    CatchupOptions,
    CompactionOptions,
    GcOptions,
    LeaseOptions,
    MergeOptions,
    SnapshotOptions,
)
from memwal_core.state import lease
from memwal_core.state.keys import UnsupportedKeyType, refuse_unsupported_keys
from memwal_core.state.store import TableLocation
from memwal_core.state.table import NoPrimaryKey, StableRowIds, open_dataset, primary_key, refuse_stable_row_ids
from memwal_core.steps import adapt
from memwal_core.steps.outcome import STEPS, StepOutcome, StepStatus

SparkProvider = Callable[[], Any]  # the session, started on first call (a JVM start is ~10 s)


@dataclass(frozen=True)
class StepOptions:
    """The settings the steps read (the sections of a table's configuration)."""

    merge: MergeOptions = field(default_factory=MergeOptions)
    compaction: CompactionOptions = field(default_factory=CompactionOptions)
    snapshot: SnapshotOptions = field(default_factory=SnapshotOptions)
    gc: GcOptions = field(default_factory=GcOptions)
    lease: LeaseOptions = field(default_factory=LeaseOptions)
    catchup: CatchupOptions = field(default_factory=CatchupOptions)

    @classmethod
    def of(cls, settings: Any) -> "StepOptions":
        """The step options of a table's settings (any object with these sections, such as the
        Dagster layer's `TableConfig`)."""
        return cls(settings.merge, settings.compaction, settings.snapshot, settings.gc, settings.lease,
                   settings.catchup)


def describe_error(e: BaseException) -> str:
    """An error in one line: memwal's own refusals as they say it (without their class name),
    anything else as `Type: first line`, without the Rust source locations Lance appends."""
    text = str(e).strip()
    line = text.splitlines()[0] if isinstance(e, MemwalError) and text else one_line(e)
    return re.sub(r",\s*/\S+\.rs:\d+:\d+", "", line).strip()


def run_step(step: str, loc: TableLocation, options: StepOptions | None = None, spark: SparkProvider | None = None,
             *, execute: bool = True, regions: list[str] | None = None, run_id: str | None = None,
             progress: ProgressFn | None = None) -> StepOutcome:
    """Step `step` (one of `STEPS`) on the table at `loc`; `regions`: the merge's regions (all
    when None); `run_id`: names the lease's holder (a Dagster run); `progress`: the jobs'
    progress events and, last, the outcome."""
    if step not in _STEPS:
        raise ValueError(f"unknown step {step!r}; choose from {', '.join(STEPS)}")
    options = options or StepOptions()
    t0 = time.monotonic()
    try:
        if execute:
            with lease.hold(loc, step, options.lease, run_id=run_id):
                outcome = _STEPS[step](loc, options, spark, True, regions, progress)
        else:
            outcome = _STEPS[step](loc, options, spark, False, regions, progress)
    except lease.LeaseHeld as e:
        outcome = StepOutcome(step, StepStatus.SKIPPED, error=f"lease held by {e.record.describe()}", exception=e)
    except Exception as e:  # noqa: BLE001 - the outcome says what failed; the caller decides what it means
        outcome = StepOutcome(step, StepStatus.FAILED, execute, error=describe_error(e), exception=e)
    outcome = replace(outcome, seconds=time.monotonic() - t0)
    report(progress, outcome)
    return outcome


def _session(spark: SparkProvider | None, step: str) -> Any:
    if spark is None:
        raise ValueError(f"the {step} step has Spark work to do and no Spark session was given")
    return spark()


def _merge(loc: TableLocation, o: StepOptions, spark: SparkProvider | None, execute: bool,
           regions: list[str] | None, progress: ProgressFn | None) -> StepOutcome:
    ds = open_dataset(loc)
    try:  # before any Spark: a table the merger refuses says so, as a plan or as a run
        refuse_unsupported_keys(ds.schema, primary_key(ds), loc.lance_uri)
        refuse_stable_row_ids(ds)
    except (NoPrimaryKey, UnsupportedKeyType, StableRowIds) as e:
        return StepOutcome("merge", StepStatus.REFUSED, execute, error=describe_error(e), exception=e)
    plan = merge.plan_merge(loc, budget_bytes=o.merge.budget_bytes, max_generations=o.merge.max_generations,
                            regions=regions)
    if not execute:
        return adapt.merge_outcome(plan, None)
    session = _session(spark, "merge") if plan.batches else None
    return adapt.merge_outcome(plan, merge.execute_merge(loc, plan, session, progress=progress, lease=o.lease))


def _compact(loc: TableLocation, o: StepOptions, spark: SparkProvider | None, execute: bool,
             regions: list[str] | None, progress: ProgressFn | None) -> StepOutcome:
    plan = compaction.plan_compaction(loc, o.compaction)
    if progress is not None:
        progress(f"compaction plan: {plan.summary}")
    if not execute:
        return adapt.compaction_outcome(plan, None)
    session = _session(spark, "compact") if plan.needs_spark else None
    r = compaction.execute_compaction(loc, plan, session, progress=progress, lease=o.lease)
    return adapt.compaction_outcome(plan, r)


def _catchup(loc: TableLocation, o: StepOptions, spark: SparkProvider | None, execute: bool,
             regions: list[str] | None, progress: ProgressFn | None) -> StepOutcome:
    # Every index: one created since the last plan gates GC all the same.
    plan = catchup.plan_catchup(loc, options=o.catchup)
    if not execute:
        return adapt.catchup_outcome(plan, None)
    return adapt.catchup_outcome(plan, catchup.execute_catchup(loc, plan, lease=o.lease))


def _index(loc: TableLocation, o: StepOptions, spark: SparkProvider | None, execute: bool,
           regions: list[str] | None, progress: ProgressFn | None) -> StepOutcome:
    threshold = o.snapshot.inline_threshold
    if not execute:
        return adapt.snapshot_outcome(snapshot.build_snapshot(loc, inline_threshold=threshold, dry_run=True,
                                                              update_hints=False))
    return adapt.snapshot_outcome(snapshot.build_snapshot(loc, inline_threshold=threshold, lease=o.lease))


def _gc(loc: TableLocation, o: StepOptions, spark: SparkProvider | None, execute: bool,
        regions: list[str] | None, progress: ProgressFn | None) -> StepOutcome:
    if not execute:  # the base-version cleanup planned by Lance, GC planned as if it had run
        return adapt.gc_outcome(gc.run_gc(loc, o.gc, dry_run=True))
    return adapt.gc_outcome(gc.run_gc(loc, o.gc, progress=progress, lease=o.lease))


_STEPS = {"merge": _merge, "compact": _compact, "catchup": _catchup, "index": _index, "gc": _gc}
