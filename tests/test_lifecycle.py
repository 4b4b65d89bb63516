"""Table lifecycle: after an overwrite and `initialize_mem_wal` again, the regions left in
`_mem_wal/` hold rows the overwrite replaced. They are never merged, never published to
readers, kept by GC and reported, until discarded (by hand or after the grace); the new
lifetime's own writes (new regions, an old region re-opened by a writer) merge normally.

Real pylance tables written by `ShardWriter`s, the real Spark merge, real Dagster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid

import lance
import pyarrow as pa
import pytest
from dagster import DagsterInstance, materialize
from support.helpers import tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memwal_core.jobs import gc, merge, snapshot
from memwal_core.observe import checks, reader, status
from memwal_core.options import GcOptions
from memwal_core.state import layout, lifecycle, region, region_values, table, value_records
from memwal_core.state.store import open_store
from memwal_core.tools import demo

INT32 = {"bucket": pa.int32()}  # the Arrow type of a bucket field's value
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GC_NOW = GcOptions(manifest_min_age_seconds=0, orphan_grace_seconds=0, discard_stale_after_seconds=None)


def rows(loc) -> dict:
    return {r["id"]: r for r in table.open_dataset(loc).to_table().to_pylist()}


def keys_of(w: demo.Workload, value, start: int, n: int) -> list[int]:
    """`n` fresh keys from `start` on whose region value is `value`."""
    out, k = [], start
    while len(out) < n:
        if w.region_value([k])[0] == value:
            out.append(k)
        k += 1
    return out


def put(loc, rid: str, keys: list[int], version: int, model: dict) -> None:
    ds = lance.dataset(loc.lance_uri)
    with ds.mem_wal_writer(rid, max_memtable_rows=50) as wr:
        data = [demo.row(k, version) for k in keys]
        wr.put(demo.rows_table(data))
    model.update({r["id"]: r for r in data})


def overwrite_and_reinit(loc, n: int = 5, num_buckets: int = 4) -> dict:
    """The operator's mistake: replace the table's rows, initialize MemWAL again."""
    new = {r["id"]: r for r in (demo.row(i, 7) for i in range(n))}
    ds = lance.write_dataset(demo.rows_table(list(new.values())), loc.lance_uri, mode="overwrite")
    assert ds.list_indices() == []  # the MemWAL index went with the overwrite; _mem_wal/ stayed
    ds.initialize_mem_wal(bucket_column="id", num_buckets=num_buckets)
    return new


def written_two_buckets(loc, seed: int, writes: int = 40) -> demo.Workload:
    """A table bucketed two ways with `writes` rows written by pylance, none merged."""
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=5)
    w = demo.Workload(loc, seed=seed, key_space=60, max_memtable_rows=10)
    w.write_round(writes, puts_per_batch=10)
    return w


@pytest.fixture
def overwritten(table_loc, spark):
    """Four old regions, each with merged and pending generations, then an overwrite and a
    re-initialization; one old region re-opened by a writer and one new region written."""
    loc = table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=4, base_rows=10)
    w = demo.Workload(loc, seed=3, key_space=300, max_memtable_rows=10)
    w.write_round(80, puts_per_batch=10)
    merge.execute_merge(loc, merge.plan_merge(loc), spark)
    w.write_round(80, puts_per_batch=10)  # pending in the old lifetime
    old = dict(w.regions)  # region value -> region id
    assert len(old) == 4
    assert all(lifecycle.assess_table(loc).lifecycle.verdict(r) is None for r in old.values())
    model = overwrite_and_reinit(loc)
    values = sorted(old)
    reopened, fresh_value = old[values[0]], values[1]
    fresh = str(uuid.uuid4())
    put(loc, reopened, keys_of(w, values[0], 5000, 6), 8, model)
    put(loc, fresh, keys_of(w, fresh_value, 6000, 6), 8, model)
    stale_keys = set(w.expected()) - set(model)
    return loc, w, old, reopened, fresh, model, stale_keys


def test_stale_regions_are_never_merged_published_or_collected(overwritten, spark):
    loc, w, old, reopened, fresh, model, stale_keys = overwritten
    a = lifecycle.assess_table(loc)
    lc, reads = a.lifecycle, a.reads
    assert lc.init is not None and lc.init.known and lc.init.previous_version is not None
    assert set(lc.stale) == set(old.values()) and fresh not in lc.stale
    top = reads.manifests[reopened].top_generation
    assert lc.verdict(reopened).stale_through == top - 1  # its one new generation is current

    plan = merge.plan_merge(loc)
    assert set(plan.walls) == set(old.values()) and all(wl.permanent for wl in plan.walls.values())
    assert plan.pending == {fresh: [1]}
    msg = plan.walls[reopened].reason
    assert f"predate the MemWAL initialization at table version {lc.init.table_version}" in msg
    assert f"generation {top}, written after it, waits behind them" in msg
    assert f"memwal regions discard URI {reopened}" in msg
    result = merge.execute_merge(loc, plan, spark)
    assert set(result.stuck_regions) == set(old.values())
    assert rows(loc) == {k: v for k, v in model.items() if k in rows(loc)}
    assert not stale_keys & set(rows(loc))  # nothing of the old lifetime came back
    assert set(rows(loc)) == {k for k in model if k < 5000 or k >= 6000}  # new region merged
    # memwal's LSM read shows the re-opened region's new rows, nothing stale
    assert {r["id"]: r for r in reader.lsm_table(loc).to_pylist()} == model

    # Reported: status (an error with the repair), the check, and the merger's wall records.
    st = {r.region_id: r for r in status.table_status(loc).regions}
    assert all("predate" in st[r].error and "Repair" in st[r].error for r in old.values())
    assert st[fresh].error is None and st[fresh].stale_through is None
    assert st[reopened].stale_through == top - 1
    report = checks.stale_regions(loc, grace_seconds=3600)
    assert set(report.regions) == set(old.values()) and not report.ok
    assert set(report.discard_at) == set(old.values())
    assert set(os.listdir(os.path.join(loc.lance_uri, "_memwal", "walls"))) == {f"{r}.json" for r in old.values()}

    # The index builder publishes no stale generation (nor a value derived from one).
    snapshot.build_snapshot(loc)
    snap = snapshot.read_snapshot(loc)
    published = {str(uuid.UUID(bytes=r["region_id"])): [g["generation"] for g in r["flushed_generations"]]
                 for r in snap.to_pylist()}
    assert published[reopened] == [top]
    assert all(published[r] == [] for r in old.values() if r != reopened)

    # GC keeps every file of a stale region, and says why.
    before = tree(loc.lance_uri)
    plan_gc = gc.plan_gc(loc, GC_NOW)
    assert not any(i.region_id in old.values() for i in plan_gc.items)
    assert plan_gc.kept.get("region:stale") == 4
    assert any(h.reason == "stale" for h in plan_gc.holds)
    gc.run_gc(loc, GC_NOW)
    after = tree(loc.lance_uri)
    for rid in old.values():
        mine = {p: v for p, v in before.items() if p.startswith(f"_mem_wal/{rid}/")}
        assert {p: after.get(p) for p in mine} == mine


def test_discard_then_the_reopened_region_merges_and_gc_collects_exactly_the_stale(overwritten, spark):
    loc, w, old, reopened, fresh, model, stale_keys = overwritten
    merge.execute_merge(loc, merge.plan_merge(loc), spark)
    a = lifecycle.assess_table(loc)
    lc, reads = a.lifecycle, a.reads
    through = lc.verdict(reopened).stale_through
    stale_dirs = {f"_mem_wal/{reopened}/{g.path}" for g in reads.manifests[reopened].generations
                  if g.generation <= through}
    other = sorted(set(old.values()) - {reopened})[0]

    before = tree(loc.lance_uri)
    dry = lifecycle.discard(loc, [reopened, other], dry_run=True)
    assert dry.discarded == {reopened: through, other: lc.verdict(other).stale_through} and not dry.refused
    assert tree(loc.lance_uri) == before  # a dry run changes nothing

    refused = lifecycle.discard(loc, [fresh])
    assert fresh in refused.refused and "not stale" in refused.refused[fresh] and not refused.discarded
    done = lifecycle.discard(loc, [reopened, other])
    assert done.discarded == dry.discarded
    merged = table.read_memwal_state(loc).merged
    assert merged[reopened] == through and merged[other] == lc.verdict(other).stale_through
    again = lifecycle.discard(loc, [reopened])
    assert "already handled" in again.refused[reopened]

    # The re-opened region's own generation now merges; no stale row ever reaches the table.
    result = merge.execute_merge(loc, merge.plan_merge(loc), spark)
    assert result.regions[reopened].generations_merged == [through + 1]
    assert set(result.stuck_regions) == set(old.values()) - {reopened, other}
    assert rows(loc) == model
    assert not stale_keys & set(rows(loc))
    st = {r.region_id: r for r in status.table_status(loc).regions}
    assert st[reopened].error is None and st[other].error is None

    # Discarded stale generations are still read by a time travel to a version from before the
    # overwrite: GC keeps them while such a version is retained (this lifetime's versions do
    # not hold them: they never should have read them).
    snapshot.build_snapshot(loc)
    held = gc.plan_gc(loc, GC_NOW)
    assert not [i for i in held.items if i.region_id in (reopened, other)]
    # Once the old versions are cleaned up, GC removes exactly the discarded regions' stale
    # generation directories (plus their trim commit); the undiscarded stale regions are untouched.
    before = tree(loc.lance_uri)
    r = gc.run_gc(loc, GcOptions(manifest_min_age_seconds=0, orphan_grace_seconds=0,
                                 discard_stale_after_seconds=None, cleanup_base_versions_older_than_seconds=0,
                         cleanup_base_versions_floor_seconds=0))
    after = tree(loc.lance_uri)
    stale_all = stale_dirs | {f"_mem_wal/{other}/{g.path}" for g in reads.manifests[other].generations}
    assert all(not any(p.startswith(d + "/") for p in after) for d in stale_all)
    # ... and, as always, the merged generations of this lifetime (with the cleanup, no version reads them)
    merged_now = {f"_mem_wal/{rid}/{g.path}" for rid in (reopened, fresh) for g in reads.manifests[rid].generations
                  if not lc.stale.get(rid) or g.generation > lc.stale[rid].stale_through}
    gone = [p for p in before if p not in after and p.startswith("_mem_wal/")]  # base versions: cleaned
    assert not [p for p in gone if not any(p.startswith(d + "/") for d in stale_all | merged_now)
                and "/wal/" not in p and "/manifest/" not in p], gone
    assert r.counts()["generation"] == len(stale_all | merged_now)
    for rid in set(old.values()) - {reopened, other}:
        mine = {p: v for p, v in before.items() if p.startswith(f"_mem_wal/{rid}/")}
        assert {p: after.get(p) for p in mine} == mine
    assert rows(loc) == model


def test_grace_discards_automatically_and_a_dry_run_only_says_so(overwritten, spark):
    loc, w, old, reopened, fresh, model, stale_keys = overwritten
    lifecycle.assess_table(loc, record=True)  # first reported now
    keep = GcOptions(manifest_min_age_seconds=0, orphan_grace_seconds=0, discard_stale_after_seconds=3600)
    assert gc.run_gc(loc, keep).stale_discarded == {}
    expired = GcOptions(manifest_min_age_seconds=0, orphan_grace_seconds=0, discard_stale_after_seconds=0)
    before = table.read_memwal_state(loc).merged
    dry = gc.run_gc(loc, expired, dry_run=True)
    assert set(dry.stale_discarded) == set(old.values())
    assert table.read_memwal_state(loc).merged == before
    r = gc.run_gc(loc, expired)
    assert set(r.stale_discarded) == set(old.values())
    # The pass planned on the table as its discard commit left it (read again after the commit).
    assert r.plan.table_version == table.read_memwal_state(loc).table_version > dry.plan.table_version
    assert checks.stale_regions(loc).ok
    rec = json.loads(loc.store.get(layout.LIFECYCLE_KEY))
    assert {v["by"] for v in rec["discarded"].values()} == {"grace"}
    merge.execute_merge(loc, merge.plan_merge(loc), spark)
    assert rows(loc) == model


def test_unflushed_wal_rows_are_replayed_into_a_stale_generation(table_loc, spark):
    """A writer that crashed with rows only in its WAL: a writer re-opening the region after the
    re-initialization replays them into its next generation, together with its own new rows
    (pylance 14). That generation is stale; until it is flushed the boundary is open."""
    loc = table_loc
    demo.create_table(loc, sharding="unsharded", base_rows=3)
    rid = str(uuid.uuid4())
    model: dict = {}
    put(loc, rid, list(range(10, 15)), 1, model)
    code = (f"import lance, os, sys; sys.path.insert(0, {REPO!r}); from memwal_core.tools import demo; "
            f"w = lance.dataset({loc.lance_uri!r}).mem_wal_writer({rid!r}, max_memtable_rows=100, durable_write=True); "
            "w.put(demo.rows_table([demo.row(k, 55) for k in range(500, 505)])); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    model = {r["id"]: r for r in (demo.row(i, 9) for i in range(2))}
    ds = lance.write_dataset(demo.rows_table(list(model.values())), loc.lance_uri, mode="overwrite")
    ds.initialize_mem_wal(unsharded=True)

    lc = lifecycle.assess_table(loc).lifecycle
    v = lc.verdict(rid)
    assert v.open and v.wal_position > 0
    assert rid in lifecycle.discard(loc, [rid]).refused  # boundary unknown: not discardable yet
    plan = merge.plan_merge(loc)
    assert rid in plan.walls and "no generation has taken yet" in plan.walls[rid].reason
    assert gc.plan_gc(loc, GC_NOW).kept.get("region:stale") == 1

    put(loc, rid, [700, 701], 3, model)  # one MemTable: the replayed rows 500..504 and 700, 701
    m = region.load_latest(loc.store, rid)
    replay_gen = m.top_generation
    got = lance.dataset(loc.child_uri(layout.generation_dir(rid, m.generations[-1].path, replay_gen))).to_table()
    assert {500, 700} <= set(got.column("id").to_pylist())
    lc = lifecycle.assess_table(loc, record=True).lifecycle
    assert lc.verdict(rid).stale_through == replay_gen  # mixed: stale (its new rows go with it)
    put(loc, rid, [800], 4, model)
    assert lifecycle.discard(loc, [rid]).discarded == {rid: replay_gen}
    merge.execute_merge(loc, merge.plan_merge(loc), spark)
    got = rows(loc)
    assert 800 in got and not {10, 500, 700} & set(got)


def test_record_follows_a_second_overwrite(table_loc):
    """The recorded initialization is checked against every version committed since: a second
    overwrite + re-initialization makes the first lifetime's current regions stale too."""
    loc = table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=2)
    overwrite_and_reinit(loc, num_buckets=2)
    w = demo.Workload(loc, seed=1, key_space=50, max_memtable_rows=10)
    w.write_round(30, puts_per_batch=5)
    lc = lifecycle.assess_table(loc, record=True).lifecycle
    assert not lc.stale and lc.fresh == set(w.regions.values())
    first = lc.init.table_version
    overwrite_and_reinit(loc, num_buckets=2)
    lc = lifecycle.assess_table(loc, record=True).lifecycle
    assert lc.init.table_version > first and set(lc.stale) == set(w.regions.values())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.sampled_from(["write", "merge", "gc", "snapshot", "compact"]), min_size=3, max_size=8),
       seed=st.integers(0, 1000))
def test_a_table_never_overwritten_has_no_stale_region(spark, steps, seed):
    """Property: writes, merges, snapshots, compactions and GC (collecting as early as allowed,
    base versions cleaned at once) never make a region of a table that was never overwritten
    stale, and the table always ends equal to the writers' model."""
    with tempfile.TemporaryDirectory() as d:
        loc = open_store(os.path.join(d, "t"))
        demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=5)
        w = demo.Workload(loc, seed=seed, key_space=100, max_memtable_rows=8)
        opts = GcOptions(manifest_min_age_seconds=0, orphan_grace_seconds=0, manifest_retention=1,
                         cleanup_base_versions_older_than_seconds=0,
                         cleanup_base_versions_floor_seconds=0)
        for step in ["write", *steps]:
            if step == "write":
                w.write_round(30, puts_per_batch=5)
            elif step == "merge":
                r = merge.execute_merge(loc, merge.plan_merge(loc), spark)
                assert not r.region_errors
            elif step == "gc":
                assert not gc.run_gc(loc, opts).region_errors
            elif step == "snapshot":
                snapshot.build_snapshot(loc)
            else:
                lance.dataset(loc.lance_uri).optimize.compact_files()
            lc = lifecycle.assess_table(loc, record=step != "gc").lifecycle
            assert not lc.stale and not lc.errors
        merge.execute_merge(loc, merge.plan_merge(loc), spark)
        assert rows(loc) == w.expected()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_cli_maintain_refuses_reports_and_discard_collects(tmp_path):
    """The user-facing path: `memwal maintain` (a subprocess) merges nothing stale and says why
    with the repair, exit 1; `memwal status` says it too; `memwal regions discard` (dry run
    first) then `maintain --only gc` collects them."""
    root = str(tmp_path / "t")
    loc = open_store(root)
    w = written_two_buckets(loc, seed=2)
    model = overwrite_and_reinit(loc, num_buckets=2)
    stale = sorted(w.regions.values())

    p = _cli("maintain", root, "--only", "merge,index,gc")
    assert p.returncode == 1, p.stderr
    for rid in stale:
        assert f"error: merge: region {rid}: its generations" in p.stderr or \
            f"error: merge: region {rid}: its generation" in p.stderr, p.stderr
    assert "memwal regions discard URI" in p.stderr
    assert "check stale_regions" in p.stderr
    assert rows(loc) == model

    s = _cli("status", root)
    assert s.returncode == 1 and all(f"{rid}  error: region {rid}: its generation" in s.stdout for rid in stale), s.stdout

    before = tree(root)
    d = _cli("regions", "discard", root, "--all", "--dry-run")
    assert d.returncode == 0, d.stderr
    assert all(f"would discard region {rid}" in d.stdout for rid in stale)
    assert tree(root) == before
    bad = _cli("regions", "discard", root, "not-a-region")
    assert bad.returncode == 1 and "not a region id" in bad.stderr

    d = _cli("regions", "discard", root, *stale)
    assert d.returncode == 0, d.stderr
    p = _cli("maintain", root, "--only", "gc", "--base-versions-older-than", "0", "--base-versions-floor", "0")  # no pre-overwrite time travel
    assert p.returncode == 0, p.stderr
    listed = {rid: region.load_latest(loc.store, rid).generations for rid in stale}
    assert all(gens == [] for gens in listed.values())
    assert not [p for p in tree(root) if p.startswith("_mem_wal/") and "_gen_" in p]
    assert _cli("status", root).returncode == 0
    assert rows(loc) == model


def test_dagster_stale_regions_check(table_loc):
    """`stale_regions` on the garbage asset: ERROR with the repair while stale regions wait,
    passing once they are discarded."""
    from memwal_pipeline.config import TableConfig
    from memwal_pipeline.definitions import table_definitions

    loc = table_loc
    written_two_buckets(loc, seed=2)
    overwrite_and_reinit(loc, num_buckets=2)
    cfg = TableConfig(name="t", uri=loc.lance_uri, gc=GcOptions(  # old-lifetime versions cleaned: nothing reads them
        manifest_min_age_seconds=0, orphan_grace_seconds=0, cleanup_base_versions_older_than_seconds=0,
                         cleanup_base_versions_floor_seconds=0))
    td = table_definitions(cfg)
    by = {a.key.path[-1]: a for a in td.assets}
    with DagsterInstance.ephemeral() as instance:
        r = materialize([by["garbage"], *td.checks_for(by["garbage"].key)], instance=instance,
                        resources=td.resources, raise_on_error=False)
        ev = {c.check_name: c for c in r.get_asset_check_evaluations()}
        assert not ev["stale_regions"].passed and ev["stale_regions"].severity.value == "ERROR"
        assert ev["stale_regions"].metadata["stale_regions"].value == 2
        assert "memwal regions discard" in ev["stale_regions"].description
        lifecycle.discard(loc, None)
        r = materialize([by["garbage"], *td.checks_for(by["garbage"].key)], instance=instance,
                        resources=td.resources)
        ev = {c.check_name: c for c in r.get_asset_check_evaluations()}
        assert ev["stale_regions"].passed
        md = r.asset_materializations_for_node(by["garbage"].op.name)[0].metadata
        assert md["generations_deleted"].value > 0
    assert not [p for p in tree(loc.lance_uri) if p.startswith("_mem_wal/") and "_gen_" in p]


def test_on_s3_stale_regions_are_found_by_the_stores_clock(s3_table_loc):
    """On S3 the initialization's time and the regions' times are both LastModified (the
    server's clock, one-second resolution on AWS): an overwrite a second after the last flush,
    and a region created a second after the re-initialization, are told apart."""
    import time

    loc = s3_table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=2)
    w = demo.Workload(loc, seed=4, key_space=40, max_memtable_rows=10)
    w.write_round(30, puts_per_batch=5)
    time.sleep(1.1)
    new = {r["id"]: r for r in (demo.row(i, 7) for i in range(3))}
    ds = lance.write_dataset(demo.rows_table(list(new.values())), loc.lance_uri, mode="overwrite",
                             storage_options=loc.storage_options)
    ds.initialize_mem_wal(bucket_column="id", num_buckets=2)
    time.sleep(1.1)
    fresh = str(uuid.uuid4())
    ds = lance.dataset(loc.lance_uri, storage_options=loc.storage_options)
    with ds.mem_wal_writer(fresh, max_memtable_rows=10) as wr:
        wr.put(demo.rows_table([demo.row(k, 1) for k in keys_of(w, w.region_value([0])[0], 900, 3)]))
    lc = lifecycle.assess_table(loc).lifecycle
    assert set(lc.stale) == set(w.regions.values()) and fresh not in lc.stale
    plan = merge.plan_merge(loc)
    assert set(plan.walls) == set(w.regions.values()) and plan.pending == {fresh: [1]}
    assert not checks.stale_regions(loc).ok


def test_gc_records_the_verdicts_before_its_base_version_cleanup(table_loc):
    """The versions around the initialization are its only evidence: GC's base-version cleanup
    (here 0 s: everything but the latest version) runs only after the stale regions are
    recorded, so they stay stale when `memwal maintain --only gc` is the first job to run."""
    loc = table_loc
    w = written_two_buckets(loc, seed=5)
    overwrite_and_reinit(loc, num_buckets=2)
    assert not loc.store.exists(layout.LIFECYCLE_KEY)
    opts = GcOptions(manifest_min_age_seconds=0, orphan_grace_seconds=0, cleanup_base_versions_older_than_seconds=0,
                         cleanup_base_versions_floor_seconds=0)
    r = gc.run_gc(loc, opts)
    assert r.base_cleanup["old_versions"] > 0 and len(table.open_dataset(loc).versions()) == 1
    assert r.counts()["generation"] == 0
    lc = lifecycle.assess_table(loc).lifecycle
    assert lc.init.known and set(lc.stale) == set(w.regions.values())
    assert set(merge.plan_merge(loc).walls) == set(w.regions.values())


def test_discard_holds_the_lease_waits_for_a_maintainer_and_is_fenced(tmp_path):
    """`memwal regions discard` commits under the table's lease, like every maintenance step.
    While another maintainer holds it: a dry run answers at once (it commits nothing); a discard
    waits `--lease-wait`, then discards nothing (exit 1, naming the holder); released while the
    discard waits, the discard commits after the release. In the library, a discard whose lease
    was taken over before its commit is refused by the fence, and nothing is committed."""
    import time

    from memwal_core.options import LeaseOptions
    from memwal_core.state import lease

    root = str(tmp_path / "t")
    loc = open_store(root)
    w = written_two_buckets(loc, seed=2)
    overwrite_and_reinit(loc, num_buckets=2)
    stale = sorted(w.regions.values())
    version = table.open_dataset(loc).version

    other = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=120, wait_seconds=0), run_id="other-run")
    try:
        d = _cli("regions", "discard", root, "--all", "--dry-run", "--lease-wait", "60")
        assert d.returncode == 0 and all(f"would discard region {rid}" in d.stdout for rid in stale), d.stderr
        t0 = time.monotonic()
        d = _cli("regions", "discard", root, "--all", "--lease-wait", "1")
        assert d.returncode == 1, d.stderr
        assert "error: nothing discarded: table " in d.stderr and "(merge, run other-run)" in d.stderr, d.stderr
        assert time.monotonic() - t0 > 1
        assert table.open_dataset(loc).version == version and table.read_memwal_state(loc).merged == {}

        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        p = subprocess.Popen([sys.executable, "-m", "memwal_pipeline.cli", "--verbose", "regions", "discard", root,
                              "--all", "--lease-wait", "120"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        waited = []
        for line in p.stderr:  # the discard reports that it waits for the lease (logged once)
            waited.append(line)
            if "held by" in line and "waiting up to" in line:
                break
        assert any("waiting up to" in x for x in waited), "".join(waited)
        time.sleep(0.5)
        assert table.open_dataset(loc).version == version  # still waiting: nothing committed
    finally:
        other.release()
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert all(f"discarded region {rid}" in out for rid in stale), out
    assert table.open_dataset(loc).version == version + 1
    assert lease.newest(loc).token > other.token  # it took the lease after the release, and released it

    # Fenced: the lease taken over (a later token) between the plan and the commit.
    overwrite_and_reinit(loc, num_buckets=2)
    again = sorted(lifecycle.assess_table(loc).lifecycle.stale)
    assert again == stale
    version = table.open_dataset(loc).version
    with lease.hold(loc, "operator", LeaseOptions(ttl_seconds=30, wait_seconds=0)) as mine:
        rec = lease.LeaseRecord(mine.token + 1, lease.Holder.me("intruder"), "gc", time.time(), time.time() + 30)
        assert loc.store.put_if_absent(layout.lease_key(rec.token), rec.encode())
        with pytest.raises(lease.LeaseLost, match="stale-region discard commit refused"):
            lifecycle.discard(loc, None)
    assert table.open_dataset(loc).version == version and table.read_memwal_state(loc).merged == {}
    assert lease.newest(loc).token == rec.token  # the intruder's record stands


@pytest.mark.parametrize("when", ["before_the_commit_reads", "after_the_commit_read"])
def test_an_overwrite_during_the_merge_run_merges_nothing_into_the_new_table(table_loc, spark, monkeypatch, when):
    """The application overwrites the table and initializes MemWAL again while a merge run is
    under way, after the run checked the table's lifetime: before a commit opens the table (the
    commit sees the new lifetime and the run stops), or after it opened it (Lance refuses the
    commit over the overwrite, and the retry sees the new lifetime). Either way no old row and
    no old region's progress reaches the new table."""
    from memwal_core import faults
    from memwal_core.jobs.merge import commit

    loc = table_loc
    written_two_buckets(loc, seed=5)
    plan = merge.plan_merge(loc)
    assert plan.batches and plan.pending
    new_model: dict = {}

    def overwrite_once() -> None:
        if not new_model:
            new_model.update(overwrite_and_reinit(loc, num_buckets=2))

    if when == "before_the_commit_reads":
        real_open = commit.open_dataset
        monkeypatch.setattr(commit, "open_dataset", lambda *a, **k: (overwrite_once(), real_open(*a, **k))[1])
    else:
        real_point = faults.point
        monkeypatch.setattr(faults, "point", lambda name: (name == "merge.before_commit" and overwrite_once(),
                                                           real_point(name))[1])
    result = merge.execute_merge(loc, plan, spark)
    monkeypatch.undo()
    assert new_model, "the overwrite did not happen"
    assert set(result.region_errors) == set(plan.pending), result.region_errors
    assert all("planned at table version" in e for e in result.region_errors.values()), result.region_errors
    assert rows(loc) == new_model
    assert table.read_memwal_state(loc).merged == {}
    assert result.commits == 0


def test_a_plan_from_before_an_overwrite_merges_nothing_after_gc_cleaned_the_versions_between(table_loc, spark):
    """A merge planned in the table's earlier lifetime runs after the overwrite, the new
    initialization and a GC whose base-version cleanup removed every version in between (the
    ones without the MemWAL index, the only evidence of the break in the table's history). The
    plan's record of its lifetime cannot be trusted across that gap: GC's own record of the
    new lifetime, saved before its cleanup, says the plan is outlived, and nothing is merged."""
    loc = table_loc
    written_two_buckets(loc, seed=7)
    plan = merge.plan_merge(loc)
    assert plan.batches and plan.pending
    new_model = overwrite_and_reinit(loc, num_buckets=2)
    init = lifecycle.assess_table(loc).lifecycle.init.table_version
    res = gc.run_gc(loc, GcOptions(cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0))
    assert res.metrics()["base_versions_cleaned"] > 0, res.base_cleanup
    retained = [v["version"] for v in lance.dataset(loc.lance_uri).versions()]
    assert min(retained) > init - 1, f"versions without the MemWAL index still there: {retained}"
    result = merge.execute_merge(loc, plan, spark)
    assert set(result.region_errors) == set(plan.pending), result.region_errors
    assert all("planned at table version" in e for e in result.region_errors.values()), result.region_errors
    assert result.commits == 0
    assert rows(loc) == new_model
    assert table.read_memwal_state(loc).merged == {}


def test_gc_records_the_initialization_even_when_no_region_could_be_judged_before_its_cleanup(table_loc, monkeypatch):
    """GC's base-version cleanup removes the evidence of the overwrite; the initialization is
    recorded before it even when no region was judged stale then (the old region's manifest
    could not be read at that moment) and the pass fails after the cleanup. Otherwise the old
    lifetime's record would be trusted across the cleaned-up versions and the old region's
    generations merged into the new table."""
    import memwal_core.jobs.gc.run as gc_run

    loc = table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=1, base_rows=5)
    w = demo.Workload(loc, seed=7, key_space=60, max_memtable_rows=10)
    w.write_round(40, puts_per_batch=10)
    lifecycle.assess_table(loc, record=True)  # the old lifetime's record, as a merger saves it
    overwrite_and_reinit(loc, num_buckets=1)
    init = lifecycle.assess_table(loc).lifecycle.init.table_version
    real_assess = lifecycle.assess_table

    def unreadable_regions(loc, **kw):
        with monkeypatch.context() as m:
            m.setattr(region, "load_latest", lambda *a, **k: (_ for _ in ()).throw(OSError("503 SlowDown")))
            return real_assess(loc, **kw)

    def failing_plan(*a, **k):
        raise OSError("503 SlowDown")

    monkeypatch.setattr(lifecycle, "assess_table", unreadable_regions)
    monkeypatch.setattr(gc_run, "plan_gc", failing_plan)
    with pytest.raises(OSError):
        gc.run_gc(loc, GcOptions(cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0))
    monkeypatch.undo()
    assert [v["version"] for v in lance.dataset(loc.lance_uri).versions()] == [init]  # the evidence is gone
    lifecycle._SEEN.clear()  # a new process
    assert lifecycle.recorded_initialization(loc).table_version == init
    assert set(merge.plan_merge(loc).walls) == set(w.regions.values())


def test_an_index_build_read_before_an_overwrite_commits_nothing_into_the_new_lifetime(table_loc):
    """The index builder reads the regions, the table is overwritten and MemWAL initialized
    again, and the build's commit loses its race: its rows list the old lifetime's generations as
    unmerged (they were not stale when read), so it commits nothing rather than publish them in
    the new lifetime's index; the next build publishes no stale generation."""
    loc = table_loc
    w = written_two_buckets(loc, seed=7)
    plan = snapshot.plan_snapshot(loc)
    assert any(row.manifest.generations for row in plan.rows.values())
    overwrite_and_reinit(loc, num_buckets=2)
    version = table.open_dataset(loc).version
    with pytest.raises(snapshot.SnapshotError, match="before the MemWAL initialization"):
        snapshot.execute_snapshot(loc, plan)
    assert table.open_dataset(loc).version == version
    snapshot.build_snapshot(loc)
    published = {str(uuid.UUID(bytes=r["region_id"])): [g["generation"] for g in r["flushed_generations"]]
                 for r in snapshot.read_snapshot(loc).to_pylist()}
    assert set(published) == set(w.regions.values()) and not any(published.values())


def test_value_records_of_an_earlier_lifetime_are_never_used(table_loc):
    """A lifetime after an overwrite and a new `initialize_mem_wal` may shard differently, so
    the region values recorded in an earlier one stand for nothing in it: not for GC, not for
    the merger, not for the index builder. An index build read before the overwrite records its
    values in its own lifetime (the overwrite landing between its records and its commit), and a
    record of an earlier lifetime under the new one's key (a table re-created, its versions
    counted from 1 again) is not used and is replaced; one of a later lifetime is never replaced
    by a process behind it."""
    from support.gc_passes import mark_merged

    loc = table_loc
    w = written_two_buckets(loc, seed=9)
    mark_merged(loc, w.regions.values())
    plan = snapshot.plan_snapshot(loc)  # values read from merged generations: recorded by the execution
    first = plan.lifecycle.init
    assert first.known and all(r.fields.source.durable for r in plan.rows.values())
    overwrite_and_reinit(loc, num_buckets=2)
    with pytest.raises(snapshot.SnapshotError, match="before the MemWAL initialization"):
        snapshot.execute_snapshot(loc, plan)
    old = value_records.read(loc, first).values
    assert set(old) == set(w.regions.values())
    view = lifecycle.assess_table(loc, record=False)
    init, state = view.lifecycle.init, view.state
    assert init.known and init.table_version > first.table_version
    assert value_records.read(loc, init).values == {}
    assert snapshot.recorded_values(loc, state, init) == {}
    assert region_values.unrecorded_regions(loc, state, view.reads.manifests, init) == set(old)
    res = snapshot.build_snapshot(loc)  # the old regions are stale here: no value, nothing recorded
    assert not any(res.region_field_sources[rid].startswith("derived") for rid in old)
    assert value_records.read(loc, init).values == {}

    rid = sorted(old)[0]
    earlier = lifecycle.Initialization(init.table_version, init.initialized_at - 3600, None, init.table_version)
    assert value_records.write(loc, earlier, rid, 1, {"bucket": 1}, "derived:gen_1", INT32)
    assert value_records.read(loc, init).values == {}
    assert region_values.unrecorded_regions(loc, state, view.reads.manifests, init) == set(old)
    assert value_records.write(loc, init, rid, 1, {"bucket": 0}, "derived:gen_2", INT32)  # replaces it
    assert value_records.read(loc, init).values[rid].values == {"bucket": 0}
    assert not value_records.write(loc, earlier, rid, 1, {"bucket": 1}, "derived:gen_1", INT32)
    assert value_records.read(loc, init).values[rid].values == {"bucket": 0}
    assert value_records.read(loc, earlier).values == {}


def test_a_plan_is_outlived_when_gc_cleaned_the_versions_while_the_check_read_them(table_loc, monkeypatch):
    """The check that a plan's lifetime is still the table's reads the versions, then the
    record: a GC (one that took the lease over) recording the new lifetime and cleaning up the
    versions without the index while the check runs cannot hide the overwrite from it."""
    loc = table_loc
    written_two_buckets(loc, seed=7)
    plan = merge.plan_merge(loc)
    overwrite_and_reinit(loc, num_buckets=2)
    version = table.open_dataset(loc).version
    real = lifecycle.find_initialization
    ran = []

    def gc_first(*a, **k):
        if not ran:
            ran.append(None)
            monkeypatch.setattr(lifecycle, "find_initialization", real)
            ran[0] = gc.run_gc(loc, GcOptions(cleanup_base_versions_older_than_seconds=0,
                                              cleanup_base_versions_floor_seconds=0))
        return real(*a, **k)

    monkeypatch.setattr(lifecycle, "find_initialization", gc_first)
    now = lifecycle.outlived(loc, plan.table_version, plan.lifecycle.init, version)
    assert ran and ran[0].metrics()["base_versions_cleaned"] > 0
    assert now is not None and now.table_version == version


def test_a_process_of_the_earlier_lifetime_never_records_it_over_the_later_one(table_loc, spark):
    """A merge planned before an overwrite carries the earlier lifetime's lifecycle; saving it
    (as a run saves its plan's verdicts) once the table's record holds the later initialization
    leaves the record alone, so no later check goes from the earlier lifetime."""
    loc = table_loc
    written_two_buckets(loc, seed=11, writes=20)
    plan = merge.plan_merge(loc)
    old = plan.lifecycle
    assert old is not None and old.init is not None
    overwrite_and_reinit(loc, num_buckets=2)
    new = lifecycle.assess_table(loc, record=True).lifecycle
    assert new.init.table_version > old.init.table_version
    before = loc.store.get(layout.LIFECYCLE_KEY)
    old.unrecorded = True
    lifecycle.save(loc, old, strict=True)
    assert loc.store.get(layout.LIFECYCLE_KEY) == before
    assert lifecycle.recorded_initialization(loc).table_version == new.init.table_version
    # A garbled record is derived again from the table, and written over.
    loc.store.put(layout.LIFECYCLE_KEY, b'{"initialization": {"checked_version": 3}}')
    assert lifecycle.recorded_initialization(loc) is None
    again = lifecycle.assess_table(loc, record=True).lifecycle
    assert again.init.table_version == new.init.table_version
    assert lifecycle.recorded_initialization(loc).table_version == new.init.table_version


def test_gc_never_discards_by_itself_a_region_whose_progress_no_discard_recorded(table_loc, spark):
    """The table restored to a version from before an overwrite and re-initialization: its
    MemWAL index (with its regions' merge progress) is back, the restore is not recognised as a
    lifetime of its own, and the regions are judged stale. Their pending generations are the
    restored lifetime's: GC's grace does not discard them (the operator still can), and says why."""
    loc = table_loc
    w = written_two_buckets(loc, seed=13)
    merge.merge(loc, spark)
    w.write_round(20, puts_per_batch=10)
    merged = table.read_memwal_state(loc).merged
    assert merged and merge.plan_merge(loc).batches
    before = table.open_dataset(loc).version
    overwrite_and_reinit(loc, num_buckets=2)
    lance.dataset(loc.lance_uri, version=before).restore()
    lc = lifecycle.assess_table(loc).lifecycle
    assert set(lc.stale) & set(merged), lc.stale  # the documented limit: not recognised
    for _ in range(2):  # the first pass records the verdicts; the grace counts from then
        res = gc.run_gc(loc, GcOptions(discard_stale_after_seconds=0))
        assert res.stale_discarded == {}
    assert table.read_memwal_state(loc).merged == merged
    dry = lifecycle.discard(loc, None, dry_run=True, by="grace", only_older_than=0)
    assert not dry.discarded and all("no discard recorded" in why for why in dry.refused.values()), dry.refused


def test_a_merge_whose_check_cannot_read_the_lifecycle_record_merges_nothing(table_loc, spark):
    """The outlived check goes from the table's record too (the only evidence of a break GC's
    cleanup may have hidden): when the store cannot read it (here the key is a directory), the
    run cannot tell and merges nothing; readable again, the next run merges."""
    loc = table_loc
    written_two_buckets(loc, seed=17)
    plan = merge.plan_merge(loc)
    assert plan.batches
    lifecycle.assess_table(loc, record=True)
    path = os.path.join(loc.store.root, layout.LIFECYCLE_KEY)
    os.replace(path, path + ".kept")
    os.mkdir(path)
    result = merge.execute_merge(loc, plan, spark)
    assert result.commits == 0 and set(result.region_errors) == set(plan.pending), result.region_errors
    assert all("initialization cannot be read" in e for e in result.region_errors.values()), result.region_errors
    assert table.read_memwal_state(loc).merged == {}
    os.rmdir(path)
    os.replace(path + ".kept", path)
    assert merge.execute_merge(loc, merge.plan_merge(loc), spark).commits > 0


def test_a_lifecycle_record_the_store_fails_to_give_stops_every_job_instead_of_an_unknown_lifetime(table_loc):
    """Once GC cleaned up the versions around the initialization, only `_memwal/lifecycle.json`
    knows the lifetime. A store that fails to give it (here the key is a directory) is not "no
    record": worked out again, the lifetime would be unknown, the region value records would not
    be read, and the merger would establish the values of regions whose merged generations GC
    trimmed on the records' word from their next, unchecked, rows. So the merger's and the index
    builder's plans, GC's pass (which so deletes nothing) and the readers stop with an error
    naming the file; readable again, all go on with the recorded lifetime."""
    from support.gc_passes import forget_process, mark_merged

    loc = table_loc
    w = written_two_buckets(loc, seed=23)
    mark_merged(loc, w.regions.values())
    assert snapshot.build_snapshot(loc, inline_threshold=0).external
    w.write_round(30, puts_per_batch=10)
    mark_merged(loc, w.regions.values())  # the external snapshot is left behind: the records stand in
    gc.run_gc(loc, GcOptions(manifest_retention=3, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                             cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0))
    ds = table.open_dataset(loc)
    assert len(ds.versions()) == 1
    init = lifecycle.recorded_initialization(loc)
    assert init.known and init.table_version < ds.version
    w.write_round(30, puts_per_batch=10)  # pending generations for the merger
    forget_process()
    path = os.path.join(loc.store.root, layout.LIFECYCLE_KEY)
    os.replace(path, path + ".kept")
    os.mkdir(path)
    listed = sorted(o.key for o in loc.store.list(layout.MEM_WAL_DIR))
    for job in (merge.plan_merge, snapshot.plan_snapshot, gc.run_gc, status.table_status, reader.lsm_table):
        with pytest.raises(lifecycle.LifecycleUnreadable, match=layout.LIFECYCLE_KEY):
            job(loc)
    assert sorted(o.key for o in loc.store.list(layout.MEM_WAL_DIR)) == listed  # GC deleted nothing
    os.rmdir(path)
    os.replace(path + ".kept", path)
    plan = merge.plan_merge(loc)
    assert plan.lifecycle.init == lifecycle.Initialization(init.table_version, init.initialized_at,
                                                           init.previous_version, ds.version)
    assert plan.batches and not plan.walls


# ---------------------------------------------------------------------------------------------
# GC's lifetime check answered from the retained versions the pass reads anyway (`run._indexed`):
# whatever happened to the table or to the version summary, it decides what reading every
# version it checks decides, and reads only the versions the pass did not read.

KEEP_ALL = GcOptions(discard_stale_after_seconds=None)  # the shipped retention: every version kept
CLEAN_ALL = GcOptions(discard_stale_after_seconds=None, cleanup_base_versions_older_than_seconds=0,
                      cleanup_base_versions_floor_seconds=0, cleanup_base_versions_retain=3,
                      manifest_min_age_seconds=0, orphan_grace_seconds=0)


def _verdicts(lc: lifecycle.Lifecycle) -> tuple:
    """What a lifetime check decides: the initialization and every region's verdict."""
    i = lc.init
    return (i.table_version, i.initialized_at, i.previous_version), \
        {rid: v.stale_through for rid, v in lc.stale.items()}, set(lc.fresh)


def _read_in_full(loc) -> tuple:
    """The verdicts of a new process that reads every version its check needs (none fed)."""
    lifecycle._SEEN.clear()
    return _verdicts(lifecycle.assess_table(loc).lifecycle)


@pytest.fixture
def manifest_reads(monkeypatch) -> list[int]:
    """The table versions whose manifests the lifetime check reads."""
    reads: list[int] = []
    real = lifecycle._has_index
    monkeypatch.setattr(lifecycle, "_has_index", lambda loc, v: reads.append(v) or real(loc, v))
    return reads


def _gc_pass(loc, config: GcOptions = KEEP_ALL) -> gc.GcResult:
    from support.gc_passes import forget_process

    forget_process()
    return gc.run_gc(loc, config)


def _reopen_one(loc, w: demo.Workload) -> str:
    """A writer re-opens one of `w`'s regions after an overwrite (its region id)."""
    value, rid = sorted(w.regions.items())[0]
    put(loc, rid, keys_of(w, value, 5000, 3), 8, {})
    return rid


def test_gc_finds_an_overwrite_from_the_versions_it_read_without_reading_them_again(table_loc, manifest_reads):
    """The table overwritten between two passes: the second pass's history reads the new
    versions (its summary knows the others), and the lifetime check reads no manifest at all,
    yet finds the new lifetime and judges the old regions stale, exactly as a full read does."""
    loc = table_loc
    w = written_two_buckets(loc, seed=11)
    _gc_pass(loc)  # the version summary and the lifecycle record
    overwrite_and_reinit(loc, num_buckets=2)
    _reopen_one(loc, w)
    expected = _read_in_full(loc)
    manifest_reads.clear()
    r = _gc_pass(loc)
    assert r.plan.history.summary == "used" and not r.plan.history.listed
    assert _verdicts(r.plan.lifecycle) == expected
    assert set(expected[1]) == set(w.regions.values()) and expected[0][2] is not None
    assert manifest_reads == []


@pytest.mark.parametrize("summary", ["garbled", "missing", "another table's"])
def test_a_summary_gc_cannot_use_leaves_the_lifetime_check_as_a_full_read(table_loc, tmp_path, summary):
    """A version summary that is garbled, missing, or sealed but of another table is read
    around (`history.py`): the versions the check is fed are then the ones just read."""
    loc = table_loc
    w = written_two_buckets(loc, seed=12)
    _gc_pass(loc)
    overwrite_and_reinit(loc, num_buckets=2)
    _reopen_one(loc, w)
    if summary == "garbled":
        loc.store.put(layout.GC_VERSIONS_KEY, b'{"format": 1, "body": "[]", "sha256": "0"}')
    elif summary == "missing":
        loc.store.delete_many([layout.GC_VERSIONS_KEY])
    else:  # a summary GC wrote for a table with this layout of versions, but not this one
        other = open_store(str(tmp_path / "other"))
        written_two_buckets(other, seed=12)
        for _ in range(3):
            table.open_dataset(other).update_config({"k": "v"})
        _gc_pass(other)
        loc.store.put(layout.GC_VERSIONS_KEY, other.store.get(layout.GC_VERSIONS_KEY))
    expected = _read_in_full(loc)
    r = _gc_pass(loc)
    assert r.plan.history.listed and r.plan.history.known == 0  # every version read again
    assert _verdicts(r.plan.lifecycle) == expected and set(expected[1]) == set(w.regions.values())


def test_versions_committed_after_the_history_was_read_are_read_by_the_check(table_loc, manifest_reads, monkeypatch):
    """An overwrite lands between the pass's read of the versions and its opening of the table:
    the check reads those versions' manifests (they are not in what the pass read) and finds
    the new lifetime."""
    import memwal_core.jobs.gc.run as gc_run

    loc = table_loc
    w = written_two_buckets(loc, seed=13)
    _gc_pass(loc)
    real, read = gc_run._versions, []

    def then_overwritten(*a, **k):
        h = real(*a, **k)
        read.append(max(h.facts))
        overwrite_and_reinit(loc, num_buckets=2)
        return h

    monkeypatch.setattr(gc_run, "_versions", then_overwritten)
    manifest_reads.clear()
    r = _gc_pass(loc)
    monkeypatch.undo()
    top = read[0]
    assert set(manifest_reads) == {top + 1, top + 2} == set(range(top + 1, table.open_dataset(loc).version + 1))
    loc.store.delete_many([layout.LIFECYCLE_KEY])  # what the walk finds from nothing, reading every version
    assert _verdicts(r.plan.lifecycle) == _read_in_full(loc)
    assert r.plan.lifecycle.init.table_version == top + 2 and set(r.plan.lifecycle.stale) == set(w.regions.values())


@pytest.mark.parametrize("kept", [2, 4])
def test_versions_cleaned_up_elsewhere_since_the_last_pass(table_loc, kept):
    """Another process's cleanup removed versions GC's summary knows (with 2 kept, the
    overwrite itself): the pass lists `_versions/`, and the check decides what reading the
    retained versions decides (versions cleaned up answer "not retained", as ever)."""
    loc = table_loc
    w = written_two_buckets(loc, seed=14)
    _gc_pass(loc)
    overwrite_and_reinit(loc, num_buckets=2)
    _reopen_one(loc, w)
    table.open_dataset(loc).update_config({"k": "v"})
    table.open_dataset(loc).cleanup_old_versions(older_than=__import__("datetime").timedelta(0),
                                                 retain_versions=kept)
    expected = _read_in_full(loc)
    r = _gc_pass(loc)
    assert r.plan.history.listed and len(r.plan.history.facts) == kept
    assert _verdicts(r.plan.lifecycle) == expected


def test_a_table_recreated_while_the_pass_read_its_versions_is_checked_by_reading(table_loc, monkeypatch):
    """The table removed and created again (shorter) between the pass's read of the versions and
    its opening of the table: what was read describes the old table, whose version 3 (an
    overwrite) had no index where the new table's has one; the check does not use it."""
    import memwal_core.jobs.gc.run as gc_run
    import shutil

    loc = table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=5)
    overwrite_and_reinit(loc, num_buckets=2)  # versions 3 (no index) and 4
    for _ in range(3):
        table.open_dataset(loc).update_config({"k": "v"})
    _gc_pass(loc)
    real = gc_run._versions

    def then_recreated(*a, **k):
        h = real(*a, **k)
        for d in ("_versions", "data", "_transactions", "_deletions", "_indices"):
            shutil.rmtree(os.path.join(loc.lance_uri, d), ignore_errors=True)
        demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=5)
        table.open_dataset(loc).update_config({"k": "v"})  # version 3, with the index
        return h

    monkeypatch.setattr(gc_run, "_versions", then_recreated)
    r = _gc_pass(loc)
    monkeypatch.undo()
    assert table.open_dataset(loc).version == 3 and r.plan.lifecycle.init.table_version == 2
    loc.store.delete_many([layout.LIFECYCLE_KEY])
    assert _verdicts(r.plan.lifecycle)[0] == _read_in_full(loc)[0]


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.sampled_from(["write", "commit", "overwrite", "reopen", "gc_keep", "gc_keep", "gc_clean",
                                     "cleanup_elsewhere", "garble", "drop_record"]), min_size=4, max_size=9),
       seed=st.integers(0, 1000))
def test_the_fed_lifetime_check_decides_what_a_full_read_does(ops, seed):
    """Property: over random histories of writes, commits, overwrites, GC passes (keeping every
    version, or cleaning all but 3), another process's cleanup, a garbled version summary and a
    lost lifecycle record, each GC pass judges the lifetime and the regions exactly as a new
    process reading every version it checks judges them right before the pass."""
    from datetime import timedelta

    with tempfile.TemporaryDirectory() as d:
        loc = open_store(os.path.join(d, "t"))
        w = written_two_buckets(loc, seed=seed, writes=20)
        for op in ops:
            if op == "write":
                w.write_round(10, puts_per_batch=5)
            elif op == "commit":
                table.open_dataset(loc).update_config({"k": str(seed)})
            elif op == "overwrite":
                overwrite_and_reinit(loc, num_buckets=2)
            elif op == "reopen":
                _reopen_one(loc, w)
            elif op == "cleanup_elsewhere":
                table.open_dataset(loc).cleanup_old_versions(older_than=timedelta(0), retain_versions=2)
            elif op == "garble" and loc.store.exists(layout.GC_VERSIONS_KEY):
                raw = loc.store.get(layout.GC_VERSIONS_KEY)
                loc.store.put(layout.GC_VERSIONS_KEY, raw[: len(raw) // 2])
            elif op == "drop_record":
                loc.store.delete_many([layout.LIFECYCLE_KEY])
            elif op.startswith("gc_"):
                expected = _read_in_full(loc)
                r = _gc_pass(loc, KEEP_ALL if op == "gc_keep" else CLEAN_ALL)
                assert _verdicts(r.plan.lifecycle) == expected, op
