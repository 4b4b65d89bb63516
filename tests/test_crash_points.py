"""Crash points: the merger, compaction, the MemWAL index builder and GC killed at every write, then rerun.

Each job first runs once un-killed in a subprocess with `MEMWAL_COUNT_OPS=1`, which reports its
K counted writes (object-store `put` / `put_if_absent` / `delete_many` and Lance commit points,
see memwal_core/faults.py). Then, on fresh copies of the same table, a subprocess is killed
(`os._exit(137)`, like kill -9) right before its k-th write, for every k in 1..K (the merger: a
sample in the suite, every k under `make soak`); with `MEMWAL_CRASH_TORN=1` a `delete_many` that
is the k-th write first deletes half of its keys. After each kill:

- the table reads correctly right away (LSM read through pylance == the writers' model) and
  no listed generation is missing (`checks.missing_generations`);
- a rerun in this process converges: it ends where the un-killed run ended (same files under
  `_mem_wal/` and the same base-table versions; the index builder: the same region snapshot);
- after a final merge the base table alone equals the model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from memwal_core import faults
from memwal_core.jobs import catchup, compaction, gc, merge, snapshot
from memwal_core.observe import checks, reader
from memwal_core.state import layout, region, table
from memwal_core.state.store import open_store
from memwal_core.tools import demo

PROCS = os.path.join(os.path.dirname(__file__), "procs")
JOB = os.path.join(PROCS, "reliability_job.py")
SOAK = bool(os.environ.get("MEMWAL_SOAK"))
soak = pytest.mark.skipif(not SOAK, reason="soak variant: run with MEMWAL_SOAK=1 (make soak)")
PARALLEL = 3  # killed subprocesses at once (2 cores: they are mostly interpreter start-up)

sys.path.insert(0, PROCS)
from reliability_job import GC_CONFIG  # noqa: E402

# ---------------------------------------------------------------------------------- helpers

def as_dict(t: pa.Table) -> dict:
    return {r["id"]: r for r in t.to_pylist()}


def lsm_rows(loc) -> dict:
    return as_dict(reader.lsm_table(loc))


def base_rows(loc) -> dict:
    return as_dict(table.open_dataset(loc).to_table())


def paths(root: str, under: str = "") -> set[str]:
    """Every file under `root` but the table lease's records (their tokens count the steps run)."""
    top = os.path.join(root, under) if under else root
    out = set()
    for d, _dirs, files in os.walk(top):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if not rel.startswith(layout.LEASE_DIR + "/"):
                out.add(rel)
    return out


def non_manifest(ps: set[str]) -> set[str]:
    return {p for p in ps if not (p.startswith(layout.MEM_WAL_DIR) and p.endswith(layout.MANIFEST_SUFFIX))}


def manifest_versions(ps: set[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for p in ps:
        parts = p.split("/")
        if parts[0] == layout.MEM_WAL_DIR and p.endswith(layout.MANIFEST_SUFFIX):
            out.setdefault(parts[1], []).append(layout.parse_bitrev(parts[-1]))
    return {k: sorted(v) for k, v in out.items()}


def hints(loc) -> dict[str, int | None]:
    return {rid: region.read_version_hint(loc.store, rid) for rid in region.list_regions(loc.store).region_ids}


def run_job(job: str, uri: str, env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEMWAL_")}
    return subprocess.run([sys.executable, JOB, job, uri, *args], capture_output=True, text=True,
                          env={**full, **env}, timeout=timeout)


def count_ops(job: str, uri: str, *args: str) -> tuple[list[str], dict]:
    p = run_job(job, uri, {"MEMWAL_COUNT_OPS": "1"}, *args)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return out["ops"], out["result"]


def kill_points(ops: list[str], every: bool, focus: str = "") -> list[tuple[int, bool]]:
    """(k, torn) pairs: every write plus a torn variant of each multi-key delete; in the suite,
    the first and last writes and every write that names `focus` (one region: all kinds)."""
    ks = [k for k in range(1, len(ops) + 1) if every or k in (1, len(ops)) or focus in ops[k - 1]]
    torn = [k for k in ks if ops[k - 1].startswith("delete_many") and not ops[k - 1].startswith("delete_many 1 ")]
    return [(k, False) for k in ks] + [(k, True) for k in torn]


def kill_many(job: str, cases: list[tuple[int, bool, str]], *args: str) -> list[subprocess.CompletedProcess]:
    """Run the killed subprocesses, PARALLEL at a time; each must die right before write k."""
    def one(case):
        k, torn, uri = case
        env = {"MEMWAL_CRASH_AFTER_OPS": str(k), **({"MEMWAL_CRASH_TORN": "1"} if torn else {})}
        return run_job(job, uri, env, *args)

    with ThreadPoolExecutor(PARALLEL) as pool:
        procs = list(pool.map(one, cases))
    for (k, torn, _), p in zip(cases, procs):
        assert p.returncode == faults.EXIT_CODE, f"k={k} torn={torn}: {p.returncode} {p.stderr[-3000:]}"
        assert f"memwal crash before write {k}:" in p.stderr, p.stderr[-2000:]
    return procs


def crashed_at(p: subprocess.CompletedProcess) -> str:
    return [ln for ln in p.stderr.splitlines() if ln.startswith("memwal crash before write")][-1]


def assert_reads_correctly(loc, model: dict, what: str) -> None:
    assert lsm_rows(loc) == model, what
    assert checks.missing_generations(loc) == {}, what


def print_summary(name: str, ops: list[str], points, seconds: float) -> None:
    torn = sum(1 for _, t in points if t)
    print(f"\n[crash points] {name}: K={len(ops)} writes; killed at {len(points) - torn} points "
          f"+ {torn} torn deletes; all converged ({seconds:.1f} s)")
    for i, o in enumerate(ops, 1):
        print(f"   write {i}: {o}")


# ------------------------------------------------------------------------- shared template

@pytest.fixture(scope="module")
def template(tmp_path_factory, spark):
    """4 bucket regions: two rounds merged, one round pending, one region with durable WAL
    entries past its hint (a writer that died before flushing), an old orphan directory."""
    root = str(tmp_path_factory.mktemp("crash_template") / "t")
    loc = open_store(root)
    demo.create_table(loc, sharding="bucket", num_buckets=4, base_rows=30)
    w = demo.Workload(loc, seed=17, key_space=300, max_memtable_rows=30)
    for _ in range(2):
        w.write_round(100, overwrite=0.3, delete=0.05, puts_per_batch=10)
    assert not merge.merge(loc, spark).region_errors
    w.write_round(60, overwrite=0.3, delete=0.05, puts_per_batch=10)
    rids = sorted(w.regions.values())
    # Durable WAL entries that are not flushed: the index builder raises their WAL hints. They
    # are not in any generation, so they are not part of what a reader sees yet (the model).
    writers = [subprocess.Popen([sys.executable, os.path.join(PROCS, "crash_writer.py"), loc.lance_uri, rid,
                                 str(5000 + 100 * i), "6", "9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for i, rid in enumerate(rids[1:3])]
    for p in writers:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    # An unlisted generation directory from a long-dead flush: GC's orphan sweep takes it.
    orphan = f"{layout.region_dir(rids[0])}/deadbeef_gen_1"
    for f in ("data/a.lance", "_versions/1.manifest"):
        loc.store.put(f"{orphan}/{f}", b"x" * 64)
        old = time.time() - 7200
        os.utime(os.path.join(root, orphan, f), (old, old))
    return root, w.expected(), rids[0]


def copy_of(template, dst: str):
    shutil.copytree(template[0], dst)
    return open_store(dst)


# ----------------------------------------------------------------------------------- GC

def _gc_crash_points(template, tmp_path, spark, every: bool) -> None:
    t0 = time.monotonic()
    # As the maintenance job runs them: the index builder first, so the regions' values are
    # recorded and GC may trim merged generations (it keeps them otherwise).
    snapshot.build_snapshot(copy_of(template, str(tmp_path / "template")))
    template = (str(tmp_path / "template"), *template[1:])
    model = template[1]
    base = copy_of(template, str(tmp_path / "baseline"))
    ops, result = count_ops("gc", base.lance_uri)
    assert result["deleted"]["generation"] > 0 and result["deleted"]["orphan"] == 1
    assert result["deleted"]["manifest"] > 0 and result["manifest_commits"] > 0
    assert ops[0] == "lance_cleanup_old_versions" and any(o.startswith("put_if_absent") for o in ops)
    assert_reads_correctly(base, model, "baseline")
    want_paths, want_hints = paths(base.store.root), hints(base)

    points = kill_points(ops, every, focus=f"{layout.MEM_WAL_DIR}/{template[2]}/")
    cases = [(k, torn, str(tmp_path / f"k{k}{'t' if torn else ''}")) for k, torn in points]
    for _, _, d in cases:
        copy_of(template, d)
    procs = kill_many("gc", cases)
    merged_checked = 0
    for (k, torn, d), p in zip(cases, procs):
        what = f"gc killed before write {k}{' (torn)' if torn else ''}: {crashed_at(p)}"
        loc = open_store(d)
        assert_reads_correctly(loc, model, what)  # right after the kill
        res = gc.run_gc(loc, GC_CONFIG)
        assert not res.region_errors, what
        assert_reads_correctly(loc, model, what)
        # The same files as the un-killed run, but for old manifest versions: GC keeps the
        # newest `manifest_retention` counted from the version it planned from, so a rerun
        # planning from the trimmed version may keep one version fewer (still contiguous).
        got = paths(d)
        assert non_manifest(got) == non_manifest(want_paths), \
            f"{what}: extra {sorted(got - want_paths)[:5]}, missing {sorted(want_paths - got)[:5]}"
        for rid, versions in manifest_versions(got).items():
            want = manifest_versions(want_paths)[rid]
            assert max(versions) == max(want) and versions == list(range(min(versions), max(versions) + 1)), what
            assert len(versions) >= GC_CONFIG.manifest_retention and set(versions) <= set(want), what
        # Version hints: as the un-killed run left them, except after a kill between a trim
        # commit and its hint update: then the hint stays one version behind (best effort by
        # design: readers probe forward from it) and the rerun, which commits nothing, leaves it.
        for rid, hint in hints(loc).items():
            latest = region.load_latest(loc.store, rid).version
            assert hint == want_hints[rid] or (ops[k - 1].startswith(f"put {layout.version_hint_key(rid)}")
                                              and hint == latest - 1), what
            assert loc.store.exists(layout.manifest_key(rid, hint)), what
        if every or k in (1, len(ops)):
            assert not merge.merge(loc, spark).region_errors
            assert base_rows(loc) == model, what
            merged_checked += 1
    assert merged_checked
    print_summary("gc", ops, points, time.monotonic() - t0)


def test_gc_killed_at_every_write(template, tmp_path, spark):
    _gc_crash_points(template, tmp_path, spark, every=False)


@soak
@pytest.mark.slow
def test_gc_killed_at_every_write_soak(template, tmp_path, spark):
    _gc_crash_points(template, tmp_path, spark, every=True)


# -------------------------------------------------------------------- MemWAL index builder

def snapshot_rows(loc) -> list[dict]:
    return sorted(snapshot.read_snapshot(loc).to_pylist(), key=lambda r: r["region_id"])


@pytest.mark.parametrize("inline_threshold", [
    0, pytest.param(100, marks=[soak, pytest.mark.slow])], ids=["external", "inline"])
def test_index_builder_killed_at_every_write(template, tmp_path, spark, inline_threshold):
    """Every write of the index builder (two WAL-hint commits, the external snapshot file, the
    guarded commit); the inline variant (the same minus the file) under soak."""
    t0 = time.monotonic()
    model = template[1]
    args = ("--inline-threshold", str(inline_threshold))
    base = copy_of(template, str(tmp_path / "baseline"))
    merged_before = table.read_memwal_state(base).merged
    ops, result = count_ops("snapshot", base.lance_uri, *args)
    assert len(result["hints_updated"]) == 2 and result["storage"] == ("inline" if inline_threshold else "external")
    assert ops[-1].startswith("lance_commit memwal_index")
    want_rows, want_version = snapshot_rows(base), table.open_dataset(base).version
    want_regions = paths(base.store.root, layout.MEM_WAL_DIR)

    points = [(k, False) for k in range(1, len(ops) + 1)]
    cases = [(k, False, str(tmp_path / f"k{k}")) for k, _ in points]
    for _, _, d in cases:
        copy_of(template, d)
    procs = kill_many("snapshot", cases, *args)
    leftovers = 0
    for (k, _, d), p in zip(cases, procs):
        what = f"index builder killed before write {k}: {crashed_at(p)}"
        loc = open_store(d)
        assert_reads_correctly(loc, model, what)
        assert table.read_memwal_state(loc).merged == merged_before, what
        r = snapshot.build_snapshot(loc, inline_threshold=inline_threshold)
        assert not r.region_errors and not r.hint_errors, what
        assert snapshot_rows(loc) == want_rows, what  # the same snapshot as the un-killed run
        assert table.open_dataset(loc).version == want_version, what
        assert table.read_memwal_state(loc).merged == merged_before, what  # progress never erased
        assert paths(d, layout.MEM_WAL_DIR) == want_regions, what
        # A kill inside the commit leaves the external snapshot file it had written: unreferenced.
        extra = {x for x in paths(d, "_indices") - paths(base.store.root, "_indices")}
        idx_uuid = str(uuid.UUID(bytes=table.read_memwal_state(loc).index.uuid.uuid))
        leftovers += len([x for x in extra if idx_uuid not in x])
        assert_reads_correctly(loc, model, what)
    loc = open_store(cases[-1][2])
    assert not merge.merge(loc, spark).region_errors
    assert base_rows(loc) == model
    print_summary(f"index builder ({'inline' if inline_threshold else 'external'} snapshot)", ops, points,
                  time.monotonic() - t0)
    print(f"   unreferenced snapshot files left by kills inside the commit: {leftovers}")


# ----------------------------------------------------------------------------------- merger

@pytest.fixture(scope="module")
def merge_template(tmp_path_factory):
    """3 regions, nothing merged yet, enough data for several byte-bounded batches."""
    root = str(tmp_path_factory.mktemp("merge_crash_template") / "t")
    loc = open_store(root)
    demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=30)
    w = demo.Workload(loc, seed=23, key_space=300, max_memtable_rows=30)
    for _ in range(3):
        w.write_round(90, overwrite=0.4, delete=0.05, puts_per_batch=10)
    return root, w.expected()


# The merger's counted writes per batch, in order: the marker of the commit in flight
# (`jobs/merge/unverified.py`), the Lance commit, the marker's deletion once the commit is checked.
MERGE_WRITES = ("put", "lance_commit", "delete_many")


def _merge_write(batch: int, kind: str) -> int:
    """The number of the merger's write `kind` of batch `batch` (both 1-based)."""
    return len(MERGE_WRITES) * (batch - 1) + MERGE_WRITES.index(kind) + 1


def _merge_crash_points(merge_template, tmp_path, spark, monkeypatch, ks) -> None:
    t0 = time.monotonic()
    _, model = merge_template
    base = copy_of(merge_template, str(tmp_path / "baseline"))
    whole = merge.plan_merge(base).batches[0]
    budget = max(max(g.bytes for g in whole.generations), whole.bytes // 3)
    plan = merge.plan_merge(base, budget_bytes=budget)
    n = len(plan.batches)
    assert n >= 3
    ks = [k for k in ks if k <= len(MERGE_WRITES) * n] if ks else list(range(1, len(MERGE_WRITES) * n + 1))
    cases = [(k, str(tmp_path / f"k{k}")) for k in ks]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMWAL_")}
    procs = []
    for k, d in cases:  # started first: their JVM start-up overlaps the un-killed run below
        copy_of(merge_template, d)
        procs.append(subprocess.Popen([sys.executable, JOB, "merge", d, "--budget", str(budget)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**env, "MEMWAL_CRASH_AFTER_OPS": str(k)}))
    # The un-killed run, counted in this process (the session's Spark: no extra JVM start).
    monkeypatch.setenv("MEMWAL_COUNT_OPS", "1")
    monkeypatch.setattr(faults, "_ops", [])
    r = merge.execute_merge(open_store(base.lance_uri), plan, spark)  # opened counting: its store writes count
    ops = faults.ops()
    monkeypatch.delenv("MEMWAL_COUNT_OPS")
    assert r.commits == n
    assert [o.split(" ")[0] for o in ops[: len(MERGE_WRITES) * n]] == list(MERGE_WRITES) * n, ops
    assert all("_memwal/unverified/" in o for o in ops[: len(MERGE_WRITES) * n] if not o.startswith("lance_commit"))
    assert base_rows(base) == model
    want_merged = table.read_memwal_state(base).merged
    for (k, d), p in zip(cases, procs):
        _, err = p.communicate(timeout=600)
        assert p.returncode == faults.EXIT_CODE, f"k={k}: {err[-3000:]}"
        kind = MERGE_WRITES[(k - 1) % len(MERGE_WRITES)]
        assert f"memwal crash before write {k}: {kind}" in err, err[-3000:]
        landed = k // len(MERGE_WRITES)  # batch b's commit is write 3b-1: those before write k landed
        what = f"merger killed before write {k} ({kind} of batch {(k - 1) // len(MERGE_WRITES) + 1} of {n})"
        loc = open_store(d)
        expect = {}
        for b in plan.batches[:landed]:
            expect.update(b.progress)
        assert table.read_memwal_state(loc).merged == expect, what
        assert_reads_correctly(loc, model, what)
        res = merge.merge(loc, spark, budget_bytes=budget)
        assert not res.region_errors, what
        assert res.commits == n - landed, what
        assert base_rows(loc) == model, what
        assert table.read_memwal_state(loc).merged == want_merged, what
        assert merge.plan_merge(loc).batches == [], what
        assert list(loc.store.list("_memwal/unverified")) == [], what  # every commit in flight settled
    print_summary("merger", ops, [(k, False) for k in ks], time.monotonic() - t0)


def test_merger_killed_inside_a_later_commit(merge_template, tmp_path, spark, monkeypatch):
    """In the suite two points: inside the second of several commits, and after the first
    commit landed but before its check was recorded done (its marker left: the rerun checks
    it); tests/test_merge.py covers the first commit before / during / after. Every write under
    soak."""
    _merge_crash_points(merge_template, tmp_path, spark, monkeypatch,
                        [_merge_write(2, "lance_commit"), _merge_write(1, "delete_many")])


@soak
@pytest.mark.slow
def test_merger_killed_at_every_commit_soak(merge_template, tmp_path, spark, monkeypatch):
    _merge_crash_points(merge_template, tmp_path, spark, monkeypatch, None)


# ------------------------------------------------------------------------------- compaction

def test_compaction_killed_at_every_commit_then_rerun(tmp_path, spark):
    """A fragmented table (30 base fragments with deletions, two merges, caught up). The
    compaction job (own JVM) is killed before each of its Lance commits (ReserveFragments, the
    Rewrite: data files written, manifest not) and right after the Rewrite, before catch-up is
    restored. After each kill the table reads correctly and merge progress is untouched; a
    rerun of compaction plus index catch-up (what follows it in the pipeline) ends where the
    un-killed run ended: one fragment, no deletion files, catch-up as before, base == model."""
    t0 = time.monotonic()
    root = str(tmp_path / "template")
    loc = open_store(root)
    import lance

    data = demo.rows_table([demo.row(i, 0) for i in range(300)])
    ds = lance.write_dataset(data, loc.lance_uri, schema=demo.SCHEMA, max_rows_per_file=10)
    ds.delete("id % 7 = 0")
    ds.create_scalar_index("id", "BTREE", name="id_btree")
    ds.initialize_mem_wal(bucket_column="id", num_buckets=2, maintained_indexes=["id_btree"])
    w = demo.Workload(loc, seed=29, key_space=400, max_memtable_rows=40)
    for _ in range(2):
        w.write_round(60, overwrite=0.4, delete=0.1, puts_per_batch=10)
        assert not merge.merge(loc, spark).region_errors
    catchup.run_catchup(loc)
    model, before = w.expected(), table.read_memwal_state(loc)
    assert before.catchup["id_btree"] == before.merged

    base = copy_of((root,), str(tmp_path / "baseline"))
    ops, result = count_ops("compact", base.lance_uri)
    assert result["status"] == "compacted" and result["catchup_restored"] == ["id_btree"]
    assert ops and all(o.startswith("lance_commit compaction.during_commit") for o in ops)
    want = compaction.read_health(base)
    assert want.fragments == 1 and want.fragments_with_deletions == 0
    assert table.read_memwal_state(base).catchup == before.catchup

    cases = [(k, str(tmp_path / f"k{k}")) for k in range(1, len(ops) + 1)] + [(0, str(tmp_path / "after"))]
    for _, d in cases:
        copy_of((root,), d)
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEMWAL_")}

    def one(case):
        k, d = case
        env = {"MEMWAL_CRASH_AFTER_OPS": str(k)} if k else {"MEMWAL_CRASH_AT": "compaction.after_commit"}
        return subprocess.run([sys.executable, JOB, "compact", d], capture_output=True, text=True,
                              env={**full, **env}, timeout=600)

    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(one, cases))
    for (k, d), p in zip(cases, procs):
        what = f"compaction killed {'before commit write ' + str(k) if k else 'after the Rewrite commit'}"
        assert p.returncode == faults.EXIT_CODE, f"{what}: {p.returncode} {p.stderr[-3000:]}"
        loc = open_store(d)
        assert_reads_correctly(loc, model, what)
        state = table.read_memwal_state(loc)
        assert state.merged == before.merged, what
        if not k:  # the Rewrite landed; Lance withdrew catch-up and the restore never ran
            assert compaction.read_health(loc).fragments == 1 and state.catchup == {}, what
        r = compaction.compact(loc, spark)
        assert not r.errors, what
        catchup.run_catchup(loc)
        got = compaction.read_health(loc)
        assert (got.fragments, got.fragments_with_deletions, got.live_rows) == \
            (want.fragments, want.fragments_with_deletions, want.live_rows), what
        after = table.read_memwal_state(loc)
        assert after.merged == before.merged and after.catchup == before.catchup, what
        assert base_rows(loc) == model, what
        assert_reads_correctly(loc, model, what)
    print_summary("compaction", ops, [(k, False) for k, _ in cases], time.monotonic() - t0)


def test_compaction_killed_around_its_index_catchup_then_rerun(tmp_path, spark):
    """A table small enough to keep fully compacted, whose last merge's fragment is not indexed
    yet: compaction catches the index up first (so Lance can fold that fragment in). Killed
    before and right after that catch-up commit, the table reads correctly, progress is
    untouched, and a rerun of compaction plus index catch-up ends where the un-killed run
    ended: one fragment, no deletion files, catch-up == progress, base == model."""
    t0 = time.monotonic()
    root = str(tmp_path / "template")
    loc = open_store(root)
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=300, btree_index=True,
                      maintained_indexes=["id_btree"])
    w = demo.Workload(loc, seed=31, key_space=2000, max_memtable_rows=100)
    w.write_round(80, overwrite=0.4, delete=0.1, puts_per_batch=10)
    assert not merge.merge(loc, spark).region_errors
    model, before = w.expected(), table.read_memwal_state(loc)
    plan = compaction.plan_compaction(loc)
    assert plan.full and plan.index_first == ["id_btree"], plan.summary

    base = copy_of((root,), str(tmp_path / "baseline"))
    p = run_job("compact", base.lance_uri, {})
    assert p.returncode == 0, p.stderr[-3000:]
    want = compaction.read_health(base)
    assert want.fragments == 1 and want.fragments_with_deletions == 0 and want.unindexed_rows == 0
    assert table.read_memwal_state(base).catchup["id_btree"] == before.merged

    points = ["compaction.before_index_first", "compaction.after_index_first"]
    cases = [(pt, str(tmp_path / pt)) for pt in points]
    for _, d in cases:
        copy_of((root,), d)
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda c: run_job("compact", c[1], {"MEMWAL_CRASH_AT": c[0]}), cases))
    for (pt, d), p in zip(cases, procs):
        what = f"compaction killed at {pt}"
        assert p.returncode == faults.EXIT_CODE, f"{what}: {p.returncode} {p.stderr[-3000:]}"
        loc = open_store(d)
        assert_reads_correctly(loc, model, what)
        state = table.read_memwal_state(loc)
        assert state.merged == before.merged, what
        caught_up = pt.startswith("compaction.after")
        assert (state.catchup.get("id_btree") == before.merged) == caught_up, what
        r = compaction.compact(loc, spark)
        assert r.status == "compacted" and not r.errors, (what, r.status, r.errors)
        catchup.run_catchup(loc)
        got = compaction.read_health(loc)
        assert (got.fragments, got.fragments_with_deletions, got.live_rows) == \
            (want.fragments, want.fragments_with_deletions, want.live_rows), what
        assert table.read_memwal_state(loc).catchup["id_btree"] == before.merged, what
        assert base_rows(loc) == model, what
        assert_reads_correctly(loc, model, what)
    print(f"\n[crash points] compaction's index catch-up: killed at {points}; all converged "
          f"({time.monotonic() - t0:.1f} s)")
