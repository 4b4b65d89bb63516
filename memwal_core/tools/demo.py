"""Demo and test workloads written by pylance's own `ShardWriter`.

`create_table` makes a MemWAL table (bucket, identity, unsharded or manual regions);
`Workload` writes puts, overwrites and deletes through real writers, one region per region
value, and keeps a plain dict model of what was written, which tests and `memwal demo`
compare against LSM reads.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import lance
import pyarrow as pa
from lance.mem_wal import evaluate_sharding_spec

from memwal_core.state.store import TableLocation

PK = {b"lance-schema:unenforced-primary-key": b"true"}

SCHEMA = pa.schema([
    pa.field("id", pa.int64(), nullable=False, metadata=PK),
    pa.field("n", pa.int64()),
    pa.field("x", pa.float64()),
    pa.field("s", pa.string()),
])


def row(key: int, version: int) -> dict[str, Any]:
    return {"id": key, "n": version, "x": key * 0.5 + version, "s": f"k{key}v{version}"}


def rows_table(rows: list[dict[str, Any]], schema: pa.Schema = SCHEMA) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def create_table(loc: TableLocation, *, sharding: str = "bucket", num_buckets: int = 4,
                 base_rows: int = 0, maintained_indexes: list[str] | None = None,
                 schema: pa.Schema = SCHEMA, btree_index: bool = False) -> lance.LanceDataset:
    """A base table with `base_rows` rows (ids 0..n-1) and MemWAL initialized."""
    data = rows_table([row(i, 0) for i in range(base_rows)], schema)
    ds = lance.write_dataset(data, loc.lance_uri, schema=schema, storage_options=loc.storage_options or None)
    if btree_index:
        ds.create_scalar_index("id", "BTREE", name="id_btree")
    kw: dict[str, Any] = {}
    if maintained_indexes is not None:
        kw["maintained_indexes"] = maintained_indexes
    if sharding == "bucket":
        ds.initialize_mem_wal(bucket_column="id", num_buckets=num_buckets, **kw)
    elif sharding == "identity":
        ds.initialize_mem_wal(identity_column="id", **kw)
    elif sharding == "unsharded":
        ds.initialize_mem_wal(unsharded=True, **kw)
    elif sharding == "manual":
        ds.initialize_mem_wal(**kw)
    else:
        raise ValueError(f"unknown sharding {sharding!r}")
    return lance.dataset(loc.lance_uri, storage_options=loc.storage_options or None)


@dataclass
class Workload:
    """Random writes through pylance ShardWriters, with a dict model of the expected table.

    Each region value (bucket number; a single value for unsharded/manual tables) gets its own
    region UUID, so regions are mutually exclusive as the spec requires.
    """

    loc: TableLocation
    seed: int = 0
    key_space: int = 1000
    max_memtable_rows: int = 200
    model: dict[int, dict[str, Any]] = field(default_factory=dict)
    regions: dict[Any, str] = field(default_factory=dict)  # region value -> region id
    version: int = 0
    durable_write: bool = False  # close() flushes everything; durable puts cost ~80 ms each

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        ds = self.dataset()
        self.model = {r["id"]: r for r in ds.to_table().to_pylist()}
        specs = (ds.mem_wal_index_details() or {}).get("sharding_specs", [])
        self.spec = specs[0] if specs else None
        self.schema = ds.schema

    def dataset(self) -> lance.LanceDataset:
        return lance.dataset(self.loc.lance_uri, storage_options=self.loc.storage_options or None)

    def region_value(self, keys: list[int]) -> list[Any]:
        if self.spec is None or self.spec["fields"][0]["transform"] == "unsharded":
            return [0] * len(keys)
        batch = pa.record_batch([pa.array(keys, pa.int64())], names=["id"])
        out = evaluate_sharding_spec(batch, self.spec, self.dataset().lance_schema)
        return out.column(0).to_pylist()

    def region_for(self, value: Any) -> str:
        if value not in self.regions:
            self.regions[value] = str(uuid.uuid4())
        return self.regions[value]

    def write_round(self, n: int = 100, overwrite: float = 0.2, delete: float = 0.02,
                    absent_delete: float = 0.01, puts_per_batch: int = 50) -> None:
        """`n` operations spread over regions; every writer is opened and closed (flushed)."""
        self.version += 1
        live = list(self.model)
        ops: list[tuple[str, int]] = []
        for _ in range(n):
            r = self.rng.random()
            if r < delete and live:
                ops.append(("del", self.rng.choice(live)))
            elif r < delete + absent_delete:
                ops.append(("del", self.key_space * 10 + self.rng.randrange(self.key_space)))
            elif r < delete + absent_delete + overwrite and live:
                ops.append(("put", self.rng.choice(live)))
            else:
                ops.append(("put", self.rng.randrange(self.key_space)))
        values = self.region_value([k for _, k in ops])
        by_region: dict[str, list[tuple[str, int]]] = {}
        for (op, k), v in zip(ops, values):
            by_region.setdefault(self.region_for(v), []).append((op, k))
        ds = self.dataset()
        for rid, rops in by_region.items():
            with ds.mem_wal_writer(rid, max_memtable_rows=self.max_memtable_rows,
                                   durable_write=self.durable_write) as w:
                self._apply(w, rops, puts_per_batch)

    def _apply(self, writer, ops: list[tuple[str, int]], puts_per_batch: int) -> None:
        pending: dict[int, dict[str, Any]] = {}

        def flush_puts() -> None:
            if pending:
                writer.put(rows_table(list(pending.values()), self.schema))
                pending.clear()

        for op, k in ops:
            if op == "put":
                pending[k] = row(k, self.version * 1000 + len(pending))
                self.model[k] = pending[k]
                if len(pending) >= puts_per_batch:
                    flush_puts()
            else:
                flush_puts()
                writer.delete(pa.table({"id": pa.array([k], pa.int64())}))
                self.model.pop(k, None)
        flush_puts()

    def expected(self) -> dict[int, dict[str, Any]]:
        return dict(self.model)
