"""Every primary-key type Lance allows for a MemWAL table, with its extreme values, merges exactly.

What a key value goes through: a real `ShardWriter` (routed to its region by Lance's own
`evaluate_sharding_spec`), the merge's Spark tasks (memwal's routing check, the newest-row
dedup), the `merge_insert` join on the key and, for a delete, the SQL predicate of
`when_not_matched_by_source_delete` (`keys.sql_literal`). A literal Lance read as another
value or type would refuse every commit (the region never merges) or delete a live row.

The property test draws put/delete sequences of adversarial values per type (integer extremes,
quotes, backslashes, NUL, unicode, long strings, every byte) into one reused table per type and
checks the base table against a dict model after each merge: every live key exactly once with
its newest value, every deleted key absent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lance.mem_wal import evaluate_sharding_spec

from memwal_core.jobs import merge
from memwal_core.jobs.merge import verify
from memwal_core.state import keys, table
from memwal_core.state.store import open_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMWAL = os.path.join(os.path.dirname(sys.executable), "memwal")
PK = {b"lance-schema:unenforced-primary-key": b"true"}

INTS = {"int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
        "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64()}
TYPES = {**INTS, "bool": pa.bool_(), "utf8": pa.string(), "large_utf8": pa.large_string(),
         "binary": pa.binary(), "large_binary": pa.large_binary()}

NASTY_STRINGS = ["", "'", "''", "it's", "\\", "\\'", "a\\nb", "\n", "\r\n", "\t", "\x00", "a\x00b", "é☃𝄞",
                 "\u202e", '"', "`", "%", "_", " ", "NULL", "x" * 5000, "a'b\\c\nd\x00e"]
NASTY_BYTES = [b"", b"\x00", b"\x00\x00", bytes(range(256)), bytes(range(255, -1, -1)), b"'", b"\\",
               b"\xff", b"\xff\xfe", b"x" * 5000]


def _range(typ: pa.DataType) -> tuple[int, int]:
    bits = typ.bit_width
    return (0, 2**bits - 1) if typ in (pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()) \
        else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def extremes(name: str) -> list:
    """The values of a type a literal is most likely to get wrong."""
    typ = TYPES[name]
    if name in INTS:
        lo, hi = _range(typ)
        return sorted({v for v in (lo, lo + 1, -1, 0, 1, hi - 1, hi, hi // 2, lo // 2) if lo <= v <= hi})
    if name == "bool":
        return [False, True]
    if name in ("utf8", "large_utf8"):
        return list(NASTY_STRINGS)
    return list(NASTY_BYTES)


def values(name: str) -> st.SearchStrategy:
    typ = TYPES[name]
    if name in INTS:
        lo, hi = _range(typ)
        return st.one_of(st.sampled_from(extremes(name)), st.integers(lo, hi))
    if name == "bool":
        return st.booleans()
    if name in ("utf8", "large_utf8"):
        return st.one_of(st.sampled_from(NASTY_STRINGS), st.text(max_size=24))
    return st.one_of(st.sampled_from(NASTY_BYTES), st.binary(max_size=24))


def schema(name: str) -> pa.Schema:
    return pa.schema([pa.field("k", TYPES[name], nullable=False, metadata=PK), pa.field("v", pa.int64())])


class KeyTable:
    """A MemWAL table keyed by one column of a type (bucket-sharded on the key where Lance can
    route the type, so memwal's routing check sees the extremes too), a dict model of what was
    written, and one region per region value."""

    def __init__(self, root: str, name: str):
        self.name, self.loc = name, open_store(root)
        self.schema = schema(name)
        ds = lance.write_dataset(pa.Table.from_pylist([], schema=self.schema), self.loc.lance_uri, schema=self.schema)
        if name in ("binary", "large_binary"):  # Lance refuses to shard by a binary column
            ds.initialize_mem_wal(unsharded=True)
        else:
            ds.initialize_mem_wal(bucket_column="k", num_buckets=3)
        ds = lance.dataset(self.loc.lance_uri)
        specs = (ds.mem_wal_index_details() or {}).get("sharding_specs", [])
        self.spec = specs[0] if specs and specs[0]["fields"][0]["transform"] != "unsharded" else None
        self.regions: dict = {}
        self.model: dict = {}
        self.version = 0

    def region_of(self, ks: list) -> list[str]:
        if self.spec is None:
            vals = [0] * len(ks)
        else:
            batch = pa.record_batch([pa.array(ks, self.schema.field("k").type)], names=["k"])
            vals = evaluate_sharding_spec(batch, self.spec, lance.dataset(self.loc.lance_uri).lance_schema) \
                .column(0).to_pylist()
        return [self.regions.setdefault(v, str(uuid.uuid4())) for v in vals]

    def write(self, ops: list[tuple[str, object]]) -> None:
        """Each op through the `ShardWriter` of its key's region, in order; small MemTables, so a
        region's ops span several generations."""
        by_region: dict[str, list[tuple[str, object]]] = {}
        for (op, k), rid in zip(ops, self.region_of([k for _, k in ops])):
            by_region.setdefault(rid, []).append((op, k))
        ds = lance.dataset(self.loc.lance_uri)
        typ = self.schema.field("k").type
        for rid, rops in by_region.items():
            with ds.mem_wal_writer(rid, max_memtable_rows=3) as w:
                for op, k in rops:
                    self.version += 1
                    if op == "put":
                        w.put(pa.Table.from_pylist([{"k": k, "v": self.version}], schema=self.schema))
                        self.model[k] = self.version
                    else:
                        w.delete(pa.table({"k": pa.array([k], typ)}))
                        self.model.pop(k, None)

    def merge_and_check(self, spark, max_generations: int = merge.DEFAULT_MAX_GENERATIONS) -> None:
        result = merge.merge(self.loc, spark, max_generations=max_generations)
        assert not result.region_errors, result.region_errors
        rows = table.open_dataset(self.loc).to_table().to_pylist()
        got = [r["k"] for r in rows]
        assert len(got) == len(set(got)), "a key is in the base table more than once"
        assert {r["k"]: r["v"] for r in rows} == self.model
        pending = sum(len(v) for v in merge.plan_merge(self.loc).pending.values())
        assert pending == 0


@pytest.fixture(scope="module")
def key_tables(tmp_path_factory):
    """One table per type, made on first use and reused by every example of the property test."""
    root = tmp_path_factory.mktemp("keys")
    made: dict[str, KeyTable] = {}

    def get(name: str) -> KeyTable:
        if name not in made:
            made[name] = KeyTable(str(root / name), name)
        return made[name]

    return get


# ------------------------------------------------------------------ which types exist

def test_supported_types_are_exactly_what_lance_accepts(tmp_path):
    """`keys.SUPPORTED_KEY_TYPES` is what `initialize_mem_wal` accepts as a primary key: the
    others are refused by Lance itself (and by memwal, should a table get such a key later)."""
    refused = {"float16": pa.float16(), "float32": pa.float32(), "float64": pa.float64(),
               "date32": pa.date32(), "date64": pa.date64(), "timestamp": pa.timestamp("us"),
               "decimal": pa.decimal128(10, 2), "fsb": pa.binary(4), "time64": pa.time64("us")}
    for name, typ in {**TYPES, **refused}.items():
        sch = pa.schema([pa.field("k", typ, nullable=False, metadata=PK)])
        ds = lance.write_dataset(pa.Table.from_pylist([], schema=sch), str(tmp_path / name), schema=sch)
        if typ in keys.SUPPORTED_KEY_TYPES:
            ds.initialize_mem_wal(unsharded=True)
            keys.refuse_unsupported_keys(sch, ["k"])
        else:
            with pytest.raises(OSError, match="unsupported type"):
                ds.initialize_mem_wal(unsharded=True)
            with pytest.raises(keys.UnsupportedKeyType, match=re.escape(f"'k' is {typ}")):
                keys.refuse_unsupported_keys(sch, ["k"])
    assert set(keys.SUPPORTED_KEY_TYPES) == set(TYPES.values())


def test_float_key_set_after_initialization_is_refused_before_spark(tmp_path):
    """A float key can only appear by marking a column as the key after `initialize_mem_wal` on
    a table that had none (pylance allows it; its writers flush generations while the table
    has no key). The merge refuses the table naming the column and type before any Spark work:
    the library with no session at all, the Dagster asset with a Spark master nobody listens
    on. Nothing is merged."""
    from dagster import DagsterInstance, materialize

    from memwal_core.options import SparkOptions
    from memwal_pipeline.config import TableConfig
    from memwal_pipeline.definitions import table_definitions

    loc = open_store(str(tmp_path / "t"))
    sch = pa.schema([pa.field("f", pa.float64(), nullable=False), pa.field("v", pa.int64())])
    ds = lance.write_dataset(pa.table({"f": [float("nan")], "v": [1]}, schema=sch), loc.lance_uri, schema=sch)
    ds.initialize_mem_wal(unsharded=True)
    rid = str(uuid.uuid4())
    with lance.dataset(loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=2) as w:
        w.put(pa.table({"f": [0.0, -0.0], "v": [2, 3]}, schema=sch))
    lance.dataset(loc.lance_uri).replace_field_metadata("f", {"lance-schema:unenforced-primary-key": "true"})
    assert merge.plan_merge(loc).pending == {rid: [1]}
    version = table.open_dataset(loc).version
    with pytest.raises(keys.UnsupportedKeyType, match=r"primary key column 'f' is double") as e:
        merge.merge(loc, spark=None)
    assert loc.lance_uri in str(e.value)

    td = table_definitions(TableConfig(name="f", uri=loc.lance_uri, spark=SparkOptions(master="spark://127.0.0.1:1")))
    base = next(a for a in td.assets if a.key.path[-1] == "base_table")
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(td.partitions.name, [rid])
        r = materialize([base], partition_key=rid, instance=instance, resources=td.resources, raise_on_error=False)
    assert not r.success
    failure = next(ev for ev in r.all_events if ev.is_step_failure).step_failure_data.error
    while failure.cause is not None:  # Dagster's step error wraps ours
        failure = failure.cause
    assert failure.cls_name == "UnsupportedKeyType" and "primary key column 'f' is double" in failure.message
    assert table.open_dataset(loc).version == version


# ------------------------------------------------------------------ literals, no merge

def _filter_rows(ds, predicate: str) -> list[int]:
    return sorted(ds.to_table(filter=predicate).column("v").to_pylist())


@pytest.mark.parametrize("name", list(TYPES))
def test_each_extreme_literal_matches_exactly_its_row(tmp_path, name):
    """For every extreme value: the predicate of that key alone matches exactly its row, and
    the predicate of all the other keys matches all rows but it (no extra row: an extra match
    would delete a live row)."""
    vals = extremes(name)
    sch = schema(name)
    ds = lance.write_dataset(pa.table({"k": pa.array(vals, sch.field("k").type), "v": list(range(len(vals)))},
                                      schema=sch), str(tmp_path / "t"), schema=sch)
    typ = sch.field("k").type
    for i, v in enumerate(vals):
        one = merge.delete_predicate(pa.table({"k": pa.array([v], typ)}), ["k"])
        assert _filter_rows(ds, one) == [i], one[:200]
        rest = [x for x in vals if x != v]
        if rest:
            others = merge.delete_predicate(pa.table({"k": pa.array(rest, typ)}), ["k"])
            assert _filter_rows(ds, others) == [j for j in range(len(vals)) if j != i]


def test_int64_min_literal_is_typed():
    """The form the int64 minimum takes (a bare `-9223372036854775808` is a Float64 to Lance's
    SQL parser, refused for an int64 column); the other extremes stay plain decimal literals."""
    t = pa.table({"k": pa.array([-(2**63), -(2**63) + 1, 2**63 - 1], pa.int64())})
    assert merge.delete_predicate(t, ["k"]) == \
        "k IN (arrow_cast('-9223372036854775808', 'Int64'), -9223372036854775807, 9223372036854775807)"
    u = pa.table({"k": pa.array([0, 2**64 - 1], pa.uint64())})
    assert merge.delete_predicate(u, ["k"]) == "k IN (0, 18446744073709551615)"


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(list(TYPES)), data=st.data())
def test_drawn_literals_match_exactly(tmp_path_factory, name, data):
    """Drawn values of a drawn type: the predicate of a drawn subset matches exactly its rows."""
    typ = TYPES[name]
    vals = data.draw(st.lists(values(name), min_size=1, max_size=12, unique=True), label="values")
    chosen = data.draw(st.lists(st.sampled_from(vals), min_size=1, max_size=len(vals), unique=True), label="deleted")
    sch = schema(name)
    ds = lance.write_dataset(pa.table({"k": pa.array(vals, typ), "v": list(range(len(vals)))}, schema=sch),
                             str(tmp_path_factory.mktemp("lit") / "t"), schema=sch)
    pred = merge.delete_predicate(pa.table({"k": pa.array(chosen, typ)}), ["k"])
    assert _filter_rows(ds, pred) == sorted(vals.index(c) for c in chosen)


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(list(TYPES)), data=st.data())
def test_distinct_and_membership_agree_with_arrow_for_every_key_type(name, data):
    """The merge's key checks that sort integers with numpy (`keys.all_distinct`, the commit
    check's `verify._only`) answer as Arrow's hash kernels do, for every key type: extremes
    (a uint64 past int64's range), repeats, NULLs, several chunks."""
    typ = TYPES[name]
    pool = data.draw(st.lists(values(name), min_size=1, max_size=6))
    drawn = st.one_of(st.sampled_from(pool), st.none()) if data.draw(st.booleans()) else st.sampled_from(pool)
    a = pa.array(data.draw(st.lists(drawn, max_size=20)), typ)
    b = pa.array(data.draw(st.lists(drawn, max_size=20)), typ)
    cut = data.draw(st.integers(0, len(a)))
    for col in (a, pa.chunked_array([a.slice(0, cut), a.slice(cut)], typ)):
        assert keys.all_distinct(col) == (pc.count_distinct(col, mode="all").as_py() == len(col))
    found = pa.table({"k": pa.chunked_array([a.slice(0, cut), a.slice(cut)], typ)})
    got = verify._only(found, pa.table({"k": b}), ["k"]).column("k").to_pylist()
    want = a.filter(pc.is_in(a, value_set=b, skip_nulls=True)).to_pylist()
    assert sorted(got) == sorted(want)
    if a.null_count == 0 and b.null_count == 0 and name in INTS:  # slices of the sorted pass, as a big column takes
        rows = data.draw(st.integers(1, 4), label="slice_rows")
        sliced = verify._sorted_members(found.column("k"), b.to_numpy(), slice_rows=rows)
        assert sorted(v for part in sliced for v in part.tolist()) == sorted(want)


def test_composite_literals_match_exactly(tmp_path):
    """A composite key (int64, utf8, binary): the predicate of some key tuples matches exactly
    their rows, with the extremes of each column combined."""
    p = {b"lance-schema:unenforced-primary-key": b"true"}
    sch = pa.schema([pa.field("a", pa.int64(), nullable=False, metadata=p),
                     pa.field("b", pa.string(), nullable=False, metadata=p),
                     pa.field("c weird", pa.binary(), nullable=False, metadata=p), pa.field("v", pa.int64())])
    rows = [{"a": a, "b": b, "c weird": c} for a in extremes("int64")[:4] for b in NASTY_STRINGS[:6]
            for c in (b"", b"\x00", bytes(range(256)))]
    for i, r in enumerate(rows):
        r["v"] = i
    ds = lance.write_dataset(pa.Table.from_pylist(rows, schema=sch), str(tmp_path / "t"), schema=sch)
    pick = rows[::5]
    pred = merge.delete_predicate(pa.Table.from_pylist(pick, schema=sch).select(["a", "b", "c weird"]),
                                  ["a", "b", "c weird"])
    assert _filter_rows(ds, pred) == [r["v"] for r in pick]


# ------------------------------------------------------------------ through ShardWriter and the merge

@pytest.mark.parametrize("name", list(TYPES))
def test_extremes_put_deleted_and_merged(tmp_path, spark, name):
    """Every extreme value of the type: put (two versions), merged; then every other one
    deleted and the rest overwritten, merged; then the deleted ones put back, merged."""
    t = KeyTable(str(tmp_path / name), name)
    vals = extremes(name)
    t.write([("put", v) for v in vals] + [("put", v) for v in reversed(vals)])
    t.merge_and_check(spark)
    t.write([("del", v) if i % 2 == 0 else ("put", v) for i, v in enumerate(vals)])
    t.merge_and_check(spark)
    assert all(v not in t.model for v in vals[::2])
    t.write([("put", v) for v in vals[::2]] + [("del", v) for v in vals[1::2]])
    t.merge_and_check(spark)


@pytest.mark.parametrize("name", list(TYPES))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_puts_and_deletes_merge_to_the_model(key_tables, spark, name, data):
    """Drawn put/delete sequences (keys reused, so deletes hit live keys and re-puts hit
    deleted ones) into the type's reused table, merged after each example (in one batch, or
    in batches of two generations, so the cross-batch key join sees the values too): the base
    table is the model."""
    t = key_tables(name)
    pool = data.draw(st.lists(values(name), min_size=1, max_size=8, unique=True), label="keys")
    known = list(t.model)[:8]
    ops = data.draw(st.lists(st.tuples(st.sampled_from(["put", "put", "del"]), st.sampled_from(pool + known)),
                             min_size=1, max_size=20), label="ops")
    t.write(ops)
    t.merge_and_check(spark, data.draw(st.sampled_from([2, merge.DEFAULT_MAX_GENERATIONS]), label="max_generations"))


def test_composite_key_puts_deletes_merge(tmp_path, spark):
    """A composite key (int64 extremes x nasty strings x bytes), unsharded: deletes of some
    tuples remove exactly those, never a row sharing one column's value."""
    p = {b"lance-schema:unenforced-primary-key": b"true"}
    sch = pa.schema([pa.field("a", pa.int64(), nullable=False, metadata=p),
                     pa.field("b", pa.string(), nullable=False, metadata=p),
                     pa.field("c", pa.large_binary(), nullable=False, metadata=p), pa.field("v", pa.int64())])
    loc = open_store(str(tmp_path / "t"))
    ds = lance.write_dataset(pa.Table.from_pylist([], schema=sch), loc.lance_uri, schema=sch)
    ds.initialize_mem_wal(unsharded=True)
    ks = [(a, b, c) for a in (-(2**63), -1, 0, 2**63 - 1) for b in ("", "it's", "a\x00\\\n")
          for c in (b"", b"\x00\xff")]
    model = {}
    ds = lance.dataset(loc.lance_uri)
    with ds.mem_wal_writer(str(uuid.uuid4()), max_memtable_rows=5) as w:
        for i, k in enumerate(ks):
            w.put(pa.Table.from_pylist([{"a": k[0], "b": k[1], "c": k[2], "v": i}], schema=sch))
            model[k] = i
        for k in ks[::3]:
            w.delete(pa.Table.from_pylist([{"a": k[0], "b": k[1], "c": k[2]}], schema=sch.remove(3)))
            model.pop(k)
    result = merge.merge(loc, spark)
    assert not result.region_errors, result.region_errors
    assert result.rows_deleted == 0  # deleted before their first merge: nothing in the base yet
    with lance.dataset(loc.lance_uri).mem_wal_writer(str(uuid.uuid4()), max_memtable_rows=5) as w:
        for k in ks[1::3]:
            w.delete(pa.Table.from_pylist([{"a": k[0], "b": k[1], "c": k[2]}], schema=sch.remove(3)))
            model.pop(k)
    result = merge.merge(loc, spark)
    assert not result.region_errors, result.region_errors
    assert result.rows_deleted == len(ks[1::3])
    rows = table.open_dataset(loc).to_table().to_pylist()
    assert {(r["a"], r["b"], r["c"]): r["v"] for r in rows} == model and len(rows) == len(model)


# ------------------------------------------------------------------ the user-facing path

def test_memwal_maintain_deletes_int64_min(tmp_path, spark):
    """`memwal maintain` (a subprocess, as a user runs it) on a table whose deleted key is the
    int64 minimum, already in the base table (merged by the test's session): the merge commits,
    the key is gone, its neighbours stay."""
    t = KeyTable(str(tmp_path / "t"), "int64")
    lo = -(2**63)
    t.write([("put", lo), ("put", lo + 1), ("put", 2**63 - 1), ("put", -1)])
    assert not merge.merge(t.loc, spark).region_errors
    assert lo in {r["k"] for r in table.open_dataset(t.loc).to_table().to_pylist()}
    t.write([("del", lo), ("put", -1)])
    run = subprocess.run([MEMWAL, "maintain", t.loc.lance_uri, "--only", "merge", "--json",
                          "--spark-master", "local[1]"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["steps"]["merge"]["metrics"]["rows_deleted"] == 1 and not report["failed"], report
    rows = {r["k"]: r["v"] for r in table.open_dataset(t.loc).to_table().to_pylist()}
    assert rows == t.model and lo not in rows and lo + 1 in rows
