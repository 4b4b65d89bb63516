"""`memwal maintain`: one maintenance pass (or its dry run) over one table, through the same
Dagster assets and checks the daemon runs."""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import Any

from memwal_core.steps.outcome import STEPS, StepOutcome, StepStatus

from . import output
from .dry_run import dry_run, format_plan
from .interrupts import Interrupted, SignalWatch
from .output import CliError, ProgressLine, one_line, print_json, say
from .report import PassReport
from .target import secret_values, target

ASSET_OF_STEP = {"merge": "base_table", "compact": "base_compaction", "index": "memwal_index",
                 "catchup": "index_catchup", "gc": "garbage"}

def run_pass(cfg, steps: list[str], *, verbose: bool = False, secrets: dict[str, str] | None = None) -> PassReport:
    """One maintenance pass over `cfg`'s table: the chosen steps' assets, materialized in process.

    Why through Dagster, when the assets only call `memwal_core.steps.run_step`: the pass then
    runs exactly what the daemon runs, with each asset's checks (merge_lag, mergeable,
    catchup_gap, gc_consistency, stale_regions: a failed check fails the command), and nothing
    is wired twice. The command still never reads Dagster's metadata back: the runner reports
    each step's `StepOutcome` to the process's progress listeners (`memwal_core/jobs/progress.py`),
    and the pass formats those outcomes and takes its exit status from them and from the
    checks' verdicts. (An asset's typed output, `output_for_node`, would not do: the merge asset
    records per-region materializations and no output, and an output would be stored by the
    daemon's IO manager on every run.) Interrupts: Dagster turns a Ctrl-C inside a step into a
    step failure, so `SignalWatch` notices it after the step. One Spark session: the assets'
    Spark resource reuses the session `cmd_maintain` prestarted.

    `secrets`: the secret storage options (default: `cfg.secrets` read from the environment).
    Progress of the jobs (merge batches) goes to stderr while the pass runs."""
    from dagster import DagsterInstance

    from memwal_core.jobs import progress

    from ..assets import TableKeys
    from ..definitions import table_definitions
    from ..resources import TableResource

    td = table_definitions(cfg)
    secrets = secret_values(cfg, {}) if secrets is None else secrets
    # The table resource with the secrets resolved here (a missing variable is one clear line).
    table = TableResource(uri=cfg.uri, storage_options={**cfg.storage_options, **secrets})
    resources = {**td.resources, TableKeys(cfg.name).table_resource: table}
    report = PassReport(cfg.uri)
    run_config = {"loggers": {"console": {"config": {"log_level": "DEBUG" if verbose else "CRITICAL"}}}}
    live = output.live = ProgressLine(cfg.name)
    heard: list[StepOutcome] = []

    def listen(event: Any) -> None:
        if isinstance(event, StepOutcome):
            heard.append(event)
        else:
            live(event)

    with DagsterInstance.ephemeral() as instance, SignalWatch() as watch, progress.listening(listen):
        try:
            _run_steps(cfg, steps, td, resources, table.location(), instance, watch, run_config, report, heard)
        finally:
            live.end()
            output.live = None
    return report


def _run_steps(cfg, steps: list[str], td, resources: dict, loc, instance, watch: SignalWatch,
               run_config: dict, report: PassReport, heard: list[StepOutcome]) -> None:
    from dagster import materialize

    from memwal_core.spark import session as spark
    from memwal_core.state import region

    from ..tags import partition_range

    listing = region.list_regions(loc.store)
    for name, reason in listing.skipped:
        say(f"warning: skipping _mem_wal/{name}: {reason}")
    regions = sorted(listing.region_ids)
    instance.add_dynamic_partitions(td.partitions.name, regions)
    if "merge" in steps and regions and not cfg.spark.connect and has_pending(loc):
        spark.prestart(cfg.spark.master, cfg.spark.conf)  # no-op when the caller prestarted already
    by_key = {a.key.path[-1]: a for a in td.assets}
    for step in STEPS:
        if step not in steps:
            continue
        if step == "merge" and not regions:  # nothing to merge, and no partition to run over
            _report_step(cfg.name, StepOutcome(step, StepStatus.NOTHING_TO_DO, summary="no regions"), [], report)
            continue
        asset_def = by_key[ASSET_OF_STEP[step]]
        tags = partition_range(regions[0], regions[-1]) if step == "merge" else {}
        say(f"[{cfg.name}] {step} ...")
        heard.clear()
        try:
            result = materialize([asset_def, *td.checks_for(asset_def.key)], instance=instance,
                                 resources=resources, tags=tags, run_config=run_config,
                                 raise_on_error=False)
        except KeyboardInterrupt:  # outside Dagster's own handling (set-up, tear-down)
            raise Interrupted(signal.SIGINT, step) from None
        if watch.fired():
            raise Interrupted(watch.signum, step)
        outcome = _step_outcome(step, heard, result)
        checks = [] if outcome.status in (StepStatus.FAILED, StepStatus.SKIPPED) else \
            [c for c in result.get_asset_check_evaluations() if not c.passed]
        _report_step(cfg.name, outcome, checks, report)


def _step_outcome(step: str, heard: list[StepOutcome], result) -> StepOutcome:
    """The step's outcome as its runner reported it; a failed run whose step reported no failure
    failed outside the step (in Dagster, or the asset around the runner): FAILED, with the
    error Dagster recorded."""
    outcome = next((o for o in reversed(heard) if o.step == step), None)
    if result.success or (outcome is not None and outcome.failed):
        return outcome or StepOutcome(step, StepStatus.FAILED, error="the step reported no outcome")
    errors = [ev.step_failure_data.error for ev in result.get_step_failure_events()]
    said = next((e.message.strip().splitlines()[0] for e in errors if e is not None and e.message.strip()), "")
    error = f"the step's Dagster run failed{f': {said}' if said else ''} (--verbose shows its log)"
    return replace(outcome, status=StepStatus.FAILED, error=error) if outcome else \
        StepOutcome(step, StepStatus.FAILED, error=error)


def _report_step(table: str, outcome: StepOutcome, checks: list, report: PassReport) -> None:
    """One step's lines on stderr and its outcome (and failed checks) in the report."""
    report.outcomes.append(outcome)
    step = outcome.step
    if outcome.status is StepStatus.SKIPPED:  # another maintainer held the table's lease: not a failure
        say(f"[{table}] {step} skipped: {outcome.error}")
        return
    if outcome.status in (StepStatus.FAILED, StepStatus.REFUSED):
        say(f"[{table}] {step} FAILED: {outcome.error}")
        return
    for line in outcome.problems:
        say(f"[{table}] {step}: {line}")
    for note in outcome.notes:
        say(f"[{table}] {step}: {note}")
    say(f"[{table}] {step} done in {outcome.seconds:.1f} s" + (f": {outcome.summary}" if outcome.summary else ""))
    for check in checks:
        why = check.description or f"{check.severity.value} (the Dagster UI shows its details)"
        say(f"[{table}] check {check.check_name} FAILED: {why}")
        report.failed_checks.append(f"check {check.check_name}: {why}")


def has_pending(loc) -> bool:
    """Whether a merge has work (cheap: region manifests and the MemWAL index only)."""
    from memwal_core.jobs import merge

    try:
        return bool(merge.plan_merge(loc).batches)
    except Exception:  # noqa: BLE001 - the merge step itself reports what is wrong
        return False


def open_table(uri: str, options: dict[str, str]):
    """The table's location, once its base table opens: otherwise one line (not one per step)."""
    from memwal_core.state import region, table
    from memwal_core.state.store import open_store

    loc = open_store(uri, options)
    region.list_regions(loc.store)  # first: memwal's store names S3 errors (403, endpoint) clearly
    try:
        table.open_dataset(loc)
    except Exception as e:  # noqa: BLE001 - Lance's errors carry Rust source locations
        raise CliError(one_line(str(e))) from None
    try:  # a feature flag or region transform memwal does not know: refused before any step or JVM
        table.read_memwal_state(loc)
    except table.UnknownFeature as e:
        raise CliError(str(e)) from None
    except table.TableError:
        pass  # each step reports the others (not initialized, ...) as it always has
    return loc


def cmd_maintain(a) -> int:
    steps = [s.strip() for s in (a.only.split(",") if a.only else STEPS)]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise CliError(f"--only: unknown step(s) {', '.join(unknown)}; choose from {','.join(STEPS)}")
    # Checked first: a bad option is one line, before any JVM starts or any step runs.
    cfg, secrets = target(a)
    loc = open_table(cfg.uri, {**cfg.storage_options, **secrets})
    if "merge" in steps and not a.dry_run:
        # Before Dagster's imports and set-up (~4 s), so the JVM start and the first job's worker
        # start-up (~11 s cold on 2 cores) overlap them.
        from memwal_core.spark import archive as jvm_archive
        from memwal_core.spark import session as spark

        if has_pending(loc):
            if not cfg.spark.master.startswith("sc://") and jvm_archive.java_binary() is None:
                # Otherwise the JVM launch fails twice (prestart, then the merge), trace each time.
                raise CliError("no java found (JAVA_HOME or PATH): the merge runs on Spark, which needs Java 17")
            spark.prestart(cfg.spark.master, cfg.spark.conf)  # with its conf: the merge reuses this session
    if a.dry_run:
        report = dry_run(cfg, steps, secrets)
        if a.json:
            print_json(report.to_dict())
        else:
            print(format_plan(report))
    else:
        report = run_pass(cfg, steps, verbose=a.verbose, secrets=secrets)
        if a.json:
            print_json(report.to_dict())
    for line in report.failed:
        say(f"error: {line}")
    return 1 if report.failed else 0
