"""Lance alone: merge_insert commits racing compaction + index catch-up + cleanup_old_versions.

usage: python bench/cleanup_race.py [--seconds 60] [--floor 0] [--pause 0.2]
Three processes on one table (a btree on the key): an upserter (reads the table, waits
`--pause` as a large commit would, then one `merge_insert` upserting and deleting random keys;
it alone changes rows and keeps the model), a compactor (`compact_files` then
`optimize_indices`, so the Rewrite is soon not the latest version) and a cleaner
(`cleanup_old_versions(older_than=--floor s)`). At the end: keys present twice, deleted keys
back, rows differing from the model, and how many upserts read a version older than a Rewrite
committed before them (the window). What memwal's retention floor is about
(`GcOptions.cleanup_base_versions_floor_seconds`); numbers in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import tempfile
import time
from datetime import timedelta

import lance
import pyarrow as pa
import pyarrow.compute as pc

KEYS = 2000


def _rows(keys: list[int], v: int) -> pa.Table:
    return pa.table({"id": pa.array(keys, pa.int64()), "v": pa.array([v] * len(keys), pa.int64())})


def upserter(uri: str, stop: float, pause: float, out) -> None:
    rng = random.Random(1)
    model = {k: 0 for k in range(KEYS // 2)}
    commits, failures, spans, n = [], 0, [], 0
    while time.time() < stop:
        n += 1
        try:
            ds = lance.dataset(uri)
        except Exception:  # noqa: BLE001 - the latest manifest cleaned up between listing and reading
            failures += 1
            continue
        read = ds.version
        time.sleep(pause)
        up = sorted(set(rng.randrange(KEYS) for _ in range(40)))
        live = [k for k in model if k not in up]
        gone = sorted(rng.sample(live, min(5, len(live))))
        b = ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
        if gone:
            b = b.when_not_matched_by_source_delete(f"id IN ({', '.join(map(str, gone))})")
        try:
            b.execute(_rows(up, n))
        except Exception as e:  # noqa: BLE001 - counted: a cleanup under the commit makes it fail
            failures += 1
            print(f"upsert failed: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        for k in up:
            model[k] = n
        for k in gone:
            model.pop(k, None)
        commits.append((read, ds.version))
    out.put({"model": model, "commits": commits, "failures": failures})


def compactor(uri: str, stop: float, q) -> None:
    rewrites, failures = [], 0
    while time.time() < stop:
        try:
            ds = lance.dataset(uri)
            m = ds.optimize.compact_files(materialize_deletions_threshold=0.0)
            if m.fragments_removed:
                rewrites.append(lance.dataset(uri).version)
            ds = lance.dataset(uri)
            ds.optimize.optimize_indices()
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"compaction failed: {str(e).splitlines()[0][:200]}", flush=True)
        time.sleep(0.05)
    q.put({"rewrites": rewrites, "failures": failures})


def cleaner(uri: str, stop: float, floor: float, q) -> None:
    removed = failures = 0
    while time.time() < stop:
        try:
            removed += lance.dataset(uri).cleanup_old_versions(older_than=timedelta(seconds=floor)).old_versions
        except Exception:  # noqa: BLE001
            failures += 1
        time.sleep(0.05)
    q.put({"removed": removed, "failures": failures})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--floor", type=float, default=0.0)
    p.add_argument("--pause", type=float, default=0.2)
    a = p.parse_args()
    uri = os.path.join(tempfile.mkdtemp(), "t")
    ds = lance.write_dataset(_rows(list(range(KEYS // 2)), 0), uri, max_rows_per_file=200)
    ds.create_scalar_index("id", "BTREE")
    stop = time.time() + a.seconds
    ctx = mp.get_context("spawn")  # no fork after Lance's runtime started in this process
    qs = [ctx.Queue() for _ in range(3)]
    procs = [ctx.Process(target=upserter, args=(uri, stop, a.pause, qs[0])),
             ctx.Process(target=compactor, args=(uri, stop, qs[1])),
             ctx.Process(target=cleaner, args=(uri, stop, a.floor, qs[2]))]
    for pr in procs:
        pr.start()
    up, comp, clean = (q.get() for q in qs)
    for pr in procs:
        pr.join()
    base = lance.dataset(uri).to_table()
    counts = pc.value_counts(base.column("id"))
    dups = sorted(c["values"].as_py() for c in counts if c["counts"].as_py() > 1)
    got = {r["id"]: r["v"] for r in base.to_pylist()}
    model = up["model"]
    window = sum(1 for r, v in up["commits"] if any(r < w < v for w in comp["rewrites"]))
    print(json.dumps({"seconds": a.seconds, "floor": a.floor, "pause": a.pause, "upserts": len(up["commits"]),
                      "upsert_failures": up["failures"], "rewrites": len(comp["rewrites"]),
                      "compaction_failures": comp["failures"], "versions_removed": clean["removed"],
                      "upserts_read_before_a_rewrite": window, "duplicate_keys": len(dups),
                      "resurrected_keys": sum(1 for k in got if k not in model),
                      "rows_differing": sum(1 for k, v in model.items() if got.get(k) != v)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
