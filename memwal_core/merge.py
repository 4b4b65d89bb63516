"""The MemTable merger: flushed generations -> base table, in order, with atomic progress.

Plan: per region, the generations newer than `merged_generations[region]` (read fresh from
the MemWAL index), ascending, grouped into batches bounded by bytes and generation count.
Execute, per batch: Spark reads the generations and keeps the newest row per primary key
(`spark.py`); the result streams into **one** `merge_insert` that upserts the live rows,
deletes the tombstoned keys and records each region's highest merged generation with
`mark_sstables_as_compacted`, all in one commit.

Why one pass for deletes rather than a delete pass followed by the marked upsert: a delete
pass commits without progress, so if another merger merged a *newer* generation of the same
key in between (re-inserting it), our delete would remove that newer row and nothing would
bring it back: a lost write. In one pass the stale-marker check refuses the whole commit
instead. (It is also one commit instead of two; see docs/benchmarks.md.)
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import lance
import pyarrow as pa

from . import faults, layout, region, routing
from . import spark as sparkpath
from .lance_mem_wal import is_stale_merge, merged_markers
from .store import TableLocation
from .table import MemWalState, open_dataset, primary_key, read_memwal_state

log = logging.getLogger("memwal.merge")

DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_GENERATIONS = 256


class MergeError(Exception):
    pass


@dataclass(frozen=True)
class PlannedGeneration:
    region_id: str
    generation: int
    path: str
    bytes: int
    rows: int


@dataclass
class MergeBatch:
    generations: list[PlannedGeneration]

    @property
    def bytes(self) -> int:
        return sum(g.bytes for g in self.generations)

    @property
    def progress(self) -> dict[str, int]:
        """The merged generation each region reaches when this batch commits."""
        out: dict[str, int] = {}
        for g in self.generations:
            out[g.region_id] = max(out.get(g.region_id, 0), g.generation)
        return out


@dataclass
class MergePlan:
    table_uri: str
    table_version: int
    merged: dict[str, int]
    batches: list[MergeBatch]
    region_errors: dict[str, str] = field(default_factory=dict)
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    max_generations: int = DEFAULT_MAX_GENERATIONS

    @property
    def pending(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for b in self.batches:
            for g in b.generations:
                out.setdefault(g.region_id, []).append(g.generation)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table_uri, "table_version": self.table_version, "merged": self.merged,
                "budget_bytes": self.budget_bytes, "max_generations": self.max_generations,
                "batches": [{"bytes": b.bytes, "progress": b.progress,
                             "generations": [asdict(g) for g in b.generations]} for b in self.batches],
                "region_errors": self.region_errors}


def _generation_bytes(loc: TableLocation, region_id: str, g: region.Generation) -> int:
    if g.in_memory_bytes:
        return g.in_memory_bytes
    prefix = layout.generation_dir(region_id, g.path, g.generation)
    return sum(o.size for o in loc.store.list(prefix))


def plan_merge(loc: TableLocation, *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
               max_generations: int = DEFAULT_MAX_GENERATIONS, regions: list[str] | None = None,
               state: MemWalState | None = None) -> MergePlan:
    """Which generations to merge, in which batches. Reads only committed state."""
    if budget_bytes <= 0 or max_generations <= 0:
        raise ValueError("budget_bytes and max_generations must be positive")
    state = state or read_memwal_state(loc)
    merged = state.merged
    ids = regions if regions is not None else region.list_regions(loc.store).region_ids
    loaded = region.load_many(loc.store, ids)
    errors: dict[str, str] = {}
    queues: dict[str, list[PlannedGeneration]] = {}
    for rid, m in sorted(loaded.items()):
        if isinstance(m, Exception):
            errors[rid] = str(m)
            continue
        try:
            pending = [PlannedGeneration(rid, g.generation, layout.validate_generation_path(g.path, g.generation),
                                         _generation_bytes(loc, rid, g), g.physical_rows)
                       for g in m.generations if g.generation > merged.get(rid, 0)]
        except layout.UnsafePath as e:
            errors[rid] = f"region {rid}: corrupt manifest version {m.version}: {e}"
            continue
        if pending:
            queues[rid] = pending
    return MergePlan(loc.lance_uri, state.table_version, merged,
                     _batches(queues, budget_bytes, max_generations), errors, budget_bytes, max_generations)


def _batches(queues: dict[str, list[PlannedGeneration]], budget: int, max_gens: int) -> list[MergeBatch]:
    """Round-robin over regions so one region's backlog cannot starve the others.

    Each region's generations stay in ascending order across batches; a single generation
    larger than the budget gets a batch of its own.
    """
    queues = {k: list(v) for k, v in queues.items()}
    batches = []
    while any(queues.values()):
        batch: list[PlannedGeneration] = []
        size = 0
        progressed = True
        while progressed and len(batch) < max_gens:
            progressed = False
            for rid in sorted(queues):
                q = queues[rid]
                if not q or len(batch) >= max_gens:
                    continue
                if batch and size + q[0].bytes > budget:
                    continue
                g = q.pop(0)
                batch.append(g)
                size += g.bytes
                progressed = True
        batches.append(MergeBatch(batch))
        queues = {k: v for k, v in queues.items() if v}
    return batches


@dataclass
class RegionMergeResult:
    region_id: str
    generations_merged: list[int] = field(default_factory=list)
    merged_generation: int = 0
    rows_read: int = 0
    bytes_read: int = 0
    skipped_generations: list[int] = field(default_factory=list)  # already merged by another merger
    error: str | None = None
    offending_keys: int = 0


@dataclass
class MergeResult:
    table_uri: str
    regions: dict[str, RegionMergeResult] = field(default_factory=dict)
    commits: int = 0
    conflicts: int = 0
    rows_upserted: int = 0
    rows_deleted: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    duration_s: float = 0.0
    table_version: int = 0

    @property
    def failed_regions(self) -> dict[str, str]:
        return {rid: r.error for rid, r in self.regions.items() if r.error}

    @property
    def generations_merged(self) -> int:
        return sum(len(r.generations_merged) for r in self.regions.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["generations_merged"] = self.generations_merged
        d["failed_regions"] = self.failed_regions
        return d


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _literal(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    if isinstance(v, bytes):
        return "X'" + v.hex() + "'"
    raise MergeError(f"cannot express a primary key value of type {type(v).__name__} in a delete predicate")


def delete_predicate(keys: pa.Table, pk: list[str]) -> str:
    """SQL predicate matching exactly the tombstoned keys (for `when_not_matched_by_source_delete`)."""
    for c in pk:
        if not _IDENT.match(c):
            raise MergeError(f"primary key column name {c!r} cannot be used in a delete predicate")
    if len(pk) == 1:
        return f"{pk[0]} IN ({', '.join(_literal(v) for v in keys.column(pk[0]).to_pylist())})"
    rows = keys.to_pylist()
    return " OR ".join("(" + " AND ".join(f"{c} = {_literal(r[c])}" for c in pk) + ")" for r in rows)


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


ProgressFn = Callable[[str], None]


def execute_merge(loc: TableLocation, plan: MergePlan, spark, *, max_attempts: int = 5,
                  progress: ProgressFn | None = None, expected_values: dict[str, dict] | None = None) -> MergeResult:
    """Merge every batch of `plan`: one Spark job and one commit per batch (normally).

    `expected_values` (region id -> {field id: value}, e.g. from the MemWAL snapshot) pins each
    region's region value; otherwise it is the majority value of the region's oldest
    generation in the batch.
    """
    clock = _Clock()
    ds = open_dataset(loc)
    pk = primary_key(ds)  # a table without a primary key cannot be merged: say so first
    result = MergeResult(plan.table_uri)
    for rid, err in plan.region_errors.items():
        result.regions[rid] = RegionMergeResult(rid, error=err)
    if not plan.batches:
        result.duration_s = clock.elapsed()
        result.table_version = plan.table_version
        return result
    state = read_memwal_state(loc, ds.version)
    columns = [f.name for f in ds.schema]
    specs = {s.spec_id: routing.RegionSpec.from_proto(s).to_lance() for s in state.details.region_specs}
    manifests = region.load_many(loc.store, sorted(plan.pending))
    tasks = merge_tasks(spark)
    for n, batch in enumerate(plan.batches, 1):
        if progress:
            progress(f"batch {n}/{len(plan.batches)}: {len(batch.generations)} generations, "
                     f"{batch.bytes / 1e6:.1f} MB")
        _merge_batch(loc, spark, batch, pk, columns, ds.lance_schema, specs, manifests, tasks, result,
                     max_attempts, expected_values or {})
    result.duration_s = clock.elapsed()
    result.table_version = open_dataset(loc).version
    return result


def merge_tasks(spark) -> int:
    """Spark tasks per merge batch (each takes whole regions): `memwal.merge.partitions` if
    set, else the session's shuffle partitions (`local[*]`: the core count) capped at 64."""
    explicit = spark.conf.get("memwal.merge.partitions", None)
    if explicit:
        return max(1, int(explicit))
    return max(1, min(64, int(spark.conf.get("spark.sql.shuffle.partitions", "8"))))


def _routing_config(rid: str, manifests, specs, lance_schema) -> str:
    m = manifests.get(rid)
    if isinstance(m, Exception) or m is None:
        return ""
    spec = specs.get(m.message.region_spec_id)
    if not spec:
        return ""
    rs = routing.RegionSpec.from_lance(spec)
    if any(f.transform == routing.UNSHARDED for f in rs.fields):
        return ""
    return json.dumps({"spec": spec, "source_columns": {str(k): v for k, v in
                                                         routing.source_columns_for(rs, lance_schema).items()}})


def _merge_batch(loc, spark, batch: MergeBatch, pk, columns, lance_schema, specs, manifests, tasks: int,
                 result: MergeResult, max_attempts: int, expected: dict[str, dict]) -> None:
    """Read, check, deduplicate and commit one batch; re-run the Spark job when what it read
    cannot be committed as it is (a generation merged meanwhile, keys shared by regions, a
    lost commit race). Each re-run has fewer generations or counts a conflict, so it ends."""
    region_ids = sorted({g.region_id for g in batch.generations})
    index = {rid: i for i, rid in enumerate(region_ids)}
    region_index = {i: rid for rid, i in index.items()}
    for rid in region_ids:
        result.regions.setdefault(rid, RegionMergeResult(rid))
    routes = {rid: _routing_config(rid, manifests, specs, lance_schema) for rid in region_ids}
    own: dict[int, str] = {}
    for rid, conf in routes.items():
        if conf and rid in expected:
            fields = [f["field_id"] for f in json.loads(conf)["spec"]["fields"]]
            own[index[rid]] = sparkpath.value_key([expected[rid].get(f) for f in fields])
    cfg = sparkpath.ReadConfig(
        pk=tuple(pk), columns=tuple(columns), storage_options=tuple(sorted(loc.storage_options.items())),
        routing=tuple((index[rid], conf) for rid, conf in routes.items()), own_values=tuple(own.items()))
    refused: dict[str, int] = {}  # region -> its first generation that must not be merged in this batch
    conflicts = 0
    while True:
        merged = read_memwal_state(loc).merged
        gens = []
        for g in batch.generations:
            if g.generation <= merged.get(g.region_id, 0):
                r = result.regions[g.region_id]
                if g.generation not in r.skipped_generations:
                    r.skipped_generations.append(g.generation)
            elif g.generation < refused.get(g.region_id, g.generation + 1):
                gens.append(g)
        if not gens:
            return
        deduped = sparkpath.read_and_dedup(
            spark, [(index[g.region_id], g.generation,
                     loc.child_uri(layout.generation_dir(g.region_id, g.path, g.generation)), g.bytes)
                    for g in gens], cfg, tasks)
        # Progress is read again after the read: a generation another merger merged meanwhile
        # may be gone already (GC collects merged generations) and fail to read. It is skipped
        # as merged on the next round, not reported as broken.
        merged_now = read_memwal_state(loc).merged
        if any(g.generation <= merged_now.get(g.region_id, 0) for g in gens):
            log.info("generations of this batch were merged by another merger meanwhile; re-reading the rest")
            continue
        by_region: dict[int, list[dict]] = {}
        for s in deduped.stats:
            by_region.setdefault(s["region"], []).append(s)
        for ridx, rows in by_region.items():
            rid = region_index[ridx]
            refusal = sparkpath.first_refused(rows, own.get(ridx))  # what the task decided too
            if refusal is None or rid in refused:
                continue
            refused[rid] = refusal.generation
            r = result.regions[rid]
            r.error = f"region {rid}: {refusal.message}"
            r.offending_keys += refusal.offending_rows
            log.error("%s; merging its generations before %d only", r.error, refusal.generation)
        if deduped.shared:
            _refuse_shared(deduped, gens, region_index, refused, result)
            continue
        gens = [g for g in gens if g.generation < refused.get(g.region_id, g.generation + 1)]
        if not gens:
            return
        if _commit(loc, deduped, gens, index, pk, columns, result) == "committed":
            return
        conflicts += 1
        result.conflicts += 1
        if conflicts >= max_attempts:
            raise MergeError(f"gave up merging a batch after {max_attempts} conflicting attempts")
        log.info("merge commit lost to another merger (attempt %d); re-reading progress", conflicts)


def _refuse_shared(deduped: sparkpath.Deduped, gens: list[PlannedGeneration], region_index: dict[int, str],
                   refused: dict[str, int], result: MergeResult) -> None:
    """Keys in several regions break the spec's exclusivity: none of those regions is merged in
    this batch (which of their rows is newest is unknowable), the others are."""
    for ridx, rows in deduped.shared.items():
        rid = region_index[ridx]
        others = ", ".join(region_index[i] for i in sorted(deduped.shared) if i != ridx)
        r = result.regions[rid]
        r.error = (f"region {rid}: {deduped.shared_keys} primary keys also appear in another region ({others}); "
                   "the spec requires mutually exclusive regions, so none of these regions is merged in this batch")
        r.offending_keys = max(r.offending_keys, rows)
        refused[rid] = min(g.generation for g in gens if g.region_id == rid)
        log.error(r.error)


def _commit(loc, deduped: sparkpath.Deduped, gens: list[PlannedGeneration], index, pk, columns,
            result: MergeResult) -> str:
    """Commit exactly `gens` from their deduplicated rows: "committed" or "conflict"."""
    deleted = pa.concat_tables(deduped.deleted) if deduped.deleted else None
    progress: dict[str, int] = {}
    for g in gens:
        progress[g.region_id] = max(progress.get(g.region_id, 0), g.generation)
    ds = open_dataset(loc, commit_lock=faults.commit_lock("merge.during_commit"))
    schema = pa.schema([ds.schema.field(c) for c in columns])
    builder = ds.merge_insert(pk).when_matched_update_all().when_not_matched_insert_all()
    if deleted is not None and deleted.num_rows:
        builder = builder.when_not_matched_by_source_delete(delete_predicate(deleted, pk))
    builder = builder.mark_sstables_as_compacted(merged_markers(progress))
    source = pa.RecordBatchReader.from_batches(schema, _cast_stream(deduped.live, schema))
    faults.point("merge.before_commit")
    try:
        stats = builder.execute(source)
    except OSError as e:
        if is_stale_merge(e) or "conflict" in str(e).lower():
            return "conflict"
        raise
    faults.point("merge.after_commit")
    new = open_dataset(loc)
    result.commits += 1
    result.rows_upserted += stats["num_inserted_rows"] + stats["num_updated_rows"]
    result.rows_deleted += stats["num_deleted_rows"]
    result.bytes_written += _bytes_written(new, new.version)
    by_gen = {(s["region"], s["generation"]): s for s in deduped.stats}
    for g in gens:
        r = result.regions[g.region_id]
        r.generations_merged.append(g.generation)
        r.merged_generation = max(r.merged_generation, g.generation)
        s = by_gen.get((index[g.region_id], g.generation), {})
        r.rows_read += s.get("rows", 0)
        r.bytes_read += s.get("bytes", 0)
        result.bytes_read += s.get("bytes", 0)
    log.info("merged %d generations of %d regions: +%d upserted, -%d deleted, progress %s",
             len(gens), len(progress), stats["num_inserted_rows"] + stats["num_updated_rows"],
             stats["num_deleted_rows"], progress)
    return "committed"


def _cast_stream(tables: Iterator[pa.Table], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    for t in tables:
        yield from t.select(schema.names).cast(schema).to_batches()


def _bytes_written(ds: lance.LanceDataset, version: int) -> int:
    txn = ds.read_transaction(version)
    op = getattr(txn, "operation", None)
    frags = list(getattr(op, "new_fragments", []) or [])
    return sum((f.file_size_bytes or 0) for frag in frags for f in frag.files)


def merge(loc: TableLocation, spark, *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
          max_generations: int = DEFAULT_MAX_GENERATIONS, regions: list[str] | None = None,
          progress: ProgressFn | None = None) -> MergeResult:
    """Plan and execute in one call (what the CLI and the Dagster asset run)."""
    plan = plan_merge(loc, budget_bytes=budget_bytes, max_generations=max_generations, regions=regions)
    return execute_merge(loc, plan, spark, progress=progress)
