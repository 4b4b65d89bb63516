"""A plain (non-editable) install works outside the checkout: no file of the checkout, no
`memwal.yaml`, any working directory; it installs under the distribution name the README
gives (`memwal-lance`: PyPI's `memwal` is an unrelated project); and an operator's fresh dg
project with its own Dagster instance maintains a table, one run of it at a time.

The wheel is built from the checkout and installed by name (`pip install memwal-lance`, from
the built wheel only) with `--no-deps` into a fresh virtualenv;
the dependencies come from the project's own `.venv` through a `.pth` line, which puts its
site-packages on `sys.path` *after* the fresh one without running its `.pth` files (so the
editable install's finder, which would map `memwal_core` back to the checkout, stays off).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import venv
import zipfile

import pytest
import yaml
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter
from support.dg_project import project
from support.tables import make_table, rows

from memwal_core.options import LeaseOptions
from memwal_core.state import lease
from memwal_core.state.store import open_store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST = "memwal-lance"  # what README's install line names
BLOCKED = "Step blocked by limit for pool memwal_events"  # Dagster's event when a step waits for its pool


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    wheels, src = tmp / "wheels", tmp / "src"
    # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("memwal_core", "memwal_pipeline"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(src)], check=True, cwd=tmp)
    (wheel,) = list(wheels.glob("memwal_lance-*.whl"))
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--find-links",
                    str(wheels), "--target", site, DIST], check=True, cwd=tmp)
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return py, tmp, wheel


def _env(**extra: str) -> dict[str, str]:
    """The environment without anything that would put the checkout on the path or name its tables."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEMWAL_CONFIG", "PYSPARK_PYTHON",
                                                              "PYSPARK_DRIVER_PYTHON", "DAGSTER_HOME")}
    return {**env, **extra}


def _run(py, cwd, *args, timeout=300):
    return subprocess.run([str(py), *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_the_installed_package_comes_from_the_wheel_not_the_checkout(installed):
    py, tmp, _ = installed
    out = _run(py, tmp, "-c", "import json, memwal_core, memwal_pipeline.definitions as d;"
                              "print(json.dumps([memwal_core.__file__, d.__file__]))")
    assert out.returncode == 0, out.stderr
    for path in json.loads(out.stdout):
        assert not path.startswith(ROOT + os.sep) and str(tmp) in path


def test_memwal_demo_and_status_run_outside_the_checkout(installed):
    py, tmp, _ = installed
    work = tmp / "elsewhere"
    work.mkdir()
    demo = _run(py, work, "-m", "memwal_pipeline.cli", "demo", "--path", "t", "--regions", "2", "--rows", "60",
                "--spark-master", "local[1]")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert (work / "t" / "_mem_wal").is_dir()  # `demo` wrote it and ran `maintain` on it in process
    st = _run(py, work, "-m", "memwal_pipeline.cli", "status", "t", "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    assert "not found" not in st.stdout + st.stderr


def test_the_installed_code_location_loads_memwal_yaml_and_ships_no_tables(installed):
    """The wheel carries the MemWalTable component but not this checkout's defs folder (the demo
    table): installed, the code location's tables are memwal.yaml's only."""
    py, tmp, _ = installed
    work = tmp / "location"
    work.mkdir()
    (work / "memwal.yaml").write_text("tables:\n  - {name: mine, uri: data/mine, merge: {budget_bytes: 64MB}}\n")
    code = ("import os, json, memwal_pipeline, memwal_pipeline.component as c, memwal_pipeline.definitions as d;"
            "os.environ['MEMWAL_CONFIG'] = 'memwal.yaml';"
            "defs = d.location_definitions();"
            "print(json.dumps([os.path.isdir(os.path.join(os.path.dirname(memwal_pipeline.__file__), 'defs')),"
            " sorted(k.to_user_string() for k in defs.resolve_all_asset_keys())]))")
    out = _run(py, work, "-c", code)
    assert out.returncode == 0, out.stdout + out.stderr
    shipped_defs, keys = json.loads(out.stdout.strip().splitlines()[-1])
    assert not shipped_defs
    assert keys and all(k.startswith("mine/") for k in keys)


def test_the_distribution_is_not_named_memwal():
    """PyPI's `memwal` is an unrelated project: `pip install memwal` must never be our install line."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        name = tomllib.load(f)["project"]["name"]
    assert name == DIST
    assert name.lower().replace("_", "-").replace(".", "-") != "memwal"
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"pip install {DIST}" in readme
    assert not re.search(r"pip install ['\"]?memwal(?![-\w])", readme)


def test_the_wheel_metadata_names_memwal_lance_and_installs_the_command(installed):
    """What pip records: the wheel's METADATA `Name`, its console script and the dg registry
    entry point (`dg list components` finds MemWalTable through it)."""
    _, _, wheel = installed
    with zipfile.ZipFile(wheel) as z:
        info = next(n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        tops = {n.split("/")[0] for n in z.namelist() if not n.startswith(info)}
    name = next(line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Name:"))
    assert name == DIST and name.lower() != "memwal"
    assert "memwal = memwal_pipeline.cli:main" in entry_points
    assert "memwal_pipeline.component" in entry_points.split("[dagster_dg_cli.registry_modules]")[1]
    assert tops == {"memwal_core", "memwal_pipeline"}


@pytest.mark.timeout(1200)  # three processes importing Dagster and one starting Spark: minutes on a loaded machine
def test_a_fresh_dg_project_maintains_a_table_one_run_at_a_time(installed, tmp_path):
    """An operator's own dg project and Dagster instance, memwal installed from the wheel: `dg
    scaffold defs` writes the table's defs.yaml; loading it warns that the instance (no
    `concurrency:` settings, nothing of this checkout's dagster_home) leaves the table's pool
    unlimited; the sensor's first tick gives the pool the limit the package ships (1) and
    requests a merge. Each run in a process of its own (as Dagster's default run launcher starts
    them): the merge run starts and holds the pool's slot (its step cannot commit while the test
    holds the table lease); a maintenance run of the same table started meanwhile is blocked by
    the pool until the merge step ends. The merge commits: the base table then holds exactly what
    the ShardWriters wrote (tests/procs/fresh_project_runs.py)."""
    py, _, _ = installed
    root, module = project(tmp_path, {})
    loc = open_store(str(root / "data" / "events"))
    w = make_table(loc, regions=2, rounds=1)
    scaffold = _run(py, root, "-m", "dagster_dg_cli.cli", "scaffold", "defs", "memwal_pipeline.component.MemWalTable",
                    "events", "--uri", "data/events")
    assert scaffold.returncode == 0, scaffold.stdout[-3000:] + scaffold.stderr[-3000:]
    written = root / module / "defs" / "events" / "defs.yaml"
    spec = yaml.safe_load(written.read_text())
    assert spec == {"type": "memwal_pipeline.component.MemWalTable",
                    "attributes": {"name": "events", "uri": "data/events"}}
    # The operator's settings: Spark on one local core; a lease wait longer than the test holds the lease.
    spec["attributes"].update(spark={"master": "local[1]"}, lease={"wait_seconds": 600})
    written.write_text(yaml.safe_dump(spec, sort_keys=False))
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    assert rows(loc) != w.expected()  # nothing merged yet
    env = _env(DAGSTER_HOME=str(home))
    script = os.path.join(ROOT, "tests", "procs", "fresh_project_runs.py")
    tick = subprocess.run([str(py), script, "events", "tick", str(tmp_path / "tick.json")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert tick.returncode == 0, tick.stdout[-3000:] + tick.stderr[-3000:]
    seen = json.loads((tmp_path / "tick.json").read_text())
    (warning,) = seen["warnings"]
    assert "does not limit the pool(s) memwal_events" in warning, warning
    assert seen["limit_before"] is None and seen["limit_after"] == 1

    procs: list[subprocess.Popen] = []

    def start(job: str, tags: dict) -> None:
        with open(tmp_path / f"{job}.log", "w") as log:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen([str(py), script, "events", "run", job, json.dumps(tags)], cwd=root,
                                          env=env, stdout=log, stderr=subprocess.STDOUT))

    with DagsterInstance.from_config(str(home)) as instance:
        def events(job: str, kind: DagsterEventType) -> list:
            return [e for r in instance.get_runs(filters=RunsFilter(job_name=job))
                    for e in instance.all_logs(r.run_id, of_type=kind)]

        def wait_for(what: str, found) -> None:
            deadline = time.time() + 300
            while not found():
                dead = [p.args[4] for p in procs if p.poll() is not None]
                assert not dead and time.time() < deadline, f"waiting for {what}: {dead} ended or timed out"
                time.sleep(0.2)

        try:
            with lease.hold(loc, "test holder", LeaseOptions(ttl_seconds=60)):
                start("events_merge", seen["merge_tags"])
                wait_for("the merge step to start", lambda: any(
                    e.step_key == "events__base_table" for e in events("events_merge", DagsterEventType.STEP_START)))
                start("events_maintenance", {})
                wait_for("the maintenance run to be blocked by the pool", lambda: any(
                    BLOCKED in (e.dagster_event.message or "")
                    for e in events("events_maintenance", DagsterEventType.ENGINE_EVENT)))
                # The merge step holds the slot and cannot commit while the test holds the lease.
                assert rows(loc) != w.expected()
            for p in procs:
                assert p.wait(timeout=600) == 0, (tmp_path / f"{p.args[4]}.log").read_text()[-3000:]
        finally:
            for p in procs:
                p.kill()
        merged_at = max(e.timestamp for e in events("events_merge", DagsterEventType.STEP_SUCCESS)
                        if e.step_key == "events__base_table")
        pooled = {e.step_key: e.timestamp for e in events("events_maintenance", DagsterEventType.STEP_START)
                  if e.step_key in ("events__base_compaction", "events__index_catchup", "events__memwal_index",
                                    "events__garbage")}
        assert len(pooled) == 4 and min(pooled.values()) >= merged_at, (pooled, merged_at)
        assert {r.status for r in instance.get_runs()} == {DagsterRunStatus.SUCCESS}
    assert rows(loc) == w.expected()
