"""What one sensor tick does, decided from what it saw: a pure function, no I/O, no Dagster.

`decide(observation, cursor, options)` judges every region on its own (`judge`), then gathers
the verdicts into one tick's decision: the partitions to add and delete, **one** merge run for
every region requested (its partition, or the range from the first to the last of them), the
maintenance request, what to remember, what to report and log.

**Nothing waits forever.** Every region that is listed, readable and has generations above its
merged progress gets exactly one of these verdicts, each tick, whatever the order of regions,
partitions or runs:
- `REQUEST`: it is in this tick's merge run;
- `IN_FLIGHT`: a queued, starting or running merge run covers its partition (that run plans
  when it starts, or the region is requested after it ends);
- `BACKOFF`: it was requested before and its progress has not moved; it is requested again at
  `due` (the backoff doubles from the sensor interval, capped: a finite time);
- `STUCK`: `merge_attempts` runs made no progress, or the merger recorded a permanent refusal
  (a wall) above its progress after the first run (retrying cannot pass it, so no JVM is
  started for it again); no more automatic runs, and the region is reported (an error and an
  observation when it becomes stuck, a warning every tick after, `liveness.stuck_regions` for
  the checks) until its progress moves.
A region that cannot be read is `UNREADABLE` (an error naming it, every tick). The property
is checked on arbitrary observations in tests/test_sensor_decide.py.

`recheck` and the `needs_*` predicates are the same rules seen from `observe`: which regions to
re-probe from their hint, and when merge progress or catch-up must be read at all (a tick on
an unchanged, fully merged table reads neither).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import Enum

from memwal_core.options import SensorOptions
from memwal_pipeline.liveness import RegionState, RetryPolicy, observe_progress, verify_this_tick

from .observation import Cursor, Observation, Probe, RunCover, Wall

VERIFY_EVERY = 16       # ticks per full rotation of hint re-checks
DOWNTIME_INTERVALS = 3  # no tick for this many intervals: re-check every region


class Verdict(str, Enum):
    IDLE = "idle"              # nothing above merged progress
    REQUEST = "request"
    IN_FLIGHT = "in_flight"
    BACKOFF = "backoff"
    STUCK = "stuck"
    RETIRE = "retire"          # sealed, merged to its end and caught up: its partition goes
    UNREADABLE = "unreadable"  # its manifest could not be read this tick


WAITING = frozenset({Verdict.REQUEST, Verdict.IN_FLIGHT, Verdict.BACKOFF, Verdict.STUCK})


@dataclass(frozen=True)
class RegionDecision:
    verdict: Verdict
    state: RegionState | None  # what to remember (None: never read)
    due: float | None = None   # BACKOFF: when the next request is made
    became_stuck: bool = False


@dataclass(frozen=True)
class Merge:
    region_id: str
    top: int       # newest flushed generation
    merged: int    # progress when requested
    attempt: int

    @property
    def key(self) -> str:
        return f"{self.region_id}:{self.top}@{self.merged}#{self.attempt}"


@dataclass(frozen=True)
class MergeRequest:
    """One run for every region that needs a merge this tick, in partition order.

    One region: its partition. Several: the range of partitions from the first to the last of
    them (a range may include regions with nothing to merge, which cost a plan and nothing
    else), so a busy table is merged in one Spark job instead of one queued run per region.
    The run key names each region's `region:generation@merged#attempt` (digested past a few)
    and the state epoch: a retry is a new key, so Dagster's run-key dedupe never swallows it.
    """

    merges: tuple[Merge, ...]
    epoch: str

    @property
    def regions(self) -> list[str]:
        return [m.region_id for m in self.merges]

    @property
    def attempt(self) -> int:
        return max(m.attempt for m in self.merges)

    @property
    def run_key(self) -> str:
        pairs = [m.key for m in self.merges]
        key = ",".join(pairs) if len(pairs) <= 4 else (
            f"{pairs[0]},...({len(pairs)} regions) {hashlib.sha1(','.join(pairs).encode()).hexdigest()[:16]}")
        return f"{key}/{self.epoch}"


@dataclass(frozen=True)
class Notice:
    level: str  # "info" | "warning" | "error"
    message: str


@dataclass(frozen=True)
class Decision:
    regions: Mapping[str, RegionDecision]  # every active region's verdict
    memory: Mapping[str, RegionState]      # what to remember: every listed region seen so far
    add_partitions: tuple[str, ...]
    delete_partitions: tuple[str, ...]
    merge: MergeRequest | None
    maintenance: int | None                # request maintenance after this materialization
    cursor: Cursor                         # digest still the previous one: emit stores the memory
    observed: tuple[str, ...]              # changed regions, reported as observations
    notices: tuple[Notice, ...]
    record_idle: bool = False              # record that the idle table's base table is current

    @property
    def became_stuck(self) -> list[str]:
        return [rid for rid, d in self.regions.items() if d.became_stuck]

    def verdicts(self, *which: Verdict) -> list[str]:
        return [rid for rid, d in self.regions.items() if d.verdict in which]


# ------------------------------------------------------------------------------------------
# What observe reads


def downtime(last_tick: float | None, now: float, interval_s: float) -> bool:
    """No tick for `DOWNTIME_INTERVALS` intervals (or never): remembered versions may have been
    collected by GC meanwhile."""
    return last_tick is None or now - last_tick > DOWNTIME_INTERVALS * interval_s


def recheck(active: Iterable[str], last_tick: float | None, ticks: int, now: float,
            interval_s: float) -> frozenset[str]:
    """Regions to probe from their version hint rather than from their remembered version + 1:
    all of them after downtime, else a rotating 1/`VERIFY_EVERY` slice, so a burst of commits
    GC collected between two ticks hides a region for at most `VERIFY_EVERY` ticks."""
    if downtime(last_tick, now, interval_s):
        return frozenset(active)
    return frozenset(rid for rid in active if verify_this_tick(rid, ticks, VERIFY_EVERY))


def needs_progress(memory: Mapping[str, RegionState], probes: Mapping[str, Probe]) -> bool:
    """Merge progress (and the merge runs in flight) must be read: a region changed, or one
    still has generations above the progress last seen, or is sealed and not retired yet."""
    for rid, p in probes.items():
        st = p.applied(memory.get(rid))
        if p.ok and p.changed or st is not None and (st.pending or (st.sealed and not st.retired)):
            return True
    return False


def needs_walls(memory: Mapping[str, RegionState], probes: Mapping[str, Probe], now: float,
                policy: RetryPolicy) -> bool:
    """The recorded walls must be read (one listing): a region the sensor requested a merge for
    still has generations above its progress and is due for another request (did that run stop
    at a permanent refusal? then no request). Within the backoff nothing is requested anyway."""
    for rid, p in probes.items():
        st = p.applied(memory.get(rid))
        if st is not None and st.pending and st.attempts and now - st.last_request >= policy.backoff(st.attempts):
            return True
    return False


def retire_candidates(memory: Mapping[str, RegionState], probes: Mapping[str, Probe],
                      merged: Mapping[str, int]) -> list[str]:
    """Sealed regions merged to their end: they retire once every gating index caught up, so
    the catch-up is read only when there is one."""
    out = []
    for rid, p in probes.items():
        st = p.applied(memory.get(rid))
        if p.ok and st is not None and st.sealed and not st.retired and st.top <= merged.get(rid, 0):
            out.append(rid)
    return out


# ------------------------------------------------------------------------------------------
# The rules


def covered_regions(runs: Iterable[RunCover], order: list[str]) -> set[str]:
    """Regions a merge run in flight covers (its partition or its range in partition `order`).
    A range whose first or last partition no longer exists covers nothing (Dagster cannot
    launch it), nor one whose end now comes before its start (a deleted partition re-added at
    the end): its regions are requested again."""
    pos = {rid: i for i, rid in enumerate(order)}
    covered: set[str] = set()
    for run in runs:
        if run.partition:
            covered.add(run.partition)
        elif run.range_start in pos and run.range_end in pos:
            covered.update(order[pos[run.range_start]:pos[run.range_end] + 1])
    return covered


def caught_up(catchup: Mapping[str, Mapping[str, int]] | None, region_id: str, generation: int) -> bool:
    """Every gating index covers `generation` of the region (unknown or absent: not caught up)."""
    if catchup is None:
        return False
    return all(regions.get(region_id, 0) >= generation for regions in catchup.values())


def judge(st: RegionState | None, probe: Probe, merged: int | None, in_flight: bool, is_caught_up: bool,
          now: float, policy: RetryPolicy, wall: Wall | None = None) -> RegionDecision:
    """One region's verdict this tick, and what to remember of it. `st` has the probe's news
    applied already; `merged` is its merge progress (None: not read, nothing pending); `wall`
    the permanent refusal recorded for it (one above its progress stops it at once)."""
    if not probe.ok or st is None:
        return RegionDecision(Verdict.UNREADABLE, st)
    if merged is None:
        if st.pending:
            raise ValueError(f"region {probe.region_id}: generations above its progress but the observation "
                             "has no merge progress (observe reads it whenever `needs_progress`)")
        return RegionDecision(Verdict.IDLE, st)
    st = observe_progress(st, merged)
    if st.top <= merged:
        if st.sealed and not in_flight and is_caught_up:
            return RegionDecision(Verdict.RETIRE, replace(st, retired=True))
        return RegionDecision(Verdict.IDLE, st)
    refused = wall is not None and wall.generation > merged and not in_flight
    verdict = Verdict.STUCK if refused else Verdict(policy.decide(st, now, in_flight))
    if verdict == Verdict.REQUEST:
        return RegionDecision(verdict, replace(st, attempts=st.attempts + 1, last_request=now))
    if verdict == Verdict.BACKOFF:
        return RegionDecision(verdict, st, due=st.last_request + policy.backoff(st.attempts))
    if verdict == Verdict.STUCK and not st.stuck_since:
        return RegionDecision(verdict, replace(st, stuck_since=now), became_stuck=True)
    return RegionDecision(verdict, st)


def policy_of(options: SensorOptions) -> RetryPolicy:
    return RetryPolicy(float(options.interval_seconds), options.merge_attempts, options.max_backoff_seconds)


def decide(obs: Observation, cursor: Cursor, options: SensorOptions, idle_every: float | None = None) -> Decision:
    """The tick's decision (see the module docstring); `cursor` is the one the tick started from.
    `idle_every`: record an idle table as current when base_table was last materialized this
    many seconds ago or more (`idle_current`; None: never)."""
    policy = policy_of(options)
    listed = set(obs.listed)
    memory = {rid: st for rid, st in obs.memory.items() if rid in listed}  # unlisted regions are forgotten
    active = obs.active
    existing = set(obs.partitions)
    new_partitions = [rid for rid in active if rid not in existing]
    order = [*obs.partitions, *new_partitions]
    covered = covered_regions(obs.in_flight, order) if obs.merged is not None else set()
    regions: dict[str, RegionDecision] = {}
    for rid in active:
        probe = obs.probes.get(rid, Probe(rid, error=f"region {rid}: not probed"))
        st = probe.applied(memory.get(rid))
        merged = None if obs.merged is None else obs.merged.get(rid, 0)
        d = judge(st, probe, merged, rid in covered, caught_up(obs.catchup, rid, st.top if st else 0),
                  obs.now, policy, (obs.walls or {}).get(rid))
        regions[rid] = d
        if d.state is not None:
            memory[rid] = d.state
    retire = [rid for rid in active if regions[rid].verdict == Verdict.RETIRE]
    pos = {rid: i for i, rid in enumerate(order)}
    merges = sorted((Merge(rid, d.state.top, d.state.base, d.state.attempts)
                     for rid, d in regions.items() if d.verdict == Verdict.REQUEST), key=lambda m: pos[m.region_id])
    merge = MergeRequest(tuple(merges), cursor.epoch) if merges else None
    maintenance = None
    if merge is None and not obs.maintenance.queued and obs.maintenance.latest_merge > cursor.maintained_after:
        maintenance = obs.maintenance.latest_merge
    first = False
    waiting = any(d.verdict in (Verdict.REQUEST, Verdict.IN_FLIGHT, Verdict.BACKOFF) for d in regions.values())
    if maintenance is None and merge is None and not obs.maintenance.queued and not obs.maintenance.ever \
            and not cursor.first_maintenance and not new_partitions and not waiting:
        # An instance that never maintained this table (a new deployment of a table maintained
        # elsewhere): one maintenance run now, not at the next schedule tick, so its assets
        # show their state instead of "Missing". Once per cursor; not while merges are on
        # their way (maintenance follows them), nor on a tick that adds partitions (the
        # base_table events emit records for them come first: the watermark).
        maintenance, first = max(obs.maintenance.latest_merge, obs.maintenance.idle_record), True
    watermark = maintenance if maintenance is not None else cursor.maintained_after
    if maintenance is None and obs.maintenance.latest_merge <= watermark:
        watermark = max(watermark, obs.maintenance.idle_record)  # an idle record is not a merge: past it
    changed = tuple(rid for rid in active if obs.probes.get(rid) and obs.probes[rid].ok and obs.probes[rid].changed)
    return Decision(
        regions=regions, memory=memory,
        add_partitions=tuple(rid for rid in new_partitions if rid not in set(retire)),
        delete_partitions=tuple(rid for rid in retire if rid in existing),
        merge=merge, maintenance=maintenance,
        cursor=replace(cursor, maintained_after=watermark,
                       first_maintenance=cursor.first_maintenance or first or maintenance is not None),
        observed=changed,
        notices=tuple(_notices(obs, regions, memory, set(changed), policy, options)),
        record_idle=not new_partitions and idle_current(obs, regions, merge, maintenance, cursor, idle_every))


def idle_current(obs: Observation, regions: Mapping[str, RegionDecision], merge: MergeRequest | None,
                 maintenance: int | None, cursor: Cursor, idle_every: float | None) -> bool:
    """Whether this tick records that the table is idle and its base table current
    (`memwal_pipeline/freshness.py`): every region merged to its newest flushed generation
    (none pending, requested, in flight, backing off, stuck or unreadable), no run requested,
    every merge followed by maintenance already, and base_table last materialized at least
    `idle_every` seconds ago (or never). Not on a tick that adds partitions (`decide` checks):
    the per-region records of regions merged before this instance saw them come first."""
    if idle_every is None or merge is not None or maintenance is not None:
        return False
    if any(d.verdict not in (Verdict.IDLE, Verdict.RETIRE) for d in regions.values()):
        return False
    if obs.maintenance.latest_merge > cursor.maintained_after:
        return False
    return obs.maintenance.latest_at is None or obs.now - obs.maintenance.latest_at >= idle_every


def stuck(memory: Mapping[str, RegionState]) -> dict[str, RegionState]:
    return {rid: st for rid, st in sorted(memory.items()) if st.stuck_since and not st.retired}


def stuck_reason(region_id: str, st: RegionState, wall: Wall | None = None, label: str | None = None) -> str:
    """Why the sensor stopped requesting merges of a region, and the repair; `label`: its value."""
    name = f"region {region_id}" + (f" ({label})" if label else "")
    if wall is not None and wall.generation > st.base:
        why = wall.reason.removeprefix(f"region {region_id}: ")
        return (f"{name} is stuck at generation {wall.generation}: the merger refused it permanently ({why}); "
                "no more automatic merge runs (retrying cannot pass a permanent refusal): repair the "
                "generation, then materialize the region's base_table partition")
    return (f"{name} is stuck at generation {st.base + 1}: {st.attempts} merge runs made no "
            "progress; no more automatic merge runs until its progress moves (see the merge run logs, repair, "
            "then materialize its base_table partition)")


def _notices(obs: Observation, regions: Mapping[str, RegionDecision], memory: Mapping[str, RegionState],
             changed: set[str], policy: RetryPolicy, options: SensorOptions) -> list[Notice]:
    """What the tick logs, in the order a person reads it: what was not looked at, what could not
    be read, then each region's news, then the stuck ones."""
    t = obs.table
    out = [Notice("warning", f"{t}: skipping _mem_wal/{name}: {reason}") for name, reason in obs.skipped]
    if obs.last_tick is not None and downtime(obs.last_tick, obs.now, options.interval_seconds):
        out.append(Notice("info", f"{t}: no tick for {obs.now - obs.last_tick:.0f} s: re-checking every region's "
                                  "latest manifest version (old versions may have been collected meanwhile)"))
    for rid in sorted(rid for rid, d in regions.items() if d.verdict == Verdict.UNREADABLE):
        probe = obs.probes.get(rid)
        out.append(Notice("error", f"{t}: {probe and probe.error or f'region {rid}: not read'}"))
    for rid, d in regions.items():
        st = d.state
        if d.verdict == Verdict.IN_FLIGHT and rid in changed:
            # A run that has not started yet plans when it starts and takes this generation
            # along; a running one is followed by a request once it ends.
            out.append(Notice("info", f"{t}: region {rid}: generation {st.top} left to the merge run in flight"))
        elif d.verdict == Verdict.REQUEST and st.attempts > 1:
            out.append(Notice("warning", f"{t}: region {rid}: generations {st.base + 1}..{st.top} still unmerged "
                                         f"after {st.attempts - 1} merge run(s); requesting attempt {st.attempts} "
                                         f"of {policy.max_attempts}"))
        elif d.became_stuck:
            why = stuck_reason(rid, st, (obs.walls or {}).get(rid), obs.labels.get(rid))
            out.append(Notice("error", f"{t}: {why}"))
        elif d.verdict == Verdict.RETIRE:
            out.append(Notice("info", f"{t}: region {rid} is sealed, fully merged and caught up: retiring its "
                                      "partition"))
    now_stuck = stuck(memory)
    if now_stuck:
        out.append(Notice("warning", f"{t}: {len(now_stuck)} region(s) stuck: " + ", ".join(
            f"{rid} at generation {st.base + 1}" for rid, st in list(now_stuck.items())[:5])))
    return out


@dataclass(frozen=True)
class IndexPartitions:
    """The index partitions a maintenance run spans, made to match the table's base-table
    indexes: new ones added, dropped ones deleted; `order` is the partition order after that."""

    add: tuple[str, ...]
    delete: tuple[str, ...]
    order: tuple[str, ...]


def index_partitions(current: Iterable[str], known: list[str]) -> IndexPartitions:
    """`current`: the table's base-table index names; `known`: the index partitions, in order."""
    current = sorted(current)
    added = [n for n in current if n not in set(known)]
    dropped = [n for n in known if n not in set(current)]
    return IndexPartitions(tuple(added), tuple(dropped), tuple([n for n in known if n not in set(dropped)] + added))
