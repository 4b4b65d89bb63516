"""Small merges inside the sensor's tick: flush to merged without a run launch.

A merge run spends seconds that are not the merge: the queue's dequeue pass, a new process
that imports Dagster and memwal and loads the code location, resource set-up, a Spark Connect
session (docs/benchmarks.md §6 measures each: together several times the ~1 s merge). So when
a tick requests a merge, the table's Spark is a Connect server that is already listening, and
the requested regions have at most `sensor.tick_merge_max_generations` generations pending,
the tick runs the merge step itself: `run_step("merge")`, the same plan, Spark job, commits
and table lease as a run, on a Connect session this process (the code server) keeps between
ticks. Each region it merged is reported as a `base_table` materialization of its partition
(`SensorResult(asset_events=...)`, metadata as a run records it, plus `merged_by`).

A tick whose merge outlives Dagster's sensor timeout (60 s) is failed by the daemon while its
thread goes on merging; later ticks then neither merge the table nor request a run for it
until that merge ends (its commits move the progress, which the next tick reads).

A tick whose table's lease another maintainer holds (a maintenance run after the last merge,
`memwal maintain`) waits for it up to `TICK_LEASE_WAIT_SECONDS` (at most `lease.wait_seconds`)
and then merges on its warm session: a maintenance run holds the lease for seconds, and a merge
run requested instead would queue behind it and then pay its own process start and a cold
session (docs/benchmarks.md §6).

Anything the tick does not finish cleanly goes to a run: when the step fails, is refused, is
kept off by another maintainer's lease past that wait, or leaves a region unmerged, the tick requests the merge run it decided on anyway (same run key, the
attempt counted): the run re-plans from whatever progress the tick committed and reports
failures as every run does (failure history, walls, stuck regions, failed partitions). A
tick never starts a JVM: the first merge of a deployment is a run, which starts the server.

Crash safety is the merge step's: progress moves only with the commit that merged the
generations. A tick cut off after a commit and before Dagster stored its events loses those
materialization records, not data: the next tick reads the progress and requests nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlparse

from memwal_core.spark import connect as spark_connect
from memwal_core.state.store import TableLocation
from memwal_core.steps import StepOptions, StepOutcome, StepStatus, run_step

from ..config import TableConfig
from . import decide

MERGED_BY = "sensor tick"
# How long a tick waits for the table's lease: a third of Dagster's sensor timeout (60 s), so the
# wait and a small merge stay well within it.
TICK_LEASE_WAIT_SECONDS = 20.0

_SESSIONS: dict[tuple, Any] = {}  # (table, spark settings) -> the resource holding a Connect session
_RUNNING: set[str] = set()         # tables with a tick merge under way in this process
_LOCK = threading.Lock()


@dataclass(frozen=True)
class TickMerge:
    """What the tick's own merge did: `outcome` None when it did not try (`reason` says why)."""

    regions: tuple[str, ...]
    reason: str
    outcome: StepOutcome | None = None
    attach_s: float = 0.0
    busy: bool = False  # an earlier tick's merge of the table is still running here: no run either

    @property
    def clean(self) -> bool:
        """Every requested region merged what it had: no run is needed."""
        o = self.outcome
        return o is not None and o.status in (StepStatus.OK, StepStatus.NOTHING_TO_DO) and not o.failures

    @property
    def merged(self) -> list[str]:
        """Regions whose progress the tick moved (reported even when a run follows)."""
        o = self.outcome
        if o is None or o.result is None:
            return []
        failing = {f.region_id for f in o.failures}
        return sorted(rid for rid, r in o.result.regions.items() if r.generations_merged and rid not in failing)


def connect_url(cfg: TableConfig) -> str | None:
    """The table's Spark Connect server (None: its runs start their own JVM)."""
    if cfg.spark.connect:
        return cfg.spark.connect
    return cfg.spark.master if cfg.spark.master.startswith("sc://") else None


def why_not(cfg: TableConfig, request: decide.MergeRequest) -> str | None:
    """Why this request goes to a run without trying in the tick (None: the tick tries)."""
    limit = cfg.sensor.tick_merge_max_generations
    if limit <= 0:
        return "merging in the tick is off (sensor.tick_merge_max_generations = 0)"
    url = connect_url(cfg)
    if url is None:
        return "the table's Spark is not a Connect server (a tick never starts a JVM)"
    u = urlparse(url)
    if not spark_connect.listening(u.hostname or "127.0.0.1", u.port or 15002):
        return f"no Spark Connect server listening at {url} yet (the merge run starts it)"
    pending = sum(max(0, m.top - m.merged) for m in request.merges)
    if pending > limit:
        return f"{pending} generations pending, more than sensor.tick_merge_max_generations = {limit}"
    return None


def session(cfg: TableConfig) -> Any:
    """This process's Connect session for the table, made on first use (with the table's
    session settings, checked against the server as a run's are) and kept between ticks."""
    from ..resources import spark_resource

    resource = spark_resource(cfg)
    key = (cfg.name, tuple(sorted((k, str(v)) for k, v in resource.spark_config.items())))
    with _LOCK:
        held = _SESSIONS.get(key)
        if held is None:
            held = _SESSIONS[key] = resource
    return held.spark_session


def forget(cfg: TableConfig) -> None:
    """Drop the table's session (after a failure: the server may have restarted)."""
    with _LOCK:
        for key in [k for k in _SESSIONS if k[0] == cfg.name]:
            held = _SESSIONS.pop(key)
            try:
                if held._spark_session is not None:
                    held._spark_session.stop()
            except Exception:  # noqa: BLE001 - a dead session: nothing to release
                pass


def merge_in_tick(cfg: TableConfig, loc: TableLocation, request: decide.MergeRequest, holder: str,
                  log=None) -> TickMerge:
    """Run the merge step for the request's regions in this tick, when `why_not` allows it."""
    regions = tuple(request.regions)
    reason = why_not(cfg, request)
    if reason is not None:
        return TickMerge(regions, reason)
    with _LOCK:
        if cfg.name in _RUNNING:
            return TickMerge(regions, "the merge an earlier tick started is still running in this process (that "
                                      "tick outlived Dagster's sensor timeout); its commits move the progress",
                             busy=True)
        _RUNNING.add(cfg.name)
    try:
        return _merge(cfg, loc, regions, holder, log)
    finally:
        with _LOCK:
            _RUNNING.discard(cfg.name)


def _merge(cfg: TableConfig, loc: TableLocation, regions: tuple[str, ...], holder: str, log) -> TickMerge:
    attach = [0.0]

    def provider() -> Any:
        t0 = time.monotonic()
        s = session(cfg)
        attach[0] = time.monotonic() - t0
        return s

    options = StepOptions.of(cfg)
    options = replace(options, lease=replace(options.lease, wait_seconds=min(
        float(options.lease.wait_seconds), TICK_LEASE_WAIT_SECONDS)))
    progress = (lambda line: log.info(line)) if log is not None else None
    outcome = run_step("merge", loc, options, provider, regions=list(regions), run_id=holder, progress=progress)
    if outcome.status is StepStatus.FAILED:
        forget(cfg)
    tm = TickMerge(regions, "merged in the tick" if outcome.status is not StepStatus.SKIPPED else
                   f"skipped: {outcome.error}", outcome, attach[0])
    if not tm.clean:
        tm = replace(tm, reason=f"{outcome}; a merge run follows")
    return tm
