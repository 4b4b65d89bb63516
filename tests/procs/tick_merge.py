"""One manifest-sensor tick in a process of its own, as the sensor runs in a code server: the
table's Spark is a Connect server (`sys.argv[2]`), so a small merge may run in the tick. A
separate process because pyspark refuses a Connect session in a process that already has a
classic one (the test session's). The Dagster instance lives in `sys.argv[3]` (one per test,
kept across ticks with the cursor); prints the tick's run requests, the base_table events it
recorded and the tick's log lines as JSON. With `MEMWAL_TEST_TICK_SERVE=1` it lives on as the
code server does, keeping its Connect session between ticks: one tick per line read from stdin
(an optional JSON object: `lease_wait`), one JSON line out per tick, until stdin closes; so a
test also times a tick exactly (it ticks when told, its imports long done)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dagster import DagsterInstance  # noqa: E402
from support.sensor_ticks import tick  # noqa: E402

from memwal_core import faults  # noqa: E402
from memwal_core.options import LeaseOptions, SensorOptions, SparkOptions  # noqa: E402
from memwal_pipeline.config import TableConfig  # noqa: E402
from memwal_pipeline.definitions import build_definitions, table_definitions  # noqa: E402

uri, remote, home, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
default_wait = float(sys.argv[5]) if len(sys.argv) > 5 else LeaseOptions().wait_seconds
cursor_file = os.path.join(home, "cursor")


def one_tick(lease_wait: float) -> dict:
    cfg = TableConfig(name="t", uri=uri, spark=SparkOptions(master="local[1]", connect=remote),
                      sensor=SensorOptions(interval_seconds=5, tick_merge_max_generations=limit),
                      lease=LeaseOptions(wait_seconds=lease_wait))
    td = table_definitions(cfg)
    defs = build_definitions([cfg])
    cursor = open(cursor_file).read() if os.path.exists(cursor_file) else None
    with DagsterInstance.local_temp(tempdir=home) as instance:
        data, cursor = tick(defs, td, instance, cursor)
        with open(cursor_file, "w") as f:
            f.write(cursor or "")
        base = [e for e in (getattr(data, "asset_events", None) or []) if e.asset_key.path[-1] == "base_table"]
        recorded = instance.fetch_materializations(td.assets[1].key, limit=100).records
        return {
            "requests": [{"job": r.job_name, "tags": dict(r.tags)} for r in data.run_requests or []],
            "merged_in_tick": sorted(e.partition for e in base),
            "merged_by": sorted({e.metadata["merged_by"].value for e in base}),
            "recorded": sorted({r.partition_key for r in recorded}),
            "ops": faults.ops(),  # the writes counted (`MEMWAL_COUNT_OPS=1`)
        }


if os.environ.get("MEMWAL_TEST_TICK_SERVE"):
    for line in sys.stdin:
        asked = json.loads(line) if line.strip() else {}
        print(json.dumps(one_tick(float(asked.get("lease_wait", default_wait)))), flush=True)
    sys.exit(0)
print(json.dumps(one_tick(default_wait)))
