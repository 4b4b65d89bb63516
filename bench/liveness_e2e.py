"""End-to-end liveness proof: a real `dagster-daemon`, writers that never stop, and chaos.

On a fresh bucket-sharded table, with the daemon running the manifest sensor every
`--sensor-interval` s (runs are Spark Connect clients of one local server, as shipped) and a
writer process flushing one generation per region every `--flush-every` s (bench/e2e.py's
writer), this script:
  1. **cancels** a merge run while it is queued (as the UI's "Terminate" does for a queued run);
  2. **SIGKILLs** the process of a merge run while it runs (its worker dies; the default run
     launcher cannot notice, so run monitoring fails it after the run's `dagster/max_runtime`,
     `--max-runtime` s, which the sensor puts on every merge run);
  3. **stops the daemon** for `--downtime` s while the writer goes on, and runs GC (a cron's
     `memwal maintain --only gc` stand-in: `gc.run_gc`, keeping 2 manifest versions, no minimum
     age) so that the manifest versions the sensor remembered are collected; checks they were;
  4. restarts the daemon and lets the writer finish.
Then the backlog (flushed, not merged generations) must drain to 0 within `--drain` s, the LSM
read must equal the writer's model, and merge runs must not pile up: the most merge runs queued
or running at once (sampled every 0.5 s) is reported and must stay <= 2.

usage: python bench/liveness_e2e.py [--duration 150] [--downtime 40] [--regions 3]
Prints `RESULT liveness_e2e killed=... cancelled=... cursor_versions_collected=... drained_s=...
max_in_flight_merge_runs=... runs=... runs_failed=... runs_canceled=...`; exits 1 on a failed check.
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
import e2e  # noqa: E402

from memwal_core.jobs import gc
from memwal_core.observe import reader
from memwal_core.spark import connect as spark_connect
from memwal_core.state import layout, region, table
from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402

DAGSTER_YAML = e2e.DAGSTER_YAML.replace("poll_interval_seconds: 30", "poll_interval_seconds: 10").replace(
    "free_slots_after_run_end_seconds: 30", "free_slots_after_run_end_seconds: 10")


def start_daemon(root: str, env: dict, n: int) -> subprocess.Popen:
    log = open(os.path.join(root, f"daemon{n}.log"), "w")
    return subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "dagster-daemon"), "run",
                             "-w", os.path.join(common.REPO, "workspace.yaml")],
                            cwd=common.REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_group(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def pids_of_run(run_id: str) -> list[int]:
    """Processes whose command line names the run (the run worker the code server started)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if run_id.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


def merge_runs(instance, statuses):
    from dagster import RunsFilter

    return [r for r in instance.get_runs(filters=RunsFilter(statuses=statuses)) if r.job_name.endswith("_merge")]


def sensor_state(instance, table_name: str):
    from memwal_pipeline import liveness

    for st in instance.all_instigator_state():
        if st.name == f"{table_name}_manifest_sensor" and st.instigator_data and st.instigator_data.cursor:
            return liveness.SensorState.load(instance, table_name, json.loads(st.instigator_data.cursor)["epoch"])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=150.0, help="seconds the writer writes")
    p.add_argument("--downtime", type=float, default=40.0, help="seconds the daemon is stopped")
    p.add_argument("--drain", type=float, default=300.0, help="bound on draining after the writer stops")
    p.add_argument("--regions", type=int, default=3)
    p.add_argument("--rows", type=int, default=300)
    p.add_argument("--flush-every", type=float, default=5.0)
    p.add_argument("--sensor-interval", type=int, default=5)
    p.add_argument("--max-runtime", type=int, default=120)
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    common.print_machine("liveness_e2e", args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below

    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    root = common.workdir("liveness", args.workdir)
    port = common.free_port()
    remote = f"sc://127.0.0.1:{port}"
    state_dir = os.path.join(root, "state")
    daemon = writer = None
    failures: list[str] = []
    try:
        path = os.path.join(root, "table")
        loc = open_store(path)
        demo.create_table(loc, sharding="bucket", num_buckets=args.regions, base_rows=1000, btree_index=True)
        home = os.path.join(root, "home")
        os.makedirs(home)
        with open(os.path.join(home, "dagster.yaml"), "w") as f:
            f.write(DAGSTER_YAML.format(base=os.path.join(home, "storage")))
        config = os.path.join(root, "memwal.yaml")
        gc_cfg = {"manifest_retention": 2, "manifest_min_age_seconds": 0, "orphan_grace_seconds": 0}
        with open(config, "w") as f:
            json.dump({"tables": [{"name": "live", "uri": path, "spark": {"master": "local[2]", "connect": remote},
                                   "gc": gc_cfg,
                                   "sensor": {"interval_seconds": args.sensor_interval,
                                              "merge_max_runtime_seconds": args.max_runtime}}]}, f)
        env = {**os.environ, "DAGSTER_HOME": home, "MEMWAL_CONFIG": config, "MEMWAL_STATE_DIR": state_dir}
        os.environ["DAGSTER_HOME"] = home
        with DagsterInstance.get():
            pass  # create the SQLite storage first: concurrent first opens race on the schema stamp
        daemon = start_daemon(root, env, 1)
        wlog = os.path.join(root, "flushes.jsonl")
        writer = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "e2e.py"), "--writer",
                                   "--table", path, "--writer-log", wlog, "--duration", str(args.duration),
                                   "--rows", str(args.rows), "--flush-every", str(args.flush_every)],
                                  cwd=common.REPO, env=env)
        t0 = time.time()
        killed = cancelled = None
        collected = 0
        max_in_flight = 0
        downtime_done = False
        drained_at = None
        last_say = 0.0
        with DagsterInstance.get() as instance:
            while True:
                now = time.time() - t0
                queued = merge_runs(instance, [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED])
                started = merge_runs(instance, [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED])
                max_in_flight = max(max_in_flight, len(queued) + len(started))
                if cancelled is None and queued:
                    run = queued[0]
                    instance.report_run_canceling(run)
                    instance.report_run_canceled(run, message="cancelled by bench/liveness_e2e.py")
                    cancelled = run.run_id
                    common.say(f"t={now:.0f}s cancelled queued merge run {run.run_id[:8]}")
                if killed is None and (cancelled is not None or now > 40) and started:
                    run = started[0]
                    pids = pids_of_run(run.run_id)
                    if pids:
                        for pid in pids:
                            os.kill(pid, signal.SIGKILL)
                        killed = run.run_id
                        common.say(f"t={now:.0f}s SIGKILLed merge run {run.run_id[:8]} (pids {pids})")
                if not downtime_done and killed and now > max(45.0, args.duration / 3):
                    stop_group(daemon)
                    common.say(f"t={now:.0f}s daemon stopped for {args.downtime:.0f}s; writer goes on")
                    before = sensor_state(instance, "live")
                    time.sleep(args.downtime)
                    r = gc.run_gc(loc, gc.GcOptions(manifest_retention=2, manifest_min_age_seconds=0, orphan_grace_seconds=0))
                    for rid, st in (before.regions.items() if before else []):
                        if not loc.store.exists(layout.manifest_key(rid, st.version + 1)) and \
                                region.load_latest(loc.store, rid).version > st.version + 1:
                            collected += 1
                    common.say(f"t={time.time() - t0:.0f}s GC while down: {r.deleted_objects} objects deleted; "
                               f"{collected} region(s) lost the version after the sensor's; daemon restarted")
                    daemon = start_daemon(root, env, 2)
                    downtime_done = True
                    continue
                merged = table.read_memwal_state(loc).merged
                flushes = e2e.read_flushes(wlog)
                pending = sum(1 for (rid, g) in flushes if merged.get(rid, 0) < g)
                if now - last_say >= 15:
                    common.say(f"t={now:5.0f}s flushed {len(flushes)} backlog {pending} in flight: "
                               f"{len(queued)} queued {len(started)} started")
                    last_say = now
                writer_done = writer.poll() is not None
                if writer_done and writer.returncode != 0:
                    raise SystemExit(f"FAIL writer exited {writer.returncode}")
                if writer_done and pending == 0 and downtime_done:
                    drained_at = now - args.duration
                    break
                if writer_done and now > args.duration + args.drain:
                    break
                time.sleep(0.5)
            # Let the runs in flight end (the last merge reports, maintenance follows) before
            # the daemon is stopped, so the run statuses below are final.
            deadline = time.time() + 180
            while time.time() < deadline and (merge_runs(instance, [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED])
                                              or instance.get_runs(filters=RunsFilter(statuses=[
                                                  DagsterRunStatus.QUEUED, DagsterRunStatus.STARTING,
                                                  DagsterRunStatus.STARTED]))):
                time.sleep(1)
            runs = instance.get_runs()
            statuses = [r.status for r in runs]
            for rec in sorted(instance.get_run_records(), key=lambda r: r.create_timestamp):
                run = rec.dagster_run
                why = [e.message for e in instance.all_logs(run.run_id)
                       if e.dagster_event and e.dagster_event.event_type_value in ("PIPELINE_FAILURE", "PIPELINE_CANCELED")]
                common.say(f"run {run.run_id[:8]} {run.job_name} attempt={run.tags.get('memwal/attempt', '-')} "
                           f"{run.status.value} created t={rec.create_timestamp.timestamp() - t0:.0f}s"
                           + (f": {why[0][:120]}" if why else ""))
        with open(wlog + ".model") as f:
            model = {int(k): v for k, v in json.load(f).items()}
        got = {r["id"]: r for r in reader.lsm_table(loc).to_pylist()}
        if killed is None:
            failures.append("no merge run was killed (none seen running)")
        if cancelled is None:
            failures.append("no merge run was cancelled (none seen queued)")
        if drained_at is None:
            failures.append(f"backlog did not drain within {args.drain:.0f}s")
        if got != model:
            failures.append(f"LSM read differs from the writer's model ({len(got)} rows vs {len(model)})")
        if max_in_flight > 2:
            failures.append(f"{max_in_flight} merge runs queued or running at once")
        common.result("liveness_e2e", duration_s=args.duration, downtime_s=args.downtime, regions=args.regions,
                      flushes=len(e2e.read_flushes(wlog)), killed=int(killed is not None),
                      cancelled=int(cancelled is not None), cursor_versions_collected=collected,
                      drained_s=round(drained_at, 1) if drained_at is not None else "NO",
                      max_in_flight_merge_runs=max_in_flight, runs=len(runs),
                      merge_runs=sum(r.job_name.endswith("_merge") for r in runs),
                      runs_ok=statuses.count(DagsterRunStatus.SUCCESS),
                      runs_failed=statuses.count(DagsterRunStatus.FAILURE),
                      runs_canceled=statuses.count(DagsterRunStatus.CANCELED), lsm_rows=len(got))
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
        stop_group(daemon)
        spark_connect.stop_server(remote, state_dir=state_dir)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            common.say(f"kept {root}")
    for f in failures:
        common.say(f"FAIL {f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
