"""Benchmark: the merge's Spark job alone, by how its rows reach the driver.

One 200-generation backlog (`bench/merge.py`'s workload) is planned once; then its Spark job
(`read_and_dedup`: read, check and deduplicate every region's generations) runs again and again,
with no commit, alternating three ways:
  files   the tasks write each region's rows to an Arrow IPC file, the driver reads it (what a
          `local` master does);
  blobs   the rows come back through Spark as Arrow IPC blobs (`memwal.merge.result_files: off`,
          what a cluster or Spark Connect master does);
  driver  the same task code run in the driver's own threads, no Spark at all: the floor.
Each way's wall time and CPU-s (this process and its JVM and Python workers) per round; the
medians and files/blobs, driver/files.

usage: python bench/merge_job.py [--rounds 5] [--quick]
Prints `RESULT merge_job files_s=... blobs_s=... driver_s=... files_over_blobs=...`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import merge as merge_bench  # noqa: E402
import pyarrow as pa  # noqa: E402

from memwal_core.jobs import merge  # noqa: E402
from memwal_core.spark import results  # noqa: E402
from memwal_core.spark import tasks as sp  # noqa: E402
from memwal_core.state.store import open_store  # noqa: E402


class _Captured(Exception):
    pass


def capture_job(path: str, spark) -> tuple[list, sp.ReadConfig, int]:
    """The first Spark job a merge of `path` would run: (generations, config, tasks)."""
    got: dict = {}
    real = sp.read_and_dedup

    def grab(_spark, generations, cfg, tasks):
        got.update(generations=generations, cfg=cfg, tasks=tasks)
        raise _Captured

    sp.read_and_dedup = grab
    try:
        merge.merge(open_store(path), spark)
    except _Captured:
        pass
    finally:
        sp.read_and_dedup = real
    return got["generations"], got["cfg"], got["tasks"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir")
    a = p.parse_args()
    shape = merge_bench.Shape(4, 5, 1000) if a.quick else merge_bench.Shape()
    common.print_machine("merge_job", a)
    root = common.workdir("merge-job", a.workdir)
    try:
        path = os.path.join(root, "t")
        bl = merge_bench.write_backlog(path, shape)
        spark = common.spark_session("local[*]")
        gens, cfg, ntasks = capture_job(path, spark)
        rows = bl.rows_put + bl.rows_deleted

        def files():
            return sp.read_and_dedup(spark, gens, cfg, ntasks)

        def blobs():
            spark.conf.set(results.RESULT_FILES_KEY, "off")
            try:
                return sp.read_and_dedup(spark, gens, cfg, ntasks)
            finally:
                spark.conf.unset(results.RESULT_FILES_KEY)

        def driver():
            groups = sp.pack_regions(gens, ntasks)

            def task(i: int) -> list:
                return list(sp.merge_regions(cfg, groups, iter([pa.record_batch({"id": pa.array([i], pa.int64())})])))

            with ThreadPoolExecutor(len(groups)) as pool:
                return sp._collect(pa.Table.from_batches([b for out in pool.map(task, range(len(groups)))
                                                          for b in out]), None, list(cfg.pk))

        ways = {"files": files, "blobs": blobs, "driver": driver}
        wall: dict[str, list[float]] = {k: [] for k in ways}
        cpu: dict[str, list[float]] = {k: [] for k in ways}
        live: dict[str, int] = {}
        for fn in ways.values():  # warm: the JVM's first jobs, the workers' imports
            fn()
        for r in range(a.rounds):
            for name, fn in ways.items():
                with common.CpuMeter() as meter:
                    t = time.perf_counter()
                    out = fn()
                    wall[name].append(time.perf_counter() - t)
                cpu[name].append(meter.seconds)
                live[name] = sum(t.num_rows for t in out.live)
            common.say(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in wall.items()))
        if len(set(live.values())) != 1:
            raise SystemExit(f"FAIL the three ways returned different live rows: {live}")
        med = {k: common.median(v) for k, v in wall.items()}
        common.result("merge_job", generations=bl.generations, rows=rows, backlog_mb=round(bl.in_memory_bytes / 1e6, 1),
                      rounds=a.rounds, **{f"{k}_s": v for k, v in med.items()},
                      **{f"{k}_cpu_s": common.median(v) for k, v in cpu.items()},
                      files_over_blobs=common.ratio(med["files"], med["blobs"]),
                      driver_over_files=common.ratio(med["driver"], med["files"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
