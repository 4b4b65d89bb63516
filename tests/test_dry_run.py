"""`memwal maintain --dry-run` and `gc.run_gc(dry_run=True)` say exactly what the real run then does.

A dry run is GC's own job with execution off: Lance explains its base-version cleanup with the
same settings, and GC is planned as if those versions were gone. The property: for table states
(tagged versions, orphans, several merges) and any combination of GC settings, the dry run's
items and base versions EQUAL what the real run deletes, and the files that disappear are
exactly the listed ones. Base-version ages here are 1 s (against a template whose last commit
is older than that) or counts, with the retention floor lowered explicitly: one process, nothing
commits meanwhile.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import lance
import pytest
from support.helpers import tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memwal_core.jobs import gc, merge, snapshot
from memwal_core.state import layout, region
from memwal_core.state.store import open_store
from memwal_core.tools import demo
from memwal_pipeline import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD = 1.0  # seconds: every version of a template is older than this when a test runs


def _settle(root: str) -> None:
    """Wait until the table's last commit is older than `OLD` (age-based cleanup is then stable)."""
    newest = max(v["timestamp"].timestamp() for v in lance.dataset(root).versions())
    time.sleep(max(0.0, newest + OLD + 0.5 - time.time()))


@pytest.fixture(scope="module")
def templates(tmp_path_factory, spark):
    """Two tables: `merged` (3 regions, two rounds merged and recorded, one pending) and
    `history` (three merges with snapshots between them and writes after each: every base
    version reads different generations)."""
    base = tmp_path_factory.mktemp("dry_run_templates")
    out = {}
    for name, merges in (("merged", 1), ("history", 3)):
        root = str(base / name)
        loc = open_store(root)
        demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=30)
        w = demo.Workload(loc, seed=7, key_space=240, max_memtable_rows=25)
        for _ in range(merges):
            for _ in range(2):
                w.write_round(60, overwrite=0.3, delete=0.05, puts_per_batch=10)
            assert not merge.merge(loc, spark).region_errors
            snapshot.build_snapshot(loc)  # the index builder records region values before GC runs
        w.write_round(40, overwrite=0.3, puts_per_batch=10)
        out[name] = root
    for root in out.values():
        _settle(root)
    return out


def _copy(root: str) -> str:
    dst = os.path.join(tempfile.mkdtemp(prefix="dry_run_"), "t")
    shutil.copytree(root, dst)  # copy2: file mtimes (orphan ages) and manifest timestamps are kept
    return dst


def _plant_orphan(loc, age: float = 7200) -> str:
    """An unlisted `*_gen_*` directory below `current_generation`, `age` seconds old."""
    rid = sorted(region.list_regions(loc.store).region_ids)[0]
    m = region.load_latest(loc.store, rid)
    d = f"{layout.region_dir(rid)}/deadbeef_gen_{m.current_generation - 1}"
    old = time.time() - age
    for f in ("data/a.lance", "_versions/1.manifest"):
        loc.store.put(f"{d}/{f}", b"x" * 100)
        os.utime(os.path.join(loc.store.root, d, f), (old, old))
    return d


def _versions(root: str) -> set[int]:
    return {int(v["version"]) for v in lance.dataset(root).versions()}


def _keys(items) -> set[tuple[str, str, tuple[str, ...]]]:
    return {(i.kind, i.path, tuple(sorted(i.keys))) for i in items}


def check_dry_equals_real(root: str, cfg: gc.GcOptions) -> tuple[gc.GcResult, gc.GcResult]:
    """Dry run, then the real run: same items, same base versions, and the files that went are
    exactly the listed ones (GC's object keys and Lance's cleanup files)."""
    loc = open_store(root)
    versions, files = _versions(root), tree(root)
    dry = gc.run_gc(loc, cfg, dry_run=True)
    assert tree(root) == files, "a dry run touches nothing"
    assert dry.dry_run and dry.deleted == [] and not dry.region_errors
    base = dry.plan.base_cleanup
    assert (base is not None) == cfg.base_cleanup
    if base is not None:
        assert dry.plan.table_version not in base.versions  # never the latest
        assert not set(base.versions) & set(dry.plan.retained_versions)

    real = gc.run_gc(loc, cfg)
    assert not real.region_errors and not real.skipped
    assert _keys(real.deleted) == _keys(dry.plan.items)
    assert real.deleted_objects == dry.plan.objects and real.bytes_reclaimed == dry.plan.bytes
    assert real.counts() == dry.plan.counts()
    removed = versions - _versions(root)
    assert removed == set(base.versions if base else [])
    if base is not None:
        assert real.base_cleanup["old_versions"] == len(base.versions)
        assert real.base_cleanup["bytes_removed"] == base.bytes
    assert real.plan.retained_versions == dry.plan.retained_versions
    gone = set(files) - set(tree(root))
    listed = {k for i in dry.plan.items for k in i.keys} | set(base.paths if base else [])
    assert not (base and base.paths_truncated)
    assert gone == listed
    return dry, real


# ---------------------------------------------------------------------------- the property

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=st.sampled_from(["merged", "history"]), tag=st.booleans(), orphan=st.booleans(),
       older=st.sampled_from([None, OLD, 10**6]), retain=st.sampled_from([None, 1, 2, 4]),
       manifest_retention=st.sampled_from([1, 3, 10]), manifest_age=st.sampled_from([0, 10**6]),
       grace=st.sampled_from([0, 10**6]), keep_epoch=st.booleans())
def test_gc_dry_run_equals_the_real_run(templates, state, tag, orphan, older, retain, manifest_retention,
                                        manifest_age, grace, keep_epoch):
    root = _copy(templates[state])
    try:
        if tag:  # an old tagged version: Lance's cleanup keeps it, so GC keeps what it reads
            ds = lance.dataset(root)
            ds.tags.create("pinned", sorted(_versions(root))[1])
        if orphan:
            _plant_orphan(open_store(root))
        cfg = gc.GcOptions(manifest_retention=manifest_retention, manifest_min_age_seconds=manifest_age,
                           orphan_grace_seconds=grace, keep_current_epoch_wal=keep_epoch,
                           cleanup_base_versions_older_than_seconds=older, cleanup_base_versions_retain=retain,
                           cleanup_base_versions_floor_seconds=0)  # single process: nothing commits meanwhile
        dry, _ = check_dry_equals_real(root, cfg)
        if tag and cfg.base_cleanup:
            assert sorted(_versions(root))[1] not in dry.plan.base_cleanup.versions
    finally:
        shutil.rmtree(os.path.dirname(root), ignore_errors=True)


def test_the_base_cleanup_is_what_frees_generations(templates):
    """The reported failure: with the cleanup configured the dry run must count the generations
    the real run deletes once the old versions are gone (it said 0 while the run deleted them)."""
    root = _copy(templates["history"])
    loc = open_store(root)
    cfg = gc.GcOptions(cleanup_base_versions_older_than_seconds=OLD, cleanup_base_versions_floor_seconds=0)
    without = gc.plan_gc(loc, replace(cfg, cleanup_base_versions_older_than_seconds=None))
    assert without.counts()["generation"] == 0  # the first versions (merged = {}) read them all
    dry, real = check_dry_equals_real(root, cfg)
    assert dry.plan.counts()["generation"] > 0 and len(dry.plan.base_cleanup.versions) > 3
    assert len(dry.plan.retained_versions) == 1


# ---------------------------------------------------------------------------- the CLI

def _memwal(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_dry_run_lists_what_maintain_then_deletes(templates):
    """Through the command (a subprocess each): `--only gc --base-versions-older-than 1 --dry-run
    --json`, then the same without --dry-run; the listed paths are the files that went."""
    root = _copy(templates["history"])
    versions, files = _versions(root), tree(root)
    dry = _memwal("maintain", root, "--only", "gc", "--base-versions-older-than", str(OLD), "--base-versions-floor", "0", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert tree(root) == files
    assert plan["dry_run"] and list(plan["steps"]) == ["gc"]
    g, w = plan["steps"]["gc"]["plan"], plan["steps"]["gc"]["metrics"]
    assert w["would_delete"]["generation"]["items"] > 0 and w["would_delete"]["base_version"]["items"] == len(versions) - 1
    assert sum(w["would_delete"][k]["objects"] for k in ("generation", "wal", "manifest", "orphan")) == g["objects"]
    assert len(g["items"]) == sum(w["would_delete"][k]["items"] for k in ("generation", "wal", "manifest", "orphan"))

    real = _memwal("maintain", root, "--only", "gc", "--base-versions-older-than", str(OLD), "--base-versions-floor", "0", "--json")
    assert real.returncode == 0, real.stderr
    rep = json.loads(real.stdout)["steps"]["gc"]
    assert rep["metrics"]["objects_deleted"] == g["objects"] and rep["result"]["deleted"] == g["counts"]
    assert versions - _versions(root) == set(g["base_cleanup"]["versions"])
    gone = set(files) - set(tree(root))
    gc_gone = {f for f in gone if f.startswith("_mem_wal/")}
    assert {f for f in gone if not f.startswith("_mem_wal/")} == set(g["base_cleanup"]["paths"])
    # Each listed item is a directory (generation, orphan) or one object (WAL entry, manifest).
    owner = {f: next(i["path"] for i in g["items"] if f == i["path"] or f.startswith(i["path"] + "/"))
             for f in gc_gone}
    assert set(owner.values()) == {i["path"] for i in g["items"]}
    assert len(gc_gone) == g["objects"]
    shutil.rmtree(os.path.dirname(root), ignore_errors=True)


def test_cli_dry_run_respects_only_and_lists_paths(templates, capsys):
    root = _copy(templates["merged"])
    _plant_orphan(open_store(root), age=3 * 86400)  # past the default 24 h grace
    files = tree(root)
    assert cli.main(["maintain", root, "--only", "gc", "--base-versions-older-than", str(OLD), "--base-versions-floor", "0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not [ln for ln in out.splitlines() if ln.split(":")[0] in ("merge", "compact", "catchup", "index")], out
    head = next(ln for ln in out.splitlines() if ln.startswith("gc: would delete "))
    for kind in ("generations", "WAL entries", "region manifest versions", "orphan directories",
                 "base-table versions"):
        assert kind in head, head
    assert "1 orphan directories" in head and "  base table: versions 1-" in out
    assert "  generation " in out and "_mem_wal/" in out
    assert "run first" not in out  # only gc chosen: nothing runs before it

    assert cli.main(["maintain", root, "--only", "merge,gc", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert list(plan["steps"]) == ["merge", "gc"]
    gc_step = plan["steps"]["gc"]
    # The shipped cleanup (versions older than a week) is planned, and finds nothing that old.
    assert gc_step["plan"]["base_cleanup"]["old_versions"] == 0
    assert gc_step["metrics"]["would_delete"]["base_version"]["items"] == 0
    assert cli.main(["maintain", root, "--only", "merge,gc", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nmerge: ") == 1 and "compact:" not in out and "run first" in out
    assert tree(root) == files
    shutil.rmtree(os.path.dirname(root), ignore_errors=True)


def test_cli_dry_run_models_the_age_flag(templates, capsys):
    """The flag's value alone changes the answer: a week keeps every version (and so every
    generation they read), one second removes all but the latest."""
    root = _copy(templates["history"])
    n = len(_versions(root))
    got = {}
    for age in ("604800", str(OLD)):
        assert cli.main(["maintain", root, "--only", "gc", "--base-versions-older-than", age, "--base-versions-floor", "0", "--dry-run", "--json"]) == 0
        got[age] = json.loads(capsys.readouterr().out)["steps"]["gc"]["metrics"]
    assert got["604800"]["would_delete"]["base_version"]["items"] == 0 and got["604800"]["would_delete"]["generation"]["items"] == 0
    assert got[str(OLD)]["would_delete"]["base_version"]["items"] == n - 1
    assert got[str(OLD)]["would_delete"]["generation"]["items"] > 0
    shutil.rmtree(os.path.dirname(root), ignore_errors=True)


@pytest.mark.s3
def test_gc_dry_run_on_s3(s3_table_loc, spark):
    """On an S3-protocol server Lance names files by their key in the bucket: the dry run lists
    them relative to the table, and they are the objects the real run's cleanup removes."""
    loc = s3_table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=3, key_space=100, max_memtable_rows=20)
    w.write_round(40, puts_per_batch=10)
    assert not merge.merge(loc, spark).region_errors
    snapshot.build_snapshot(loc)
    cfg = gc.GcOptions(cleanup_base_versions_older_than_seconds=None, cleanup_base_versions_retain=1, manifest_min_age_seconds=0, cleanup_base_versions_floor_seconds=0)
    objects = {o.key for o in loc.store.list("")}
    versions = {int(v["version"]) for v in lance.dataset(loc.lance_uri, storage_options=loc.storage_options).versions()}
    dry = gc.run_gc(loc, cfg, dry_run=True)
    base = dry.plan.base_cleanup
    assert base.versions == sorted(versions)[:-1] and set(base.paths) <= objects, base.paths
    assert {o.key for o in loc.store.list("")} == objects
    real = gc.run_gc(loc, cfg)
    assert _keys(real.deleted) == _keys(dry.plan.items) and dry.plan.counts()["generation"] > 0
    left = {o.key for o in loc.store.list("")}
    assert not set(base.paths) & left and not {k for i in dry.plan.items for k in i.keys} & left
