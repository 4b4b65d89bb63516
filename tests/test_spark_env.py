"""What a cluster's executors get from memwal (memwal_core/spark/env.py), without Spark:
the interpreter choice, the shipped memwal_core zip, and the packed environment."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

from memwal_core.spark import env as spark_env


def test_cluster_masters_and_loopback():
    assert not spark_env.is_cluster("local[*]") and not spark_env.is_cluster("local-cluster[2,1,1024]")
    assert not spark_env.is_cluster("sc://127.0.0.1:15002")
    assert all(spark_env.is_cluster(m) for m in ("spark://h:7077", "yarn", "k8s://https://h:6443"))
    assert spark_env.loopback_master("spark://127.0.0.1:7077") and spark_env.loopback_master("spark://localhost:1")
    assert spark_env.loopback_master("spark://127.0.0.1:7077,localhost:7078")
    assert not spark_env.loopback_master("spark://10.0.0.5:7077") and not spark_env.loopback_master("yarn")
    assert not spark_env.loopback_master("spark://127.0.0.1:7077,node2:7077")


@pytest.fixture
def environ(monkeypatch):
    """A private copy of os.environ for the test (spark_env sets variables directly; a
    PYSPARK_PYTHON left behind would break every later Spark session of the suite)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")}
    monkeypatch.setattr(os, "environ", env)
    return env


def test_executor_python_precedence(environ):
    assert spark_env.executor_python({}) == sys.executable  # the driver's own, by default
    environ["PYSPARK_PYTHON"] = "/opt/py/bin/python3"
    assert spark_env.executor_python({}) == "/opt/py/bin/python3"
    # A shipped environment with an alias is more specific than the environment variable...
    archives = {"spark.archives": "hdfs:///envs/a.zip,s3://b/memwal-env.tar.gz#env"}
    assert spark_env.executor_python(archives) == "./env/bin/python"
    assert spark_env.archive_python("s3://b/x.tar.gz") is None  # no alias: nothing to infer
    # ...and an explicit setting wins over everything.
    assert spark_env.executor_python({**archives, "spark.pyspark.python": "/usr/bin/python3.11"}) == "/usr/bin/python3.11"


def test_prepare_sets_what_pyspark_reads(environ):
    conf: dict[str, str] = {}
    spark_env.prepare("spark://127.0.0.1:7077", conf)
    # pyspark's SparkContext takes the executors' Python from PYSPARK_PYTHON, not from the
    # spark.pyspark.python setting; both are set.
    assert conf["spark.pyspark.python"] == os.environ["PYSPARK_PYTHON"] == sys.executable
    assert os.environ["SPARK_LOCAL_IP"] == "127.0.0.1"
    del environ["SPARK_LOCAL_IP"]
    spark_env.prepare("spark://10.1.2.3:7077", {"spark.pyspark.python": "/x/python"})
    assert environ["PYSPARK_PYTHON"] == "/x/python" and "SPARK_LOCAL_IP" not in environ


def test_package_zip_is_deterministic_and_importable_alone(tmp_path):
    z1 = spark_env.package_zip(tmp_path / "a")
    z2 = spark_env.package_zip(tmp_path / "b")
    assert z1.name == z2.name and z1.read_bytes() == z2.read_bytes()
    names = zipfile.ZipFile(z1).namelist()
    assert "memwal_core/spark/tasks.py" in names and "memwal_core/proto/memwal_pb2.py" in names
    assert not any("__pycache__" in n for n in names)
    # A Python with the dependencies on its path but not memwal (-I -S: no PYTHONPATH, no
    # cwd, no .pth files, so not the shared venv's editable memwal) imports it from the zip.
    import site

    code = ("import sys; sys.path[:0] = sys.argv[1:]; "
            "import memwal_core.spark.tasks, memwal_core.state.routing; print(memwal_core.spark.tasks.__file__)")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(z1), *site.getsitepackages()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(z1 / "memwal_core" / "spark" / "tasks.py")


def test_pack_environment_spark_can_unpack(tmp_path):
    """Editable hooks, excluded paths and __pycache__ left out; the interpreter symlink that
    leaves the env stored as a copy of its target (Spark refuses entries pointing outside the
    archive); inside symlinks kept, relative."""
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    (site,) = env.glob("lib/python*/site-packages")
    for pkg in ("dep", "big"):
        (site / pkg / "__pycache__").mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("X = 1\n")
        (site / pkg / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (site / "__editable__.mine-1.0.pth").write_text("import __editable___mine_finder; __editable___mine_finder.install()\n")
    (site / "__editable___mine_finder.py").write_text("def install(): pass\n")
    skipped = spark_env.editable_files(env)
    assert sorted(os.path.basename(s) for s in skipped) == ["__editable__.mine-1.0.pth", "__editable___mine_finder.py"]
    out, left = spark_env.pack_environment(tmp_path / "env.tar.gz", env, exclude=["lib/*/site-packages/big*"])
    assert left == skipped
    members = {m.name: m for m in tarfile.open(out)}
    rel_site = str(site.relative_to(env))
    assert f"{rel_site}/dep/__init__.py" in members and "pyvenv.cfg" in members
    assert not any("editable" in n or "/big" in n or "__pycache__" in n for n in members)
    for name, m in members.items():  # nothing points outside the archive
        if m.issym():
            assert not os.path.isabs(m.linkname)
            target = os.path.normpath(os.path.join(os.path.dirname(name), m.linkname))
            assert target in members or any(n.startswith(target + "/") for n in members)  # a file or a dir
    python = members[f"bin/python{sys.version_info.major}.{sys.version_info.minor}"]
    assert python.isfile() and python.mode & 0o111 and python.size == os.path.getsize(os.path.realpath(sys.executable))
    # Unpacked anywhere, its python runs as that env (its own site-packages).
    dest = tmp_path / "unpacked"
    with tarfile.open(out) as t:
        t.extractall(dest, filter="tar")
    r = subprocess.run([str(dest / "bin" / "python"), "-c", "import sys, dep; print(sys.prefix, dep.__file__)"],
                       capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(dest), str(dest / rel_site / "dep" / "__init__.py")]
    with pytest.raises(FileExistsError):
        spark_env.pack_environment(out, env)
    with pytest.raises(ValueError, match="tar.gz"):
        spark_env.pack_environment(tmp_path / "env.tar", env)
