"""Benchmark: GC pass time as history grows, with the shipped retention (base versions kept a week).

A real pylance table (bucket-sharded, `--regions` regions). Every cycle: pylance `ShardWriter`s
flush a generation per region (`--rows` operations), one commit records them as merged (an
empty `merge_insert` marking them, the merger's commit without rows), `--extra-versions` more
table versions are committed (standing for compaction, index catch-up and the MemWAL index
snapshot: `update_config`), then one GC pass with the default `GcOptions` runs. Nothing is ever
old enough for the base-version cleanup, so every version stays retained and holds every
generation: nothing is collected, and each pass sees all of the history.

Every GC run is a new process in a deployment (CLI, Dagster run), so before each timed pass the
in-process caches are emptied (`leaks._REFS`, the lifecycle's `_SEEN`); what carries over from one
pass to the next is only what GC keeps on the store (`_memwal/gc_versions.json` and the sealed
older versions under `_memwal/gc_versions/`, `_memwal/gc_refs.json`, `_memwal/gc_regions/`).

Measured: the pass time (`run_gc`), median (and mean, max) of the first and of the last `--window`
cycles, and the CPU time of the same passes (the process's, all threads: steadier than wall time
on a busy machine), the cycles whose pass listed the whole table (`full_scan_interval_seconds`), and
the baselines in the same run: **interleaved rounds** (`--ab-rounds`), where a copy of the table
taken after the first window and the table at the end take turns, a cycle and a timed pass each,
in ABBA order, so both histories are timed under the same machine load (the two windows are
minutes apart, and a loaded machine moves their medians more than what is measured); a
**full-read pass** (those summaries removed first, so every retained manifest, WAL entry and
manifest version is read again, as before they existed), `--reps`
times right after the first window and at the end; and as often a **scan pass**: one that lists
the whole table with what the summaries know (`full_scan_interval_seconds=0`), as a deployment's
pass does once per interval. Also counted: GETs per pass at the end.

usage: python bench/gc_history.py [--cycles 1000] [--quick]
Prints `RESULT gc_history ... pass_last_over_first=R ab_last_over_first=A full_last_over_first=F
last_full_over_cached=S`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, print_machine, ratio, result, say, workdir  # noqa: E402  (puts tests/ on the path)
from support.gc_passes import forget_process, mark_merged  # noqa: E402

from memwal_core.jobs import gc  # noqa: E402
from memwal_core.jobs.gc import fact_segments  # noqa: E402
from memwal_core.state import layout, table  # noqa: E402
from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402


def forget_store(loc) -> None:
    """What GC keeps on the store between passes (the full-read baseline starts without it)."""
    loc.store.delete_many([layout.GC_VERSIONS_KEY, layout.GC_REFS_KEY]
                          + [o.key for d in (layout.GC_REGIONS_DIR, fact_segments.DIR)
                             for o in loc.store.list(d)])


# A pass that lists the whole table with what the summaries know (once per interval in a deployment).
SCAN = (gc.GcOptions(full_scan_interval_seconds=0) if "full_scan_interval_seconds" in gc.GcOptions.__dataclass_fields__
        else gc.GcOptions())


CPU: list[float] = []  # CPU-s of every timed pass (this process, all its threads): steadier than wall time on a busy machine


def gc_pass(loc, *, full: bool = False, scan: bool = False) -> tuple[float, gc.GcResult]:
    forget_process()
    if full:
        forget_store(loc)
    t, c = time.perf_counter(), time.process_time()
    r = gc.run_gc(loc, SCAN if scan else None)
    s = time.perf_counter() - t
    CPU.append(time.process_time() - c)
    if r.region_errors:
        raise SystemExit(f"GC failed: {r.region_errors}")
    return s, r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--regions", type=int, default=2)
    p.add_argument("--rows", type=int, default=40, help="operations per cycle (over all regions)")
    p.add_argument("--extra-versions", type=int, default=3, help="table versions per cycle besides the merge")
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--reps", type=int, default=5, help="full-read passes per checkpoint")
    p.add_argument("--ab-rounds", type=int, default=50,
                   help="interleaved rounds at the end: a cycle and a pass on the early copy and on the table")
    p.add_argument("--workdir")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.cycles, a.window, a.reps, a.ab_rounds = 40, 10, 3, 6
    window = max(1, min(a.window, a.cycles // 4))
    print_machine("gc_history", a)
    base = workdir("gc-history", a.workdir)
    try:
        return run(a, base, window)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def one_cycle(a, w: demo.Workload, loc, label: str) -> None:
    """Writers flush a generation per region, one commit marks them merged, and `--extra-versions`
    more table versions are committed: what a deployment's cycle leaves GC to look at."""
    w.write_round(a.rows, overwrite=0.3, delete=0.05, puts_per_batch=50)
    mark_merged(loc, sorted(w.regions.values()))
    ds = table.open_dataset(loc)
    for i in range(a.extra_versions):
        ds.update_config({"bench.cycle": f"{label}.{i}"})


def interleaved(a, early: demo.Workload, late: demo.Workload) -> dict[str, list[tuple[float, float]]]:
    """`--ab-rounds` rounds of a cycle and a timed pass on each table, in ABBA order: (wall, CPU)
    per pass, for the early copy ("first") and the table at the end ("last")."""
    out: dict[str, list[tuple[float, float]]] = {"first": [], "last": []}
    for i in range(a.ab_rounds):
        turn = [("first", early), ("last", late)]
        for key, w in (turn if i % 2 == 0 else turn[::-1]):
            one_cycle(a, w, w.loc, f"ab{i}")
            s, r = gc_pass(w.loc)
            if r.deleted_objects:
                raise SystemExit(f"round {i}: GC deleted {r.deleted_objects} objects; nothing is old enough")
            out[key].append((s, CPU[-1]))
    return out


def run(a, base: str, window: int) -> int:
    loc = open_store(os.path.join(base, "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=a.regions, base_rows=1000)
    w = demo.Workload(loc, seed=3, key_space=10**6, max_memtable_rows=max(1000, a.rows * 4))
    early: demo.Workload | None = None  # a copy of the table after the first window
    passes: list[float] = []
    cpu: list[float] = []  # the same passes' CPU-s
    full_scans: list[int] = []  # cycles whose pass listed the table (`full_scan_interval_seconds`)
    full: dict[str, list[float]] = {}
    scans: dict[str, list[float]] = {}
    t0 = time.monotonic()
    for cycle in range(1, a.cycles + 1):
        one_cycle(a, w, loc, str(cycle))
        s, r = gc_pass(loc)
        passes.append(s)
        cpu.append(CPU[-1])
        if getattr(r.plan.history, "listed", True) or "skipped" not in r.leak_scan:
            full_scans.append(cycle)
        if r.deleted_objects:
            raise SystemExit(f"cycle {cycle}: GC deleted {r.deleted_objects} objects; nothing is old enough")
        if cycle == window or cycle == a.cycles:
            key = "first" if cycle == window else "last"
            full[key] = [gc_pass(loc, full=True)[0] for _ in range(a.reps)]
            gc_pass(loc)  # back to what the summaries know
            scans[key] = [gc_pass(loc, scan=True)[0] for _ in range(a.reps)]
            if key == "first" and a.ab_rounds:
                shutil.copytree(os.path.join(base, "t"), os.path.join(base, "early"), symlinks=True)
                early = demo.Workload(open_store(os.path.join(base, "early")), seed=4, key_space=10**6,
                                      max_memtable_rows=w.max_memtable_rows, regions=dict(w.regions),
                                      version=w.version)
        if cycle % 50 == 0 or cycle == a.cycles:
            say(f"cycle {cycle}/{a.cycles} ({time.monotonic() - t0:.0f} s): GC {s * 1e3:.0f} ms, "
                f"{r.retained_versions} base versions retained, history {r.plan.history.to_dict()}")
    loc.store.stats.clear()
    last_s, last = gc_pass(loc)
    gets = dict(loc.store.stats)
    wal_entries = sum(1 for rid in w.regions.values() for o in loc.store.list(layout.wal_dir(rid)))
    manifest_versions = sum(1 for rid in w.regions.values() for o in loc.store.list(layout.manifest_dir(rid)))
    first_w, last_w = median(passes[:window]), median(passes[-window:])
    ab = interleaved(a, early, w) if early is not None else {}
    ab_fields = {}
    if ab:
        af, al = median([x for x, _ in ab["first"]]), median([x for x, _ in ab["last"]])
        cf, cl = median([c for _, c in ab["first"]]), median([c for _, c in ab["last"]])
        ab_fields = dict(ab_rounds=a.ab_rounds, ab_first_s=af, ab_last_s=al, ab_last_over_first=ratio(al, af),
                         ab_cpu_first_s=cf, ab_cpu_last_s=cl, ab_cpu_last_over_first=ratio(cl, cf))
    result("gc_history", cycles=a.cycles, regions=a.regions, window=window,
           base_versions=last.retained_versions, wal_entries=wal_entries, manifest_versions=manifest_versions,
           pass_first_s=first_w, pass_last_s=last_w, pass_last_over_first=ratio(last_w, first_w),
           pass_first_mean_s=round(sum(passes[:window]) / window, 3), pass_first_max_s=round(max(passes[:window]), 3),
           pass_last_mean_s=round(sum(passes[-window:]) / window, 3), pass_last_max_s=round(max(passes[-window:]), 3),
           cpu_first_s=median(cpu[:window]), cpu_last_s=median(cpu[-window:]),
           cpu_last_over_first=ratio(median(cpu[-window:]), median(cpu[:window])),
           full_scan_cycles=",".join(map(str, full_scans[:20])) or "none",
           full_first_s=median(full["first"]), full_last_s=median(full["last"]),
           full_last_over_first=ratio(median(full["last"]), median(full["first"])),
           last_full_over_cached=ratio(median(full["last"]), last_w),
           scan_first_s=median(scans["first"]), scan_last_s=median(scans["last"]),
           **ab_fields,
           requests_last_pass="/".join(f"{k}:{v}" for k, v in sorted(gets.items())),
           seconds=round(time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
