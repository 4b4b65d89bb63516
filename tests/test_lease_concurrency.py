"""Two whole maintainers on one table, across processes, with a writer flushing all the time.

Each maintainer (`tests/procs/reliability_loop.py maintain`: its own JVM; merge, compaction,
catch-up, MemWAL index builder, GC in a loop) takes the table lease around every step, as
`memwal maintain` and the Dagster assets do. The lease must be contended (waits logged as
"held by", or skips): otherwise the test proves nothing. At the end: the base table equals the
writer's model with no duplicate key, the LSM read too, no listed generation is missing, and
after a last GC (grace 0) no base-table file is left that no retained version references.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import lance

from memwal_core.jobs import catchup, gc, merge
from memwal_core.jobs.gc import leaks
from memwal_core.observe import checks, reader
from memwal_core.state import table
from memwal_core.state.store import open_store
from memwal_core.tools import demo

PROCS = os.path.join(os.path.dirname(__file__), "procs")
WRITER_SECONDS = float(os.environ.get("MEMWAL_LEASE_SOAK_SECONDS", 12))


def _spawn(args: list[str], log: str, **env) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEMWAL_")}
    return subprocess.Popen([sys.executable, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**base, **env})


def _referenced(loc) -> set[str]:
    """Data and deletion files of every retained version, through pylance's API."""
    out = set()
    ds = lance.dataset(loc.lance_uri)
    for v in ds.versions():
        for f in lance.dataset(loc.lance_uri, version=v["version"]).get_fragments():
            out |= {f"data/{d.path}" for d in f.metadata.data_files()}
            if f.metadata.deletion_file is not None:
                out.add(f.metadata.deletion_file.path(f.fragment_id))
    return out


def test_two_maintainers_and_a_writer_serialize_on_the_lease(tmp_path, spark):
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=50, btree_index=True,
                      maintained_indexes=["id_btree"])
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    go, stop = str(ctl / "go"), str(ctl / "stop")
    writer_out = str(ctl / "writer.json")
    writer = _spawn([os.path.join(PROCS, "reliability_writer.py"), loc.lance_uri, "11", go, writer_out],
                    str(ctl / "writer.log"))
    loops = []
    for i in range(2):
        ready, out, log = str(ctl / f"ready{i}"), str(ctl / f"maintain{i}.json"), str(ctl / f"maintain{i}.log")
        p = _spawn([os.path.join(PROCS, "reliability_loop.py"), "maintain", loc.lance_uri, ready, go, stop, out],
                   log, MEMWAL_TEST_LEASE_TTL="10", MEMWAL_TEST_LEASE_WAIT="2")
        loops.append((p, ready, out, log))
    try:
        deadline = time.time() + 300
        while not all(os.path.exists(r) for _, r, _, _ in loops):
            for p, _, _, log in loops:
                assert p.poll() is None, f"a maintainer died while starting: {open(log).read()[-3000:]}"
            assert time.time() < deadline, "maintainers did not get ready"
            time.sleep(0.2)
        with open(go + ".tmp", "w") as f:
            f.write(str(time.time() + WRITER_SECONDS))
        os.replace(go + ".tmp", go)
        assert writer.wait(timeout=WRITER_SECONDS + 120) == 0, open(str(ctl / "writer.log")).read()[-3000:]
        t_end = time.time()

        def passes_after(out: str, t: float) -> bool:  # a whole pass started after `t`
            try:
                return float(open(out + ".pass").read().split()[1]) >= t
            except (OSError, IndexError, ValueError):
                return False

        deadline = time.time() + 240
        while not all(passes_after(out, t_end) for _, _, out, _ in loops):
            assert all(p.poll() is None for p, *_ in loops), "a maintainer died"
            assert time.time() < deadline, "maintainers made no pass after the writer stopped"
            time.sleep(0.2)
        open(stop, "w").close()
        for p, _, _, log in loops:
            assert p.wait(timeout=240) == 0, open(log).read()[-3000:]
    finally:
        open(stop, "w").close()
        for p in [writer] + [p for p, *_ in loops]:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.load(open(out)) for _, _, out, _ in loops]
    logs = [open(log).read() for *_, log in loops]
    waits = sum(text.count("held by") for text in logs)
    skips = sum(r["stats"].get("lease_skipped", 0) for r in results)
    written = json.load(open(writer_out))
    model = {int(k): v for k, v in written["model"].items()}

    # The last pass in this process (also under the lease), then GC with no grace at all.
    assert not merge.merge(loc, spark).region_errors
    catchup.run_catchup(loc)
    final = gc.run_gc(loc, gc.GcOptions(manifest_retention=3, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                                        leaked_file_grace_seconds=0,
                                        cleanup_base_versions_older_than_seconds=0,
                                        cleanup_base_versions_floor_seconds=0))  # the maintainers have stopped
    rows = table.open_dataset(loc).to_table().to_pylist()
    base = {r["id"]: r for r in rows}
    lsm = {r["id"]: r for r in reader.lsm_table(loc).to_pylist()}
    files = {o.key for d in ("data", "_deletions") for o in loc.store.list(d)}
    left = leaks.plan_leaks(loc, time.time(), 0)
    print(f"\n[lease] writer {written['batches']} batches, {len(model)} live keys; lease waits logged {waits}, "
          f"steps skipped {skips}")
    for r in results:
        print(f"   maintainer: {r['passes']} passes, {r['stats']}, errors {r['errors'][:5]}")
    print(f"   final GC: deleted {final.counts()}, leaked {final.leaked_objects} objects / {final.leaked_bytes} "
          f"bytes, scan {final.leak_scan}")

    assert waits + skips > 0, "the maintainers never contended for the lease: the test proved nothing"
    assert all(not r["errors"] for r in results), [r["errors"][:5] for r in results]
    assert sum(r["stats"].get("commits", 0) for r in results) > 0
    assert len(rows) == len(base), "duplicate keys in the base table"
    assert base == model and lsm == model
    assert checks.missing_generations(loc) == {}
    assert not final.region_errors
    assert left.error is None and left.leaks == []
    assert files <= _referenced(loc), sorted(files - _referenced(loc))[:10]
