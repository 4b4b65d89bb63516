"""`dagster-webserver` on 127.0.0.1 in its own process group, serving this checkout's
workspace.yaml, with a GraphQL client and a bounded wait until its code location is loaded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
START_TIMEOUT_S = 120  # the code server imports dagster + pyspark; slow when other suites run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebServer:
    """`dagster-webserver` in its own process group (killed as a group in `stop`)."""

    def __init__(self, home: str, config: str, log_path: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "DAGSTER_HOME": home, "MEMWAL_CONFIG": config}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "dagster-webserver"), "-h", "127.0.0.1", "-p", str(self.port),
             "-w", os.path.join(REPO, "workspace.yaml")],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def graphql(self, query: str, variables: dict | None = None, timeout: float = 30) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out = json.loads(resp.read())
        assert not out.get("errors"), out["errors"]
        return out["data"]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Bounded poll: `/server_info` answers, then the code location reports LOADED."""
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"dagster-webserver exited ({self.proc.returncode}):\n{self.log_tail()}")
            if time.time() > deadline:
                raise AssertionError(f"dagster-webserver not ready after {timeout} s:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(f"{self.url}/server_info", timeout=2).read()
                data = self.graphql(LOCATIONS)
                entries = data["workspaceOrError"]["locationEntries"]
                if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                    for e in entries:
                        err = e["locationOrLoadError"] or {}
                        assert err.get("__typename") != "PythonError", f"{e['name']}: {err.get('message')}"
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)

    def location(self) -> str:
        """The (one) code location's name, as URLs of the UI spell it."""
        return self.graphql(LOCATIONS)["workspaceOrError"]["locationEntries"][0]["name"]

    def dismiss_welcome(self) -> None:
        """No "Join the Dagster community" dialog over the pages a browser opens."""
        self.graphql("mutation { setNuxSeen }")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the webserver and its code server
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self._log.close()


LOCATIONS = """
query Locations {
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name
        loadStatus
        locationOrLoadError { __typename ... on PythonError { message } }
      }
    }
  }
}
"""
