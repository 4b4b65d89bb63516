"""A table's two dynamic partition sets, and the readable name of a region partition.

- Regions (`{table}_regions`): one partition per region id, added by the manifest sensor when a
  region appears and deleted when a sealed region is retired.
- Indexes (`{table}_indexes`): one partition per base-table index (`index_catchup`), kept
  current by the sensor before each maintenance run it requests: indexes are created and
  dropped at run time, so a fixed set of asset specs (a multi-asset) would need a code reload.

A region partition's key is its UUID; what a reader recognizes is the region's *value* (the
routing value its rows carry: `bucket=3`, an identity value, `unsharded`). Dagster has no
per-partition description, so the value goes into the partition's metadata (`region_value`)
wherever memwal records an event for that partition, and into a single-region merge run's tags
(`tags.REGION_VALUE_TAG`).

Why the key is not the value (`bucket=3 · 1a2b3c4d`): the key must exist when the region
appears, before its value is recorded (by the next `memwal_index` run, provisional until one of
its generations merges); a value is not unique over time (a retired region and the region that
replaces it share it); and a Dagster partition cannot be renamed, so a key that changed with
the value would start a new history and strand the runs and partition ranges naming the old one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dagster import DynamicPartitionsDefinition

from memwal_core.state import memwal_index, routing
from memwal_core.state.region_values import region_specs, snapshot_field_values
from memwal_core.state.store import TableLocation
from memwal_core.state.table import MemWalState

from .tags import partition_range

log = logging.getLogger("memwal.partitions")

UNSHARDED = "unsharded"
NOT_RECORDED = "not recorded yet"


def index_partitions(table: str) -> DynamicPartitionsDefinition:
    """`index_catchup`'s partitions (the region partitions are named by `assets.TableKeys`)."""
    return DynamicPartitionsDefinition(name=f"{table}_indexes")


def index_range_tags(instance, partitions: DynamicPartitionsDefinition) -> dict[str, str]:
    """Tags of a maintenance run over every index partition (none: no index partition yet, and
    `index_catchup` then records one table-wide materialization instead)."""
    keys = list(instance.get_dynamic_partitions(partitions.name))
    return partition_range(keys[0], keys[-1]) if keys else {}


def format_value(values: dict) -> str:
    """`{field id: value}` as `field=value`, fields in id order (`bucket=3`, `tenant=acme`)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(values.items()))


@dataclass
class RegionLabels:
    """Region id -> its readable value, from the MemWAL index snapshot (one read per tick or run).

    A region the snapshot does not name yet (new since the last `memwal_index` run) reads
    `not recorded yet`, unless the table is unsharded. Values the snapshot marks provisional
    (read from a generation not merged yet) are shown too: a label, not a routing decision.
    """

    values: dict[str, dict] = field(default_factory=dict)
    unsharded: bool = False

    @classmethod
    def load(cls, loc: TableLocation, state: MemWalState) -> RegionLabels:
        specs = list(region_specs(state).values())
        unsharded = bool(specs) and all(f.transform == routing.UNSHARDED for s in specs for f in s.fields)
        try:
            values = snapshot_field_values(memwal_index.read_snapshot(loc, state))
        except memwal_index.SnapshotNotFound:
            values = {}
        except Exception as e:  # noqa: BLE001 - a label must never stop the sensor or a merge
            log.warning("region values unavailable (%s): partitions show their id only", e)
            values = {}
        return cls(values, unsharded)

    @classmethod
    def of(cls, loc: TableLocation) -> RegionLabels:
        """`load` on the table's current state; no labels (ids only) when that cannot be read:
        a label never fails a run, a check or `memwal status` that did its work."""
        from memwal_core.state.table import read_memwal_state

        try:
            return cls.load(loc, read_memwal_state(loc))
        except Exception as e:  # noqa: BLE001
            log.warning("region values unavailable (%s): regions show their id only", e)
            return cls()

    def label(self, region_id: str) -> str:
        if self.unsharded:
            return UNSHARDED
        vals = self.values.get(region_id)
        return format_value(vals) if vals else NOT_RECORDED
