"""A real Spark standalone cluster on loopback: one master and one worker started from
pyspark's own `bin/spark-class`, in a temporary directory, stopped by PID.

Used by tests/test_cluster.py (as a fixture) and by `bench/merge.py --start-cluster`. Every
address is 127.0.0.1 (SPARK_LOCAL_IP), ports are free ports picked here, the master's and the
worker's logs, the worker's work dir (one directory per application, with each executor's
stdout/stderr) and the event log all live under `root`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


class StandaloneCluster:
    """`start()` returns once the worker has registered with the master; `stop()` ends both
    JVMs (SIGTERM, then SIGKILL) by the PIDs this object started."""

    def __init__(self, root: str | os.PathLike | None = None, cores: int = 2, memory: str = "2g"):
        self.root = Path(root or tempfile.mkdtemp(prefix="memwal-cluster-"))
        self.cores, self.memory = cores, memory
        self.port = self.web_port = self.worker_port = self.worker_web_port = 0
        self.procs: list[subprocess.Popen] = []
        self.work_dir = self.root / "work"
        self.event_log_dir = self.root / "events"
        self.log_dir = self.root / "logs"

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        # A node's environment, not the test's: no PYTHONPATH or PYSPARK_PYTHON pointing at
        # this checkout, so the executors get their Python and memwal_core from the application.
        base = {k: v for k, v in os.environ.items()
                if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")}
        return {**base, "SPARK_HOME": spark_home(), "SPARK_LOCAL_IP": "127.0.0.1",
                "SPARK_LOG_DIR": str(self.log_dir), "SPARK_WORKER_DIR": str(self.work_dir),
                # The worker's own (not the tasks') Python: whatever `python3` is on PATH, as on
                # a real node; the executors' Python is the application's choice.
                "SPARK_NO_DAEMONIZE": "1"}

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.out", "wb")
        cls = os.path.join(spark_home(), "bin", "spark-class")
        # spark-class ends in `exec java ...`, so the PID is the JVM's.
        p = subprocess.Popen([cls, *args], env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()
        self.procs.append(p)
        return p

    def start(self, timeout_s: float = 120.0) -> "StandaloneCluster":
        for d in (self.work_dir, self.event_log_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.port, self.web_port, self.worker_port, self.worker_web_port = (free_port() for _ in range(4))
        try:
            self._spawn("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                        "--port", str(self.port), "--webui-port", str(self.web_port))
            self._wait(lambda: self._listening(self.port), "the master to listen", timeout_s)
            self._spawn("worker", "org.apache.spark.deploy.worker.Worker", self.master_url,
                        "--host", "127.0.0.1", "--port", str(self.worker_port),
                        "--webui-port", str(self.worker_web_port), "--cores", str(self.cores),
                        "--memory", self.memory, "--work-dir", str(self.work_dir))
            self._wait(self._worker_registered, "the worker to register", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _listening(self, port: int) -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def _worker_registered(self) -> bool:
        log = self.log_dir / "worker.out"
        return log.exists() and b"Successfully registered with master" in log.read_bytes()

    def _wait(self, ready, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"Spark standalone JVM exited ({dead[0].returncode}) waiting for {what}: "
                                   f"{self.tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}: {self.tail()}")

    def tail(self, lines: int = 20) -> str:
        out = []
        for name in ("master", "worker"):
            p = self.log_dir / f"{name}.out"
            if p.exists():
                out.append(f"--- {name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def conf(self) -> dict[str, str]:
        """Session settings for an application on this cluster: event log under `root`, and
        at most the worker's cores and a modest executor memory (2 cores, small data)."""
        return {"spark.eventLog.enabled": "true", "spark.eventLog.dir": f"file://{self.event_log_dir}",
                # One plain JSON-lines file per application (Spark 4 defaults: rolling, zstd).
                "spark.eventLog.rolling.enabled": "false", "spark.eventLog.compress": "false",
                "spark.executor.memory": "1g", "spark.cores.max": str(self.cores)}

    def app_dirs(self) -> list[Path]:
        return sorted(p for p in self.work_dir.glob("app-*") if p.is_dir())

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)
        self.procs.clear()

    def __enter__(self) -> "StandaloneCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # python tests/support/cluster.py: start one, print its URL, stop on Ctrl-C
    with StandaloneCluster() as c:
        print(c.master_url, c.root, flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    sys.exit(0)
