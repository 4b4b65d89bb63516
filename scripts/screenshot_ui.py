"""Screenshots of the Dagster UI on a demo table, for docs/.

    .venv/bin/python scripts/screenshot_ui.py            # writes docs/ui-asset-graph.png, docs/ui-region-partitions.png

Writes a demo table with pylance ShardWriters (as `memwal demo` does) in a temporary directory,
materializes its assets into a temporary Dagster instance (two write/merge/maintain cycles, so
metadata has history), starts `dagster-webserver` on that instance with a MEMWAL_CONFIG naming
the table, and captures with headless Chromium (/usr/bin/chromium, `apt-get install -y chromium`):
  - the table's asset group graph (/locations/<repo>@<location>/asset-groups/<table>);
  - the partitions view of base_table with one region selected
    (/assets/<table>/base_table?view=partitions&partition=<region>).
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
CHROMIUM = "/usr/bin/chromium"
ASSETS = ("region_generations", "base_table", "memwal_index", "index_catchup", "garbage")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# table + instance


def write_demo(path: str, regions: int, rows: int):
    from memwal_core.state.store import open_store
    from memwal_core.tools import demo

    loc = open_store(path)
    demo.create_table(loc, sharding="bucket", num_buckets=regions, base_rows=rows // 2, btree_index=True)
    w = demo.Workload(loc, seed=42, key_space=max(10, rows), max_memtable_rows=max(100, rows // regions))
    return loc, w


def populate(home: str, config: str, w, rounds_per_cycle: int, cycles: int, rows: int) -> list[str]:
    """`cycles` times: write, refresh region_generations of every region, merge all regions with
    the table's merge job as a one-run backfill, then run its maintenance job (memwal_index ->
    index_catchup -> garbage); asset checks run with their assets."""
    from dagster import DagsterInstance, materialize
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    from memwal_pipeline.config import load_config
    from memwal_pipeline.definitions import build_definitions, table_definitions

    (cfg,) = load_config(config)
    td = table_definitions(cfg)
    defs = build_definitions([cfg])
    merge_job = defs.resolve_job_def(td.merge_job.name)
    maintenance_job = defs.resolve_job_def(td.maintenance_job.name)
    (gens,) = [a for a in td.assets if a.key.path[-1] == "region_generations"]
    quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
    with DagsterInstance.from_config(home) as instance:
        for cycle in range(cycles):
            for _ in range(rounds_per_cycle):
                w.write_round(rows, overwrite=0.3, delete=0.03)
            regions = sorted(w.regions.values())
            known = set(instance.get_dynamic_partitions(td.partitions.name))
            instance.add_dynamic_partitions(td.partitions.name, [r for r in regions if r not in known])
            say(f"cycle {cycle + 1}/{cycles}: region_generations x{len(regions)}, {merge_job.name} over all "
                f"regions, {maintenance_job.name}")
            for rid in regions:
                res = materialize([gens, *td.checks_for(gens.key)], partition_key=rid, instance=instance,
                                  resources=td.resources, run_config=quiet)
                assert res.success, f"region_generations {rid} failed"
            res = merge_job.execute_in_process(instance=instance, run_config=quiet, tags={
                ASSET_PARTITION_RANGE_START_TAG: regions[0], ASSET_PARTITION_RANGE_END_TAG: regions[-1]})
            assert res.success, f"{merge_job.name} failed"
            res = maintenance_job.execute_in_process(instance=instance, run_config=quiet)
            assert res.success, f"{maintenance_job.name} failed"
    return regions


# ---------------------------------------------------------------------------------------------
# webserver


class WebServer:
    def __init__(self, home: str, config: str, log_path: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {**os.environ, "DAGSTER_HOME": home, "MEMWAL_CONFIG": config}
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "dagster-webserver"), "-h", "127.0.0.1", "-p", str(self.port),
             "-w", os.path.join(REPO, "workspace.yaml")],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.url}/graphql", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"query": query, "variables": variables or {}}).encode())
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.loads(resp.read())
        if out.get("errors"):
            raise RuntimeError(out["errors"])
        return out["data"]

    def wait_ready(self, timeout: float = 180) -> str:
        """Returns the code location's name once it is LOADED (raises on a load error)."""
        q = ("{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus "
             "locationOrLoadError { __typename ... on PythonError { message } } } } } }")
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dagster-webserver exited ({self.proc.returncode}); see {self.log_path}")
            try:
                urllib.request.urlopen(f"{self.url}/server_info", timeout=2).read()
                entries = self.graphql(q)["workspaceOrError"]["locationEntries"]
                if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                    err = entries[0]["locationOrLoadError"] or {}
                    if err.get("__typename") == "PythonError":
                        raise RuntimeError(f"code location failed to load: {err['message']}")
                    return entries[0]["name"]
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"dagster-webserver not ready after {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self._log.close()


# ---------------------------------------------------------------------------------------------
# chromium


def screenshot(url: str, out: str, profile: str, size: str, scale: float, budget_ms: int) -> None:
    """Chromium's own --screenshot; the virtual time budget lets the JS app fetch and render."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={size}",
           f"--force-device-scale-factor={scale}",
           f"--virtual-time-budget={budget_ms}", f"--screenshot={out}", url]
    if os.path.exists(out):
        os.remove(out)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"chromium failed ({proc.returncode}) for {url}:\n{proc.stderr[-2000:]}")
    say(f"wrote {out} ({os.path.getsize(out) // 1024} KiB) from {url}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=os.path.join(REPO, "docs"))
    p.add_argument("--regions", type=int, default=4)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--cycles", type=int, default=2, help="write/merge/maintain cycles (metadata history)")
    p.add_argument("--name", default="demo", help="table name (asset key prefix and group)")
    p.add_argument("--graph-size", default="1600,600",
                   help="window (CSS px) for the graph; at 1600 wide the nodes show their details")
    p.add_argument("--page-size", default="1600,1000", help="window (CSS px) for the partitions page")
    p.add_argument("--scale", type=float, default=2, help="device scale factor (2: sharp text in docs)")
    p.add_argument("--budget-ms", type=int, default=15000, help="chromium --virtual-time-budget")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (table, instance, logs)")
    a = p.parse_args(argv)

    if not os.access(CHROMIUM, os.X_OK):
        say(f"{CHROMIUM} is not installed; install it with `apt-get install -y chromium` and run again.")
        return 2

    tmp = tempfile.mkdtemp(prefix="memwal-ui-")
    home = os.path.join(tmp, "dagster_home")
    os.makedirs(home)
    with open(os.path.join(home, "dagster.yaml"), "w") as f:
        f.write(f"storage:\n  sqlite:\n    base_dir: {home}\ntelemetry:\n  enabled: false\n")
    table_path = os.path.join(tmp, "demo_table")
    config = os.path.join(tmp, "memwal.yaml")
    with open(config, "w") as f:
        # As `memwal demo`: keep only the latest base-table version, so GC can reclaim merged generations.
        f.write(f"tables:\n  - name: {a.name}\n    uri: {table_path}\n    spark: {{master: 'local[2]'}}\n"
                "    gc: {cleanup_base_versions_older_than_seconds: 0, manifest_min_age_seconds: 0}\n")
    server = None
    try:
        say(f"writing a demo table at {table_path}: {a.regions} bucket regions")
        _, w = write_demo(table_path, a.regions, a.rows)
        from dagster import DagsterInstance

        with DagsterInstance.from_config(home):
            pass  # create the SQLite storage before the webserver opens it
        server = WebServer(home, config, os.path.join(tmp, "webserver.log"))
        regions = populate(home, config, w, rounds_per_cycle=2, cycles=a.cycles, rows=a.rows)
        location = server.wait_ready()
        say(f"webserver on {server.url} (code location {location})")
        nodes = server.graphql('{ assetNodes { assetKey { path } } }')["assetNodes"]
        keys = {"/".join(n["assetKey"]["path"]) for n in nodes}
        missing = {f"{a.name}/{x}" for x in ASSETS} - keys
        if missing:
            raise RuntimeError(f"the webserver does not list {sorted(missing)}")

        server.graphql("mutation { setNuxSeen }")  # no "Join the Dagster community" modal over the page
        os.makedirs(a.out_dir, exist_ok=True)
        profile = os.path.join(tmp, "chromium")
        repo_path = urllib.parse.quote(f"__repository__@{location}", safe="@")
        graph_url = f"{server.url}/locations/{repo_path}/asset-groups/{a.name}"
        region = regions[0]
        parts_url = (f"{server.url}/assets/{a.name}/base_table?view=partitions"
                     f"&partition={urllib.parse.quote(region)}")
        screenshot(graph_url, os.path.join(a.out_dir, "ui-asset-graph.png"), profile, a.graph_size, a.scale,
                   a.budget_ms)
        screenshot(parts_url, os.path.join(a.out_dir, "ui-region-partitions.png"), profile, a.page_size, a.scale,
                   a.budget_ms)
        return 0
    finally:
        if server:
            server.stop()
        if a.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
