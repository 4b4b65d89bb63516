"""The base-version retention floor (`GcOptions.cleanup_base_versions_floor_seconds`) on real
pylance tables: no configuration of memwal's base-version cleanup removes a version younger
than the floor, an age below it is refused, and only the explicit floor option lowers it."""

from __future__ import annotations

import time
from datetime import timedelta

import lance
import pyarrow as pa
import pytest
from support.helpers import tree
from hypothesis import given
from hypothesis import strategies as st

from memwal_core.errors import OptionError
from memwal_core.jobs import gc
from memwal_core.options import GcOptions, from_mapping, parse_duration
from memwal_core.state.store import open_store
from memwal_core.tools import demo
from memwal_pipeline import cli
from memwal_pipeline.config import ConfigError, single_table, table_from_mapping

DAY = 86400.0


def _versions(loc) -> list[int]:
    return [v["version"] for v in lance.dataset(loc.lance_uri).versions()]


def _table(tmp_path, commits: int = 4):
    """A MemWAL table with `commits` more base-table versions (plain appends of fresh keys)."""
    loc = open_store(str(tmp_path / "t"))
    demo.create_table(loc, base_rows=4)
    for i in range(commits):
        lance.write_dataset(demo.rows_table([demo.row(100 + i, 1)]), loc.lance_uri, mode="append")
    return loc


def test_default_floor_is_a_day_and_longer_than_any_run():
    from memwal_core.options import SensorOptions

    assert GcOptions().cleanup_base_versions_floor_seconds == DAY
    assert GcOptions().cleanup_base_versions_floor_seconds >= 24 * SensorOptions().merge_max_runtime_seconds


@pytest.mark.parametrize("raw", [{"cleanup_base_versions_older_than_seconds": 0},
                                 {"cleanup_base_versions_older_than_seconds": "12h"},
                                 {"cleanup_base_versions_older_than_seconds": 60,
                                  "cleanup_base_versions_floor_seconds": "2m"}])
def test_an_age_below_the_floor_is_refused_naming_value_floor_and_override(raw):
    with pytest.raises(OptionError) as e:
        from_mapping(GcOptions, raw, "gc")
    msg = str(e.value)
    age = parse_duration(raw["cleanup_base_versions_older_than_seconds"], "x")
    floor = parse_duration(raw.get("cleanup_base_versions_floor_seconds", DAY), "x")
    assert f"{age:g} s is below the retention floor of {floor:g} s" in msg, msg
    assert "gc.cleanup_base_versions_floor_seconds" in msg and "--base-versions-floor" in msg, msg
    with pytest.raises(OptionError, match="below the retention floor"):
        GcOptions(cleanup_base_versions_older_than_seconds=age, cleanup_base_versions_floor_seconds=floor)


def test_the_floor_option_lowers_it_explicitly():
    assert from_mapping(GcOptions, {"cleanup_base_versions_older_than_seconds": 0,
                                    "cleanup_base_versions_floor_seconds": 0}, "gc").base_cleanup_older_than.total_seconds() == 0
    assert GcOptions(cleanup_base_versions_older_than_seconds=DAY).base_cleanup_older_than.total_seconds() == DAY


@pytest.mark.parametrize("text,want", [("7d", 7 * DAY), ("12h", 43200), ("30m", 1800), ("90s", 90), ("90", 90),
                                       (" 1.5h ", 5400), ("2w", 14 * DAY), (3600, 3600), (0.5, 0.5)])
def test_durations_take_units(text, want):
    assert parse_duration(text, "d") == want
    got = from_mapping(GcOptions, {"cleanup_base_versions_older_than_seconds": text,
                                   "cleanup_base_versions_floor_seconds": 0}, "gc")
    assert got.cleanup_base_versions_older_than_seconds == want


@pytest.mark.parametrize("bad", ["7 days", "h", "-1h", "1e3", "nan", "inf", "7dd", "", True, [1]])
def test_bad_durations_are_refused_naming_the_key(bad):
    with pytest.raises(OptionError, match="gc.orphan_grace_seconds"):
        from_mapping(GcOptions, {"orphan_grace_seconds": bad}, "gc")


@given(age=st.one_of(st.none(), st.floats(0, 10 * DAY)), floor=st.floats(0, 10 * DAY),
       retain=st.one_of(st.none(), st.integers(1, 5)))
def test_effective_age_never_below_the_floor(age, floor, retain):
    """Whatever is configured, the age the cleanup passes to Lance is at least the floor."""
    try:
        o = GcOptions(cleanup_base_versions_older_than_seconds=age, cleanup_base_versions_retain=retain,
                      cleanup_base_versions_floor_seconds=floor)
    except OptionError:
        assert age is not None and age < floor
        return
    # Only the shipped week is lifted to a higher floor instead of refused.
    assert age is None or age >= floor or age == GcOptions().cleanup_base_versions_older_than_seconds
    if o.base_cleanup:
        assert o.base_cleanup_older_than >= timedelta(seconds=floor)  # no rounding below it
        if age is not None:
            assert o.base_cleanup_older_than.total_seconds() - max(age, floor) < 2e-6
    else:
        assert o.base_cleanup_older_than is None


def test_a_cleanup_by_count_alone_keeps_versions_younger_than_the_floor(tmp_path):
    """Lance's `cleanup_old_versions(retain_versions=1)` alone removes every older version
    whatever its age; memwal's cleanup by count never removes one younger than the floor."""
    loc = _table(tmp_path)
    before = _versions(loc)
    assert len(before) >= 5
    out = gc.cleanup_base_versions(loc, GcOptions(cleanup_base_versions_older_than_seconds=None, cleanup_base_versions_retain=1))  # default floor: a day
    assert out["old_versions"] == 0 and _versions(loc) == before
    out = gc.cleanup_base_versions(loc, GcOptions(cleanup_base_versions_older_than_seconds=None, cleanup_base_versions_retain=1, cleanup_base_versions_floor_seconds=3))
    assert out["old_versions"] == 0 and _versions(loc) == before  # all younger than 3 s
    time.sleep(3.2)
    lance.write_dataset(demo.rows_table([demo.row(200, 1)]), loc.lance_uri, mode="append")  # a young version
    lance.write_dataset(demo.rows_table([demo.row(201, 1)]), loc.lance_uri, mode="append")
    out = gc.cleanup_base_versions(loc, GcOptions(cleanup_base_versions_older_than_seconds=None, cleanup_base_versions_retain=1, cleanup_base_versions_floor_seconds=3))
    # The old ones go; both young ones stay although retain=1 alone would keep only the latest.
    assert out["old_versions"] == len(before) and _versions(loc) == [before[-1] + 1, before[-1] + 2]


def test_a_cleanup_by_age_at_the_floor_keeps_young_versions(tmp_path):
    loc = _table(tmp_path, commits=2)
    before = _versions(loc)
    cfg = GcOptions(cleanup_base_versions_older_than_seconds=2, cleanup_base_versions_floor_seconds=2)
    assert gc.cleanup_base_versions(loc, cfg)["old_versions"] == 0 and _versions(loc) == before
    time.sleep(2.2)
    assert gc.cleanup_base_versions(loc, cfg)["old_versions"] == len(before) - 1
    assert _versions(loc) == before[-1:]


def test_run_gc_with_a_count_cleanup_reports_what_the_floor_kept(tmp_path):
    loc = _table(tmp_path)
    n = len(_versions(loc))
    res = gc.run_gc(loc, GcOptions(cleanup_base_versions_older_than_seconds=None, cleanup_base_versions_retain=1, manifest_min_age_seconds=0, orphan_grace_seconds=0))
    assert res.base_cleanup == {"old_versions": 0, "bytes_removed": 0, "versions_after": n, "versions_before": n}


@pytest.mark.parametrize("flags,what", [
    (["--base-versions-older-than=0"], "0 s is below the retention floor of 86400 s"),
    (["--base-versions-older-than=12h"], "43200 s is below the retention floor of 86400 s"),
    (["--base-versions-floor=1h", "--base-versions-older-than=30m"], "1800 s is below the retention floor of 3600 s"),
])
def test_cli_refuses_an_age_below_the_floor(tmp_path, capsys, flags, what):
    loc = _table(tmp_path, commits=1)
    before = tree(loc.store.root)
    rc = cli.main(["maintain", loc.store.root, *flags])
    err = capsys.readouterr().err
    assert rc in (1, 2), err
    assert what in err and "--base-versions-floor" in err and "--base-versions-older-than" in err, err
    assert tree(loc.store.root) == before


def test_cli_config_floor_lowers_it_for_the_flag(tmp_path):
    """The flag is checked against the table's configured floor, not the default."""
    from types import SimpleNamespace

    cfg = single_table("x", base_versions_older_than=60, base_versions_floor=30)
    got = cli.apply_flags(cfg, SimpleNamespace(base_versions_older_than="45"))
    assert got.gc.cleanup_base_versions_older_than_seconds == 45 and got.gc.cleanup_base_versions_floor_seconds == 30
    with pytest.raises(OptionError, match="--base-versions-older-than.*20 s is below the retention floor of 30 s"):
        cli.apply_flags(cfg, SimpleNamespace(base_versions_older_than="20"))
    with pytest.raises(OptionError, match="--base-versions-floor.*60 s is below the retention floor of 120 s"):
        cli.apply_flags(cfg, SimpleNamespace(base_versions_floor="2m"))
    with pytest.raises(ConfigError, match="below the retention floor"):
        single_table("x", base_versions_older_than="1h")
    assert single_table("x", base_versions_older_than="7d").gc.cleanup_base_versions_older_than_seconds == 7 * DAY


def test_the_shipped_retention_is_a_week_within_the_floor_and_can_be_turned_off():
    """GC cleans up base-table versions older than a week by default (LanceDB's `optimize`
    default), never below the floor; `null` / `off` turns the cleanup off, in memwal.yaml, a
    component's yaml and a CLI flag alike (one parser)."""
    from types import SimpleNamespace

    o = GcOptions()
    assert o.base_cleanup and o.base_cleanup_older_than == timedelta(days=7)
    assert o.cleanup_base_versions_older_than_seconds >= o.cleanup_base_versions_floor_seconds
    # A floor raised above the shipped week lifts it (no refusal: the week was not written).
    assert GcOptions(cleanup_base_versions_floor_seconds=14 * DAY).base_cleanup_older_than == timedelta(days=14)
    for off in (None, "off", "null", "None"):
        assert not from_mapping(GcOptions, {"cleanup_base_versions_older_than_seconds": off}, "gc").base_cleanup
    assert table_from_mapping({"name": "t", "uri": "/x", "gc": {"cleanup_base_versions_older_than_seconds": "off"}},
                              "memwal.yaml").gc.base_cleanup is False
    flagged = cli.apply_flags(single_table("x"), SimpleNamespace(base_versions_older_than="off"))
    assert flagged.gc.cleanup_base_versions_older_than_seconds is None
    assert cli.apply_flags(single_table("x"), SimpleNamespace(base_versions_older_than="2w")).gc \
        .cleanup_base_versions_older_than_seconds == 14 * DAY


@pytest.mark.parametrize("section,key,text,want", [("lease", "ttl_seconds", "2m", 120),
                                                   ("slo", "merge_lag_seconds", "15m", 900),
                                                   ("sensor", "max_backoff_seconds", "1h", 3600),
                                                   ("gc", "discard_stale_after_seconds", "3d", 3 * DAY)])
def test_every_duration_setting_takes_units(section, key, text, want):
    cfg = table_from_mapping({"name": "t", "uri": "/x", section: {key: text}}, "memwal.yaml")
    assert getattr(getattr(cfg, section), key) == want
