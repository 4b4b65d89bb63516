"""A long-lived local Spark Connect server, so sensor-triggered runs skip the JVM start.

Every Dagster run is a new process; with `spark.master = local[*]` each would start its own
JVM (~10 s here), which dominates a small merge. Pointing the table at `sc://127.0.0.1:PORT`
instead makes each run a thin client of one warm server: `ensure_server` starts it once
(pyspark ships `sbin/start-connect-server.sh`) and later runs find it listening.

A port is machine-wide, but a server runs the memwal code and Python of whoever started it:
its Python workers import that checkout's memwal_core. So the server carries its starter's
identity (`identity()`: version, code location, interpreter) in its conf, and a run of another
checkout or version that finds it listening refuses it (`check_identity`) instead of silently
running the other code.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

from memwal_core.errors import MemwalError
from memwal_core.spark import archive as jvm_archive


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


IDENTITY_KEY = "spark.memwal.server_identity"  # a spark.* key: the server keeps it (percent-encoded)


class ForeignConnectServer(MemwalError, RuntimeError):
    """The local Connect server on a table's port was started by another memwal (checkout or version)."""


def identity() -> str:
    """Who this memwal is, as far as a Connect server's workers are concerned: the version, the
    folder its code is imported from, and the interpreter (its packages)."""
    import memwal_core

    code = Path(memwal_core.__file__).resolve().parent.parent
    return f"memwal {memwal_core.__version__} at {code} (python {sys.executable})"


def check_identity(session, remote: str) -> None:
    """Refuse a server another memwal started: its workers would run that memwal's code, not this
    one's. A server that does not say who started it is one an operator runs (memwal starts
    none without its identity): used as it is."""
    have = session.conf.get(IDENTITY_KEY, None)
    have = unquote(have) if have else have
    mine = identity()
    if have and have != mine:
        raise ForeignConnectServer(
            f"the Spark Connect server at {remote} was started by {have}; this is {mine}. Its workers run the "
            "code of whoever started it: give this project its own spark.connect port, or stop that server "
            "(memwal spark-server stop --port PORT) and let this one start its own")


def spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def ensure_server(remote: str, *, master: str = "local[*]", conf: dict[str, str] | None = None,
                  state_dir: str | os.PathLike | None = None, timeout_s: float = 90.0) -> bool:
    """Start a local Connect server for `remote` (sc://127.0.0.1:PORT) unless one is listening.

    Returns True when this call started it. Only loopback addresses are started locally; a
    remote host must already run its own server.
    """
    url = urlparse(remote)
    host, port = url.hostname or "127.0.0.1", url.port or 15002
    if listening(host, port):
        return False
    if host not in ("127.0.0.1", "localhost"):
        raise ConnectionError(f"no Spark Connect server at {remote}, and it is not local to start one")
    state = Path(state_dir or os.environ.get("MEMWAL_STATE_DIR", Path.home() / ".memwal"))
    state.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SPARK_HOME": spark_home(), "PYSPARK_PYTHON": sys.executable,
           "SPARK_LOG_DIR": str(state / "spark-logs"), "SPARK_PID_DIR": str(state / "spark-pids"),
           "SPARK_IDENT_STRING": f"memwal-{port}"}
    args = ["bash", os.path.join(spark_home(), "sbin", "start-connect-server.sh"), "--master", master,
            "--conf", f"spark.connect.grpc.binding.port={port}",
            "--conf", "spark.sql.execution.arrow.pyspark.enabled=true",
            "--conf", f"spark.sql.shuffle.partitions={max(2, os.cpu_count() or 2)}",
            "--conf", "spark.ui.enabled=false", "--conf", f"{IDENTITY_KEY}={quote(identity(), safe='')}"]
    conf = dict(conf or {})
    archive = jvm_archive.java_options()  # the server's driver JVM starts sooner too
    if archive:
        conf["spark.driver.extraJavaOptions"] = f"{archive} {conf.get('spark.driver.extraJavaOptions', '')}".strip()
    for k, v in conf.items():
        args += ["--conf", f"{k}={v}"]
    # Two runs may race to start it: the loser's script exits non-zero ("running as process
    # N"), and it then simply waits for the winner's server like everyone else.
    started = subprocess.run(args, env=env, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if listening(host, port):
            return started.returncode == 0
        time.sleep(0.25)
    said = started.stdout.strip().splitlines()[-1:] if started.stdout else []
    raise TimeoutError(f"Spark Connect server on port {port} did not start within {timeout_s:.0f} s"
                       f"{': ' + said[0] if said else ''}; see {state / 'spark-logs'}")


def stop_server(remote: str, state_dir: str | os.PathLike | None = None) -> None:
    port = urlparse(remote).port or 15002
    state = Path(state_dir or os.environ.get("MEMWAL_STATE_DIR", Path.home() / ".memwal"))
    env = {**os.environ, "SPARK_HOME": spark_home(), "SPARK_PID_DIR": str(state / "spark-pids"),
           "SPARK_IDENT_STRING": f"memwal-{port}"}
    subprocess.run(["bash", os.path.join(spark_home(), "sbin", "stop-connect-server.sh")], env=env,
                   check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class ConnectConfMismatch(MemwalError, ValueError):
    """A table asks a running Connect server for settings it was not started with."""


def is_session_setting(session, key: str) -> bool:
    """memwal's own `memwal.*` settings and Spark's runtime SQL settings apply per Connect
    session; everything else (the master, executor/driver settings) is fixed at server start."""
    if key.startswith("memwal."):
        return True
    try:
        return bool(session.conf.isModifiable(key))
    except Exception:  # noqa: BLE001 - unknown to this server: treat as fixed
        return False


def apply_session_conf(session, remote: str, master: str | None, conf: dict[str, str]) -> None:
    """Give one Connect session (from `SparkSession.builder.remote(url).create()`, so its
    settings are its own) a table's Spark settings, and refuse loudly what cannot apply.

    A Connect server ignores non-`spark.` keys at start ("Ignoring non-Spark config
    property") and fixes its master and static conf for its lifetime, so two tables sharing a
    `connect` URL would otherwise silently share the first one's settings. Per-session settings
    are set here; a fixed setting (or master) that differs from the running server's is an
    error naming both values (give the table its own `connect` port, or restart the server).
    """
    wrong = []
    for key, want in conf.items():
        if is_session_setting(session, key):
            session.conf.set(key, want)
            continue
        have = session.conf.get(key, None)
        # memwal prepends its JVM archive option to the driver's Java options at start.
        if have != want and not (key.endswith("extraJavaOptions") and have and have.endswith(want)):
            wrong.append(f"{key}={want!r} (server: {have!r})")
    if master:
        have = session.conf.get("spark.master", None)
        if have is not None and have != master:
            wrong.append(f"spark.master={master!r} (server: {have!r})")
    if wrong:
        raise ConnectConfMismatch(
            f"Spark Connect server {remote} was started with other settings than this table asks for: "
            f"{', '.join(wrong)}. These are fixed while the server runs: give the table its own "
            f"spark.connect port, use the same settings, or restart the server (memwal spark-server stop).")


def server_conf(conf: dict[str, str]) -> dict[str, str]:
    """The settings passed to a server at start (memwal.* are per session; the server drops them)."""
    return {k: v for k, v in conf.items() if not k.startswith("memwal.")}
