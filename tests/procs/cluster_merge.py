"""A driver process on a standalone cluster (`spark://...`): a merge with `merge.merge` on a
local table, then (with `compact`) a base-table compaction of it, a probe of where the tasks ran, and a Dagster run (materialize base_table) of an
`s3://` table whose secret comes from an environment variable through `secrets:`. A separate
process because one JVM holds one SparkContext, and the test session has a local one.

argv: master, local table uri, s3 table uri ('' to skip), JSON {conf, s3_options (no secret), compact}.
The S3 secret is in MEMWAL_TEST_SECRET. Prints one JSON line.
"""

import json
import os
import sys
import time

import pyarrow as pa

from memwal_core.jobs import merge
from memwal_core.spark import session as spark
from memwal_core.state.store import open_store

master, uri, s3_uri, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])


def probe(batches):
    import lance  # noqa: F401  (the executors' Python must have it)

    import memwal_core

    for b in batches:
        yield pa.RecordBatch.from_pylist([{"info": json.dumps({
            "pid": os.getpid(), "ppid": os.getppid(), "python": sys.executable, "cwd": os.getcwd(),
            "memwal_core": memwal_core.__file__}) } for _ in range(b.num_rows)])


t0 = time.monotonic()
session = spark.get_spark(master, dict(extra["conf"]))
secs = {"session": time.monotonic() - t0}
out = {"driver_pid": os.getpid(), "python": sys.executable,
       "conf_python": session.sparkContext.getConf().get("spark.pyspark.python", "")}
r = merge.merge(open_store(uri), session)
secs["merge"] = time.monotonic() - t0 - secs["session"]
out["merge"] = {"generations_merged": r.generations_merged, "failed": r.region_errors, "commits": r.commits}
if extra.get("compact"):
    from memwal_core.jobs import compaction
    from memwal_core.options import CompactionOptions
    from memwal_core.state import table

    loc = open_store(uri)
    before = table.read_memwal_state(loc).merged
    c = compaction.compact(loc, session, CompactionOptions())
    out["compaction"] = {"status": c.status, "tasks": c.tasks, "fragments_removed": c.fragments_removed,
                         "fragments_after": c.health_after.fragments if c.health_after else None,
                         "progress_kept": table.read_memwal_state(loc).merged == before}
out["probe"] = [json.loads(x.info) for x in
                session.range(0, 4, 1, 4).mapInArrow(probe, "info string").collect()]

if s3_uri:
    from dagster import DagsterInstance, materialize

    from memwal_core.options import SparkOptions
    from memwal_core.state import region
    from memwal_pipeline.config import TableConfig
    from memwal_pipeline.definitions import table_definitions
    from memwal_pipeline.tags import PARTITION_RANGE_END, PARTITION_RANGE_START

    cfg = TableConfig(name="t", uri=s3_uri, storage_options=extra["s3_options"],
                      secrets={"aws_secret_access_key": "MEMWAL_TEST_SECRET"},
                      spark=SparkOptions(master=master, conf=extra["conf"]))
    td = table_definitions(cfg)
    loc = td.resources["t_table"].process_config_and_initialize().location()
    regions = sorted(region.list_regions(loc.store).region_ids)
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(td.partitions.name, regions)
        base = next(a for a in td.assets if a.key.path[-1] == "base_table")
        res = materialize([base], instance=instance, resources=td.resources,
                          tags={PARTITION_RANGE_START: regions[0],
                                PARTITION_RANGE_END: regions[-1]}, raise_on_error=False)
        md = {}
        for ev in res.get_asset_materialization_events():
            md = {k: getattr(v, "value", v) for k, v in ev.event_specific_data.materialization.metadata.items()}
    out["dagster"] = {"success": res.success, "generations_merged": md.get("generations_merged"),
                      "app_id": session.sparkContext.applicationId}
out["seconds"] = {**secs, "total": time.monotonic() - t0}
out["app_id"] = session.sparkContext.applicationId
session.stop()
print(json.dumps(out, default=str))
