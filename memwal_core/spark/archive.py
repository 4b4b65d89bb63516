"""A class-data-sharing (AppCDS) archive for Spark's driver JVM: local sessions start ~3 s sooner.

A Spark driver loads some 20,000 classes while starting and running its first job; on 2 cores
that is most of a cold `memwal maintain` (session + first job, measured alone: 11–13 s
without, 7.5–8.5 s with the archive; docs/benchmarks.md). Java 17 dumps the classes a run loaded into an archive
(`-XX:ArchiveClassesAtExit`) and maps it at the next start (`-XX:SharedArchiveFile`).

The JVM validates an archive itself (same JVM build, same class path) and silently runs without
one that does not match, so a stale or damaged archive costs nothing but disk (~150 MB). The
file name carries a key of the java binary and the pyspark version, so an upgrade gets a new one.

Built explicitly — `memwal spark-archive`, which `make` runs after installing — never as a side
effect of a merge: dumping costs ~15 s of CPU. `MEMWAL_SPARK_CDS=0` turns its use off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"  # no class-sharing warnings on the run's stderr


def java_binary() -> str | None:
    """The java Spark's launcher runs: $JAVA_HOME/bin/java, else java on PATH."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(java) if java and os.path.exists(java) else None


def archive_path(state_dir: str | os.PathLike | None = None) -> Path | None:
    """Where this installation's archive lives (whether or not it exists); None without java."""
    import pyspark

    java = java_binary()
    if java is None:
        return None
    jars = sorted(os.listdir(os.path.join(os.path.dirname(pyspark.__file__), "jars")))
    key = hashlib.sha256(f"{java}:{os.stat(java).st_mtime_ns}:{pyspark.__version__}:{jars}".encode()).hexdigest()[:16]
    state = Path(state_dir or os.environ.get("MEMWAL_STATE_DIR", Path.home() / ".memwal"))
    return state / "jvm" / f"spark-{pyspark.__version__}-{key}.jsa"


def java_options() -> str:
    """Driver JVM options that map the archive, or "" (none built, or disabled)."""
    if os.environ.get("MEMWAL_SPARK_CDS", "1") == "0":
        return ""
    try:
        path = archive_path()
    except Exception:  # noqa: BLE001 - an archive is an optimisation, never a reason to fail
        return ""
    return f"-XX:SharedArchiveFile={path} {QUIET}" if path is not None and path.is_file() else ""
