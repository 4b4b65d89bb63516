"""A region's checked generation list (`jobs/gc/listed.py`) and its orphan sweep once per full-scan
interval: what a pass learns of the list from the region cache only spares it validating records
whose bytes it validated before; the plan is the one a full read makes, and whatever the cache
says, an invalid path is refused."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.gc_passes import COLLECT, KEEP, assert_same_decision, decision, forget_process
from support.gc_passes import history_table as _history

from memwal_core.jobs import gc
from memwal_core.jobs.gc import listed as listing, region_cache
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, region, sealed

# ------------------------------------------------------------------------------------------------
# The property: random edits of a real region manifest, the list checked with the chunks the
# previous step left equals the list checked from nothing.

BAD_PATHS = ["../0000000a_gen_{g}", "0000000a_gen_{g}/..", "0000000a_gen_{g}\n", "/abs_gen_{g}", "x_gen_{g}",
             "0000000a_gen_{h}", ""]
EDITS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 40)),
    st.tuples(st.just("trim"), st.integers(1, 40)),
    st.tuples(st.just("bad"), st.integers(0, 200), st.sampled_from(BAD_PATHS)),  # a path that must be refused
    st.tuples(st.just("repath"), st.integers(0, 200)),  # a valid path changed in place
    st.tuples(st.just("size"), st.integers(0, 200), st.integers(0, 2**63 - 1)),
    st.tuples(st.just("swap"), st.integers(0, 200)),  # out of order
    st.tuples(st.just("twice"), st.integers(0, 200)),  # listed twice
), min_size=1, max_size=12)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    """A region manifest written by pylance's ShardWriter (one region, a few generations)."""
    loc, w = _history(tmp_path_factory.mktemp("gens"), cycles=2)
    rid = sorted(w.regions.values())[0]
    return region.load_latest(loc.store, rid)


def full_check(m: region.RegionManifest):
    """What the pass decided before the cache: every path validated, in generation order."""
    try:
        return [(g, layout.generation_dir(m.region_id, g.path, g.generation)) for g in m.generations]
    except layout.UnsafePath as e:
        return str(e)


def cached_check(m: region.RegionManifest, known: dict) -> tuple[object, listing.Listed | None]:
    try:
        got = listing.listed(m, known)
    except layout.UnsafePath as e:
        return str(e), None
    return got.each() if got.run is None else got.take(0, len(got.run)), got


def apply(msg: pb.RegionManifest, edit: tuple) -> None:
    fg = msg.flushed_generations
    top = max([g.generation for g in fg], default=msg.current_generation - 1)
    kind, n = edit[0], edit[1]
    if kind == "append":
        for g in range(top + 1, top + 1 + n):
            fg.add(generation=g, path=f"{g % 2**32:08x}_gen_{g}", in_memory_bytes=g * 7, physical_rows=g)
        msg.current_generation = top + n + 1
    elif kind == "trim":
        del fg[:n]
    elif fg and kind == "bad":
        g = fg[n % len(fg)]
        g.path = edit[2].format(g=g.generation, h=g.generation + 1)
    elif fg and kind == "repath":
        g = fg[n % len(fg)]
        g.path = f"{(g.generation * 31 + 5) % 2**32:08x}_gen_{g.generation}"
    elif fg and kind == "size":
        fg[n % len(fg)].in_memory_bytes = edit[2]
    elif len(fg) > 1 and kind == "swap":
        i = n % (len(fg) - 1)
        a, b = pb.FlushedGeneration(), pb.FlushedGeneration()
        a.CopyFrom(fg[i])
        b.CopyFrom(fg[i + 1])
        fg[i].CopyFrom(b)
        fg[i + 1].CopyFrom(a)
    elif fg and kind == "twice":
        fg.add().CopyFrom(fg[n % len(fg)])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(edits=EDITS, garbled=st.booleans())
def test_the_checked_list_equals_a_full_check(manifest, edits, garbled):
    msg = pb.RegionManifest()
    msg.CopyFrom(manifest.message)
    known: dict = {}
    for i, edit in enumerate(edits):
        apply(msg, edit)
        msg.version = manifest.version + i + 1
        m = region.RegionManifest(manifest.region_id, msg.version, msg, msg.SerializeToString())
        full = full_check(m)
        got, lst = cached_check(m, known)
        assert got == full
        if lst is not None and lst.run is not None:
            n = len(lst.run)
            assert list(lst.run) == [g.generation for g, _ in full]
            for a, b in [(0, n), (0, n // 2), (n // 3, n), (1, n - 1)]:
                assert lst.mem(a, b) == sum(g.in_memory_bytes for g, _ in full[a:b])
        if lst is not None:
            known = lst.chunks
            if garbled and known:  # a chunk that lies about its bytes is only never matched
                first = sorted(known)[0]
                c = known[first]
                known = dict(known) | {first: listing.Chunk(c.first, c.count, c.nbytes, "0" * 32, c.mem + 1)}


# ------------------------------------------------------------------------------------------------
# Through GC, with real tables.


def _commit(loc, rid: str, change) -> region.RegionManifest:
    m = region.load_latest(loc.store, rid)

    def mutate(msg: pb.RegionManifest) -> bool:
        change(msg)
        return True

    return region.commit_next(loc.store, m, mutate)


@pytest.mark.parametrize("bad", ["../../../escape_gen_{g}", "0000000a_gen_{g}/../..", "0000000a_gen_{h}"])
@pytest.mark.parametrize("where", ["added", "rewritten"])
def test_an_invalid_path_after_the_cache_was_written_is_refused(tmp_path, bad, where):
    """A generation whose path escapes the region (or names another generation), listed after a
    pass recorded the list as checked: appended, or in place of a path the cache's chunk covers
    (a region re-created under the same id, or a manifest rewritten): the region is refused."""
    loc, w = _history(tmp_path, cycles=3, merge=False)
    rid = sorted(w.regions.values())[0]
    assert region_cache.load(loc.store, rid).gens  # the checked list is cached

    def change(msg: pb.RegionManifest) -> None:
        if where == "added":
            g = msg.current_generation
            msg.flushed_generations.add(generation=g, path=bad.format(g=g, h=g + 1))
            msg.current_generation = g + 1
        else:
            first = msg.flushed_generations[0]
            first.path = bad.format(g=first.generation, h=first.generation + 1)

    _commit(loc, rid, change)
    forget_process()
    plan = gc.plan_gc(loc, KEEP)
    assert plan.regions[rid].failure is not None and "corrupt manifest" in plan.regions[rid].error
    assert not plan.regions[rid].items
    assert_same_decision(loc, COLLECT)


@pytest.mark.parametrize("lie", ["mem", "count", "first"])
def test_a_chunk_that_lies_is_not_trusted(tmp_path, lie):
    """A cache, sealed as this code seals it, whose chunk says other sizes, another count or
    other generations than the bytes it was recorded for: the digest covers what the chunk says
    with the bytes, so it matches nothing and its records are read again."""
    loc, w = _history(tmp_path, cycles=3, merge=False)
    w.write_round(40, puts_per_batch=5)
    forget_process()
    gc.run_gc(loc, KEEP)
    rid = sorted(w.regions.values())[0]
    cache = region_cache.load(loc.store, rid)
    c = cache.gens[1]
    cache.gens[1] = listing.Chunk(c.first, c.count - (lie == "count"), c.nbytes, c.digest, c.mem + 10**6 * (lie == "mem"))
    if lie == "first":  # the chunk of generations 1.. said to start at the next chunk's first
        cache.gens = {1 + listing.CHUNK: listing.Chunk(1 + listing.CHUNK, c.count, c.nbytes, c.digest, c.mem)}
    region_cache.save(loc.store, cache)
    assert region_cache.load(loc.store, rid).gens == cache.gens
    assert_same_decision(loc, KEEP)
    m = region.load_latest(loc.store, rid)
    assert all(s.chunk is None for s in listing._walk(rid, m.raw, cache.gens)[:c.count])


@pytest.mark.parametrize("order", [(1, 3, 2, 4), (1, 2, 3, 2, 5)])
def test_a_forged_chunk_does_not_stand_in_for_the_numbers(manifest, order):
    """A chunk forged with a digest computed over records out of order, or listing a generation
    twice, saying they are consecutive: the run is not used (the decoded numbers are not it), so
    the region is classified one generation at a time and the merge-order check refuses what it
    refuses on a full read."""
    msg = pb.RegionManifest()
    msg.CopyFrom(manifest.message)
    del msg.flushed_generations[:]
    for i, g in enumerate(order):
        msg.flushed_generations.add(generation=g, path=f"{10 + i:08x}_gen_{g}", in_memory_bytes=g)
    msg.current_generation = max(order) + 1
    raw = msg.SerializeToString()
    m = region.RegionManifest(manifest.region_id, msg.version, msg, raw)
    start = raw.index(bytes(msg.flushed_generations[0].SerializeToString()[:2])) - 2
    end = start + sum(len(r.SerializeToString()) + 2 for r in msg.flushed_generations)
    n, mem = len(order), sum(order)
    forged = {1: listing.Chunk(1, n, end - start, listing._digest(1, n, mem, raw[start:end]), mem)}
    assert [s.chunk for s in listing._walk(m.region_id, raw, forged)] == [forged[1]]  # the digest matches
    got = listing.listed(m, forged)
    assert got.run is None and list(got.numbers) == sorted(order)
    if len(set(order)) < len(order):
        with pytest.raises(region.CorruptManifest, match="more than once"):
            region.pending_generations(m, 3)


def test_a_sweep_whose_deletes_failed_is_due_again(tmp_path, monkeypatch):
    """The orphan sweep counts as done only once its deletes went: when they fail (after the WAL
    entries and manifest versions of the region were deleted, and its cache saved), the next
    sweep is due an interval after the last sweep whose deletes went, not after the failed one."""
    from memwal_core.jobs.gc import execute

    loc, w = _history(tmp_path, cycles=4)
    rid = sorted(w.regions.values())[0]
    before = region_cache.load(loc.store, rid).orphans_at
    crashed = _orphan(loc, rid, "0000abcd_gen_1", age=600)
    forget_process()
    plan = gc.plan_gc(loc, COLLECT, full_scan=True)
    rp = plan.regions[rid]
    assert rp.orphans_swept and [i.path for i in rp.items if i.kind == gc.ORPHAN] == [crashed]
    assert [i for i in rp.items if i.kind in (gc.WAL, gc.MANIFEST)], "the region deletes more than orphans"

    def fail(*a, **k):
        raise OSError("the store refused the delete")

    monkeypatch.setattr(execute, "_delete_orphans", fail)
    res = execute.execute_gc(loc, plan)
    assert rid in {f.region_id for f in res.failures}
    assert region_cache.load(loc.store, rid).orphans_at == before
    monkeypatch.undo()
    forget_process()
    plan = gc.plan_gc(loc, COLLECT, now=before + COLLECT.full_scan_interval_seconds)
    assert plan.regions[rid].orphans_swept and crashed in [i.path for i in plan.items if i.kind == gc.ORPHAN]


@pytest.mark.parametrize("how", ["garbled", "other_chunking", "absent"])
def test_a_garbled_or_foreign_generation_list_is_read_around(tmp_path, how):
    loc, w = _history(tmp_path, cycles=3)
    rid = sorted(w.regions.values())[0]
    key = layout.gc_region_cache_key(rid)
    doc, blob = sealed.unseal_blob(loc.store.get(key), region_cache.FORMAT) if how != "garbled" else (None, b"")
    if how == "garbled":
        loc.store.put(key, loc.store.get(key).replace(b"gens", b"gen5"))
    else:
        doc["gens"] = [listing.CHUNK * 2, doc["gens"][1]] if how == "other_chunking" else None
        loc.store.put(key, sealed.seal_blob(doc, bytes(blob), region_cache.FORMAT))
    w.write_round(12, puts_per_batch=50)
    assert_same_decision(loc, KEEP)
    assert_same_decision(loc, COLLECT)
    forget_process()
    gc.run_gc(loc, KEEP)
    assert region_cache.load(loc.store, rid).gens  # written again


def test_the_cached_list_plans_as_a_full_read_while_generations_come_and_go(tmp_path):
    """Passes that append and trim (a merge, then a collecting pass): each plan equals a full read,
    and a pass with the cache validates only the records of the chunks that changed."""
    loc, w = _history(tmp_path, cycles=2)
    for i in range(4):
        w.write_round(40, puts_per_batch=5)  # several generations per cycle: chunks fill
        forget_process()
        gc.run_gc(loc, KEEP if i % 2 else COLLECT)
        assert_same_decision(loc, KEEP)
        assert_same_decision(loc, COLLECT)
    rid = sorted(w.regions.values())[0]
    m = region.load_latest(loc.store, rid)
    known = region_cache.load(loc.store, rid).gens
    segs = listing._walk(rid, m.raw, known)
    assert sum(s.chunk is not None for s in segs) == len([f for f in known if f >= m.generations[0].generation])


# ------------------------------------------------------------------------------------------------
# The orphan sweep, once per full-scan interval.


def _orphan(loc, rid: str, name: str, age: float) -> str:
    d = f"{layout.region_dir(rid)}/{name}"
    loc.store.put(f"{d}/data/a.lance", b"x" * 10)
    os.utime(os.path.join(loc.store.root, d, "data/a.lance"), (time.time() - age, time.time() - age))
    return d


def test_an_orphan_of_a_crashed_flush_is_collected_within_one_interval(tmp_path):
    """A flush that crashed after writing its directory, seen by no pass until the sweep is due:
    a pass between sweeps keeps it (and lists no region directory); the first pass an interval
    after the last sweep takes it, once older than the grace."""
    loc, w = _history(tmp_path, cycles=2)
    rid = sorted(w.regions.values())[0]
    cfg = gc.GcOptions(orphan_grace_seconds=60, full_scan_interval_seconds=3600)
    swept = region_cache.load(loc.store, rid).orphans_at  # `_history`'s pass swept, and recorded when
    assert swept is not None and swept <= time.time()
    crashed = _orphan(loc, rid, "0000abcd_gen_1", age=600)
    forget_process()
    loc.store.stats.clear()
    plan = gc.plan_gc(loc, cfg, now=swept + 3599)
    assert not [i for i in plan.items if i.kind == gc.ORPHAN] and not plan.regions[rid].orphans_swept
    forget_process()
    plan = gc.plan_gc(loc, cfg, now=swept + 3600)
    assert [i.path for i in plan.items if i.kind == gc.ORPHAN] == [crashed]
    forget_process()
    plan = gc.plan_gc(loc, cfg, now=swept - 10)  # a clock that went back: due
    assert [i.path for i in plan.items if i.kind == gc.ORPHAN] == [crashed]


def test_an_orphan_sweep_without_a_cache_is_due(tmp_path):
    loc, w = _history(tmp_path, cycles=2)
    rid = sorted(w.regions.values())[0]
    crashed = _orphan(loc, rid, "0000abcd_gen_1", age=600)
    cfg = gc.GcOptions(orphan_grace_seconds=60)
    forget_process()
    assert not [i for i in gc.plan_gc(loc, cfg).items if i.kind == gc.ORPHAN]  # swept by `_history`'s pass
    loc.store.delete_many([layout.gc_region_cache_key(rid)])
    forget_process()
    assert [i.path for i in gc.plan_gc(loc, cfg).items if i.kind == gc.ORPHAN] == [crashed]
    forget_process()
    plan = gc.plan_gc(loc, cfg, use_summary=False)  # a full read sweeps too
    assert [i.path for i in plan.items if i.kind == gc.ORPHAN] == [crashed]
    assert decision(gc.plan_gc(loc, cfg, full_scan=True)) == decision(plan)


# ------------------------------------------------------------------------------------------------
# `check_fields`: the sizes read only when the bytes may hold one past 2^63-1.


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
                      min_size=1, max_size=8))
def test_check_fields_with_the_bytes_refuses_what_it_refuses_without(sizes):
    rid = "00000000-0000-4000-8000-000000000001"
    msg = pb.RegionManifest(version=1, current_generation=len(sizes) + 1)
    msg.region_id.uuid = region.region_uuid_bytes(rid)
    for g, (a, b, c) in enumerate(sizes, 1):
        msg.flushed_generations.add(generation=g, path=f"0000000a_gen_{g}", in_memory_bytes=a, physical_rows=b,
                                    primary_key_bytes=c)
    raw = msg.SerializeToString()

    def verdict(raw_or_none):
        try:
            region.check_fields(rid, "k", msg, raw_or_none)
        except region.FieldOutOfRange as e:
            return str(e)
        return None

    assert verdict(raw) == verdict(None)
    assert (verdict(raw) is None) == all(max(s) < 2**63 for s in sizes)


@settings(max_examples=300, deadline=None)
@given(raw=st.lists(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x42]) | st.integers(0, 255), max_size=40).map(bytes))
def test_may_exceed_counter_is_nine_continuation_bits_in_a_row(raw):
    """The scan's definition, byte by byte: some nine bytes in a row have their top bit set."""
    assert region._may_exceed_counter(raw) == any(all(b & 0x80 for b in raw[i:i + 9]) for i in range(len(raw) - 8))


def test_a_dry_run_says_when_a_real_run_takes_the_orphans_it_lists(tmp_path):
    """A dry run sweeps every region; a real run sweeps a region once per interval. So the dry
    run lists an orphan the next real run leaves, and says so, with when its sweep is due."""
    from memwal_core.steps import adapt

    loc, w = _history(tmp_path, cycles=2)
    rid = sorted(w.regions.values())[0]
    swept = region_cache.load(loc.store, rid).orphans_at
    crashed = _orphan(loc, rid, "0000abcd_gen_1", age=600)
    cfg = gc.GcOptions(orphan_grace_seconds=60)
    forget_process()
    dry = gc.run_gc(loc, cfg, dry_run=True)
    assert crashed in [i.path for i in dry.plan.items if i.kind == gc.ORPHAN]
    due = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(swept + cfg.full_scan_interval_seconds))
    assert [n for n in adapt.gc_notes(dry) if "orphan" in n] == [
        f"region {rid}: 1 orphan directories are taken by its next sweep, due at {due} (a run sweeps a region "
        "once per gc.full_scan_interval_seconds; a run before then leaves them)"]
    forget_process()
    real = gc.run_gc(loc, cfg)
    assert crashed not in [i.path for i in real.deleted] and loc.store.exists(f"{crashed}/data/a.lance")
    region_cache.save(loc.store, region_cache.RegionCache(rid))  # no sweep recorded: the next run sweeps
    forget_process()
    assert not [n for n in adapt.gc_notes(gc.run_gc(loc, cfg, dry_run=True)) if "orphan" in n]
