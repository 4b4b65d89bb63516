"""The table lease (memwal_core/state/lease.py) after its old records are pruned.

Pruning deletes old lease records. A token that was written and then pruned is absent again: a
holder that was paused past its TTL while the new holder renewed a few times (or ran a few short
steps) could write that pruned token as its "renewal", and a fence that only HEADs `token + 1`
finds a pruned token absent too: both maintainers would pass their fences and commit at once,
neither noticing (ABA on the token). So the lease lists for any later token instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memwal_core.options import LeaseOptions
from memwal_core.state import layout, lease, region, table
from memwal_core.state.store import open_store
from memwal_core.tools import demo

PROCS = Path(__file__).parent / "procs"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def test_a_paused_holder_cannot_commit_after_the_new_holder_renewed_past_pruning(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    w = demo.Workload(loc, seed=3, key_space=50, max_memtable_rows=10)
    w.write_round(40, puts_per_batch=10)
    ready, go = tmp_path / "ready", tmp_path / "go"
    p = subprocess.Popen([sys.executable, str(PROCS / "lease_holder.py"), loc.lance_uri, "2", "commit",
                          str(ready), str(go)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGSTOP)  # a paused process (VM pause, long GC, swapped out)
        taker = lease.acquire(loc, "index", LeaseOptions(ttl_seconds=30, wait_seconds=10))  # after the TTL
        for _ in range(20):  # the new holder renews (a 7-minute step at the default TTL: every 20 s)
            assert taker.renew()
    finally:
        os.kill(p.pid, signal.SIGCONT)
    time.sleep(2.0)  # the resumed holder's renewal thread beats before its main thread commits
    version = table.open_dataset(loc).version
    go.touch()
    out, _ = p.communicate(timeout=120)
    taker_ok = True
    try:
        taker.check()
    except lease.LeaseLost:
        taker_ok = False
    finally:
        taker.release()
    # The promise: at most one of the two may pass its fence and commit.
    both = out.startswith("committed") and taker_ok
    assert not both, (f"both maintainers passed their fences: paused holder said {out.strip()!r} "
                      f"(table version {version} -> {table.open_dataset(loc).version}), the new holder "
                      f"(token {taker.token}) still holds it")
