"""MemWAL region routing, bit-exact with ``lance.mem_wal.evaluate_sharding_spec``.

pylance calls a region a "shard" and a region spec a "sharding spec".  We compute
region values ourselves (vectorized with numpy) so the merger can route and check
rows without a Lance round trip, and so the rules are written down in one place.

Rules of pylance 14 (``rust/lance/src/dataset/mem_wal/sharding.rs``, confirmed by
``tests/test_routing.py`` against the real ``evaluate_sharding_spec``):

* ``bucket``: ``(murmur3_x86_32(bytes, seed=0) & 0x7fffffff) % num_buckets`` as int32.
  Bytes per type (little endian):
  - int8/16/32, uint8/16/32, date32, time32, bool (0/1): the value as a 4-byte
    int32 (signed widened by sign extension, unsigned by zero extension);
  - int64, uint64, timestamp (any unit or tz, raw stored value, no unit
    normalization), time64: the 8-byte int64;
  - float32: its 4 bit-pattern bytes, float64: its 8; ``-0.0`` hashes as ``0.0``
    and every NaN as the canonical quiet NaN (0x7fc00000 / 0x7ff8000000000000);
  - utf8 / large_utf8: the UTF-8 bytes; whole 4-byte blocks as in standard
    murmur3, but each tail byte is sign-extended to an int32 and mixed as its own
    block (k1 mix + h1 mix), unlike standard murmur3 which packs the tail into one
    k1 with no h1 mix.  The final mix uses the byte length.
  - null: hash is the seed 0, so bucket 0.
  Other types (binary, date64, decimal, dictionary, string_view, null, ...) are
  refused by Lance as soon as a batch has a row.
* ``identity``: the source column unchanged (type kept, nulls kept).
* ``unsharded``: int32 zeros.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import mmh3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_core.errors import MemwalError

__all__ = [
    "RegionField",
    "RegionSpec",
    "UnsupportedTransform",
    "UnsupportedSourceType",
    "field_values",
    "source_columns_for",
    "evaluate_region_spec",
    "value_key",
    "misrouted_mask",
    "hash_array",
]

BUCKET = "bucket"
IDENTITY = "identity"
UNSHARDED = "unsharded"
SUPPORTED_TRANSFORMS = (BUCKET, IDENTITY, UNSHARDED)


class UnsupportedTransform(MemwalError, ValueError):
    """A region field we cannot evaluate locally (Lance would refuse it too)."""


class UnsupportedSourceType(UnsupportedTransform):
    """The bucket transform's source column has a type Lance cannot hash."""


@dataclass(frozen=True)
class RegionField:
    """One field of a region spec; ``parameters`` is sorted pairs so it hashes."""

    field_id: str
    source_ids: tuple[int, ...]
    transform: str | None
    result_type: str
    parameters: tuple[tuple[str, str], ...] = ()
    expression: str | None = None

    @property
    def params(self) -> dict[str, str]:
        return dict(self.parameters)

    def to_lance(self) -> dict[str, Any]:
        """The dict form pylance's ``evaluate_sharding_spec`` accepts."""
        return {
            "field_id": self.field_id,
            "source_ids": list(self.source_ids),
            "transform": self.transform,
            "expression": self.expression,
            "result_type": self.result_type,
            "parameters": dict(self.parameters),
        }


@dataclass(frozen=True)
class RegionSpec:
    """A region (shard) spec: values of all fields together name one region."""

    spec_id: int
    fields: tuple[RegionField, ...]

    @classmethod
    def from_proto(cls, spec: Any) -> "RegionSpec":
        """From memwal's protobuf `RegionSpec` (the MemWAL index details)."""
        return cls(spec_id=spec.spec_id, fields=tuple(
            RegionField(field_id=f.field_id, source_ids=tuple(f.source_ids),
                        transform=f.transform if f.HasField("transform") else None,
                        result_type=f.result_type,
                        parameters=tuple(sorted((p.key, p.value) for p in f.parameters)),
                        expression=f.expression if f.HasField("expression") else None)
            for f in spec.fields))

    @classmethod
    def from_lance(cls, d: Mapping[str, Any]) -> "RegionSpec":
        """Build from an entry of ``ds.mem_wal_index_details()["sharding_specs"]``."""
        fields = tuple(
            RegionField(
                field_id=str(f["field_id"]),
                source_ids=tuple(int(i) for i in f.get("source_ids") or ()),
                transform=f.get("transform"),
                result_type=str(f.get("result_type") or ""),
                parameters=tuple(
                    sorted((str(k), str(v)) for k, v in (f.get("parameters") or {}).items())
                ),
                expression=f.get("expression"),
            )
            for f in d["fields"]
        )
        return cls(spec_id=int(d["spec_id"]), fields=fields)

    def to_lance(self) -> dict[str, Any]:
        return {"spec_id": self.spec_id, "fields": [f.to_lance() for f in self.fields]}

    @property
    def sharded(self) -> bool:
        """Whether rows are routed by it: it has fields and not all of them are ``unsharded``
        (a manual region's spec 0 has none; an unsharded table's regions all hold value 0)."""
        return bool(self.fields) and not all(f.transform == UNSHARDED for f in self.fields)


# --------------------------------------------------------------------------
# Source column resolution
# --------------------------------------------------------------------------


def source_columns_for(spec: RegionSpec, schema: Any) -> dict[int, str]:
    """Map each source field id used by ``spec`` to its column name.

    Accepts ``ds.lance_schema`` (authoritative: field ids survive schema
    evolution) or a ``pa.Schema`` (ids assigned as Lance does for a fresh
    dataset: depth-first pre-order, counting struct/list/map children). Nested
    fields get dotted names, as Lance does; Lance then looks the name up among
    the batch's top-level columns only.
    """
    if isinstance(schema, pa.Schema):
        import lance.schema

        schema = lance.schema.LanceSchema.from_pyarrow(schema)
    by_id: dict[int, str] = {}

    def walk(fields: Iterable[Any], prefix: str) -> None:
        for f in fields:
            name = prefix + f.name()
            by_id[f.id()] = name
            walk(f.children(), name + ".")

    walk(schema.fields(), "")
    out: dict[int, str] = {}
    for field in spec.fields:
        if field.transform == UNSHARDED or _embedded_column(field):
            continue
        if not field.source_ids:
            raise ValueError(f"region field {field.field_id!r} has no source column")
        sid = field.source_ids[0]
        if sid not in by_id:
            raise ValueError(
                f"region field {field.field_id!r}: source id {sid} is not in the schema"
            )
        out[sid] = by_id[sid]
    return out


def _embedded_column(field: RegionField) -> str | None:
    """Lance lets a ``column`` parameter override ``source_ids``."""
    col = field.params.get("column")
    return col if col and col.strip() else None


def _source_array(
    field: RegionField, batch: pa.RecordBatch | pa.Table, source_columns: Mapping[int, str]
) -> pa.Array:
    name = _embedded_column(field)
    if name is None:
        if not field.source_ids:
            raise ValueError(f"region field {field.field_id!r} has no source column")
        sid = field.source_ids[0]  # Lance uses only the first source id
        if sid not in source_columns:
            raise ValueError(
                f"region field {field.field_id!r}: source id {sid} not mapped to a column"
            )
        name = source_columns[sid]
    names = batch.schema.names
    if name not in names:
        raise ValueError(f"region source column {name!r} not found in batch")
    col = batch.column(names.index(name))  # first match, like arrow-rs column_by_name
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col


# --------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------


def field_values(
    spec: RegionSpec, batch: pa.RecordBatch | pa.Table, source_columns: Mapping[int, str]
) -> dict[str, pa.Array]:
    """Region value of every row for each field of ``spec``, keyed by field id."""
    return {f.field_id: _evaluate_field(f, batch, source_columns) for f in spec.fields}


def evaluate_region_spec(
    spec: RegionSpec, batch: pa.RecordBatch | pa.Table, source_columns: Mapping[int, str]
) -> pa.Table:
    """Each row's region value: all fields as columns named by field id, typed like
    ``evaluate_sharding_spec``.

    Like arrow-rs, a column is marked nullable only if it holds a null.
    """
    arrays = [_evaluate_field(f, batch, source_columns) for f in spec.fields]
    schema = pa.schema(
        pa.field(f.field_id, a.type, nullable=a.null_count > 0)
        for f, a in zip(spec.fields, arrays)
    )
    return pa.Table.from_arrays(arrays, schema=schema)


def value_key(values: list) -> str:
    """A region value (one value per spec field, in spec order) as a comparable string: the
    Spark tasks count rows by it and the driver compares it with the regions' trusted values."""
    return json.dumps(values, sort_keys=True, default=str)


def _evaluate_field(
    field: RegionField, batch: pa.RecordBatch | pa.Table, source_columns: Mapping[int, str]
) -> pa.Array:
    if field.transform == UNSHARDED:
        return pa.array(np.zeros(batch.num_rows, dtype=np.int32))
    if field.transform == IDENTITY:
        return _source_array(field, batch, source_columns)
    if field.transform == BUCKET:
        n = _num_buckets(field)
        arr = _source_array(field, batch, source_columns)
        h = hash_array(arr)
        return pa.array(((h & np.uint32(0x7FFFFFFF)) % np.uint32(n)).astype(np.int32))
    raise UnsupportedTransform(
        f"region field {field.field_id!r}: transform {field.transform!r}"
        f" (expression {field.expression!r}) is not supported;"
        f" supported transforms: {', '.join(SUPPORTED_TRANSFORMS)}"
    )


def _num_buckets(field: RegionField) -> int:
    raw = field.params.get("num_buckets")
    if raw is None:
        raise ValueError(f"bucket field {field.field_id!r} has no 'num_buckets' parameter")
    if not re.fullmatch(r"[+-]?[0-9]+", raw):  # what Rust's i32 parse accepts
        raise ValueError(f"bucket field {field.field_id!r} has invalid num_buckets {raw!r}")
    n = int(raw)
    if not 0 < n <= 0x7FFFFFFF:
        raise ValueError(f"bucket field {field.field_id!r} needs 0 < num_buckets < 2^31, got {n}")
    return n


def misrouted_mask(
    spec: RegionSpec,
    batch: pa.RecordBatch | pa.Table,
    source_columns: Mapping[int, str],
    expected: Mapping[str, object],
) -> pa.BooleanArray:
    """True where a row's region value differs from ``expected[field_id]`` for any field.

    Lets the merger check that a region holds only its own rows. Identity values
    compare with Arrow equality (so -0.0 == 0.0), plus null == None and NaN == NaN.
    """
    mask = np.zeros(batch.num_rows, dtype=bool)
    for field in spec.fields:
        if field.field_id not in expected:
            raise ValueError(f"no expected value for region field {field.field_id!r}")
        mask |= _differs(_evaluate_field(field, batch, source_columns), expected[field.field_id])
    return pa.array(mask, type=pa.bool_())


def _differs(arr: pa.Array, want: object) -> np.ndarray:
    if isinstance(want, pa.Scalar):
        want = None if not want.is_valid else want.cast(arr.type)
    if want is None:
        return _np_bool(arr.is_valid())
    scalar = want if isinstance(want, pa.Scalar) else pa.scalar(want, type=arr.type)
    same = pc.fill_null(pc.equal(arr, scalar), False)
    if pa.types.is_floating(arr.type) and np.isnan(scalar.as_py()):
        same = pc.fill_null(pc.is_nan(arr), False)
    return ~_np_bool(same)


def _np_bool(a: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(a.to_numpy(zero_copy_only=False), dtype=bool)


# --------------------------------------------------------------------------
# Hashing (Lance's murmur3_x86_32 variant, seed 0), vectorized
# --------------------------------------------------------------------------

_U32 = np.uint32
_C1, _C2 = _U32(0xCC9E2D51), _U32(0x1B873593)
_F1, _F2 = _U32(0x85EBCA6B), _U32(0xC2B2AE35)
_F1_INV, _F2_INV = _U32(pow(0x85EBCA6B, -1, 1 << 32)), _U32(pow(0xC2B2AE35, -1, 1 << 32))
_LONG_STRING_BLOCKS = 32  # rows with more whole blocks hash their blocks via mmh3 (C)

_INT32_LIKE = {
    pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32,
    pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32,
}  # fmt: skip


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << _U32(r)) | (x >> _U32(32 - r))


def _mix_k1(k: np.ndarray) -> np.ndarray:
    return _rotl(k * _C1, 15) * _C2


def _mix_h1(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    return _rotl(h ^ k, 13) * _U32(5) + _U32(0xE6546B64)


def _fmix(h: np.ndarray, length: np.ndarray | np.uint32) -> np.ndarray:
    h = h ^ length
    h ^= h >> _U32(16)
    h *= _F1
    h ^= h >> _U32(13)
    h *= _F2
    h ^= h >> _U32(16)
    return h


def _unfmix(h: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Invert ``_fmix`` (every step is a bijection), recovering the running h1."""
    h = h ^ (h >> _U32(16))
    h *= _F2_INV
    h = h ^ (h >> _U32(13)) ^ (h >> _U32(26))
    h *= _F1_INV
    h ^= h >> _U32(16)
    return h ^ length


def _hash_int(v: np.ndarray) -> np.ndarray:
    """Hash of int32 values given as uint32 bit patterns (== mmh3 of 4 LE bytes)."""
    return _fmix(_mix_h1(np.zeros_like(v), _mix_k1(v)), _U32(4))


def _hash_long(v: np.ndarray) -> np.ndarray:
    """Hash of int64 values given as uint64 bit patterns (== mmh3 of 8 LE bytes)."""
    lo = (v & np.uint64(0xFFFFFFFF)).astype(_U32)
    hi = (v >> np.uint64(32)).astype(_U32)
    h = _mix_h1(np.zeros_like(lo), _mix_k1(lo))
    return _fmix(_mix_h1(h, _mix_k1(hi)), _U32(8))


def _values(arr: pa.Array, dtype: Any) -> np.ndarray:
    """The value buffer as numpy (null slots hold arbitrary values)."""
    buf = arr.buffers()[1]
    if len(arr) == 0 or buf is None:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(buf, dtype=dtype)[arr.offset : arr.offset + len(arr)]


def _hash_strings(arr: pa.Array) -> np.ndarray:
    n = len(arr)
    bufs = arr.buffers()
    off_t = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    offs = np.frombuffer(bufs[1], dtype=off_t)[arr.offset : arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    starts, lens = offs[:-1], np.diff(offs)
    nblocks = lens // 4
    h = np.zeros(n, dtype=_U32)

    # Long strings: let mmh3 (C) hash the whole blocks, then undo its final mix.
    long_rows = np.flatnonzero(nblocks > _LONG_STRING_BLOCKS)
    if long_rows.size:
        digests = np.fromiter(
            (
                mmh3.hash(data[s : s + 4 * b].tobytes(), 0, signed=False)
                for s, b in zip(starts[long_rows].tolist(), nblocks[long_rows].tolist())
            ),
            dtype=_U32,
            count=long_rows.size,
        )
        h[long_rows] = _unfmix(digests, (4 * nblocks[long_rows]).astype(_U32))

    # Short strings: one numpy pass per block index, over the rows that have it.
    short_nb = np.where(nblocks > _LONG_STRING_BLOCKS, 0, nblocks)
    order = np.argsort(-short_nb, kind="stable")
    counts = np.bincount(short_nb, minlength=1)[::-1].cumsum()[::-1]  # counts[j] = #rows nb >= j
    for j in range(1, len(counts)):
        rows = order[: counts[j]]
        p = starts[rows] + 4 * (j - 1)
        word = (
            data[p].astype(_U32)
            | (data[p + 1].astype(_U32) << _U32(8))
            | (data[p + 2].astype(_U32) << _U32(16))
            | (data[p + 3].astype(_U32) << _U32(24))
        )
        h[rows] = _mix_h1(h[rows], _mix_k1(word))

    # Tail: Lance mixes each leftover byte, sign-extended, as its own block.
    tail_start = starts + 4 * nblocks
    rem = lens - 4 * nblocks
    for t in range(3):
        rows = np.flatnonzero(rem > t)
        if rows.size:
            b = data[tail_start[rows] + t].view(np.int8).astype(np.int32).view(_U32)
            h[rows] = _mix_h1(h[rows], _mix_k1(b))
    return _fmix(h, lens.astype(_U32))


def hash_array(arr: pa.Array) -> np.ndarray:
    """Lance's 32-bit bucket hash of every row as uint32 (nulls hash to 0)."""
    t = arr.type
    if len(arr) == 0:
        return np.zeros(0, dtype=_U32)
    if t in _INT32_LIKE:
        h = _hash_int(_values(arr, _INT32_LIKE[t]).astype(np.int32).view(_U32))
    elif pa.types.is_date32(t) or pa.types.is_time32(t):
        h = _hash_int(_values(arr, np.int32).view(_U32))
    elif t in (pa.int64(), pa.uint64()) or pa.types.is_timestamp(t) or pa.types.is_time64(t):
        h = _hash_long(_values(arr, np.uint64))
    elif pa.types.is_boolean(t):
        h = _hash_int(_np_bool(arr.fill_null(False)).astype(_U32))
    elif t == pa.float32():
        v = _values(arr, np.float32)
        bits = np.where(v == 0, _U32(0), v.view(_U32))
        h = _hash_int(np.where(np.isnan(v), _U32(0x7FC00000), bits))
    elif t == pa.float64():
        v = _values(arr, np.float64)
        bits = np.where(v == 0, np.uint64(0), v.view(np.uint64))
        h = _hash_long(np.where(np.isnan(v), np.uint64(0x7FF8000000000000), bits))
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        h = _hash_strings(arr)
    else:
        raise UnsupportedSourceType(
            f"bucket transform cannot hash source type {t}; Lance supports ints, uint,"
            " float32/64, bool, date32, time32/64, timestamp, utf8, large_utf8"
        )
    if arr.null_count:
        h = np.where(_np_bool(arr.is_valid()), h, _U32(0))
    return h
