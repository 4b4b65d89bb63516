"""The Dagster UI on a real table: `dagster-webserver` serves the workspace and its GraphQL API
shows the table's assets, its region partitions and the metadata of real materializations.

The webserver runs in a subprocess with a temporary DAGSTER_HOME (SQLite) and a temporary
MEMWAL_CONFIG naming a table written by pylance ShardWriters; the test materializes assets
into the same instance on disk, so the server reads exactly what the runs recorded.
"""

from __future__ import annotations

import json

import pytest
from dagster import DagsterInstance, materialize
from support.webserver import LOCATIONS, WebServer

from memwal_core.state.store import open_store
from memwal_core.tools import demo
from memwal_pipeline.config import load_config
from memwal_pipeline.definitions import table_definitions
from memwal_pipeline.tags import PARTITION_RANGE_END, PARTITION_RANGE_START

NAME = "uitable"
ASSETS = ("region_generations", "base_table", "base_compaction", "index_catchup", "memwal_index", "garbage")
BASE_ROWS = 20


ASSET_NODES = """
query AssetNodes($group: String!, $location: String!) {
  assetNodes(group: {groupName: $group, repositoryName: "__repository__", repositoryLocationName: $location}) {
    assetKey { path }
    groupName
    isPartitioned
    partitionKeys
    partitionDefinition { type name dimensionTypes { type dynamicPartitionsDefinitionName } }
    dependencyKeys { path }
    pools
    description
  }
}
"""

PARTITIONS_AND_LATEST = """
query BaseTable($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    __typename
    ... on AssetNode {
      partitionKeys
      partitionStats { numPartitions numMaterialized numFailed }
      assetPartitionStatuses {
        __typename
        ... on DefaultPartitionStatuses { materializedPartitions unmaterializedPartitions failedPartitions }
      }
      assetMaterializations(limit: 10) {
        runId
        partition
        timestamp
        metadataEntries {
          __typename
          label
          ... on IntMetadataEntry { intValue intRepr }
          ... on FloatMetadataEntry { floatValue }
          ... on JsonMetadataEntry { jsonString }
          ... on TextMetadataEntry { text }
        }
      }
    }
  }
}
"""


def _values(entries: list[dict]) -> dict:
    out = {}
    for e in entries:
        kind = e["__typename"]
        if kind == "IntMetadataEntry":
            out[e["label"]] = int(e["intRepr"])
        elif kind == "FloatMetadataEntry":
            out[e["label"]] = e["floatValue"]
        elif kind == "JsonMetadataEntry":
            out[e["label"]] = json.loads(e["jsonString"])
        else:
            out[e["label"]] = e.get("text", kind)
    return out


@pytest.fixture
def ui_env(tmp_path):
    """A table with 3 bucket regions written by ShardWriters, its config file and a Dagster home."""
    loc = open_store(str(tmp_path / "table"))
    demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=BASE_ROWS, btree_index=True)
    w = demo.Workload(loc, seed=7, key_space=200, max_memtable_rows=50)
    for _ in range(2):
        w.write_round(90, overwrite=0.3, delete=0.05, puts_per_batch=10)
    config = tmp_path / "memwal.yaml"
    config.write_text(f"tables:\n  - name: {NAME}\n    uri: {loc.lance_uri}\n    spark: {{master: 'local[2]'}}\n")
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        f"storage:\n  sqlite:\n    base_dir: {home}\ntelemetry:\n  enabled: false\n")
    return loc, w, str(config), str(home)


def test_webserver_graphql_shows_assets_partitions_and_metadata(ui_env, spark, tmp_path):
    loc, w, config, home = ui_env
    (cfg,) = load_config(config)
    td = table_definitions(cfg)
    regions = sorted(w.regions.values())
    assert len(regions) == 3
    by = {a.key.path[-1]: a for a in td.assets}

    with DagsterInstance.from_config(home) as instance:
        # Create the SQLite storage before the server opens it, then let the server start
        # (its code server imports the definitions) while Spark merges.
        instance.add_dynamic_partitions(td.partitions.name, regions)
        server = WebServer(home, config, str(tmp_path / "webserver.log"))
        try:
            r = materialize([by["region_generations"]], partition_key=regions[0], instance=instance,
                            resources=td.resources)
            assert r.success
            r = materialize([by["base_table"]], instance=instance, resources=td.resources,
                            tags={PARTITION_RANGE_START: regions[0],
                                  PARTITION_RANGE_END: regions[-1]})
            assert r.success
            in_process = {m.partition: m.metadata for m in r.asset_materializations_for_node(by["base_table"].op.name)}
            run_id = r.run_id

            server.wait_ready()
            location = server.graphql(LOCATIONS)["workspaceOrError"]["locationEntries"][0]["name"]

            # 1. The table's six assets, in its own group, chained in dependency order.
            nodes = server.graphql(ASSET_NODES, {"group": NAME, "location": location})["assetNodes"]
            by_key = {"/".join(n["assetKey"]["path"]): n for n in nodes}
            assert set(by_key) == {f"{NAME}/{a}" for a in ASSETS}
            deps = {k: sorted("/".join(d["path"]) for d in n["dependencyKeys"]) for k, n in by_key.items()}
            assert deps == {f"{NAME}/region_generations": [],
                            f"{NAME}/base_table": [f"{NAME}/region_generations"],
                            f"{NAME}/base_compaction": [f"{NAME}/base_table"],
                            f"{NAME}/index_catchup": [f"{NAME}/base_compaction"],
                            f"{NAME}/memwal_index": [f"{NAME}/index_catchup"],
                            f"{NAME}/garbage": [f"{NAME}/memwal_index"]}
            assert all(n["description"] for n in nodes)
            assert by_key[f"{NAME}/base_table"]["pools"] == [f"memwal_{NAME}"]

            # 2. Region partitions: the dynamic partitions definition's keys are the region ids.
            for short in ("region_generations", "base_table"):
                n = by_key[f"{NAME}/{short}"]
                assert n["isPartitioned"]
                assert n["partitionDefinition"]["type"] == "DYNAMIC"
                assert n["partitionDefinition"]["dimensionTypes"][0]["dynamicPartitionsDefinitionName"] \
                    == f"{NAME}_regions"
                assert sorted(n["partitionKeys"]) == regions
            for short in ("base_compaction", "memwal_index", "garbage"):
                assert not by_key[f"{NAME}/{short}"]["isPartitioned"]
            # index_catchup: one partition per base-table index (the sensor keeps them current).
            n = by_key[f"{NAME}/index_catchup"]
            assert n["isPartitioned"] and n["partitionDefinition"]["type"] == "DYNAMIC"
            assert n["partitionDefinition"]["dimensionTypes"][0]["dynamicPartitionsDefinitionName"] \
                == f"{NAME}_indexes"

            # 3. base_table: every region materialized by the one backfill run, with its metadata.
            node = server.graphql(PARTITIONS_AND_LATEST,
                                  {"key": {"path": [NAME, "base_table"]}})["assetNodeOrError"]
            assert node["__typename"] == "AssetNode"
            assert sorted(node["partitionKeys"]) == regions
            assert node["partitionStats"] == {"numPartitions": 3, "numMaterialized": 3, "numFailed": 0}
            statuses = node["assetPartitionStatuses"]
            assert sorted(statuses["materializedPartitions"]) == regions
            assert statuses["unmaterializedPartitions"] == [] and statuses["failedPartitions"] == []
            mats = node["assetMaterializations"]
            assert sorted(m["partition"] for m in mats) == regions
            assert {m["runId"] for m in mats} == {run_id}
            latest = max(mats, key=lambda m: int(m["timestamp"]))
            md = _values(latest["metadataEntries"])
            # Each partition's metadata is that region's own numbers (2 rounds, one flush each),
            # plus the run's facts labelled `run/`.
            assert md["generations_merged"] == 2 and md["pending_generations"] == 0
            assert md["merged_generation"] >= 2
            assert md["run/regions"] == 3 and md["run/commits"] == 1
            assert md["rows_read"] > 0 and md["bytes_read"] > 0
            assert isinstance(md["run/duration_s"], float) and md["run/duration_s"] > 0
            # What the UI shows is what the run recorded, for that partition.
            recorded = in_process[latest["partition"]]
            assert md == {k: v.value for k, v in recorded.items()}

            # region_generations: the one partition materialized, with the pending generations it saw.
            node = server.graphql(PARTITIONS_AND_LATEST,
                                  {"key": {"path": [NAME, "region_generations"]}})["assetNodeOrError"]
            assert [m["partition"] for m in node["assetMaterializations"]] == [regions[0]]
            md = _values(node["assetMaterializations"][0]["metadataEntries"])
            assert md["pending_generations"] == 2 and md["merged_generation"] == 0
            assert md["region_value"]  # the region's routing value beside its UUID (bucket=N, or not recorded yet)
            assert node["partitionStats"]["numMaterialized"] == 1
        finally:
            server.stop()
