"""The sensor's decision (`memwal_pipeline.sensor.decide`) on hand-built observations: no table,
no Dagster instance, no clock. Each rule table-driven, then the "nothing waits forever" guarantee
as a property over arbitrary observations and over arbitrary sequences of ticks (Hypothesis).

The same rules on real tables and a real Dagster instance: tests/test_sensor_liveness.py and the
sensor tests of tests/test_pipeline.py.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memwal_core.options import SensorOptions
from memwal_pipeline.liveness import RegionState
from memwal_pipeline.sensor.decide import (
    VERIFY_EVERY,
    WAITING,
    Verdict,
    covered_regions,
    decide,
    index_partitions,
    judge,
    needs_progress,
    policy_of,
    recheck,
    retire_candidates,
    stuck,
)
from memwal_pipeline.sensor.observation import Cursor, Maintenance, Observation, Probe, RunCover

ROOT = Path(__file__).resolve().parent.parent
OPTS = SensorOptions(interval_seconds=30, merge_attempts=3, max_backoff_seconds=100)
NOW = 10_000.0
CURSOR = Cursor("ep0ch", maintained_after=7)


def seen(rid: str, version: int = 2, top: int = 1, sealed: bool = False) -> Probe:
    """A probe that found a new manifest version (the region moved)."""
    return Probe(rid, version, True, top, sealed)


def still(rid: str, version: int = 1) -> Probe:
    """A probe that found the remembered version (nothing moved)."""
    return Probe(rid, version)


def observation(probes: list[Probe], memory: dict[str, RegionState] | None = None, *,
                partitions: tuple[str, ...] | None = None, merged: dict[str, int] | None = None,
                now: float = NOW, **kw) -> Observation:
    memory = memory or {}
    listed = tuple([p.region_id for p in probes] + [r for r, s in memory.items() if s.retired])
    return Observation("t", now, memory, kw.pop("last_tick", now - 30), kw.pop("ticks", 5), listed,
                       probes={p.region_id: p for p in probes},
                       partitions=tuple(memory) if partitions is None else partitions,
                       merged=merged, **kw)


def verdicts(d) -> dict[str, Verdict]:
    return {rid: r.verdict for rid, r in d.regions.items()}


# ----------------------------------------------------------------------------- the layer


def test_deciding_loads_no_dagster_and_nothing_that_reads():
    """Importing `decide` (and its package) loads no Dagster, no object store, no table (the
    state layer), no Lance, Arrow or Spark: what it decides, it decides from its arguments."""
    code = ("import sys, memwal_pipeline.sensor.decide; "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in "
            "('dagster', 'lance', 'pyarrow', 'pyspark', 'boto3') or m.startswith(('memwal_core.state', "
            "'memwal_core.jobs', 'memwal_pipeline.sensor.observe', 'memwal_pipeline.sensor.emit'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""


# ----------------------------------------------------------------------------- the rules


def test_a_new_region_with_a_flushed_generation_becomes_a_partition_and_is_requested():
    d = decide(observation([seen("a", top=3)], merged={}), CURSOR, OPTS)
    assert verdicts(d) == {"a": Verdict.REQUEST} and d.add_partitions == ("a",)
    assert d.merge.regions == ["a"] and d.merge.run_key == "a:3@0#1/ep0ch"
    assert d.memory["a"] == RegionState(version=2, top=3, attempts=1, last_request=NOW)
    assert d.observed == ("a",) and d.maintenance is None


def test_several_regions_form_one_run_over_their_partition_range_in_partition_order():
    memory = {r: RegionState(1, 0) for r in "cab"}
    d = decide(observation([seen("a"), seen("b"), still("c"), seen("d")], memory, merged={}), CURSOR, OPTS)
    assert d.merge.regions == ["a", "b", "d"]  # partition order c, a, b, then the new d
    assert d.merge.run_key == "a:1@0#1,b:1@0#1,d:1@0#1/ep0ch" and d.add_partitions == ("d",)
    many = decide(observation([seen(f"r{i}") for i in range(6)], merged={}), CURSOR, OPTS)
    key = many.merge.run_key
    assert key.startswith("r0:1@0#1,...(6 regions) ") and key.endswith("/ep0ch") and len(key) < 80


@pytest.mark.parametrize("runs, covered", [
    ([RunCover("b")], {"b"}),
    ([RunCover(range_start="b", range_end="d")], {"b", "c", "d"}),
    ([RunCover(range_start="x", range_end="d")], set()),   # its first partition is gone: covers nothing
    ([RunCover(range_start="d", range_end="b")], set()),   # ends before it starts (re-added at the end)
    ([RunCover("a"), RunCover(range_start="c", range_end="e")], {"a", "c", "d", "e"}),
])
def test_merge_runs_in_flight_cover_their_partition_or_range(runs, covered):
    assert covered_regions(runs, list("abcde")) == covered


def test_a_region_a_run_in_flight_covers_is_left_to_it():
    memory = {"a": RegionState(1, 1, attempts=1, last_request=NOW - 5)}
    d = decide(observation([seen("a", top=2)], memory, merged={}, in_flight=(RunCover("a"),)), CURSOR, OPTS)
    assert verdicts(d) == {"a": Verdict.IN_FLIGHT} and d.merge is None
    assert any("generation 2 left to the merge run in flight" in n.message for n in d.notices)


@pytest.mark.parametrize("attempts, since_request, verdict, due", [
    (1, 10, Verdict.BACKOFF, 30),      # first backoff: one interval
    (1, 30, Verdict.REQUEST, None),
    (2, 59, Verdict.BACKOFF, 60),      # doubled
    (3, 100, Verdict.STUCK, None),     # the cap (3 attempts), past the backoff
    (3, 99, Verdict.BACKOFF, 100),     # capped at max_backoff_seconds
])
def test_retries_back_off_doubling_then_stop_at_the_cap(attempts, since_request, verdict, due):
    memory = {"a": RegionState(1, 4, base=2, attempts=attempts, last_request=NOW - since_request)}
    d = decide(observation([still("a")], memory, merged={"a": 2}), CURSOR, OPTS)
    r = d.regions["a"]
    assert r.verdict == verdict
    assert r.due == (None if due is None else NOW - since_request + due)
    if verdict == Verdict.REQUEST:
        assert d.merge.run_key == f"a:4@2#{attempts + 1}/ep0ch" and r.state.attempts == attempts + 1
        assert any(f"requesting attempt {attempts + 1} of 3" in n.message for n in d.notices)


def test_a_region_becomes_stuck_once_visibly_and_progress_unsticks_it():
    memory = {"a": RegionState(1, 4, base=2, attempts=3, last_request=NOW - 500)}
    d = decide(observation([still("a")], memory, merged={"a": 2}), CURSOR, OPTS)
    assert d.became_stuck == ["a"] and d.memory["a"].stuck_since == NOW
    errors = [n.message for n in d.notices if n.level == "error"]
    assert errors == ["t: region a is stuck at generation 3: 3 merge runs made no progress; no more automatic "
                      "merge runs until its progress moves (see the merge run logs, repair, then materialize its "
                      "base_table partition)"]
    later = decide(observation([seen("a", 3, top=5)], dict(d.memory), merged={"a": 2}, now=NOW + 10**6),
                   CURSOR, OPTS)
    assert verdicts(later) == {"a": Verdict.STUCK} and later.became_stuck == [] and later.merge is None
    assert [n.message for n in later.notices if n.level == "warning"] == ["t: 1 region(s) stuck: a at generation 3"]
    moved = decide(observation([still("a", 3)], dict(later.memory), merged={"a": 3}, now=NOW + 10**6 + 1),
                   CURSOR, OPTS)
    assert verdicts(moved) == {"a": Verdict.REQUEST} and moved.memory["a"].stuck_since == 0
    assert moved.merge.run_key == "a:5@3#1/ep0ch"


@pytest.mark.parametrize("catchup, in_flight, verdict", [
    ({"idx": {"a": 5}}, (), Verdict.RETIRE),
    ({"idx": {"a": 4}}, (), Verdict.IDLE),             # an index behind
    ({"idx": {"a": 5}, "other": {}}, (), Verdict.IDLE),  # a gating index with no record
    ({"idx": {"a": 5}}, (RunCover("a"),), Verdict.IDLE),  # a run still covers it
    ({}, (), Verdict.RETIRE),                           # no gating index at all
])
def test_a_sealed_region_retires_once_merged_caught_up_and_free(catchup, in_flight, verdict):
    memory = {"a": RegionState(3, 5, sealed=True, base=5), "b": RegionState(1, 1, base=1)}
    d = decide(observation([still("a", 3), still("b")], memory, merged={"a": 5, "b": 1}, catchup=catchup,
                           in_flight=in_flight), CURSOR, OPTS)
    assert d.regions["a"].verdict == verdict
    assert d.delete_partitions == (("a",) if verdict == Verdict.RETIRE else ())
    assert d.memory["a"].retired == (verdict == Verdict.RETIRE)
    # A retired region is no longer probed nor judged, and stays remembered as retired.
    if verdict == Verdict.RETIRE:
        after = decide(observation([still("b")], dict(d.memory), merged=None), CURSOR, OPTS)
        assert set(after.regions) == {"b"} and after.memory["a"].retired


def test_a_region_retiring_on_its_first_tick_never_becomes_a_partition():
    d = decide(observation([seen("a", top=2, sealed=True)], {}, partitions=(), merged={"a": 2}, catchup={}),
               CURSOR, OPTS)
    assert verdicts(d) == {"a": Verdict.RETIRE} and d.add_partitions == () and d.delete_partitions == ()


def test_an_unreadable_region_is_reported_every_tick_and_its_memory_kept():
    memory = {"a": RegionState(4, 2, base=1, attempts=1, last_request=NOW - 1)}
    d = decide(observation([Probe("a", error="region a: bad manifest")], memory, merged={"a": 1}), CURSOR, OPTS)
    assert verdicts(d) == {"a": Verdict.UNREADABLE} and d.memory["a"] == memory["a"]
    assert [n.message for n in d.notices if n.level == "error"] == ["t: region a: bad manifest"]


def test_regions_no_longer_listed_are_forgotten():
    memory = {"a": RegionState(1, 1, base=1), "gone": RegionState(9, 9, base=9)}
    d = decide(observation([still("a")], memory, partitions=("a", "gone"), merged=None), CURSOR, OPTS)
    assert set(d.memory) == {"a"}


@pytest.mark.parametrize("merge, queued, latest, wanted", [
    (False, False, 8, 8),
    (False, False, 7, None),   # nothing materialized since the last request
    (False, True, 8, None),    # one is queued already
    (True, False, 8, None),    # a merge first; maintenance follows it
])
def test_maintenance_follows_a_merge_once(merge, queued, latest, wanted):
    memory = {"a": RegionState(1, 2 if merge else 1, base=1)}
    d = decide(observation([still("a")], memory, merged={"a": 1}, maintenance=Maintenance(queued, latest)),
               CURSOR, OPTS)
    assert d.maintenance == wanted and (d.merge is not None) == merge
    assert d.cursor.maintained_after == (wanted or 7) and d.cursor.epoch == "ep0ch"


def test_progress_must_be_read_whenever_a_region_could_need_it():
    idle = {"a": RegionState(1, 1, base=1)}
    assert not needs_progress(idle, {"a": still("a")})
    assert needs_progress(idle, {"a": seen("a")})                                         # moved
    assert needs_progress({"a": RegionState(1, 2, base=1)}, {"a": still("a")})           # pending
    assert needs_progress({"a": RegionState(1, 1, True, base=1)}, {"a": still("a")})     # sealed
    assert needs_progress({"a": RegionState(1, 2, base=1)}, {"a": Probe("a", error="x")})
    with pytest.raises(ValueError, match="no merge progress"):
        decide(observation([still("a")], {"a": RegionState(1, 2, base=1)}, merged=None), CURSOR, OPTS)
    sealed = {"a": RegionState(1, 3, True, base=3), "b": RegionState(1, 3, True, base=2)}
    assert retire_candidates(sealed, {r: still(r) for r in sealed}, {"a": 3, "b": 2}) == ["a"]


def test_recheck_every_region_after_downtime_else_a_rotating_slice():
    rids = [f"r{i}" for i in range(40)]
    assert recheck(rids, None, 0, NOW, 30) == set(rids)
    assert recheck(rids, NOW - 91, 3, NOW, 30) == set(rids)
    slices = [recheck(rids, NOW - 30, t, NOW, 30) for t in range(VERIFY_EVERY)]
    assert all(len(s) < len(rids) for s in slices) and set().union(*slices) == set(rids)


def test_index_partitions_follow_the_tables_indexes():
    ip = index_partitions(["b_idx", "c_idx"], ["a_idx", "b_idx"])
    assert (ip.add, ip.delete, ip.order) == (("c_idx",), ("a_idx",), ("b_idx", "c_idx"))
    assert index_partitions([], []).order == ()


# ----------------------------------------------------------------------------- nothing waits forever

rids = st.sampled_from([f"r{i}" for i in range(6)])


@st.composite
def observations(draw):
    """An arbitrary tick: regions remembered or new, moved or not, readable or not, runs in
    flight over partitions or ranges (some stale), progress anywhere at or below the top."""
    regions = draw(st.lists(rids, min_size=1, max_size=6, unique=True))
    now = NOW
    memory, probes, merged = {}, [], {}
    for rid in regions:
        top = draw(st.integers(0, 6))
        done = draw(st.integers(0, top))
        merged[rid] = done
        known = draw(st.booleans())
        if known:
            attempts = draw(st.integers(0, 5))
            memory[rid] = RegionState(
                version=1, top=draw(st.integers(0, top)), sealed=draw(st.booleans()),
                base=draw(st.integers(0, done)), attempts=attempts,
                last_request=now - draw(st.floats(0, 500)) if attempts else 0.0,
                stuck_since=now - 1 if attempts and draw(st.booleans()) else 0.0)
        kind = draw(st.sampled_from(["moved", "still", "broken"] if known else ["moved", "broken"]))
        probes.append({"moved": seen(rid, 2, top, sealed=draw(st.booleans())), "still": still(rid),
                       "broken": Probe(rid, error=f"region {rid}: unreadable")}[kind])
    partitions = tuple(draw(st.permutations([r for r in regions if r in memory])))
    runs = tuple(draw(st.lists(st.one_of(
        st.builds(RunCover, rids), st.builds(lambda a, b: RunCover(range_start=a, range_end=b), rids, rids)),
        max_size=3)))
    return observation(probes, memory, partitions=partitions, merged=merged, in_flight=runs,
                       catchup=draw(st.sampled_from([None, {}, {"idx": {r: 6 for r in regions}}])),
                       maintenance=Maintenance(draw(st.booleans()), draw(st.integers(0, 10))))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(observations())
def test_every_region_with_unmerged_generations_is_requested_in_flight_backing_off_or_reported(obs):
    d = decide(obs, CURSOR, OPTS)
    order = [*obs.partitions, *[r for r in obs.active if r not in obs.partitions]]
    covered = covered_regions(obs.in_flight, order)
    requested = set(d.merge.regions) if d.merge else set()
    stuck_now = stuck(d.memory)
    for rid in obs.active:
        r = d.regions[rid]
        if not obs.probes[rid].ok:
            assert r.verdict == Verdict.UNREADABLE
            assert any(n.level == "error" and f"region {rid}:" in n.message for n in d.notices)
            continue
        state = r.state
        if state.top > obs.merged[rid]:
            assert r.verdict in WAITING, (rid, r)
            assert (r.verdict == Verdict.IN_FLIGHT) == (rid in covered)
        assert (r.verdict == Verdict.REQUEST) == (rid in requested)
        if rid in requested:
            assert rid not in covered  # never a second run behind one in flight
        if r.verdict == Verdict.BACKOFF:
            assert NOW < r.due <= state.last_request + OPTS.max_backoff_seconds
        if r.verdict == Verdict.STUCK:
            assert state.attempts >= OPTS.merge_attempts and rid in stuck_now
            assert any(n.level == "warning" and f"{len(stuck_now)} region(s) stuck" in n.message for n in d.notices)
            assert not r.became_stuck or any(n.level == "error" and f"region {rid} is stuck" in n.message
                                             for n in d.notices)
        assert d.memory[rid] == state
    # A merge run's range spans exactly the partitions Dagster will have.
    if d.merge:
        after = [p for p in [*obs.partitions, *d.add_partitions] if p not in d.delete_partitions]
        lo, hi = after.index(d.merge.regions[0]), after.index(d.merge.regions[-1])
        assert set(d.merge.regions) <= set(after[lo:hi + 1])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(observations(), st.randoms(use_true_random=False))
def test_the_decision_does_not_depend_on_the_order_regions_are_seen_in(obs, rnd):
    """Each region is judged on its own: the order of probes, of remembered regions and of runs
    in flight changes nothing, nor the listing order once every region has its partition (a new
    region's partition is appended in listing order, which is the one order that matters)."""
    listed, runs = list(obs.listed), list(obs.in_flight)
    if set(obs.active) <= set(obs.partitions):
        rnd.shuffle(listed)
    rnd.shuffle(runs)
    shuffled = replace(obs, listed=tuple(listed), in_flight=tuple(runs),
                       probes=dict(sorted(obs.probes.items(), key=lambda _: rnd.random())),
                       memory=dict(sorted(obs.memory.items(), key=lambda _: rnd.random())))
    a, b = decide(obs, CURSOR, OPTS), decide(shuffled, CURSOR, OPTS)
    assert a.regions == b.regions and a.memory == b.memory and a.maintenance == b.maintenance
    assert (a.merge.run_key if a.merge else None) == (b.merge.run_key if b.merge else None)
    assert set(a.delete_partitions) == set(b.delete_partitions) and a.add_partitions == b.add_partitions


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 400), st.booleans(), st.booleans()), min_size=1, max_size=60))
def test_a_region_whose_runs_all_fail_is_requested_until_the_cap_then_reported_stuck(ticks):
    """Ticks at arbitrary intervals; a requested run is sometimes still in flight at the next
    tick, then fails; a writer sometimes flushes again. The region never waits unseen: each tick
    it is requested, in flight, backing off until a finite due time, or stuck; it is requested
    at the first tick past its due time; exactly `merge_attempts` requests, then stuck, once."""
    policy = policy_of(OPTS)
    memory: dict[str, RegionState] = {}
    now, top, version, requests, stuck_reports = NOW, 1, 1, 0, 0
    in_flight = False
    due = None
    for gap, still_running, flush in ticks:
        now += gap
        if flush:
            top, version = top + 1, version + 1
        probe = seen("a", version, top) if (flush or not memory) else still("a", version)
        runs = (RunCover("a"),) if in_flight else ()
        d = decide(Observation("t", now, memory, now - gap, 1, ("a",), probes={"a": probe},
                               partitions=("a",) if memory else (), merged={"a": 0}, in_flight=runs),
                   CURSOR, OPTS)
        r = d.regions["a"]
        assert r.verdict in WAITING
        if r.verdict == Verdict.REQUEST:
            assert due is None or now >= due
            requests += 1
            assert r.state.attempts == requests
        elif r.verdict == Verdict.BACKOFF:
            assert r.due == r.state.last_request + policy.backoff(r.state.attempts) and now < r.due
            due = r.due
        elif r.verdict == Verdict.IN_FLIGHT:
            assert in_flight
        else:
            assert requests == OPTS.merge_attempts and not in_flight
        if due is not None and now >= due and not in_flight:
            assert r.verdict in (Verdict.REQUEST, Verdict.STUCK)
            due = None
        stuck_reports += r.became_stuck
        in_flight = (r.verdict == Verdict.REQUEST or in_flight) and still_running
        memory = dict(d.memory)
    assert requests <= OPTS.merge_attempts and stuck_reports <= 1
    assert stuck_reports == (memory["a"].stuck_since > 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40))
def test_progress_resets_the_count_so_a_region_that_merges_is_never_stuck(progress_per_tick):
    """Ticks a backoff apart: whenever a run made progress since the last tick, the next
    request is attempt 1 again; a region that merges something at least every other attempt
    never reaches the cap."""
    memory: dict[str, RegionState] = {}
    now, merged, top = NOW, 0, 100
    for moved in progress_per_tick:
        now += OPTS.max_backoff_seconds
        merged += moved
        d = decide(Observation("t", now, memory, now - 30, 1, ("a",),
                               probes={"a": seen("a", 2, top) if not memory else still("a", 2)},
                               partitions=("a",) if memory else (), merged={"a": merged}), CURSOR, OPTS)
        r = d.regions["a"]
        assert r.verdict in (Verdict.REQUEST, Verdict.STUCK)
        if moved:
            assert r.verdict == Verdict.REQUEST and r.state.attempts == 1
        memory = dict(d.memory)
    if all(progress_per_tick[i] or progress_per_tick[i + 1] for i in range(len(progress_per_tick) - 1)):
        assert not memory["a"].stuck_since


def test_judge_alone_needs_no_tick():
    """A region's verdict is a function of its own state: the rule a reader checks by eye."""
    p = policy_of(OPTS)
    st_ = RegionState(1, 3, base=1, attempts=0)
    assert judge(st_, still("a"), 1, False, False, NOW, p).verdict == Verdict.REQUEST
    assert judge(st_, still("a"), 1, True, False, NOW, p).verdict == Verdict.IN_FLIGHT
    assert judge(st_, still("a"), 3, False, False, NOW, p).verdict == Verdict.IDLE
    assert judge(None, Probe("a", error="x"), 1, False, False, NOW, p).verdict == Verdict.UNREADABLE


def test_an_instance_that_never_maintained_the_table_gets_one_maintenance_run():
    """No `garbage` materialization in this instance yet (the newest merge already followed):
    once no merge is on its way and no partition is being added, one maintenance request, once
    per cursor."""
    merged = {"a": 3}
    idle = {"a": RegionState(1, 3, base=3)}
    new = Maintenance(latest_merge=4, ever=False)
    start = Cursor("e", maintained_after=4)
    d = decide(observation([still("a")], idle, merged=merged, maintenance=new), start, OPTS)
    assert d.maintenance == 4 and d.cursor.first_maintenance
    assert decide(observation([still("a")], idle, merged=merged, maintenance=new), d.cursor, OPTS).maintenance is None
    # Not while a merge is requested or waits, nor on a tick that adds partitions.
    waiting = decide(observation([still("a")], {"a": RegionState(1, 5, base=3, attempts=1, last_request=NOW - 1)},
                                 merged=merged, maintenance=new), start, OPTS)
    assert verdicts(waiting) == {"a": Verdict.BACKOFF} and waiting.maintenance is None
    adding = decide(observation([seen("b", top=1)], idle, merged={**merged, "b": 1}, maintenance=new), start, OPTS)
    assert adding.add_partitions == ("b",) and adding.maintenance is None
    assert not adding.cursor.first_maintenance
    # An instance that maintained it already: nothing.
    assert decide(observation([still("a")], idle, merged=merged), start, OPTS).maintenance is None


def test_a_recorded_permanent_refusal_makes_a_due_region_stuck_at_once():
    from memwal_pipeline.sensor.decide import needs_walls, policy_of
    from memwal_pipeline.sensor.observation import Wall

    failed = {"a": RegionState(1, 5, base=3, attempts=1, last_request=NOW - 1000)}
    policy = policy_of(OPTS)
    assert needs_walls(failed, {"a": still("a")}, NOW, policy)
    assert not needs_walls({"a": RegionState(1, 5, base=3, attempts=1, last_request=NOW - 1)}, {"a": still("a")},
                           NOW, policy)  # within its backoff: nothing to decide yet
    wall = Wall(4, "region a: generation 4: columns differ from the base table")
    d = decide(observation([still("a")], failed, merged={"a": 3}, walls={"a": wall}), CURSOR, OPTS)
    assert verdicts(d) == {"a": Verdict.STUCK} and d.merge is None and d.became_stuck == ["a"]
    (err,) = [n.message for n in d.notices if n.level == "error"]
    assert "refused it permanently (generation 4: columns differ" in err and "repair" in err
    # A wall the region was merged past (another merger) is no reason: requested again.
    past = decide(observation([still("a")], failed, merged={"a": 4}, walls={"a": wall}), CURSOR, OPTS)
    assert verdicts(past) == {"a": Verdict.REQUEST}


def test_an_idle_table_is_recorded_current_at_most_every_interval():
    """Every region merged to its newest flushed generation: the tick records the table as
    current once base_table was last materialized `idle_every` seconds ago (or never); not
    while a region waits, is unreadable or a merge is unfollowed, nor when not asked; an idle
    record newer than every merge moves the maintenance watermark without a maintenance run."""
    idle = {"a": RegionState(1, 3, base=3)}
    old = Maintenance(latest_merge=7, latest_at=NOW - 60)

    def record(probes, memory, maintenance, cursor=CURSOR, every=60.0, **kw) -> bool:
        return decide(observation(probes, memory, maintenance=maintenance, **kw), cursor, OPTS,
                      idle_every=every).record_idle

    assert record([still("a")], idle, old)
    assert record([], {}, Maintenance(latest_merge=0), Cursor("e"))               # no region, never materialized
    assert not record([still("a")], idle, replace(old, latest_at=NOW - 59))        # recorded recently
    assert not record([still("a")], idle, old, every=None)                         # not asked
    assert not record([still("a")], {"a": RegionState(1, 4, base=3, attempts=1, last_request=NOW - 1)}, old,
                      merged={"a": 3})                                            # generation 4 waits
    assert not record([Probe("a", error="unreadable")], idle, old)
    assert not record([still("a")], idle, replace(old, latest_merge=8))           # maintenance follows first
    # The newest materialization is an idle record (storage id 9), no merge past the watermark (7).
    d = decide(observation([still("a")], idle, maintenance=Maintenance(latest_merge=0, latest_at=NOW - 5,
                                                                        idle_record=9)), CURSOR, OPTS, idle_every=60.0)
    assert d.maintenance is None and d.cursor.maintained_after == 9 and not d.record_idle
    # ... and one merge past it (8): maintenance follows that merge; the watermark is the merge.
    d = decide(observation([still("a")], idle, maintenance=Maintenance(latest_merge=8, latest_at=NOW - 5)),
               CURSOR, OPTS, idle_every=60.0)
    assert d.maintenance == 8 and d.cursor.maintained_after == 8
