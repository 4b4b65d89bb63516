"""Compaction's plan: which triggers fire, what one bounded run rewrites, which index segments
are merged or retrained. Planning reads and changes nothing."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import lance
from lance.optimize import Compaction

from memwal_core.options import CompactionOptions
from memwal_core.state import table
from memwal_core.state.store import TableLocation

from .health import IndexHealth, TableHealth, read_health


@dataclass
class CompactionPlan:
    table_uri: str
    table_version: int
    health: TableHealth
    options: CompactionOptions
    reasons: list[str]  # data triggers that fired
    full: bool = False  # cheap enough to keep fully compacted: every deletion file materialized
    index_first: list[str] = field(default_factory=list)  # indexes caught up before the rewrite
    segments_first: dict[str, int] = field(default_factory=dict)  # index -> segments merged before it
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
        return bool(self.tasks or self.index_first or self.segments_first)

    @property
    def healthy(self) -> bool:
        return not self.tasks and not self.index_first and not self.segments_first and not self.merge_segments \
            and not self.retrain

    @property
    def summary(self) -> str:
        if self.healthy:
            why = "; ".join(self.reasons) + " but nothing Lance would rewrite" if self.reasons else ""
            return "healthy, skipped" + (f" ({why})" if why else "")
        parts = []
        if self.index_first:
            parts.append(f"catch up {', '.join(self.index_first)} first ({self.health.unindexed_rows} unindexed "
                         "rows: Lance compacts only fragments with the same index coverage)")
        if self.segments_first:
            parts.append("merge index segments of " + ", ".join(f"{n} ({s})" for n, s in self.segments_first.items())
                         + " first (each segment covers other fragments: Lance compacts only fragments with "
                           "the same index coverage)")
        if self.tasks or self.index_first or self.segments_first:
            parts.append(f"compact {self.source_fragments} fragments in {self.tasks} tasks ({'; '.join(self.reasons)})"
                         + (" as planned now; planned again after that" if self.index_first or self.segments_first else ""))
        if self.merge_segments:
            parts.append("merge index segments of " + ", ".join(f"{n} ({s})" for n, s in self.merge_segments.items()))
        if self.retrain:
            parts.append("retrain " + ", ".join(self.retrain))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table_uri, "table_version": self.table_version, "summary": self.summary,
                "health": self.health.to_dict(), "reasons": self.reasons, "full": self.full,
                "index_first": self.index_first, "segments_first": self.segments_first, "tasks": self.tasks,
                "source_fragments": self.source_fragments, "source_bytes": self.source_bytes,
                "merge_segments": self.merge_segments, "retrain": self.retrain,
                "retrain_refused": self.retrain_refused, "options": asdict(self.options)}


def _task_bytes(task) -> int:
    return sum(f.file_size_bytes or 0 for frag in task.fragments for f in frag.files)


def bounded_plan(ds: lance.LanceDataset, o: CompactionOptions, full: bool = False):
    """`Compaction.plan` limited to the first candidate fragments (oldest first) whose data
    files fit `max_bytes_per_run` (at least two, so it always progresses). `full` (a table of
    at most `cheap_rewrite_bytes`, kept fully compacted) is not bounded: the whole table is
    the run's bound, and one run leaves one fragment without deletion files."""
    lp = Compaction.plan(ds, o.lance_options(full=full))
    if full:
        return lp
    candidates = [frag for t in lp.tasks for frag in t.fragments]
    keep: list[int] = []
    size = 0
    for frag in candidates:
        nbytes = sum(f.file_size_bytes or 0 for f in frag.files)
        if len(keep) >= 2 and size + nbytes > o.max_bytes_per_run:
            break
        keep.append(frag.id)
        size += nbytes
    if len(keep) == len(candidates):
        return lp
    kept = set(keep)
    return Compaction.plan(ds, o.lance_options([f.fragment_id for f in ds.get_fragments() if f.fragment_id not in kept],
                                               full=full))


def mergeable_segments(ih: IndexHealth) -> int:
    """Segments of `ih` a merge may fold together: a vector index keeps its first (trained)
    segment apart (Lance merges the most recent N; merging the first too would hide the drift
    from its training, so retraining would never be suggested)."""
    return ih.segments - 1 if ih.vector else ih.segments


def coverage_merges(health: TableHealth) -> dict[str, int]:
    """Index -> segments to merge so the fragments they cover can be compacted together.

    Lance compacts only fragments with the same index coverage; a catch-up that appends a delta
    segment per merge (`catchup.num_indices_to_merge: 0`) gives every merged fragment its own,
    so a trigger fires and Lance plans nothing (or rewrites each fragment alone), pass after
    pass. Asked when Lance plans nothing, and always for a table kept fully compacted."""
    return {ih.name: mergeable_segments(ih) for ih in health.indexes if mergeable_segments(ih) >= 2}


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
        if (full or not lp.tasks) and not plan.index_first:  # after a catch-up: checked again then
            plan.segments_first = coverage_merges(health)
    for ih in health.indexes:
        mergeable = mergeable_segments(ih)
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
    for name in list(plan.retrain) + list(plan.segments_first):
        plan.merge_segments.pop(name, None)  # a retrain merges everything into one segment anyway
    return plan
