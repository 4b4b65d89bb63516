"""`memwal demo`: a small table written by pylance's writers, maintained once, read back."""

from __future__ import annotations

import os
import shutil

from memwal_core.steps.outcome import STEPS

from .maintain import run_pass
from .output import CliError, say
from .status import print_status


DEMO_MARKER = ".memwal-demo"
# What a table written by an older `memwal demo` (before the marker) holds, and nothing else.
_DEMO_ENTRIES = {"_versions", "_mem_wal", "_memwal", "data", "_indices", "_transactions", "_deletions"}


def _clear_demo_path(path: str, *, force: bool) -> None:
    """Make room for the demo at `path`, deleting only what a previous demo wrote there.

    A missing or empty directory is used as is; a directory with the demo's marker (or an older
    demo table: Lance's directories only, the demo's schema) is replaced; anything else is
    refused unless --force.
    """
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        entries = set(os.listdir(path))
        if not entries:
            return
        if DEMO_MARKER in entries or force or _looks_like_old_demo(path, entries):
            say(f"removing the previous demo table at {path}")
            shutil.rmtree(path)
            return
    elif force:
        say(f"removing {path}")
        os.remove(path)
        return
    raise CliError(f"{path} exists and is not a table memwal demo wrote: not touching it "
                   "(choose another --path, or --force to replace it)")


def _looks_like_old_demo(path: str, entries: set[str]) -> bool:
    if not entries <= _DEMO_ENTRIES or "_mem_wal" not in entries:
        return False
    try:
        import lance

        from memwal_core.tools import demo

        return lance.dataset(path).schema.remove_metadata() == demo.SCHEMA.remove_metadata()
    except Exception:  # noqa: BLE001 - not a readable demo table: not ours to delete
        return False


def cmd_demo(a) -> int:
    from memwal_core.observe import reader
    from memwal_core.options import GcOptions, check_spark_master
    from memwal_core.state.store import open_store
    from memwal_core.tools import demo

    from ..config import single_table

    check_spark_master(a.spark_master, "--spark-master")
    path = os.path.abspath(a.path)
    _clear_demo_path(path, force=a.force)
    loc = open_store(path)
    from memwal_core.spark import session as spark

    spark.prestart(a.spark_master)  # the JVM starts while the writers write
    say(f"writing a demo table at {path}: {a.regions} bucket regions, ~{a.rows} operations per round")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, DEMO_MARKER), "w") as f:  # first: an interrupted demo is still ours
        f.write("written by `memwal demo`; `memwal demo --path` may replace this directory\n")
    demo.create_table(loc, sharding="bucket", num_buckets=a.regions, base_rows=a.rows // 2, btree_index=True)
    w = demo.Workload(loc, seed=42, key_space=max(10, a.rows), max_memtable_rows=max(100, a.rows // a.regions))
    for _ in range(3):
        w.write_round(a.rows, overwrite=0.3, delete=0.03)
    # The demo cleans up base-table versions at the retention floor (a day), as a deployment
    # would: GC then says which generations the retained versions still hold.
    cfg = single_table(path, spark_master=a.spark_master, name="demo",
                       base_versions_older_than=GcOptions().cleanup_base_versions_floor_seconds)
    report = run_pass(cfg, list(STEPS), verbose=a.verbose)
    got = {r["id"]: r for r in reader.lsm_table(loc).to_pylist()}
    ok = got == w.expected()
    print_status(path)
    print(f"LSM read equals what the writers wrote: {'yes' if ok else 'NO'} ({len(got)} rows)")
    for line in report.failed:
        say(f"error: {line}")
    return 0 if ok and not report.failed else 1
