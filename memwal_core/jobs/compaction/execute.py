"""Base-table compaction and index-segment merging (the table's long-run health).

Every merge commit adds a fragment and deletion files to older fragments; every incremental
index catch-up may add a delta index segment. Scans, point lookups and the merger's own
`merge_insert` get slower as they pile up. This module reads the table's **health**
(fragments, small fragments, deleted rows, index segments), decides from thresholds whether
anything is worth doing, and does it:

- **Plan** on the driver with `lance.optimize.Compaction.plan`, bounded per run
  (`max_source_bytes` / `max_source_fragments`: one run never holds the table's pool for long).
- **Execute** the `CompactionTask`s in Spark tasks: they are picklable, so a DataFrame of task
  indices goes through `mapInArrow`, each task opens the dataset at the plan's read version,
  runs its rewrite and returns the pickled `RewriteResult` as a binary blob (the merger's
  distribution story; only DataFrame APIs, so Spark Connect and clusters work the same).
- **Commit** on the driver with `Compaction.commit` (a Lance *Rewrite*).

What a Rewrite commit does to MemWAL state (pylance 14.0.2, tests/test_compaction.py):
- `merged_generations` (pylance: `compacted_sstables`) is carried over unchanged.
- `index_catchup` is **withdrawn** (Lance withdraws catch-up whenever an index changes, and a
  Rewrite remaps every index), even though the remapped indexes still cover every row. An
  absent entry reads as "not caught up": safe for readers and GC (they keep reading / keeping
  the generations), but it would stall GC until the next catch-up. So right after the commit
  the executor restores it with `optimize_indices` on the withdrawn indexes (nothing to add;
  Lance re-derives catch-up in that commit). A crash in between leaves it to the next index
  catch-up, which always follows compaction in the pipeline.
- Compaction itself makes two commits: `ReserveFragments` (new fragment ids) and the Rewrite.
- A merge committed between plan and commit makes the Rewrite fail with a retryable commit
  conflict (even an insert-only merge: `merge_insert` is an Update). The executor re-plans
  from the new version and re-runs the tasks, up to `max_attempts`, then gives up cleanly:
  nothing of the failed attempt is visible, and the executor deletes its unreferenced data
  files at once (Lance's `cleanup_old_versions` would keep never-referenced files 7 days).
  The other order is harmless: a merge that read the table before a Rewrite and commits
  after it is rebased by Lance.
- Time travel: older versions keep their fragments until `cleanup_old_versions` removes them.

A table of at most `cheap_rewrite_bytes` is kept **fully compacted**: any second fragment or
deletion file is rewritten away on the next run (every deletion file materialized), because on
a small table each costs its scans 30-40 % (docs/benchmarks.md §7), more than the rewrite.
Lance compacts only fragments with the same index coverage, so the fragment the preceding merge
added (not indexed yet: catch-up follows compaction) would stay apart forever; when a compaction
runs and some index has unindexed rows, it **indexes first** (the catch-up that would follow it)
and plans after that, so the newest fragment is folded in too.

Index segments: an index with more segments than `max_index_segments` is merged with
`optimize_indices(num_indices_to_merge=N)` (centroids and codebooks kept); a vector index
keeps its first, trained segment apart (it settles at 2 segments), so its drift stays
visible. A vector index whose data drifted from its training (rows outside its first
segment plus unindexed rows, as a share of all rows) past `retrain_drift_share` is retrained
only on request (`retrain_vector_indexes`), and never an index the MemTables maintain: the
spec requires a stable codebook once MemWAL is enabled (switching codebooks is a migration to
a new index).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import lance
import pyarrow as pa
from lance.optimize import Compaction

from memwal_core import faults
from memwal_core.errors import one_line
from memwal_core.jobs import catchup
from memwal_core.options import CompactionOptions
from memwal_core.state import lease, table
from memwal_core.state.lance_mem_wal import is_commit_conflict
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.compaction")

VECTOR_TYPES = ("IVF", "HNSW", "PQ", "SQ", "VECTOR")
TASK_DDL = "task long, rewrite binary"


# ------------------------------------------------------------------------------------ health


@dataclass(frozen=True)
class IndexHealth:
    name: str
    index_type: str
    segments: int
    vector: bool
    gating: bool  # maintained by MemTables / gates GC
    indexed_rows: int
    unindexed_rows: int
    drift_share: float  # rows outside the first (trained) segment + unindexed, over all rows


@dataclass(frozen=True)
class TableHealth:
    table_version: int
    fragments: int
    small_fragments: int
    physical_rows: int
    deleted_rows: int
    fragments_with_deletions: int
    bytes: int
    stable_row_ids: bool
    indexes: tuple[IndexHealth, ...] = ()

    @property
    def live_rows(self) -> int:
        return self.physical_rows - self.deleted_rows

    @property
    def small_fragment_share(self) -> float:
        return self.small_fragments / self.fragments if self.fragments else 0.0

    @property
    def deleted_row_ratio(self) -> float:
        return self.deleted_rows / self.physical_rows if self.physical_rows else 0.0

    @property
    def deletion_file_ratio(self) -> float:
        return self.fragments_with_deletions / self.fragments if self.fragments else 0.0

    @property
    def index_segments(self) -> dict[str, int]:
        return {i.name: i.segments for i in self.indexes}

    @property
    def unindexed_rows(self) -> int:
        """Rows some index does not cover yet (the most of any index)."""
        return max((i.unindexed_rows for i in self.indexes), default=0)

    def cheap_reason(self, o: CompactionOptions) -> str | None:
        """Why a table small enough to keep fully compacted is not (None: it is, or too big)."""
        if not o.cheap_rewrite_bytes or self.bytes > o.cheap_rewrite_bytes:
            return None
        if self.fragments <= 1 and not self.fragments_with_deletions:
            return None
        return (f"{self.fragments} fragments, {self.fragments_with_deletions} with deletions, in a table of "
                f"{self.bytes} bytes <= cheap_rewrite_bytes {o.cheap_rewrite_bytes}: kept fully compacted")

    def reasons(self, o: CompactionOptions) -> list[str]:
        """The data triggers that fire (empty: healthy)."""
        out = []
        if self.fragments > o.max_fragments and self.fragments >= 2:
            out.append(f"{self.fragments} fragments > {o.max_fragments}")
        if self.small_fragments > o.max_small_fragments:
            out.append(f"{self.small_fragments} small fragments > {o.max_small_fragments}")
        elif self.small_fragments >= max(2, o.min_small_fragments) and \
                self.small_fragment_share > o.max_small_fragment_share:
            out.append(f"small fragments {self.small_fragments}/{self.fragments} = "
                       f"{self.small_fragment_share:.2f} > {o.max_small_fragment_share}")
        if self.deleted_row_ratio > o.max_deleted_row_ratio and self.deleted_rows >= o.min_deleted_rows:
            out.append(f"deleted rows {self.deleted_rows}/{self.physical_rows} = "
                       f"{self.deleted_row_ratio:.2f} > {o.max_deleted_row_ratio}")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(small_fragment_share=round(self.small_fragment_share, 4),
                 deleted_row_ratio=round(self.deleted_row_ratio, 4),
                 deletion_file_ratio=round(self.deletion_file_ratio, 4))
        return d


def is_vector(index_type: str) -> bool:
    return any(t in index_type.upper() for t in VECTOR_TYPES)


def _statistics_without_centroids(ds: lance.LanceDataset, name: str) -> dict:
    """`index_statistics` without every centroid (memory; a warning). Lance reads the switch from
    the environment: set only for this call, so other readers of the statistics in the process
    (a user's, a test's) still get the centroids."""
    key = "LANCE_INCLUDE_VECTOR_CENTROIDS"
    before = os.environ.get(key)
    os.environ[key] = "false"
    try:
        return ds.index_statistics(name)
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _index_health(ds: lance.LanceDataset, gating: set[str]) -> list[IndexHealth]:
    out = []
    for name in sorted(catchup.base_indexes(ds)):
        try:
            s = _statistics_without_centroids(ds, name)
        except Exception as e:  # noqa: BLE001 - a statistics failure must not stop compaction
            log.warning("index %s: statistics unavailable (%s)", name, e)
            continue
        kind = str(s.get("index_type") or "")
        per_delta = [int(n) for n in (s.get("num_indexed_rows_per_delta") or [])]
        indexed = int(s.get("num_indexed_rows") or sum(per_delta))
        unindexed = int(s.get("num_unindexed_rows") or 0)
        total = indexed + unindexed
        drift = (sum(per_delta[1:]) + unindexed) / total if total else 0.0
        segments = int(s.get("num_segments") or s.get("num_indices") or len(per_delta) or 1)
        out.append(IndexHealth(name, kind, segments, is_vector(kind), name in gating, indexed, unindexed,
                               round(drift, 4)))
    return out


def read_health(loc: TableLocation, options: CompactionOptions | None = None,
                ds: lance.LanceDataset | None = None) -> TableHealth:
    """Fragments, small fragments, deletions, bytes and index segments of the latest version."""
    o = options or CompactionOptions()
    ds = ds or table.open_dataset(loc)
    fragments = small = physical = deleted = with_del = nbytes = 0
    for frag in ds.get_fragments():
        m = frag.metadata
        fragments += 1
        physical += m.physical_rows or 0
        if (m.physical_rows or 0) < o.small_fragment_rows:
            small += 1
        if m.deletion_file is not None:
            with_del += 1
            deleted += m.deletion_file.num_deleted_rows or 0
        nbytes += sum(f.file_size_bytes or 0 for f in m.files)
    try:
        gating = set(table.read_memwal_state(loc, ds.version).gating_indexes(list(catchup.base_indexes(ds))))
    except table.TableError:
        gating = set()
    return TableHealth(ds.version, fragments, small, physical, deleted, with_del, nbytes,
                       bool(ds.has_stable_row_ids), tuple(_index_health(ds, gating)))


# -------------------------------------------------------------------------------------- plan


@dataclass
class CompactionPlan:
    table_uri: str
    table_version: int
    health: TableHealth
    options: CompactionOptions
    reasons: list[str]  # data triggers that fired
    full: bool = False  # cheap enough to keep fully compacted: every deletion file materialized
    index_first: list[str] = field(default_factory=list)  # indexes caught up before the rewrite
    tasks: int = 0
    source_fragments: int = 0
    source_bytes: int = 0
    merge_segments: dict[str, int] = field(default_factory=dict)  # index -> segments to merge
    retrain: list[str] = field(default_factory=list)
    retrain_refused: dict[str, str] = field(default_factory=dict)
    lance_plan: Any = field(default=None, repr=False, compare=False)

    @property
    def needs_spark(self) -> bool:
        """Fragments to rewrite now, or possibly after the catch-up that comes first."""
        return bool(self.tasks or self.index_first)

    @property
    def healthy(self) -> bool:
        return not self.tasks and not self.index_first and not self.merge_segments and not self.retrain

    @property
    def summary(self) -> str:
        if self.healthy:
            why = "; ".join(self.reasons) + " but nothing Lance would rewrite" if self.reasons else ""
            return "healthy, skipped" + (f" ({why})" if why else "")
        parts = []
        if self.index_first:
            parts.append(f"catch up {', '.join(self.index_first)} first ({self.health.unindexed_rows} unindexed "
                         "rows: Lance compacts only fragments with the same index coverage)")
        if self.tasks or self.index_first:
            parts.append(f"compact {self.source_fragments} fragments in {self.tasks} tasks ({'; '.join(self.reasons)})"
                         + (" as planned now; planned again after the catch-up" if self.index_first else ""))
        if self.merge_segments:
            parts.append("merge index segments of " + ", ".join(f"{n} ({s})" for n, s in self.merge_segments.items()))
        if self.retrain:
            parts.append("retrain " + ", ".join(self.retrain))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table_uri, "table_version": self.table_version, "summary": self.summary,
                "health": self.health.to_dict(), "reasons": self.reasons, "full": self.full,
                "index_first": self.index_first, "tasks": self.tasks,
                "source_fragments": self.source_fragments, "source_bytes": self.source_bytes,
                "merge_segments": self.merge_segments, "retrain": self.retrain,
                "retrain_refused": self.retrain_refused, "options": asdict(self.options)}


def _task_bytes(task) -> int:
    return sum(f.file_size_bytes or 0 for frag in task.fragments for f in frag.files)


def bounded_plan(ds: lance.LanceDataset, o: CompactionOptions, full: bool = False):
    """`Compaction.plan` limited to the first candidate fragments (oldest first) that fit
    `max_fragments_per_run` and `max_bytes_per_run` (at least two, so it always progresses)."""
    lp = Compaction.plan(ds, o.lance_options(full=full))
    candidates = [frag for t in lp.tasks for frag in t.fragments]
    keep: list[int] = []
    size = 0
    for frag in candidates:
        nbytes = sum(f.file_size_bytes or 0 for f in frag.files)
        if len(keep) >= 2 and (len(keep) + 1 > o.max_fragments_per_run or size + nbytes > o.max_bytes_per_run):
            break
        keep.append(frag.id)
        size += nbytes
    if len(keep) == len(candidates):
        return lp
    kept = set(keep)
    return Compaction.plan(ds, o.lance_options([f.fragment_id for f in ds.get_fragments() if f.fragment_id not in kept],
                                               full=full))


def plan_compaction(loc: TableLocation, options: CompactionOptions | None = None) -> CompactionPlan:
    """Read health; plan a bounded compaction only when a trigger fires. Changes nothing."""
    o = options or CompactionOptions()
    ds = table.open_dataset(loc)
    table.read_memwal_state(loc, ds.version)  # a table without MemWAL is refused, as every step does
    health = read_health(loc, o, ds)
    reasons = health.reasons(o)
    cheap = health.cheap_reason(o)
    full = cheap is not None
    if cheap is not None:
        reasons.append(cheap)
    plan = CompactionPlan(loc.lance_uri, ds.version, health, o, reasons, full)
    if reasons:
        plan.index_first = sorted(i.name for i in health.indexes if i.unindexed_rows)
        lp = bounded_plan(ds, o, full)
        plan.lance_plan = lp
        plan.tasks = len(lp.tasks)
        plan.source_fragments = sum(len(t.fragments) for t in lp.tasks)
        plan.source_bytes = sum(_task_bytes(t) for t in lp.tasks)
    for ih in health.indexes:
        # A vector index keeps its first (trained) segment apart: Lance merges the most recent
        # N segments, and merging the first one too would hide the drift from its training
        # (rows outside the first segment), so retraining would never be suggested.
        mergeable = ih.segments - 1 if ih.vector else ih.segments
        if ih.segments > o.max_index_segments and mergeable >= 2:
            plan.merge_segments[ih.name] = mergeable
        if ih.vector and ih.drift_share > o.retrain_drift_share:
            if not o.retrain_vector_indexes:
                plan.retrain_refused[ih.name] = (f"drift {ih.drift_share:.2f} > {o.retrain_drift_share}: "
                                                 "retrain on request (retrain_vector_indexes)")
            elif ih.gating:
                plan.retrain_refused[ih.name] = (
                    "MemTables maintain this index: the spec requires a stable codebook once MemWAL is "
                    "enabled, so retraining it would make distances incomparable across generations; "
                    "migrate to a new index instead")
            else:
                plan.retrain.append(ih.name)
    for name in plan.retrain:
        plan.merge_segments.pop(name, None)  # a retrain merges everything into one segment anyway
    return plan


# ---------------------------------------------------------------------------------- execute


@dataclass(frozen=True)
class TaskConfig:
    """What a Spark task needs to run its rewrites (storage options never in a repr)."""

    uri: str
    read_version: int
    storage_options: tuple[tuple[str, str], ...]
    tasks: tuple[bytes, ...]  # pickled CompactionTasks

    def __repr__(self) -> str:
        return f"TaskConfig(uri={self.uri!r}, read_version={self.read_version}, tasks={len(self.tasks)})"


def run_rewrites(cfg: TaskConfig, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The Spark task: execute its CompactionTasks, yield (task index, pickled RewriteResult)."""
    ds = lance.dataset(cfg.uri, version=cfg.read_version, storage_options=dict(cfg.storage_options) or None)
    for batch in batches:
        for i in batch.column("id").to_pylist():
            result = pickle.loads(cfg.tasks[i]).execute(ds)
            yield pa.record_batch([pa.array([i], pa.int64()), pa.array([pickle.dumps(result)], pa.binary())],
                                  names=["task", "rewrite"])


def execute_tasks(spark, loc: TableLocation, lance_plan) -> list:
    """Run every task of `lance_plan` in Spark; the RewriteResults in task order."""
    n = len(lance_plan.tasks)
    cfg = TaskConfig(loc.lance_uri, lance_plan.read_version, tuple(sorted(loc.storage_options.items())),
                     tuple(pickle.dumps(t) for t in lance_plan.tasks))
    parallel = max(1, min(n, int(spark.conf.get("spark.sql.shuffle.partitions", "2"))))
    out = spark.range(0, n, 1, numPartitions=parallel).mapInArrow(
        functools.partial(run_rewrites, cfg), TASK_DDL).toArrow()
    order = out.column("task").to_pylist()
    blobs = out.column("rewrite")
    results = sorted(((t, pickle.loads(blobs[k].as_py())) for k, t in enumerate(order)), key=lambda x: x[0])
    if [t for t, _ in results] != list(range(n)):
        raise RuntimeError(f"compaction: Spark returned tasks {order}, expected 0..{n - 1}")
    return [r for _, r in results]


@dataclass
class CompactionResult:
    table_uri: str
    status: str  # "healthy, skipped" | "compacted" | "gave up: ..." | "nothing to rewrite"
    health_before: TableHealth
    health_after: TableHealth | None = None
    tasks: int = 0
    attempts: int = 0
    conflicts: int = 0
    fragments_removed: int = 0
    fragments_added: int = 0
    indexed_first: list[str] = field(default_factory=list)  # caught up before the rewrite
    segments_merged: dict[str, int] = field(default_factory=dict)
    retrained: list[str] = field(default_factory=list)
    catchup_restored: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0
    table_version: int = 0

    @property
    def committed(self) -> bool:
        return self.fragments_removed > 0 or bool(self.segments_merged) or bool(self.retrained)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["committed"] = self.committed
        return d


@lease.step("compact")
def execute_compaction(loc: TableLocation, plan: CompactionPlan, spark=None, *,
                       progress: Callable[[str], None] | None = None,
                       before_commit: Callable[[int], None] | None = None) -> CompactionResult:
    """Do what `plan` says: rewrite in Spark, commit on the driver, merge/retrain index
    segments, restore the catch-up the Rewrite withdrew.

    A commit conflict (a merge landed since the plan) re-plans from the new version and
    re-runs, up to `max_attempts` plans; then it gives up cleanly (status "gave up: ...").
    `before_commit(attempt)` runs after the Spark tasks and before each commit (tests land a
    concurrent merge there).
    """
    t0 = time.monotonic()
    o = plan.options
    say = progress or (lambda _m: None)
    result = CompactionResult(plan.table_uri, "healthy, skipped", plan.health)
    if plan.healthy:
        result.table_version = plan.table_version
        result.health_after = plan.health
        result.duration_s = time.monotonic() - t0
        return result
    before = table.read_memwal_state(loc, plan.table_version)
    lance_plan = plan.lance_plan
    if plan.needs_spark:
        if spark is None:
            raise ValueError("compaction has tasks to run but no Spark session was given")
        result.status = "nothing to rewrite"
        if plan.index_first:
            _index_first(loc, plan.index_first, result, say)
            lance_plan = None
        while True:
            result.attempts += 1
            if lance_plan is None:  # after the catch-up, or a retry: plan from the latest version
                ds = table.open_dataset(loc)
                lance_plan = bounded_plan(ds, o, plan.full)
                before = table.read_memwal_state(loc, ds.version)
            if not lance_plan.tasks:
                break
            result.tasks = len(lance_plan.tasks)
            say(f"compaction: {len(lance_plan.tasks)} tasks over "
                f"{sum(len(t.fragments) for t in lance_plan.tasks)} fragments (attempt {result.attempts})")
            rewrites = execute_tasks(spark, loc, lance_plan)
            if before_commit is not None:
                before_commit(result.attempts)
            ds = table.open_dataset(loc, version=lance_plan.read_version,
                                    commit_lock=faults.commit_lock("compaction.during_commit"))
            faults.point("compaction.before_commit")
            lease.fence(loc, "compaction commit")
            try:
                metrics = Compaction.commit(ds, rewrites)
            except OSError as e:
                if not is_commit_conflict(e):
                    raise
                result.conflicts += 1
                discard_rewrites(loc, rewrites)
                if result.attempts >= o.max_attempts:
                    result.status = (f"gave up: {result.conflicts} commit conflicts with concurrent commits "
                                     "(merges); nothing of the rewrite is visible, the next run retries")
                    log.warning("compaction of %s %s", loc.lance_uri, result.status)
                    break
                log.info("compaction lost a commit race (attempt %d); planning again", result.attempts)
                lance_plan = None
                continue
            faults.point("compaction.after_commit")
            result.fragments_removed += metrics.fragments_removed
            result.fragments_added += metrics.fragments_added
            result.status = "compacted"
            say(f"compaction: {metrics.fragments_removed} fragments -> {metrics.fragments_added}")
            break
    for name, segments in plan.merge_segments.items():
        _optimize(loc, name, result, {"num_indices_to_merge": segments}, result.segments_merged, segments)
    for name in plan.retrain:
        _optimize(loc, name, result, {"retrain": True}, None, 0)
        if name not in result.errors:
            result.retrained.append(name)
    if o.restore_catchup and result.committed:
        result.catchup_restored = restore_catchup(loc, before, result.errors)
    if result.status in ("healthy, skipped", "nothing to rewrite") and result.committed:
        result.status = "indexes merged" if not result.retrained else "indexes retrained"
    ds = table.open_dataset(loc)
    result.table_version = ds.version
    result.health_after = read_health(loc, o, ds)
    result.duration_s = time.monotonic() - t0
    return result


def _index_first(loc: TableLocation, names: list[str], result: CompactionResult,
                 say: Callable[[str], None]) -> None:
    """Catch up `names` so Lance can compact the newest (unindexed) fragments with the rest.

    A failing index is recorded and the compaction goes on: it then leaves the unindexed
    fragments apart, exactly as without this step.
    """
    say(f"compaction: catching up {', '.join(names)} first (Lance compacts only fragments with the same "
        "index coverage)")
    faults.point("compaction.before_index_first")
    r = catchup.run_catchup(loc, names)
    faults.point("compaction.after_index_first")
    result.indexed_first = [i.name for i in r.indexes if i.optimized and i.error is None]
    for name, err in r.errors.items():
        result.errors[name] = f"catch-up before compaction: {err}"
        log.warning("index %s: catch-up before compaction failed (%s); its unindexed fragments stay apart",
                    name, err)


def discard_rewrites(loc: TableLocation, rewrites: list) -> int:
    """Delete the data files of rewrites whose commit lost a race (a conflict: no manifest
    references them, and none ever will). Lance leaves them to `cleanup_old_versions`, which
    keeps files no manifest ever referenced for 7 days (it cannot tell them from a write in
    flight): a table whose compaction keeps losing to merges would pile up a full rewrite per
    attempt. Best effort: a failure here only leaves them to Lance's cleanup."""
    keys = [f"data/{f.path}" for r in rewrites for frag in r.new_fragments for f in frag.files
            if getattr(f, "base_id", None) is None]
    try:
        return loc.store.delete_many(keys) if keys else 0
    except Exception as e:  # noqa: BLE001 - a leftover file is garbage, not damage
        log.warning("compaction: could not delete %d data files of a lost rewrite (%s); Lance's "
                    "cleanup_old_versions removes them after its unverified-file age", len(keys), e)
        return 0


def _optimize(loc: TableLocation, name: str, result: CompactionResult, kw: dict, record: dict | None,
              segments: int) -> None:
    try:
        lease.fence(loc, f"index {name} optimize")
        table.open_dataset(loc).optimize.optimize_indices(index_names=[name], **kw)
        if record is not None:
            record[name] = segments
    except Exception as e:  # noqa: BLE001 - one index failing does not stop the others
        result.errors[name] = one_line(e)
        log.warning("index %s: optimize_indices(%s) failed: %s", name, kw, result.errors[name])


def withdrawn_catchup(before: table.MemWalState, after: table.MemWalState) -> list[str]:
    """Indexes whose recorded catch-up is lower (or gone) in `after` for some region."""
    out = []
    for name, regions in before.catchup.items():
        now = after.catchup.get(name, {})
        if any(now.get(rid, 0) < g for rid, g in regions.items()):
            out.append(name)
    return sorted(out)


def restore_catchup(loc: TableLocation, before: table.MemWalState, errors: dict[str, str]) -> list[str]:
    """Re-record the catch-up a Rewrite withdrew (optimize_indices on those indexes only).

    A failure goes into `errors` (the result's: the asset's check and `memwal maintain` show
    it); the index catch-up that follows compaction in every pass retries it."""
    ds = table.open_dataset(loc)
    existing = catchup.base_indexes(ds)
    names = [n for n in withdrawn_catchup(before, table.read_memwal_state(loc, ds.version)) if n in existing]
    if not names:
        return []
    r = catchup.run_catchup(loc, names)
    for name, err in r.errors.items():
        errors[name] = f"restoring catch-up after the rewrite: {err}"
        log.warning("restoring catch-up of %s failed: %s", name, err)
    return [o.name for o in r.indexes if o.error is None]


@lease.step("compact")
def compact(loc: TableLocation, spark=None, options: CompactionOptions | None = None, **kw) -> CompactionResult:
    """Plan and execute in one call."""
    return execute_compaction(loc, plan_compaction(loc, options), spark, **kw)
