"""The scripts under tests/procs/ (each runs as its own process) and how the tests start them."""

from __future__ import annotations

import os
import subprocess
import sys

PROCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "procs")


def spawn(args: list[str], log: str) -> subprocess.Popen:
    """`python args...` with its output in `log`, without the parent's MEMWAL_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMWAL_")}
    return subprocess.Popen([sys.executable, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
