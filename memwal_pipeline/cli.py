"""`memwal`: demo, maintain and status, running the same Dagster definitions in process.

A command works on one table: a URI (default settings), or `--config FILE --table NAME` (that
table's settings); flags override settings and are checked by the same rules as the file.
Progress of long jobs goes to stderr (one updating line on a terminal), so `--json` keeps
stdout for the report.
Errors are one clear line naming the region (a traceback only with --verbose). What a step did
is its `StepOutcome` (`memwal_core.steps`): the lines printed, the `--json` report (versioned by
`schema_version`) and the exit status (non-zero when a step failed, was refused, left regions
behind, or a check failed) all come from outcomes, never from Dagster metadata; `--dry-run`
is the same runner with `execute=False`. Ctrl-C (SIGINT) or SIGTERM stops the pass: the step
under way is abandoned (its commits are atomic: either in or not), no later step runs, and the
exit status is 128 + the signal number (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
from dataclasses import dataclass, field, replace
from typing import Any

# Light: the jobs (and Lance with them) are imported by the commands that run them.
from memwal_core.steps.outcome import SCHEMA_VERSION, STEPS, StepOutcome, StepStatus

ASSET_OF_STEP = {"merge": "base_table", "compact": "base_compaction", "index": "memwal_index",
                 "catchup": "index_catchup", "gc": "garbage"}


class CliError(Exception):
    pass


class Interrupted(Exception):
    """The operator interrupted the pass (Ctrl-C, SIGTERM): stop, run nothing more."""

    def __init__(self, signum: int, step: str | None):
        self.signum, self.step = signum, step
        where = f" during {step}" if step else ""
        super().__init__(f"interrupted{where} ({signal.Signals(signum).name}): stopped, no later step was run; "
                         "what committed before stays (every commit is atomic); run it again to continue")


class _SignalWatch:
    """Notices SIGINT/SIGTERM even while Dagster has replaced their handlers.

    Dagster turns a Ctrl-C inside a step into a step failure and restores the handlers after
    the run, so the CLI cannot see it from the result alone. The interpreter also writes the
    number of every signal it handles to the wakeup fd, whoever's handler runs: read it after
    each step. (Main thread only; elsewhere it sees nothing and the handlers stay as they are.)
    """

    WATCHED = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> "_SignalWatch":
        self.signum: int | None = None
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        try:
            self._old = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def fired(self) -> int | None:
        while self.signum is None:
            try:
                data = self._r.recv(4096)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            self.signum = next((b for b in data if b in self.WATCHED), None)
        return self.signum

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.set_wakeup_fd(self._old)
        self._r.close()
        self._w.close()


def _stop_spark() -> None:
    """After an interrupt: cancel the session's jobs and stop it before the interpreter exits.

    Left to the exit, the JVM's scheduler finishes an abandoned task after Python's accumulator
    server is gone and logs that as a Java stack trace under the one-line message."""
    if "pyspark" not in sys.modules:
        return
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None:
        return
    try:
        sc.cancelAllJobs()
        sc.stop()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _options(pairs: list[str], flag: str = "--storage-option") -> dict[str, str]:
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise CliError(f"{flag} expects KEY=VALUE, got {p!r}")
        k, v = p.split("=", 1)
        out[k.strip()] = v
    return out


def _say(msg: str) -> None:
    if _live is not None:
        _live.end()
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the table: a URI, or a table of a config file; flags over its settings


def split_secrets(options: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain storage options, secret ones): a TableConfig holds no secret value (its
    `secrets` name environment variables), so secrets given as flags travel beside it."""
    from memwal_core.state.store import _S3_OPTION_ALIASES

    from .config import SECRET_OPTIONS

    canonical = {alias: name for name in SECRET_OPTIONS for alias in _S3_OPTION_ALIASES[name]}
    plain = {k: v for k, v in options.items() if k.lower() not in canonical}
    return plain, {canonical[k.lower()]: v for k, v in options.items() if k.lower() in canonical}


def _secret_values(cfg, given: dict[str, str]) -> dict[str, str]:
    """The table's secret storage options: `given` (flags), then each `secrets:` entry from
    its environment variable. Values are never printed, not even in errors."""
    out = dict(given)
    for option, var in cfg.secrets.items():
        if option in given:
            continue
        value = os.environ.get(var)
        if not value:
            raise CliError(f"table {cfg.name}: secret {option} is read from the environment variable {var}, "
                           f"which is not set: export {var} (or pass --storage-option {option}=...)")
        out[option] = value
    return out


def _configured_table(path: str, name: str | None):
    """Table `name` of the config file at `path` (`name` may be omitted when it has one table)."""
    import difflib

    from .config import load_config

    tables = load_config(path)
    names = [t.name for t in tables]
    if name is None:
        if len(tables) == 1:
            return tables[0]
        raise CliError(f"{path} configures {len(tables)} tables ({', '.join(names) or 'none'}): "
                       "choose one with --table NAME")
    for t in tables:
        if t.name == name:
            return t
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise CliError(f"{path} has no table {name!r}{hint}; configured tables: {', '.join(names) or 'none'}")


def _flag_value(value: str) -> Any:
    """A flag's value read as memwal.yaml would read it (`0` is a number, `256MB` a string), so a
    flag is checked by the same rule as the setting in the file, with the same message."""
    import yaml

    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, (int, float, str, bool)) else value


def _override(options: Any, section: str, key: str, flag: str, value: Any, keep: tuple[str, ...] = ()) -> Any:
    """`options` (a section of TableConfig) with `key` set from a flag, converted and checked
    by `from_mapping` exactly as the config file's `section.key` is (`keep`: the settings the
    check weighs it against, taken from `options`: the retention floor for a cleanup age)."""
    from dataclasses import replace

    from memwal_core.errors import OptionError
    from memwal_core.options import from_mapping

    try:
        parsed = from_mapping(type(options), {**{k: getattr(options, k) for k in keep}, key: value},
                              f"{flag}: {section}")
    except OptionError as e:
        raise (e if str(e).startswith(flag) else OptionError(f"{flag}: {e}")) from None
    return replace(options, **{key: getattr(parsed, key)})


def apply_flags(cfg, a) -> Any:
    """`cfg` with the command line's settings over its own (flags win; `--spark-conf` keys are
    merged over `spark.conf`)."""
    from dataclasses import replace

    merge, spark, gc, compaction = cfg.merge, cfg.spark, cfg.gc, cfg.compaction
    if getattr(a, "budget", None) is not None:
        merge = _override(merge, "merge", "budget_bytes", "--budget", _flag_value(a.budget))
    if getattr(a, "max_generations", None) is not None:
        merge = _override(merge, "merge", "max_generations", "--max-generations", _flag_value(a.max_generations))
    if getattr(a, "spark_master", None) is not None:
        spark = _override(spark, "spark", "master", "--spark-master", a.spark_master)
    if getattr(a, "spark_conf", None):
        spark = replace(spark, conf={**spark.conf, **_options(a.spark_conf, "--spark-conf")})
    # The CLI is one short process: it runs its own session (`spark.master`), never the table's
    # long-lived Connect server; `--spark-master sc://HOST:PORT` asks for a Connect server.
    spark = replace(spark, connect=None)
    if getattr(a, "base_versions_floor", None) is not None:  # first: the age below is checked against it
        gc = _override(gc, "gc", "cleanup_base_versions_floor_seconds", "--base-versions-floor",
                       _flag_value(a.base_versions_floor), keep=("cleanup_base_versions_older_than_seconds",))
    if getattr(a, "base_versions_older_than", None) is not None:
        gc = _override(gc, "gc", "cleanup_base_versions_older_than_seconds", "--base-versions-older-than",
                       _flag_value(a.base_versions_older_than), keep=("cleanup_base_versions_floor_seconds",))
    if getattr(a, "retrain_vector_indexes", False):
        compaction = replace(compaction, retrain_vector_indexes=True)
    lease = cfg.lease
    if getattr(a, "lease_wait", None) is not None:
        lease = _override(lease, "lease", "wait_seconds", "--lease-wait", _flag_value(a.lease_wait))
    return replace(cfg, merge=merge, spark=spark, gc=gc, compaction=compaction, lease=lease)


def target(a) -> tuple[Any, dict[str, str]]:
    """The table a command works on (`URI`, or `--config FILE [--table NAME]`: exactly one),
    with the flags applied, and its secret storage options resolved."""
    from dataclasses import replace

    from .config import single_table

    if a.table is not None and a.config is None:
        raise CliError("--table NAME needs --config FILE (the file that configures the table)")
    if a.config is None and a.uri is None:
        raise CliError("which table? give its URI, or --config FILE [--table NAME]")
    if a.config is not None and a.uri is not None:
        raise CliError(f"give either a URI ({a.uri}) or --config FILE [--table NAME], not both")
    plain, secrets = split_secrets(_options(a.storage_option))
    if a.config is None:
        cfg = single_table(a.uri, plain)
    else:
        cfg = _configured_table(a.config, a.table)
        cfg = replace(cfg, storage_options={**cfg.storage_options, **plain})
    return apply_flags(cfg, a), _secret_values(cfg, secrets)


# ---------------------------------------------------------------------------------------------
# progress


class ProgressLine:
    """Progress events of the jobs a pass runs, on stderr (stdout stays the --json report):
    one line updated in place on a terminal, one plain line per event otherwise."""

    def __init__(self, table: str, stream=None):
        self.table = table
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.open = False

    def __call__(self, event: Any) -> None:
        from memwal_core.jobs.progress import MergeProgress

        step = "merge: " if isinstance(event, MergeProgress) else ""
        line = f"[{self.table}] {step}{event}"
        if not self.tty:
            print(line, file=self.stream, flush=True)
            return
        width = shutil.get_terminal_size((120, 24)).columns - 1
        self.stream.write("\r\x1b[K" + line[:width])
        self.stream.flush()
        self.open = True

    def end(self) -> None:
        """Clear the line in place (the step's summary follows)."""
        if self.open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.open = False


_live: ProgressLine | None = None  # the line _say clears before it prints


# ---------------------------------------------------------------------------------------------
# maintain


@dataclass
class PassReport:
    """What one `memwal maintain` pass (or its dry run) did: each step's outcome, in the order
    the steps ran, and the checks that failed after them. Its `to_dict()` is the `--json` report."""

    table: str
    dry_run: bool = False
    outcomes: list[StepOutcome] = field(default_factory=list)
    failed_checks: list[str] = field(default_factory=list)  # `check NAME: why`

    @property
    def failed(self) -> list[str]:
        """One line per failure (`step: what`): non-empty makes the command exit 1."""
        lines = [f"{o.step}: {p}" for o in self.outcomes if o.failed for p in o.problems or [o.status.value]]
        return lines + self.failed_checks

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "table": self.table, "dry_run": self.dry_run,
                "steps": {o.step: o.to_dict() for o in self.outcomes}, "failed": self.failed}


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
    step failure, so `_SignalWatch` notices it after the step. One Spark session: the assets'
    Spark resource reuses the session `cmd_maintain` prestarted.

    `secrets`: the secret storage options (default: `cfg.secrets` read from the environment).
    Progress of the jobs (merge batches) goes to stderr while the pass runs."""
    from dagster import DagsterInstance

    from memwal_core.jobs import progress

    from .assets import TableKeys
    from .definitions import table_definitions
    from .resources import TableResource

    global _live
    td = table_definitions(cfg)
    secrets = _secret_values(cfg, {}) if secrets is None else secrets
    # The table resource with the secrets resolved here (a missing variable is one clear line).
    table = TableResource(uri=cfg.uri, storage_options={**cfg.storage_options, **secrets})
    resources = {**td.resources, TableKeys(cfg.name).table_resource: table}
    report = PassReport(cfg.uri)
    run_config = {"loggers": {"console": {"config": {"log_level": "DEBUG" if verbose else "CRITICAL"}}}}
    _live = ProgressLine(cfg.name)
    heard: list[StepOutcome] = []
    live = _live

    def listen(event: Any) -> None:
        if isinstance(event, StepOutcome):
            heard.append(event)
        else:
            live(event)

    with DagsterInstance.ephemeral() as instance, _SignalWatch() as watch, progress.listening(listen):
        try:
            _run_steps(cfg, steps, td, resources, table.location(), instance, watch, run_config, report, heard)
        finally:
            _live.end()
            _live = None
    return report


def _run_steps(cfg, steps: list[str], td, resources: dict, loc, instance, watch: _SignalWatch,
               run_config: dict, report: PassReport, heard: list[StepOutcome]) -> None:
    from dagster import materialize

    from memwal_core.spark import session as spark
    from memwal_core.state import region

    from .tags import partition_range

    listing = region.list_regions(loc.store)
    for name, reason in listing.skipped:
        _say(f"warning: skipping _mem_wal/{name}: {reason}")
    regions = sorted(listing.region_ids)
    instance.add_dynamic_partitions(td.partitions.name, regions)
    if "merge" in steps and regions and not cfg.spark.connect and _has_pending(loc):
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
        _say(f"[{cfg.name}] {step} ...")
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
        _say(f"[{table}] {step} skipped: {outcome.error}")
        return
    if outcome.status in (StepStatus.FAILED, StepStatus.REFUSED):
        _say(f"[{table}] {step} FAILED: {outcome.error}")
        return
    for line in outcome.problems:
        _say(f"[{table}] {step}: {line}")
    for note in outcome.notes:
        _say(f"[{table}] {step}: {note}")
    _say(f"[{table}] {step} done in {outcome.seconds:.1f} s" + (f": {outcome.summary}" if outcome.summary else ""))
    for check in checks:
        why = check.description or f"{check.severity.value} (the Dagster UI shows its details)"
        _say(f"[{table}] check {check.check_name} FAILED: {why}")
        report.failed_checks.append(f"check {check.check_name}: {why}")


def _has_pending(loc) -> bool:
    """Whether a merge has work (cheap: region manifests and the MemWAL index only)."""
    from memwal_core.jobs import merge

    try:
        return bool(merge.plan_merge(loc).batches)
    except Exception:  # noqa: BLE001 - the merge step itself reports what is wrong
        return False


DRY_RUN_PATHS = 20  # GC paths a dry run prints (--json lists them all)


def dry_run(cfg, steps: list[str] | tuple[str, ...] = STEPS, secrets: dict[str, str] | None = None) -> PassReport:
    """What each chosen step would do, with every setting the real pass uses. Touches nothing.

    The same runner as the real pass with `execute=False`: each step is planned with the
    table's options and the flags over them. GC's dry run is its own job with execution off:
    the base-version cleanup is planned by Lance and GC planned as if those versions were gone,
    so its list is what the real GC deletes on the table as it is now (steps before it that
    commit can change that)."""
    from memwal_core.state.store import open_store
    from memwal_core.steps import StepOptions, run_step

    secrets = _secret_values(cfg, {}) if secrets is None else secrets
    loc = open_store(cfg.uri, {**cfg.storage_options, **secrets})
    options = StepOptions.of(cfg)
    return PassReport(cfg.uri, True, [run_step(s, loc, options, execute=False) for s in STEPS if s in steps])


def _open_table(uri: str, options: dict[str, str]):
    """The table's location, once its base table opens: otherwise one line (not one per step)."""
    from memwal_core.state import region, table
    from memwal_core.state.store import open_store

    loc = open_store(uri, options)
    region.list_regions(loc.store)  # first: memwal's store names S3 errors (403, endpoint) clearly
    try:
        table.open_dataset(loc)
    except Exception as e:  # noqa: BLE001 - Lance's errors carry Rust source locations
        raise CliError(_one_line(str(e))) from None
    try:  # a feature flag or region transform memwal does not know: refused before any step or JVM
        table.read_memwal_state(loc)
    except table.UnknownFeature as e:
        raise CliError(str(e)) from None
    except table.TableError:
        pass  # each step reports the others (not initialized, ...) as it always has
    return loc


def _one_line(msg: str) -> str:
    """The first line of an error, without the Rust source locations Lance appends."""
    first = (msg.strip().splitlines() or [""])[0]
    return re.sub(r",\s*/\S+\.rs:\d+:\d+", "", first).strip()


def cmd_maintain(a) -> int:
    steps = [s.strip() for s in (a.only.split(",") if a.only else STEPS)]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise CliError(f"--only: unknown step(s) {unknown}; choose from {','.join(STEPS)}")
    # Checked first: a bad option is one line, before any JVM starts or any step runs.
    cfg, secrets = target(a)
    loc = _open_table(cfg.uri, {**cfg.storage_options, **secrets})
    if "merge" in steps and not a.dry_run:
        # Before Dagster's imports and set-up (~4 s), so the JVM start and the first job's worker
        # start-up (~11 s cold on 2 cores) overlap them.
        from memwal_core.spark import archive as jvm_archive
        from memwal_core.spark import session as spark

        if _has_pending(loc):
            if not cfg.spark.master.startswith("sc://") and jvm_archive.java_binary() is None:
                # Otherwise the JVM launch fails twice (prestart, then the merge), trace each time.
                raise CliError("no java found (JAVA_HOME or PATH): the merge runs on Spark, which needs Java 17")
            spark.prestart(cfg.spark.master, cfg.spark.conf)  # with its conf: the merge reuses this session
    if a.dry_run:
        report = dry_run(cfg, steps, secrets)
        print(json.dumps(report.to_dict(), indent=2, default=str) if a.json else _format_plan(report))
    else:
        report = run_pass(cfg, steps, verbose=a.verbose, secrets=secrets)
        if a.json:
            print(json.dumps(report.to_dict(), indent=2, default=str))
    for line in report.failed:
        _say(f"error: {line}")
    return 1 if report.failed else 0


def _format_plan(report: PassReport) -> str:
    """A dry run for a person: one section per chosen step, from its outcome."""
    chosen = [o.step for o in report.outcomes]
    lines = [f"table {report.table} (dry run: {', '.join(chosen)})"]
    for o in report.outcomes:
        if o.status is StepStatus.REFUSED:
            lines.append(f"{o.step}: refused: {o.error}")
        elif o.status is StepStatus.FAILED:
            lines.append(f"{o.step}: cannot be planned: {o.error}")
        elif o.step == "gc":
            lines += _format_gc(o, earlier=[s for s in chosen if s != "gc"])
        else:
            lines.append(f"{o.step}: {o.summary}")
            if o.step == "merge":
                lines += [f"  batch of {len(b.generations)} generations, {b.bytes} bytes -> progress {b.progress}"
                          for b in o.plan.batches]
            lines += [f"  {line}" for line in o.problems + o.notes]
    return "\n".join(lines)


_KIND_NAMES = {"generation": "generations", "wal": "WAL entries", "manifest": "region manifest versions",
               "orphan": "orphan directories", "base_version": "base-table versions"}


def _format_gc(o: StepOutcome, earlier: list[str]) -> list[str]:
    """GC's part of a dry run: totals per kind, the first paths, base versions, what is kept."""
    m, plan = o.metrics, o.plan
    would = {k: m[f"would_delete/{k}/items"] for k in _KIND_NAMES}
    lines = ["gc: would delete " + ", ".join(f"{would[k]} {name}" for k, name in _KIND_NAMES.items())
             + f": {m['objects'] + m['would_delete/base_version/objects']} objects, "
               f"{m['bytes'] + m['would_delete/base_version/bytes']} bytes"]
    base = plan.base_cleanup
    if base:
        files = ", ".join(f"{n} {k}" for k, n in base.files.items())
        lines.append(f"  base table: versions {_ranges(base.versions) or 'none'} ({files or 'no files'})")
    lines += [f"  {note}" for note in o.notes]
    items = plan.items
    for item in items[:DRY_RUN_PATHS]:
        lines.append(f"  {item.kind:<10} {item.path}  ({len(item.keys)} objects, {item.bytes} bytes)")
    if len(items) > DRY_RUN_PATHS:
        lines.append(f"  ... and {len(items) - DRY_RUN_PATHS} more (--json lists every one)")
    lines.append(f"  base versions left after it: {len(plan.retained_versions)}")
    lines += [f"  keeps {h.describe()}" for h in plan.holds]
    lines += [f"  {line}" for line in o.problems]
    if earlier:
        lines.append(f"  (planned on the table as it is now: {', '.join(earlier)} run first and what they "
                     "commit can change what GC collects)")
    return lines


def _ranges(ns: list[int]) -> str:
    """`1-4, 6` for [1, 2, 3, 4, 6]."""
    out, run = [], []
    for n in sorted(ns):
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [n]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------
# status


def cmd_status(a) -> int:
    cfg, secrets = target(a)
    return print_status(cfg.uri, {**cfg.storage_options, **secrets}, as_json=a.json)


def print_status(uri: str, storage_options: dict[str, str] | None = None, *, as_json: bool = False) -> int:
    """`memwal status` for a table already resolved (the demos call it after their pass):
    per-region lag, index gaps, what GC keeps; 1 when a region is in error or stuck."""
    from memwal_core.jobs import gc
    from memwal_core.observe import blockers, status
    from memwal_core.state.store import open_store

    from .partitions import RegionLabels

    loc = open_store(uri, storage_options or {})
    st = status.table_status(loc)
    stuck = _stuck(st)
    try:
        holds = gc.plan_gc(loc, gc.GcOptions(collect_leaked_files=False)).holds  # holds only: no file scan
    except Exception as e:  # noqa: BLE001 - status still shows the lag
        holds = []
        _say(f"warning: GC plan failed: {e}")
    try:
        blocked = blockers.merge_blockers(loc)
    except Exception as e:  # noqa: BLE001 - status still shows the lag
        blocked = []
        _say(f"warning: merge blockers not checked: {e}")
    bad = 1 if (st.region_errors or stuck or blocked) else 0
    labels = RegionLabels.of(loc)  # each region's value (`bucket=2`), from the MemWAL index snapshot
    if as_json:
        print(json.dumps({**st.to_dict(), "region_values": {r.region_id: labels.label(r.region_id) for r in st.regions},
                          "stuck": [s.__dict__ for s in stuck],
                          "merge_blockers": [b.to_dict() for b in blocked],
                          "gc_holds": [h.__dict__ | {"text": h.describe()} for h in holds]}, indent=2, default=str))
        return bad
    print(f"table {st.table} (version {st.table_version}): {len(st.regions)} regions, "
          f"{st.pending_generations} pending generations")
    # `lag`: age of the region's oldest unmerged generation (what merge_lag and the SLO measure).
    print(f"{'region':36}  {'value':16}  {'manifest':>8}  {'epoch':>5}  {'merged':>6}  {'pending':>7}  {'rows':>8}  "
          f"{'lag':>6}")
    for r in st.regions:
        value = _cell(labels.label(r.region_id), 16)
        if r.error:
            print(f"{r.region_id:36}  error: {r.error} (region value: {labels.label(r.region_id)})")
            continue
        print(f"{r.region_id:36}  {value:16}  {r.manifest_version:>8}  {r.writer_epoch:>5}  {r.merged_generation:>6}  "
              f"{len(r.pending_generations):>7}  {r.pending_rows:>8}  {_age(r.oldest_pending_age_s):>6}")
    for i in st.indexes:
        print(f"index {i.name}: max gap {i.max_gap} generations{' (gates GC)' if i.gating else ''}")
    for h in holds:
        print(f"GC keeps {h.describe()}")
    for s in stuck:
        print(f"STUCK {s.describe(labels.label(s.region_id))}")
    for b in blocked:
        print(f"MERGE BLOCKED ({b.kind}): {b.message}")
    return bad


# ---------------------------------------------------------------------------------------------
# regions discard


def cmd_regions_discard(a) -> int:
    """Discard the stale generations of regions whose data predates the MemWAL initialization
    (`memwal_core/state/lifecycle.py`): their rows are never merged; GC then collects them."""
    from memwal_core.state import layout, lease, lifecycle
    from memwal_core.state.store import open_store

    targets = list(a.targets)
    a.uri = None if a.config is not None or not targets else targets.pop(0)
    bad = [r for r in targets if not layout.is_region_id(r)]
    if bad:
        raise CliError(f"not a region id (UUID): {', '.join(bad)}")
    if bool(targets) == a.all:
        raise CliError("name the regions to discard (REGION ...) or give --all (every stale region), not both")
    cfg, secrets = target(a)
    loc = open_store(cfg.uri, {**cfg.storage_options, **secrets})
    try:  # holds the table's lease: waits up to lease.wait_seconds (--lease-wait) for a running maintainer
        out = lifecycle.discard(loc, None if a.all else targets, dry_run=a.dry_run, lease=cfg.lease)
    except lease.LeaseHeld as e:
        raise CliError(f"nothing discarded: table {loc.lance_uri} is held by {e.record.describe()}; run again "
                       "when that maintainer is done (or wait longer: --lease-wait SECONDS)") from None
    if a.json:
        print(json.dumps({"table": loc.lance_uri, "dry_run": out.dry_run, "discarded": out.discarded,
                          "refused": out.refused, "table_version": out.table_version}, indent=2))
    else:
        verb = "would discard" if a.dry_run else "discarded"
        for rid, g in sorted(out.discarded.items()):
            print(f"{verb} region {rid}: generations through {g} (never merged; GC collects them)")
        if not out.discarded and not out.refused:
            print("no stale region to discard")
        if out.discarded and not a.dry_run:
            print(f"table version {out.table_version}; run `memwal maintain {cfg.uri} --only gc` to collect now")
    for rid, why in sorted(out.refused.items()):
        _say(f"error: {why}" if why.startswith("region ") else f"error: region {rid}: {why}")
    return 1 if out.refused else 0


def _cell(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _age(seconds: float | None) -> str:
    """A lag as one short figure: 42s, 12m, 3.5h, 2.1d ("-": nothing pending)."""
    if seconds is None:
        return "-"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f}{unit}" if seconds < 10 * n else f"{seconds / n:.0f}{unit}"
    return f"{seconds:.0f}s"


def _stuck(st) -> list:
    """Stuck regions as recorded by failed merge runs in the Dagster instance of `DAGSTER_HOME`
    (the daemon's); none without one."""
    if not os.environ.get("DAGSTER_HOME"):
        return []
    from dagster import DagsterInstance

    from .failures import recent_failures, stuck_regions

    merged = {r.region_id: r.merged_generation for r in st.regions}
    try:
        with DagsterInstance.get() as instance:
            return stuck_regions(recent_failures(instance, regions=merged), merged)
    except Exception as e:  # noqa: BLE001 - no usable instance: say so, show the table anyway
        _say(f"warning: cannot read merge failures from DAGSTER_HOME: {e}")
        return []


# ---------------------------------------------------------------------------------------------
# demo


DEMO_MARKER = ".memwal-demo"
# What a table written by an older `memwal demo` (before the marker) holds, and nothing else.
_DEMO_ENTRIES = {"_versions", "_mem_wal", "_memwal", "data", "_indices", "_transactions", "_deletions"}


def _clear_demo_path(path: str, *, force: bool) -> None:
    """Make room for the demo at `path`, deleting only what a previous demo wrote there.

    A missing or empty directory is used as is; a directory with the demo's marker (or an older
    demo table: Lance's directories only, the demo's schema) is replaced; anything else is
    refused unless --force.
    """
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        entries = set(os.listdir(path))
        if not entries:
            return
        if DEMO_MARKER in entries or force or _looks_like_old_demo(path, entries):
            _say(f"removing the previous demo table at {path}")
            shutil.rmtree(path)
            return
    elif force:
        _say(f"removing {path}")
        os.remove(path)
        return
    raise CliError(f"{path} exists and is not a table `memwal demo` wrote: not touching it "
                   "(choose another --path, or --force to replace it)")


def _looks_like_old_demo(path: str, entries: set[str]) -> bool:
    if not entries <= _DEMO_ENTRIES or "_mem_wal" not in entries:
        return False
    try:
        import lance

        from memwal_core.tools import demo

        return lance.dataset(path).schema.remove_metadata() == demo.SCHEMA.remove_metadata()
    except Exception:  # noqa: BLE001 - not a readable demo table: not ours to delete
        return False


def cmd_demo(a) -> int:
    from memwal_core.observe import reader
    from memwal_core.options import GcOptions, check_spark_master
    from memwal_core.state.store import open_store
    from memwal_core.tools import demo

    from .config import single_table

    check_spark_master(a.spark_master, "--spark-master")
    path = os.path.abspath(a.path)
    _clear_demo_path(path, force=a.force)
    loc = open_store(path)
    from memwal_core.spark import session as spark

    spark.prestart(a.spark_master)  # the JVM starts while the writers write
    _say(f"writing a demo table at {path}: {a.regions} bucket regions, ~{a.rows} operations per round")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, DEMO_MARKER), "w") as f:  # first: an interrupted demo is still ours
        f.write("written by `memwal demo`; `memwal demo --path` may replace this directory\n")
    demo.create_table(loc, sharding="bucket", num_buckets=a.regions, base_rows=a.rows // 2, btree_index=True)
    w = demo.Workload(loc, seed=42, key_space=max(10, a.rows), max_memtable_rows=max(100, a.rows // a.regions))
    for _ in range(3):
        w.write_round(a.rows, overwrite=0.3, delete=0.03)
    # The demo cleans up base-table versions at the retention floor (a day), as a deployment
    # would: GC then says which generations the retained versions still hold.
    cfg = single_table(path, spark_master=a.spark_master, name="demo",
                       base_versions_older_than=GcOptions().cleanup_base_versions_floor_seconds)
    report = run_pass(cfg, list(STEPS), verbose=a.verbose)
    got = {r["id"]: r for r in reader.lsm_table(loc).to_pylist()}
    ok = got == w.expected()
    print_status(path)
    print(f"LSM read equals what the writers wrote: {'yes' if ok else 'NO'} ({len(got)} rows)")
    for line in report.failed:
        _say(f"error: {line}")
    return 0 if ok and not report.failed else 1


# ---------------------------------------------------------------------------------------------
# spark-server


def cmd_spark_server(a) -> int:
    from memwal_core.spark import connect as spark_connect

    remote = f"sc://127.0.0.1:{a.port}"
    if a.action == "start":
        started = spark_connect.ensure_server(remote, master=a.master)
        print(f"Spark Connect server {'started' if started else 'already running'} at {remote}")
    elif a.action == "stop":
        spark_connect.stop_server(remote)
        print(f"Spark Connect server at {remote} stopped")
    else:
        up = spark_connect.listening("127.0.0.1", a.port)
        print(f"Spark Connect server at {remote}: {'running' if up else 'not running'}")
        return 0 if up else 1
    return 0


def cmd_spark_archive(a) -> int:
    from memwal_core.spark import archive as jvm_archive

    path = jvm_archive.archive_path()
    if path is None:
        raise CliError("no java found (JAVA_HOME or PATH): Spark needs Java 17")
    if a.action == "status":
        there = path.is_file()
        used = there and bool(jvm_archive.java_options())
        print(f"JVM class archive {path}: " + (f"{path.stat().st_size / 1e6:.0f} MB, "
              f"{'used' if used else 'not used (MEMWAL_SPARK_CDS=0)'}" if there else "not built"))
        return 0 if there else 1
    if a.action == "remove":
        if path.is_file():
            path.unlink()
        print(f"JVM class archive {path}: removed")
        return 0
    from memwal_core.tools.archive_build import build

    path, took = build(force=a.force)
    print(f"JVM class archive {path}: " + (f"built in {took:.0f} s" if took else "already built (--force rebuilds)"))
    return 0


def cmd_spark_env(a) -> int:
    from memwal_core.spark import env as spark_env

    path, skipped = spark_env.pack_environment(a.output, exclude=a.exclude, force=a.force)
    alias = a.alias
    for f in skipped:
        _say(f"left out (editable install; memwal_core is shipped with each job): {f}")
    print(f"packed {sys.prefix} into {path} ({path.stat().st_size / 1e6:.0f} MB). Spark settings "
          f"(memwal.yaml `spark.conf`, or --conf):\n"
          f"  spark.archives: {path}#{alias}\n"
          f"  spark.pyspark.python: ./{alias}/bin/python   # memwal's default when spark.archives has #{alias}\n"
          f"The nodes need Python {sys.version.split()[0]} installed at {sys.base_prefix} "
          "(the archive holds the packages, not the standard library).")
    return 0


# ---------------------------------------------------------------------------------------------


def _table_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", nargs="?", help="the table (or --config FILE --table NAME)")
    p.add_argument("--config", metavar="FILE", help="a memwal.yaml: work on one of its tables, with its settings")
    p.add_argument("--table", metavar="NAME", help="the table's name in --config (optional if it has one)")
    p.add_argument("--storage-option", action="append", metavar="K=V", default=[],
                   help="over the table's storage_options (prefer the environment for secrets: `ps` shows flags)")


def main(argv: list[str] | None = None) -> int:
    """`memwal`: parse the command line and run the command (one clear line per error, the exit
    status of the command). Long because it is the argument parser's declaration."""
    p = argparse.ArgumentParser(prog="memwal", description="Maintenance plane for MemWAL Lance tables.")
    p.add_argument("--verbose", "-v", action="store_true", help="full tracebacks and Dagster logs")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="write a demo table with pylance ShardWriters and maintain it once")
    d.add_argument("--path", default="demo_data/demo_table")
    d.add_argument("--regions", type=int, default=4)
    d.add_argument("--rows", type=int, default=400)
    d.add_argument("--spark-master", default="local[*]")
    d.add_argument("--force", action="store_true",
                   help="replace --path even if it is not a previous demo table")
    d.set_defaults(fn=cmd_demo)

    m = sub.add_parser("maintain", help="one full maintenance pass over a MemWAL table",
                       description="One maintenance pass over a table: its URI, or a table of a memwal.yaml "
                                   "(--config FILE --table NAME, its settings; the flags below override "
                                   "them). Progress goes to stderr; --json prints the report on stdout.")
    _table_args(m)
    m.add_argument("--budget", metavar="SIZE", help="merge.budget_bytes: bytes of generations per merge batch "
                                                    "(e.g. 256MB)")
    m.add_argument("--max-generations", metavar="N", help="merge.max_generations: generations per merge batch")
    m.add_argument("--spark-master", metavar="MASTER",
                   help="spark.master (default: the table's, else local[*]); the CLI runs its own session, "
                        "not the table's spark.connect server (sc://HOST:PORT here asks for one)")
    m.add_argument("--spark-conf", action="append", metavar="K=V", default=[],
                   help="a Spark setting, merged over the table's spark.conf (repeatable)")
    m.add_argument("--only", help=f"comma-separated subset of {','.join(STEPS)}")
    m.add_argument("--base-versions-older-than", metavar="DURATION",  # checked by GcOptions: one line
                   help="let GC first clean up base-table versions older than this (Lance's "
                        "cleanup_old_versions; seconds or 7d, 12h, 30m, 90s); generations a retained "
                        "version needs are always kept; refused below the retention floor (a day)")
    m.add_argument("--base-versions-floor", metavar="DURATION",
                   help="gc.cleanup_base_versions_floor_seconds: base-table versions younger than this are "
                        "never cleaned up (default a day); lower it only where no commit can be in flight "
                        "that long")
    m.add_argument("--retrain-vector-indexes", action="store_true",
                   help="compact step: retrain vector indexes that drifted past the threshold (never one "
                        "MemTables maintain: the spec requires a stable codebook)")
    m.add_argument("--lease-wait", metavar="SECONDS",
                   help="lease.wait_seconds: how long a step waits for the table's lease while another "
                        "maintainer holds it, before it is skipped (\"skipped: lease held by ... until ...\")")
    m.add_argument("--dry-run", action="store_true",
                   help="print what the chosen steps would do, with the same settings, and change nothing: "
                        "GC lists what it would delete (base-table versions its cleanup removes included)")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_maintain)

    s = sub.add_parser("status", help="per-region lag of a MemWAL table")
    _table_args(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    r = sub.add_parser("regions", help="act on regions of a MemWAL table")
    rsub = r.add_subparsers(dest="regions_cmd", required=True)
    rd = rsub.add_parser("discard", help="never merge the generations of regions written before the MemWAL "
                                         "initialization (after an overwrite); GC then collects them",
                         description="memwal regions discard URI REGION... | --all  (or --config FILE [--table "
                                     "NAME] REGION...). Records the regions' stale generations as handled in one "
                                     "commit without rows: they never reach the table, later generations merge. "
                                     "Only regions `memwal status` reports as stale are accepted.")
    rd.add_argument("targets", nargs="*", metavar="URI|REGION", help="the table's URI (unless --config), then "
                                                                    "region ids")
    rd.add_argument("--config", metavar="FILE", help="a memwal.yaml: work on one of its tables")
    rd.add_argument("--table", metavar="NAME", help="the table's name in --config (optional if it has one)")
    rd.add_argument("--storage-option", action="append", metavar="K=V", default=[],
                    help="over the table's storage_options")
    rd.add_argument("--all", action="store_true", help="every stale region of the table")
    rd.add_argument("--dry-run", action="store_true", help="say what would be discarded, change nothing")
    rd.add_argument("--lease-wait", metavar="SECONDS",
                    help="lease.wait_seconds: how long to wait for the table's lease while a maintainer holds "
                         "it (then nothing is discarded, exit 1)")
    rd.add_argument("--json", action="store_true")
    rd.set_defaults(fn=cmd_regions_discard)

    c = sub.add_parser("spark-server", help="start/stop the long-lived local Spark Connect server "
                                            "(tables configured with spark master sc://127.0.0.1:PORT)")
    c.add_argument("action", choices=["start", "stop", "status"])
    c.add_argument("--port", type=int, default=15002)
    c.add_argument("--master", default="local[*]")
    c.set_defaults(fn=cmd_spark_server)

    j = sub.add_parser("spark-archive", help="build/show/remove the class-data-sharing archive that starts "
                                             "local Spark driver JVMs ~3 s sooner (make builds it)")
    j.add_argument("action", nargs="?", default="build", choices=["build", "status", "remove"])
    j.add_argument("--force", action="store_true", help="rebuild even if present")
    j.set_defaults(fn=cmd_spark_archive)

    e = sub.add_parser("spark-env", help="pack this virtualenv for spark.archives, so remote executors get "
                                         "pylance and memwal's other dependencies")
    e.add_argument("output", nargs="?", default="memwal-env.tar.gz", help="a .tar.gz or .tgz")
    e.add_argument("--alias", default="memwal_env", help="directory the executors unpack it to")
    e.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="leave out paths inside the env (fnmatch, * spans /; e.g. "
                        "'lib/python3.11/site-packages/dagster*')")
    e.add_argument("--force", action="store_true", help="overwrite OUTPUT")
    e.set_defaults(fn=cmd_spark_env)

    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not a.verbose:
        # pylance logs a harmless "ERROR lance::index Index __lance_mem_wal has no fields" on
        # every merge; keep real errors, drop that one source of noise.
        os.environ.setdefault("LANCE_LOG", "error,lance::index=off")
    try:
        return a.fn(a)
    except KeyboardInterrupt:
        _say(f"error: {Interrupted(signal.SIGINT, None)}")
        _stop_spark()
        return 128 + signal.SIGINT
    except Interrupted as e:
        if a.verbose:
            raise
        _say(f"error: {e}")
        _stop_spark()
        return 128 + e.signum
    except Exception as e:  # noqa: BLE001 - one clear line unless --verbose
        if a.verbose:
            raise
        _say(f"error: {_one_line(str(e)) or type(e).__name__}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
