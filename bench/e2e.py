"""Benchmark: end to end, a writer flushing continuously while the pipeline runs on its sensor.

Per mode, on a fresh table (bucket-sharded, `--regions` regions, MemWAL initialized):
  * `dagster-daemon run` on a throwaway DAGSTER_HOME (SQLite, the repo's pools and run
    monitoring) and a throwaway MEMWAL_CONFIG naming the table, with the manifest sensor every
    `--sensor-interval` s: the daemon evaluates the sensor, queues the merge runs it requests
    (one per tick, run keys `region:generation@merged#attempt`, pool limit 1) and the maintenance
    runs that follow (MemWAL index, catch-up, GC), and launches each as its own run process, with
    the repo's `dagster_home/dagster.yaml` — exactly as deployed;
  * a writer process (pylance `ShardWriter`s via `demo.Workload`) that every `--flush-every` s
    writes `--rows` operations (puts, overwrites, deletes) spread over all regions and closes
    each writer, which flushes one generation per region; it logs each flush's time;
  * this process polls the table's merge progress every 0.5 s and records, per flushed
    generation, flush -> first poll that sees it merged (the merge lag), and the backlog
    (flushed, not yet merged generations) over time.
The first `--warmup` s of writes are not measured (the first merges on a fresh Connect server
start its Python workers; a new instance runs one maintenance at once). After the measured
`--duration` s the writer stops; the pipeline gets `--drain` s to merge what is left. The
final LSM read (pylance, generations newer than merged) must equal the writer's model.
Unless `--cold-start`, the Connect server is started before the daemon and the writer waits
for the sensor's first tick (the steady state a deployment is in).

Modes: `connect` — the shipped default, `spark.connect: sc://127.0.0.1:<port>`: small merges run
in the sensor's tick on the long-lived Connect server (`spark.master local[2]`), the others in
runs that are its clients; `runs` — the baseline, the same with
`sensor.tick_merge_max_generations: 0`: every merge is a run; `local` — `spark.master local[2]`
without `connect`: every merge run starts its own JVM. Ratios: runs / connect and local /
connect, p50 and p95.

Where the seconds go: `RESULT e2e_breakdown` gives per stage (sensor tick wait and
evaluation, queue, run process start, set-up, Spark attach, merge, poll) the p50 and p95 over
the measured generations, from the instance's records (`breakdown`), and the sensor's cost
per tick.

usage: python bench/e2e.py [--duration 180] [--warmup 60] [--modes connect,runs] [--regions 4] [--quick]
Prints `RESULT e2e mode=... flushes=... p50_s=... p95_s=... max_s=... backlog_q1..q4=...
drained_s=... runs_ok=... runs_failed=...` and `RESULT e2e_breakdown mode=... <stage>_p50=...`
per mode, and `RESULT e2e_ratio runs_over_connect_p50=... runs_over_connect_p95=...`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from memwal_core.observe import reader
from memwal_core.spark import connect as spark_connect
from memwal_core.state import region, table
from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402
from memwal_pipeline import config as config_mod  # noqa: E402

def dagster_yaml(base: str) -> str:
    """The repo's `dagster_home/dagster.yaml` (queued runs, pools, tag limits, run monitoring,
    dequeue settings: the deployed shape) with SQLite storage under `base`."""
    with open(os.path.join(common.REPO, "dagster_home", "dagster.yaml")) as f:
        shipped = f.read()
    return f"storage:\n  sqlite:\n    base_dir: {base}\n" + shipped


def writer_main(args) -> None:
    """The writer process: one round of writes (one flush per region) every --flush-every s."""
    loc = open_store(args.table)
    w = demo.Workload(loc, seed=11, key_space=args.rows * 20, max_memtable_rows=args.rows * 4)
    deadline = time.time() + args.duration
    with open(args.writer_log, "a") as log:
        while time.time() < deadline:
            t0 = time.time()
            w.write_round(args.rows, overwrite=0.2, delete=0.02)
            done = time.time()
            for rid in w.regions.values():
                m = region.load_latest(loc.store, rid)
                gens = [g.generation for g in m.generations]
                if gens:
                    log.write(json.dumps({"t": done, "region": rid, "generation": max(gens)}) + "\n")
            log.flush()
            time.sleep(max(0.0, args.flush_every - (time.time() - t0)))
    with open(args.writer_log + ".model", "w") as f:
        json.dump({str(k): v for k, v in w.expected().items()}, f)


def read_flushes(path: str) -> dict[tuple[str, int], float]:
    out: dict[tuple[str, int], float] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    r = json.loads(line)
                    out.setdefault((r["region"], r["generation"]), r["t"])
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def wait_for_tick(log: str, timeout_s: float = 600.0) -> None:
    """Until the daemon has finished a tick of the table's sensor (its code location loaded)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with open(log, errors="replace") as f:
            text = f.read()
            if "Sensor e2e_manifest_sensor" in text or "for e2e_manifest_sensor" in text:
                return
        time.sleep(1)
    raise SystemExit(f"FAIL no tick of the sensor within {timeout_s:.0f} s (see {log})")


def run_mode(mode: str, args) -> dict:
    root = common.workdir(f"e2e-{mode}", args.workdir)
    port = common.free_port()
    remote = f"sc://127.0.0.1:{port}"
    state = os.path.join(root, "state")
    daemon = writer = None
    try:
        path = os.path.join(root, "table")
        loc = open_store(path)
        demo.create_table(loc, sharding="bucket", num_buckets=args.regions, base_rows=1000, btree_index=True)
        home = os.path.join(root, "home")
        os.makedirs(home)
        with open(os.path.join(home, "dagster.yaml"), "w") as f:
            f.write(dagster_yaml(os.path.join(home, "storage")))
        spark = {"master": "local[2]", **({"connect": remote} if mode in ("connect", "runs") else {})}
        sensor = {"interval_seconds": args.sensor_interval,
                  **({"tick_merge_max_generations": 0} if mode == "runs" else {})}  # runs: every merge a run
        config = os.path.join(root, "memwal.yaml")
        with open(config, "w") as f:
            json.dump({"tables": [{"name": "e2e", "uri": path, "spark": spark, "sensor": sensor}]}, f)  # JSON is YAML
        if "connect" in spark and not args.cold_start:  # steady state: the server a first run would start
            spark_connect.ensure_server(remote, master=spark["master"], state_dir=state, timeout_s=600,
                                        conf=spark_connect.server_conf(dict(config_mod.load_config(config)[0].spark.conf)))
        env = {**os.environ, "DAGSTER_HOME": home, "MEMWAL_CONFIG": config, "MEMWAL_STATE_DIR": state}
        daemon_log = open(os.path.join(root, "daemon.log"), "w")
        daemon = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "dagster-daemon"), "run",
                                   "-w", os.path.join(common.REPO, "workspace.yaml")],
                                  cwd=common.REPO, env=env, stdout=daemon_log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        if not args.cold_start:  # steady state: the daemon up and its sensor ticking
            wait_for_tick(os.path.join(root, "daemon.log"))
        wlog = os.path.join(root, "flushes.jsonl")
        writer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--writer", "--table", path,
                                   "--writer-log", wlog, "--duration", str(args.duration + args.warmup),
                                   "--rows", str(args.rows), "--flush-every", str(args.flush_every)],
                                  cwd=common.REPO, env=env)
        t_start = time.time()
        lags: dict[tuple[str, int], float] = {}
        backlog: list[tuple[float, int]] = []
        last_say = 0.0
        drained_at = None
        while True:
            now = time.time()
            merged = table.read_memwal_state(loc).merged
            flushes = read_flushes(wlog)
            for key, t in flushes.items():
                if key not in lags and merged.get(key[0], 0) >= key[1]:
                    lags[key] = now - t
            pending = len(flushes) - len(lags)
            backlog.append((now - t_start, pending))
            if now - last_say >= 15:
                done = [v for v in lags.values()]
                common.say(f"[{mode}] t={now - t_start:5.0f}s flushed {len(flushes)} merged {len(lags)} "
                           f"backlog {pending} lag p50 {percentile(done, .5):.1f}s")
                last_say = now
            writer_done = writer.poll() is not None
            if writer_done and writer.returncode != 0:
                raise SystemExit(f"FAIL writer exited {writer.returncode}")
            if writer_done and pending == 0:
                drained_at = now - t_start
                break
            if writer_done and now - t_start > args.warmup + args.duration + args.drain:
                break
            time.sleep(0.5)
        # What the users read: base table + unmerged generations equals what was written.
        with open(wlog + ".model") as f:
            model = {int(k): v for k, v in json.load(f).items()}
        got = {r["id"]: r for r in reader.lsm_table(loc).to_pylist()}
        if got != model:
            raise SystemExit(f"FAIL [{mode}] LSM read differs from the writer's model "
                             f"({len(got)} rows vs {len(model)})")
        runs = run_counts(home)
        flushes = read_flushes(wlog)
        measured_from = t_start + args.warmup
        values = [lag for key, lag in lags.items() if flushes[key] >= measured_from]
        quarter = args.duration / 4
        qs = []
        for i in range(4):
            xs = [n for t, n in backlog if args.warmup + i * quarter <= t < args.warmup + (i + 1) * quarter]
            qs.append(round(sum(xs) / len(xs), 1) if xs else float("nan"))
        row = {"mode": mode, "duration_s": args.duration, "regions": args.regions, "flush_every_s": args.flush_every,
               "sensor_interval_s": args.sensor_interval, "flushes": len(read_flushes(wlog)), "merged": len(lags),
               "measured": len(values), "warmup_s": args.warmup,
               "p50_s": round(percentile(values, .5), 1), "p95_s": round(percentile(values, .95), 1),
               "max_s": round(max(values), 1) if values else float("nan"),
               **{f"backlog_q{i + 1}": q for i, q in enumerate(qs)},
               "backlog_max": max(n for _, n in backlog),
               "drained_s": round(drained_at - args.warmup - args.duration, 1) if drained_at is not None else "NO",
               **runs}
        common.result("e2e", **row)
        common.result("e2e_breakdown", mode=mode, **breakdown(
            home, flushes, {k: v for k, v in lags.items() if flushes[k] >= measured_from}))
        common.say(f"check [{mode}]: LSM read equals the writer's model ({len(model)} rows)")
        return row
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
        if daemon is not None and daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
        if mode in ("connect", "runs"):
            spark_connect.stop_server(remote, state_dir=state)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            common.say(f"kept {root}")


STAGES = ("tick_wait", "tick_eval", "queue", "process_start", "setup", "spark_attach", "merge", "poll")


def breakdown(home: str, flushes: dict[tuple[str, int], float], lags: dict[tuple[str, int], float]) -> dict:
    """Where each flush's seconds went, from the instance's records: per merged generation the
    first `base_table` materialization of its region at or past it, and the stages from the
    flush to the poll that saw it merged, each clipped to start where the previous one ended
    (so the stages of a flush add up to its lag).
    A merge run's stages:
      tick_wait      flush -> start of the sensor tick that requested the run (the sensor
                     loop, and the wait while an earlier run covering the region was in flight);
      tick_eval      tick start -> run created (the sensor's evaluation);
      queue          run created -> launched (the coordinator's dequeue pass, runs of the table ahead);
      process_start  launched -> the run process reports its start (spawn, imports, code location);
      setup          run start -> start of the Spark attach (resources, step start);
      spark_attach   getting the session (the line `assets.SPARK_READY`);
      merge          session -> the region's materialization (plan, Spark, commits);
      poll           materialization -> this script's poll that saw the progress.
    A merge in the tick (`merged_by` in the metadata): tick_wait to the tick's start, then
    tick_eval (the tick's time less the attach and merge it reports), spark_attach, merge, and
    poll (storing the tick's events, and the poll); no queue, process or set-up.
    Also the sensor's cost per tick (start to end, every tick of the run), and how many
    generations each path merged."""
    import bisect

    from dagster import AssetKey, DagsterEventType, DagsterInstance
    from dagster._core.definitions.run_request import InstigatorType

    from memwal_pipeline.assets import SPARK_READY

    os.environ["DAGSTER_HOME"] = home
    with DagsterInstance.get() as instance:
        tick_of: dict[str, float] = {}
        ticks: list[tuple[float, float]] = []
        for st in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
            if not st.instigator_name.startswith("e2e_"):
                continue
            for tick in instance.get_ticks(st.instigator_origin_id, st.selector_id, limit=10000):
                if tick.end_timestamp:
                    ticks.append((tick.timestamp, tick.end_timestamp))
                for rid in tick.run_ids:
                    tick_of[rid] = tick.timestamp
        ticks.sort()
        run_marks: dict[str, dict[str, float]] = {}

        def marks_of(run_id: str) -> dict[str, float]:
            if run_id in run_marks:
                return run_marks[run_id]
            rec = instance.get_run_record_by_id(run_id)
            created = rec.create_timestamp.timestamp()
            marks = run_marks[run_id] = {"tick": tick_of.get(run_id, created), "created": created}
            for e in instance.all_logs(run_id):
                ev = e.dagster_event
                if ev is None:
                    if e.user_message.startswith(SPARK_READY) and "attached" not in marks:
                        took = float(e.user_message[len(SPARK_READY):].split()[0])
                        marks["attach_start"], marks["attached"] = e.timestamp - took, e.timestamp
                elif ev.event_type == DagsterEventType.RUN_STARTING:
                    marks.setdefault("launched", e.timestamp)
                elif ev.event_type == DagsterEventType.RUN_START:
                    marks.setdefault("run_start", e.timestamp)
                elif ev.event_type == DagsterEventType.STEP_START:
                    marks.setdefault("step_start", e.timestamp)
            return marks

        mats: list[tuple[float, str, int, list[float | None], str]] = []  # time, region, merged, ends, path
        for rec in instance.fetch_materializations(AssetKey(["e2e", "base_table"]), limit=10000).records:
            e = rec.event_log_entry
            m = rec.asset_materialization
            md = m.metadata
            if not m.partition or "merged_generation" not in md:
                continue
            if "merged_by" in md:
                i = bisect.bisect_right(ticks, (e.timestamp, float("inf"))) - 1
                if i < 0:
                    continue
                start, end = ticks[i]
                attach, merge = float(md["run/spark_attach_s"].value), float(md["run/duration_s"].value)
                evaluated = max(start, end - attach - merge)
                ends = [start, evaluated, None, None, None, evaluated + attach, end]
                mats.append((e.timestamp, m.partition, int(md["merged_generation"].value), ends, "tick"))
            elif e.run_id:
                k = marks_of(e.run_id)
                ends = [k["tick"], k["created"], k.get("launched"), k.get("run_start"),
                        k.get("attach_start", k.get("step_start")), k.get("attached"), e.timestamp]
                mats.append((e.timestamp, m.partition, int(md["merged_generation"].value), ends, "run"))
        mats.sort(key=lambda x: x[0])
    per: dict[str, list[float]] = {k: [] for k in STAGES}
    paths = {"tick": 0, "run": 0}
    for key, lag in lags.items():
        t_flush = flushes[key]
        hit = next((m for m in mats if m[1] == key[0] and m[2] >= key[1] and m[0] >= t_flush - 1), None)
        if hit is None:
            continue
        paths[hit[4]] += 1
        prev = t_flush
        for name, end in zip(STAGES, [*hit[3], t_flush + lag]):
            end = prev if end is None else max(prev, min(end, t_flush + lag))
            per[name].append(end - prev)
            prev = end
    out: dict = {"attributed": len(per["poll"]), "merged_by_tick": paths["tick"], "merged_by_run": paths["run"]}
    for name in STAGES:
        out[f"{name}_p50"] = round(percentile(per[name], .5), 2)
        out[f"{name}_p95"] = round(percentile(per[name], .95), 2)
    costs = [(b - a) * 1000 for a, b in ticks]
    out["sensor_tick_ms_p50"] = round(percentile(costs, .5), 1)
    out["sensor_tick_ms_p95"] = round(percentile(costs, .95), 1)
    out["sensor_ticks"] = len(costs)
    return out


def run_counts(home: str) -> dict:
    from dagster import DagsterInstance, DagsterRunStatus

    os.environ["DAGSTER_HOME"] = home
    with DagsterInstance.get() as instance:
        runs = instance.get_runs()
        merge = [r for r in runs if r.job_name.endswith("_merge")]
        return {"runs": len(runs), "merge_runs": len(merge),
                "runs_ok": sum(r.status == DagsterRunStatus.SUCCESS for r in runs),
                "runs_failed": sum(r.status == DagsterRunStatus.FAILURE for r in runs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds the writer writes")
    p.add_argument("--drain", type=float, default=180.0, help="seconds allowed afterwards to merge the rest")
    p.add_argument("--regions", type=int, default=4)
    p.add_argument("--rows", type=int, default=400, help="operations per round (one flush per region)")
    p.add_argument("--flush-every", type=float, default=10.0)
    p.add_argument("--sensor-interval", type=int, default=2)
    p.add_argument("--modes", default="connect,runs")
    p.add_argument("--warmup", type=float, default=60.0,
                   help="seconds of writes before the measured ones (the first merges on a fresh server and "
                        "instance: Python workers, the first maintenance run); not in the percentiles")
    p.add_argument("--cold-start", action="store_true",
                   help="start the writer with the daemon, and leave the Connect server to the first run")
    p.add_argument("--quick", action="store_true", help="60 s")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--writer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--table", help=argparse.SUPPRESS)
    p.add_argument("--writer-log", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.writer:
        writer_main(args)
        return
    if args.quick:
        args.duration, args.warmup = min(args.duration, 60.0), min(args.warmup, 30.0)
    common.print_machine("e2e", args)
    rows = {m: run_mode(m, args) for m in args.modes.split(",")}
    if "connect" in rows and "runs" in rows:
        common.result("e2e_ratio", runs_over_connect_p50=common.ratio(rows["runs"]["p50_s"], rows["connect"]["p50_s"]),
                      runs_over_connect_p95=common.ratio(rows["runs"]["p95_s"], rows["connect"]["p95_s"]))
    if "connect" in rows and "local" in rows:
        common.result("e2e_ratio", local_over_connect_p50=common.ratio(rows["local"]["p50_s"], rows["connect"]["p50_s"]),
                      local_over_connect_p95=common.ratio(rows["local"]["p95_s"], rows["connect"]["p95_s"]))


if __name__ == "__main__":
    main()
