"""`memwal spark-server|spark-archive|spark-env`: the Spark pieces a deployment sets up once."""

from __future__ import annotations

import sys

from .output import CliError, say


def cmd_spark_server(a) -> int:
    from memwal_core.spark import connect as spark_connect

    remote = f"sc://127.0.0.1:{a.port}"
    if a.action == "start":
        started = spark_connect.ensure_server(remote, master=a.master)
        print(f"Spark Connect server {'started' if started else 'already running'} at {remote}")
    elif a.action == "stop":
        spark_connect.stop_server(remote)
        print(f"Spark Connect server at {remote} stopped")
    else:
        up = spark_connect.listening("127.0.0.1", a.port)
        print(f"Spark Connect server at {remote}: {'running' if up else 'not running'}")
        return 0 if up else 1
    return 0


def cmd_spark_archive(a) -> int:
    from memwal_core.spark import archive as jvm_archive

    path = jvm_archive.archive_path()
    if path is None:
        raise CliError("no java found (JAVA_HOME or PATH): Spark needs Java 17")
    if a.action == "status":
        there = path.is_file()
        used = there and bool(jvm_archive.java_options())
        print(f"JVM class archive {path}: " + (f"{path.stat().st_size / 1e6:.0f} MB, "
              f"{'used' if used else 'not used (MEMWAL_SPARK_CDS=0)'}" if there else "not built"))
        return 0 if there else 1
    if a.action == "remove":
        if path.is_file():
            path.unlink()
        print(f"JVM class archive {path}: removed")
        return 0
    from memwal_core.tools.archive_build import build

    path, took = build(force=a.force)
    print(f"JVM class archive {path}: " + (f"built in {took:.0f} s" if took else "already built (--force rebuilds)"))
    return 0


def cmd_spark_env(a) -> int:
    from memwal_core.spark import env as spark_env

    path, skipped = spark_env.pack_environment(a.output, exclude=a.exclude, force=a.force)
    alias = a.alias
    for f in skipped:
        say(f"left out (editable install; memwal_core is shipped with each job): {f}")
    print(f"packed {sys.prefix} into {path} ({path.stat().st_size / 1e6:.0f} MB). Spark settings "
          f"(spark.conf in memwal.yaml or defs.yaml, or --conf):\n"
          f"  spark.archives: {path}#{alias}\n"
          f"  spark.pyspark.python: ./{alias}/bin/python   # memwal's default when spark.archives has #{alias}\n"
          f"The nodes need Python {sys.version.split()[0]} installed at {sys.base_prefix} "
          "(the archive holds the packages, not the standard library).")
    return 0
