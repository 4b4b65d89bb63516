"""One maintenance job in its own process, for the crash-point suite.

usage: reliability_job.py JOB URI [--inline-threshold N] [--budget BYTES]
JOB is `merge` (own local SparkSession), `compact` (base-table compaction, own local
SparkSession), `snapshot` (the MemWAL index builder) or `gc`
(GC with everything collectable at once: no grace, no minimum age, 2 manifest versions kept,
base-table versions cleaned first). Regions are handled one at a time so that the k-th write
is the same write in every run.

With MEMWAL_COUNT_OPS=1 the last line is JSON {"ops": [...], "result": {...}}: every counted
write (store writes and Lance commit points) in order. With MEMWAL_CRASH_AFTER_OPS=k the
process exits with 137 right before its k-th write (see memwal_core/faults.py).
"""

import argparse
import json
import sys
from dataclasses import asdict

from memwal_core import faults
from memwal_core.jobs import compaction, gc, merge, snapshot
from memwal_core.state.store import open_store

GC_CONFIG = gc.GcOptions(manifest_retention=2, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                        cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0, max_workers=1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("job", choices=["merge", "compact", "snapshot", "gc"])
    p.add_argument("uri")
    p.add_argument("--inline-threshold", type=int, default=snapshot.DEFAULT_INLINE_THRESHOLD)
    p.add_argument("--budget", type=int, default=merge.DEFAULT_BUDGET_BYTES)
    a = p.parse_args()
    loc = open_store(a.uri)
    if a.job == "merge":
        from memwal_core.spark.session import get_spark

        spark = get_spark("local[1]", {"spark.sql.shuffle.partitions": "2"})
        r = merge.merge(loc, spark, budget_bytes=a.budget)
        result, failed = r.to_dict(), r.region_errors
    elif a.job == "compact":
        from memwal_core.spark.session import get_spark

        spark = get_spark("local[1]", {"spark.sql.shuffle.partitions": "2"})
        r = compaction.compact(loc, spark)
        result, failed = r.to_dict(), r.errors
    elif a.job == "snapshot":
        r = snapshot.build_snapshot(loc, inline_threshold=a.inline_threshold, max_workers=1)
        result, failed = asdict(r), r.region_errors
    else:
        r = gc.run_gc(loc, GC_CONFIG)
        result, failed = r.to_dict(), r.region_errors
    print(json.dumps({"ops": faults.ops(), "result": result}, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
