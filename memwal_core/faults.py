"""Crash points for the reliability suites: a process exits hard where a test says.

`MEMWAL_CRASH_AT=<name>` makes `point(name)` call `os._exit(137)`, like a kill -9 at that
line (no cleanup, no flush). `MEMWAL_CRASH_AFTER_OPS=<k>` makes a `CrashingStore` exit at its
k-th write to the object store. Both are inert unless those variables are set.
"""

from __future__ import annotations

import contextlib
import os

EXIT_CODE = 137


def point(name: str) -> None:
    if os.environ.get("MEMWAL_CRASH_AT") == name:
        os._exit(EXIT_CODE)


def commit_lock(name: str):
    """A Lance commit lock whose body is a crash point: data files written, manifest not yet."""

    @contextlib.contextmanager
    def lock(version: int):
        point(name)
        yield

    return lock if os.environ.get("MEMWAL_CRASH_AT") == name else None
