"""The garbage collector in its own process (crash tests).

usage: gc_proc.py TABLE_URI [--grace SECONDS] [--keep N] [--min-age SECONDS] [--base-cleanup SECONDS]
Prints the GcResult as JSON on the last line; MEMWAL_CRASH_AT=gc.after_manifest_commit makes it
die right after committing the first region manifest that unlists generations.
"""

import argparse
import json
import sys

from memwal_core.jobs import gc
from memwal_core.state.store import open_store


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("uri")
    p.add_argument("--grace", type=float, default=3600.0)
    p.add_argument("--keep", type=int, default=10)
    p.add_argument("--min-age", type=float, default=3600.0)
    p.add_argument("--base-cleanup", type=float, default=None)
    a = p.parse_args()
    cfg = gc.GcOptions(manifest_retention=a.keep, manifest_min_age_seconds=a.min_age, orphan_grace_seconds=a.grace,
                      cleanup_base_versions_older_than_seconds=a.base_cleanup,
                      cleanup_base_versions_floor_seconds=a.base_cleanup or 0)
    result = gc.run_gc(open_store(a.uri), cfg)
    print(json.dumps(result.to_dict()))
    return 1 if result.region_errors else 0


if __name__ == "__main__":
    sys.exit(main())
