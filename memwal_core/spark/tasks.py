"""Spark data path of the merger: one Spark task per group of regions, no shuffle.

Regions own disjoint primary keys (the spec requires it; the driver verifies it on every
batch), so the newest row of a key is decided inside its region. Each Spark task therefore
takes whole regions: it reads each region's generations in ascending order through Lance (so
in-generation deletion files apply), checks them (columns, routing), keeps the newest row per
key over the generations it may merge, and returns live rows and tombstoned keys as **Arrow
IPC blobs**. One stage, nothing shuffled: rows cross the JVM once, on their way to the driver;
when the executors run on the driver's machine, not even once (`results.py`: files instead).
(A first design hash-partitioned keys across a shuffle; it moved every row through the JVM
four times and was ~2x slower at 200 generations, see docs/benchmarks.md.) Blobs rather than
Spark rows keep every Arrow type (unsigned ints, nanosecond timestamps, fixed-size-list
vectors, ...) exactly as written. Only DataFrame APIs are used, so a Spark Connect session or
a cluster master works the same as `local[*]`.

The price: one region's share of a batch is one task, so parallelism comes from regions (a
single-region table merges on one core; the batch budget bounds that task's work).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import io
import json
import logging
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_core.errors import MemwalError, one_line
from memwal_core.state.keys import all_distinct
from memwal_core.state.routing import value_key  # noqa: F401 - one definition, shared with the trusted values
from memwal_core.failures import RegionFailure
from memwal_core.spark import results

# pylance warns whenever a process that loaded it forks; Spark's worker daemon forks workers
# that import lance afresh, so the warning is noise here.
warnings.filterwarnings("ignore", message="lance is not fork-safe")

log = logging.getLogger(__name__)

REGION_COL = "_memwal_region"
TOMBSTONE = "_tombstone"
ROWS_PER_BLOB = 65536

# Task output: per generation one 'stats' row; per region the 'live' rows and 'del' keys as blobs.
OUTPUT_SCHEMA = pa.schema([
    ("kind", pa.string()),          # 'stats' | 'live' | 'del'
    ("region", pa.int32()),
    ("generation", pa.int64()),
    ("blob", pa.binary()),
    ("rows", pa.int64()),
    ("bytes", pa.int64()),
    ("info", pa.string()),          # stats: `GenerationStats.info` (JSON), decoded once on the driver;
                                    # live/del: the result file's name (`results.py`), or "" (rows in `blob`)
])
OUTPUT_DDL = "kind string, region int, generation long, blob binary, rows long, bytes long, info string"


def to_blob(table: pa.Table | pa.RecordBatch) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write(table)
    return sink.getvalue()


def from_blob(blob: bytes | pa.Buffer) -> pa.Table:
    return pa.ipc.open_stream(blob if isinstance(blob, pa.Buffer) else pa.py_buffer(blob)).read_all()


@dataclass(frozen=True)
class ReadConfig:
    """What the merge tasks need; pickled into them (storage options are never logged)."""

    pk: tuple[str, ...]
    columns: tuple[str, ...]            # base-table columns, in order (without _tombstone)
    storage_options: tuple[tuple[str, str], ...]
    routing: tuple[tuple[int, "RoutingCheck | None"], ...]  # region index -> how its rows route (None: unchecked)
    own_values: tuple[tuple[int, str], ...] = ()  # region index -> its region value (`value_key`), if known
    base_schema: pa.Schema | None = None  # the base table's schema (types, nullability); None = unchecked
    base_field_ids: tuple[tuple[str, int], ...] = ()  # the base table's top-level Lance field ids by name
    dropped_fields: tuple[tuple[str, int], ...] | None = None  # (name, field id) the base dropped; None: not looked up
    read_threads: int = 4                # generations a task reads at once
    read_attempts: int = 3               # tries per generation before a read failure stops its region
    retry_backoff_s: float = 0.2         # first back-off between tries (doubles)
    result_dir: str | None = None        # where tasks write their rows (`results.py`); None: through Spark

    def __repr__(self) -> str:  # the storage options hold credentials: never in a repr
        return (f"ReadConfig(pk={self.pk}, columns={self.columns}, "
                f"storage_options={sorted(k for k, _ in self.storage_options)}, routing=...)")


@dataclass(frozen=True)
class RoutingCheck:
    """How one region's rows route: its region spec (Lance's dict form, what
    `evaluate_sharding_spec` takes) and the column of each source field. Pickled into the tasks."""

    spec: dict
    source_columns: tuple[tuple[int, str], ...]

    @property
    def field_ids(self) -> list[str]:
        return [f["field_id"] for f in self.spec["fields"]]


def route_counts(table: pa.Table, check: RoutingCheck, pk: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """((region value as `value_key`, rows), ...) over the rows that can be routed.

    Live rows always; tombstones only when every routing column is a key column. A delete's
    tombstone carries only the key (NULL elsewhere), so a spec on a non-key column would send
    every tombstone to the NULL value's region (bucket 0): tombstones are checked by their
    key instead (no key may sit in two regions; `shared_keys` on the driver).
    """
    from memwal_core.state import routing

    spec = routing.RegionSpec.from_lance(check.spec)
    sources = dict(check.source_columns)
    if TOMBSTONE in table.column_names and not set(sources.values()) <= set(pk):
        table = table.filter(pc.invert(table.column(TOMBSTONE).fill_null(False)))
    values = routing.evaluate_region_spec(spec, table, sources)
    if values.num_rows == 0:
        return ()
    if values.num_columns == 1:  # one field: value_counts is far cheaper than a group_by
        counts = pc.value_counts(values.column(0))
        return tuple((value_key([v]), c) for v, c in zip(counts.field("values").to_pylist(),
                                                         counts.field("counts").to_pylist()))
    counts = values.group_by(values.column_names).aggregate([([], "count_all")])
    return tuple((value_key([r[c] for c in values.column_names]), r["count_all"]) for r in counts.to_pylist())


@dataclass(frozen=True)
class GenerationStats:
    """What a merge task found in one generation it read: the 'stats' row of its output.

    It crosses from the Spark task to the driver as the row's columns plus `info` (JSON for
    the variable part), encoded by `info` and decoded by `from_row` only, so both sides work
    with this type. `routes` counts the routable rows per region value (`value_key`); `error`
    says why the generation cannot be merged (`permanent`: the generation itself is wrong;
    otherwise its read failed and may pass); `fields` are its (name, Lance field id) pairs the
    base table's schema does not have (the driver looks them up in the base table's history)."""

    region: int                 # region index within the batch
    generation: int
    rows: int = 0
    bytes: int = 0
    routes: tuple[tuple[str, int], ...] = ()
    error: str | None = None
    permanent: bool = True
    fields: tuple[tuple[str, int], ...] = ()

    @property
    def info(self) -> str:
        return json.dumps({"routes": [list(r) for r in self.routes], "error": self.error,
                           "permanent": self.permanent, "fields": [list(f) for f in self.fields]})

    @classmethod
    def from_row(cls, region: int, generation: int, rows: int, nbytes: int, info: str) -> GenerationStats:
        d = json.loads(info)
        return cls(region, generation, rows, nbytes, tuple((str(v), int(c)) for v, c in d["routes"]),
                   d["error"], bool(d.get("permanent", True)),
                   tuple((str(n), int(i)) for n, i in d.get("fields", ())))


class Refused(MemwalError, ValueError):
    """A generation that can never be merged as it is (schema, NULL keys): permanent.
    `fields`: its (name, field id) pairs the base table's schema does not have (the driver
    looks them up in the base table's history: a dropped column is projected away)."""

    def __init__(self, message: str, fields: list | None = None):
        super().__init__(message)
        self.fields = fields or []


def first_routed_value(stats: list[GenerationStats]) -> tuple[int, str] | None:
    """(generation, value) of a region's first readable generation with routable rows, when all
    those rows route to one value: the region's value when nothing authoritative is known."""
    for s in sorted(stats, key=lambda s: s.generation):
        if s.error:
            return None
        values = {v for v, _ in s.routes}
        if values:
            return (s.generation, next(iter(values))) if len(values) == 1 else None
    return None


def first_refused(stats: list[GenerationStats], own: str | None, region_id: str = "") -> RegionFailure | None:
    """The first generation of one region (stats rows, any order) that must not be merged, as
    the region's failure (`region_id` names it; the task, which knows only region indexes,
    leaves it empty).

    A generation is refused when its read failed (wrong columns, NULL keys, unreadable) or when
    any of its routable rows routes to a region value other than the region's own. `own` comes
    from authoritative state (the MemWAL snapshot, or the region's first generation, decided by
    the driver); when it is not known, the region's first routed generation here must route
    all its rows to one value, which becomes the region's (never a majority vote). Stray rows
    are counted over all the region's generations, so the report says how big the damage is.
    `permanent`: the generation itself is wrong (columns, routing, NULL keys); otherwise its
    read failed after `ReadConfig.read_attempts` tries and the next run tries again.
    """
    first: tuple[int, str, bool] | None = None  # (generation, message, permanent)
    offending = 0
    elsewhere: Counter = Counter()  # stray rows per region value they route to
    for s in sorted(stats, key=lambda s: s.generation):
        if s.error:
            first = first or (s.generation, f"generation {s.generation}: {s.error}", s.permanent)
            continue
        counts = Counter(dict(s.routes))
        if counts and own is None:
            if len(counts) > 1:
                first = first or (
                    s.generation, f"generation {s.generation}: its rows route to {len(counts)} "
                    "different region values and the region's own value is not established yet "
                    "(no MemWAL snapshot value, no earlier generation); the spec requires mutually "
                    "exclusive regions", True)
                offending += sum(counts.values()) - max(counts.values())
                continue
            own = next(iter(counts))
        stray = sum(c for v, c in counts.items() if v != own)
        if stray:
            first = first or (s.generation, "", True)
            offending += stray
            for v, c in counts.items():
                if v != own:
                    elsewhere[v] += c
    if first is None:
        return None
    generation, message, permanent = first
    values = ", ".join(f"{v} ({c} rows)" for v, c in elsewhere.most_common(3))
    more = f" and {len(elsewhere) - 3} more" if len(elsewhere) > 3 else ""
    message = message or (f"generation {generation}: {offending} rows route to another region (region value "
                          f"{own}; they route to {values}{more}); the spec requires mutually exclusive regions")
    return RegionFailure(region_id, generation, f"region {region_id}: {message}" if region_id else message,
                         permanent, offending_rows=offending)


def _read_generation(ds_uri: str, cfg: ReadConfig, check: RoutingCheck | None, options
                     ) -> tuple[pa.Table, tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
    """One generation's rows in row order (columns in base-table order + _tombstone), its
    route counts and its fields the base table's schema does not have. Raises `Refused` when it can never be merged as it is (wrong columns, NULL
    keys) and anything else when it could not be read."""
    import lance

    ds = lance.dataset(ds_uri, storage_options=options)
    want = list(cfg.columns) + [TOMBSTONE]
    # A generation carries the base table's Lance field ids of when it was written. A column whose
    # (name, id) the base table dropped since (`drop_columns`; also a dropped column re-added under
    # the same name, which gets a new id) is data the table no longer has: projected away, and a
    # re-added column is then missing here (NULL, as for `add_columns`). A column the base never
    # had stays refused: dropping it would silently drop data.
    base_ids = dict(cfg.base_field_ids)
    unmatched = sorted([f.name(), f.id()] for f in ds.lance_schema.fields()
                       if f.name() != TOMBSTONE and base_ids and base_ids.get(f.name()) != f.id())
    dropped = {tuple(x) for x in cfg.dropped_fields or ()}
    gone = {n for n, i in unmatched if (n, i) in dropped}
    names = [f.name for f in ds.schema if f.name not in gone]
    extra = sorted(set(names) - set(want))
    missing = sorted(set(want) - set(names))
    base = cfg.base_schema
    # A generation flushed before `add_columns` lacks the new columns: read as NULL there, as a
    # reader of the table shows them. Anything else (extra columns, a missing key, _tombstone or
    # non-nullable column) is not a schema this table ever had.
    evolved = base is not None and not extra and all(
        c != TOMBSTONE and c not in cfg.pk and base.field(c).nullable for c in missing)
    if (extra or missing) and not evolved:
        raise Refused(f"columns differ from the base table: extra {extra}, missing {missing}", unmatched)
    if base is not None:
        wrong = [f"{c!r} is {ds.schema.field(c).type}, the base table's is {base.field(c).type}"
                 for c in cfg.columns if c in names and not ds.schema.field(c).type.equals(base.field(c).type)]
        if wrong:
            raise Refused(f"column types differ from the base table: {'; '.join(wrong)}")
    present = [c for c in want if c in names]
    table = ds.to_table(columns=present, with_row_address=True)
    addr = table.column(table.num_columns - 1)
    if table.num_rows > 1 and not pc.all(pc.greater_equal(addr.slice(1), addr.slice(0, table.num_rows - 1))).as_py():
        table = table.sort_by(table.column_names[-1])  # later position wins: rows must be in write order
    table = table.drop_columns([table.column_names[-1]])
    if missing:
        for c in missing:
            table = table.append_column(base.field(c), pa.nulls(table.num_rows, base.field(c).type))
        table = table.select(want)
    nulls = {c: table.column(c).null_count for c in cfg.pk if table.column(c).null_count}
    if nulls:
        raise Refused(f"NULL primary key values ({', '.join(f'{c}: {n} rows' for c, n in nulls.items())}); "
                      "a row without a key cannot be upserted or deleted")
    return table, route_counts(table, check, cfg.pk) if check else (), tuple((n, i) for n, i in unmatched)


def _read_with_retries(ds_uri: str, cfg: ReadConfig, check: RoutingCheck | None, options, region: int,
                       generation: int) -> tuple[pa.Table | None, GenerationStats]:
    """`_read_generation` and its stats, retried with back-off on failures that may pass (I/O,
    object-store 5xx, a directory briefly missing): `cfg.read_attempts` tries, waiting
    `cfg.retry_backoff_s` before the second and doubling. A `Refused` generation is not retried."""
    from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

    attempts = max(1, cfg.read_attempts)
    tries = Retrying(stop=stop_after_attempt(attempts), wait=wait_exponential(multiplier=cfg.retry_backoff_s),
                     retry=retry_if_exception(lambda e: isinstance(e, Exception) and not isinstance(e, Refused)))
    try:
        table, routes, fields = tries(_read_generation, ds_uri, cfg, check, options)
        return table, GenerationStats(region, generation, table.num_rows, table.nbytes, routes, fields=fields)
    except Refused as e:
        return None, GenerationStats(region, generation, error=str(e), permanent=True,
                                     fields=tuple((n, i) for n, i in e.fields))
    except RetryError as e:  # reported per generation; the region stops for this run
        return None, GenerationStats(region, generation, permanent=False,
                                     error=f"unreadable after {attempts} tries: {one_line(e.last_attempt.exception())}")


def newest_rows(tables: list[pa.Table], pk: list[str]) -> pa.Table:
    """The newest row of each key among `tables` (one region's generations, oldest first, each
    in write order): the key's last row in their concatenation."""
    table = pa.concat_tables(tables, promote_options="permissive")
    table = table.append_column("_memwal_i", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    last = table.group_by(pk, use_threads=False).aggregate([("_memwal_i", "max")])
    return table.take(last["_memwal_i_max"]).drop_columns(["_memwal_i"])


def merge_regions(cfg: ReadConfig, groups: tuple, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The Spark task: for each region of its group, read, check and deduplicate its generations.

    Only the generations before the region's first refused one (`first_refused`) are
    deduplicated; every generation read gets a stats row, so the driver can report and decide.
    A refused generation's later generations are still read, to count their stray rows.
    """
    options = dict(cfg.storage_options) or None
    routes = dict(cfg.routing)
    own = dict(cfg.own_values)

    def read(ridx: int, generation: int, uri: str) -> tuple[pa.Table | None, GenerationStats]:
        return _read_with_retries(uri, cfg, routes.get(ridx), options, ridx, generation)

    # Generations are read `read_threads` at a time: opening and scanning a small Lance dataset
    # is mostly waiting (file I/O, object-store round trips) with the GIL released.
    with ThreadPoolExecutor(max(1, cfg.read_threads)) as pool:
        for batch in batches:
            for group in batch.column("id").to_pylist():
                for ridx, generations in groups[group]:
                    # No name keeps the tables alive here: _merge_region drops them as it goes.
                    yield _merge_region(cfg, ridx, list(pool.map(lambda gu: read(ridx, *gu), generations)),
                                        own.get(ridx) or None)


def _merge_region(cfg: ReadConfig, ridx: int, read: list[tuple[pa.Table | None, GenerationStats]],
                  own: str | None) -> pa.RecordBatch:
    """One region's output from its generations' (table, stats) in ascending order: a stats row
    per generation, then its newest live rows and tombstoned keys over the generations before
    its first refused one."""
    stats = [s for _, s in read]
    refused = first_refused(stats, own)
    keep = [t for t, s in read if refused is None or s.generation < refused.generation]
    rows = [("stats", s.generation, b"", s.rows, s.bytes, s.info) for s in stats]
    del read
    if keep:
        newest = newest_rows(keep, list(cfg.pk))
        del keep
        dead = newest.column(TOMBSTONE).fill_null(False)
        live = newest.filter(pc.invert(dead)).drop_columns([TOMBSTONE])
        gone = newest.filter(dead).select(list(cfg.pk))
        for kind, t in (("live", live), ("del", gone)):
            if cfg.result_dir is not None and t.num_rows:  # a file of this machine; the row carries its name
                try:
                    rows.append((kind, -1, b"", t.num_rows, t.nbytes, results.write(cfg.result_dir, t, ROWS_PER_BLOB)))
                    continue
                except OSError as e:  # a full or read-only temporary directory: through Spark instead
                    log.warning("merge task: result file not written (%s); returning the rows through Spark",
                                one_line(e))
            for off in range(0, t.num_rows, ROWS_PER_BLOB):
                chunk = t.slice(off, ROWS_PER_BLOB)
                rows.append((kind, -1, to_blob(chunk), chunk.num_rows, chunk.nbytes, ""))
    return _output_batch(ridx, rows)


def _output_batch(ridx: int, rows: list[tuple]) -> pa.RecordBatch:
    kind, generation, blob, nrows, nbytes, info = zip(*rows)
    return pa.RecordBatch.from_arrays(
        [pa.array(kind, pa.string()), pa.array([ridx] * len(rows), pa.int32()), pa.array(generation, pa.int64()),
         pa.array(blob, pa.binary()), pa.array(nrows, pa.int64()), pa.array(nbytes, pa.int64()),
         pa.array(info, pa.string())], schema=OUTPUT_SCHEMA)


def pack_regions(generations: list[tuple[int, int, str, int]], tasks: int) -> tuple:
    """Regions -> at most `tasks` groups of about equal bytes (largest region first onto the
    lightest group). `generations` are (region index, generation, uri, bytes); each group is a
    tuple of (region index, ((generation, uri), ...) ascending)."""
    by_region: dict[int, list[tuple[int, str, int]]] = {}
    for ridx, generation, uri, nbytes in generations:
        by_region.setdefault(ridx, []).append((generation, uri, nbytes))
    weight = {r: sum(max(1, b) for _, _, b in gs) for r, gs in by_region.items()}
    n = max(1, min(tasks, len(by_region)))
    heap = [(0, i) for i in range(n)]
    groups: list[list] = [[] for _ in range(n)]
    for r in sorted(by_region, key=lambda r: (-weight[r], r)):
        load, i = heapq.heappop(heap)
        groups[i].append((r, tuple((g, u) for g, u, _ in sorted(by_region[r]))))
        heapq.heappush(heap, (load + weight[r], i))
    return tuple(tuple(g) for g in groups if g)


@dataclass
class Deduped:
    """One batch's newest rows, on the driver: bounded by the batch budget."""

    stats: list[GenerationStats]        # one per generation read
    live: list[pa.Table] = field(default_factory=list)
    deleted: list[pa.Table] = field(default_factory=list)
    live_region: list[int] = field(default_factory=list)      # region index of each `live` table
    deleted_region: list[int] = field(default_factory=list)   # region index of each `deleted` table
    shared: dict[int, int] = field(default_factory=dict)  # region index -> its keys also in another region
    shared_keys: int = 0

    def only(self, regions: set[int]) -> "Deduped":
        """The part of this batch that belongs to `regions` (to commit them on their own)."""
        return Deduped([s for s in self.stats if s.region in regions],
                       [t for t, r in zip(self.live, self.live_region) if r in regions],
                       [t for t, r in zip(self.deleted, self.deleted_region) if r in regions],
                       [r for r in self.live_region if r in regions],
                       [r for r in self.deleted_region if r in regions])


def read_and_dedup(spark, generations: list[tuple[int, int, str, int]], cfg: ReadConfig, tasks: int) -> Deduped:
    """Run one Spark job over `generations` (region index, generation, uri, bytes) and collect
    the newest rows per region; then check on the driver that no key sits in two regions."""
    groups = pack_regions(generations, tasks)
    with results.job_directory(spark) as result_dir:
        job_cfg = dataclasses.replace(cfg, result_dir=result_dir)
        df = spark.range(0, len(groups), 1, numPartitions=len(groups))
        out = df.mapInArrow(functools.partial(merge_regions, job_cfg, groups), OUTPUT_DDL).toArrow()
        return _collect(out, result_dir, list(cfg.pk))


def _collect(out: pa.Table, result_dir: str | None, pk: list[str]) -> Deduped:
    """The job's output rows as a `Deduped` (rows from the files of `result_dir`, or the blobs)."""
    result = Deduped(stats=[])
    keys: list[tuple[int, pa.Table]] = []
    regions = out.column("region").to_pylist()
    for i, kind in enumerate(out.column("kind").to_pylist()):
        if kind == "stats":
            result.stats.append(GenerationStats.from_row(
                regions[i], out.column("generation")[i].as_py(), out.column("rows")[i].as_py(),
                out.column("bytes")[i].as_py(), out.column("info")[i].as_py()))
            continue
        name = out.column("info")[i].as_py()
        table = results.read(result_dir, name) if name and result_dir is not None \
            else from_blob(out.column("blob")[i].as_buffer())
        if table.num_rows != out.column("rows")[i].as_py():  # a short file or blob must never commit fewer rows
            raise MemwalError(f"merge task output for region index {regions[i]}: {table.num_rows} {kind} rows "
                              f"arrived, the task wrote {out.column('rows')[i].as_py()}")
        (result.live if kind == "live" else result.deleted).append(table)
        (result.live_region if kind == "live" else result.deleted_region).append(regions[i])
        keys.append((regions[i], table.select(pk)))
    result.shared, result.shared_keys = shared_keys(keys, pk)
    return result


def shared_keys(keys_by_region: list[tuple[int, pa.Table]], pk: list[str]) -> tuple[dict[int, int], int]:
    """Keys present in more than one region (which the spec forbids): per region index how many
    of its rows have such a key, and how many such keys. Cheap when there are none, for a
    single-column key (`keys.all_distinct`: integers sorted, other types one distinct count)."""
    if not keys_by_region:
        return {}, 0
    if len(pk) == 1 and all_distinct(pa.concat_tables([t.select(pk) for _, t in keys_by_region],
                                                      promote_options="permissive").column(pk[0])):
        return {}, 0
    keys = pa.concat_tables([t.append_column(REGION_COL, pa.array(np.full(t.num_rows, r, np.int32)))
                             for r, t in keys_by_region], promote_options="permissive")
    spans = keys.group_by(pk, use_threads=False).aggregate([(REGION_COL, "min"), (REGION_COL, "max")])
    shared = spans.filter(pc.not_equal(spans[f"{REGION_COL}_min"], spans[f"{REGION_COL}_max"])).select(pk)
    if not shared.num_rows:
        return {}, 0
    per = keys.join(shared, pk, join_type="inner").group_by([REGION_COL]).aggregate([([], "count_all")])
    return dict(zip(per[REGION_COL].to_pylist(), per["count_all"].to_pylist())), shared.num_rows
