"""pylance only: a commit made with a `commit_lock` overwrites a concurrent commit made without one.

usage: lance_commit_lock_overwrite.py [DIR] [SECONDS]   (prints one JSON line, exit 1 when commits were lost)

Lance commits through a `commit_lock` as lock(version) -> HEAD the manifest path -> write the
manifest with a plain put; a writer without the lock creates the same path with
create-if-absent. A writer without the lock whose manifest lands between the HEAD and the put
is overwritten: its `execute()` returned, its rows and its version are in no version of the
table. pylance documents the lock as the mutual exclusion of *all* writers ("only needed if
your object store does not support atomic commits"), so this is no bug of pylance's; it is why
memwal must not use a `commit_lock` as a compare-and-swap on a table that other writers (its
own merger, an application) commit to without it.

A process upserts the row `id = 1000, n = g` for g = 1..N (merge_insert, default commit:
create-if-absent) while this process commits metadata updates through a lock that admits only
`read_version + 1` (memwal's old guard). Every g must be in some table version; the ones that
are not were overwritten. A large metadata value makes the locked manifest slow to write (a
wide window), so a few seconds usually show it on a loaded 2-core machine.
"""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import lance
import pyarrow as pa
from lance.dataset import LanceOperation

KEY = 1000


def upserter(uri: str, count: int) -> None:
    for g in range(1, count + 1):
        for attempt in range(100):
            try:
                (lance.dataset(uri).merge_insert("id").when_matched_update_all()
                 .when_not_matched_insert_all().execute(pa.table({"id": [KEY], "n": [g]})))
                break
            except OSError:
                time.sleep(0.002 * (1 + attempt % 5))
        else:
            sys.exit(f"upsert {g} failed 100 times")
    print(json.dumps({"upserted": count}))


def guard(read_version: int):
    @contextlib.contextmanager
    def lock(version: int):
        if version != read_version + 1:
            raise RuntimeError("lost race")
        yield

    return lock


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    uri = os.path.join(root, "t.lance")
    lance.write_dataset(pa.table({"id": list(range(30)), "n": [0] * 30}), uri)
    count = 100_000
    proc = subprocess.Popen([sys.executable, __file__, "--upsert", uri, str(count)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    big = "x" * 1_000_000  # a slow manifest write: the window between the HEAD and the put
    locked, deadline = 0, time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        ds = lance.dataset(uri)
        try:
            lance.LanceDataset.commit(uri, LanceOperation.UpdateConfig(
                config_updates=LanceOperation.UpdateMap({"pad": big + str(locked)}, replace=False)),
                read_version=ds.version, commit_lock=guard(ds.version), max_retries=0)
            locked += 1
        except (OSError, RuntimeError):
            pass
    proc.kill()
    _, err = proc.communicate()
    ds = lance.dataset(uri)
    seen = {0}
    for v in range(1, ds.version + 1):
        seen.update(r["n"] for r in lance.dataset(uri, version=v).to_table(filter=f"id = {KEY}").to_pylist())
    if not seen - {0}:
        print(err, file=sys.stderr)
        return 2
    upserted = max(seen)  # the last one in flight when killed may be missing: not counted
    lost = sorted(set(range(1, upserted)) - seen)
    print(json.dumps({"versions": ds.version, "locked_commits": locked, "upserts": upserted,
                      "lost_upserts": lost}))
    return 1 if lost else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--upsert"]:
        upserter(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
