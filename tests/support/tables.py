"""A demo table for the Dagster tests, its `TableConfig` (GC without waiting periods), and its
rows by key."""

from __future__ import annotations

from memwal_core.options import GcOptions, SparkOptions
from memwal_core.state import table
from memwal_core.tools import demo
from memwal_pipeline.config import TableConfig


def rows(loc) -> dict:
    """The base table's rows by primary key `id`."""
    return {r["id"]: r for r in table.open_dataset(loc).to_table().to_pylist()}


def make_table(loc, seed=1, regions=3, rounds=2):
    """A bucket-sharded demo table with `rounds` rounds of writes; returns the workload (its model)."""
    demo.create_table(loc, sharding="bucket", num_buckets=regions, base_rows=20, btree_index=True)
    w = demo.Workload(loc, seed=seed, key_space=200, max_memtable_rows=50)
    for _ in range(rounds):
        w.write_round(90, overwrite=0.3, delete=0.05, puts_per_batch=10)
    return w


def cfg_for(loc, name="t", **kw) -> TableConfig:
    """The table's config with `local[2]` Spark and GC that waits for nothing (no minimum ages)."""
    kw.setdefault("spark", SparkOptions(master="local[2]"))
    kw.setdefault("gc", GcOptions(manifest_min_age_seconds=0, orphan_grace_seconds=0,
                                  cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0))
    return TableConfig(name=name, uri=loc.lance_uri, storage_options=dict(loc.storage_options), **kw)
