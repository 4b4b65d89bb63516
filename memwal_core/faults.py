"""Crash points for the reliability suites: a process exits hard where a test says.

`MEMWAL_CRASH_AT=<name>` makes `point(name)` call `os._exit(137)`, like a kill -9 at that
line (no cleanup, no flush); `MEMWAL_PAUSE_AT=<name>` makes it print `memwal paused at <name>`
to stderr and sleep there (a test interrupts the process at a known line). `MEMWAL_CRASH_AFTER_OPS=<k>` makes the process exit right
before its k-th *write*: `open_store` then wraps the store in a `CrashingStore`, which counts
`put`, `put_if_absent` and `delete_many`, and the Lance commit points (`commit_lock`,
`op`) count too. `MEMWAL_CRASH_TORN=1` makes a `delete_many` of two keys or more that is the
k-th write delete its first half before exiting (a batch cut short, as a killed S3
`delete_objects` or a local loop leaves it). `MEMWAL_COUNT_OPS=1` counts without crashing,
so a test can learn how many writes a job does (`ops()`). `MEMWAL_CRASH_SIGNAL=1` makes every
crash a real SIGKILL of the process instead (returncode -9), so a parent can tell a crash from a
job that exited with an error of its own. All of this is inert unless those variables are set.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Iterable

EXIT_CODE = 137


def _die() -> None:
    if os.environ.get("MEMWAL_CRASH_SIGNAL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(EXIT_CODE)

_lock = threading.Lock()
_ops: list[str] = []


def point(name: str) -> None:
    if os.environ.get("MEMWAL_CRASH_AT") == name:
        _die()
    if os.environ.get("MEMWAL_PAUSE_AT") == name:
        os.write(2, f"memwal paused at {name}\n".encode())
        deadline = time.monotonic() + float(os.environ.get("MEMWAL_PAUSE_SECONDS", "60"))
        while time.monotonic() < deadline:
            time.sleep(0.05)


def _crash_after() -> int | None:
    raw = os.environ.get("MEMWAL_CRASH_AFTER_OPS", "").strip()
    return int(raw) if raw else None


def counting() -> bool:
    """True when writes are counted (a crash after k writes is armed, or counting was asked for)."""
    return bool(os.environ.get("MEMWAL_COUNT_OPS")) or _crash_after() is not None


def ops() -> list[str]:
    """The writes counted so far in this process, in order (kind and key)."""
    with _lock:
        return list(_ops)


def op(kind: str, torn: Callable[[], None] | None = None) -> None:
    """Count one write; exit before it when it is the k-th (after `torn()` if torn mode is on)."""
    if not counting():
        return
    with _lock:
        _ops.append(kind)
        n = len(_ops)
        crash = n == _crash_after()
    if crash:
        if torn is not None and os.environ.get("MEMWAL_CRASH_TORN"):
            torn()
            kind += " (torn: first half deleted)"
        os.write(2, f"memwal crash before write {n}: {kind}\n".encode())
        _die()


def commit_lock(name: str):
    """A Lance commit lock whose body is a crash point: data files written, manifest not yet.

    Also a counted write when writes are counted. None (no lock) when nothing is armed, and
    it must stay so outside crash tests: Lance commits through a lock as HEAD-then-put of the
    manifest, which overwrites a concurrent commit made without one (`state/exclusive_commit.py`).
    """
    crash_here = os.environ.get("MEMWAL_CRASH_AT") == name
    if not (crash_here or counting()):
        return None

    @contextlib.contextmanager
    def lock(version: int):
        point(name)
        op(f"lance_commit {name} v{version}")
        yield

    return lock


def raw_store(store):
    """The store under a `CrashingStore` (else `store`): for the writes memwal makes on Lance's
    behalf (a commit's transaction and manifest files), which count as the one Lance commit
    point (`op`) the job names, as Lance's own writes do."""
    return store._inner if isinstance(store, CrashingStore) else store


class CrashingStore:
    """An object store that counts its writes and exits before the k-th (see module docstring).

    Reads pass straight through; any other attribute (`root`, `stats`, ...) is the inner store's.
    Writes under an `uncounted` prefix (the table lease's records: bookkeeping around a job whose
    number varies with pruning) are neither counted nor crashed at, so the k-th write is the
    same write on every run.
    """

    def __init__(self, inner, uncounted: tuple[str, ...] = ()):
        self._inner = inner
        self._uncounted = uncounted

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def put(self, key: str, data: bytes) -> None:
        if not key.startswith(self._uncounted or ("\0",)):
            op(f"put {key}")
        return self._inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if not key.startswith(self._uncounted or ("\0",)):
            op(f"put_if_absent {key}")
        return self._inner.put_if_absent(key, data)

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        if keys and self._uncounted and all(k.startswith(self._uncounted) for k in keys):
            return self._inner.delete_many(keys)
        first = keys[0] if keys else ""
        half = keys[: len(keys) // 2]
        op(f"delete_many {len(keys)} keys from {first}",
           torn=(lambda: self._inner.delete_many(half)) if len(keys) >= 2 else None)
        return self._inner.delete_many(keys)
