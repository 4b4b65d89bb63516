"""A LanceDB 0.40 table with an LSM write spec (bucket, identity or unsharded), local or on an
object store, and the model of what was written to it: the rows LanceDB's LSM read
(`use_lsm`) and pylance's LSM scanner must both return."""

from __future__ import annotations

import struct

import lancedb
import mmh3
import pyarrow as pa
from lancedb import LsmWriteSpec

from memwal_core.observe import reader
from memwal_core.state import layout
from memwal_core.state.store import open_store

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("k", pa.int64(), nullable=False),
                    pa.field("v", pa.string())])


def k_of(i: int) -> int:
    return i % 3


def bucket_of(i: int, n: int) -> int:
    """pylance's bucket of an int64 (see lance14-memwal-facts: standard murmur3 of '<q')."""
    return (mmh3.hash(struct.pack("<q", i), 0, signed=True) & 0x7FFFFFFF) % n


def rows(ids: list[int], tag: str) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "k": pa.array([k_of(i) for i in ids], pa.int64()),
                     "v": [f"{tag}{i}" for i in ids]}, schema=SCHEMA)


class LdbTable:
    """A LanceDB table with an LSM write spec, and the model of what was written to it."""

    def __init__(self, root: str, spec: str, *, buckets: int = 4, base: int = 30, index: bool = False,
                 storage_options: dict[str, str] | None = None):
        self.db = lancedb.connect(root, storage_options=storage_options)
        self.spec, self.buckets = spec, buckets
        self.tbl = self.db.create_table("t", data=rows(list(range(base)), "base"), schema=SCHEMA)
        self.tbl.set_unenforced_primary_key("id")
        ws = {"bucket": lambda: LsmWriteSpec.bucket("id", buckets), "identity": lambda: LsmWriteSpec.identity("k"),
              "unsharded": LsmWriteSpec.unsharded}[spec]()
        if index:
            self.tbl.create_scalar_index("v", index_type="BTREE")
            ws = ws.with_maintained_indexes(["v_idx"])
        self.tbl.set_lsm_write_spec(ws)
        self.model = {i: (k_of(i), f"base{i}") for i in range(base)}
        self.loc = open_store(f"{root.rstrip('/')}/t.lance", storage_options)
        self.route_open: object = None

    def route(self, i: int) -> object:
        return {"bucket": lambda: bucket_of(i, self.buckets), "identity": lambda: k_of(i),
                "unsharded": lambda: 0}[self.spec]()

    def upsert(self, ids: list[int], tag: str, per_call: int = 10**9) -> None:
        """Rows of one shard per call, at most `per_call` rows (one WAL entry) per call (LanceDB
        refuses a call that routes to another shard than the handle's open writer: close it first)."""
        by_route: dict = {}
        for i in ids:
            by_route.setdefault(self.route(i), []).append(i)
        for r, group in sorted(by_route.items()):
            if self.route_open is not None and self.route_open != r:
                self.tbl.close_lsm_writers()
            self.route_open = r
            for at in range(0, len(group), per_call):
                chunk = group[at:at + per_call]
                self.tbl.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(
                    rows(chunk, tag))
                self.model.update({i: (k_of(i), f"{tag}{i}") for i in chunk})

    def flush(self) -> None:
        self.tbl.close_lsm_writers()
        self.route_open = None

    def reopen(self) -> None:
        """A new table handle: its writer claims the shard again (new epoch, fence sentinel)."""
        self.flush()
        self.tbl = self.db.open_table("t")

    def expected(self) -> dict:
        return dict(self.model)

    def lancedb_read(self) -> dict:
        t = self.db.open_table("t").search().use_lsm(True).limit(10**9).to_arrow()
        return as_model(t)

    def check(self, what: str) -> None:
        assert self.lancedb_read() == self.expected(), f"LanceDB LSM read after {what}"
        assert as_model(reader.lsm_table(self.loc)) == self.expected(), f"pylance LSM read after {what}"

    def wal_positions(self, region_id: str) -> list[int]:
        """The positions of the region's WAL entries in the store."""
        names = (o.key.rsplit("/", 1)[-1] for o in self.loc.store.list(layout.wal_dir(region_id)))
        return sorted(int(n[:-len(layout.WAL_SUFFIX)][::-1], 2) for n in names if n.endswith(layout.WAL_SUFFIX))

    def wal_entries(self) -> int:
        """WAL entries of every region (`_mem_wal/<region>/wal/<name>.arrow`)."""
        return sum(1 for o in self.loc.store.list("_mem_wal")
                   if len(parts := o.key.split("/")) == 4 and parts[2] == "wal" and parts[3].endswith(layout.WAL_SUFFIX))


def as_model(t: pa.Table) -> dict:
    d = t.select(["id", "k", "v"]).to_pydict()
    out = {}
    for i, k, v in zip(d["id"], d["k"], d["v"]):
        assert i not in out, f"duplicate key {i}"
        out[i] = (k, v)
    return out
