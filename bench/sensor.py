"""Benchmark: the manifest sensor's tick against the naive tick, local disk and S3 (moto).

Setup (not timed): a real base table with MemWAL initialized (`demo.create_table`) and
`--regions` region manifests written with memwal's own manifest writer (pb.RegionManifest +
`store.put_if_absent` of `layout.manifest_key`, plus the version hint), region ids uuid4,
each with one flushed generation. The sensor's first tick adds every region as a dynamic
partition and builds its cursor (not timed: a one-off).

The regions' generations are then recorded as merged in the MemWAL index (one guarded
details replacement: the sensor only reads progress), so steady state is a table whose
regions are caught up, as in production.

Timed, steady state, `--ticks` times each, `memwal_pipeline.sensors.evaluate_tick` with a
context built like tests/test_pipeline.py (`build_sensor_context` on an ephemeral instance
that already has the partitions, and the previous tick's cursor):
  unchanged  no region moved;
  changed    `--changed` regions committed a next manifest version (one more flushed
             generation) just before the tick; the tick must request exactly those merges.
Baseline, the naive tick a user writes: list `_mem_wal/`, then `region.load_latest` (version
hint GET + existence probes + manifest GET) for every region, and compare versions with the
previous tick; measured as a plain loop (`naive_seq`) and with memwal's own 16-thread
`region.load_many` (`naive_par`, the same concurrency as the sensor's probes); `ratio` is the
faster of the two over the sensor (`ratio_par`, `ratio_seq` each). Request
counts per tick come from the store's counters (`loc.store.stats`, reset before each tick).

usage: python bench/sensor.py [--regions 1000] [--changed 10] [--ticks 5] [--stores local,s3] [--quick]
Prints `RESULT sensor store=... case=... regions=N sensor_ms=... naive_par_ms=... naive_seq_ms=...
ratio=min(naive)/sensor sensor_requests=... naive_requests=... tick_bytes=... kv_bytes=...` per store
and case. Storage per tick: `tick_bytes` is what Dagster keeps in the tick's history row
beyond its fixed fields (cursor + skip reason + run keys, max over the ticks); `kv_bytes` is what
the tick rewrites in place in the instance's key-value rows (per-region state; no growth);
`old_cursor_bytes` is the previous design's cursor (one version per region, stored per tick).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from dagster import DagsterInstance, SkipReason, build_sensor_context  # noqa: E402

from memwal_core.options import SparkOptions
from memwal_core.proto import memwal_pb2 as pb  # noqa: E402
from memwal_core.state import layout, region, table
from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402
from memwal_pipeline.config import TableConfig  # noqa: E402
from memwal_pipeline.definitions import table_definitions  # noqa: E402
from memwal_pipeline.sensors import evaluate_tick  # noqa: E402

NUM_BUCKETS = 16


def manifest(rid: str, version: int, gens: int, bucket: int) -> bytes:
    msg = pb.RegionManifest(version=version, writer_epoch=1, replay_after_wal_entry_position=gens,
                            wal_entry_position_last_seen=gens, current_generation=gens + 1, region_spec_id=1)
    msg.region_id.uuid = uuid.UUID(rid).bytes
    for g in range(1, gens + 1):
        msg.flushed_generations.add(generation=g, path=f"{g:08x}_gen_{g}", in_memory_bytes=1000, physical_rows=10)
    msg.region_field_entries.add(field_id="bucket", value=bucket.to_bytes(4, "little"))
    return msg.SerializeToString()


class Regions:
    """The regions' manifests as memwal's writer commits them (version N has N generations)."""

    def __init__(self, loc, n: int):
        self.loc = loc
        self.ids = [str(uuid.uuid4()) for _ in range(n)]
        self.version = {rid: 1 for rid in self.ids}
        self.next_changed = 0

    def commit(self, rid: str) -> None:
        v = self.version[rid]
        ok = self.loc.store.put_if_absent(layout.manifest_key(rid, v), manifest(rid, v, v, self.ids.index(rid) % NUM_BUCKETS))
        assert ok, (rid, v)
        region.write_version_hint(self.loc.store, rid, v)

    def create(self) -> None:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(self.commit, self.ids))

    def change(self, k: int) -> list[str]:
        """Commit the next version of `k` regions (a different set each time)."""
        out = []
        for _ in range(k):
            rid = self.ids[self.next_changed % len(self.ids)]
            self.next_changed += 1
            self.version[rid] += 1
            self.commit(rid)
            out.append(rid)
        return out


def mark_merged(loc, regs: "Regions") -> None:
    """Record every region's generations as merged (setup only: the sensor reads progress)."""
    read = table.read_memwal_state(loc)
    details = pb.MemWalIndexDetails()
    details.CopyFrom(read.details)
    del details.merged_generations[:]
    for rid in regs.ids:
        e = details.merged_generations.add(generation=regs.version[rid])
        e.region_id.uuid = uuid.UUID(rid).bytes
    table.guarded_replace_details(loc, read, details)


def tick_bytes(res, cursor: str | None) -> int:
    """The variable part of a tick's history row: cursor, skip reason, run keys."""
    if isinstance(res, SkipReason):
        return len(cursor or "") + len(res.skip_message or "")
    return len(res.cursor or "") + sum(len(r.run_key or "") for r in res.run_requests or [])


def naive_tick(loc, previous: dict[str, int], parallel: bool) -> tuple[dict[str, int], list[str]]:
    """What a user writes: load every region's latest manifest, compare with the last tick."""
    ids = region.list_regions(loc.store).region_ids
    if parallel:
        loaded = region.load_many(loc.store, ids).manifests
    else:
        loaded = {rid: region.load_latest(loc.store, rid) for rid in ids}
    versions = {rid: m.version for rid, m in loaded.items()}
    changed = [rid for rid, v in versions.items() if previous.get(rid) != v]
    return versions, changed


def requested(req) -> int:
    """Regions a merge run request is for (one partition, or `memwal/regions` of a range)."""
    return 1 if req.partition_key else int(req.tags.get("memwal/regions", 0))


def bench_store(name: str, loc, args) -> list[dict]:
    t = time.perf_counter()
    demo.create_table(loc, sharding="bucket", num_buckets=NUM_BUCKETS, base_rows=10)
    regs = Regions(loc, args.regions)
    regs.create()
    mark_merged(loc, regs)
    common.say(f"[{name}] setup: base table + {args.regions} region manifests in {time.perf_counter() - t:.1f}s")
    cfg = TableConfig(name="t", uri=loc.lance_uri, storage_options=dict(loc.storage_options), spark=SparkOptions(master="local[2]"))
    td = table_definitions(cfg)
    out = []
    with DagsterInstance.ephemeral() as instance:
        kv_written = [0]
        real_set = instance.run_storage.set_cursor_values

        def counting_set(pairs):
            kv_written[0] += sum(len(k) + len(v) for k, v in pairs.items())
            return real_set(pairs)

        instance.run_storage.set_cursor_values = counting_set
        sizes: dict[str, list[int]] = {"tick": [], "kv": []}

        def sensor_tick(cursor):
            ctx = build_sensor_context(instance=instance, cursor=cursor, resources=td.resources)
            loc.store.stats.clear()
            kv_written[0] = 0
            t0 = time.perf_counter()
            res = evaluate_tick(ctx, cfg, td.partitions, td.merge_job.name, td.maintenance_job.name, loc)
            secs = time.perf_counter() - t0
            stats = dict(loc.store.stats)
            sizes["tick"].append(tick_bytes(res, cursor))
            sizes["kv"].append(kv_written[0])
            if isinstance(res, SkipReason):
                return secs, stats, cursor, []
            for req in res.dynamic_partitions_requests or []:
                instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
            return secs, stats, res.cursor, list(res.run_requests or [])

        secs, stats, cursor, reqs = sensor_tick(None)
        assert len(instance.get_dynamic_partitions(td.partitions.name)) == args.regions
        common.say(f"[{name}] first tick (adds {args.regions} partitions, {len(reqs)} merge requests): "
                   f"{secs:.2f}s, requests {stats}")
        # Not steady state (every region is new: hint + probes + manifest + status per region),
        # but what a new deployment or a sensor with a lost cursor pays once.
        common.result("sensor", store=name, case="first_tick", regions=args.regions, sensor_ms=secs * 1e3,
                      merge_requests=len(reqs), regions_to_merge=sum(requested(r) for r in reqs),
                      sensor_requests=sum(stats.values()),
                      sensor_req="/".join(f"{k}:{v}" for k, v in sorted(stats.items())))
        # Steady state: the instance has the partitions, the cursor every version.
        naive_versions = dict(regs.version)
        for case, k in (("unchanged", 0), ("changed", args.changed)):
            sizes["tick"].clear()
            sizes["kv"].clear()
            s_times, n_par, n_seq = [], [], []
            s_req: dict = {}
            n_req: dict = {}
            for _ in range(args.ticks):
                moved = regs.change(k)
                secs, s_req, cursor, reqs = sensor_tick(cursor)
                # One merge run per tick: for the changed regions' partition range.
                got = sum(requested(r) for r in reqs)
                if got != len(moved) or len(reqs) != (1 if moved else 0):
                    raise SystemExit(f"FAIL [{name}] {case}: sensor requested {len(reqs)} runs for {got} regions, "
                                     f"expected one run for {len(moved)}")
                s_times.append(secs)
                prev = dict(naive_versions)  # both naive ticks see the same change as the sensor
                for parallel, times in ((True, n_par), (False, n_seq)):
                    if not parallel and len(n_seq) >= args.seq_ticks:
                        continue
                    loc.store.stats.clear()
                    t0 = time.perf_counter()
                    versions, changed = naive_tick(loc, prev, parallel)
                    times.append(time.perf_counter() - t0)
                    n_req = dict(loc.store.stats)
                    if sorted(changed) != sorted(moved):
                        raise SystemExit(f"FAIL [{name}] naive {case}: saw {sorted(changed)}")
                    naive_versions = versions
            row = {"store": name, "case": case, "regions": args.regions, "changed": k,
                   "sensor_ms": common.median(s_times) * 1e3, "naive_par_ms": common.median(n_par) * 1e3,
                   "naive_seq_ms": common.median(n_seq) * 1e3,
                   # headline: the faster of the two naive ticks (the loop wins on local disk,
                   # where 16 Python threads only add GIL contention; the threads win on S3)
                   "ratio": common.ratio(min(common.median(n_par), common.median(n_seq)), common.median(s_times)),
                   "ratio_par": common.ratio(common.median(n_par), common.median(s_times)),
                   "ratio_seq": common.ratio(common.median(n_seq), common.median(s_times)),
                   "sensor_requests": sum(s_req.values()), "naive_requests": sum(n_req.values()),
                   "sensor_req": "/".join(f"{k}:{v}" for k, v in sorted(s_req.items())),
                   "naive_req": "/".join(f"{k}:{v}" for k, v in sorted(n_req.items())),
                   "tick_bytes": max(sizes["tick"]), "kv_bytes": max(sizes["kv"]),
                   "old_cursor_bytes": len(json.dumps({"versions": regs.version, "maintained_after": 0},
                                                      sort_keys=True))}
            common.say(f"[{name}] {case}: sensor {[round(x * 1e3) for x in s_times]} ms, naive (16 threads) "
                       f"{[round(x * 1e3) for x in n_par]} ms, naive (loop) {[round(x * 1e3) for x in n_seq]} ms")
            common.result("sensor", **row)
            out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions", type=int, default=1000)
    p.add_argument("--changed", type=int, default=10)
    p.add_argument("--ticks", type=int, default=5, help="timed ticks per case (median reported)")
    p.add_argument("--seq-ticks", type=int, default=3, help="of which the sequential naive loop runs this many")
    p.add_argument("--stores", default="local,s3")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if args.quick:
        args.regions, args.ticks, args.seq_ticks = min(args.regions, 100), min(args.ticks, 2), min(args.seq_ticks, 1)
    common.print_machine("sensor", args)
    stores = [s.strip() for s in args.stores.split(",")]
    root = common.workdir("sensor", args.workdir)
    try:
        if "local" in stores:
            bench_store("local", open_store(os.path.join(root, "table")), args)
        if "s3" in stores:
            with common.MotoServer() as moto:
                bucket = moto.bucket("bench-sensor")
                bench_store("s3", open_store(f"s3://{bucket}/table", moto.options()), args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
