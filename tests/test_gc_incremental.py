"""What keeps a GC pass's cost flat as the retained history grows, and when it must not be
trusted: the settled run of kept WAL entries (`region_cache.Settled`), the summaries written by
appending to their text (`history.encode`, `RegionCache.encode`), the generations held counted
by runs (`plan._classify_runs`) and the retention's bounds over distinct merge states
(`retention.Retention`). Each is checked against what reading or classifying everything decides."""

from __future__ import annotations

import dataclasses
import json
import types
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from support.gc_passes import forget_process
from test_gc_summaries import COLLECT, KEEP, _history, assert_same_decision

from memwal_core.jobs import gc
from memwal_core.jobs.gc import history, plan, region_cache, retention, sealed
from memwal_core.jobs.gc.holds import Bound, KeepReason
from memwal_core.state import layout, region, wal
from memwal_core.state.store import open_store


def _settled(loc, rid) -> region_cache.Settled:
    c = region_cache.load(loc.store, rid)
    assert c is not None and c.settled is not None, "a pass that kept every older entry records its run"
    return c.settled


def _forge(loc, rid, **changes) -> None:
    c = region_cache.load(loc.store, rid)
    c.settled = dataclasses.replace(c.settled, **changes)
    assert region_cache.save(loc.store, c)


def _wal_kept(loc, config, rid) -> dict:
    forget_process()
    return {k: v for k, v in gc.plan_gc(loc, config).regions[rid].kept.items() if k.value.startswith("wal:")}


def test_a_settled_run_is_counted_without_classifying_its_entries(tmp_path):
    """While the limit stays below the run's lowest generation and the current epoch above its
    epochs, the run is taken as the cache says: forged counts show up in the plan (the trust it
    buys), and the true ones equal a full read."""
    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    forget_process()
    gc.run_gc(loc, KEEP)  # a second pass: the run recorded by the first is used and extended
    s = _settled(loc, rid)
    assert s.top > s.bottom and s.sentinels and s.kept
    assert_same_decision(loc, KEEP)
    _forge(loc, rid, sentinels=s.top - s.bottom, kept=0, min_gen=None)
    kept = _wal_kept(loc, KEEP, rid)
    assert kept[KeepReason.WAL_FENCE_SENTINEL] >= s.top - s.bottom
    assert KeepReason.WAL_GENERATION_KEPT not in kept or kept[KeepReason.WAL_GENERATION_KEPT] < s.kept


def test_a_settled_run_is_walked_again_once_the_limit_reaches_it(tmp_path):
    """Base versions cleaned up raise the limit into the run: its entries are classified again, as
    a full read does (a forged run, trusted while every version was retained, shows other counts)."""
    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    s = _settled(loc, rid)
    _forge(loc, rid, sentinels=s.top - s.bottom - 1, kept=1, min_gen=1, max_epoch=0)  # the limit will be >= 1
    forget_process()
    assert gc.plan_gc(loc, COLLECT).regions[rid].limit == 0  # every version retained: the run is trusted
    assert gc.cleanup_base_versions(loc, COLLECT)["old_versions"] > 0
    decided = assert_same_decision(loc, COLLECT)  # the forged counts would differ from a full read
    assert decided.regions[rid].limit >= 1
    forget_process()
    gc.run_gc(loc, COLLECT)
    assert_same_decision(loc, KEEP)
    assert_same_decision(loc, COLLECT)


def test_a_settled_run_of_the_current_epoch_is_not_trusted(tmp_path):
    """A run that holds an entry of the current writer epoch (kept as such, not by its
    generation) is classified again: counted as the cache says it would show other reasons."""
    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    s = _settled(loc, rid)
    epoch = region.load_latest(loc.store, rid).writer_epoch
    _forge(loc, rid, sentinels=s.top - s.bottom, kept=0, min_gen=None, max_epoch=epoch)
    assert_same_decision(loc, KEEP)
    kept = _wal_kept(loc, KEEP, rid)
    assert kept.get(KeepReason.WAL_GENERATION_KEPT, 0) > 0


def test_a_garbled_settled_run_drops_the_cache(tmp_path):
    """A run whose counts do not add up to its positions, or whose top is not a known entry, makes
    the cache unusable (the region is read in full), never a skip."""
    loc, w = _history(tmp_path, cycles=3)
    rid = sorted(w.regions.values())[0]
    c = region_cache.load(loc.store, rid)
    for bad in (dataclasses.replace(c.settled, sentinels=c.settled.sentinels + 1),
                dataclasses.replace(c.settled, top=max(c.rows) + 5,
                                    bottom=max(c.rows) + 5 - (c.settled.top - c.settled.bottom))):
        c.settled = bad
        loc.store.put(region_cache.layout.gc_region_cache_key(rid), c.encode())
        assert region_cache.load(loc.store, rid) is None
        assert_same_decision(loc, KEEP)


# ------------------------------------------------------------------------------------------------
# Summaries written by appending to their text


def _facts(n: int, start: int = 1) -> dict[int, history.VersionFacts]:
    states = [None, {}, {"a": 1}, {"a": 1, "b": 2}]
    return {v: history.VersionFacts(v, 600 + v, 1.7e9 + v / 3, None if v % 5 == 0 else 1.7e9 + v / 7,
                                    states[v % 4] if v % 4 != 3 else {"a": v, "b": 1})
            for v in range(start, start + n)}


def test_the_version_summary_appends_only_when_the_facts_only_grew(tmp_path):
    """Written from the text of the summary it read when only newer versions came; any other
    change (a version gone, a row replaced by another object, an older version added) encodes
    everything again. Each result decodes to exactly the facts given."""
    first = history.decode_summary(history.encode(_facts(40), 1.0, 2.0))
    assert first.text is not None
    grown = dict(first.facts) | _facts(5, start=41)
    gone = {v: f for v, f in first.facts.items() if v != 1}
    replaced = dict(first.facts) | {7: history.VersionFacts(7, 1, 1.0, 2.0, {"z": 3})}
    older = {v: f for v, f in first.facts.items() if v != 3} | {3: first.facts[3]._replace(size=1)}
    for facts in (grown, gone, replaced, older, {}):
        raw = history.encode(facts, 3.0, None, first.text)
        got = history.decode_summary(raw)
        assert got.facts == facts and (got.listed_at, got.leaks_at) == (3.0, None)
        assert json.loads(sealed.unseal_body(raw, history.FORMAT)) == \
            json.loads(sealed.unseal_body(history.encode(facts, 3.0, None), history.FORMAT))


def test_a_version_summary_in_another_layout_is_read_and_written_in_full():
    """A summary whose body is not laid out as `encode` writes it (keys in another order) is still
    read; nothing of its text is reused."""
    facts = _facts(6)
    d = json.loads(sealed.unseal_body(history.encode(facts), history.FORMAT))
    body = json.dumps({"versions": d["versions"], "states": d["states"], "listed_at": None, "leaks_at": None})
    got = history.decode_summary(sealed.seal_body(body, history.FORMAT))
    assert got.facts == facts and got.text is None


def test_the_region_cache_keeps_settled_rows_as_text_until_one_is_looked_up(tmp_path):
    """The rows of settled runs are carried over as the text they were read as, with the rows that
    joined the run appended, while none of them is looked up; once one is (or a position of theirs
    is deleted or found missing) every row is written again. Each result decodes to exactly the
    rows it holds."""
    loc = open_store(str(tmp_path / "t"))
    rid = "00000000-0000-4000-8000-000000000001"
    meta = lambda p, e=1: wal.WalEntryMeta(p, e, None if p % 2 else p // 2, p % 2 == 1, 100 + p)  # noqa: E731
    loc.store.put(region_cache.layout.wal_key(rid, 1), b"x")
    first = region_cache.RegionCache(rid, {p: meta(p) for p in range(1, 11)}, {20}, (1, 1, 1.0),
                                     settled=region_cache.Settled(8, 0, 4, 4, 1, 1))
    checked = region_cache.Checked(loc.store, region_cache.RegionCache.decode(first.encode(), rid))
    checked._wal_ok = True
    base = region_cache.after_pass(checked, rid, {}, set(), {}, set(), region_cache.Settled(8, 0, 4, 4, 1, 1))
    assert base.cold_top == 8
    rows = {p: meta(p) for p in range(1, 11)}
    cases = [({11: meta(11), 12: meta(12)}, set(), region_cache.Settled(10, 0, 5, 5, 1, 1), True),
             ({11: meta(11)}, set(), None, True),
             ({5: meta(5)}, set(), None, False),  # looked up: decoded
             ({}, {4}, None, False), ({6: None}, set(), None, False), ({7: meta(7, e=2)}, set(), None, False)]
    for metas, deleted, settled, as_text in cases:
        old = region_cache.RegionCache.decode(base.encode(), rid)
        assert old._cold is not None
        checked = region_cache.Checked(loc.store, old)
        checked._wal_ok = True
        for p in metas:
            if p <= old.cold_top:
                assert checked.wal_meta(p)[0]  # what the scan does before it reads an entry
        new = region_cache.after_pass(checked, rid, metas, deleted, {}, set(), settled)
        assert (new._cold is not None) == as_text
        expect = rows | {p: m for p, m in metas.items() if m is not None}
        expect = {p: m for p, m in expect.items() if p not in deleted and metas.get(p, 0) is not None}
        again = region_cache.RegionCache.decode(new.encode(), rid)
        assert again.cold_top == max(8, settled.top if settled else 0) and again._cold is not None
        assert again.wal == expect and again == new


def test_settled_rows_that_are_not_the_recorded_ones_drop_the_cache(tmp_path):
    """A text of settled rows that does not hold as many rows as recorded, or holds one above its
    top, is found when it is decoded: the cache is then not used (the region is read in full)."""
    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    forget_process()
    gc.run_gc(loc, KEEP)
    good = region_cache.load(loc.store, rid)
    assert good.cold_top and good._cold_n
    key = region_cache.layout.gc_region_cache_key(rid)
    d = sealed.unseal(loc.store.get(key), region_cache.FORMAT)
    top, n, text = d["cold"]
    rows = json.loads(text)
    swapped = json.dumps([[top + 50] + rows[0][1:]] + rows[1:], separators=(",", ":"))  # passes the cheap checks
    for cold in ([top, n + 1, text], [top - 1, n, text], [top, n, swapped]):
        loc.store.put(key, sealed.seal(d | {"cold": cold}, region_cache.FORMAT))
        c = region_cache.load(loc.store, rid)
        if c is not None:  # found only once decoded: then the WAL part is not used
            assert cold[2] == swapped
            checked = region_cache.Checked(loc.store, c)
            assert checked.wal_meta(1) == (False, None) and not checked.wal_ok()
        assert_same_decision(loc, KEEP)


# ------------------------------------------------------------------------------------------------
# Generations held, counted by runs; bounds over distinct merge states


def _ctx(tmp_path, retained=None) -> plan._Context:
    loc = open_store(str(tmp_path / "t"))
    return plan._Context(loc, gc.GcOptions(), 0.0, {}, {}, [], retained)


@settings(max_examples=150, deadline=None)
@given(gens=st.lists(st.integers(1, 60), unique=True, max_size=40),
       bounds=st.lists(st.tuples(st.sampled_from([KeepReason.GENERATION_NOT_MERGED, KeepReason.GENERATION_INDEX_BEHIND,
                                                  KeepReason.GENERATION_TIME_TRAVEL, KeepReason.GENERATION_UNVERIFIED]),
                                 st.integers(0, 70)), min_size=1, max_size=5),
       current=st.integers(1, 70))
def test_generations_counted_by_runs_as_one_at_a_time(tmp_path_factory, gens, bounds, current):
    """The same holds (bound, count, bytes, highest, in order) and kept counters, for any bounds
    and any listed generations (only the held ones: the collectable prefix is deleted by both)."""
    tmp = tmp_path_factory.mktemp("runs")
    m = types.SimpleNamespace(sealed=False, current_generation=current)
    rid = "00000000-0000-4000-8000-000000000002"
    listed = [(region.Generation(g, f"0000000a_gen_{g}", g * 10 + 1, 1),
               layout.generation_dir(rid, f"0000000a_gen_{g}", g)) for g in sorted(gens)]
    gen_bounds = [Bound(r, g) for r, g in bounds]
    limit = min(b.generation for b in gen_bounds)
    out = []
    for classify in ("each", "runs"):
        rp = plan.RegionGcPlan(rid)
        holds: dict = {}
        if classify == "each":
            plan._classify_each(_ctx(tmp), rp, m, listed, gen_bounds, limit, None, 0, holds)
        else:
            plan._classify_runs(_ctx(tmp), rp, m, listed, gen_bounds, limit, holds)
        out.append(([dataclasses.astuple(h) for h in holds.values()], dict(rp.kept), rp.trim))
    assert out[0] == out[1]


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.booleans()), min_size=1, max_size=30),
       gen=st.integers(0, 7))
def test_bounds_over_distinct_states_as_over_every_version(rows, gen):
    """A region's time-travel bound (value and version) and `held_until` equal the per-version
    definitions, whether equal states are one object (decoded) or copies."""
    shared: dict = {}
    states, stamps = {}, {}
    for v, (a, b, same) in enumerate(rows, start=1):
        m = {"r": a, "s": b} if a else {"s": b}
        states[v] = shared.setdefault((a, b), m) if same else m
        stamps[v] = 1000.0 + v
    r = retention.Retention(sorted(states), states, stamps)
    for rid in ("r", "s", "t"):
        lowest = min(m.get(rid, 0) for m in states.values())
        assert r.bound(rid) == Bound(KeepReason.GENERATION_TIME_TRAVEL, lowest,
                                     table_version=min(v for v, m in states.items() if m.get(rid, 0) == lowest))
        needing = [v for v, m in states.items() if m.get(rid, 0) < gen]
        assert r.held_until(rid, gen, timedelta(seconds=5)) == (stamps[max(needing)] + 5 if needing else None)
