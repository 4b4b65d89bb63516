"""A writer and merger in a loop in its own process (own SparkSession): the merges another
process's compaction runs beside.

usage: merge_loop.py URI ROUNDS READY_FILE OUT_JSON
Writes READY_FILE once Spark is warm, then ROUNDS times: pylance ShardWriters flush a round of
puts, overwrites and deletes, and the merger merges them (waiting for the table lease as long
as a compaction holds it). From the second round on, the round is written at once and merged
once another process committed after the previous merge (or 300 s passed): the other
process's compaction runs while this one writes, and each merge lands beside it. Then OUT_JSON: {"model": {id: row}, "merged": {region: generation},
"commits": n}.
"""

import json
import sys
import time

from proc_log import log_memwal_to_stderr

from memwal_core.jobs import merge
from memwal_core.options import LeaseOptions
from memwal_core.spark.session import get_spark
from memwal_core.state import table
from memwal_core.state.store import open_store
from memwal_core.tools import demo


def main() -> int:
    uri, rounds, ready, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    log_memwal_to_stderr()
    loc = open_store(uri)
    w = demo.Workload(loc, seed=17, key_space=20_000, max_memtable_rows=100)
    spark = get_spark("local[1]", {"spark.sql.shuffle.partitions": "2"})
    spark.range(1).collect()  # warm
    open(ready, "w").close()
    commits = 0
    merged_at = None
    for _ in range(rounds):
        w.write_round(60, overwrite=0.4, delete=0.1, puts_per_batch=20)
        deadline = time.time() + 300
        while merged_at is not None and table.open_dataset(loc).version == merged_at and time.time() < deadline:
            time.sleep(0.2)
        r = merge.merge(loc, spark, lease=LeaseOptions(wait_seconds=300))
        merged_at = r.table_version  # read under the lease: no compaction commit in it yet
        if r.region_errors:
            print(f"merge failed: {r.region_errors}", file=sys.stderr)
            return 1
        commits += r.commits
    with open(out, "w") as f:
        json.dump({"model": {str(k): v for k, v in w.expected().items()},
                   "merged": table.read_memwal_state(loc).merged, "commits": commits}, f)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
