"""Compaction, the MemWAL index builder, base-index catch-up and GC (with its base-version
cleanup at the retention floor) in a loop, for the shared-table race (tests/test_shared_table.py).

usage: shared_maintainer.py URI FLOOR_SECONDS READY_FILE GO_FILE STOP_FILE OUT_JSON
Writes READY_FILE when its Spark session (compaction's rewrites) is warm, starts at GO_FILE, loops until STOP_FILE exists, then writes OUT_JSON:
{"passes": n, "errors": [...], "stats": {...}}. The cleanup removes every version older than
FLOOR_SECONDS (the floor lowered explicitly: this is what protects a merge in flight). An
exception in a pass is recorded and the loop goes on. It takes no table lease: it stands for a
committer that does not (an application's own compaction, another client), which is what the
floor protects a merge from; memwal's own maintainers are serialized by the lease on top.
"""

import json
import os
import sys
import time
import traceback
from collections import Counter

from memwal_core.jobs import catchup, compaction, gc, snapshot
from memwal_core.options import CompactionOptions, LeaseOptions
from memwal_core.state.store import open_store
from proc_log import log_memwal_to_stderr


def main() -> int:
    uri, floor, ready, go, stop, out = sys.argv[1], float(sys.argv[2]), *sys.argv[3:7]
    log_memwal_to_stderr()
    loc = open_store(uri)
    cfg = gc.GcOptions(manifest_retention=3, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                       cleanup_base_versions_older_than_seconds=floor, cleanup_base_versions_floor_seconds=floor)
    # The small table is kept fully compacted: every merged fragment is compacted away at once.
    opts = CompactionOptions(max_attempts=1)
    no_lease = LeaseOptions(enabled=False)
    stats: Counter = Counter()
    errors: list[str] = []
    from memwal_core.spark.session import get_spark

    spark = get_spark("local[1]", {"spark.sql.shuffle.partitions": "1"})
    spark.range(1).collect()  # warm
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    passes = 0
    while not os.path.exists(stop):
        passes += 1
        try:
            c = compaction.compact(loc, spark, opts, lease=no_lease)
            stats["compactions"] += int(c.fragments_removed > 0)
            stats["compaction_conflicts"] += c.conflicts
            errors.extend(f"compaction {n}: {e}" for n, e in c.errors.items())
            s = snapshot.build_snapshot(loc, lease=no_lease)
            errors.extend(f"snapshot: {e}" for e in s.region_errors.values())
            k = catchup.run_catchup(loc, lease=no_lease)
            errors.extend(f"catchup {n}: {e}" for n, e in k.errors.items())
            r = gc.run_gc(loc, cfg, lease=no_lease)
            stats["base_versions_cleaned"] += (r.base_cleanup or {}).get("old_versions", 0)
            stats["generations_deleted"] += r.counts().get("generation", 0)
            errors.extend(r.region_errors.values())
            if r.base_cleanup and r.base_cleanup.get("error"):
                errors.append(f"base cleanup: {r.base_cleanup['error']}")
        except Exception as e:  # noqa: BLE001 - recorded; the loop goes on
            first = (str(e).strip().splitlines() or [""])[0]
            errors.append(f"{type(e).__name__}: {first}")
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            time.sleep(0.2)
        with open(out + ".pass.tmp", "w") as f:
            f.write(f"{passes} {time.time()}")
        os.replace(out + ".pass.tmp", out + ".pass")
    with open(out + ".tmp", "w") as f:
        json.dump({"job": "maintain", "passes": passes, "errors": errors, "stats": dict(stats)}, f)
    os.replace(out + ".tmp", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
