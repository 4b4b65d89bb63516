"""A merger committing merge progress for one region, in its own process (snapshot race test).

usage: snapshot_merger.py TABLE_URI REGION_ID MARKER_KEY FIRST_GEN COUNT GO_FILE [PACE_FILE PACE_TARGET]
Waits for GO_FILE, then for g = FIRST_GEN .. FIRST_GEN+COUNT-1 upserts a few rows, among them
the marker row `id = MARKER_KEY` with `n = g`, in one `merge_insert` that also marks
generation g of REGION_ID as merged. The marker row therefore always holds the highest
generation merged for the region, in every table version. A generation refused as stale was
already recorded (by this process: an earlier attempt that did commit) and counts as merged.
With PACE_FILE, the i-th generation waits (up to 30 s) until the number written in PACE_FILE
(the racing builder's commits so far) reaches i * PACE_TARGET / COUNT: the race then spans at
least PACE_TARGET builder commits however fast this machine merges.
Prints one JSON line {"merged": [g, ...], "retries": N}.
"""

import json
import os
import sys
import time

import lance
from lance.mem_wal import CompactedSsTable

from memwal_core.state.lance_mem_wal import is_stale_merge
from memwal_core.tools import demo


def _paced(pace_file: str | None, want: int) -> None:
    deadline = time.time() + 30
    while pace_file and time.time() < deadline:
        try:
            if int(open(pace_file).read() or 0) >= want:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.01)


def main() -> None:
    uri, rid, marker, first, count, go = sys.argv[1:7]
    pace_file, pace_target = (sys.argv[7], int(sys.argv[8])) if len(sys.argv) > 8 else (None, 0)
    marker, first, count = int(marker), int(first), int(count)
    deadline = time.time() + 60
    while not os.path.exists(go):
        if time.time() > deadline:
            sys.exit("no go signal")
        time.sleep(0.005)
    merged, retries = [], 0
    for g in range(first, first + count):
        _paced(pace_file, (g - first) * pace_target // count)
        src = demo.rows_table([demo.row(marker, g)] + [demo.row(marker + j, g) for j in (1, 2)])
        for attempt in range(50):
            try:
                (lance.dataset(uri).merge_insert("id").when_matched_update_all()
                 .when_not_matched_insert_all()
                 .mark_sstables_as_compacted([CompactedSsTable(rid, g)]).execute(src))
                break
            except Exception as e:  # noqa: BLE001
                if is_stale_merge(e):
                    break
                retries += 1
                time.sleep(0.01 * (1 + attempt % 5))
        else:
            sys.exit(f"merge of generation {g} failed 50 times")
        merged.append(g)
    print(json.dumps({"merged": merged, "retries": retries}))


if __name__ == "__main__":
    main()
