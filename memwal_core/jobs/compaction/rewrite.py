"""The rewrite's data path: Lance `CompactionTask`s run in Spark tasks, and the files of a
rewrite whose commit lost a race deleted at once.

The tasks are picklable, so a DataFrame of task indices goes through `mapInArrow`; each Spark
task opens the dataset at the plan's read version, runs its rewrites and returns each pickled
`RewriteResult` as a binary blob (only DataFrame APIs: Spark Connect and clusters work the same).
"""

from __future__ import annotations

import functools
import logging
import pickle
from dataclasses import dataclass
from typing import Iterator

import lance
import pyarrow as pa

from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.compaction")

TASK_DDL = "task long, rewrite binary"


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
