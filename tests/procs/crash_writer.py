"""Open a pylance ShardWriter, put rows, and die without closing it (a crashed writer).

usage: crash_writer.py TABLE_URI REGION_ID FIRST_KEY N_KEYS VERSION
The puts are durable WAL entries (durable_write defaults to true); no MemTable is flushed.
"""

import os
import sys

import lance

from memwal_core.tools import demo


def main() -> None:
    uri, rid, first, n, version = sys.argv[1:6]
    first, n, version = int(first), int(n), int(version)
    ds = lance.dataset(uri)
    w = ds.mem_wal_writer(rid, max_memtable_rows=1000)
    keys = list(range(first, first + n))
    half = len(keys) // 2
    for chunk in (keys[:half], keys[half:]):
        w.put(demo.rows_table([demo.row(k, version) for k in chunk]))
    sys.stdout.flush()
    os._exit(0)  # no close(): nothing flushed, the WAL entries are all that is left


if __name__ == "__main__":
    main()
