"""The Dagster UI as a person sees it, in a headless browser: the table's asset graph and the
partitions page of one region, after a real merge and a maintenance run, captured as the
screenshots docs/ shows.

`dagster-webserver` serves a temporary DAGSTER_HOME holding the runs of a table written by
pylance ShardWriters (3 bucket regions): one merge run over every region, a maintenance run
(its MemWAL index snapshot names each region's value), and each region's `region_generations`.
Chromium (tests/support/browser.py) opens the two pages; the test waits for their real content
(asset names, a region's `bucket=N`), not the loading state, before it captures them.

The pictures go to the test's temporary directory; with `MEMWAL_UPDATE_SCREENSHOTS=1`
(`make screenshots`) they replace docs/ui-asset-graph.png and docs/ui-region-partitions.png.
Either way the docs' copies must have the size this test takes them at, so a change of layout
here without new pictures in docs/ fails.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import urllib.parse

import pytest
from dagster import DagsterInstance, materialize
from support.browser import launch, unavailable
from support.tables import make_table
from support.webserver import WebServer

from memwal_core.state.store import open_store
from memwal_pipeline.config import load_config
from memwal_pipeline.definitions import build_definitions, table_definitions
from memwal_pipeline.tags import PARTITION_RANGE_END, PARTITION_RANGE_START

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
NAME = "events"
ASSETS = ("region_generations", "base_table", "base_compaction", "index_catchup", "memwal_index", "garbage")
SCALE = 2  # device pixels per CSS pixel: sharp text in the docs
# name -> CSS viewport; at 1800 wide the graph's six nodes show their details
SHOTS = {"ui-asset-graph.png": (1800, 560), "ui-region-partitions.png": (1600, 1000)}
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
WAIT_MS = 120_000  # the UI's first load compiles its queries; slower while other suites run


# Skipped before the Spark session and the runs it would need, saying how to install the browser.
pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def png_size(path: str) -> tuple[int, int]:
    """A PNG's width and height, from its IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def _populate(instance, config: str, regions: list[str]) -> None:
    """One merge run over every region (a range run, as the sensor requests it), a maintenance
    run (its MemWAL index snapshot records each region's value), then each region's
    `region_generations`, with asset checks, all into `instance`."""
    (cfg,) = load_config(config)
    td = table_definitions(cfg)
    defs = build_definitions([cfg])
    merge, maintenance = defs.resolve_job_def(td.merge_job.name), defs.resolve_job_def(td.maintenance_job.name)
    (gens,) = [a for a in td.assets if a.key.path[-1] == "region_generations"]
    instance.add_dynamic_partitions(td.partitions.name, regions)
    assert merge.execute_in_process(instance=instance, run_config=QUIET, tags={
        PARTITION_RANGE_START: regions[0], PARTITION_RANGE_END: regions[-1]}).success
    assert maintenance.execute_in_process(instance=instance, run_config=QUIET).success
    for rid in regions:
        assert materialize([gens, *td.checks_for(gens.key)], partition_key=rid, instance=instance,
                           resources=td.resources, run_config=QUIET).success


def _wait_for_text(page, needles: list[str], pattern: str = "") -> str:
    """Waits until every needle (and `pattern`) is on the page and nothing on it is still
    "Loading": the JS app has fetched and drawn the real content. Returns the page's text."""
    page.wait_for_function(
        """([needles, pattern]) => {
            const text = document.body.innerText;
            return needles.every(n => text.includes(n)) && !text.includes("Loading")
                && (!pattern || new RegExp(pattern).test(text));
        }""", arg=[needles, pattern], timeout=WAIT_MS)
    return page.inner_text("body")


def test_ui_pages_of_a_merged_table_in_a_browser(spark, tmp_path):
    loc = open_store(str(tmp_path / "table"))
    w = make_table(loc, regions=3, rounds=2)
    regions = sorted(w.regions.values())
    config = tmp_path / "memwal.yaml"
    config.write_text(f"tables:\n  - name: {NAME}\n    uri: {loc.lance_uri}\n    spark: {{master: 'local[2]'}}\n")
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(f"storage:\n  sqlite:\n    base_dir: {home}\ntelemetry:\n  enabled: false\n")
    out = tmp_path / "shots"
    out.mkdir()

    with DagsterInstance.from_config(str(home)) as instance:
        instance.get_runs()  # the SQLite storage exists before the server opens it
        server = WebServer(str(home), str(config), str(tmp_path / "webserver.log"))
        try:
            _populate(instance, str(config), regions)  # while the server's code location loads
            server.wait_ready()
            server.dismiss_welcome()
            location = urllib.parse.quote(f"__repository__@{server.location()}", safe="@")
            graph_url = f"{server.url}/locations/{location}/asset-groups/{NAME}"
            region = regions[0]
            parts_url = (f"{server.url}/assets/{NAME}/region_generations?view=partitions"
                         f"&partition={urllib.parse.quote(region)}")

            with launch() as browser:
                (w1, h1), (w2, h2) = SHOTS.values()
                page = browser.new_page(viewport={"width": w1, "height": h1}, device_scale_factor=SCALE)
                page.goto(graph_url, timeout=WAIT_MS)
                text = _wait_for_text(page, [*ASSETS, "Latest event", "Materialized"])
                # Every node drawn with its last materialization; none "Never materialized".
                assert "Never materialized" not in text, text
                assert text.count("Materialized") == 3, text  # base_compaction, memwal_index, garbage
                # region_generations and base_table: every region's partition materialized
                assert text.count(f"{len(regions)} partitions") == 2 and text.count("100% filled") == 2, text
                page.screenshot(path=str(out / "ui-asset-graph.png"))

                page = browser.new_page(viewport={"width": w2, "height": h2}, device_scale_factor=SCALE)
                page.goto(parts_url, timeout=WAIT_MS)
                text = _wait_for_text(page, [region, "merged_generation", "pending_generations", "region_value"],
                                      r"bucket=\d")
                assert f"Materialized ({len(regions)})" in text and "Missing (0)" in text, text
                assert "Failed (0)" in text, text
                # The region as observed after the merge: nothing pending, its generations merged.
                assert re.search(r"pending_generations\s+0\s", text), text
                assert re.search(r"merged_generation\s+[1-9]", text), text
                page.screenshot(path=str(out / "ui-region-partitions.png"))
        finally:
            server.stop()

    update = os.environ.get("MEMWAL_UPDATE_SCREENSHOTS") == "1"
    for name, (width, height) in SHOTS.items():
        taken = str(out / name)
        assert png_size(taken) == (width * SCALE, height * SCALE)
        if update:
            shutil.copyfile(taken, os.path.join(DOCS, name))
        docs = os.path.join(DOCS, name)
        if not os.path.exists(docs) or png_size(docs) != png_size(taken):
            pytest.fail(f"docs/{name} is not what this test takes ({png_size(taken)} px): "
                        "refresh it with `make screenshots`")
