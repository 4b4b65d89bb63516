"""An operator's own dg project driving memwal installed from its wheel (tests/test_install.py).

Run with the Python of a virtualenv that installed memwal from its wheel, in the project's root,
with DAGSTER_HOME an instance that has no `concurrency:` settings.

- `tick RESULT`: loads the project's definitions (its defs folder, as `dg` does), which warns
  when the instance leaves the table's pool unlimited, and evaluates the table sensor's first
  tick: it gives the pool the limit memwal ships, adds the region partitions and requests a
  merge. Writes JSON to RESULT: the warnings, the pool's limit before and after, the merge
  request's tags.
- `run JOB TAGS_JSON`: one run of JOB in this process (a run worker of its own, as Dagster's
  default run launcher starts one per run); exit 0 when it succeeded.

argv[1]: table name; then the mode and its arguments.
"""

import json
import logging
import sys
from pathlib import Path

from dagster import ComponentTree, DagsterInstance, build_sensor_context, partition_loading_context


def _defs():
    sys.path.insert(0, str(Path.cwd()))
    return ComponentTree.for_project(path_within_project=Path.cwd()).build_defs()


def tick(name: str, result: str) -> int:
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("memwal.pools").addHandler(Keep(logging.WARNING))
    defs = _defs()
    from memwal_pipeline import pools

    pool = f"memwal_{name}"
    with DagsterInstance.get() as instance:
        before = pools.pool_limits(instance, [pool])[0].limit
        ctx = build_sensor_context(instance=instance, definitions=defs,
                                   resources={f"{name}_table": defs.resources[f"{name}_table"]})
        with partition_loading_context(dynamic_partitions_store=instance):
            data = defs.get_sensor_def(f"{name}_manifest_sensor").evaluate_tick(ctx)
        for req in data.dynamic_partitions_requests or []:  # as the sensor daemon applies them
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        (merge,) = [r for r in data.run_requests or [] if r.job_name == f"{name}_merge"]
        after = pools.pool_limits(instance, [pool])[0].limit
    Path(result).write_text(json.dumps({"warnings": warnings, "limit_before": before, "limit_after": after,
                                        "merge_tags": dict(merge.tags)}))
    return 0


def run(job: str, tags: str) -> int:
    defs = _defs()
    with DagsterInstance.get() as instance:
        ok = defs.resolve_job_def(job).execute_in_process(instance=instance, tags=json.loads(tags)).success
    return 0 if ok else 1


if __name__ == "__main__":
    name, mode, *rest = sys.argv[1:]
    sys.exit(tick(name, *rest) if mode == "tick" else run(*rest))
