"""Benchmark: flush-to-merged latency of a one-generation backlog through the Dagster layer.

Each trial flushes one generation (`--rows` rows, one region, a pylance ShardWriter closed,
which flushes) and then runs the merge of that region's partition; a poller thread reads
`table.read_memwal_state(loc).merged` every `--poll` s from the moment the writer's close
returned, and the latency is flush -> first poll that sees the generation merged.

Modes (what triggers the merge):
  (i)   local     a new process, like a Dagster run process: `python -c` materializes
                  `T/base_table` for the region's partition with the table's own resources
                  (`table_definitions(cfg).resources`), `spark.master = local[2]`: the run
                  starts its own JVM;
  (ii)  connect   the same run process, the table configured with `spark.master =
                  sc://127.0.0.1:<free port>`: a thin client of one long-lived local Spark
                  Connect server, started once beforehand (`spark_connect.ensure_server`,
                  one unmeasured warm-up run) and stopped at the end (`stop_server`);
  (iii) inprocess materialize in this process with a warm session (what the CLI does
                  across its steps, or one long-lived process).
Not included in any mode: the sensor interval (30 s by default: up to that much before a run
is requested) and Dagster's run launcher queueing. A real run process also loads the code
location, which `python -c` importing `memwal_pipeline.definitions` stands in for.

usage: python bench/latency.py [--trials 5] [--rows 1000] [--modes local,connect,inprocess] [--quick]
Prints `RESULT latency mode=... median_s=... runs_s=...` per mode and
`RESULT latency_ratio local_over_connect=... local_over_inprocess=...`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from memwal_core.spark import connect as spark_connect
from memwal_core.state import region, table
from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402

RUN_PROCESS = r"""
import sys, time
t0 = time.perf_counter()
from dagster import DagsterInstance, materialize
from memwal_pipeline.config import TableConfig
from memwal_core.options import SparkOptions
from memwal_pipeline.definitions import table_definitions
t1 = time.perf_counter()
from memwal_core.jobs import merge as _mg
from memwal_core.spark import tasks as _sp
phases = {}
def _wrap(obj, name, key):
    fn = getattr(obj, name)
    def inner(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            phases[key] = phases.get(key, 0.0) + time.perf_counter() - t
    setattr(obj, name, inner)
_wrap(_sp, "read_and_dedup", "read_and_dedup")
_wrap(sys.modules["lance.dataset"].MergeInsertBuilder, "execute", "merge_insert")
_wrap(sys.modules["memwal_pipeline.resources"], "get_spark", "spark_session")
uri, rid, master = sys.argv[1:4]
cfg = TableConfig(name="t", uri=uri, spark=SparkOptions(master=master))
td = table_definitions(cfg)
quiet = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
with DagsterInstance.ephemeral() as instance:
    instance.add_dynamic_partitions(td.partitions.name, [rid])
    base = next(a for a in td.assets if a.key.path[-1] == "base_table")
    r = materialize([base], partition_key=rid, instance=instance, resources=td.resources, run_config=quiet,
                    raise_on_error=False)
t2 = time.perf_counter()
md = r.asset_materializations_for_node(base.op.name)[0].metadata if r.success else {}
merge_s = md["duration_s"].value if "duration_s" in md else -1
print(f"TIMING import={t1 - t0:.3f} materialize={t2 - t1:.3f} merge={merge_s:.3f} "
      + " ".join(f"{k}={v:.3f}" for k, v in phases.items()))
sys.exit(0 if r.success else 1)
"""

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


class Table:
    """An unsharded MemWAL table with one region, written by a pylance ShardWriter."""

    def __init__(self, path: str, rows: int, base_rows: int):
        self.loc = open_store(path)
        self.rows = rows
        demo.create_table(self.loc, sharding="unsharded", base_rows=base_rows)
        self.rid = str(uuid.uuid4())
        self.next_key = base_rows
        self.version = 0

    def flush_generation(self) -> int:
        """Write and flush one generation; returns its number (the writer's close flushes)."""
        self.version += 1
        keys = np.arange(self.next_key - self.rows // 5, self.next_key - self.rows // 5 + self.rows, dtype=np.int64)
        self.next_key += self.rows - self.rows // 5
        t = pa.table([pa.array(keys), pa.array(np.full(len(keys), self.version, np.int64)),
                      pa.array(keys * 0.5), pa.array([f"k{k}v{self.version}" for k in keys.tolist()])],
                     schema=demo.SCHEMA)
        ds = table.open_dataset(self.loc)
        with ds.mem_wal_writer(self.rid, max_memtable_rows=max(self.rows, 1000), durable_write=False) as w:
            w.put(t)
        return max(g.generation for g in region.load_latest(self.loc.store, self.rid).generations)

    def merged(self) -> int:
        return table.read_memwal_state(self.loc).merged.get(self.rid, 0)


class Poller(threading.Thread):
    def __init__(self, tbl: Table, gen: int, t0: float, interval: float, timeout: float):
        super().__init__(daemon=True)
        self.tbl, self.gen, self.t0, self.interval, self.timeout = tbl, gen, t0, interval, timeout
        self.seconds: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and time.perf_counter() - self.t0 < self.timeout:
            if self.tbl.merged() >= self.gen:
                self.seconds = time.perf_counter() - self.t0
                return
            self.stop.wait(self.interval)


def trial(tbl: Table, trigger, args) -> tuple[float, float]:
    """(flush -> merged seen, flush -> run finished) seconds for one generation."""
    gen = tbl.flush_generation()
    t0 = time.perf_counter()
    poller = Poller(tbl, gen, t0, args.poll, args.timeout)
    poller.start()
    trigger()
    done = time.perf_counter() - t0
    poller.join(args.timeout)
    poller.stop.set()
    if poller.seconds is None:
        if tbl.merged() < gen:
            raise SystemExit(f"FAIL generation {gen} not merged after the run")
        poller.seconds = time.perf_counter() - t0
    return poller.seconds, done


def run_process(tbl: Table, master: str, timings: list[dict]) -> None:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", RUN_PROCESS, tbl.loc.lance_uri, tbl.rid, master],
                         capture_output=True, text=True, cwd=common.REPO)
    if out.returncode != 0:
        raise SystemExit(f"FAIL run process ({master}) exited {out.returncode}: {out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("TIMING "))
    t = {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
    t["process"] = time.perf_counter() - t0
    # What the run spends outside the merge itself: interpreter + imports, Spark session
    # (JVM start or Connect client), Dagster run bookkeeping.
    t["outside_merge"] = t["process"] - t["merge"]
    timings.append(t)


def bench_mode(name: str, label: str, tbl: Table, trigger, args, warm_up: bool = False,
               timings: list[dict] | None = None) -> list[float]:
    if warm_up:
        w, _ = trial(tbl, trigger, args)
        common.say(f"{label}: warm-up run {w:.2f}s (not counted)")
    if timings is not None:
        timings.clear()
    lat, ends = [], []
    for i in range(args.trials):
        s, e = trial(tbl, trigger, args)
        lat.append(s)
        ends.append(e)
        extra = ""
        if timings:
            extra = " [" + ", ".join(f"{k} {v:.2f}s" for k, v in timings[-1].items()) + "]"
        common.say(f"{label}: trial {i + 1}: flush -> merged {s:.2f}s (run finished at {e:.2f}s){extra}")
    kv = {}
    if timings:
        for k in ("import", "spark_session", "merge", "read_and_dedup", "merge_insert",
                  "outside_merge"):
            kv[f"{k}_median_s"] = common.median([t.get(k, 0.0) for t in timings])
    common.result("latency", mode=name, trials=args.trials, rows=args.rows, median_s=common.median(lat),
                  min_s=min(lat), max_s=max(lat), run_end_median_s=common.median(ends), **kv,
                  runs_s=",".join(f"{x:.2f}" for x in lat))
    return lat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--rows", type=int, default=1000, help="rows in each flushed generation")
    p.add_argument("--base-rows", type=int, default=10_000)
    p.add_argument("--modes", default="local,connect,inprocess")
    p.add_argument("--poll", type=float, default=0.1, help="seconds between progress reads")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="2 trials of 200 rows")
    p.add_argument("--connect-conf", action="append", default=[], metavar="K=V",
                   help="extra --conf for the Spark Connect server (e.g. spark.sql.shuffle.partitions=2); "
                        "default none, as memwal starts it")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if args.quick:
        args.trials, args.rows, args.base_rows = min(args.trials, 2), min(args.rows, 200), min(args.base_rows, 1000)
    common.print_machine("latency", args)
    modes = [m.strip() for m in args.modes.split(",")]
    root = common.workdir("latency", args.workdir)
    remote = f"sc://127.0.0.1:{common.free_port()}"
    started = False
    medians: dict[str, float] = {}
    try:
        tbl = Table(os.path.join(root, "table"), args.rows, args.base_rows)
        if "local" in modes:
            timings: list[dict] = []
            lat = bench_mode("local", "(i) run process, local[2] (JVM per run)", tbl,
                             lambda: run_process(tbl, "local[2]", timings), args, timings=timings)
            medians["local"] = common.median(lat)
        if "connect" in modes:
            t = time.perf_counter()
            conf = dict(kv.split("=", 1) for kv in args.connect_conf)
            started = spark_connect.ensure_server(remote, master="local[2]", conf=conf,
                                                  state_dir=os.path.join(root, "state"))
            common.say(f"Spark Connect server {remote} started in {time.perf_counter() - t:.1f}s (once)")
            timings = []
            lat = bench_mode("connect", f"(ii) run process, {remote}", tbl,
                             lambda: run_process(tbl, remote, timings), args, warm_up=True, timings=timings)
            medians["connect"] = common.median(lat)
        if "inprocess" in modes:
            from dagster import DagsterInstance, materialize

            from memwal_core.options import SparkOptions
            from memwal_pipeline.config import TableConfig
            from memwal_pipeline.definitions import table_definitions

            t = time.perf_counter()
            warm = common.warm_up_merge(common.spark_session("local[2]"), root)
            common.say(f"in-process session up and warm in {time.perf_counter() - t:.1f}s (warm-up merge {warm:.1f}s)")
            td = table_definitions(TableConfig(name="t", uri=tbl.loc.lance_uri, spark=SparkOptions(master="local[2]")))
            base = next(a for a in td.assets if a.key.path[-1] == "base_table")
            with DagsterInstance.ephemeral() as instance:
                instance.add_dynamic_partitions(td.partitions.name, [tbl.rid])

                def in_process() -> None:
                    r = materialize([base], partition_key=tbl.rid, instance=instance, resources=td.resources,
                                    run_config=QUIET, raise_on_error=False)
                    if not r.success:
                        raise SystemExit("FAIL in-process materialization failed")

                lat = bench_mode("inprocess", "(iii) in process, warm session", tbl, in_process, args, warm_up=True)
            medians["inprocess"] = common.median(lat)
        kv = {f"{m}_median_s": v for m, v in medians.items()}
        if "local" in medians and "connect" in medians:
            kv["local_over_connect"] = common.ratio(medians["local"], medians["connect"])
        if "local" in medians and "inprocess" in medians:
            kv["local_over_inprocess"] = common.ratio(medians["local"], medians["inprocess"])
        common.result("latency_ratio", **kv)
    finally:
        if started:
            spark_connect.stop_server(remote, state_dir=os.path.join(root, "state"))
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
