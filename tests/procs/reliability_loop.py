"""A maintenance job in a loop, for the concurrency suite.

usage: reliability_loop.py JOB URI READY_FILE GO_FILE STOP_FILE OUT_JSON
JOB: `merge` (own local SparkSession, small byte budget so a pass makes several commits),
`index` (the MemWAL index builder, then the base-index catch-up), `gc` (no grace, no minimum
age, 3 manifest versions kept, base-table versions older than 2 s cleaned first) or `maintain`
(a whole maintainer: merge, compaction, catch-up, index builder, GC, each step under the table
lease with `MEMWAL_TEST_LEASE_TTL` / `MEMWAL_TEST_LEASE_WAIT` seconds). A step skipped because
another maintainer held the lease is counted (`lease_skipped`), not an error; waits for the lease
are logged by memwal.lease ("held by ..."). Writes
READY_FILE when warm, starts at GO_FILE, loops until STOP_FILE exists (after each pass
OUT_JSON.pass holds "passes start_of_last_pass"), then writes OUT_JSON:
{"passes": n, "errors": [...], "stats": {...}}. An exception in a pass is recorded (type and
first line) and the loop goes on, so one failure does not hide later ones.
"""

import json
import os
import sys
import time
import traceback
from collections import Counter

from memwal_core.jobs import catchup, compaction, gc, merge, snapshot
from memwal_core.options import LeaseOptions
from memwal_core.state import lease
from memwal_core.state.store import open_store
from proc_log import log_memwal_to_stderr

GC_CONFIG = gc.GcOptions(manifest_retention=3, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                        cleanup_base_versions_older_than_seconds=2,
                        cleanup_base_versions_floor_seconds=2)


def main() -> int:
    job, uri, ready, go, stop, out = sys.argv[1:7]
    memwal_log = log_memwal_to_stderr()
    loc = open_store(uri)
    stats: Counter = Counter()
    errors: list[str] = []
    lease_opts = LeaseOptions(ttl_seconds=float(os.environ.get("MEMWAL_TEST_LEASE_TTL", 60)),
                              wait_seconds=float(os.environ.get("MEMWAL_TEST_LEASE_WAIT", 30)))
    if job in ("merge", "maintain"):
        from memwal_core.spark.session import get_spark

        spark = get_spark("local[1]", {"spark.sql.shuffle.partitions": "2"})
        spark.range(1).collect()  # warm
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    passes = 0
    last_kept: dict = {}
    while not os.path.exists(stop):
        passes += 1
        started = time.time()
        try:
            if job == "merge":
                memwal_log.info("pass %d", passes)
                r = merge.merge(loc, spark, budget_bytes=40_000)
                stats["commits"] += r.commits
                stats["conflicts"] += r.conflicts
                stats["generations_merged"] += r.generations_merged
                stats["skipped_generations"] += sum(len(x.skipped_generations) for x in r.regions.values())
                errors.extend(r.region_errors.values())
                if not r.commits:
                    time.sleep(0.3)
            elif job == "maintain":
                memwal_log.info("pass %d", passes)
                for name, step in (("merge", lambda: merge.merge(loc, spark, budget_bytes=40_000, lease=lease_opts)),
                                   ("compact", lambda: compaction.compact(loc, spark, lease=lease_opts)),
                                   ("catchup", lambda: catchup.run_catchup(loc, lease=lease_opts)),
                                   ("index", lambda: snapshot.build_snapshot(loc, lease=lease_opts)),
                                   ("gc", lambda: gc.run_gc(loc, GC_CONFIG, lease=lease_opts))):
                    try:
                        r = step()
                    except lease.LeaseHeld as e:
                        stats["lease_skipped"] += 1
                        memwal_log.info("%s", e)
                        continue
                    stats[f"{name}_runs"] += 1
                    if name == "merge":
                        stats["commits"] += r.commits
                        stats["generations_merged"] += r.generations_merged
                        errors.extend(r.region_errors.values())
                    elif name == "compact":
                        stats["compactions"] += r.status.startswith("compacted")
                        errors.extend(f"compact {n}: {e}" for n, e in r.errors.items())
                    elif name == "catchup":
                        errors.extend(f"catchup {n}: {e}" for n, e in r.errors.items())
                    elif name == "index":
                        errors.extend(f"snapshot: {e}" for e in r.region_errors.values())
                    else:
                        for kind, n in r.counts().items():
                            stats[f"deleted_{kind}"] += n
                        errors.extend(r.region_errors.values())
                time.sleep(0.1)
            elif job == "index":
                s = snapshot.build_snapshot(loc)
                stats["snapshots"] += 1
                stats["snapshot_attempts"] += s.attempts
                stats["hints_updated"] += len(s.hints_updated)
                errors.extend(f"snapshot: {e}" for e in s.region_errors.values())
                c = catchup.run_catchup(loc)
                stats["indexes_optimized"] += sum(1 for o in c.indexes if o.optimized)
                errors.extend(f"catchup {n}: {e}" for n, e in c.errors.items())
                time.sleep(0.2)
            else:
                r = gc.run_gc(loc, GC_CONFIG)
                for kind, n in r.counts().items():
                    stats[f"deleted_{kind}"] += n
                stats["skipped"] += len(r.skipped)
                stats["manifest_commits"] += r.manifest_commits
                last_kept = {k: v for k, v in r.kept.items() if k.startswith("generation:")}
                errors.extend(r.region_errors.values())
                if r.base_cleanup and r.base_cleanup.get("error"):
                    errors.append(f"base cleanup: {r.base_cleanup['error']}")
                time.sleep(0.3)
        except lease.LeaseHeld as e:  # another maintainer's lease past the wait: a skip, not an error
            stats["lease_skipped"] += 1
            memwal_log.info("%s", e)
        except Exception as e:  # noqa: BLE001 - recorded; the loop goes on
            first = (str(e).strip().splitlines() or [""])[0]
            errors.append(f"{type(e).__name__}: {first}")
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            time.sleep(0.3)
        with open(out + ".pass.tmp", "w") as f:  # heartbeat: passes done, start of the last one
            f.write(f"{passes} {started}")
        os.replace(out + ".pass.tmp", out + ".pass")
    with open(out + ".tmp", "w") as f:
        json.dump({"job": job, "passes": passes, "errors": errors, "stats": dict(stats),
                   **({"last_kept": last_kept} if job == "gc" else {})}, f)
    os.replace(out + ".tmp", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
