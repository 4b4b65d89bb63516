"""`make s3-demo` (`python -m support.s3_demo` from tests/): the demo table on a local S3-protocol server (moto), maintained once.

Starts `moto_server` on 127.0.0.1 on a free port, creates a bucket, writes a demo table at
`s3://BUCKET/demo_table` with pylance `ShardWriter`s through the storage options `open_store`
produces, runs one full maintenance pass (merge, MemWAL index, catch-up, GC: the same
in-process Dagster pass as `memwal demo`), prints the per-region status and the S3 requests
memwal made, checks an LSM read against what the writers wrote, and stops the server.

The secret key goes the way a real deployment's should: into an environment variable that
the table resource reads with `dagster.EnvVar` (`secrets:` in memwal.yaml), never into a
printed line. moto accepts any credentials.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from support.s3_server import LocalS3

SECRET_ENV = "MEMWAL_S3_DEMO_SECRET"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make s3-demo", description=__doc__.splitlines()[0])
    p.add_argument("--bucket", default="memwal-demo")
    p.add_argument("--regions", type=int, default=4)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--spark-master", default="local[*]")
    p.add_argument("--verbose", "-v", action="store_true")
    a = p.parse_args(argv)
    with LocalS3() as s3:
        print(f"moto S3 server on {s3.endpoint}", file=sys.stderr)
        rc = run_demo(s3, bucket=a.bucket, regions=a.regions, rows=a.rows, spark_master=a.spark_master,
                      verbose=a.verbose)
    print("moto S3 server stopped", file=sys.stderr)
    return rc


def run_demo(s3: LocalS3, *, bucket: str = "memwal-demo", regions: int = 4, rows: int = 400,
             spark_master: str = "local[*]", verbose: bool = False) -> int:
    """The demo against a running S3 server `s3` (`make s3-demo` starts its own; the tests pass
    theirs): a new bucket, the table, one maintenance pass, the status, the LSM check."""
    from memwal_core.observe import reader
    from memwal_core.options import GcOptions, SparkOptions
    from memwal_core.state.store import make_s3_client, open_store
    from memwal_core.tools import demo

    from memwal_pipeline.cli import STEPS, print_status, run_pass
    from memwal_pipeline.config import TableConfig

    secret = "demo-" + secrets.token_hex(12)
    os.environ[SECRET_ENV] = secret  # what `secrets: {aws_secret_access_key: ...}` reads
    options = s3.options(secret)
    make_s3_client(options).create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/demo_table"
    loc = open_store(uri, options)
    print(f"writing a demo table at {uri}: {regions} bucket regions, ~{rows} operations per round",
          file=sys.stderr)
    demo.create_table(loc, sharding="bucket", num_buckets=regions, base_rows=rows // 2, btree_index=True)
    w = demo.Workload(loc, seed=42, key_space=max(10, rows), max_memtable_rows=max(100, rows // regions))
    for _ in range(3):
        w.write_round(rows, overwrite=0.3, delete=0.03)
    public = {k: v for k, v in options.items() if k != "aws_secret_access_key"}
    # As in `memwal demo`: base-table versions are cleaned up at the retention floor (a day).
    cfg = TableConfig(name="s3demo", uri=uri, storage_options=public,
                      secrets={"aws_secret_access_key": SECRET_ENV}, spark=SparkOptions(master=spark_master),
                      gc=GcOptions(cleanup_base_versions_older_than_seconds=GcOptions().cleanup_base_versions_floor_seconds))
    report = run_pass(cfg, list(STEPS), verbose=verbose)
    got = {r["id"]: r for r in reader.lsm_table(loc).to_pylist()}
    ok = got == w.expected()
    status_rc = print_status(uri, options)
    print(f"LSM read equals what the writers wrote: {'yes' if ok else 'NO'} ({len(got)} rows)")
    listed = sum(1 for _ in loc.store.list(""))
    print(f"objects under {uri}: {listed}")
    for line in report.failed:
        print(f"error: {line}", file=sys.stderr)
    return 0 if ok and not report.failed and status_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
