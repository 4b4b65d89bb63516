"""Benchmark: plan and delete ~100,000 objects with the garbage collector, local disk and S3.

Setup (not timed), per region, written directly through the store (or plain files on local
disk, to skip LocalStore's fsync per object):
- `GENS` flushed generations of `FILES` small objects each, listed in the latest region manifest;
- one WAL entry per generation (real Arrow IPC streams with `generation` / `writer_epoch`
  metadata, epoch 1) plus a fence sentinel of epoch 2 at the tail, everything covered;
- `VERSIONS` region manifest versions (pb.RegionManifest, the latest listing the generations);
- one orphan `*_gen_*` directory of `ORPHAN_FILES` objects.
The base table is a real pylance table whose merge progress comes from **one real marked
merge** (`merge_insert` of an empty source with `mark_sstables_as_compacted` for every region,
i.e. every generation merged) followed by `cleanup_old_versions`, so only that version is
retained. No index gates GC. With the defaults each region has exactly 1,000 deletable objects
(900 generation files, 45 WAL entries, 50 manifest versions, 5 orphan files): 100 regions make
100,000.

Timed: `plan_gc` + `execute_gc` (orphan grace and manifest age 0). Counted: the store's list
requests (`store.stats["list"]`); expected 1 (regions) + per region 1 (orphan sweep) + one per
generation directory and orphan directory (their keys).

usage: python bench/gc.py [--regions N] [--stores local,s3]
Prints `RESULT gc store=... objects=N seconds=S objects_per_s=R list_requests=L` per store.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import lance
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memwal_core import demo, gc, layout, region  # noqa: E402
from memwal_core.proto import memwal_pb2 as pb  # noqa: E402
from memwal_core.store import LocalStore, make_s3_client, open_store  # noqa: E402

GENS = 45
FILES = 20
VERSIONS = 60
ORPHAN_FILES = 5
KEEP_VERSIONS = 10
PER_REGION = GENS * FILES + GENS + (VERSIONS - KEEP_VERSIONS) + ORPHAN_FILES  # 1000


def wal_entry(meta: dict[str, str]) -> bytes:
    schema = pa.schema([("id", pa.int64()), ("_tombstone", pa.bool_())], metadata=meta)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, schema) as w:
        if "generation" in meta:
            w.write_batch(pa.record_batch([pa.array([1], pa.int64()), pa.array([False])], schema=schema))
    return sink.getvalue()


def region_objects(rid: str) -> dict[str, bytes]:
    """Every object of one region (key -> bytes)."""
    objs: dict[str, bytes] = {}
    msg = pb.RegionManifest(writer_epoch=2, replay_after_wal_entry_position=GENS + 1,
                            wal_entry_position_last_seen=GENS + 1, current_generation=GENS + 1)
    msg.region_id.uuid = uuid.UUID(rid).bytes
    for g in range(1, GENS + 1):
        path = f"{g:08x}_gen_{g}"
        msg.flushed_generations.add(generation=g, path=path, in_memory_bytes=FILES, physical_rows=1)
        gdir = layout.generation_dir(rid, path, g)
        for f in range(FILES):
            objs[f"{gdir}/data/{f:04d}.lance"] = b"x"
        objs[layout.wal_key(rid, g)] = wal_entry({"generation": str(g), "writer_epoch": "1"})
    objs[layout.wal_key(rid, GENS + 1)] = wal_entry({"fence_sentinel": "true", "writer_epoch": "2"})
    for v in range(1, VERSIONS + 1):
        msg.version = v
        objs[layout.manifest_key(rid, v)] = msg.SerializeToString()
    objs[layout.version_hint_key(rid)] = b'{"version":%d}' % VERSIONS
    odir = f"{layout.region_dir(rid)}/deadbeef_gen_{GENS}"
    for f in range(ORPHAN_FILES):
        objs[f"{odir}/data/{f}.lance"] = b"o"
    return objs


def write_local(root: str, objs: dict[str, bytes]) -> None:
    for key, data in objs.items():
        path = os.path.join(root, *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def setup(loc, regions: list[str]) -> None:
    t = time.perf_counter()
    demo.create_table(loc, sharding="manual", base_rows=10)
    per_region = [region_objects(rid) for rid in regions]
    with ThreadPoolExecutor(32) as pool:
        if isinstance(loc.store, LocalStore):
            list(pool.map(lambda objs: write_local(loc.store.root, objs), per_region))
        else:
            jobs = [kv for objs in per_region for kv in objs.items()]
            list(pool.map(lambda kv: loc.store.put(*kv), jobs, chunksize=64))
    # One real marked merge: every generation of every region merged, atomically.
    from lance.mem_wal import CompactedSsTable

    ds = lance.dataset(loc.lance_uri, storage_options=loc.storage_options or None)
    empty = pa.table({f.name: pa.array([], f.type) for f in ds.schema}, schema=ds.schema)
    ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all() \
        .mark_sstables_as_compacted([CompactedSsTable(rid, GENS) for rid in regions]).execute(empty)
    gc.cleanup_base_versions(loc, gc.GcConfig(base_cleanup_older_than=timedelta(0)))
    print(f"  setup: {len(regions)} regions, {sum(map(len, per_region))} objects "
          f"in {time.perf_counter() - t:.1f}s", flush=True)


def verify(loc, regions: list[str]) -> None:
    for rid in regions[:: max(1, len(regions) // 10)]:
        m = region.load_latest(loc.store, rid)
        assert m.generations == [] and m.version == VERSIONS + 1, (rid, m.version)
        assert loc.store.exists(layout.wal_key(rid, GENS + 1))  # the tail / fence sentinel
        assert not loc.store.exists(layout.wal_key(rid, GENS))
        assert loc.store.exists(layout.manifest_key(rid, VERSIONS - KEEP_VERSIONS + 1))
        assert not loc.store.exists(layout.manifest_key(rid, VERSIONS - KEEP_VERSIONS))
        assert region.read_version_hint(loc.store, rid) == VERSIONS + 1


def bench(name: str, loc, n_regions: int) -> None:
    regions = sorted(str(uuid.UUID(int=i + 1, version=4)) for i in range(n_regions))
    setup(loc, regions)
    cfg = gc.GcConfig(manifest_keep_versions=KEEP_VERSIONS, manifest_min_age_s=0, orphan_grace_s=0,
                      keep_current_epoch_wal=True, max_workers=32)
    loc.store.stats.clear()
    t0 = time.perf_counter()
    plan = gc.plan_gc(loc, cfg)
    t1 = time.perf_counter()
    result = gc.execute_gc(loc, plan)
    t2 = time.perf_counter()
    stats = dict(loc.store.stats)
    assert not plan.errors and not result.region_errors, (plan.errors, result.region_errors)
    expected = n_regions * PER_REGION
    assert plan.objects == expected and result.deleted_objects == expected, (plan.objects, result.deleted_objects)
    verify(loc, regions)
    secs = t2 - t0
    print(f"  plan {t1 - t0:.2f}s, execute {t2 - t1:.2f}s, counts {result.counts()}, "
          f"{result.bytes_reclaimed} bytes, requests {stats}", flush=True)
    print(f"RESULT gc store={name} objects={result.deleted_objects} seconds={secs:.2f} "
          f"objects_per_s={result.deleted_objects / secs:.0f} list_requests={stats.get('list', 0)}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, dict[str, str]]:
    port = _free_port()
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.time() > deadline:
                proc.terminate()
                raise RuntimeError("moto_server did not start")
            time.sleep(0.1)
    return proc, {"aws_endpoint": f"http://127.0.0.1:{port}", "allow_http": "true",
                  "aws_access_key_id": "bench", "aws_secret_access_key": "bench", "aws_region": "us-east-1"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--regions", type=int, default=100)
    p.add_argument("--stores", default="local,s3")
    a = p.parse_args()
    stores = a.stores.split(",")
    if "local" in stores:
        root = tempfile.mkdtemp(prefix="memwal-bench-gc-")
        try:
            print(f"local disk ({root})", flush=True)
            bench("local", open_store(os.path.join(root, "t")), a.regions)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if "s3" in stores:
        proc, options = start_moto()
        try:
            make_s3_client(options).create_bucket(Bucket="bench")
            print(f"S3 protocol (moto_server at {options['aws_endpoint']})", flush=True)
            bench("s3", open_store("s3://bench/t", options), a.regions)
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
