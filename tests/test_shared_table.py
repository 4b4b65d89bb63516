"""One table, several processes: a merger racing compaction + index catch-up + GC with its
base-version cleanup at the retention floor, while a writer flushes.

Lance commits a transaction by rebasing it over the transactions committed since its read
version. A merge commit that read version R and commits after a compaction Rewrite at W > R
is rebased over that Rewrite; if the cleanup removed version W meanwhile, the rebase loses the
merge's deletions (duplicate keys, deleted rows back). The retention floor keeps every version
younger than it; here it is lowered explicitly to 6 s (the default is a day) so the race runs
often, and what protects the merge is the floor alone.

The merger pauses 1 s between reading the table and committing (`MEMWAL_PAUSE_AT=
merge.before_commit`, the reliability suites' pause point), as a large batch's commit takes
that long: it widens the window the race needs without changing what races.

How we know the window was hit: every table version's transaction is read as soon as it
appears (before the cleanup may remove it), which tells the Rewrites; the merger logs the
version each commit read and the version it committed (Lance's own transaction records the
version it was rebased onto, not the one it read). A merge commit whose read version is older
than a Rewrite committed before it was rebased over that Rewrite: exactly the commit the
cleanup could break. The race runs until there are such commits (bounded in time) and the test
asserts there are. Then: no key twice, no deleted key back (base table == the writer's model),
merge progress and catch-up never went down, and no process reported an error (the merge
commit verifier, `memwal_core/jobs/merge/verify.py`, reports any commit that went wrong).

`test_floor_zero_reproduces_duplicates` (slow, `MEMWAL_SLOW=1`) runs the same race with the
floor at 0 and shows what the floor prevents; its numbers are in docs/reliability.md.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from support.procs import PROCS, spawn
from support.progress_monitor import ProgressMonitor

from memwal_core.jobs import catchup, merge, snapshot
from memwal_core.observe import reader
from memwal_core.state import table
from memwal_core.state.store import open_store
from memwal_core.tools import demo

SLOW = bool(os.environ.get("MEMWAL_SLOW"))


PAUSE_S = float(os.environ.get("MEMWAL_RACE_PAUSE", 1.0))  # the merger's pause between its read and its commit
FLOOR_S = 6.0  # the floor, lowered explicitly (default a day): longer than a commit here (~1-3 s)


def _spawn_env(args: list[str], log: str, env: dict[str, str]) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMWAL_")}
    return subprocess.Popen([sys.executable, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**clean, **env})


class TransactionLog:
    """Each table version's operation, read version and commit time, read as soon as the
    version appears (before the cleanup may remove it)."""

    def __init__(self, loc):
        self.loc = loc
        self.ops: dict[int, tuple[str, int]] = {}  # version -> (operation, read version)
        self.stamps: dict[int, float] = {}          # version -> commit time (epoch seconds)
        self.missed: list[int] = []
        self.missed_samples = 0
        self.next = 1

    def read(self) -> None:
        ds = lance.dataset(self.loc.lance_uri)
        if ds.version >= self.next:
            try:
                listed = ds.versions()
            except ValueError:  # a version cleaned up between listing and reading: next time
                listed = []
            for info in listed:
                self.stamps.setdefault(int(info["version"]), info["timestamp"].timestamp())
        for v in range(self.next, ds.version + 1):
            try:
                t = ds.read_transaction(v)
                self.ops[v] = (type(t.operation).__name__, int(t.read_version))
            except TypeError as e:
                # pylance 14 cannot build a Rewrite's `RewrittenIndex` back (it lacks arguments):
                # only a Rewrite that remaps an index fails so; its read version is unknown.
                if "RewrittenIndex" not in str(e):
                    raise
                self.ops[v] = ("Rewrite", -1)
            except Exception:  # noqa: BLE001 - cleaned up before it was read
                self.missed.append(v)
        self.next = max(self.next, ds.version + 1)

    def rebased_over_rewrite(self, merge_log: str) -> list[tuple[int, int, int]]:
        """(merge version, its read version, the Rewrite between): merge commits (from the
        merger's log) rebased over a compaction committed after they read the table."""
        rewrites = sorted(v for v, (op, _) in self.ops.items() if op == "Rewrite")
        out = []
        for read, v in merge_commits(merge_log):
            between = [w for w in rewrites if read < w < v]
            if between:
                out.append((v, read, between[0]))
        return out

    def longest_span(self, hits: list[tuple[int, int, int]]) -> float:
        """The longest time from a rebased merge's read version to its commit: an upper bound
        on how old the Rewrite it was rebased over could get before the commit (below the
        floor: the cleanup could not have removed it)."""
        spans = [self.stamps[v] - self.stamps[r] for v, r, _ in hits if v in self.stamps and r in self.stamps]
        return max(spans, default=0.0)


def merge_commits(log_path: str) -> list[tuple[int, int]]:
    """(read version, committed version) of every merge commit the merger logged."""
    try:
        text = open(log_path).read()
    except OSError:
        return []
    return [(int(r), int(v)) for r, v in re.findall(r"read version (\d+), committed version (\d+)", text)]


def _count(log_path: str, text: str) -> int:
    try:
        return open(log_path).read().count(text)
    except OSError:
        return 0


def _duplicates(loc) -> list[int]:
    ids = table.open_dataset(loc).to_table(columns=["id"]).column("id")
    counts = pc.value_counts(ids)
    return sorted(c["values"].as_py() for c in counts if c["counts"].as_py() > 1)


def _observe(monitor: ProgressMonitor, txns: TransactionLog) -> None:
    """One sample of both; a version cleaned up between listing and opening (only without a
    floor can that be the latest a moment ago) is seen on the next sample."""
    try:
        monitor.sample()
        txns.read()
    except (ValueError, OSError) as e:
        if "not found" not in str(e).lower():
            raise
        txns.missed_samples += 1


def _race(tmp_path, spark, *, floor: float, min_hits: int, max_seconds: float) -> dict:
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=50, btree_index=True,
                      maintained_indexes=["id_btree"])
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    go, stop, stop_writer = str(ctl / "go"), str(ctl / "stop"), str(ctl / "stop_writer")
    writer_out, merge_out, maint_out = str(ctl / "writer.json"), str(ctl / "merge.json"), str(ctl / "maint.json")
    merge_ready, maint_ready = str(ctl / "merge.ready"), str(ctl / "maint.ready")
    merge_log = str(ctl / "merge.log")
    writer = spawn([os.path.join(PROCS, "reliability_writer.py"), loc.lance_uri, "5", go, writer_out, stop_writer],
                    str(ctl / "writer.log"))
    merger = _spawn_env([os.path.join(PROCS, "reliability_loop.py"), "merge", loc.lance_uri, merge_ready, go, stop,
                         merge_out], str(ctl / "merge.log"),
                        {"MEMWAL_PAUSE_AT": "merge.before_commit", "MEMWAL_PAUSE_SECONDS": str(PAUSE_S)})
    maint = spawn([os.path.join(PROCS, "shared_maintainer.py"), loc.lance_uri, str(floor), maint_ready, go, stop,
                    maint_out],
                   str(ctl / "maint.log"))
    procs = [("writer", writer, ctl / "writer.log"), ("merge", merger, ctl / "merge.log"),
             ("maintain", maint, ctl / "maint.log")]
    monitor, txns = ProgressMonitor(loc), TransactionLog(loc)
    try:
        deadline = time.time() + 240
        while not (os.path.exists(merge_ready) and os.path.exists(maint_ready)):
            for name, p, log in procs:
                assert p.poll() is None, f"{name} died while starting: {open(log).read()[-3000:]}"
            assert time.time() < deadline, "the loops did not get ready"
            time.sleep(0.2)
        # A fresh latest version: the floor counts from a version's commit, so the version the
        # loops read first (created before the JVMs started) must not be older than the floor
        # already (docs/reliability.md: a version that stayed latest longer than the floor).
        snapshot.build_snapshot(loc)
        with open(go + ".tmp", "w") as f:
            f.write(str(time.time() + max_seconds))
        os.replace(go + ".tmp", go)
        t0 = time.time()
        while writer.poll() is None:
            _observe(monitor, txns)
            if len(txns.rebased_over_rewrite(merge_log)) >= min_hits and time.time() - t0 > 10:
                open(stop_writer, "w").close()  # enough: let the writer flush and report
            time.sleep(0.1)
        assert writer.returncode == 0, open(ctl / "writer.log").read()[-3000:]
        race_s = time.time() - t0
        # The loops go on until the merger has done a whole pass after the writer's last flush.
        t_end = time.time()
        while True:
            try:
                if float(open(merge_out + ".pass").read().split()[1]) >= t_end:
                    break
            except (OSError, IndexError, ValueError):
                pass
            assert merger.poll() is None and maint.poll() is None, "a loop died"
            _observe(monitor, txns)
            time.sleep(0.1)
        open(stop, "w").close()
        for name, p, log in procs[1:]:
            while p.poll() is None:
                _observe(monitor, txns)
                time.sleep(0.1)
            assert p.returncode == 0, f"{name}: {open(log).read()[-3000:]}"
    finally:
        open(stop, "w").close()
        open(stop_writer, "w").close()
        for _, p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    _observe(monitor, txns)
    monitor.final_check()
    written = json.load(open(writer_out))
    model = {int(k): v for k, v in written["model"].items()}
    merged_loop, maint_loop = json.load(open(merge_out)), json.load(open(maint_out))
    duplicates_before_final = _duplicates(loc)
    final = merge.merge(loc, spark)  # whatever the loops left pending (none of it races now)
    catchup.run_catchup(loc)
    base = {r["id"]: r for r in table.open_dataset(loc).to_table().to_pylist()}
    out = {
        "race_s": round(race_s, 1), "floor": floor,
        "writer_batches": written["batches"], "live_keys": len(model),
        "merge": merged_loop, "maintain": maint_loop,
        "versions": len(txns.ops), "versions_missed": len(txns.missed),
        "operations": dict(collections.Counter(op for op, _ in txns.ops.values())),
        "rebased_over_rewrite": txns.rebased_over_rewrite(merge_log),
        "longest_span_s": round(txns.longest_span(txns.rebased_over_rewrite(merge_log)), 2),
        "duplicates": duplicates_before_final, "duplicates_after_final": _duplicates(loc),
        "resurrected": sorted(k for k in base if k not in model),
        "lost_or_stale": sorted(k for k, r in model.items() if base.get(k) != r),
        "final_region_errors": final.region_errors,
        # Merge commits the verifier found outside the latest version (landed in a freed slot)
        # and retried, and merge commits that failed on a version cleaned up under them.
        "orphaned_commits": _count(merge_log, "is not in the latest version"),
        "commits_failed_on_cleaned_version": _count(merge_log, "commit failed: OSError: Not found"),
        # Merge progress never goes down; catch-up may between versions (a compaction's Rewrite
        # withdraws it and restores it in its next commit, `compaction.restore_catchup`).
        "progress_problems": [p for p in monitor.problems if " merged " in p],
        "catchup_dips": len([p for p in monitor.problems if " catch-up " in p]),
        "lsm_equals_model": None,
        "merge_errors": len(merged_loop["errors"]),
    }
    if not out["final_region_errors"]:
        out["lsm_equals_model"] = {r["id"]: r for r in reader.lsm_table(loc).to_pylist()} == model
    hits = out["rebased_over_rewrite"]
    print(f"\n[shared table, floor {floor:g} s] {race_s:.0f} s race: writer {written['batches']} batches, "
          f"{len(model)} live keys; merge {merged_loop['passes']} passes {merged_loop['stats']}, "
          f"{len(merged_loop['errors'])} errors; maintain {maint_loop['passes']} passes {maint_loop['stats']}, "
          f"{len(maint_loop['errors'])} errors")
    print(f"   versions {out['versions']} read ({out['versions_missed']} cleaned before read), operations "
          f"{out['operations']}; merge commits rebased over a Rewrite: {len(hits)} (e.g. {hits[:3]}), longest "
          f"read-to-commit span {out['longest_span_s']} s")
    print(f"   duplicates {len(out['duplicates'])} {out['duplicates'][:10]}, resurrected {len(out['resurrected'])} "
          f"{out['resurrected'][:10]}, lost/stale {len(out['lost_or_stale'])}, progress problems "
          f"{len(out['progress_problems'])} {out['progress_problems'][:3]}, catch-up dips {out['catchup_dips']}")
    print(f"   merge commits retried as not in the latest version {out['orphaned_commits']}, failed on a cleaned "
          f"version {out['commits_failed_on_cleaned_version']}")
    for e in (merged_loop["errors"] + maint_loop["errors"])[:5]:
        print(f"   error: {e[:400]}")
    return out


def test_merge_races_compaction_and_cleanup_at_the_floor(tmp_path, spark):
    out = _race(tmp_path, spark, floor=FLOOR_S, min_hits=3, max_seconds=60)
    # The window was hit: merge commits rebased over a compaction the cleanup could have removed,
    # and the floor is what kept it (each commit came sooner after its read version than the floor).
    assert out["rebased_over_rewrite"], (out["operations"], out["versions_missed"])
    assert out["longest_span_s"] < FLOOR_S, out["longest_span_s"]
    assert out["maintain"]["stats"].get("base_versions_cleaned", 0) > 0  # the cleanup did run
    assert out["maintain"]["stats"].get("compactions", 0) > 0
    assert out["merge"]["stats"].get("commits", 0) > 0
    assert not out["merge"]["errors"], out["merge"]["errors"][:5]  # the commit verifier found nothing
    # A region the writer is creating (its directory there, its first manifest not yet) is
    # reported by the snapshot of that moment; the next pass reads it. Nothing else may fail.
    creating = [e for e in out["maintain"]["errors"] if e.startswith("snapshot: ") and "no manifest under" in e]
    assert len(creating) <= 3 and len(out["maintain"]["errors"]) == len(creating), out["maintain"]["errors"][:5]
    assert out["duplicates"] == [] and out["duplicates_after_final"] == []
    assert out["resurrected"] == [] and out["lost_or_stale"] == []
    assert out["progress_problems"] == []
    assert out["final_region_errors"] == {} and out["lsm_equals_model"] is True


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="shows the race without the floor: run with MEMWAL_SLOW=1")
def test_floor_zero_reproduces_duplicates(tmp_path, spark):
    """The same race with the floor at 0: what the floor prevents happens (merge commits fail on
    versions cleaned up under them; keys twice or deleted keys back, which the verifier reports;
    commits outside the latest version, which it retries)."""
    out = _race(tmp_path, spark, floor=0.0, min_hits=30, max_seconds=float(os.environ.get("MEMWAL_SLOW_SECONDS", 90)))
    (tmp_path.parent / "floor_zero.json").write_text(json.dumps(out, default=str, indent=1))
    verifier = [e for e in out["merge"]["errors"] if e.startswith(merge.COMMIT_CHECK_FAILED)]
    assert (out["duplicates"] or out["resurrected"] or verifier or out["orphaned_commits"]
            or out["commits_failed_on_cleaned_version"]), out
