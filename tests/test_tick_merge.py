"""Merging in the sensor's tick (`memwal_pipeline/sensor/tick_merge.py`) against a real Spark
Connect server and a real Dagster instance: a small merge runs in the tick and is recorded as
base_table materializations with no run; without a server, or over the limit, the tick
requests the merge run as before (`why_not`); a lease another maintainer holds is waited for,
and only one held past the wait sends the merge to a run; a tick killed inside its merge loses
nothing. One Connect server serves the module."""

from __future__ import annotations

import json
import os
import socket
import signal
import subprocess
import sys
import time

import pytest

from support.tables import make_table, rows

from memwal_core.observe import reader
from memwal_core.options import LeaseOptions, SensorOptions, SparkOptions
from memwal_core.spark import connect as spark_connect
from memwal_core.state import lease, table
from memwal_pipeline.config import TableConfig
from memwal_pipeline.sensor import decide, tick_merge

PROC = os.path.join(os.path.dirname(__file__), "procs", "tick_merge.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(uri: str, remote: str, home, limit: int = 64, lease_wait: float | None = None,
           env: dict | None = None) -> subprocess.Popen:
    """A tick in its own process; the instance (and cursor) live in `home`, the Connect server's
    records in the `state` directory beside it."""
    extra = [] if lease_wait is None else [str(lease_wait)]
    env = {**os.environ, "MEMWAL_STATE_DIR": str(home.parent / "state"), **(env or {})}
    return subprocess.Popen([sys.executable, PROC, uri, remote, str(home), str(limit), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _tick(uri: str, remote: str, home, limit: int = 64, lease_wait: float | None = None) -> dict:
    return _result(_start(uri, remote, home, limit, lease_wait))


class CodeServer:
    """A tick process that lives on between ticks, as the code server does (its Connect session
    kept warm): `send()` starts a tick, `result()` waits for what it did."""

    def __init__(self, uri: str, remote: str, home, limit: int = 64) -> None:
        self.stderr = home.parent / f"{home.name}.stderr"
        env = {**os.environ, "MEMWAL_STATE_DIR": str(home.parent / "state"), "MEMWAL_TEST_TICK_SERVE": "1"}
        with open(self.stderr, "w") as err:
            self.p = subprocess.Popen([sys.executable, PROC, uri, remote, str(home), str(limit)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)

    def send(self, lease_wait: float | None = None) -> None:
        self.p.stdin.write(json.dumps({} if lease_wait is None else {"lease_wait": lease_wait}) + "\n")
        self.p.stdin.flush()

    def result(self) -> dict:
        line = self.p.stdout.readline()
        assert line, f"the tick process died ({self.p.wait()}): {self.stderr.read_text()[-3000:]}"
        return json.loads(line)

    def tick(self, lease_wait: float | None = None) -> dict:
        self.send(lease_wait)
        return self.result()

    def close(self) -> None:
        self.p.stdin.close()
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One Spark Connect server for the module: (its URL, the directory holding `state` and the
    instances' homes)."""
    base = tmp_path_factory.mktemp("tick")
    remote = f"sc://127.0.0.1:{_port()}"
    assert spark_connect.ensure_server(remote, master="local[1]", state_dir=base / "state", timeout_s=600)
    try:
        yield remote, base
    finally:
        spark_connect.stop_server(remote, state_dir=base / "state")


def _home(base, name: str):
    home = base / name
    home.mkdir()
    return home


def _merge_requests(res: dict) -> list:
    return [r for r in res["requests"] if r["job"] == "t_merge"]


def test_a_small_merge_runs_in_the_tick_on_the_connect_server(table_loc, tmp_path, server):
    remote, base = server
    w = make_table(table_loc, regions=2, rounds=1)
    regions = sorted(w.regions.values())
    # No server at the table's URL: the tick never starts a JVM; the merge run does (here: nobody).
    first = _tick(table_loc.lance_uri, f"sc://127.0.0.1:{_port()}", _home(tmp_path, "home"))
    assert len(_merge_requests(first)) == 1 and first["merged_in_tick"] == []
    assert table.read_memwal_state(table_loc).merged == {}
    server_proc = CodeServer(table_loc.lance_uri, remote, _home(base, "small"))
    try:
        res = server_proc.tick()
        assert _merge_requests(res) == [], res
        assert res["merged_in_tick"] == regions and res["merged_by"] == [tick_merge.MERGED_BY]
        assert res["recorded"] == regions  # stored as materializations of base_table's partitions
        assert rows(table_loc) == w.expected()
        # The next flushes: merged by the next tick; the one after requests maintenance.
        w.write_round(60, overwrite=0.3, delete=0.05, puts_per_batch=10)
        res = server_proc.tick()
        assert _merge_requests(res) == [] and res["merged_in_tick"]
        assert rows(table_loc) == w.expected()
        res = server_proc.tick()
        assert [r["job"] for r in res["requests"]] == ["t_maintenance"]
        # Another maintainer (a maintenance run) holds the table's lease for a few seconds, longer
        # than the sensor's interval: the tick waits for it and merges on its warm session.
        w.write_round(60, overwrite=0.3, delete=0.05, puts_per_batch=10)
        with lease.hold(table_loc, "compact", LeaseOptions(), run_id="a maintenance run"):
            server_proc.send()
            time.sleep(6)  # the tick waits: longer than a sensor interval (5 s), within its 20 s wait
        res = server_proc.result()
        assert _merge_requests(res) == [] and res["merged_in_tick"], res
        assert rows(table_loc) == w.expected()
        # Held past the tick's wait (`lease.wait_seconds`, here 3 s): the tick's merge is skipped
        # and the merge run is requested, as without merges in the tick.
        w.write_round(60, overwrite=0.3, delete=0.05, puts_per_batch=10)
        before = table.read_memwal_state(table_loc).merged
        with lease.hold(table_loc, "merge", LeaseOptions(), run_id="another maintainer"):
            res = server_proc.tick(lease_wait=3)
        assert len(_merge_requests(res)) == 1 and res["merged_in_tick"] == []
        assert table.read_memwal_state(table_loc).merged == before
    finally:
        server_proc.close()


def test_a_tick_killed_inside_its_merge_loses_nothing(table_loc, server):
    """The code server dies (SIGKILL) at the first, a middle and the last write of a tick's
    merge: every read stays right, progress never goes back, and the next tick (the dead
    holder's lease taken over at once) merges the rest in the tick, with no run."""
    remote, base = server
    home = _home(base, "killed")
    w = make_table(table_loc, regions=2, rounds=1)
    counted = _result(_start(table_loc.lance_uri, remote, home, env={"MEMWAL_COUNT_OPS": "1"}))
    assert counted["merged_in_tick"] and rows(table_loc) == w.expected()
    n = len(counted["ops"])
    assert n >= 2, counted["ops"]
    restarted = None  # the code server started again after the first kill, living on
    try:
        for k in sorted({1, (n + 1) // 2, n}):
            w.write_round(60, overwrite=0.3, delete=0.05, puts_per_batch=10)
            before = table.read_memwal_state(table_loc).merged
            p = _start(table_loc.lance_uri, remote, home,
                       env={"MEMWAL_CRASH_AFTER_OPS": str(k), "MEMWAL_CRASH_SIGNAL": "1"})
            _, err = p.communicate(timeout=600)
            assert p.returncode == -signal.SIGKILL, f"write {k} of {n}: not killed there: {err[-3000:]}"
            after = table.read_memwal_state(table_loc).merged
            assert all(after.get(r, 0) >= g for r, g in before.items()), f"write {k}: progress went back"
            assert {r["id"]: r for r in reader.lsm_table(table_loc).to_pylist()} == w.expected(), f"write {k}"
            restarted = restarted or CodeServer(table_loc.lance_uri, remote, home)
            res = restarted.tick()
            assert _merge_requests(res) == [], f"write {k}: {res}"
            assert rows(table_loc) == w.expected(), f"write {k}: the next tick did not merge everything"
    finally:
        if restarted is not None:
            restarted.close()


def test_why_not_names_what_sends_a_merge_to_a_run(tmp_path):
    """No server, no Connect, or too many generations: a run (checked without a server)."""
    request = decide.MergeRequest((decide.Merge("r1", top=11, merged=2, attempt=1),), "e")
    port = _port()
    connect = TableConfig(name="t", uri=str(tmp_path), spark=SparkOptions(connect=f"sc://127.0.0.1:{port}"))
    assert "no Spark Connect server listening" in tick_merge.why_not(connect, request)
    local = TableConfig(name="t", uri=str(tmp_path), spark=SparkOptions(master="local[1]"))
    assert "not a Connect server" in tick_merge.why_not(local, request)
    off = TableConfig(name="t", uri=str(tmp_path), spark=SparkOptions(connect=f"sc://127.0.0.1:{port}"),
                      sensor=SensorOptions(tick_merge_max_generations=0))
    assert "off" in tick_merge.why_not(off, request)
    with socket.socket() as s:  # something listening on the port: only the size decides
        s.bind(("127.0.0.1", port))
        s.listen()
        small = TableConfig(name="t", uri=str(tmp_path), spark=SparkOptions(connect=f"sc://127.0.0.1:{port}"),
                            sensor=SensorOptions(tick_merge_max_generations=8))
        assert "9 generations pending, more than sensor.tick_merge_max_generations = 8" in tick_merge.why_not(small, request)
        few = decide.MergeRequest((decide.Merge("r1", 4, 2, 1),), "e")
        assert tick_merge.why_not(small, few) is None
        # A merge an earlier tick started still runs in this process: neither a merge nor a run.
        tick_merge._RUNNING.add("t")
        try:
            tm = tick_merge.merge_in_tick(small, None, few, holder="test")
        finally:
            tick_merge._RUNNING.discard("t")
        assert tm.busy and tm.outcome is None and not tm.clean and "still running" in tm.reason
