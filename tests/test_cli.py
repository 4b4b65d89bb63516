"""`memwal maintain|status --config FILE --table NAME`: a configured table's settings, flags over
them (checked like the file), secrets from the environment, and merge progress on stderr.

Real tables written by pylance; the CLI runs in process (`cli.main`) so that its merge shares
the test session's local Spark.
"""

from __future__ import annotations

import io
import json
import re
import textwrap

import pytest
from support.helpers import tree

from memwal_core.jobs import merge
from memwal_core.jobs.progress import MergeProgress
from memwal_core.state import table
from memwal_core.state.store import open_store
from memwal_core.tools import demo
from memwal_pipeline import cli
from memwal_pipeline.config import ConfigError, load_config

SECRET = "s3cr3t-value-never-printed"


def _table(root: str, rounds: int = 3) -> demo.Workload:
    loc = open_store(root)
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20, btree_index=True)
    w = demo.Workload(loc, seed=1, key_space=50, max_memtable_rows=20)
    for _ in range(rounds):
        w.write_round(40, overwrite=0.3, delete=0.05)
    return w


def _config(tmp_path, text: str):
    p = tmp_path / "memwal.yaml"
    p.write_text(textwrap.dedent(text))
    return str(p)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Two tables and a file configuring them: `alpha` with its own merge and Spark settings (and a
    Connect server nobody listens on: the CLI must not use it), `beta` with a secret."""
    root = tmp_path_factory.mktemp("cli")
    _table(str(root / "a"))
    _table(str(root / "b"), rounds=1)
    path = _config(root, """
        tables:
          - name: alpha
            uri: a
            spark: {master: "local[2]", connect: "sc://127.0.0.1:1", conf: {spark.memwal.cli_test: configured}}
            merge: {budget_bytes: 3KB, max_generations: 3}
          - name: beta
            uri: b
            secrets: {aws_secret_access_key: MEMWAL_CLI_TEST_SECRET}
    """)
    return root, path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("error")]


def test_config_table_settings_and_flags_over_them(tables, capsys):
    root, path = tables
    before = tree(str(root / "a"))
    rc, out, _ = _run(capsys, "maintain", "--config", path, "--table", "alpha", "--dry-run", "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["table"] == str(root / "a") and plan["dry_run"] and plan["failed"] == []
    merge_plan = plan["steps"]["merge"]["plan"]
    assert (merge_plan["budget_bytes"], merge_plan["max_generations"]) == (3 * 1024, 3)
    rc, out, _ = _run(capsys, "maintain", "--config", path, "--table", "alpha", "--dry-run", "--json",
                      "--budget", "256MB", "--max-generations", "5")
    merge_plan = json.loads(out)["steps"]["merge"]["plan"]
    assert (merge_plan["budget_bytes"], merge_plan["max_generations"]) == (256 << 20, 5)
    assert max(len(b["generations"]) for b in merge_plan["batches"]) == 5
    assert tree(str(root / "a")) == before  # a dry run touches nothing


def test_flags_are_checked_like_the_config_file(tmp_path, tables, capsys):
    _, path = tables
    cases = [("--budget=lots", "merge", "{budget_bytes: lots}", "merge.budget_bytes"),
             ("--max-generations=0", "merge", "{max_generations: 0}", "merge.max_generations"),
             ("--spark-master=lokal[2]", "spark", '{master: "lokal[2]"}', "spark.master"),
             ("--base-versions-older-than=-5", "gc", "{cleanup_base_versions_older_than_seconds: -5}",
              "gc.cleanup_base_versions_older_than_seconds")]
    for flag, section, value, key in cases:
        bad = _config(tmp_path, f"""
            tables:
              - {{name: t, uri: data/t, {section}: {value}}}
        """)
        with pytest.raises(ConfigError) as from_file:
            load_config(bad)
        rc, out, err = _run(capsys, "maintain", "--config", path, "--table", "alpha", flag)
        (line,) = _errors(err)
        assert rc == 1 and out == ""
        expected = str(from_file.value)
        assert line == f"error: {flag.split('=')[0]}: {expected[expected.index(key):]}", (line, expected)
    rc, _, err = _run(capsys, "maintain", "--config", path, "--table", "alpha", "--spark-conf", "nokey")
    assert rc == 1 and _errors(err) == ["error: --spark-conf expects KEY=VALUE, got 'nokey'"]


def test_which_table(tables, capsys):
    root, path = tables
    wrong = [(["--config", path, "--table", "alpah"],
              f"error: {path} has no table 'alpah' (did you mean 'alpha'?); configured tables: alpha, beta"),
             (["--config", path], f"error: {path} configures 2 tables (alpha, beta): choose one with --table NAME"),
             (["--table", "alpha"], "error: --table NAME needs --config FILE (the file that configures the table)"),
             ([str(root / "a"), "--config", path], "error: give either a URI"),
             ([], "error: which table? give its URI, or --config FILE [--table NAME]")]
    for cmd in ("status", "maintain"):
        for args, message in wrong:
            rc, out, err = _run(capsys, cmd, *args)
            assert rc == 1 and out == "" and len(_errors(err)) == 1 and _errors(err)[0].startswith(message), err
    # --table may be left out when the file has one table.
    (root / "one").mkdir(exist_ok=True)
    one = _config(root / "one", f"tables:\n  - {{name: only, uri: {root / 'a'}}}\n")
    rc, out, _ = _run(capsys, "status", "--config", one, "--json")
    assert rc == 0 and json.loads(out)["table"].rstrip("/").endswith("/a")


def test_secrets_come_from_the_environment(tables, capsys, monkeypatch):
    _, path = tables
    monkeypatch.delenv("MEMWAL_CLI_TEST_SECRET", raising=False)
    rc, out, err = _run(capsys, "status", "--config", path, "--table", "beta")
    assert rc == 1 and out == ""
    (line,) = _errors(err)
    assert "MEMWAL_CLI_TEST_SECRET" in line and "not set" in line and "aws_secret_access_key" in line
    monkeypatch.setenv("MEMWAL_CLI_TEST_SECRET", SECRET)
    rc, out, err = _run(capsys, "status", "--config", path, "--table", "beta", "--json")
    assert rc == 0 and json.loads(out)["pending_generations"] > 0
    assert SECRET not in out + err
    # A secret flag for a bare URI travels beside the TableConfig (which holds no secret values).
    plain, secrets = cli.split_secrets({"aws_region": "r", "secret_access_key": SECRET})
    assert plain == {"aws_region": "r"} and secrets == {"aws_secret_access_key": SECRET}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _frames(shown: str) -> list[str]:
    """What a terminal shows of each redraw (control codes removed)."""
    frames = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f) for f in re.split(r"\r|\n", shown)]
    return [f.strip() for f in frames if f.strip()]


def test_progress_line_on_a_terminal(monkeypatch):
    """On a terminal: a bar labelled with the table's name, redrawn in place (one line on the
    screen), the latest event's text beside it; cleared when the pass prints a line or ends."""
    monkeypatch.setenv("COLUMNS", "160")
    term = _Terminal()
    line = cli.ProgressLine("t", term)
    for n in (1, 2):
        line(MergeProgress(n, 2, 1, 2048, 1, 2, 4096, 2, n - 1, (n - 1) * 2048, False))
        line(MergeProgress(n, 2, 1, 2048, 1, 2, 4096, 2, n, n * 2048, True))
    assert line.open
    shown = term.getvalue()
    drawn = _frames(shown)
    assert len(drawn) >= 4 and all(f.startswith("t ") for f in drawn), drawn  # the label: the table's name
    assert drawn[-1].endswith("merge: batch 2/2 merged: 2/2 generations, 4.0 KiB of 4.0 KiB, 2 regions"), drawn
    assert "\n" not in shown  # one line, redrawn in place
    line.end()
    assert not line.open and term.getvalue().startswith(shown) and term.getvalue() != shown  # cleared


def test_progress_line_on_a_narrow_terminal_keeps_its_label(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    term = _Terminal()
    line = cli.ProgressLine("events", term)
    line(MergeProgress(1, 2, 1, 2048, 1, 2, 4096, 2, 1, 2048, True))
    (frame, *_) = _frames(term.getvalue())
    assert frame.startswith("events ") and frame.endswith("…") and len(frame) <= 60, frame
    line.end()


def test_progress_lines_in_a_file_are_plain():
    """Not a terminal (a log file, a pipe): one plain line per event, no control codes."""
    out = io.StringIO()
    line = cli.ProgressLine("t", out)
    line(MergeProgress(1, 2, 1, 2048, 1, 2, 4096, 2, 1, 2048, True))
    line.end()
    assert out.getvalue() == "[t] merge: batch 1/2 merged: 1/2 generations, 2.0 KiB of 4.0 KiB, 2 regions\n"


def test_tables_are_plain_columns_off_a_terminal_and_fit_a_terminal(monkeypatch):
    """`memwal status`'s table (rich): written to a file, plain columns two spaces apart, one row
    per line starting with its first cell, whole values, no control codes or box characters, no
    trailing spaces; on a narrow terminal the value column gives way, the numbers keep theirs."""
    from memwal_pipeline.cli.tables import Column, print_table

    cols = [Column("region", min_width=36), Column("value", max_width=24), Column("rows", right=True),
            Column("lag", right=True)]
    rid = "1a2b3c4d-0000-4000-8000-000000000000"
    rows = [[rid, "tenant=a rather long value, region=eu-west-1", "12", "3.5h"], [rid.replace("1a", "ff"), "bucket=2",
                                                                                 "7", "-"]]
    out = io.StringIO()
    print_table(cols, rows, out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["region", "value", "rows", "lag"]
    assert lines[1].startswith(f"{rid}  tenant=a rather long value, region=eu-west-1  ")
    assert lines[1].endswith("  12  3.5h") and lines[2].endswith("   7     -")
    assert all(ln == ln.rstrip() and "\x1b" not in ln and not set(ln) & set("│─┃━╭╮") for ln in lines)
    monkeypatch.setenv("COLUMNS", "60")
    term = _Terminal()
    print_table(cols, rows, term)
    shown = _frames(term.getvalue())
    assert all(len(ln) <= 60 for ln in shown) and shown[1].endswith("12  3.5h") and "…" in shown[1], shown


def test_maintain_configured_table_with_progress_and_json(tables, capsys, spark):
    """The configured table, merged in small batches with a budget from the command line: one
    progress line per batch start and end, k of n as planned; stdout is the JSON report only;
    the table's Connect server is not used (nobody listens there) and --spark-conf reaches the
    session."""
    root, path = tables
    loc = open_store(str(root / "a"))
    plan = merge.plan_merge(loc, budget_bytes=2048, max_generations=3)
    n, total = len(plan.batches), sum(len(b.generations) for b in plan.batches)
    assert n >= 2
    rc, out, err = _run(capsys, "maintain", "--config", path, "--table", "alpha", "--budget", "2KB",
                        "--spark-conf", "spark.memwal.cli_test=flag", "--only", "merge", "--json")
    assert rc == 0, err
    report = json.loads(out)  # stdout: nothing but the report
    assert report["steps"]["merge"]["metrics"]["generations_merged"] == total
    assert report["steps"]["merge"]["status"] == "ok" and report["failed"] == []
    lines = [ln for ln in err.splitlines() if ln.startswith("[alpha] merge: batch")]
    started = [ln for ln in lines if "merging" in ln]
    finished = [ln for ln in lines if " merged: " in ln]
    assert [ln.split()[3] for ln in started] == [f"{k}/{n}:" for k in range(1, n + 1)], lines
    assert len(finished) == n and finished[-1].startswith(f"[alpha] merge: batch {n}/{n} merged: {total}/{total} generations")
    assert spark.conf.get("spark.memwal.cli_test") == "flag"
    assert table.read_memwal_state(loc).merged == {rid: max(g for g in gens) for rid, gens in plan.pending.items()}
