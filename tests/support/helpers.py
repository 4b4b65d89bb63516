"""Helpers shared by several test modules: a file tree to compare, a generation planted by hand."""

from __future__ import annotations

import os
import time
import uuid

import lance
import pyarrow as pa

from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, region


def tree(root: str) -> dict[str, tuple[int, int]]:
    """Every file under `root`: relative path -> (size, mtime in ns); "touched nothing" means
    equal trees. The table lease's records are left out: every committing step takes the lease
    (`_memwal/lease/`), also one that then refuses the table. A file gone between the listing
    and its stat (a live writer's in-flight upload renamed as it lands) is not in the tree."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            rel = os.path.relpath(p, root)
            if rel.startswith(layout.LEASE_DIR + "/") or f"/{layout.LEASE_DIR}/" in f"/{rel}":
                continue
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            out[rel] = (st.st_size, st.st_mtime_ns)
    return out


def wait_flushed(writers, seconds: float = 30) -> None:
    """Wait until none of `writers` (pylance MemWAL writers; None skipped) has a frozen MemTable
    still being flushed: pylance flushes a full MemTable in the background."""
    deadline = time.monotonic() + seconds
    for w in writers:
        while w is not None and w.memtable_stats()["frozen_count"]:
            assert time.monotonic() < deadline, f"a frozen MemTable was not flushed within {seconds:g} s"
            time.sleep(0.005)


def plant_generation(loc, rid: str, data: pa.Table, path: str | None = None) -> int:
    """A generation written by hand and listed in a new manifest version (a foreign writer).
    A `path` with a `/` is only listed, never written (an unsafe path)."""
    latest = region.load_latest(loc.store, rid)
    gen = latest.current_generation
    path = path or f"{uuid.uuid4().hex[:8]}_gen_{gen}"
    if "/" not in path:
        lance.write_dataset(data, loc.child_uri(layout.generation_dir(rid, path, gen)))

    def add(m: pb.RegionManifest) -> bool:
        m.flushed_generations.add(generation=gen, path=path, physical_rows=data.num_rows)
        m.current_generation = gen + 1
        return True

    region.commit_next(loc.store, latest, add)
    return gen
