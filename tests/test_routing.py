"""memwal_core.state.routing must be bit-exact with pylance's evaluate_sharding_spec.

Every comparison runs the real pylance evaluator on a spec read back from a real
dataset's MemWAL index (num_buckets is varied by editing that spec's parameter).
"""

from __future__ import annotations

import re
import struct
import zlib

import lance
import mmh3
import numpy as np
import pyarrow as pa
import pytest
from lance.mem_wal import evaluate_sharding_spec

from memwal_core.state.routing import (
    RegionSpec,
    UnsupportedSourceType,
    UnsupportedTransform,
    evaluate_region_spec,
    field_values,
    bucket_values,
    misrouted_mask,
    source_columns_for,
)

# initialize_mem_wal(identity_column=...) refuses floats, dates, times and timestamps
# (bucket accepts every type in TYPES); evaluate_sharding_spec's identity takes any type.
IDENTITY_TYPES = {
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool", "utf8", "large_utf8",
}  # fmt: skip
PK = {"lance-schema:unenforced-primary-key": "true"}
N_ROWS = 3000
NUM_BUCKETS = [1, 2, 7, 8, 1000, 2**31 - 1]

TYPES: dict[str, pa.DataType] = {
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "uint8": pa.uint8(),
    "uint16": pa.uint16(),
    "uint32": pa.uint32(),
    "uint64": pa.uint64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "date32": pa.date32(),
    "ts_s": pa.timestamp("s"),
    "ts_ms": pa.timestamp("ms"),
    "ts_us_utc": pa.timestamp("us", "UTC"),
    "ts_ns_ny": pa.timestamp("ns", "America/New_York"),
    "time32_ms": pa.time32("ms"),
    "time64_ns": pa.time64("ns"),
    "utf8": pa.utf8(),
    "large_utf8": pa.large_utf8(),
}


class Table:
    """A real dataset's spec plus its Lance schema."""

    def __init__(self, path: str, **mem_wal: object) -> None:
        ds = lance.dataset(path)
        ds.initialize_mem_wal(**mem_wal)
        ds = lance.dataset(path)
        self.spec: dict = ds.mem_wal_index_details()["sharding_specs"][0]
        self.lance_schema = ds.lance_schema
        self.arrow_schema = ds.schema

    def as_identity(self) -> dict:
        """This bucket spec switched to identity (for types initialize refuses)."""
        field = dict(self.spec["fields"][0], transform="identity", parameters={})
        return {**self.spec, "fields": [field]}

    def with_buckets(self, n: int) -> dict:
        spec = {**self.spec, "fields": [dict(f) for f in self.spec["fields"]]}
        spec["fields"][0]["parameters"] = {"num_buckets": str(n)}
        return spec


def _write(root, name: str, typ: pa.DataType) -> str:
    # The key is not the primary key: Lance refuses float/date/time PKs, not shard keys.
    schema = pa.schema(
        [pa.field("id", pa.int64(), nullable=False, metadata=PK), pa.field("k", typ)]
    )
    path = str(root / name)
    lance.write_dataset(pa.table({"id": [1], "k": pa.nulls(1, typ)}, schema=schema), path)
    return path


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, dict[str, Table]]:
    root = tmp_path_factory.mktemp("routing")
    out: dict[str, dict[str, Table]] = {}
    for name, typ in TYPES.items():
        out[name] = {"bucket": Table(_write(root, f"b_{name}", typ), bucket_column="k", num_buckets=8)}
        if name in IDENTITY_TYPES:
            out[name]["identity"] = Table(_write(root, f"i_{name}", typ), identity_column="k")
    out["_"] = {"unsharded": Table(_write(root, "unsharded", pa.int64()), unsharded=True)}
    return out


# --------------------------------------------------------------------------
# random data
# --------------------------------------------------------------------------

ALPHABET = list("aZ09 \x00\x7f") + ["é", "ß", "€", "中", "𝄞", "😀"]  # 1..4 UTF-8 bytes


def _with_nulls(values: np.ndarray, rng: np.random.Generator, typ: pa.DataType) -> pa.Array:
    mask = rng.random(len(values)) < 0.1
    return pa.array(values, type=typ, mask=mask)


def _ints(rng, np_type) -> np.ndarray:
    info = np.iinfo(np_type)
    v = rng.integers(info.min, info.max, size=N_ROWS, dtype=np_type, endpoint=True)
    edge = [info.min, info.max, 0, 1, info.min + 1, info.max - 1]
    edge += [] if info.min == 0 else [-1]
    v[: len(edge)] = edge
    return v


def _floats(rng, np_type, bits_type) -> np.ndarray:
    v = (rng.standard_normal(N_ROWS) * 10.0 ** rng.integers(-30, 30, N_ROWS)).astype(np_type)
    f = np.finfo(np_type)
    special = np.array(
        [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, f.max, f.min, f.tiny, f.smallest_subnormal, 1.25],
        dtype=np_type,
    )
    v[: len(special)] = special
    # NaNs with other payloads and signs must hash as the canonical NaN.
    payload_nans = np.array(
        [0x7F800001, 0xFFC00000, 0x7FBFFFFF]  # signalling, negative quiet, max payload
        if np_type == np.float32
        else [0x7FF0000000000001, 0xFFF8000000000000, 0x7FF7FFFFFFFFFFFF],
        dtype=bits_type,
    ).view(np_type)
    assert np.isnan(payload_nans).all()
    v[len(special) : len(special) + 3] = payload_nans
    # repeat the special values a few times across the array (so some land in nulls)
    v[100:400] = np.resize(np.concatenate([special, payload_nans]), 300)
    return v


def _strings(rng) -> list[str]:
    out = ["", "a", "b", "ab", "abc", "abcd", "abcde", "é", "€", "𝄞", "\uffff"]
    while len(out) < N_ROWS:
        n = int(rng.integers(0, 21))
        out.append("".join(rng.choice(ALPHABET, size=n)))
    out[-5:] = ["x" * 1000, "é" * 333, "€" * 77, "y" * 129, "z" * 131]  # long-string path
    return out


def random_array(name: str, typ: pa.DataType, seed: int) -> pa.Array:
    rng = np.random.default_rng(seed)
    if pa.types.is_integer(typ):
        return _with_nulls(_ints(rng, typ.to_pandas_dtype()), rng, typ)
    if typ == pa.float32():
        return _with_nulls(_floats(rng, np.float32, np.uint32), rng, typ)
    if typ == pa.float64():
        return _with_nulls(_floats(rng, np.float64, np.uint64), rng, typ)
    if typ == pa.bool_():
        return _with_nulls(rng.random(N_ROWS) < 0.5, rng, typ)
    if pa.types.is_date32(typ):
        return _with_nulls(_ints(rng, np.int32), rng, pa.int32()).cast(typ)
    if pa.types.is_timestamp(typ):
        return _with_nulls(_ints(rng, np.int64), rng, pa.int64()).cast(typ)
    if pa.types.is_time32(typ):
        return _with_nulls(rng.integers(0, 86_400_000, N_ROWS, dtype=np.int32), rng, pa.int32()).cast(typ)
    if pa.types.is_time64(typ):
        v = rng.integers(0, 86_400 * 10**9, N_ROWS, dtype=np.int64)
        return _with_nulls(v, rng, pa.int64()).cast(typ)
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return _with_nulls(np.array(_strings(rng), dtype=object), rng, typ)
    raise AssertionError(name)


def _batch(arr: pa.Array) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(np.arange(len(arr), dtype=np.int64)), "k": arr})


def assert_same_array(got: pa.Array, exp: pa.Array) -> None:
    """Exact equality; floats compared by bit pattern so NaN and -0.0 count."""
    assert got.type == exp.type
    if pa.types.is_floating(exp.type):
        assert got.is_valid().equals(exp.is_valid())
        bits = np.uint32 if exp.type == pa.float32() else np.uint64
        g, e = (np.asarray(a.fill_null(0).to_numpy()).view(bits) for a in (got, exp))
        np.testing.assert_array_equal(g, e)
    else:
        assert got.equals(exp)


def assert_matches_lance(spec: dict, schema, batch: pa.RecordBatch) -> pa.RecordBatch:
    exp = evaluate_sharding_spec(batch, spec, schema)
    ours = RegionSpec.from_lance(spec)
    got = evaluate_region_spec(ours, batch, source_columns_for(ours, schema))
    assert got.schema == exp.schema
    assert got.num_rows == exp.num_rows
    for i in range(exp.num_columns):
        assert_same_array(got.column(i).combine_chunks(), exp.column(i))
    return exp


# --------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------


def test_spec_test_vectors(tables):
    """The Lance spec appendix's bucket vectors (num_buckets = 8)."""
    cases = {
        "int32": ([1, 2, 3, None], [2, 7, 1, 0]),
        "date32": ([1, 2, 3, None], [2, 7, 1, 0]),
        "utf8": (["a", "b", None], [1, 5, 0]),
        "bool": ([True], [2]),
        "float32": ([1.25], [0]),
        "float64": ([1.25], [0]),
    }
    for name, (values, want) in cases.items():
        t = tables[name]["bucket"]
        arr = pa.array(values, pa.int32()).cast(TYPES[name]) if name == "date32" else pa.array(values, TYPES[name])
        exp = assert_matches_lance(t.spec, t.lance_schema, _batch(arr))
        assert exp.column(0).to_pylist() == want, name


@pytest.mark.parametrize("name", list(TYPES))
def test_bucket_matches_lance(tables, name):
    t = tables[name]["bucket"]
    arr = random_array(name, TYPES[name], seed=zlib.crc32(name.encode()))
    batch = _batch(arr)
    for n in NUM_BUCKETS:
        assert_matches_lance(t.with_buckets(n), t.lance_schema, batch)
    # sliced arrays (non-zero offset) and empty batches
    assert_matches_lance(t.spec, t.lance_schema, _batch(arr.slice(13, 777)))
    assert_matches_lance(t.spec, t.lance_schema, _batch(arr.slice(0, 0)))


@pytest.mark.parametrize("name", list(TYPES))
def test_identity_matches_lance(tables, name):
    if name in IDENTITY_TYPES:
        t = tables[name]["identity"]
        spec = t.spec
        assert spec["fields"][0]["result_type"] == str(TYPES[name]).replace("bool", "boolean").replace("string", "utf8")
    else:
        t = tables[name]["bucket"]
        spec = t.as_identity()
    assert spec["fields"][0]["transform"] == "identity"
    arr = random_array(name, TYPES[name], seed=zlib.crc32(name.encode()) + 1)
    assert_matches_lance(spec, t.lance_schema, _batch(arr))
    assert_matches_lance(spec, t.lance_schema, _batch(arr.drop_null()))  # "not null" field


def test_initialize_identity_refuses_types(tmp_path):
    for name in sorted(set(TYPES) - IDENTITY_TYPES):
        path = _write(tmp_path, name, TYPES[name])
        with pytest.raises(OSError, match="identity_sharding: .* cannot be used as a shard key"):
            lance.dataset(path).initialize_mem_wal(identity_column="k")


def test_table_input_matches_batch(tables):
    t = tables["utf8"]["bucket"]
    spec = RegionSpec.from_lance(t.spec)
    arr = random_array("utf8", pa.utf8(), seed=1)
    table = pa.Table.from_batches([_batch(arr.slice(0, 1000)), _batch(arr.slice(1000))])
    got = field_values(spec, table, {1: "k"})["bucket"]
    exp = evaluate_sharding_spec(_batch(arr), t.spec, t.lance_schema).column(0)
    assert got.equals(exp)


MAX_BUCKETS = 2**31 - 1  # (hash & 0x7fffffff) % MAX_BUCKETS: the hash itself, but for one value


def _std(data: bytes) -> int:
    return (mmh3.hash(data, 0, signed=True) & 0x7FFFFFFF) % MAX_BUCKETS


def test_int_hash_is_standard_murmur3(tables):
    """Known fact: int64 bucket == (mmh3(<q) & 0x7fffffff) % N; narrower ints widen to <i."""
    rng = np.random.default_rng(5)
    v64 = _ints(rng, np.int64)[:500]
    got = bucket_values(pa.array(v64), MAX_BUCKETS).to_pylist()
    assert got == [_std(struct.pack("<q", int(x))) for x in v64]
    v8 = _ints(rng, np.int8)[:200]
    got = bucket_values(pa.array(v8), MAX_BUCKETS).to_pylist()
    assert got == [_std(struct.pack("<i", int(x))) for x in v8]
    t = tables["int64"]["bucket"]
    exp = evaluate_sharding_spec(_batch(pa.array(v64)), t.with_buckets(1000), t.lance_schema)
    want = [(mmh3.hash(struct.pack("<q", int(x)), 0, signed=True) & 0x7FFFFFFF) % 1000 for x in v64]
    assert exp.column(0).to_pylist() == want


def test_string_tail_differs_from_standard_murmur3():
    """Whole blocks match mmh3; a 1-3 byte tail is mixed byte by byte (Lance's rule)."""
    words = ["", "abcd", "abcdefgh", "a", "ab", "abc", "abcde", "\xff"]
    ours = bucket_values(pa.array(words), MAX_BUCKETS).to_pylist()
    std = [_std(w.encode()) for w in words]
    assert ours[:3] == std[:3]
    assert all(o != s for o, s in zip(ours[3:], std[3:]))


def test_unsharded_matches_lance(tables):
    t = tables["_"]["unsharded"]
    assert t.spec["fields"][0]["transform"] == "unsharded"
    spec = RegionSpec.from_lance(t.spec)
    assert source_columns_for(spec, t.lance_schema) == {}
    for n in (0, 5):
        batch = pa.record_batch({"anything": pa.array(range(n), pa.int64())})
        exp = assert_matches_lance(t.spec, t.lance_schema, batch)
        assert exp.column(0).to_pylist() == [0] * n


def test_only_a_spec_with_a_routing_field_is_sharded(tables):
    """Unsharded and manual regions route nothing: the merger, GC and the checks skip them."""
    assert RegionSpec.from_lance(tables["utf8"]["bucket"].spec).sharded
    assert not RegionSpec.from_lance(tables["_"]["unsharded"].spec).sharded
    assert not RegionSpec(spec_id=0, fields=()).sharded


@pytest.mark.parametrize(
    "transform, expression", [("truncate", None), ("year", None), (None, "k || 'x'")]
)
def test_unsupported_transform(tables, transform, expression):
    t = tables["utf8"]["bucket"]
    spec = {
        "spec_id": 2,
        "fields": [
            {
                "field_id": "r",
                "source_ids": [1],
                "transform": transform,
                "expression": expression,
                "result_type": "int32",
                "parameters": {},
            }
        ],
    }
    batch = _batch(pa.array(["a"]))
    with pytest.raises(ValueError, match="Unsupported MemWAL sharding transform"):
        evaluate_sharding_spec(batch, spec, t.lance_schema)
    with pytest.raises(UnsupportedTransform, match=repr(transform)) as err:
        field_values(RegionSpec.from_lance(spec), batch, {1: "k"})
    assert repr(expression) in str(err.value) and "bucket, identity, unsharded" in str(err.value)


@pytest.mark.parametrize(
    "arr",
    [
        pa.array([b"a"]),
        pa.array([1], pa.date64()),
        pa.array(["a"]).dictionary_encode(),
        pa.array(["a"], pa.string_view()),
        pa.nulls(2),
    ],
    ids=str,
)
def test_unsupported_source_type(tables, arr):
    t = tables["utf8"]["bucket"]
    spec = RegionSpec.from_lance(t.spec)
    with pytest.raises(ValueError, match="Unsupported bucket sharding column type"):
        evaluate_sharding_spec(_batch(arr), t.spec, t.lance_schema)
    with pytest.raises(UnsupportedSourceType, match=re.escape(str(arr.type))):
        field_values(spec, _batch(arr), {1: "k"})
    # Lance only complains once there is a row to hash.
    assert_matches_lance(t.spec, t.lance_schema, _batch(arr.slice(0, 0)))


def test_initialize_refuses_types(tmp_path):
    """Documented: pylance refuses these as bucket columns at initialize time."""
    for typ in (pa.binary(), pa.date64(), pa.decimal128(10, 2)):
        path = _write(tmp_path, str(typ).replace(",", "_").replace(" ", ""), typ)
        with pytest.raises(OSError, match="cannot be used as a shard key"):
            lance.dataset(path).initialize_mem_wal(bucket_column="k", num_buckets=4)


def test_bad_num_buckets(tables):
    t = tables["int64"]["bucket"]
    batch = _batch(pa.array([1, 2], pa.int64()))
    for raw in ("0", "-1", "abc", " 8", "2147483648"):
        spec = t.with_buckets(8)
        spec["fields"][0]["parameters"] = {"num_buckets": raw}
        with pytest.raises(ValueError):
            evaluate_sharding_spec(batch, spec, t.lance_schema)
        with pytest.raises(ValueError, match="num_buckets"):
            field_values(RegionSpec.from_lance(spec), batch, {1: "k"})
        spec = t.with_buckets(8)
    spec["fields"][0]["parameters"] = {"num_buckets": "+8"}
    assert_matches_lance(spec, t.lance_schema, batch)


def test_source_columns_for_nested_schema(tmp_path):
    schema = pa.schema(
        [
            pa.field("l", pa.list_(pa.struct([("a", pa.int32()), ("b", pa.list_(pa.utf8()))]))),
            pa.field("m", pa.map_(pa.utf8(), pa.int32())),
            pa.field("fsl", pa.list_(pa.float32(), 2)),
            pa.field("id", pa.int64(), nullable=False, metadata=PK),
            pa.field("k", pa.utf8()),
        ]
    )
    data = {"l": [[{"a": 1, "b": ["x"]}]], "m": [[("a", 1)]], "fsl": [[1.0, 2.0]], "id": [1], "k": ["a"]}
    lance.write_dataset(pa.table(data, schema=schema), str(tmp_path))
    t = Table(str(tmp_path), bucket_column="k", num_buckets=8)
    spec = RegionSpec.from_lance(t.spec)
    assert spec.fields[0].source_ids == (11,)  # list/map children count; fixed-size-list's do not
    assert source_columns_for(spec, t.lance_schema) == {11: "k"}
    assert source_columns_for(spec, t.arrow_schema) == {11: "k"}
    nested = RegionSpec.from_lance(
        {"spec_id": 1, "fields": [dict(t.spec["fields"][0], source_ids=[2])]}
    )
    assert source_columns_for(nested, t.lance_schema) == {2: "l.item.a"}


def test_embedded_column_parameter(tables):
    """Lance lets a 'column' parameter name the source column instead of source_ids."""
    t = tables["utf8"]["bucket"]
    spec = t.with_buckets(8)
    spec["fields"][0] = dict(spec["fields"][0], source_ids=[], parameters={"num_buckets": "8", "column": "zz"})
    batch = pa.record_batch({"zz": ["a", "b", None]})
    exp = assert_matches_lance(spec, t.lance_schema, batch)
    assert exp.column(0).to_pylist() == [1, 5, 0]


def test_misrouted_mask(tables):
    t = tables["int64"]["bucket"]
    spec = RegionSpec.from_lance(t.spec)
    arr = random_array("int64", pa.int64(), seed=3)
    batch = _batch(arr)
    values = evaluate_sharding_spec(batch, t.spec, t.lance_schema).column(0).to_numpy()
    for want in range(8):
        mask = misrouted_mask(spec, batch, {1: "k"}, {"bucket": want})
        assert isinstance(mask, pa.BooleanArray) and mask.null_count == 0
        np.testing.assert_array_equal(mask.to_numpy(zero_copy_only=False), values != want)
    with pytest.raises(ValueError, match="bucket"):
        misrouted_mask(spec, batch, {1: "k"}, {})

    ispec = RegionSpec.from_lance(tables["float64"]["bucket"].as_identity())
    fb = _batch(pa.array([1.5, None, float("nan"), -0.0, 0.0, 1.5]))
    m = lambda want: misrouted_mask(ispec, fb, {1: "k"}, {"bucket": want}).to_pylist()  # noqa: E731
    assert m(1.5) == [False, True, True, True, True, False]
    assert m(None) == [True, False, True, True, True, True]
    assert m(float("nan")) == [True, True, False, True, True, True]
    assert m(0.0) == [True, True, True, False, False, True]
    assert m(pa.scalar(1.5)) == m(1.5)
