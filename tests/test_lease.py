"""The table lease (memwal_core/state/lease.py), on local disk and on S3 (moto).

Real stores, real processes: a holder that is SIGSTOPped past its TTL (a paused process) is
taken over and its commit refused; a holder that died is taken over at once; N threads as N
holders never overlap.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from memwal_core.jobs import snapshot
from memwal_core.options import LeaseOptions
from memwal_core.state import layout, lease, region, table
from memwal_core.state.store import LocalStore, StoreError, TableLocation, open_store
from memwal_core.tools import demo

PROCS = Path(__file__).parent / "procs"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def _records(loc) -> list[int]:
    return sorted(t for o in loc.store.list(layout.LEASE_DIR) if (t := layout.lease_token_of(o.key)))


def test_acquire_release_and_tokens_grow(loc):
    a = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=30, wait_seconds=0))
    assert lease.newest(loc).holder == a.record.holder and not lease.newest(loc).released
    a.check()
    first = a.token
    a.release()
    assert lease.newest(loc).released and lease.newest(loc).token == first + 1  # the release is the next token
    assert a.token == first + 1
    b = lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=30, wait_seconds=0))
    assert b.token == a.token + 1 and b.record.holder != a.record.holder
    b.release()
    for _ in range(15):
        lease.acquire(loc, "x", LeaseOptions(ttl_seconds=30, wait_seconds=0)).release()
    assert len(_records(loc)) <= lease.KEEP_RECORDS, _records(loc)  # bounded
    assert max(_records(loc)) == lease.newest(loc).token  # the newest is never pruned


def test_a_disabled_lease_covers_the_entry_points_called_inside(tmp_path):
    """`lease: {enabled: false}` reaches the whole step: GC's `run_gc` runs the decorated
    `execute_gc` inside, which takes no lease either (no record written), while another
    process's lease would not stop it; without the option the same call takes the lease."""
    from memwal_core.jobs import gc

    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=5)
    held = lease.acquire(loc, "other maintainer", LeaseOptions(ttl_seconds=30, wait_seconds=0))
    gc.run_gc(loc, gc.GcOptions(), lease=LeaseOptions(enabled=False, wait_seconds=0))
    assert _records(loc) == [held.token]  # nothing acquired, nothing waited for
    held.release()
    gc.run_gc(loc, gc.GcOptions())
    assert max(_records(loc)) > held.token


def test_a_held_lease_is_waited_for_then_skipped_with_holder_and_time(loc):
    a = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=30, wait_seconds=0), run_id="run-a")
    t0 = time.monotonic()
    with pytest.raises(lease.LeaseHeld) as e:
        lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=30, wait_seconds=1.0))
    assert 0.9 < time.monotonic() - t0 < 5
    msg = str(e.value)
    assert msg.startswith("gc skipped: table ") and "held by" in msg and f"pid {os.getpid()}" in msg
    assert "(merge, run run-a) until 20" in msg and "UTC" in msg
    # Released while the other waits: it gets the lease.
    threading.Timer(0.5, a.release).start()
    b = lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=30, wait_seconds=10))
    assert b.token > a.token
    b.release()


def test_heartbeat_keeps_a_lease_past_its_ttl(loc):
    # A 3 s TTL: a renewal (every 1 s) may be late by ~1 s on a loaded machine (the suite runs
    # in parallel processes beside moto) before the fence's margin (TTL/4) refuses.
    a = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=3, wait_seconds=0))
    time.sleep(7)  # > 2 TTLs
    a.check()
    assert a.token > 2
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=3, wait_seconds=0))
    a.release()


def test_expired_holder_is_taken_over_and_fenced(loc):
    """A holder that stopped renewing (its heartbeat stopped, as in a long pause) is taken over
    after its TTL; its fence then refuses, its renewal fails, its release writes nothing."""
    a = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=1, wait_seconds=0))
    a._stop.set()  # no more renewals: the pause
    a._thread.join()
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=1, wait_seconds=0))
    b = lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=30, wait_seconds=3))
    with pytest.raises(lease.LeaseLost, match="no longer held"):
        a.check("merge commit")
    assert a.renew() is False
    a._stop.clear()
    a.release()
    assert lease.newest(loc).holder == b.record.holder and not lease.newest(loc).released
    b.check()
    b.release()


def test_a_fresh_lease_is_fenced_by_a_later_token(loc):
    """Even unexpired, a holder whose token is no longer the newest is refused (someone broke
    the lease: a clock far ahead, an operator)."""
    a = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=30, wait_seconds=0))
    rec = lease.LeaseRecord(a.token + 1, lease.Holder.me("intruder"), "gc", time.time(), time.time() + 30)
    assert loc.store.put_if_absent(layout.lease_key(rec.token), rec.encode())
    with pytest.raises(lease.LeaseLost, match=f"token {a.token + 1}"):
        a.check()
    a.release()
    assert lease.newest(loc).token == rec.token  # the intruder's record stands


def test_hold_reenters_in_its_thread_and_fence_finds_it(loc):
    opts = LeaseOptions(ttl_seconds=30, wait_seconds=0)
    lease.fence(loc)  # nothing held: no-op
    with lease.hold(loc, "maintain", opts) as outer:
        with lease.hold(loc, "gc", opts) as inner:
            assert inner is outer
        assert lease.held(loc) is outer
        seen = []
        t = threading.Thread(target=lambda: seen.append(lease.held(loc)))
        t.start()
        t.join()
        assert seen == [outer]  # a worker thread fences through the same lease
        lease.fence(loc)
    assert lease.held(loc) is None and lease.newest(loc).released
    with lease.hold(loc, "gc", LeaseOptions(enabled=False)) as none:
        assert none is None and lease.newest(loc).released


def test_threads_as_holders_never_overlap(loc):
    """8 holders (threads, each its own acquisition) race for the lease 40 times in all: at most
    one is inside at any moment, and every acquisition gets a greater token."""
    inside, peak, tokens, errors = [0], [0], [], []
    mu = threading.Lock()

    def worker():
        for _ in range(5):
            try:
                a = lease.acquire(loc, "w", LeaseOptions(ttl_seconds=30, wait_seconds=60))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return
            with mu:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
                tokens.append(a.token)
            time.sleep(0.01)
            with mu:
                inside[0] -= 1
            a.release()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and peak[0] == 1 and len(tokens) == 40 and len(set(tokens)) == 40


class _DownStore(LocalStore):
    """The store answering nothing but errors for writes (a server that went away)."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        raise StoreError(f"S3 put_if_absent on {key} failed: Could not connect to the endpoint URL")


def test_a_release_that_never_reached_the_store_is_taken_back_by_its_process(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    a = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=600, wait_seconds=0))
    down = TableLocation(_DownStore(loc.store.root), loc.lance_uri, {})
    a.loc = down  # the store goes away before the release
    a.release()
    assert not lease.newest(loc).released  # still held for everyone else, for 10 minutes
    b = lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=30, wait_seconds=0))  # this process: at once
    assert b.token == a.token + 1
    # ... while a live acquisition of this process is never taken over by it.
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=30, wait_seconds=0))
    b.release()


def test_a_dead_holder_on_this_machine_is_taken_over_at_once(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    ready = tmp_path / "ready"
    subprocess.run([sys.executable, str(PROCS / "lease_holder.py"), loc.lance_uri, "600", "exit", str(ready)],
                   env=ENV, check=True, timeout=60)
    assert not lease.newest(loc).released  # it died holding a 10-minute lease
    t0 = time.monotonic()
    b = lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=30, wait_seconds=0))
    assert time.monotonic() - t0 < 2
    b.release()


def test_a_paused_holder_is_taken_over_and_its_commit_refused(loc, tmp_path):
    """A real process holds the lease (TTL 2 s) and is SIGSTOPped; another maintainer takes the
    lease over after the TTL; the holder resumes and runs the MemWAL index builder: the fence
    refuses its commits, and neither the table nor any region manifest changes."""
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    w = demo.Workload(loc, seed=3, key_space=50, max_memtable_rows=10)
    w.write_round(40, puts_per_batch=10)
    ready, go = tmp_path / "ready", tmp_path / "go"
    p = subprocess.Popen([sys.executable, str(PROCS / "lease_holder.py"), loc.lance_uri, "2", "commit",
                          str(ready), str(go), *(f"{k}={v}" for k, v in loc.storage_options.items())],
                         env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGSTOP)
        taker = lease.acquire(loc, "index", LeaseOptions(ttl_seconds=30, wait_seconds=10))  # after the TTL
    finally:
        os.kill(p.pid, signal.SIGCONT)
    version = table.open_dataset(loc).version
    manifests = {rid: region.load_latest(loc.store, rid).version for rid in region.list_regions(loc.store).region_ids}
    go.touch()
    out, _ = p.communicate(timeout=120)
    assert out.startswith("refused: "), out
    assert "no longer held" in out
    assert table.open_dataset(loc).version == version
    assert {rid: region.load_latest(loc.store, rid).version for rid in manifests} == manifests
    taker.check()
    taker.release()
    # The lease works on: the builder commits under a fresh lease.
    snapshot.build_snapshot(loc, lease=LeaseOptions(ttl_seconds=30, wait_seconds=5))
    assert table.open_dataset(loc).version == version + 1


def test_memwal_maintain_skips_the_steps_of_a_held_table_and_says_by_whom(tmp_path):
    """The CLI (Dagster assets in process) while another maintainer holds the lease: each step
    waits `--lease-wait`, then is skipped with holder and time; not a failure (exit 0); nothing
    committed. Once released, the same command commits."""
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
    demo.Workload(loc, seed=5, key_space=40, max_memtable_rows=10).write_round(30, puts_per_batch=10)
    version = table.open_dataset(loc).version
    cmd = [sys.executable, "-m", "memwal_pipeline.cli", "maintain", loc.lance_uri, "--only", "index,gc",
           "--lease-wait", "1"]
    other = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=120, wait_seconds=0), run_id="other-run")
    try:
        p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        other.release()
    assert p.returncode == 0, p.stderr[-3000:]
    for step in ("index", "gc"):
        assert f"[t] {step} skipped: lease held by " in p.stderr, p.stderr
    assert f"pid {os.getpid()} (merge, run other-run) until " in p.stderr
    assert table.open_dataset(loc).version == version
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "skipped" not in p.stderr, p.stderr[-3000:]
    assert table.open_dataset(loc).version == version + 1  # the index builder's snapshot


@pytest.mark.parametrize("offset", [30.0, -30.0])
def test_a_host_whose_clock_is_off_the_stores_gives_the_lease_back(loc, monkeypatch, offset):
    """Expiry times are written in the writer's clock and read in the reader's: a host 30 s
    off the store's clock (more than a quarter of the 60 s TTL) is refused with the skew, which
    way, and the fix; the record it had written is released, so a host with a good clock takes
    the lease at once instead of after the TTL."""
    real = time.time
    monkeypatch.setattr(lease, "_now", lambda: real() + offset)
    with pytest.raises(lease.ClockSkew) as e:
        lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=60, wait_seconds=0))
    msg = str(e.value)
    assert "merge refused" in msg and ("ahead of" if offset > 0 else "behind") in msg
    assert "NTP" in msg and "lease.ttl_seconds" in msg
    assert re.search(r"clock is (29|30|31)\.\d s", msg), msg  # S3 keeps seconds: within a second
    assert lease.newest(loc).released
    monkeypatch.setattr(lease, "_now", real)
    good = lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=60, wait_seconds=0))
    good.check()
    good.release()


def test_a_clock_that_jumps_while_holding_loses_the_lease_at_the_next_renewal(loc, monkeypatch):
    """The clock is checked on every renewal too: a host whose clock jumped 20 s after it took
    the lease (max skew 2.25 s at a 9 s TTL) loses it, and the fence then refuses the commit
    naming the clock, not a vague expiry."""
    a = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=9, wait_seconds=0))
    try:
        a.check()
        real = time.time
        monkeypatch.setattr(lease, "_now", lambda: real() - 20)
        assert a.renew() is False
        with pytest.raises(lease.LeaseLost, match=r"clock is (19|20|21)\.\d s behind the store's clock"):
            a.check()
    finally:
        a.release()


def test_a_small_skew_within_a_quarter_ttl_is_accepted(loc, monkeypatch):
    """A few seconds of skew (here 3 s, the bound being 15 s at the default TTL) is normal
    between hosts and must not refuse anything."""
    real = time.time
    monkeypatch.setattr(lease, "_now", lambda: real() + 3)
    a = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=60, wait_seconds=0))
    assert a.renew() is True
    a.check()
    a.release()
