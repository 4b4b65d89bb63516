"""Benchmark: the MemWAL index builder over many regions, local disk.

Region manifests are created cheaply with memwal's own manifest writer (pb.RegionManifest +
store.put_if_absent), each with two flushed generations and its region value in
`region_field_entries`; one region in ten has two WAL entries past its hint, so the builder
also commits hint updates. Goal: 10,000 regions in under 30 s.

usage: python bench/snapshot.py [N ...]   (default: 1000 10000)
Prints `RESULT snapshot regions=N seconds=S regions_per_s=R` per size.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memwal_core.jobs import snapshot
from memwal_core.proto import memwal_pb2 as pb  # noqa: E402
from memwal_core.state import layout, region, table
from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402

NUM_BUCKETS = 16


def make_region(store, i: int) -> None:
    rid = str(uuid.UUID(int=i + 1, version=4))
    version = 1 + i % 3
    msg = pb.RegionManifest(version=version, writer_epoch=1 + i % 2, replay_after_wal_entry_position=4,
                            wal_entry_position_last_seen=4, current_generation=3, region_spec_id=1)
    msg.region_id.uuid = uuid.UUID(rid).bytes
    for g in (1, 2):
        msg.flushed_generations.add(generation=g, path=f"{i % 2**32:08x}_gen_{g}", physical_rows=100)
    msg.region_field_entries.add(field_id="bucket", value=(i % NUM_BUCKETS).to_bytes(4, "little"))
    store.put_if_absent(layout.manifest_key(rid, version), msg.SerializeToString())
    region.write_version_hint(store, rid, version)
    if i % 10 == 0:
        for pos in (5, 6):
            store.put(layout.wal_key(rid, pos), b"x")


def bench(n: int, root: str) -> float:
    path = os.path.join(root, f"t{n}")
    loc = open_store(path)
    demo.create_table(loc, sharding="bucket", num_buckets=NUM_BUCKETS, base_rows=10)
    t = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: make_region(loc.store, i), range(n)))
    print(f"setup: {n} region manifests in {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    r = snapshot.build_snapshot(loc)
    secs = time.perf_counter() - t
    assert r.num_regions == n and not r.region_errors, r.region_errors
    assert len(r.hints_updated) == (n + 9) // 10, len(r.hints_updated)
    assert snapshot.read_snapshot(loc).num_rows == n
    assert table.read_memwal_state(loc).details.num_regions == n
    print(f"snapshot of {n} regions ({r.storage}, {len(r.hints_updated)} hints raised): {secs:.2f}s", flush=True)
    t = time.perf_counter()
    r2 = snapshot.build_snapshot(loc)
    print(f"  second run (no hints to raise): {time.perf_counter() - t:.2f}s, {len(r2.hints_updated)} hints", flush=True)
    print(f"RESULT snapshot regions={n} seconds={secs:.2f} regions_per_s={n / secs:.0f}", flush=True)
    shutil.rmtree(path, ignore_errors=True)
    return secs


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1000, 10000]
    root = tempfile.mkdtemp(prefix="memwal-bench-snapshot-")
    try:
        for n in sizes:
            secs = bench(n, root)
            if n == 10000 and secs >= 30:
                print(f"GOAL MISSED: 10,000 regions took {secs:.1f}s (goal < 30s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
