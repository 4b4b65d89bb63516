"""What the merge-commit check (`memwal_core/jobs/merge/verify.py`) costs, next to the commit itself.

usage: python bench/verify_commit.py [--rows 100000] [--keys 100,1000,10000,50000]
A base table of `--rows` rows (the demo schema, btree index on the key, MemWAL initialized);
for each key count a `merge_insert` upserting that many keys (half existing, half new) and
tombstoning a tenth as many, then `verify_commit` on the version it made. Prints the commit
and check times (best of 3 checks) as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import pyarrow as pa

from memwal_core.jobs.merge import verify
from memwal_core.jobs.merge import delete_predicate
from memwal_core.state import table
from memwal_core.state.store import open_store
from memwal_core.tools import demo


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--keys", default="100,1000,10000,50000")
    a = p.parse_args()
    loc = open_store(tempfile.mkdtemp() + "/t")
    demo.create_table(loc, base_rows=a.rows, btree_index=True)
    rng = random.Random(1)
    for k in (int(x) for x in a.keys.split(",")):
        ids = rng.sample(range(a.rows * 2), k)
        gone = pa.table({"id": pa.array(rng.sample(range(a.rows), max(1, k // 10)), pa.int64())})
        ids = [i for i in ids if i not in set(gone.column("id").to_pylist())]
        ds = table.open_dataset(loc)
        t0 = time.perf_counter()
        (ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
         .when_not_matched_by_source_delete(delete_predicate(gone, ["id"]))
         .execute(demo.rows_table([demo.row(i, 1) for i in ids])))
        commit_s = time.perf_counter() - t0
        up = pa.table({"id": pa.array(ids, pa.int64())})
        best, check = None, None
        for _ in range(3):
            check = verify.verify_commit(loc, ds.version, {}, up, gone, ["id"])
            best = check.seconds if best is None else min(best, check.seconds)
        assert not check.bad_rows and check.landed, check.describe()
        print(json.dumps({"base_rows": table.open_dataset(loc).count_rows(), "upserted_keys": len(ids),
                          "tombstoned_keys": gone.num_rows, "commit_ms": round(commit_s * 1000, 1),
                          "check_ms": round(best * 1000, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
