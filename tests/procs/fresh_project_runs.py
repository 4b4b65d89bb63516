"""Two runs of one table in an operator's own dg project and Dagster instance (tests/test_install.py).

Run with the Python of a virtualenv that installed memwal from its wheel, in the project's root,
with DAGSTER_HOME an instance that has no `concurrency:` settings; the test holds the table's
lease meanwhile, so the merge run's step waits for it while it holds its pool slot.

1. Loads the project's definitions (its defs folder, as `dg` does): memwal warns that the
   instance leaves the table's pool unlimited.
2. One tick of the table's sensor: it gives the pool the shipped limit, adds the region
   partitions and requests a merge.
3. Starts that merge run; once its `base_table` step has started (it holds the pool's slot),
   starts the maintenance run, and waits until Dagster logs that run's step blocked by the pool.
   Prints `blocked` (the test then releases the lease), waits for both runs, and prints one
   JSON line: what it saw.

argv: table name.
"""

import json
import logging
import sys
import threading
import time
from pathlib import Path

from dagster import ComponentTree, DagsterEventType, DagsterInstance, build_sensor_context

BLOCKED = "Step blocked by limit for pool"


def _message(entry) -> str:
    return (entry.dagster_event.message or "") if entry.dagster_event else ""


def main() -> int:
    name = sys.argv[1]
    pool = f"memwal_{name}"
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("memwal.pools").addHandler(Keep(logging.WARNING))
    sys.path.insert(0, str(Path.cwd()))
    defs = ComponentTree.for_project(path_within_project=Path.cwd()).build_defs()

    from memwal_pipeline import pools

    with DagsterInstance.get() as instance:
        limit_before = pools.pool_limits(instance, [pool])[0].limit
        ctx = build_sensor_context(instance=instance, definitions=defs,
                                   resources={f"{name}_table": defs.resources[f"{name}_table"]})
        result = defs.get_sensor_def(f"{name}_manifest_sensor")(ctx)
        for req in result.dynamic_partitions_requests or []:
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        (request,) = [r for r in result.run_requests or [] if r.job_name == f"{name}_merge"]
        limit_after = pools.pool_limits(instance, [pool])[0].limit

        out: dict = {}

        def run(key: str, job: str, tags: dict) -> None:
            out[key] = defs.resolve_job_def(job).execute_in_process(instance=instance, tags=tags).success

        def events(job: str, kind: DagsterEventType | None = None):
            runs = instance.get_runs()
            for r in runs:
                if r.job_name == job:
                    for e in instance.all_logs(r.run_id, of_type=kind):
                        yield r.run_id, e

        def wait_for(what: str, found, timeout: float = 600) -> None:
            deadline = time.time() + timeout
            while not found():
                if time.time() > deadline:
                    raise SystemExit(f"timed out waiting for {what}")
                time.sleep(0.2)

        merge = threading.Thread(target=run, args=("merge", f"{name}_merge", dict(request.tags)))
        merge.start()
        wait_for("the merge step to start", lambda: any(
            e.step_key == f"{name}__base_table" for _, e in events(f"{name}_merge", DagsterEventType.STEP_START)))
        maintenance = threading.Thread(target=run, args=("maintenance", f"{name}_maintenance", {}))
        maintenance.start()
        wait_for("the maintenance step to be blocked", lambda: any(
            BLOCKED in _message(e) for _, e in events(f"{name}_maintenance", DagsterEventType.ENGINE_EVENT)))
        print("blocked", flush=True)
        merge.join(600)
        maintenance.join(600)

        def steps(job: str, kind: DagsterEventType) -> dict[str, float]:
            return {e.step_key: e.timestamp for _, e in events(job, kind) if e.step_key}

        print(json.dumps({
            "warnings": warnings, "limit_before": limit_before, "limit_after": limit_after,
            "merge_ok": out.get("merge"), "maintenance_ok": out.get("maintenance"),
            "merge_tags": dict(request.tags),
            "merge_end": steps(f"{name}_merge", DagsterEventType.STEP_SUCCESS),
            "maintenance_start": steps(f"{name}_maintenance", DagsterEventType.STEP_START),
            "blocked_steps": sorted({e.step_key for _, e in events(f"{name}_maintenance", DagsterEventType.ENGINE_EVENT)
                                     if BLOCKED in _message(e)}),
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
