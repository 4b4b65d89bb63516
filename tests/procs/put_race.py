"""Race `LocalStore.put_if_absent` on the same keys from several processes.

usage: put_race.py ROOT TAG NKEYS SIZE READY_DIR GO_FILE
Writes READY_DIR/TAG when ready, waits for GO_FILE, then for each key k0..k{NKEYS-1} calls
put_if_absent with a payload of SIZE bytes that names TAG, and prints one JSON line:
{"tag": TAG, "won": [key, ...]}.
"""

import json
import os
import sys
import time

from memwal_core.state.store import LocalStore


def payload(tag: str, key: str, size: int) -> bytes:
    head = f"{tag}:{key}:".encode()
    return head + bytes([65 + (len(tag) + i) % 26 for i in range(size - len(head))])


def main() -> None:
    root, tag, nkeys, size, ready_dir, go = sys.argv[1:7]
    nkeys, size = int(nkeys), int(size)
    store = LocalStore(root)
    data = {f"race/k{i}": payload(tag, f"race/k{i}", size) for i in range(nkeys)}
    open(os.path.join(ready_dir, tag), "w").close()
    deadline = time.time() + 30
    while not os.path.exists(go):
        if time.time() > deadline:
            sys.exit("no go signal")
        time.sleep(0.001)
    won = [k for k, d in data.items() if store.put_if_absent(k, d)]
    print(json.dumps({"tag": tag, "won": won}))


if __name__ == "__main__":
    main()
