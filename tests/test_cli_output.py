"""What `memwal` prints, through the command itself (a subprocess each): a quiet merge (no JVM,
Spark or Lance chatter), `--json` as plain versioned data (nested keys without `/`, one duration,
no reprs or markdown), a JSON error object on failure, `--version`, a did-you-mean for a
mistyped flag or command, a quiet end when the reader of stdout goes away, sizes in one style,
and `--config` pointed at a MemWalTable defs.yaml (or its folder) of a dg project."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from support.helpers import tree

import memwal_core
from memwal_core.state.store import open_store
from memwal_core.steps.outcome import SCHEMA_VERSION
from memwal_core.tools import demo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}
ENV.pop("LANCE_LOG", None)  # the default memwal sets is under test
NOISE = ("WARNING: Using incubator modules", "Setting default log level", "To adjust logging level",
         "has no fields", "Traceback", "Exception ignored")


def _memwal(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", *args], env=ENV, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _table(root: str) -> None:
    loc = open_store(root)
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20, btree_index=True)
    w = demo.Workload(loc, seed=3, key_space=50, max_memtable_rows=20)
    for _ in range(2):
        w.write_round(40, overwrite=0.3, delete=0.05)


def _keys_and_strings(node, path=""):
    """Every (path, key) and (path, string value) of a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield "key", f"{path}.{k}", k
            yield from _keys_and_strings(v, f"{path}.{k}")
    elif isinstance(node, list):
        for v in node:
            yield from _keys_and_strings(v, f"{path}[]")
    elif isinstance(node, str):
        yield "str", path, node


def _assert_plain(doc: dict) -> None:
    assert doc["schema_version"] == SCHEMA_VERSION
    for kind, path, value in _keys_and_strings(doc):
        if kind == "key":
            assert "/" not in value, path
            if value in ("duration_s", "seconds", "plan_seconds", "execute_seconds"):  # one per step
                assert re.fullmatch(r"\.steps\.\w+\.duration_s", path), path
        else:
            assert not re.search(r"\{'|\['|<\w+[ .][^>]*>|\w+\(\w+=|StepStatus\.|`|\*\*", value), (path, value)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("out") / "my-events")
    _table(root)
    return root


def test_a_pass_is_quiet_and_its_json_is_plain_data(table):
    """A real pass (merge on local Spark included): stderr has the steps' lines and nothing from
    the JVM, Spark or Lance; sizes read `4.1 KiB`; the report is plain data."""
    p = _memwal("maintain", table, "--spark-master", "local[1]", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    for noise in NOISE:
        assert noise not in p.stderr, p.stderr
    assert "[my_events] merge done in " in p.stderr  # the table's name, from its folder
    assert re.search(r"\[my_events\] gc done in .*bytes reclaimed \d+(\.\d)? (B|KiB|MiB)\b", p.stderr), p.stderr
    assert not re.search(r"\d{3,} bytes", p.stderr), p.stderr
    doc = json.loads(p.stdout)
    _assert_plain(doc)
    merge = doc["steps"]["merge"]
    assert doc["ok"] and merge["status"] == "ok" and merge["duration_s"] > 0
    assert "duration_s" not in merge["metrics"] and "duration_s" not in merge["result"]
    assert merge["metrics"]["generations_merged"] > 0
    assert isinstance(doc["steps"]["compact"]["metrics"]["segments"], dict)  # was segments/<index>

    dry = _memwal("maintain", table, "--only", "gc", "--base-versions-older-than", "1", "--base-versions-floor", "0",
                  "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr[-3000:]
    doc = json.loads(dry.stdout)
    _assert_plain(doc)
    would = doc["steps"]["gc"]["metrics"]["would_delete"]
    assert set(would) >= {"generation", "wal", "manifest", "orphan", "leaked", "base_version"}
    assert would["base_version"]["items"] > 0 and set(would["generation"]) == {"items", "objects", "bytes"}
    text = _memwal("maintain", table, "--only", "gc", "--base-versions-older-than", "1", "--base-versions-floor", "0",
                   "--dry-run")
    assert re.search(r"^gc: would delete .* objects, \d+(\.\d)? (B|KiB|MiB)$", text.stdout, re.M), text.stdout


def test_failures_under_json_are_a_json_error_object(tmp_path, table):
    missing = _memwal("status", str(tmp_path / "nothing"), "--json")
    assert missing.returncode == 1
    doc = json.loads(missing.stdout)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["ok"] is False
    assert "cannot open Lance table" in doc["error"]["message"] and doc["error"]["type"]
    assert missing.stderr.startswith("error: cannot open Lance table"), missing.stderr

    typo = _memwal("maintain", table, "--dryrun", "--json")
    assert typo.returncode == 2
    doc = json.loads(typo.stdout)
    assert doc["error"] == {"type": "usage", "message": "unrecognized arguments: --dryrun (did you mean --dry-run?)"}
    assert "did you mean --dry-run?" in typo.stderr


def test_version_and_did_you_mean():
    v = _memwal("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"memwal {memwal_core.__version__}"
    cmd = _memwal("maintian", "x")
    assert cmd.returncode == 2 and "(did you mean maintain?)" in cmd.stderr, cmd.stderr
    flag = _memwal("status", "x", "--jsn")
    assert flag.returncode == 2 and "(did you mean --json?)" in flag.stderr, flag.stderr


def test_status_into_a_closed_pipe_ends_quietly(table):
    """`memwal status | head`: the reader goes away before the command writes; no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "memwal_pipeline.cli", "status", table], env=ENV, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert err == "", err


# ------------------------------------------------------------------------- a dg project's defs.yaml


def _project(tmp_path, defs: dict[str, str]):
    """A dg project's layout: pyproject.toml at its root, one folder per component under defs/."""
    (tmp_path / "pyproject.toml").write_text("[tool.dg]\ndirectory_type = \"project\"\n")
    for folder, text in defs.items():
        d = tmp_path / "src" / "proj" / "defs" / folder
        d.mkdir(parents=True)
        (d / "defs.yaml").write_text(textwrap.dedent(text))
    return tmp_path / "src" / "proj" / "defs"


def test_config_reads_a_component_defs_yaml(tmp_path):
    """`--config defs.yaml` (or the defs folder): the component's attributes are the table, a
    relative uri is relative to the project root; a typo gets a did-you-mean."""
    table = str(tmp_path / "events")
    _table(table)
    defs = _project(tmp_path, {
        "events": """
            type: memwal_pipeline.component.MemWalTable
            attributes:
              name: events
              uri: events
              merge: {budget_bytes: 3KB}
        """,
        "other": "type: dagster.components.DefsFolderComponent\n",
    })
    before = tree(table)
    p = _memwal("maintain", "--config", str(defs / "events" / "defs.yaml"), "--only", "merge", "--dry-run", "--json",
                cwd=str(defs))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["table"] == str(tmp_path / "events") and doc["steps"]["merge"]["plan"]["budget_bytes"] == 3 * 1024
    s = _memwal("status", "--config", str(defs), "--table", "events", "--json")
    assert s.returncode in (0, 1) and json.loads(s.stdout)["table"].endswith("events"), s.stderr
    assert tree(table) == before

    (defs / "events" / "defs.yaml").write_text("type: memwal_pipeline.component.MemWalTable\n"
                                               "attributes: {name: events, uri: events, merge: {budgt_bytes: 3KB}}\n")
    typo = _memwal("status", "--config", str(defs / "events" / "defs.yaml"))
    assert typo.returncode == 1 and "unknown key 'budgt_bytes' (did you mean 'budget_bytes'?)" in typo.stderr, typo.stderr
    (defs / "events" / "defs.yaml").write_text("type: memwal_pipeline.component.MemWalTable\n"
                                               "atributes: {name: events, uri: events}\n")
    typo = _memwal("status", "--config", str(defs / "events" / "defs.yaml"))
    assert typo.returncode == 1 and "unknown key 'atributes' (did you mean 'attributes'?)" in typo.stderr, typo.stderr
    none = _memwal("status", "--config", str(defs / "other" / "defs.yaml"))
    assert none.returncode == 1 and "no MemWalTable component" in none.stderr, none.stderr
