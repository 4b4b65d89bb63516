"""Race `region.commit_next` against another process from the same loaded version.

usage: commit_racer.py ROOT REGION_ID START_VERSION INDEX ROUNDS READY_DIR GO_FILE
Each round commits `wal_entry_position_last_seen = max(current, 1000 + 2 * round + INDEX)`.
Prints one JSON line: {"index": INDEX, "commits": [[version, value], ...], "attempts": N}.
"""

import json
import os
import sys
import time

from memwal_core.state import region
from memwal_core.state.store import LocalStore


def main() -> None:
    root, rid, start, index, rounds, ready_dir, go = sys.argv[1:8]
    start, index, rounds = int(start), int(index), int(rounds)
    store = LocalStore(root)
    current = region.load_version(store, rid, start)
    open(os.path.join(ready_dir, str(index)), "w").close()
    deadline = time.time() + 30
    while not os.path.exists(go):
        if time.time() > deadline:
            sys.exit("no go signal")
        time.sleep(0.001)
    commits = []
    for r in range(rounds):
        value = 1000 + 2 * r + index

        def bump(msg, value=value):
            msg.wal_entry_position_last_seen = max(msg.wal_entry_position_last_seen, value)
            return True

        current = region.commit_next(store, current, bump, max_attempts=10_000)
        commits.append([current.version, value])
    print(json.dumps({"index": index, "commits": commits,
                      "attempts": store.stats["put_if_absent"]}))


if __name__ == "__main__":
    main()
