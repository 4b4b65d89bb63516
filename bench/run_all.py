"""Run every benchmark in sequence and print their RESULT lines (what `make bench` runs).

Each script runs as its own process (so one JVM or moto server never outlives its script),
its output streams through, and at the end all `RESULT ` lines are printed again together,
with the machine line. Exit status: non-zero when any script failed (the others still run).

usage: python bench/run_all.py [--quick] [--only merge,sensor,...] [--skip merge_2000,...] [--log-dir DIR]

Names: snapshot, gc, merge, merge_2000, merge_memory, merge_job, sensor, latency, cold_start, e2e, steady_state, liveness_e2e (gc and snapshot only when
their scripts exist). `--quick` runs every script at small sizes (a smoke test; minutes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

# name -> (script, full-size arguments, --quick arguments)
BENCHES: list[tuple[str, str, list[str], list[str]]] = [
    ("snapshot", "snapshot.py", [], ["1000"]),
    ("gc", "gc.py", [], ["--regions", "5"]),
    ("merge", "merge.py", [], ["--quick"]),
    ("merge_2000", "merge.py", ["--generations-per-region", "200"],
     ["--quick", "--generations-per-region", "20", "--contenders", "memwal,memwal_2nd,naive,bound"]),
    ("merge_memory", "merge.py", ["--memory"], ["--memory", "--quick"]),
    ("merge_job", "merge_job.py", [], ["--quick", "--rounds", "2"]),
    ("sensor", "sensor.py", [], ["--quick"]),
    ("latency", "latency.py", [], ["--quick"]),
    ("cold_start", "cold_start.py", [], ["--quick"]),
    ("e2e", "e2e.py", [], ["--quick"]),
    ("steady_state", "steady_state.py", ["--cycles", "250"], ["--quick"]),
    ("liveness_e2e", "liveness_e2e.py", [], ["--duration", "90", "--downtime", "30"]),
]


def run(name: str, argv: list[str], log_dir: str | None) -> tuple[int, list[str], float]:
    results: list[str] = []
    log = open(os.path.join(log_dir, f"{name}.log"), "w") if log_dir else None
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if log else None,
                            text=True, bufsize=1, cwd=common.REPO)
    assert proc.stdout is not None
    for line in proc.stdout:
        if log:
            log.write(line)
            log.flush()
        if line.startswith("RESULT ") or not log or line.startswith(("MACHINE", "NOTE", "GOAL", "FAIL", "check")):
            sys.stdout.write(line)
            sys.stdout.flush()
        if line.startswith("RESULT "):
            results.append(line.rstrip("\n"))
    rc = proc.wait()
    if log:
        log.close()
    return rc, results, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes everywhere (smoke test)")
    p.add_argument("--only", default="", help="comma-separated names to run")
    p.add_argument("--skip", default="", help="comma-separated names to skip")
    p.add_argument("--log-dir", default=None,
                   help="write each script's full output (stdout + stderr) to DIR/<name>.log and only "
                        "show its summary lines here")
    args = p.parse_args()
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    common.print_machine("run_all", args)
    summary: list[str] = []
    failed: list[str] = []
    for name, script, full, quick in BENCHES:
        path = os.path.join(HERE, script)
        if (only and name not in only) or name in skip:
            continue
        if not os.path.exists(path):
            print(f"== {name}: {script} not present, skipped", flush=True)
            continue
        argv = [sys.executable, path, *(quick if args.quick else full)]
        print(f"\n== {name}: {' '.join(os.path.relpath(a, common.REPO) if a == path else a for a in argv[1:])}",
              flush=True)
        rc, results, secs = run(name, argv, args.log_dir)
        print(f"== {name}: exit {rc} after {secs:.0f}s", flush=True)
        summary.extend(results)
        if rc != 0:
            failed.append(f"{name} (exit {rc})")
    print("\n==== RESULT lines ====", flush=True)
    m = common.machine()
    print("MACHINE " + " ".join(f"{k}={v}" for k, v in m.items()))
    for line in summary:
        print(line)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
