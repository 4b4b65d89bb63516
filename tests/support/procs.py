"""The scripts under tests/procs/ (each runs as its own process) and how the tests start them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Iterator

PROCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "procs")


def spawn(args: list[str], log: str) -> subprocess.Popen:
    """`python args...` with its output in `log`, without the parent's MEMWAL_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMWAL_")}
    return subprocess.Popen([sys.executable, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


@contextlib.contextmanager
def reaped(procs: list[subprocess.Popen]) -> Iterator[list[subprocess.Popen]]:
    """`procs`, killed and waited for if still running when the block ends (a failed assertion
    must not leave a test's processes behind)."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
