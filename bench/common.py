"""Shared helpers of the benchmark scripts: machine header, RESULT lines, timing, memory, moto.

Every script prints a `MACHINE ...` line first and its results as `RESULT <bench> k=v ...`
lines (one line, space-separated, no spaces inside values), so `grep ^RESULT` collects them.
The load average is printed with the machine and repeated on every RESULT line (`load1=`):
numbers taken with load1 well above the core count were measured on a busy machine.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# pylance logs "ERROR lance::index Index __lance_mem_wal has no fields" on every merge; keep
# real errors only (the CLI does the same).
os.environ.setdefault("LANCE_LOG", "error,lance::index=off")
BIN = os.path.dirname(sys.executable)

sys.path.insert(0, os.path.join(REPO, "tests"))
from support.s3_server import LocalS3  # noqa: E402  (the S3 test server: test tooling)

# ------------------------------------------------------------------------------ reporting

def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:  # noqa: BLE001
        return "?"


def _java() -> str:
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30).stderr
        first = out.splitlines()[0]
        return first.split('"')[1] if '"' in first else first.replace(" ", "_")
    except Exception:  # noqa: BLE001
        return "?"


def load1() -> float:
    return os.getloadavg()[0]


def machine() -> dict[str, Any]:
    return {"cores": os.cpu_count(), "arch": platform.machine(), "os": platform.system().lower(),
            "python": platform.python_version(), "pyspark": _version("pyspark"), "pylance": _version("pylance"),
            "pyarrow": _version("pyarrow"), "dagster": _version("dagster"), "java": _java(),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "load": ",".join(f"{x:.2f}" for x in os.getloadavg())}


def print_machine(bench: str, args: Any = None) -> None:
    m = machine()
    print(f"MACHINE bench={bench} " + " ".join(f"{k}={v}" for k, v in m.items()), flush=True)
    if args is not None:
        print(f"ARGS {vars(args) if hasattr(args, '__dict__') else args}", flush=True)
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print(f"NOTE load average {m['load']} exceeds {os.cpu_count()} cores: timings are noisy "
              "(measured under load)", flush=True)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v).replace(" ", "_")


def result(bench: str, **kv: Any) -> None:
    kv.setdefault("load1", round(load1(), 2))
    print(f"RESULT {bench} " + " ".join(f"{k}={fmt(v)}" for k, v in kv.items()), flush=True)


def say(msg: str) -> None:
    print(msg, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


@contextmanager
def timed(store: dict[str, float], key: str) -> Iterator[None]:
    """Accumulate wall seconds of the block under `key`."""
    t = time.perf_counter()
    try:
        yield
    finally:
        store[key] = store.get(key, 0.0) + time.perf_counter() - t


def workdir(prefix: str, base: str | None = None) -> str:
    return tempfile.mkdtemp(prefix=f"memwal-bench-{prefix}-", dir=base)


def dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


# ------------------------------------------------------------------------------ memory

def proc_status_kb(pid: int | str, field: str) -> int:
    """A `/proc/<pid>/status` field in kB (VmRSS, VmHWM), 0 when gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def self_peak_rss_mb() -> float:
    """Peak RSS of this process (ru_maxrss is in kB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _proc_cpu(pid: int, tick: float) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


class CpuMeter:
    """CPU seconds (user + system) used during the block by this process and every descendant
    (the Spark JVM and Python workers of an in-process session, a subprocess and its JVM).

    Descendants are sampled every `interval` s and each one counts with the last value seen, so
    a process that lives shorter than the interval can be missed. Less sensitive to a busy
    machine than wall time: compare contenders by both.
    """

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self.tick = os.sysconf("SC_CLK_TCK")
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.seconds = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self, initial: bool = False) -> None:
        for pid in descendants(os.getpid()):
            v = _proc_cpu(pid, self.tick)
            if v is None:
                continue
            if pid not in self.first:
                self.first[pid] = v if initial else 0.0
            self.last[pid] = v

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "CpuMeter":
        t = os.times()
        self._self0 = t.user + t.system
        self._sample(initial=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self._sample()
        t = os.times()
        own = t.user + t.system - self._self0
        self.seconds = own + sum(self.last[p] - self.first[p] for p in self.last)


class RssSampler:
    """Samples the RSS of this process's descendants (the Spark JVM, Python workers) in a thread.

    Reports the peak of the JVM (VmHWM, exact) and the peak of the summed RSS of the Python
    workers (sampled every `interval` s, so a short spike can be missed).
    """

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.workers_peak_kb = 0
        self.jvm_peak_kb = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RssSampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self._sample()

    def _sample(self) -> None:
        workers = 0
        for pid in descendants(os.getpid()):
            cl = cmdline(pid)
            if "java" in cl.split(" ")[0]:
                self.jvm_peak_kb = max(self.jvm_peak_kb, proc_status_kb(pid, "VmHWM"))
            elif "python" in cl:
                workers += proc_status_kb(pid, "VmRSS")
        self.workers_peak_kb = max(self.workers_peak_kb, workers)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()


# ------------------------------------------------------------------------------ Spark

def spark_session(master: str = "local[*]", conf: dict[str, str] | None = None):
    from memwal_core.spark.session import get_spark

    return get_spark(master, conf or {})


def warm_up_merge(spark, root: str) -> float:
    """A tiny merge on a throwaway table so the session's first-job costs are paid; seconds."""
    from memwal_core.jobs import merge
    from memwal_core.state.store import open_store
    from memwal_core.tools import demo

    path = os.path.join(root, "warmup")
    loc = open_store(path)
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    w = demo.Workload(loc, seed=7, key_space=100, max_memtable_rows=50)
    w.write_round(60, puts_per_batch=10)
    t = time.perf_counter()
    r = merge.merge(loc, spark)
    took = time.perf_counter() - t
    assert r.generations_merged and not r.region_errors, r.to_dict()
    shutil.rmtree(path, ignore_errors=True)
    return took


# ------------------------------------------------------------------------------ S3 (moto)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer(LocalS3):
    """`moto_server` on 127.0.0.1 on a free port, in a subprocess (memwal's own `LocalS3`),
    with the benchmarks' credentials."""

    def start(self, timeout: float = 60.0) -> "MotoServer":
        return super().start(timeout)

    def options(self) -> dict[str, str]:
        return {"aws_endpoint": self.endpoint, "allow_http": "true", "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing-secret", "aws_region": "us-east-1"}

    def bucket(self, name: str) -> str:
        from memwal_core.state.store import make_s3_client

        make_s3_client(self.options()).create_bucket(Bucket=name)
        return name
