"""The merge and the base-table compaction on a real Spark standalone cluster (master + one
worker from pyspark's own `spark-class`, loopback only): tasks run in executor JVMs whose
Python and memwal_core come from the application (no PYSPARK_PYTHON, no PYTHONPATH on the
cluster), on a local table and on `s3://` (moto) through a Dagster run, and no secret reaches
Spark's logs. The drivers are subprocesses: one JVM holds one SparkContext, and this process
has the suite's local one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import lance
import pytest
from support.cluster import StandaloneCluster

from memwal_core.state import table
from memwal_core.state.store import make_s3_client, open_store
from memwal_core.tools import demo

PROCS = os.path.join(os.path.dirname(__file__), "procs")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = StandaloneCluster(tmp_path_factory.mktemp("cluster"), cores=2, memory="2g").start()
    yield c
    c.stop()


def driver_env(**extra: str) -> dict[str, str]:
    """The driver's environment as a user's shell would have it: no PYSPARK_PYTHON (memwal
    must choose the executors' Python itself); this checkout first on the driver's path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["LANCE_LOG"] = "error,lance::index=off"
    return {**env, **extra}


def written(loc, seed: int, fragmented: bool = False) -> demo.Workload:
    """3 bucket regions and two rounds of puts, overwrites and deletes by ShardWriters;
    `fragmented`: the base table in 30 fragments of 10 rows (something for compaction)."""
    if fragmented:
        data = demo.rows_table([demo.row(i, 0) for i in range(300)])
        lance.write_dataset(data, loc.lance_uri, schema=demo.SCHEMA, max_rows_per_file=10,
                            storage_options=loc.storage_options or None
                            ).initialize_mem_wal(bucket_column="id", num_buckets=3)
    else:
        demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=30)
    w = demo.Workload(loc, seed=seed, key_space=400, max_memtable_rows=40)
    for _ in range(2):
        w.write_round(150, overwrite=0.3, delete=0.05)
    return w


def base_rows(loc) -> dict:
    return {r["id"]: r for r in table.open_dataset(loc).to_table().to_pylist()}


def files_under(*roots: Path) -> list[Path]:
    return [p for root in roots for p in Path(root).rglob("*") if p.is_file()]


def test_merge_and_dagster_s3_run_on_standalone_cluster(cluster, tmp_path, moto_server):
    loc = open_store(str(tmp_path / "t"))
    w = written(loc, seed=3, fragmented=True)
    secret = f"cluster-secret-{uuid.uuid4().hex}"
    bucket = f"b{uuid.uuid4().hex[:12]}"
    make_s3_client(moto_server.options()).create_bucket(Bucket=bucket)
    s3_loc = open_store(f"s3://{bucket}/t", moto_server.options(secret))
    w3 = written(s3_loc, seed=4)
    public = {k: v for k, v in moto_server.options(secret).items() if k != "aws_secret_access_key"}

    extra = {"conf": {**cluster.conf(), "spark.app.name": "memwal-cluster-test"}, "s3_options": public,
             "compact": True}
    p = subprocess.run([sys.executable, os.path.join(PROCS, "cluster_merge.py"), cluster.master_url,
                        loc.lance_uri, s3_loc.lance_uri, json.dumps(extra)],
                       env=driver_env(MEMWAL_TEST_SECRET=secret), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:] + cluster.tail()
    out = json.loads(p.stdout.strip().splitlines()[-1])

    # The merge is right: the base table alone is what the writers wrote.
    assert out["merge"]["generations_merged"] > 0 and not out["merge"]["failed"]
    assert base_rows(loc) == w.expected()
    # Then the base-table compaction (default thresholds: 30+ small fragments), its rewrites in
    # Spark tasks on the cluster: one fragment, the same rows, merge progress kept.
    c = out["compaction"]
    assert c["status"] == "compacted" and c["tasks"] >= 1 and c["fragments_removed"] >= 30
    assert c["fragments_after"] == 1 and c["progress_kept"]
    assert len(table.open_dataset(loc).get_fragments()) == 1 and base_rows(loc) == w.expected()
    # The Dagster run on the cluster merged the s3:// table (secret from the environment).
    assert out["dagster"]["success"] and out["dagster"]["generations_merged"] > 0
    assert base_rows(s3_loc) == w3.expected()

    # Where the tasks ran: in the worker's executor (cwd = work/<app>/<executor>), other
    # processes than the driver, with the driver's interpreter chosen by memwal, and
    # memwal_core imported from the zip shipped with the job (not from a path on the node).
    app_dir = cluster.work_dir / out["app_id"]
    assert app_dir.is_dir() and [d.name for d in app_dir.iterdir()] == ["0"]
    assert out["conf_python"] == out["python"]
    for task in out["probe"]:
        assert task["pid"] != out["driver_pid"] and task["ppid"] != out["driver_pid"]
        assert Path(task["cwd"]) == app_dir / "0"
        assert task["python"] == out["python"]
        zip_path, inner = task["memwal_core"].split(".zip" + os.sep, 1)
        assert Path(zip_path).name.startswith("memwal_core-") and inner == os.path.join("memwal_core", "__init__.py")
        assert (Path(task["cwd"]) / (zip_path + ".zip")).resolve().parent == app_dir / "0"

    # Spark's event log: every task of the application (merge, compaction, probe, Dagster merge) ran on
    # executor 0 of the worker, none on the driver.
    (log,) = [f for f in cluster.event_log_dir.iterdir() if f.name.startswith(out["app_id"])]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    ends = [e for e in events if e["Event"] == "SparkListenerTaskEnd"]
    assert len(ends) >= 8 and {e["Task Info"]["Executor ID"] for e in ends} == {"0"}
    assert all(e["Task End Reason"]["Reason"] == "Success" for e in ends)

    # No secret anywhere Spark writes: event log, executor stdout/stderr, master/worker logs,
    # nor the driver's own output. (The table URI is there: the files are the right ones.)
    logs = files_under(cluster.event_log_dir, cluster.work_dir, cluster.log_dir)
    text = "\n".join(f.read_bytes().decode(errors="replace") for f in logs if f.suffix != ".zip")
    assert "memwal-cluster-test" in text and any(f.name == "stderr" for f in logs)
    assert secret not in text and secret not in p.stdout + p.stderr


def test_cli_maintain_on_standalone_cluster_with_no_other_setting(cluster, tmp_path):
    """`memwal maintain URI --spark-master spark://HOST:PORT`, nothing else: a full pass."""
    loc = open_store(str(tmp_path / "t"))
    w = written(loc, seed=5)
    before = set(cluster.app_dirs())
    p = subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", "maintain", loc.lance_uri,
                        "--spark-master", cluster.master_url, "--json"],
                       env=driver_env(), capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:] + cluster.tail()
    report = json.loads(p.stdout)
    assert report["failed"] == [] and report["steps"]["merge"]["metrics"]["generations_merged"] > 0
    assert all(report["steps"][s]["ok"] for s in ("merge", "compact", "catchup", "index", "gc"))
    assert base_rows(loc) == w.expected()
    assert len(set(cluster.app_dirs()) - before) == 1  # the merge ran as an application on the cluster


# Packages the executors never import (the worker brings pyspark's own zip): left out so the
# archive stays a few hundred MB.
NOT_ON_EXECUTORS = ["pyspark", "dagster*", "moto", "cfnlint", "sympy", "botocore", "boto3", "sqlalchemy",
                    "grpc", "networkx", "hypothesis", "pip", "setuptools"]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMWAL_SOAK"), reason="packs ~0.6 GB: run with MEMWAL_SOAK=1 (make soak)")
def test_merge_with_a_packed_environment_from_spark_archives(cluster, tmp_path):
    """`memwal spark-env` output shipped with `spark.archives`: executors unpack it in their
    work dir and run its Python (memwal infers `./memwal_env/bin/python` from the alias)."""
    loc = open_store(str(tmp_path / "t"))
    w = written(loc, seed=6)
    archive = tmp_path / "memwal-env.tar.gz"
    site = os.path.relpath(next(Path(sys.prefix).glob("lib/python*/site-packages")), sys.prefix)
    excludes = [a for p in NOT_ON_EXECUTORS for a in ("--exclude", f"{site}/{p}*")]  # fnmatch: * spans /
    p = subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", "spark-env", str(archive), *excludes],
                       env=driver_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"spark.archives: {archive}#memwal_env" in p.stdout

    extra = {"conf": {**cluster.conf(), "spark.archives": f"{archive}#memwal_env"}, "s3_options": {}}
    p = subprocess.run([sys.executable, os.path.join(PROCS, "cluster_merge.py"), cluster.master_url,
                        loc.lance_uri, "", json.dumps(extra)],
                       env=driver_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + cluster.tail()
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["merge"]["generations_merged"] > 0 and not out["merge"]["failed"]
    assert base_rows(loc) == w.expected()
    assert out["conf_python"] == "./memwal_env/bin/python"
    executor_dir = cluster.work_dir / out["app_id"] / "0"
    for task in out["probe"]:
        assert Path(task["python"]).parent == executor_dir / "memwal_env" / "bin"
        assert "memwal_core-" in task["memwal_core"]
