"""Spark sessions for memwal: local, cluster and Spark Connect, started early and warmed.

Everything a driver needs before the first job: the JVM's options (our log4j config, the
class-data-sharing archive), the Python the workers run, shipping memwal_core to a cluster's
executors, and a prestart that overlaps the JVM start with the caller's own work.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from typing import Iterator

import pyarrow as pa

from memwal_core.spark import archive as jvm_archive
from memwal_core.spark import env as spark_env

# pylance warns whenever a process that loaded it forks; Spark's worker daemon forks workers
# that import lance afresh, so the warning is noise here.
warnings.filterwarnings("ignore", message="lance is not fork-safe")

log = logging.getLogger(__name__)


_prestart_lock = threading.Lock()
_prestarting: threading.Thread | None = None
_prestart_failed: tuple[str, Exception] | None = None  # (master, why): not started a second time


def prestart(master: str = "local[*]", conf: dict[str, str] | None = None) -> None:
    """Start the session and its Python workers in the background (a no-op for `sc://`).

    A short-lived process (the CLI) otherwise pays the JVM start (~7 s here) and then the first
    job's worker start-up (fork, import lance) one after the other, after its own imports and
    planning; started early they overlap. `get_spark` waits for a prestart in flight.
    """
    global _prestarting
    if master.startswith("sc://"):
        return
    with _prestart_lock:
        if _prestarting is not None:
            return

        def run() -> None:
            global _prestart_failed
            try:
                session = _build_session(master, conf)
            except Exception as e:  # noqa: BLE001 - get_spark raises it in the caller
                _prestart_failed = (master, e)
                return
            try:
                warm_workers(session)
            except Exception:  # noqa: BLE001 - the session works; its first job will say what is wrong
                log.debug("Spark worker warm-up failed", exc_info=True)

        _prestarting = threading.Thread(target=run, name="memwal-spark-prestart", daemon=True)
        _prestarting.start()


# What the driver JVM prints on every start and nobody can act on: Spark 4's launcher always adds
# the incubating vector module, and the JVM says so on stderr (no option turns that off).
JVM_NOISE = (b"WARNING: Using incubator modules: jdk.incubator.vector",)


def _launch_jvm(conf: dict[str, str]) -> None:
    """Start the driver JVM (pyspark's gateway) as pyspark would, with its stderr passed through
    a thread that drops `JVM_NOISE` lines and forwards every other line as it comes. A no-op
    when this process already has a JVM (a session ran before, or the caller started one)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    with SparkContext._lock:
        if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
            return  # a JVM already (or one pyspark connects to instead of starting it)
        spark_conf = SparkConf(loadDefaults=False).setAll(list(conf.items()))
        # Forwarding starts before the launch: a JVM that fails to start says why on stderr.
        read, write = os.pipe()
        threading.Thread(target=_forward_stderr, args=(os.fdopen(read, "rb"),), name="memwal-jvm-stderr",
                         daemon=True).start()
        try:
            gateway = launch_gateway(spark_conf, popen_kwargs={"stderr": write})
        finally:
            os.close(write)  # the JVM has its own copy: the forwarder ends when the JVM does
    SparkContext._ensure_initialized(gateway=gateway)


def _forward_stderr(stream) -> None:
    for line in iter(stream.readline, b""):
        if not line.rstrip().startswith(JVM_NOISE):
            try:
                os.write(2, line)
            except OSError:  # stderr is gone: nothing left to tell
                return


def _import_worker_modules(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    import lance  # noqa: F401  (the import is the point: it takes a fresh worker ~1 s)

    from memwal_core.state import routing  # noqa: F401

    yield from batches


def warm_workers(session) -> None:
    """One trivial task per core, so Python workers exist and have imported lance."""
    n = max(1, int(session.sparkContext.defaultParallelism))
    session.range(0, n, 1, n).mapInArrow(_import_worker_modules, "id long").collect()


def get_spark(master: str = "local[*]", conf: dict[str, str] | None = None, app_name: str = "memwal"):
    """A SparkSession for the merger (`getOrCreate`: an existing session in the process wins).

    A `sc://host:port` master builds a Spark Connect session instead of a local JVM.
    """
    thread = _prestarting
    if thread is not None and thread is not threading.current_thread():
        thread.join()
    if _prestart_failed is not None and _prestart_failed[0] == master:
        raise _prestart_failed[1]  # the same JVM start failed already: one start, one error
    return _build_session(master, conf, app_name)


def _build_session(master: str, conf: dict[str, str] | None = None, app_name: str = "memwal"):
    from pyspark.sql import SparkSession

    conf = dict(conf or {})
    if master.startswith("sc://"):
        return SparkSession.builder.remote(master).appName(app_name).getOrCreate()
    defaults = {
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(max(2, (os.cpu_count() or 2))),
        "spark.driver.memory": "2g",
        "spark.sql.execution.pyspark.udf.faulthandler.enabled": "true",
    }
    # The driver JVM is this process's child for every in-process master (client mode).
    log4j = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")
    # Ours first, the caller's after them (a later JVM option wins).
    archive = "" if conf.pop("memwal.jvm_archive", "on") == "off" else jvm_archive.java_options()
    conf["spark.driver.extraJavaOptions"] = " ".join(
        o for o in (f"-Dlog4j2.configurationFile=file:{log4j}", archive,
                    conf.get("spark.driver.extraJavaOptions", "")) if o)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # a local session binds to loopback
        # Python workers must run this interpreter (it has lance and memwal_core); Spark reads
        # PYSPARK_PYTHON when it forks them. (A cluster: spark_env.prepare.)
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    elif spark_env.is_cluster(master):
        # Executors are not our children: give them a Python with lance (ours by default) and
        # ship memwal_core with the job (memwal_core/spark_env.py says why).
        spark_env.prepare(master, conf)
    builder = SparkSession.builder.master(master).appName(app_name)
    for k, v in {**defaults, **conf}.items():
        builder = builder.config(k, v)
    _launch_jvm({"spark.master": master, "spark.app.name": app_name, **defaults, **conf})
    session = builder.getOrCreate()
    if spark_env.is_cluster(master):
        spark_env.ship_package(session)
    session.sparkContext.setLogLevel(conf.get("memwal.log_level", "ERROR"))
    return session
