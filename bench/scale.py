"""Benchmark: a merge run over a 3,000-region table where 2 regions flushed, vs a one-region table.

The Dagster run must not cost in proportion to the regions it spans. Setup (not
timed): table A, bucket-sharded, whose 2 real regions are written by pylance `ShardWriter`s
(`demo.Workload`) plus `--regions - 2` idle regions (a manifest with no flushed generation,
written like bench/sensor.py writes manifests); its partitions are ordered real, idle..., real,
so the run's partition range spans every region, as the sensor requests it when the first and
the last region flushed. Table B has one region. Both are merged once (warm-up), then per round
each real region flushes one tiny generation (not timed) and one merge run of `base_table`
is timed, A and B alternately: `materialize` (in-process executor) on an on-disk SQLite
instance (`DagsterInstance.local_temp`, like a deployment's), one shared local Spark session.

Measured twice in the same process: with Dagster storing one "materialization planned" event
per run (`DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS=true`, memwal's setting) and with one
per partition of the range (Dagster's default; one round, it is slow).

usage: python bench/scale.py [--regions 3000] [--rounds 3]
Prints `RESULT scale planned_events=per_run|per_partition regions=N run_s=... one_region_run_s=...
ratio=... materializations=...`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from dagster import DagsterInstance, materialize  # noqa: E402
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG  # noqa: E402

from memwal_core.options import SparkOptions
from memwal_core.proto import memwal_pb2 as pb  # noqa: E402
from memwal_core.state import layout, region
from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402
from memwal_pipeline.config import TableConfig  # noqa: E402
from memwal_pipeline.definitions import PLANNED_EVENTS_ENV as PLANNED  # noqa: E402
from memwal_pipeline.definitions import table_definitions  # noqa: E402


def idle_manifest(rid: str) -> bytes:
    msg = pb.RegionManifest(version=1, writer_epoch=1, current_generation=1, region_spec_id=1)
    msg.region_id.uuid = uuid.UUID(rid).bytes
    return msg.SerializeToString()


class Table:
    def __init__(self, root: str, name: str, real: int, idle: int):
        self.loc = open_store(os.path.join(root, name))
        demo.create_table(self.loc, sharding="bucket", num_buckets=real, base_rows=10)
        self.w = demo.Workload(self.loc, seed=5, key_space=400, max_memtable_rows=50)
        self.w.write_round(40 * real, puts_per_batch=10)
        self.real = sorted(self.w.regions.values())
        idle_ids = [str(uuid.uuid4()) for _ in range(idle)]

        def put(rid: str) -> None:
            assert self.loc.store.put_if_absent(layout.manifest_key(rid, 1), idle_manifest(rid))
            region.write_version_hint(self.loc.store, rid, 1)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, idle_ids))
        # Partition order: a real region first and last, so the range spans every region.
        self.order = [self.real[0], *idle_ids, *self.real[1:]]
        self.cfg = TableConfig(name=name, uri=self.loc.lance_uri, spark=SparkOptions(master="local[2]"))
        self.td = table_definitions(self.cfg)
        self.asset = next(a for a in self.td.assets if a.key.path[-1] == "base_table")
        self.keys = {rid: [k for k in range(1000, 9000) if self.w.region_value([k])[0] == v][:3]
                     for v, rid in self.w.regions.items()}
        self.round = 0

    def flush(self) -> None:
        self.round += 1
        for rid, keys in self.keys.items():
            with self.w.dataset().mem_wal_writer(rid) as writer:
                writer.put(demo.rows_table([demo.row(k, self.round) for k in keys]))

    def run(self, instance) -> tuple[float, int]:
        t = time.perf_counter()
        r = materialize([self.asset], instance=instance, resources=self.td.resources,
                        tags={ASSET_PARTITION_RANGE_START_TAG: self.order[0],
                              ASSET_PARTITION_RANGE_END_TAG: self.order[-1]})
        took = time.perf_counter() - t
        assert r.success
        return took, len(r.asset_materializations_for_node(self.asset.op.name))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--regions", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    common.print_machine("scale", args)
    root = tempfile.mkdtemp(prefix="memwal-scale-")
    spark = common.spark_session("local[2]", {"spark.sql.shuffle.partitions": "2"})
    try:
        t = time.perf_counter()
        big = Table(root, "big", real=2, idle=args.regions - 2)
        one = Table(root, "one", real=1, idle=0)
        common.say(f"setup: {args.regions} + 1 regions in {time.perf_counter() - t:.1f}s")
        os.makedirs(os.path.join(root, "dagster"))
        with DagsterInstance.local_temp(os.path.join(root, "dagster")) as instance:
            for tbl in (big, one):
                instance.add_dynamic_partitions(tbl.td.partitions.name, tbl.order)
                tbl.run(instance)  # warm-up: merges the initial generations, pays first-job costs
            # Two ways Dagster records the partitions a range run plans: one event per run
            # (memwal's setting) or one per partition (Dagster's default).
            for mode, value, rounds in (("per_run", "true", args.rounds), ("per_partition", "false", 1)):
                os.environ[PLANNED] = value
                runs: dict[str, list[float]] = {"big": [], "one": []}
                mats: dict[str, int] = {}
                for i in range(rounds):
                    for tbl, key in ((big, "big"), (one, "one")) if i % 2 == 0 else ((one, "one"), (big, "big")):
                        tbl.flush()
                        took, n = tbl.run(instance)
                        runs[key].append(took)
                        mats[key] = n
                        common.say(f"{mode} round {i + 1} {key}: {took:.2f}s, {n} materializations")
                big_s, one_s = common.median(runs["big"]), common.median(runs["one"])
                common.result("scale", planned_events=mode, regions=args.regions, changed=2, run_s=big_s,
                              one_region_run_s=one_s, ratio=common.ratio(big_s, one_s),
                              materializations=mats["big"], one_region_materializations=mats["one"],
                              rounds=rounds)
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
