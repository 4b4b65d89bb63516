"""A merger in its own process (own SparkSession), for concurrency and crash tests.

Usage: python -m tests.procs.merge_proc URI [--budget BYTES] [--ready FILE --go FILE]
Prints the MergeResult as JSON on the last line; MEMWAL_CRASH_AT makes it die at a point.
With --ready/--go it creates FILE `--ready` once its SparkSession is up, then merges only once
FILE `--go` exists (a test lines several mergers up after their JVMs are warm).
"""

import argparse
import json
import os
import sys
import time

from memwal_core.jobs import merge
from memwal_core.options import LeaseOptions
from memwal_core.spark.session import get_spark
from memwal_core.state.store import open_store


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("uri")
    p.add_argument("--budget", type=int, default=merge.DEFAULT_BUDGET_BYTES)
    p.add_argument("--ready")
    p.add_argument("--go")
    a = p.parse_args()
    spark = get_spark("local[1]", {"spark.sql.shuffle.partitions": "2"})
    if a.ready:  # line the mergers up after their JVMs are warm: say so, merge when told
        open(a.ready, "w").close()
    while a.go and not os.path.exists(a.go):
        time.sleep(0.01)
    # The lease serializes two mergers: the second waits for the first however slow the machine.
    result = merge.merge(open_store(a.uri), spark, budget_bytes=a.budget, lease=LeaseOptions(wait_seconds=240))
    print(json.dumps(result.to_dict()))
    return 1 if result.region_errors else 0


if __name__ == "__main__":
    sys.exit(main())
