"""The Spark driver's class-data-sharing archive: built by the CLI, used only when present."""

from __future__ import annotations

import os
import subprocess
import sys

from memwal_core.spark import archive as jvm_archive

BIN = os.path.dirname(sys.executable)


def test_options_only_for_a_built_enabled_archive(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMWAL_STATE_DIR", str(tmp_path))
    path = jvm_archive.archive_path()
    assert path is not None and path.parent == tmp_path / "jvm" and path.suffix == ".jsa"
    assert jvm_archive.java_options() == ""  # not built: nothing to map
    path.parent.mkdir()
    path.write_bytes(b"")
    assert jvm_archive.java_options().startswith(f"-XX:SharedArchiveFile={path} ")
    monkeypatch.setenv("MEMWAL_SPARK_CDS", "0")
    assert jvm_archive.java_options() == ""


# A driver JVM that must map the archive (-Xshare:on fails the start otherwise) runs a job.
CHECK = r"""
import sys
from memwal_core.spark import archive as jvm_archive, session as spark
opts = jvm_archive.java_options()
assert opts, "archive not found"
s = spark.get_spark("local[2]", {"spark.driver.extraJavaOptions": "-Xshare:on"})
assert s.range(10).count() == 10
print("MAPPED", opts)
"""


def test_cli_builds_an_archive_a_driver_jvm_maps(tmp_path):
    env = {**os.environ, "MEMWAL_STATE_DIR": str(tmp_path)}
    env.pop("MEMWAL_SPARK_CDS", None)
    memwal = os.path.join(BIN, "memwal")
    status = subprocess.run([memwal, "spark-archive", "status"], env=env, capture_output=True, text=True)
    assert status.returncode == 1 and "not built" in status.stdout
    built = subprocess.run([memwal, "spark-archive"], env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0 and "built in" in built.stdout, built.stderr[-2000:]
    (archive,) = (tmp_path / "jvm").iterdir()  # no temporary file left beside it
    assert archive.suffix == ".jsa" and archive.stat().st_size > 10_000_000
    again = subprocess.run([memwal, "spark-archive"], env=env, capture_output=True, text=True, timeout=60)
    assert "already built" in again.stdout
    check = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "MAPPED" in check.stdout, check.stderr[-3000:]
    removed = subprocess.run([memwal, "spark-archive", "remove"], env=env, capture_output=True, text=True)
    assert removed.returncode == 0 and not archive.exists()
