"""Benchmark: plan and delete ~100,000 objects with the garbage collector, local disk and S3.

Setup (not timed), per region, objects written directly (plain files on local disk, to skip
LocalStore's fsync per object; on S3 straight into the server's store, see below):
- `--gens` flushed generations of `--files` small objects each, listed in the latest manifest;
- `--wal-per-gen` WAL entries per generation (real Arrow IPC streams with `generation` and
  `writer_epoch` metadata, epoch 1) plus a fence sentinel of epoch 2 at the tail, all covered;
- `--versions` region manifest versions (pb.RegionManifest; the latest lists the generations);
- one orphan `*_gen_*` directory of `--orphan-files` objects.
The base table is a real pylance table whose merge progress comes from **one real marked
merge** (`merge_insert` of an empty source with `mark_sstables_as_compacted` for every region:
every generation merged) followed by `cleanup_old_versions`, so only that version is retained.
No index gates GC. Defaults: 100 regions x (9 x 100 generation files + 45 WAL entries + 50 old
manifest versions + 5 orphan files) = 100,000 deletable objects.

S3: a moto server runs in a subprocess on a free 127.0.0.1 port (this script re-invoked with
`--serve-moto`); it is pre-filled through moto's in-process backend before it serves (100k
PUTs over HTTP would take ~7 min), then everything else (pylance, GC) goes over HTTP. Note
moto's LIST scans every key of the bucket per request, so on moto GC is list-bound: few, larger
generation directories keep the run short; `--gens 45 --files 20` is closer to real Lance
generations and makes 4x the list requests.

Timed: `plan_gc` + `execute_gc` (orphan grace and manifest age 0). Counted: the store's list
requests (`store.stats["list"]`): 1 (regions) + per region 1 (orphan sweep) + one per
generation and orphan directory deleted (their keys).

usage: python bench/gc.py [--regions N] [--gens G] [--files F] [--stores local,s3]
Prints `RESULT gc store=... objects=N seconds=S objects_per_s=R list_requests=L` per store.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import lance
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memwal_core.jobs import gc
from memwal_core.proto import memwal_pb2 as pb  # noqa: E402
from memwal_core.state import layout, region
from memwal_core.state.store import LocalStore, open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402

BUCKET = "bench"
PREFIX = "t"


@dataclass(frozen=True)
class Shape:
    regions: int = 100
    gens: int = 9
    files: int = 100
    wal_per_gen: int = 5
    versions: int = 60
    keep: int = 10
    orphan_files: int = 5

    @property
    def per_region(self) -> int:
        """Deletable objects per region."""
        return self.gens * self.files + self.gens * self.wal_per_gen + (self.versions - self.keep) + self.orphan_files

    @property
    def tail(self) -> int:
        return self.gens * self.wal_per_gen + 1

    def region_ids(self) -> list[str]:
        return sorted(str(uuid.UUID(int=i + 1, version=4)) for i in range(self.regions))

    def args(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={v}" for k, v in self.__dict__.items()]


def wal_entry(meta: dict[str, str]) -> bytes:
    schema = pa.schema([("id", pa.int64()), ("_tombstone", pa.bool_())], metadata=meta)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, schema) as w:
        if "generation" in meta:
            w.write_batch(pa.record_batch([pa.array([1], pa.int64()), pa.array([False])], schema=schema))
    return sink.getvalue()


def region_objects(shape: Shape, rid: str) -> dict[str, bytes]:
    """Every object of one region (key relative to the table root -> bytes)."""
    objs: dict[str, bytes] = {}
    msg = pb.RegionManifest(writer_epoch=2, replay_after_wal_entry_position=shape.tail,
                            wal_entry_position_last_seen=shape.tail, current_generation=shape.gens + 1)
    msg.region_id.uuid = uuid.UUID(rid).bytes
    pos = 0
    for g in range(1, shape.gens + 1):
        path = f"{g:08x}_gen_{g}"
        msg.flushed_generations.add(generation=g, path=path, in_memory_bytes=shape.files, physical_rows=1)
        gdir = layout.generation_dir(rid, path, g)
        for f in range(shape.files):
            objs[f"{gdir}/data/{f:04d}.lance"] = b"x"
        for _ in range(shape.wal_per_gen):
            pos += 1
            objs[layout.wal_key(rid, pos)] = wal_entry({"generation": str(g), "writer_epoch": "1"})
    objs[layout.wal_key(rid, shape.tail)] = wal_entry({"fence_sentinel": "true", "writer_epoch": "2"})
    for v in range(1, shape.versions + 1):
        msg.version = v
        objs[layout.manifest_key(rid, v)] = msg.SerializeToString()
    objs[layout.version_hint_key(rid)] = b'{"version":%d}' % shape.versions
    odir = f"{layout.region_dir(rid)}/deadbeef_gen_{shape.gens}"
    for f in range(shape.orphan_files):
        objs[f"{odir}/data/{f}.lance"] = b"o"
    return objs


def write_local(root: str, objs: dict[str, bytes]) -> None:
    for key, data in objs.items():
        path = os.path.join(root, *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def setup(loc, shape: Shape) -> None:
    """Region objects (local: here; S3: already pre-filled by the server), then the base table."""
    t = time.perf_counter()
    regions = shape.region_ids()
    if isinstance(loc.store, LocalStore):
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda rid: write_local(loc.store.root, region_objects(shape, rid)), regions))
    demo.create_table(loc, sharding="manual", base_rows=10)
    # One real marked merge: every generation of every region merged, atomically.
    from lance.mem_wal import CompactedSsTable

    ds = lance.dataset(loc.lance_uri, storage_options=loc.storage_options or None)
    empty = pa.table({f.name: pa.array([], f.type) for f in ds.schema}, schema=ds.schema)
    ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all() \
        .mark_sstables_as_compacted([CompactedSsTable(rid, shape.gens) for rid in regions]).execute(empty)
    gc.cleanup_base_versions(loc, gc.GcOptions(cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0))
    print(f"  setup: {shape.regions} regions, {shape.regions * shape.per_region} deletable objects, "
          f"base table in {time.perf_counter() - t:.1f}s", flush=True)


def verify(loc, shape: Shape) -> None:
    regions = shape.region_ids()
    for rid in regions[:: max(1, len(regions) // 10)]:
        m = region.load_latest(loc.store, rid)
        assert m.generations == [] and m.version == shape.versions + 1, (rid, m.version)
        assert loc.store.exists(layout.wal_key(rid, shape.tail))  # the tail / fence sentinel
        assert not loc.store.exists(layout.wal_key(rid, shape.tail - 1))
        assert loc.store.exists(layout.manifest_key(rid, shape.versions - shape.keep + 1))
        assert not loc.store.exists(layout.manifest_key(rid, shape.versions - shape.keep))
        assert region.read_version_hint(loc.store, rid) == shape.versions + 1


def bench(name: str, loc, shape: Shape) -> None:
    setup(loc, shape)
    cfg = gc.GcOptions(manifest_retention=shape.keep, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                      max_workers=32)
    loc.store.stats.clear()
    t0 = time.perf_counter()
    plan = gc.plan_gc(loc, cfg)
    t1 = time.perf_counter()
    result = gc.execute_gc(loc, plan)
    t2 = time.perf_counter()
    stats = dict(loc.store.stats)
    assert not plan.region_errors and not result.region_errors, (plan.region_errors, result.region_errors)
    expected = shape.regions * shape.per_region
    assert plan.objects == expected and result.deleted_objects == expected, (plan.objects, result.deleted_objects)
    verify(loc, shape)
    secs = t2 - t0
    print(f"  plan {t1 - t0:.2f}s, execute {t2 - t1:.2f}s, counts {result.counts()}, "
          f"{result.bytes_reclaimed} bytes, requests {stats}", flush=True)
    print(f"RESULT gc store={name} objects={result.deleted_objects} seconds={secs:.2f} "
          f"objects_per_s={result.deleted_objects / secs:.0f} list_requests={stats.get('list', 0)}", flush=True)


# ---------------------------------------------------------------------------- S3 (moto)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_moto(port: int, shape: Shape) -> None:
    """The server subprocess: moto on 127.0.0.1:port, pre-filled with every region object."""
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    backend.create_bucket(BUCKET, "us-east-1")
    t = time.perf_counter()
    n = 0
    for rid in shape.region_ids():
        for key, data in region_objects(shape, rid).items():
            backend.put_object(BUCKET, f"{PREFIX}/{key}", data)
            n += 1
    print(f"READY {n} objects pre-filled in {time.perf_counter() - t:.1f}s", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), sys.exit(0)))
    while True:
        time.sleep(3600)


def start_moto(shape: Shape) -> tuple[subprocess.Popen, dict[str, str]]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-moto", str(port), *shape.args()],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.terminate()
        raise RuntimeError(f"moto server did not start: {line!r}")
    print(f"  moto server on 127.0.0.1:{port}: {line.split(' ', 1)[1].strip()}", flush=True)
    return proc, {"aws_endpoint": f"http://127.0.0.1:{port}", "allow_http": "true",
                  "aws_access_key_id": "bench", "aws_secret_access_key": "bench", "aws_region": "us-east-1"}


def main() -> None:
    p = argparse.ArgumentParser()
    for k, v in Shape().__dict__.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--stores", default="local,s3")
    p.add_argument("--serve-moto", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    shape = Shape(**{k: getattr(a, k) for k in Shape().__dict__})
    if a.serve_moto is not None:
        serve_moto(a.serve_moto, shape)
        return
    stores = a.stores.split(",")
    print(f"shape: {shape} -> {shape.regions * shape.per_region} deletable objects", flush=True)
    if "local" in stores:
        root = tempfile.mkdtemp(prefix="memwal-bench-gc-")
        try:
            print(f"local disk ({root})", flush=True)
            bench("local", open_store(os.path.join(root, "t")), shape)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if "s3" in stores:
        print("S3 protocol (moto)", flush=True)
        proc, options = start_moto(shape)
        try:
            bench("s3", open_store(f"s3://{BUCKET}/{PREFIX}", options), shape)
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
