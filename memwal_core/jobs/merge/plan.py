"""Which generations to merge, in which batches: the merge plan. Reads only committed state.

Per region, the generations newer than `merged_generations[region]` (read fresh from the
MemWAL index), ascending, grouped into batches bounded by bytes (`MergeOptions.budget_bytes`),
round robin over regions so one region's backlog cannot starve the others. A batch is not
bounded by its generation count unless `max_generations` asks for it: every batch costs a Spark
job, a commit and a join of its rows against the whole base table, so a backlog that fits the
budget is merged as one batch. (The driver's and a task's memory follow the batch's bytes: the
deduplicated rows; see docs/benchmarks.md, "Memory".) A region that cannot be
planned (its manifest does not load, its generation list is malformed, its data predates the
MemWAL initialization) gets a `RegionFailure` at its first unmerged generation and nothing
planned; the other regions are planned.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from memwal_core.failures import RegionFailure
from memwal_core.options import MergeOptions
from memwal_core.state import layout, lifecycle, region
from memwal_core.state.store import TableLocation, refuse_links
from memwal_core.state.table import MemWalState, read_memwal_state

log = logging.getLogger("memwal.merge")

# The defaults are MergeOptions' (memwal_core/options.py): one default per setting.
DEFAULT_BUDGET_BYTES = MergeOptions().budget_bytes
DEFAULT_MAX_GENERATIONS = MergeOptions().max_generations


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
    walls: dict[str, RegionFailure] = field(default_factory=dict)  # regions refused while planning
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    max_generations: int | None = DEFAULT_MAX_GENERATIONS  # None: batches are bounded by bytes only
    lifecycle: lifecycle.Lifecycle | None = None  # stale regions (data from before the initialization)

    @property
    def failures(self) -> list[RegionFailure]:
        return [self.walls[rid] for rid in sorted(self.walls)]

    @property
    def region_errors(self) -> dict[str, str]:
        return {rid: w.reason for rid, w in self.walls.items()}

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
                             "generations": [dataclasses.asdict(g) for g in b.generations]} for b in self.batches],
                "region_errors": self.region_errors,
                "walls": {rid: w.to_dict() for rid, w in self.walls.items()}}


def _generation_bytes(loc: TableLocation, region_id: str, g: region.Generation) -> int:
    prefix = layout.generation_dir(region_id, g.path, g.generation)
    refuse_links(loc.store, prefix)  # Spark opens it by URI: a link would be followed there
    if g.in_memory_bytes:
        return g.in_memory_bytes
    return sum(o.size for o in loc.store.list(prefix))


def _options(options: MergeOptions | None, budget_bytes: int | None, max_generations: int | None) -> MergeOptions:
    """`options`, with the explicit keywords (the older way to say the same) on top."""
    if (budget_bytes is not None and budget_bytes <= 0) or (max_generations is not None and max_generations <= 0):
        raise ValueError("budget_bytes and max_generations must be positive")
    opts = options or MergeOptions()
    given = {k: v for k, v in (("budget_bytes", budget_bytes), ("max_generations", max_generations)) if v is not None}
    return dataclasses.replace(opts, **given) if given else opts


def plan_merge(loc: TableLocation, options: MergeOptions | None = None, *, budget_bytes: int | None = None,
               max_generations: int | None = None, regions: list[str] | None = None,
               state: MemWalState | None = None) -> MergePlan:
    """Which generations to merge, in which batches (see the module docstring)."""
    opts = _options(options, budget_bytes, max_generations)
    state = state or read_memwal_state(loc)
    merged = state.merged
    ids = regions if regions is not None else region.list_regions(loc.store).region_ids
    loaded = region.load_many(loc.store, ids)
    spec_ids = [s.spec_id for s in state.details.region_specs]
    lc = lifecycle.assess(loc, loaded.manifests, current_version=state.table_version, record=False)
    walls: dict[str, RegionFailure] = {}
    queues: dict[str, list[PlannedGeneration]] = {}
    for rid, got in sorted(loaded.items()):
        done = merged.get(rid, 0)
        if not got.ok:
            failure = RegionFailure(rid, done + 1, got.message, permanent=got.permanent)
        else:
            failure = _stale_failure(lc, rid, got.manifest, done)
            if failure is None:
                pending, failure = _pending(loc, rid, got.manifest, done, spec_ids)
                if pending:
                    queues[rid] = pending
        if failure is not None:
            walls[rid] = failure
            log.error("%s", failure.reason)
    return MergePlan(loc.lance_uri, state.table_version, merged,
                     _batches(queues, opts.budget_bytes, opts.max_generations), walls,
                     opts.budget_bytes, opts.max_generations, lc)


def _pending(loc: TableLocation, rid: str, m: region.RegionManifest, done: int, spec_ids: list[int]
             ) -> tuple[list[PlannedGeneration], RegionFailure | None]:
    """A region's generations above `done`, sized; or the failure that stops it (a malformed
    generation list, an unknown region spec, an unsafe path, or sizing I/O that failed)."""
    try:
        region.check_spec(m, spec_ids)
        return [PlannedGeneration(rid, g.generation, layout.validate_generation_path(g.path, g.generation),
                                  _generation_bytes(loc, rid, g), g.physical_rows)
                for g in region.pending_generations(m, done)], None
    except region.CorruptManifest as e:
        return [], RegionFailure(rid, done + 1, f"region {rid}: corrupt manifest version {m.version}: {e.detail}",
                                 permanent=True)
    except layout.UnsafePath as e:
        return [], RegionFailure(rid, done + 1, f"region {rid}: corrupt manifest version {m.version}: {e}",
                                 permanent=True)
    except Exception as e:  # noqa: BLE001 - sizing a generation failed (I/O): this region only
        return [], RegionFailure(rid, done + 1, f"region {rid}: {type(e).__name__}: {e}", permanent=False)


def _stale_failure(lc: lifecycle.Lifecycle, rid: str, m: region.RegionManifest, done: int) -> RegionFailure | None:
    """The wall of a region whose data predates the MemWAL initialization (`state/lifecycle.py`):
    permanent until discarded, so the stale rows never reach the table and nothing of the region
    (its later generations included) merges past them. A region whose lifecycle could not be
    read stops for this run."""
    listed = [g.generation for g in m.generations]
    if rid in lc.errors:
        return RegionFailure(rid, done + 1, lc.errors[rid], permanent=False)
    if lc.blocks(rid, done) and any(g > done for g in listed):
        return RegionFailure(rid, done + 1, lc.message(rid, done, listed), permanent=True)
    return None


def _batches(queues: dict[str, list[PlannedGeneration]], budget: int, max_gens: int | None) -> list[MergeBatch]:
    """Round-robin over regions so one region's backlog cannot starve the others.

    Each region's generations stay in ascending order across batches; a single generation
    larger than the budget gets a batch of its own. `max_gens` None: no count bound.
    """
    if max_gens is None:
        max_gens = sum(len(q) for q in queues.values()) or 1
    queues = {k: collections.deque(v) for k, v in queues.items()}  # popleft: linear in the backlog
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
                g = q.popleft()
                batch.append(g)
                size += g.bytes
                progressed = True
        batches.append(MergeBatch(batch))
        queues = {k: v for k, v in queues.items() if v}
    return batches
