"""A local Spark Connect server runs the code of the memwal that started it: a run of another
checkout (or version) that finds it on its port refuses it, naming both, instead of merging with
the other checkout's code. Real server (pyspark's start script), real Connect clients."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

from memwal_core.spark import connect

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROC = os.path.join(os.path.dirname(__file__), "procs", "connect_identity.py")


def _client(remote: str, code_root: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": code_root}
    return subprocess.run([sys.executable, PROC, remote], env=env, cwd=code_root, capture_output=True, text=True,
                          timeout=300)


def test_a_server_of_another_checkout_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = f"sc://127.0.0.1:{port}"
    other = tmp_path / "other-checkout"
    shutil.copytree(os.path.join(REPO, "memwal_core"), other / "memwal_core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    state = tmp_path / "state"
    try:
        assert connect.ensure_server(remote, master="local[1]", state_dir=state)
        mine = _client(remote, REPO)
        assert mine.returncode == 0, mine.stderr[-3000:]
        assert mine.stdout.strip() == connect.identity() and f"at {REPO} " in connect.identity()

        theirs = _client(remote, str(other))
        assert theirs.returncode == 3, theirs.stderr[-3000:]
        said = theirs.stderr.strip().splitlines()[-1]
        assert f"started by {connect.identity()}" in said and f"at {other} " in said, said
        assert "own spark.connect port" in said
        # ensure_server of the other checkout finds the port taken: it starts nothing
        assert not connect.ensure_server(remote, master="local[1]", state_dir=state)
    finally:
        connect.stop_server(remote, state_dir=state)
