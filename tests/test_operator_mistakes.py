"""Operator mistakes get one clear line and change nothing: Ctrl-C, `demo --path`, config
mistakes, one line and one JVM per failing command.

The CLI runs as a real subprocess where signals or process output matter, in process otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import lance
import pytest
from support.helpers import tree

from memwal_core.errors import OptionError
from memwal_core.options import parse_size
from memwal_core.state.store import open_store
from memwal_core.tools import demo
from memwal_pipeline import cli
from memwal_pipeline.config import ConfigError, load_config, single_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _small_table(root: str) -> demo.Workload:
    loc = open_store(root)
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20, btree_index=True)
    w = demo.Workload(loc, seed=1, key_space=50, max_memtable_rows=20)
    w.write_round(40, overwrite=0.3, delete=0.05)
    return w


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error")]


def _clean(line: str) -> None:
    for noise in ("Dagster", "Error:", "Exception", "Traceback", "\tat ", "py4j", ".rs:"):
        assert noise not in line, line


# ------------------------------------------------------------------------------------- Ctrl-C

def test_ctrl_c_stops_maintain_runs_nothing_more_and_exits_130(tmp_path):
    """SIGINT while the merge step is under way (paused right before its commit): the merge
    does not commit, no later step (index, catch-up, GC) runs, exit 130, one line."""
    root = str(tmp_path / "t")
    _small_table(root)
    version = lance.dataset(root).version
    before = tree(os.path.join(root, "_mem_wal"))
    proc = subprocess.Popen([sys.executable, "-m", "memwal_pipeline.cli", "maintain", root,
                             "--spark-master", "local[1]"],
                            env=_env(MEMWAL_PAUSE_AT="merge.before_commit"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        deadline = time.monotonic() + 300
        for line in proc.stderr:
            seen.append(line)
            if "memwal paused at merge.before_commit" in line:
                proc.send_signal(signal.SIGINT)
                break
            assert time.monotonic() < deadline, "the merge never reached its commit"
        rest = proc.stderr.read()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(seen) + rest
    assert rc == 130, stderr[-3000:]
    for step in ("compact", "catchup", "index", "gc"):
        assert f"] {step} ..." not in stderr, stderr[-3000:]
    errors = _error_lines(rest)
    assert len(errors) == 1 and "interrupted during merge" in errors[0], rest[-3000:]
    _clean(errors[0])
    assert "\tat " not in rest and "Traceback" not in rest, rest[-3000:]  # no Java or Python trace
    assert lance.dataset(root).version == version  # nothing committed after ^C
    assert tree(os.path.join(root, "_mem_wal")) == before


# -------------------------------------------------------------------------------- demo --path

def test_demo_refuses_a_directory_it_did_not_write(tmp_path, capsys):
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    assert cli.main(["demo", "--path", str(precious)]) == 1
    err = capsys.readouterr().err
    assert len(_error_lines(err)) == 1 and "--force" in err
    assert (precious / "thesis.tex").read_text() == "years of work"
    # A plain file is not deleted either.
    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main(["demo", "--path", str(f)]) == 1
    assert f.read_text() == "x"


def test_demo_marks_its_table_and_replaces_it_on_the_next_run(tmp_path):
    """The run before this one left its table and marker at the path (the demo's own table and
    marker file, written here without a JVM; a first run on a fresh path: tests/test_install.py):
    the next `memwal demo` replaces it, marks its own table, and maintains it."""
    path = tmp_path / "demo"
    previous = _small_table(str(path))
    (path / cli.DEMO_MARKER).write_text("the previous run's marker\n")
    old_files = tree(str(path))
    assert previous.expected() and len(old_files) > 5
    p = _cli("demo", "--path", str(path), "--regions", "2", "--rows", "40", "--spark-master", "local[1]",
             timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "LSM read equals what the writers wrote: yes" in p.stdout
    assert "removing the previous demo table" in p.stderr
    assert (path / cli.DEMO_MARKER).read_text().startswith("written by `memwal demo`")  # marked by this run
    assert not set(old_files.items()) & set(tree(str(path)).items())  # no file of the previous table is left


def test_demo_path_replaces_only_previous_demo_tables(tmp_path):
    # Marked by a previous `memwal demo`: replaced.
    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / cli.DEMO_MARKER).write_text("")
    (marked / "data").mkdir()
    cli._clear_demo_path(str(marked), force=False)
    assert not marked.exists()
    # A demo table written before the marker existed (Lance's directories, the demo schema).
    old = tmp_path / "old"
    _small_table(str(old))
    cli._clear_demo_path(str(old), force=False)
    assert not old.exists()
    # A MemWAL table with another schema, or with anything else in it: not a demo table.
    other = tmp_path / "other"
    _small_table(str(other))
    (other / "notes.txt").write_text("mine")
    with pytest.raises(cli.CliError):
        cli._clear_demo_path(str(other), force=False)
    assert (other / "notes.txt").exists()
    cli._clear_demo_path(str(other), force=True)
    assert not other.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    cli._clear_demo_path(str(empty), force=False)
    assert empty.exists()


# ----------------------------------------------------------------------------------- config

def _write(tmp_path, text: str):
    p = tmp_path / "memwal.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_config_refuses_one_table_under_two_spellings(tmp_path):
    (tmp_path / "data").mkdir()
    for a, b in [("data/t", "./data/t"), ("data/t", f"{tmp_path}/data/t/"), ("data/t", "data//t"),
                 ("s3://b/p", "s3://b/p/"), ("s3://b/a%20b", "s3://b/a b")]:
        p = _write(tmp_path, f"""
            tables:
              - {{name: one, uri: "{a}"}}
              - {{name: two, uri: "{b}"}}
        """)
        with pytest.raises(ConfigError, match="same table"):
            load_config(p)
    # Different tables stay accepted, as does one bucket prefix on two endpoints.
    p = _write(tmp_path, """
        tables:
          - {name: one, uri: data/t}
          - {name: two, uri: data/t2}
          - {name: three, uri: "s3://b/p", storage_options: {aws_endpoint: "http://127.0.0.1:1"}}
          - {name: four, uri: "s3://b/p", storage_options: {aws_endpoint: "http://127.0.0.1:2"}}
    """)
    assert [t.name for t in load_config(p)] == ["one", "two", "three", "four"]


def test_config_refuses_unknown_keys_with_a_suggestion(tmp_path):
    p = _write(tmp_path, """
        tables:
          - name: t
            uri: data/t
            merg: {budget_bytes: 1000}
    """)
    with pytest.raises(ConfigError, match=r"unknown key 'merg'.*did you mean 'merge'"):
        load_config(p)
    p = _write(tmp_path, """
        tables:
          - name: t
            uri: data/t
            gc: {manifest_retension: 3}
    """)
    with pytest.raises(ConfigError, match=r"gc: unknown key 'manifest_retension'.*'manifest_retention'"):
        load_config(p)
    p = _write(tmp_path, "tabels: []\n")
    with pytest.raises(ConfigError, match=r"unknown key 'tabels'.*did you mean 'tables'"):
        load_config(p)


def test_config_sizes_numbers_and_shapes(tmp_path):
    p = _write(tmp_path, """
        tables:
          - {name: t, uri: data/t, merge: {budget_bytes: 256MB}}
    """)
    assert load_config(p)[0].merge.budget_bytes == 256 * 1024 * 1024
    assert parse_size("1.5g", "x") == 1536 * 1024 * 1024 and parse_size("64KiB", "x") == 65536
    assert parse_size(1000, "x") == 1000
    for bad in ("lots", "-5MB", "0", True):
        with pytest.raises(OptionError, match="budget_bytes|x:"):
            parse_size(bad, "x")
    p = _write(tmp_path, """
        tables:
          - {name: t, uri: data/t, merge: {budget_bytes: lots}}
    """)
    with pytest.raises(ConfigError, match=r"merge.budget_bytes: expected a size in bytes"):
        load_config(p)
    p = _write(tmp_path, """
        tables:
          t: {uri: data/t}
    """)
    with pytest.raises(ConfigError, match="'tables' must be a list"):
        load_config(p)
    p = _write(tmp_path, """
        tables:
          - {name: t, uri: data/t, gc: {orphan_grace_seconds: .nan}}
    """)
    with pytest.raises(ConfigError, match="orphan_grace_seconds: must be a finite number"):
        load_config(p)
    p = _write(tmp_path, """
        tables:
          - {name: t, uri: data/t, spark: {master: "lokal[2]"}}
    """)
    with pytest.raises(ConfigError, match="is not a Spark master"):
        load_config(p)


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "soon"])
def test_cli_refuses_bad_base_versions_older_than(tmp_path, capsys, value):
    root = str(tmp_path / "t")
    _small_table(root)
    before = tree(root)
    rc = cli.main(["maintain", root, f"--base-versions-older-than={value}"])
    err = capsys.readouterr().err
    assert rc in (1, 2)
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
    assert tree(root) == before
    assert single_table(root, base_versions_older_than=0,
                        base_versions_floor=0).gc.cleanup_base_versions_older_than_seconds == 0


# ----------------------------------------------------------------------- one line, one JVM

def test_bad_spark_master_is_one_line_and_starts_no_jvm(tmp_path):
    root = str(tmp_path / "t")
    _small_table(root)
    before = tree(root)
    t0 = time.monotonic()
    p = _cli("maintain", root, "--spark-master", "bogus")
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a Spark master" in lines[0], p.stderr
    assert "Exception in thread" not in p.stderr and "JAVA_GATEWAY" not in p.stderr
    assert time.monotonic() - t0 < 60
    assert tree(root) == before


def test_merge_without_java_is_one_line(tmp_path):
    root = str(tmp_path / "t")
    _small_table(root)
    before = tree(root)
    env = {k: v for k, v in _env().items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)  # no java here (the interpreter is called by its full path)
    p = subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", "maintain", root], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no java found" in lines[0], p.stderr
    assert tree(root) == before


def test_maintain_of_a_missing_table_is_one_line(tmp_path):
    p = _cli("maintain", str(tmp_path / "nonexistent"))
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "nonexistent" in lines[0] and "not found" in lines[0], p.stderr
    _clean(lines[0].removeprefix("error: "))
