"""A Dagster run process whose table is on a Spark Connect server (sc://...): materializes
base_table over all region partitions and exits. A separate process because pyspark refuses a
Connect session in a process that already has a classic one (the test session's)."""

import sys

from dagster import DagsterInstance, materialize

from memwal_core.options import SparkOptions
from memwal_core.state import region
from memwal_core.state.store import open_store
from memwal_pipeline.config import TableConfig
from memwal_pipeline.definitions import table_definitions
from memwal_pipeline.tags import PARTITION_RANGE_END, PARTITION_RANGE_START

uri, remote = sys.argv[1], sys.argv[2]
td = table_definitions(TableConfig(name="t", uri=uri, spark=SparkOptions(master=remote)))
regions = sorted(region.list_regions(open_store(uri).store).region_ids)
with DagsterInstance.ephemeral() as instance:
    instance.add_dynamic_partitions(td.partitions.name, regions)
    base = next(a for a in td.assets if a.key.path[-1] == "base_table")
    r = materialize([base], instance=instance, resources=td.resources,
                    tags={PARTITION_RANGE_START: regions[0], PARTITION_RANGE_END: regions[-1]})
sys.exit(0 if r.success else 1)
