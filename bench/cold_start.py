"""Benchmark: a cold `memwal maintain` of a tiny table against a bare PySpark start-and-stop.

What a cold maintenance pass costs beyond the Spark start it cannot avoid. Per trial, as fresh
processes, alternating so load drifts hit both sides alike:
  (bare)     `python -c` that imports pyspark, starts a `local[*]` SparkSession, runs one
             trivial job (`spark.range(1).count()`) and stops it: the floor of any process
             that uses Spark;
  (maintain) `memwal maintain <copy> --spark-master local[*] --json` on a fresh copy of a tiny
             table (2 regions, a few generations of ~50 rows pending): every step (merge,
             compaction, catch-up, index, GC), JVM start included.
Every maintain run must merge every pending generation (checked from its JSON report).

Goal: maintain / bare <= 1.5 (median over the trials).

usage:
  python bench/cold_start.py              # 5 trials each
  python bench/cold_start.py --quick      # 2 trials each
Prints `RESULT cold_start ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the repo on sys.path)

from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402

BARE = ("from pyspark.sql import SparkSession\n"
        "s = SparkSession.builder.master('local[*]').getOrCreate()\n"
        "s.range(1).count()\n"
        "s.stop()\n")


def tiny_table(path: str) -> int:
    """A 2-region table with a few small generations pending; how many generations."""
    loc = open_store(path)
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=100)
    w = demo.Workload(loc, seed=3, key_space=300, max_memtable_rows=50)
    for _ in range(2):
        w.write_round(100, puts_per_batch=10)
    from memwal_core.jobs import merge

    return sum(len(b.generations) for b in merge.plan_merge(loc).batches)


def bare() -> float:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", BARE], capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"FAIL bare PySpark exited {out.returncode}: {out.stderr[-2000:]}")
    return took


def maintain(path: str, pending: int) -> tuple[float, float | None]:
    """Seconds of the whole process, and its merge step's own."""
    exe = os.path.join(common.BIN, "memwal")
    t = time.perf_counter()
    out = subprocess.run([exe, "maintain", path, "--spark-master", "local[*]", "--json"],
                         capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"FAIL memwal maintain exited {out.returncode}: {out.stderr[-2000:]}")
    step = json.loads(out.stdout)["steps"]["merge"]
    merged = step["metrics"].get("generations_merged")
    if merged != pending:
        raise SystemExit(f"FAIL memwal maintain merged {merged} of {pending} generations: {step}")
    return took, step.get("duration_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=None, help="trials per side (default 5; --quick: 2)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    trials = args.trials or (2 if args.quick else 5)
    common.print_machine("cold_start", args)
    root = common.workdir("cold-start", args.workdir)
    try:
        src = os.path.join(root, "source")
        pending = tiny_table(src)
        common.say(f"tiny table: {pending} generations pending")
        bares, maints, steps = [], [], []
        for i in range(trials):
            copy = os.path.join(root, f"t{i}")
            shutil.copytree(src, copy)
            bares.append(bare())
            took, step = maintain(copy, pending)
            maints.append(took)
            steps.append(step or 0.0)
            common.say(f"trial {i + 1}: bare PySpark {bares[-1]:.2f}s, memwal maintain {took:.2f}s "
                       f"(merge step {step}s), load1 {common.load1():.2f}")
        r = common.ratio(common.median(maints), common.median(bares))
        common.result("cold_start", trials=trials, generations=pending, bare_pyspark_s=common.median(bares),
                      maintain_s=common.median(maints), merge_step_s=common.median(steps),
                      maintain_over_bare=r, bare_min_s=min(bares), maintain_min_s=min(maints))
        common.say(f"GOAL maintain/bare <= 1.5: {'met' if r <= 1.5 else 'MISSED'} ({r:.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
