"""Hold a table's lease in a process of its own (tests/test_lease.py).

usage: lease_holder.py URI TTL MODE READY_FILE [GO_FILE] [storage options as K=V ...]
MODE `exit`: acquire, write READY_FILE, then `os._exit(0)` without releasing (a crashed holder).
MODE `commit`: acquire, write READY_FILE, wait for GO_FILE (the test SIGSTOPs this process in
between, past the TTL, and lets another maintainer take over), then run the MemWAL index
builder while still "holding" the lease: prints `refused: ...` when the fence stops its commit,
else `committed: table version N`.
"""

import os
import sys
import time

from memwal_core.jobs import snapshot
from memwal_core.options import LeaseOptions
from memwal_core.state import lease, table
from memwal_core.state.store import open_store


def main() -> int:
    uri, ttl, mode, ready = sys.argv[1:5]
    rest = sys.argv[5:]
    go = rest.pop(0) if mode == "commit" else None
    options = dict(kv.split("=", 1) for kv in rest)
    loc = open_store(uri, options)
    opts = LeaseOptions(ttl_seconds=float(ttl), wait_seconds=5)
    with lease.hold(loc, "test holder", opts):
        open(ready, "w").close()
        if mode == "exit":
            os._exit(0)
        while not os.path.exists(go):
            time.sleep(0.05)
        try:
            snapshot.build_snapshot(loc, lease=opts)
        except lease.LeaseLost as e:
            print(f"refused: {e}", flush=True)
            return 0
        print(f"committed: table version {table.open_dataset(loc).version}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
