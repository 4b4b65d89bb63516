"""Builds the driver JVM's class-data-sharing archive (memwal_core/spark/archive.py says what
it is) by running a real tiny merge in a fresh JVM.

It lives here, above the jobs and the demo table it runs, so that `spark.archive` (read by
every session start) depends on nothing but the JVM and pyspark.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from memwal_core.spark.archive import QUIET, archive_path


def build(force: bool = False, timeout_s: float = 600.0) -> tuple[Path, float]:
    """Build the archive (unless present) from a real tiny merge in a fresh JVM; (path, seconds).

    Must run in a process without a SparkSession: the archive is written when the JVM exits.
    Written under a temporary name and renamed, so concurrent builders and readers never see a
    half-written archive.
    """
    from pyspark import SparkContext

    from memwal_core.jobs import merge
    from memwal_core.spark import session as spark
    from memwal_core.state.store import open_store
    from memwal_core.tools import demo

    path = archive_path()
    if path is None:
        raise RuntimeError("no java found (JAVA_HOME or PATH): Spark needs Java 17")
    if path.is_file() and not force:
        return path, 0.0
    if SparkContext._active_spark_context is not None:
        raise RuntimeError("build the JVM archive in a process without a running SparkSession")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    t0 = time.monotonic()
    session = spark.get_spark("local[*]", {"memwal.jvm_archive": "off",
                                           "spark.driver.extraJavaOptions": f"-XX:ArchiveClassesAtExit={tmp} {QUIET}"})
    with tempfile.TemporaryDirectory(prefix="memwal-jvm-archive-") as d:
        loc = open_store(os.path.join(d, "t"))
        demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
        demo.Workload(loc, seed=1, key_space=100, max_memtable_rows=50).write_round(60, puts_per_batch=10)
        spark.warm_workers(session)
        merge.merge(loc, session)
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    session.stop()
    gateway.shutdown()
    if proc is not None:  # the JVM exits on stdin EOF and writes the archive on its way out
        proc.stdin.close()
        proc.wait(timeout=timeout_s)
    if not tmp.is_file():
        raise RuntimeError(f"the JVM wrote no archive at {tmp}")
    os.replace(tmp, path)
    return path, time.monotonic() - t0
