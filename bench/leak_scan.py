"""Benchmark: what the leaked-file scan (memwal_core/jobs/gc/leaks.py) costs per GC pass.

A real pylance table of `--files` data files (one write with `max_rows_per_file`), `--versions`
versions (deletes: a deletion file each) and a few leaked files (abandoned commits), local disk
and a moto S3 server. Timed: `leaks.plan_leaks` cold (every retained manifest read) and warm
(manifests cached per process; only the listings), with the store's list/get request counts.

usage: python bench/leak_scan.py [--files N] [--versions V] [--stores local,s3]
Prints `RESULT leak_scan store=... files=N versions=V cold_s=... warm_s=... list_s=... lists=L gets=G`.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time

import lance
import pyarrow as pa

sys.path.insert(0, ".")
from memwal_core.jobs.gc import leaks  # noqa: E402
from memwal_core.state.store import open_store  # noqa: E402


@contextlib.contextmanager
def _abandon(version):
    raise RuntimeError("abandoned")
    yield


def run(uri: str, options: dict, files: int, versions: int) -> str:
    rows = files * 10
    lance.write_dataset(pa.table({"id": pa.array(range(rows), pa.int64()), "v": pa.array(range(rows))}), uri,
                        max_rows_per_file=10, storage_options=options or None)
    for i in range(versions - 1):
        lance.dataset(uri, storage_options=options or None).delete(f"id = {i * 10}")
    for i in range(3):
        with contextlib.suppress(Exception):
            lance.dataset(uri, storage_options=options or None, commit_lock=_abandon).insert(
                pa.table({"id": pa.array([10**9 + i], pa.int64()), "v": pa.array([i])}))
    loc = open_store(uri, options)
    leaks._REFS.clear()
    loc.store.stats.clear()
    t0 = time.perf_counter()
    cold = leaks.plan_leaks(loc, time.time(), 0)
    cold_s = time.perf_counter() - t0
    stats = dict(loc.store.stats)
    t0 = time.perf_counter()
    warm = leaks.plan_leaks(loc, time.time(), 0)
    warm_s = time.perf_counter() - t0
    assert cold.error is None and len(cold.leaks) == 3 == len(warm.leaks), (cold.error, cold.leaks)
    return (f"files={cold.files_listed} versions={cold.versions} cold_s={cold_s:.3f} warm_s={warm_s:.3f} "
            f"list_s={warm.list_seconds:.3f} lists={stats.get('list', 0)} gets={stats.get('get', 0)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--versions", type=int, default=50)
    ap.add_argument("--stores", default="local,s3")
    a = ap.parse_args()
    for store in a.stores.split(","):
        if store == "local":
            d = tempfile.mkdtemp()
            try:
                print(f"RESULT leak_scan store=local {run(d + '/t', {}, a.files, a.versions)}", flush=True)
            finally:
                shutil.rmtree(d)
        else:
            from memwal_core.state.store import make_s3_client
            from memwal_pipeline.s3_demo import LocalS3

            s3 = LocalS3().start()
            try:
                opts = {"aws_endpoint": s3.endpoint, "aws_access_key_id": "x", "aws_secret_access_key": "x",
                        "aws_region": "us-east-1", "allow_http": "true"}
                make_s3_client(opts).create_bucket(Bucket="bench")
                print(f"RESULT leak_scan store=s3 {run('s3://bench/t', opts, a.files, a.versions)}", flush=True)
            finally:
                s3.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
