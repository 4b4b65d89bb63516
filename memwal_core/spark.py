"""Spark data path of the merger: parallel generation reads and newest-wins deduplication.

Rows cross Spark as **Arrow IPC blobs**, not as Spark rows: stage 1 reads one flushed
generation per task through Lance (so in-generation deletion files apply), tags each row with
its generation and position, and emits one binary blob per hash partition of the primary key;
stage 2 gets every blob of a partition together and keeps the newest row per key. Spark thus
does the parallel I/O and the shuffle while every Arrow type (unsigned ints, nanosecond
timestamps, fixed-size-list vectors, ...) reaches the merge exactly as written, which a
conversion to Spark's own types would not guarantee. Only DataFrame APIs are used, so a
Spark Connect session or a cluster master works the same as `local[*]`.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Iterator

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# pylance warns whenever a process that loaded it forks; Spark's worker daemon forks workers
# that import lance afresh, so the warning is noise here.
warnings.filterwarnings("ignore", message="lance is not fork-safe")

log = logging.getLogger(__name__)

GEN_COL = "_memwal_gen"
ORD_COL = "_memwal_ord"
REGION_COL = "_memwal_region"
TOMBSTONE = "_tombstone"
ROWS_PER_BLOB = 65536

# Stage 1 output: data blobs per hash partition, plus one stats row per task.
STAGE1_SCHEMA = pa.schema([
    ("kind", pa.string()),          # 'data' | 'stats'
    ("part", pa.int32()),
    ("region", pa.int32()),
    ("generation", pa.int64()),
    ("blob", pa.binary()),
    ("rows", pa.int64()),
    ("bytes", pa.int64()),
    ("info", pa.string()),          # stats: JSON {routes: [[values, count]], error: str|None}
])

STAGE1_DDL = "kind string, part int, region int, generation long, blob binary, rows long, bytes long, info string"

# Stage 2 output: newest live rows and tombstoned keys, plus cross-region duplicate counts.
STAGE2_SCHEMA = pa.schema([
    ("kind", pa.string()),          # 'live' | 'del' | 'dups' | 'stats' (one-job path)
    ("blob", pa.binary()),
    ("rows", pa.int64()),
    ("info", pa.string()),
])
STAGE2_DDL = "kind string, blob binary, rows long, info string"


_prestart_lock = threading.Lock()
_prestarting: threading.Thread | None = None


def prestart(master: str = "local[*]", conf: dict[str, str] | None = None) -> None:
    """Start the session and its Python workers in the background (a no-op for `sc://`).

    A short-lived process (the CLI) otherwise pays the JVM start (~7 s here) and then the first
    job's worker start-up (fork, import lance) one after the other, after its own imports and
    planning; started early they overlap. `get_spark` waits for a prestart in flight.
    """
    global _prestarting
    if master.startswith("sc://"):
        return
    with _prestart_lock:
        if _prestarting is not None:
            return

        def run() -> None:
            try:
                warm_workers(_build_session(master, conf))
            except Exception:  # noqa: BLE001 - get_spark will raise the real error in the caller
                log.debug("Spark prestart failed", exc_info=True)

        _prestarting = threading.Thread(target=run, name="memwal-spark-prestart", daemon=True)
        _prestarting.start()


def _import_worker_modules(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    import lance  # noqa: F401  (the import is the point: it takes a fresh worker ~1 s)

    from . import routing  # noqa: F401

    yield from batches


def warm_workers(session) -> None:
    """One trivial task per core, so Python workers exist and have imported lance."""
    n = max(1, int(session.sparkContext.defaultParallelism))
    session.range(0, n, 1, n).mapInArrow(_import_worker_modules, "id long").collect()


def get_spark(master: str = "local[*]", conf: dict[str, str] | None = None, app_name: str = "memwal"):
    """A SparkSession for the merger (`getOrCreate`: an existing session in the process wins).

    A `sc://host:port` master builds a Spark Connect session instead of a local JVM.
    """
    thread = _prestarting
    if thread is not None and thread is not threading.current_thread():
        thread.join()
    return _build_session(master, conf, app_name)


def _build_session(master: str, conf: dict[str, str] | None = None, app_name: str = "memwal"):
    from pyspark.sql import SparkSession

    conf = dict(conf or {})
    if master.startswith("sc://"):
        return SparkSession.builder.remote(master).appName(app_name).getOrCreate()
    defaults = {
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(max(2, (os.cpu_count() or 2))),
        "spark.driver.memory": "2g",
        "spark.sql.execution.pyspark.udf.faulthandler.enabled": "true",
    }
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # a local session binds to loopback
        log4j = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")
        defaults["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile=file:{log4j}"
        # Python workers must run this interpreter (it has lance and memwal_core); Spark reads
        # PYSPARK_PYTHON when it forks them. On a cluster, the executors' Python is the cluster's.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app_name)
    for k, v in {**defaults, **conf}.items():
        builder = builder.config(k, v)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(conf.get("memwal.log_level", "ERROR"))
    return session


def to_blob(table: pa.Table | pa.RecordBatch) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write(table)
    return sink.getvalue()


def from_blob(blob: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(blob)).read_all()


def key_partition(table: pa.Table, pk: list[str], parts: int) -> np.ndarray:
    """Deterministic (same in every process) hash partition of each row's primary key.

    A single non-null integer key (the common case) is mixed with splitmix64 in numpy, ~30x
    cheaper than pandas' generic row hashing, which every other key shape uses.
    """
    col = table.column(pk[0]) if len(pk) == 1 else None
    if col is not None and pa.types.is_integer(col.type) and col.null_count == 0:
        with np.errstate(over="ignore"):
            x = col.to_numpy().astype(np.int64).view(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(31))
        return (x % np.uint64(parts)).astype(np.int32)
    import pandas as pd

    frame = table.select(pk).to_pandas()
    return (pd.util.hash_pandas_object(frame, index=False).to_numpy() % np.uint64(parts)).astype(np.int32)


@dataclass(frozen=True)
class ReadConfig:
    """What stage-1 tasks need; pickled into the tasks (storage options are never logged)."""

    pk: tuple[str, ...]
    columns: tuple[str, ...]            # base-table columns, in order (without _tombstone)
    parts: int
    storage_options: tuple[tuple[str, str], ...]
    routing: tuple[tuple[int, str], ...]  # region index -> JSON {spec, source_columns} ('' = none)

    def __repr__(self) -> str:  # the storage options hold credentials: never in a repr
        return (f"ReadConfig(pk={self.pk}, columns={self.columns}, parts={self.parts}, "
                f"storage_options={sorted(k for k, _ in self.storage_options)}, routing=...)")


def _route_counts(table: pa.Table, routing_json: str) -> list:
    from . import routing

    cfg = json.loads(routing_json)
    spec = routing.RegionSpec.from_lance(cfg["spec"])
    sources = {int(k): v for k, v in cfg["source_columns"].items()}
    values = routing.region_values(spec, table, sources)
    if values.num_rows == 0:
        return []
    if values.num_columns == 1:  # one field: value_counts is far cheaper than a group_by
        counts = pc.value_counts(values.column(0))
        return [[[v], c] for v, c in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist())]
    counts = values.group_by(values.column_names).aggregate([([], "count_all")])
    return [[[r[c] for c in values.column_names], r["count_all"]] for r in counts.to_pylist()]


def read_generations(cfg: ReadConfig, tasks: tuple, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Stage 1: read each task's generation through Lance; emit hash-partitioned blobs + stats."""
    import lance

    options = dict(cfg.storage_options) or None
    routes = dict(cfg.routing)
    for batch in batches:
        for task_id in batch.column("id").to_pylist():
            tid, region_idx, generation, uri = tasks[task_id]
            task = {"region": region_idx, "generation": generation, "uri": uri}
            info: dict = {"routes": [], "error": None}
            nbytes = nrows = 0
            rows: list[tuple] = []  # (kind, part, blob, rows, bytes, info): one record batch per task
            try:
                ds = lance.dataset(task["uri"], storage_options=options)
                names = [f.name for f in ds.schema]
                want = list(cfg.columns) + [TOMBSTONE]
                if sorted(names) != sorted(want):
                    extra = sorted(set(names) - set(want))
                    missing = sorted(set(want) - set(names))
                    raise ValueError(f"columns differ from the base table: extra {extra}, missing {missing}")
                table = ds.to_table(columns=want, with_row_address=True)
                nrows = table.num_rows
                nbytes = table.nbytes
                if routes.get(task["region"]):
                    info["routes"] = _route_counts(table, routes[task["region"]])
                table = (table.rename_columns([*want, ORD_COL])
                         .append_column(GEN_COL, pa.array(np.full(nrows, task["generation"], np.int64)))
                         .append_column(REGION_COL, pa.array(np.full(nrows, task["region"], np.int32))))
                if nrows:
                    part = key_partition(table, list(cfg.pk), cfg.parts)
                    order = np.argsort(part, kind="stable")
                    table = table.take(pa.array(order))
                    part = part[order]
                    bounds = np.flatnonzero(np.diff(part)) + 1
                    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, nrows]):
                        chunk = table.slice(int(lo), int(hi - lo))
                        rows.append(("data", int(part[lo]), to_blob(chunk), chunk.num_rows, 0, ""))
            except Exception as e:  # noqa: BLE001 - reported per generation, refused by the driver
                info["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                rows = []  # a generation that failed half-way emits no data at all
            rows.append(("stats", -1, b"", nrows, nbytes, json.dumps(info)))
            yield _stage1_batch(task, rows)


def _stage1_batch(task: dict, rows: list[tuple]) -> pa.RecordBatch:
    kind, part, blob, nrows, nbytes, info = zip(*rows)
    n = len(rows)
    return pa.RecordBatch.from_arrays(
        [pa.array(kind, pa.string()), pa.array(part, pa.int32()), pa.array([task["region"]] * n, pa.int32()),
         pa.array([task["generation"]] * n, pa.int64()), pa.array(blob, pa.binary()),
         pa.array(nrows, pa.int64()), pa.array(nbytes, pa.int64()), pa.array(info, pa.string())],
        schema=STAGE1_SCHEMA)


def _in_order(table: pa.Table) -> pa.Table:
    """A stage-1 blob in row-position order (Lance scans in that order; sort if it did not)."""
    ords = table.column(ORD_COL)
    if table.num_rows > 1 and not pc.all(pc.greater_equal(ords.slice(1), ords.slice(0, table.num_rows - 1))).as_py():
        return table.sort_by(ORD_COL)
    return table


def newest_per_key(tables: list[pa.Table], pk: list[str]) -> tuple[pa.Table, pa.Table]:
    """The newest row of each key (highest generation, then highest row position), and the
    keys whose rows come from more than one region.

    Each stage-1 blob holds one generation in row order, so concatenating the blobs by
    generation orders every row by (generation, position) without sorting rows; one group_by
    then finds each key's last row and its lowest and highest region at once.
    """
    tables = sorted((_in_order(t) for t in tables if t.num_rows), key=lambda t: t.column(GEN_COL)[0].as_py())
    table = pa.concat_tables(tables, promote_options="permissive")
    table = table.append_column("_memwal_i", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    last = table.group_by(pk, use_threads=False).aggregate(
        [("_memwal_i", "max"), (REGION_COL, "min"), (REGION_COL, "max")])
    shared = last.filter(pc.not_equal(last[f"{REGION_COL}_min"], last[f"{REGION_COL}_max"])).select(pk)
    return table.take(last["_memwal_i_max"]).drop_columns(["_memwal_i"]), shared


def dedup_partition(pk: tuple[str, ...], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Stage 2: all blobs of some key partitions -> newest live rows and tombstoned keys.

    Input rows with a `kind` column (the one-job path) may also be stage-1 stats rows: they
    pass through as `stats` rows, their fields as JSON in `info`.
    """
    tables: list[pa.Table] = []
    for batch in batches:
        if "kind" not in batch.schema.names:
            tables += [from_blob(b) for b in batch.column("blob").to_pylist()]
            continue
        for row in batch.to_pylist():
            if row["kind"] == "data":
                tables.append(from_blob(row["blob"]))
            else:
                stats = {k: row[k] for k in ("region", "generation", "rows", "bytes", "info")}
                yield _stage2_row("stats", b"", row["rows"], json.dumps(stats))
    if not any(t.num_rows for t in tables):
        return
    pk = list(pk)
    newest, shared = newest_per_key(tables, pk)
    if shared.num_rows:
        # A key in several regions breaks the spec's exclusivity: report which regions share keys.
        table = pa.concat_tables(tables, promote_options="permissive")
        both = table.join(shared, pk, join_type="inner").group_by([REGION_COL]).aggregate([([], "count_all")])
        yield _stage2_row("dups", b"", shared.num_rows, json.dumps(both.to_pylist()))
    dead = newest.column(TOMBSTONE).fill_null(False)
    live = newest.filter(pc.invert(dead)).drop_columns([TOMBSTONE, GEN_COL, ORD_COL, REGION_COL])
    gone = newest.filter(dead).select(pk)
    for kind, t in (("live", live), ("del", gone)):
        for off in range(0, t.num_rows, ROWS_PER_BLOB):
            chunk = t.slice(off, ROWS_PER_BLOB)
            yield _stage2_row(kind, to_blob(chunk), chunk.num_rows, "")


def _stage2_row(kind, blob, rows, info) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([{"kind": kind, "blob": blob, "rows": rows, "info": info}],
                                      schema=STAGE2_SCHEMA)


@dataclass
class BatchRead:
    """The stage-1 result of one merge batch, cached in Spark until `release`."""

    stage1: object  # pyspark DataFrame (persisted)
    stats: list[dict]

    def release(self) -> None:
        self.stage1.unpersist()


def read_batch(spark, tasks: list[tuple[int, int, int, str]], cfg: ReadConfig) -> BatchRead:
    """Run stage 1 over `tasks` (task id, region index, generation, uri); collect its stats.

    Tasks are spread over about two Spark partitions per key partition, straight from `range`
    (no shuffle to spread them): a Spark task costs ~0.1 s of fixed overhead, far more than
    reading one small generation, so each task reads several generations in turn.
    """
    df = spark.range(0, len(tasks), 1, numPartitions=max(1, min(len(tasks), 2 * cfg.parts)))
    fn = functools.partial(read_generations, cfg, tuple(tasks))
    stage1 = df.mapInArrow(fn, STAGE1_DDL).persist()
    stats = [r.asDict() for r in stage1.filter("kind = 'stats'").drop("blob").collect()]
    return BatchRead(stage1, stats)


@functools.lru_cache(maxsize=64)
def hash_slots(parts: int) -> tuple[int, ...]:
    """For each p in 0..parts-1 the smallest int v with pmod(murmur3_32(v, seed 42), parts) == p:
    Spark's `HashPartitioning` of an int column (`hash()` in Spark SQL) sends v to partition p."""
    import mmh3

    slots: dict[int, int] = {}
    v = 0
    while len(slots) < parts:
        slots.setdefault(mmh3.hash(struct.pack("<i", v), 42, signed=True) % parts, v)
        v += 1
    return tuple(slots[p] for p in range(parts))


@dataclass
class Deduped:
    """Stage-2 output of one batch, on the driver: bounded by the batch budget."""

    live: list[pa.Table]
    deleted: list[pa.Table]
    dups: list[dict]  # {"rows": keys shared, "regions": [{region, count_all}]}


def _slot(parts: int, part):
    """Spark's Murmur3 of the small ints 0..parts-1 collides (with 2 or 4 partitions most parts
    land in one task), and repartitionByRange costs a sampling job; so each part is mapped to an
    int that Spark's hash partitioning sends to Spark partition `part`. Were Spark to hash
    differently, only the balance would suffer: a part still lands in exactly one partition."""
    from pyspark.sql import functions as F

    return F.element_at(F.array(*[F.lit(v) for v in hash_slots(parts)]), part + 1)


def dedup_batch(spark, stage1, pk: list[str], parts: int) -> Deduped:
    """Stage 2 over (a filtered view of) the cached stage 1, collected in one Spark job."""
    from pyspark.sql import functions as F

    data = (stage1.filter(F.col("kind") == "data")
            .select(_slot(parts, F.col("part")).alias("slot"), "blob")
            .repartition(parts, "slot"))
    out = data.mapInArrow(functools.partial(dedup_partition, tuple(pk)), STAGE2_DDL).toArrow()
    return _collected(out)[1]


def read_and_dedup(spark, tasks: list[tuple[int, int, int, str]], cfg: ReadConfig) -> tuple[list[dict], Deduped]:
    """Stages 1 and 2 in one Spark job, nothing cached: the common case, where every generation
    of the batch is readable, routes correctly and is still unmerged. Stats rows travel through
    the shuffle (to partition 0) and come back beside the result; when they show a refusal the
    caller falls back to `read_batch` + `dedup_batch`, which can drop generations and re-run.
    About 1.7x faster than the two-job path on a fresh session (no cache build, one job less).
    """
    from pyspark.sql import functions as F

    df = spark.range(0, len(tasks), 1, numPartitions=max(1, min(len(tasks), 2 * cfg.parts)))
    stage1 = df.mapInArrow(functools.partial(read_generations, cfg, tuple(tasks)), STAGE1_DDL)
    shuffled = (stage1.select(_slot(cfg.parts, F.greatest(F.col("part"), F.lit(0))).alias("slot"),
                              "kind", "region", "generation", "blob", "rows", "bytes", "info")
                .repartition(cfg.parts, "slot"))
    out = shuffled.mapInArrow(functools.partial(dedup_partition, cfg.pk), STAGE2_DDL).toArrow()
    return _collected(out)


def _collected(out: pa.Table) -> tuple[list[dict], Deduped]:
    stats, live, deleted, dups = [], [], [], []
    for row in out.to_pylist():
        if row["kind"] == "live":
            live.append(from_blob(row["blob"]))
        elif row["kind"] == "del":
            deleted.append(from_blob(row["blob"]))
        elif row["kind"] == "stats":
            stats.append(json.loads(row["info"]))
        else:
            dups.append({"rows": row["rows"], "regions": json.loads(row["info"])})
    return stats, Deduped(live, deleted, dups)
