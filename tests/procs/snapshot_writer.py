"""A pylance ShardWriter flushing repeatedly in its own process (snapshot coexistence test).

usage: snapshot_writer.py TABLE_URI REGION_ID FIRST_KEY NUM_PUTS ROWS_PER_PUT MAX_MEMTABLE_ROWS SLEEP_S READY_FILE
Writes READY_FILE once the writer is open, then puts NUM_PUTS batches of demo rows (keys
FIRST_KEY...), sleeping SLEEP_S between puts, closes the writer and prints one JSON line
{"keys": [...], "version": V} with every key written (row version V).
"""

import json
import sys
import time

import lance

from memwal_core.tools import demo

VERSION = 7


def main() -> None:
    uri, rid, first, nputs, per_put, max_rows, sleep_s, ready = sys.argv[1:9]
    first, nputs, per_put, max_rows, sleep_s = int(first), int(nputs), int(per_put), int(max_rows), float(sleep_s)
    ds = lance.dataset(uri)
    keys = []
    with ds.mem_wal_writer(rid, max_memtable_rows=max_rows) as w:
        open(ready, "w").close()
        for i in range(nputs):
            batch = list(range(first + i * per_put, first + (i + 1) * per_put))
            w.put(demo.rows_table([demo.row(k, VERSION) for k in batch]))
            keys.extend(batch)
            time.sleep(sleep_s)
    print(json.dumps({"keys": keys, "version": VERSION}))


if __name__ == "__main__":
    main()
