"""A pylance writer flushing continuously, for the concurrency suite.

usage: reliability_writer.py URI SEED GO_FILE OUT_JSON [STOP_FILE]
Waits for GO_FILE (which holds the deadline as epoch seconds), then until the deadline (or
until STOP_FILE exists) writes
a deterministic (seeded) sequence of puts and deletes through one ShardWriter per region value
(bucket), small MemTables so that generations are flushed all the time; every 25 batches one
region's writer is closed and re-opened (a new writer epoch, a fence sentinel). At the end
every writer is closed (flushed) and OUT_JSON gets {"model": {id: row}, "batches": n,
"regions": {value: region id}, "reopens": n}.
"""

import json
import os
import random
import sys
import time
import uuid

import lance
import pyarrow as pa
from lance.mem_wal import evaluate_sharding_spec

from memwal_core.tools import demo

MAX_MEMTABLE_ROWS = 40
BATCH = 12


def main() -> int:
    uri, seed, go, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    stop = sys.argv[5] if len(sys.argv) > 5 else None
    rng = random.Random(seed)
    ds = lance.dataset(uri)
    model = {r["id"]: r for r in ds.to_table().to_pylist()}
    spec = ds.mem_wal_index_details()["sharding_specs"][0]
    key_space = 600
    keys = list(range(key_space))
    values = evaluate_sharding_spec(pa.record_batch([pa.array(keys, pa.int64())], names=["id"]), spec,
                                    ds.lance_schema).column(0).to_pylist()
    by_value: dict = {}
    for k, v in zip(keys, values):
        by_value.setdefault(v, []).append(k)
    region_of = {v: str(uuid.UUID(int=rng.getrandbits(128), version=4)) for v in sorted(by_value)}
    while not os.path.exists(go):
        time.sleep(0.01)
    time.sleep(0.05)
    deadline = float(open(go).read())
    writers = {}

    def writer(v):
        if v not in writers:
            writers[v] = lance.dataset(uri).mem_wal_writer(region_of[v], max_memtable_rows=MAX_MEMTABLE_ROWS,
                                                          durable_write=False)
        return writers[v]

    batches = reopens = 0
    while time.time() < deadline and not (stop and os.path.exists(stop)):
        v = rng.choice(sorted(by_value))
        pool = by_value[v]
        batches += 1
        if rng.random() < 0.15:
            live = [k for k in pool if k in model]
            if live:
                gone = rng.sample(live, min(3, len(live)))
                writer(v).delete(pa.table({"id": pa.array(gone, pa.int64())}))
                for k in gone:
                    model.pop(k)
        else:
            ks = sorted(set(rng.choice(pool) for _ in range(BATCH)))
            rows = [demo.row(k, batches) for k in ks]
            writer(v).put(demo.rows_table(rows))
            model.update({r["id"]: r for r in rows})
        if batches % 25 == 0:
            v = rng.choice(sorted(writers))
            writers.pop(v).close()
            reopens += 1
        time.sleep(0.02)
    for w in writers.values():
        w.close()
    with open(out + ".tmp", "w") as f:
        json.dump({"model": {str(k): r for k, r in model.items()}, "batches": batches,
                   "regions": {str(v): r for v, r in region_of.items()}, "reopens": reopens}, f)
    os.replace(out + ".tmp", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
