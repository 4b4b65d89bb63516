"""What the batches of one merge run share, each part complete when the run starts.

`Run` holds no loose state of its own: the base table's shape (`BaseTable`, fixed), and the
objects that own what a run learns as it goes: its walls (`walls.Walls`), region values
(`owners.RegionOwnership`), the keys it merged (`exclusivity.KeyLedger`), the columns the base
table dropped (`DroppedColumns`, looked up at most once) and the result it reports.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa

from memwal_core.errors import MemwalError
from memwal_core.jobs.merge.exclusivity import KeyLedger
from memwal_core.jobs.merge.owners import RegionOwnership
from memwal_core.jobs.merge.result import MergeResult
from memwal_core.jobs.merge.walls import Walls
from memwal_core.spark import tasks as sparkpath
from memwal_core.state.keys import refuse_unsupported_keys
from memwal_core.state.store import TableLocation
from memwal_core.state.table import open_dataset, primary_key, refuse_stable_row_ids

log = logging.getLogger("memwal.merge")


@dataclass(frozen=True)
class BaseTable:
    """The base table as a run merges into it: key columns, columns in order, schema, and each
    top-level column's Lance field id."""

    loc: TableLocation
    pk: tuple[str, ...]
    columns: tuple[str, ...]
    schema: pa.Schema
    field_ids: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, loc: TableLocation, ds) -> "BaseTable":
        """Refuses, before any work, a table memwal cannot merge into: no primary key, a key
        type no predicate matches exactly, stable row ids (merge_insert would mint new ones)."""
        pk = primary_key(ds)
        refuse_unsupported_keys(ds.schema, pk, loc.lance_uri)
        refuse_stable_row_ids(ds)
        return cls(loc, tuple(pk), tuple(f.name for f in ds.schema), ds.schema,
                   tuple((f.name(), f.id()) for f in ds.lance_schema.fields()))

    @property
    def key_types(self) -> pa.Schema:
        return pa.schema([pa.field(c, self.schema.field(c).type) for c in self.pk])


_SCHEMA_CACHE: dict[tuple[str, int], tuple[tuple[str, int], ...]] = {}  # versions are immutable


class DroppedColumns:
    """(name, field id) of every top-level column some retained version of the base table had
    and the current one does not (`drop_columns`, or dropped and re-added: a new field id).
    Looked up once per run, only when a generation has a column the base table's schema does
    not; a column whose version was cleaned up cannot be told from a foreign one: it stays
    refused."""

    def __init__(self, base: BaseTable) -> None:
        self._base = base
        self.fields: tuple[tuple[str, int], ...] | None = None  # None: not looked up

    @property
    def known(self) -> bool:
        return self.fields is not None

    def look_up(self) -> tuple[tuple[str, int], ...]:
        ds = open_dataset(self._base.loc)
        seen: set[tuple[str, int]] = set()
        for v in sorted((int(v["version"]) for v in ds.versions()), reverse=True):
            key = (self._base.loc.lance_uri, v)
            if key not in _SCHEMA_CACHE:
                try:
                    _SCHEMA_CACHE[key] = tuple((f.name(), f.id()) for f in ds.checkout_version(v).lance_schema.fields())
                except Exception as e:  # noqa: BLE001 - cleaned up meanwhile: nothing learnt from it
                    log.info("base table version %d unreadable while looking for dropped columns: %s", v, e)
                    continue
            seen.update(_SCHEMA_CACHE[key])
        self.fields = tuple(sorted(seen - set(self._base.field_ids)))
        return self.fields


def unmatched_fields(stats: list[sparkpath.GenerationStats]) -> set[tuple[str, int]]:
    """(name, field id) of generation columns the base table's schema does not have as such."""
    return {f for s in stats for f in s.fields}


class PlanOutlived(MemwalError):
    """The table was overwritten (or its MemWAL initialized again) after the plan was made: no
    commit of the plan may land in the new table. The run stops; the next one re-plans."""


@dataclass(frozen=True)
class Run:
    base: BaseTable
    spark: Any
    tasks: int          # Spark tasks per batch
    max_attempts: int   # commit attempts per batch before the run gives up
    walls: Walls
    ownership: RegionOwnership
    keys: KeyLedger
    dropped: DroppedColumns
    result: MergeResult
    # Why the plan belongs to an earlier lifetime of the table at a version (None: it does not);
    # asked of every version a commit reads, so an overwrite during the run is caught.
    outlived: Callable[[int], str | None] = lambda version: None

    @property
    def loc(self) -> TableLocation:
        return self.base.loc
