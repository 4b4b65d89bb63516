"""Benchmark: long-run table health, with base-table compaction on vs off, in one run.

Two copies of one table (bucket-sharded, `--regions` regions, `--base-rows` rows, a btree on
the primary key that MemTables maintain). Every cycle, on each copy: pylance `ShardWriter`s
flush one generation per region (`--rows` operations per cycle: new keys, overwrites of live
keys, a few deletes; the same seeded sequence on both copies), then the pipeline's order runs:
the merger merges them (`merge.merge`, Spark), on the "on" copy the compaction step runs
(`compaction.compact` with the default options: it compacts only when the table's health
says so), then index catch-up, the MemWAL index snapshot and GC, as every maintenance pass does
(`--no-gc` leaves the last two out, as this bench did before). GC runs with the default
`GcOptions`, which configure no base-version cleanup: every retained base version holds its
generations, so none is collected and each pass reads every version;
`--gc-base-versions-older-than S` runs the cleanup (what a deployment should set). Per
cycle and copy it records the merge time, the fragment count, the fragments with deletion
files, a full scan and `--lookups` point lookups (`id = k` through the btree, random live
keys). The two copies alternate which goes first each cycle, so machine noise hits both.

Merge time in a long-lived process also grows with the process (the Spark driver's state
after thousands of jobs), which a Dagster run, a new process each time, never sees. So at
the start and at the end a **fresh process** (`--probe`) merges `--probe-cycles` more cycles
on a copy of each table: `merge_fresh_last_over_first_*` is the table's own share.

At the end: a fresh copy of the "on" table fully compacted (`compact_files`) and the two
copies are scanned `--final-reps` times each (median).

Goals, as ratios in one run: with compaction, the median merge time of the last
`--window` cycles <= 1.2x the first window's, and its scan time <= 1.2x the freshly compacted
table's; without compaction, the growth is reported.

usage:
  python bench/steady_state.py                         # 1,000 cycles on a 100,000-row base (hours on 2 cores)
  python bench/steady_state.py --max-seconds 1800     # as many of them as fit in 30 min
  python bench/steady_state.py --quick                # 12 cycles (smoke test)
  python bench/steady_state.py --cycles 300 --cheap-rewrite-bytes 0   # the ratio thresholds alone
Prints `RESULT steady_state ...` (the ratios) and `RESULT steady_state_window ...` lines.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lance  # noqa: E402
from common import median, print_machine, ratio, result, say, workdir  # noqa: E402

from memwal_core.jobs import catchup, compaction, gc, merge, snapshot  # noqa: E402
from memwal_core.spark.session import get_spark  # noqa: E402
from memwal_core.state import region, region_values, table
from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo


def make_table(root: str, a) -> None:
    loc = open_store(root)
    demo.create_table(loc, sharding="bucket", num_buckets=a.regions, base_rows=a.base_rows,
                      btree_index=True, maintained_indexes=["id_btree"])


def scan_s(loc) -> float:
    t = time.perf_counter()
    table.open_dataset(loc).to_table()
    return time.perf_counter() - t


def lookups_s(loc, keys: list[int]) -> float:
    ds = table.open_dataset(loc)
    t = time.perf_counter()
    for k in keys:
        ds.to_table(filter=f"id = {k}")
    return time.perf_counter() - t


def probe(uri: str, cycles: int, compact: bool, rows: int) -> int:
    """In a fresh process: `cycles` more write+merge cycles on the table at `uri` (its own
    copy), the median merge time as the last line. Writers reuse the regions the table's
    snapshot records (a new region for a merged value is refused, as it must be); the snapshot
    is built first, as the index builder would have (a `--no-gc` loop never builds one)."""
    loc = open_store(uri)
    w = demo.Workload(loc, seed=1234, key_space=10**9, max_memtable_rows=max(1000, rows * 4))
    snapshot.build_snapshot(loc)
    state = table.read_memwal_state(loc)
    w.regions = {next(iter(v.values())): rid for rid, v in region_values.recorded_values(loc, state).items()}
    spark = get_spark("local[2]", {"spark.sql.shuffle.partitions": "2"})
    merge.merge(loc, spark)  # warm-up
    times = []
    for _ in range(cycles):
        w.write_round(rows, overwrite=0.4, delete=0.05, puts_per_batch=50)
        t = time.perf_counter()
        r = merge.merge(loc, spark)
        times.append(time.perf_counter() - t)
        if r.region_errors:
            raise SystemExit(f"probe merge failed: {r.region_errors}")
        if compact:
            compaction.compact(loc, spark)
        catchup.run_catchup(loc)
    print(f"PROBE {median(times[2:])}", flush=True)
    spark.stop()
    return 0


def fresh_process_merge_s(base: str, name: str, src: str, a) -> float:
    """Copy `src`, run `probe` on the copy in a new interpreter, return its median merge."""
    import subprocess

    dst = os.path.join(base, f"probe-{name}")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", dst,
                        "--probe-cycles", str(a.probe_cycles), "--rows", str(a.rows)]
                       + (["--probe-compact"] if name.startswith("on") else []),
                       capture_output=True, text=True, timeout=3600)
    shutil.rmtree(dst, ignore_errors=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")]
    if p.returncode or not lines:
        raise SystemExit(f"probe {name} failed: {p.stderr[-2000:]}")
    return float(lines[-1].split()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--regions", type=int, default=2)
    p.add_argument("--base-rows", type=int, default=100_000)
    p.add_argument("--rows", type=int, default=200, help="operations per cycle (over all regions)")
    p.add_argument("--lookups", type=int, default=100)
    p.add_argument("--window", type=int, default=100, help="cycles compared first vs last (capped at cycles/4)")
    p.add_argument("--final-reps", type=int, default=41)
    p.add_argument("--cheap-rewrite-bytes", type=int, default=None,
                   help="CompactionOptions.cheap_rewrite_bytes for the 'on' copy (default: the option's "
                        "default; 0: the ratio thresholds alone)")
    p.add_argument("--csv", help="write per-cycle rows here")
    p.add_argument("--no-gc", action="store_true", help="leave the snapshot and GC out of each cycle")
    p.add_argument("--gc-base-versions-older-than", type=float, default=None, metavar="SECONDS",
                   help="GC's base-version cleanup (gc.cleanup_base_versions_older_than_seconds; "
                        "default: off, as shipped, so retained versions hold every merged generation)")
    p.add_argument("--probe-cycles", type=int, default=30, help="cycles of each fresh-process probe (0: none)")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--probe-compact", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop the cycles after this long (the ratios then compare the cycles run)")
    p.add_argument("--workdir")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.probe:
        return probe(a.probe, a.probe_cycles, a.probe_compact, a.rows)
    if a.quick:
        a.cycles, a.base_rows, a.window = 12, 2000, 3
    print_machine("steady_state", a)
    base = workdir("steady", a.workdir)
    try:
        return run(a, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(a, base: str) -> int:
    template = os.path.join(base, "template")
    make_table(template, a)
    locs = {}
    workloads = {}
    for name in ("off", "on"):
        shutil.copytree(template, os.path.join(base, name))
        locs[name] = open_store(os.path.join(base, name))
        # The same seed on both copies: the same operations, cycle by cycle.
        workloads[name] = demo.Workload(locs[name], seed=7, key_space=a.base_rows * 50,
                                        max_memtable_rows=max(1000, a.rows * 4))
    fresh_first = {name: fresh_process_merge_s(base, f"{name}-first", template, a)
                   for name in ("off", "on")} if a.probe_cycles else {}
    spark = get_spark("local[2]", {"spark.sql.shuffle.partitions": "2"})
    merge.merge(locs["off"], spark)  # warm-up: JVM, Python workers (nothing to merge)
    opts = compaction.CompactionOptions() if a.cheap_rewrite_bytes is None else \
        compaction.CompactionOptions(cheap_rewrite_bytes=a.cheap_rewrite_bytes)
    # One process maintains the bench table: the floor may go down to the age measured.
    age = a.gc_base_versions_older_than
    gc_opts = gc.GcOptions(cleanup_base_versions_older_than_seconds=age,
                           cleanup_base_versions_floor_seconds=gc.GcOptions().cleanup_base_versions_floor_seconds
                           if age is None else age)
    rows: list[dict] = []
    rng = random.Random(11)
    t_start = time.monotonic()
    cycles = 0
    for cycle in range(1, a.cycles + 1):
        if a.max_seconds is not None and time.monotonic() - t_start > a.max_seconds:
            say(f"--max-seconds {a.max_seconds:g} reached after {cycles} of {a.cycles} cycles")
            break
        cycles = cycle
        order = ("off", "on") if cycle % 2 else ("on", "off")
        keys = None
        for name in order:
            loc, w = locs[name], workloads[name]
            w.write_round(a.rows, overwrite=0.4, delete=0.05, puts_per_batch=50)
            t = time.perf_counter()
            r = merge.merge(loc, spark)
            merge_s = time.perf_counter() - t
            if r.region_errors or r.generations_merged != a.regions:
                raise SystemExit(f"cycle {cycle} {name}: merge failed {r.region_errors} "
                                 f"({r.generations_merged} generations)")
            compact_s, compacted = 0.0, False
            if name == "on":
                t = time.perf_counter()
                c = compaction.compact(loc, spark, opts)
                compact_s, compacted = time.perf_counter() - t, c.status == "compacted"
                if c.errors:
                    raise SystemExit(f"cycle {cycle}: compaction errors {c.errors}")
            t = time.perf_counter()
            catchup.run_catchup(loc)
            catchup_s = time.perf_counter() - t
            gc_s = 0.0
            if not a.no_gc:
                t = time.perf_counter()
                snapshot.build_snapshot(loc)
                g = gc.run_gc(loc, gc_opts)
                gc_s = time.perf_counter() - t
                if g.region_errors:
                    raise SystemExit(f"cycle {cycle} {name}: GC failed {g.region_errors}")
            if keys is None:
                keys = rng.sample(sorted(w.model), min(a.lookups, len(w.model)))
            frag_list = table.open_dataset(loc).get_fragments()
            frags = len(frag_list)
            with_deletions = sum(1 for f in frag_list if f.metadata.deletion_file is not None)
            # What each merge and GC pass reads: generations the region manifests list, base versions.
            listed = sum(len(region.load_latest(loc.store, rid).generations)
                         for rid in region.list_regions(loc.store).region_ids)
            rows.append({"cycle": cycle, "table": name, "merge_s": merge_s, "catchup_s": catchup_s, "gc_s": gc_s,
                         "generations_listed": listed, "base_versions": len(table.open_dataset(loc).versions()),
                         "compact_s": compact_s, "compacted": compacted, "fragments": frags,
                         "with_deletions": with_deletions,
                         "scan_s": scan_s(loc), "lookups_s": lookups_s(loc, keys),
                         "rows": len(w.model)})
        if cycle % 10 == 0 or cycle == a.cycles:
            last = {r["table"]: r for r in rows[-2:]}
            say(f"cycle {cycle}/{a.cycles} ({time.monotonic() - t_start:.0f} s): "
                + ", ".join(f"{n} merge {last[n]['merge_s']:.2f} s frags {last[n]['fragments']} "
                            f"scan {last[n]['scan_s'] * 1e3:.0f} ms lookups {last[n]['lookups_s'] * 1e3:.0f} ms"
                            for n in ("off", "on")))
    window = max(1, min(a.window, cycles // 4))
    if workloads["on"].expected() != workloads["off"].expected():
        raise SystemExit("the two copies' models differ")
    for name in ("off", "on"):
        got = {r["id"]: r for r in table.open_dataset(locs[name]).to_table().to_pylist()}
        if got != workloads[name].expected():
            raise SystemExit(f"{name}: base table differs from what the writers wrote")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)

    fresh_last = {name: fresh_process_merge_s(base, f"{name}-last", locs[name].lance_uri, a)
                  for name in ("off", "on")} if a.probe_cycles else {}
    # Final scans: both copies and a freshly, fully compacted copy of "on".
    fresh = os.path.join(base, "fresh")
    shutil.copytree(locs["on"].lance_uri, fresh)
    lance.dataset(fresh).optimize.compact_files(target_rows_per_fragment=1 << 30)
    floc = open_store(fresh)
    # Interleaved, rotating order, many repetitions: a 10 ms scan on a shared 2-core machine
    # is noisy, and a block of reps of one table after another would compare machine moments.
    final_locs = {"off": locs["off"], "on": locs["on"], "fresh": floc}
    samples: dict[str, list[float]] = {name: [] for name in final_locs}
    for loc in final_locs.values():
        scan_s(loc)  # page in
    names = list(final_locs)
    for rep in range(a.final_reps):
        for name in names[rep % 3:] + names[:rep % 3]:
            samples[name].append(scan_s(final_locs[name]))
    final = {name: median(xs) for name, xs in samples.items()}
    ds_on = table.open_dataset(locs["on"])
    on_state = {"fragments": len(ds_on.get_fragments()),
                "fragment_rows": sorted(f.metadata.physical_rows for f in ds_on.get_fragments()),
                "deleted_rows": sum(f.metadata.physical_rows for f in ds_on.get_fragments()) - ds_on.count_rows()}
    # Then memwal's own compaction with every threshold at zero ("compact whatever is not
    # optimal now") on "on": what one memwal compaction leaves, against Lance's full compaction.
    forced = compaction.CompactionOptions(max_fragments=1, max_small_fragments=0, max_deleted_row_ratio=0.0,
                                          min_deleted_rows=1, materialize_deletions_threshold=0.0)
    final_c = compaction.compact(locs["on"], spark, forced)
    samples["on_compacted"], samples["fresh_again"] = [], []
    scan_s(locs["on"])
    for rep in range(a.final_reps):
        for name, loc in ((("on_compacted", locs["on"]), ("fresh_again", floc))[::1 if rep % 2 else -1]):
            samples[name].append(scan_s(loc))
    final["on_compacted"] = median(samples["on_compacted"])
    final["fresh_again"] = median(samples["fresh_again"])
    say(f"final scans (median of {a.final_reps}, interleaved): " + ", ".join(
        f"{n} {v * 1e3:.1f} ms" for n, v in final.items()) + f"; 'on' at the end: {on_state}")

    def series(name: str, key: str) -> list[float]:
        return [r[key] for r in rows if r["table"] == name]

    for name in ("off", "on"):
        for key in ("merge_s", "scan_s", "lookups_s", "fragments", "gc_s", "generations_listed", "base_versions"):
            s = series(name, key)
            result("steady_state_window", table=name, metric=key, first=median(s[:window]),
                   last=median(s[-window:]), growth=ratio(median(s[-window:]), median(s[:window])))
    on_merge, off_merge = series("on", "merge_s"), series("off", "merge_s")
    result("steady_state", cycles=cycles, cycles_planned=a.cycles, window=window, regions=a.regions, base_rows=a.base_rows,
           rows_per_cycle=a.rows, final_rows=len(workloads["on"].model),
           merge_last_over_first_on=ratio(median(on_merge[-window:]), median(on_merge[:window])),
           merge_last_over_first_off=ratio(median(off_merge[-window:]), median(off_merge[:window])),
           **({f"merge_fresh_{when}_{name}": d[name] for when, d in (("first", fresh_first), ("last", fresh_last))
               for name in ("on", "off")} if fresh_first else {}),
           **({f"merge_fresh_last_over_first_{name}": ratio(fresh_last[name], fresh_first[name])
               for name in ("on", "off")} if fresh_first else {}),
           scan_on_over_fresh=ratio(final["on"], final["fresh"]),
           scan_off_over_fresh=ratio(final["off"], final["fresh"]),
           fragments_on=series("on", "fragments")[-1], fragments_off=series("off", "fragments")[-1],
           # The final scan stands for every cycle only if the "on" table was in the same shape
           # after each: the last window's worst fragment and deletion-file counts.
           on_fragments_max_last=max(series("on", "fragments")[-window:]),
           on_with_deletions_max_last=max(series("on", "with_deletions")[-window:]),
           compactions=sum(1 for r in rows if r["compacted"]),
           compact_s_median=median([r["compact_s"] for r in rows if r["compacted"]] or [0.0]),
           lookups_last_on=median(series("on", "lookups_s")[-window:]),
           lookups_last_off=median(series("off", "lookups_s")[-window:]),
           scan_final_on=final["on"], scan_final_off=final["off"], scan_final_fresh=final["fresh"],
           on_fragments_at_end=on_state["fragments"], on_deleted_rows_at_end=on_state["deleted_rows"],
           scan_on_compacted_over_fresh=ratio(final["on_compacted"], final["fresh_again"]),
           final_compaction=final_c.status,
           gc_base_versions_older_than=a.gc_base_versions_older_than,
           generations_listed_on=series("on", "generations_listed")[-1],
           base_versions_on=series("on", "base_versions")[-1],
           seconds=round(time.monotonic() - t_start))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
