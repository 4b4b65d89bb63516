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

import collections

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import lance
import pyarrow as pa
import pyarrow.compute as pc

from memwal_core import faults
from memwal_core.errors import MemwalError, one_line
from memwal_core.jobs import snapshot
from memwal_core.jobs.merge import verify
from memwal_core.jobs.progress import MergeProgress, ProgressFn, report
from memwal_core.options import MergeOptions
from memwal_core.spark import tasks as sparkpath
from memwal_core.state import layout, lease, lifecycle, region, routing, walls
from memwal_core.state.keys import delete_predicate, quote_column, refuse_unsupported_keys  # noqa: F401 - merge.* names
from memwal_core.state.lance_mem_wal import is_commit_conflict, merged_markers
from memwal_core.state.store import TableLocation, refuse_links
from memwal_core.state.table import MemWalState, open_dataset, primary_key, read_memwal_state, refuse_stable_row_ids

log = logging.getLogger("memwal.merge")

# The defaults are MergeOptions' (memwal_core/options.py): one default per setting.
DEFAULT_BUDGET_BYTES = MergeOptions().budget_bytes
DEFAULT_MAX_GENERATIONS = MergeOptions().max_generations


class MergeError(MemwalError):
    """A merge run cannot go on (a batch lost too many commit races, a key not expressible)."""


class CommitVerificationError(MergeError):
    """A merge commit recorded progress over rows that are not what it planned (keys present
    twice, tombstoned keys back, upserted keys missing): its regions stop behind a permanent
    wall until the table is repaired (`verify.py`)."""

    def __init__(self, message: str, regions: list[str]) -> None:
        super().__init__(message)
        self.regions = regions


# How a wall record of a failed commit verification starts: later runs keep the region stopped.
COMMIT_CHECK_FAILED = "commit verification failed"


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


@dataclass(frozen=True)
class Wall:
    """A region's first generation that is not merged in this run, and why.

    Merge progress never passes it: every later generation of the region waits too, across
    all batches and retries of the run. `permanent`: the region itself is wrong (a refused
    generation, a malformed or corrupt manifest) and stays stuck until repaired; otherwise
    (a read or load that failed after retries) the next run tries again.
    """

    generation: int
    reason: str
    permanent: bool


@dataclass
class MergePlan:
    table_uri: str
    table_version: int
    merged: dict[str, int]
    batches: list[MergeBatch]
    walls: dict[str, Wall] = field(default_factory=dict)  # regions refused while planning
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    max_generations: int = DEFAULT_MAX_GENERATIONS
    lifecycle: lifecycle.Lifecycle | None = None  # stale regions (data from before the initialization)

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
                             "generations": [asdict(g) for g in b.generations]} for b in self.batches],
                "region_errors": self.region_errors,
                "walls": {rid: asdict(w) for rid, w in self.walls.items()}}


def _generation_bytes(loc: TableLocation, region_id: str, g: region.Generation) -> int:
    prefix = layout.generation_dir(region_id, g.path, g.generation)
    refuse_links(loc.store, prefix)  # Spark opens it by URI: a link would be followed there
    if g.in_memory_bytes:
        return g.in_memory_bytes
    return sum(o.size for o in loc.store.list(prefix))


def plan_merge(loc: TableLocation, *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
               max_generations: int = DEFAULT_MAX_GENERATIONS, regions: list[str] | None = None,
               state: MemWalState | None = None) -> MergePlan:
    """Which generations to merge, in which batches. Reads only committed state.

    A region whose manifest cannot be loaded, or whose generation list is malformed, gets a
    wall at its first unmerged generation and nothing planned; the other regions are planned.
    """
    if budget_bytes <= 0 or max_generations <= 0:
        raise ValueError("budget_bytes and max_generations must be positive")
    state = state or read_memwal_state(loc)
    merged = state.merged
    ids = regions if regions is not None else region.list_regions(loc.store).region_ids
    loaded = region.load_many(loc.store, ids)
    spec_ids = [s.spec_id for s in state.details.region_specs]
    lc = lifecycle.assess(loc, loaded.manifests, current_version=state.table_version, record=False)
    walls: dict[str, Wall] = {}
    queues: dict[str, list[PlannedGeneration]] = {}
    for rid, got in sorted(loaded.items()):
        done = merged.get(rid, 0)
        if not got.ok:
            walls[rid] = Wall(done + 1, got.message, permanent=got.permanent)
            log.error("%s", got.message)
            continue
        m = got.manifest
        if _stale_wall(lc, rid, m, done, walls):
            continue
        try:
            region.check_spec(m, spec_ids)
            pending = [PlannedGeneration(rid, g.generation, layout.validate_generation_path(g.path, g.generation),
                                         _generation_bytes(loc, rid, g), g.physical_rows)
                       for g in region.pending_generations(m, done)]
        except region.CorruptManifest as e:  # malformed generation list, unknown region spec
            walls[rid] = Wall(done + 1, f"region {rid}: corrupt manifest version {m.version}: {e.detail}",
                              permanent=True)
            log.error("%s", walls[rid].reason)
            continue
        except layout.UnsafePath as e:
            walls[rid] = Wall(done + 1, f"region {rid}: corrupt manifest version {m.version}: {e}", permanent=True)
            log.error("%s", walls[rid].reason)
            continue
        except Exception as e:  # noqa: BLE001 - sizing a generation failed (I/O): this region only
            walls[rid] = Wall(done + 1, f"region {rid}: {type(e).__name__}: {e}", permanent=False)
            log.error("%s", walls[rid].reason)
            continue
        if pending:
            queues[rid] = pending
    return MergePlan(loc.lance_uri, state.table_version, merged,
                     _batches(queues, budget_bytes, max_generations), walls, budget_bytes, max_generations, lc)


def _stale_wall(lc: lifecycle.Lifecycle, rid: str, m: region.RegionManifest, done: int,
                walls: dict[str, Wall]) -> bool:
    """A wall for a region whose data predates the MemWAL initialization (`state/lifecycle.py`):
    permanent until discarded, so the stale rows never reach the table and nothing of the region
    (its later generations included) merges past them. A region whose lifecycle could not be
    read stops for this run."""
    listed = [g.generation for g in m.generations]
    if rid in lc.errors:
        walls[rid] = Wall(done + 1, lc.errors[rid], permanent=False)
    elif lc.blocks(rid, done) and any(g > done for g in listed):
        walls[rid] = Wall(done + 1, lc.message(rid, done, listed), permanent=True)
    else:
        return False
    log.error("%s", walls[rid].reason)
    return True


def _batches(queues: dict[str, list[PlannedGeneration]], budget: int, max_gens: int) -> list[MergeBatch]:
    """Round-robin over regions so one region's backlog cannot starve the others.

    Each region's generations stay in ascending order across batches; a single generation
    larger than the budget gets a batch of its own.
    """
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
    wall: int | None = None      # first generation not merged in this run (see `Wall`)
    permanent: bool = False      # the wall stays until the region is repaired (stuck)

    def stop(self, wall: Wall) -> None:
        """Record a wall; the lowest one wins (progress can never pass it)."""
        if self.wall is None or wall.generation < self.wall:
            self.wall, self.error, self.permanent = wall.generation, wall.reason, wall.permanent


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
    def region_errors(self) -> dict[str, str]:
        """Regions not merged as far as planned: region id -> why (their walls; see `Wall`)."""
        return {rid: r.error for rid, r in self.regions.items() if r.error}

    @property
    def stuck_regions(self) -> dict[str, str]:
        """Regions behind a permanent wall: nothing merges there until they are repaired."""
        return {rid: r.error for rid, r in self.regions.items() if r.error and r.permanent}

    @property
    def generations_merged(self) -> int:
        return sum(len(r.generations_merged) for r in self.regions.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["generations_merged"] = self.generations_merged
        d["region_errors"] = self.region_errors
        d["stuck_regions"] = self.stuck_regions
        return d




class _Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


@lease.step("merge")
def execute_merge(loc: TableLocation, plan: MergePlan, spark, *, max_attempts: int = 5,
                  progress: ProgressFn | None = None, expected_values: dict[str, dict] | None = None) -> MergeResult:
    """Merge every batch of `plan`: one Spark job and one commit per batch (normally).

    Each region's value (what its rows must route to) comes from authoritative state
    (`region_values`): `expected_values` (region id -> {field id: value}) if given, else the
    MemWAL snapshot, else its oldest merged generation, else the run's first routed generation
    (unanimous, not owned by another region). A region's first generation that cannot be
    merged is a `Wall` for the rest of the run: no later batch or retry merges past it.
    """
    clock = _Clock()
    ds = open_dataset(loc)
    pk = primary_key(ds)  # a table without a primary key cannot be merged: say so first
    refuse_unsupported_keys(ds.schema, pk, loc.lance_uri)  # a key type no predicate matches exactly
    refuse_stable_row_ids(ds)  # merge_insert would mint new row ids (table.refuse_stable_row_ids)
    result = MergeResult(plan.table_uri)
    for rid, wall in plan.walls.items():
        result.regions.setdefault(rid, RegionMergeResult(rid)).stop(wall)
    if not plan.batches:
        _record_walls(loc, plan, result, read_memwal_state(loc).merged, {})
        _save_lifecycle(loc, plan)
        result.duration_s = clock.elapsed()
        result.table_version = plan.table_version
        return result
    state = read_memwal_state(loc, ds.version)
    specs = {s.spec_id: s for s in state.details.region_specs}
    loaded = region.load_many(loc.store, sorted(plan.pending))
    run = _Run(loc, spark, tuple(pk), tuple(f.name for f in ds.schema), ds.schema, merge_tasks(spark), result,
               max_attempts)
    run.field_ids = tuple((f.name(), f.id()) for f in ds.lance_schema.fields())
    recorded_walls = _recorded_walls(loc)
    run.evidence = {rid: rec for rid, rec in recorded_walls.items()
                    if rid in plan.pending and rec.shared_keys is not None}
    for rid, rec in recorded_walls.items():  # a region merged over wrong rows stays stopped until repaired
        if rid in plan.pending and rec.reason.startswith(COMMIT_CHECK_FAILED):
            run.stop(rid, Wall(rec.generation, rec.reason, permanent=True))
    for rid, got in loaded.items():
        if got.ok:
            run.routes[rid] = routing_check(got.manifest, specs, ds.lance_schema)
        else:  # loaded when planned, not now: no routing to check it by
            run.stop(rid, Wall(plan.merged.get(rid, 0) + 1, got.message, permanent=got.permanent))
    routed = {r: m for r, m in loaded.manifests.items() if run.routes.get(r)}
    stale = plan.lifecycle
    try:
        recorded = snapshot.recorded_values(loc, state)  # read once: values and other regions' owners
        values = region_values(loc, state, ds, routed, pk, expected_values or {}, recorded, stale)
        run.owners = _owners(recorded, specs, values)
        if any(rid not in values for rid in routed):  # a region will establish its value: against every owner
            run.owners.update(_unrecorded_owners(loc, state, ds, pk, specs, recorded, routed, stale))
    except snapshot.SnapshotError as e:  # recorded values exist but cannot be read: nothing to check by
        for rid in routed:
            if not (expected_values or {}).get(rid):
                run.stop(rid, Wall(plan.merged.get(rid, 0) + 1, f"region {rid}: the MemWAL snapshot that records "
                                   f"region values is unreadable ({e}); not merging routed regions without it",
                                   permanent=False))
        values = dict(expected_values or {})
    for rid, check in run.routes.items():
        if check and rid in values:
            run.own[rid] = sparkpath.value_key([values[rid].get(f) for f in check.field_ids])
    run.owners.update({v: rid for rid, v in run.own.items()})
    totals = {"batches": len(plan.batches), "generations": sum(len(b.generations) for b in plan.batches),
              "bytes": sum(b.bytes for b in plan.batches), "regions": len(plan.pending)}
    gens_merged = bytes_merged = 0
    for n, batch in enumerate(plan.batches, 1):
        here = {"batch": n, "batch_generations": len(batch.generations), "batch_bytes": batch.bytes,
                "batch_regions": len({g.region_id for g in batch.generations}), **totals}
        report(progress, MergeProgress(**here, generations_merged=gens_merged, bytes_merged=bytes_merged,
                                       finished=False))
        _merge_batch(run, batch)
        for g in batch.generations:  # each generation is in one batch: count what committed
            r = result.regions.get(g.region_id)
            if r is not None and g.generation in r.generations_merged:
                gens_merged += 1
                bytes_merged += g.bytes
        report(progress, MergeProgress(**here, generations_merged=gens_merged, bytes_merged=bytes_merged,
                                       finished=True))
    merged_end = read_memwal_state(loc).merged
    run.lift(merged_end)
    _record_walls(loc, plan, result, merged_end, run.evidence)
    _save_lifecycle(loc, plan)
    result.duration_s = clock.elapsed()
    result.table_version = open_dataset(loc).version
    return result


def _save_lifecycle(loc: TableLocation, plan: MergePlan) -> None:
    """Record the plan's stale-region verdicts (the planner only reads), after the commits."""
    if plan.lifecycle is not None:
        lifecycle.save(loc, plan.lifecycle)


def _owners(recorded: dict[str, dict], specs: dict, values: dict[str, dict]) -> dict[str, str]:
    """Region value -> region, over every region the snapshot knows (pending or not): a new
    region may not adopt a value another region already holds (this run's own values are added
    by the caller)."""
    owners: dict[str, str] = {}
    for rid, vals in recorded.items():
        if rid in values:
            continue
        fields = _spec_field_ids(specs, vals)
        if fields:
            owners[sparkpath.value_key([vals.get(f) for f in fields])] = rid
    return owners


def _unrecorded_owners(loc: TableLocation, state: MemWalState, ds, pk: list[str], specs: dict,
                       recorded: dict[str, dict], routed: dict[str, region.RegionManifest],
                       stale: lifecycle.Lifecycle | None = None) -> dict[str, str]:
    """Region value -> region, for regions with merge progress that no snapshot records yet and
    that have nothing pending in this run (before the first snapshot, or merged since the last).

    Their values come from their merged generations (GC keeps those until a snapshot records
    the value: `gc.unrecorded_regions`). Without this, a new region could adopt the value of a
    region merged earlier, and two regions would write one value."""
    others = [rid for rid, g in state.merged.items() if g > 0 and rid not in recorded and rid not in routed
              and not (stale and stale.discarded_only(rid, g))]
    if not others:
        return {}
    reads = region.load_many(loc.store, others)
    derived = region_values(loc, state, ds, reads.manifests, pk, {}, recorded, stale)
    for rid in sorted(set(others) - set(derived)):
        why = reads.region_errors.get(rid) or "no value derived from its merged generations"
        log.warning("region %s: merged, not in a MemWAL snapshot (%s): a new region's value cannot be "
                    "checked against it", rid, why)
    return _owners(derived, specs, {})


def _spec_field_ids(specs: dict, vals: dict) -> list[str] | None:
    """The field ids of the one region spec whose fields are exactly `vals`' keys (values from
    a snapshot row carry no spec id here)."""
    for spec_pb in specs.values():
        ids = [f.field_id for f in spec_pb.fields]
        if ids and set(ids) == set(vals):
            return ids
    return None


def merge_tasks(spark) -> int:
    """Spark tasks per merge batch (each takes whole regions): `memwal.merge.partitions` if
    set, else the session's shuffle partitions (`local[*]`: the core count) capped at 64."""
    explicit = spark.conf.get("memwal.merge.partitions", None)
    if explicit:
        return max(1, int(explicit))
    return max(1, min(64, int(spark.conf.get("spark.sql.shuffle.partitions", "8"))))


def routing_check(m: region.RegionManifest, specs: dict, lance_schema) -> sparkpath.RoutingCheck | None:
    """How the tasks check a region's rows (None: a manual or unsharded region, nothing to route)."""
    spec_pb = specs.get(m.message.region_spec_id)
    if spec_pb is None:
        return None
    rs = routing.RegionSpec.from_proto(spec_pb)
    if any(f.transform == routing.UNSHARDED for f in rs.fields):
        return None
    return sparkpath.RoutingCheck(rs.to_lance(), tuple(sorted(routing.source_columns_for(rs, lance_schema).items())))


def region_values(loc: TableLocation, state: MemWalState, ds, manifests: dict[str, region.RegionManifest],
                  pk: list[str], expected: dict[str, dict],
                  recorded: dict[str, dict] | None = None,
                  stale: lifecycle.Lifecycle | None = None) -> dict[str, dict]:
    """Region id -> {field id: value}: what each region's rows must route to.

    Authoritative only: `expected`, then the value recorded in the MemWAL snapshot (reused by
    every later snapshot, so it never changes), then the oldest *merged* generation still
    listed whose live rows all agree (a generation the merger already accepted; never one it is
    about to check, which after GC trimmed the merged ones would be the pending ones). A region
    with none of these is checked by its first routed generation being unanimous and its value
    not owned by another region (`_Run.establish`). Stale generations (`stale`: data from before
    the MemWAL initialization, discarded or not) are no authority: they are left out.
    """
    if stale is not None:
        manifests = {rid: lifecycle.without_stale(m, stale.verdict(rid)) for rid, m in manifests.items()}
    out = {rid: expected[rid] for rid in manifests if rid in expected}
    missing = [rid for rid in manifests if rid not in out]
    if missing:
        known = snapshot.recorded_values(loc, state) if recorded is None else recorded
        out.update({rid: known[rid] for rid in missing if rid in known})
    specs = {s.spec_id: snapshot.spec_from_pb(s) for s in state.details.region_specs}
    merged = state.merged
    todo = [rid for rid in manifests if rid not in out and merged.get(rid, 0) > 0
            and manifests[rid].message.region_spec_id in specs]

    def derive(rid: str):
        m = manifests[rid]
        try:
            return snapshot.derive_region_fields(loc, specs[m.message.region_spec_id], ds.lance_schema, pk, m,
                                                 upto=merged[rid])
        except Exception as e:  # noqa: BLE001 - no value: the task's unanimity rule applies
            log.info("region %s: no region value derived (%s)", rid, e)
            return None

    if todo:
        with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
            for rid, fv in zip(todo, pool.map(derive, todo)):
                if fv is not None and fv.values and fv.source.startswith(("derived", "manifest")):
                    out[rid] = fv.values
    return out


@dataclass
class _Run:
    """What the batches of one `execute_merge` share, the walls above all."""

    loc: TableLocation
    spark: Any
    pk: tuple[str, ...]
    columns: tuple[str, ...]
    schema: pa.Schema
    tasks: int
    result: MergeResult
    max_attempts: int
    routes: dict[str, sparkpath.RoutingCheck | None] = field(default_factory=dict)
    own: dict[str, str] = field(default_factory=dict)      # region -> its value (`value_key`)
    owners: dict[str, str] = field(default_factory=dict)   # value -> the region that owns it (any region)
    walls: dict[str, Wall] = field(default_factory=dict)
    seen: list[tuple[str, pa.Table]] = field(default_factory=list)  # keys this run merged, by region
    evidence: dict[str, walls.WallRecord] = field(default_factory=dict)  # region -> keys it must not merge
    field_ids: tuple[tuple[str, int], ...] = ()                 # the base table's (name, Lance field id)
    dropped: tuple[tuple[str, int], ...] | None = None          # those it dropped (looked up when needed)

    def stop(self, rid: str, wall: Wall) -> None:
        if rid not in self.walls or wall.generation < self.walls[rid].generation:
            self.walls[rid] = wall
            log.error("%s; %s", wall.reason, "the region is stuck until it is repaired" if wall.permanent
                      else f"merging stops before generation {wall.generation} in this run")
        self.result.regions.setdefault(rid, RegionMergeResult(rid)).stop(wall)

    def establish(self, rid: str, stats: list[sparkpath.GenerationStats]) -> None:
        """Adopt a region's value from its first routed generation (unanimous) when nothing
        authoritative gave one, unless another region owns that value; kept for the rest of the
        run, so later batches and re-runs check against it."""
        if rid in self.own or not self.routes.get(rid):
            return
        first = sparkpath.first_routed_value(stats)
        if first is None:
            return
        generation, value = first
        owner = self.owners.get(value)
        if owner is not None and owner != rid:
            self.stop(rid, Wall(generation, f"region {rid}: generation {generation}: its rows route to region value "
                                            f"{value}, which region {owner} owns; the spec requires mutually "
                                            "exclusive regions", permanent=True))
            return
        self.own[rid] = value
        self.owners[value] = rid

    def open(self, g: PlannedGeneration) -> bool:
        """False for a generation at or past its region's wall."""
        w = self.walls.get(g.region_id)
        return w is None or g.generation < w.generation

    def lift(self, merged: dict[str, int]) -> None:
        """Forget transient walls another merger has merged past (they stop nothing any more and
        would report a merged region as failed); a permanent wall stays reported: it is a
        verdict on the generation's contents."""
        for rid, r in self.result.regions.items():
            if r.wall is not None and not r.permanent and r.wall <= merged.get(rid, 0):
                log.info("region %s: generation %d was merged by another merger; its wall is lifted", rid, r.wall)
                r.wall, r.error = None, None
                self.walls.pop(rid, None)

    def remember(self, deduped: sparkpath.Deduped, regions: dict[int, str]) -> None:
        """Keep the keys a commit merged, per region, for the cross-batch exclusivity check."""
        for tables, owners in ((deduped.live, deduped.live_region), (deduped.deleted, deduped.deleted_region)):
            for t, ridx in zip(tables, owners):
                if ridx in regions and t.num_rows:
                    self.seen.append((regions[ridx], t.select(list(self.pk))))


def _merge_batch(run: _Run, batch: MergeBatch) -> None:
    """Read, check, deduplicate and commit one batch; re-run the Spark job when what it read
    cannot be committed as it is (a generation merged meanwhile, keys shared by regions, a
    lost commit race). Each re-run has fewer generations or counts a conflict, so it ends."""
    loc, result = run.loc, run.result
    region_ids = sorted({g.region_id for g in batch.generations if run.open(g)})
    index = {rid: i for i, rid in enumerate(region_ids)}
    region_index = {i: rid for rid, i in index.items()}
    for rid in region_ids:
        result.regions.setdefault(rid, RegionMergeResult(rid))
    conflicts = 0
    while True:
        cfg = sparkpath.ReadConfig(  # own values may have been established by an earlier round
            pk=run.pk, columns=run.columns, base_schema=run.schema, storage_options=tuple(sorted(loc.storage_options.items())),
            routing=tuple((index[rid], run.routes.get(rid)) for rid in region_ids),
            own_values=tuple((index[rid], run.own[rid]) for rid in region_ids if rid in run.own),
            base_field_ids=run.field_ids, dropped_fields=run.dropped)
        merged = read_memwal_state(loc).merged
        run.lift(merged)
        gens = []
        for g in batch.generations:
            if g.generation <= merged.get(g.region_id, 0):
                r = result.regions[g.region_id]
                if g.generation not in r.skipped_generations:
                    r.skipped_generations.append(g.generation)
            elif run.open(g):
                gens.append(g)
        if not gens:
            return
        deduped = sparkpath.read_and_dedup(
            run.spark, [(index[g.region_id], g.generation,
                         loc.child_uri(layout.generation_dir(g.region_id, g.path, g.generation)), g.bytes)
                        for g in gens], cfg, run.tasks)
        # Progress is read again after the read: a generation another merger merged meanwhile
        # may be gone already (GC collects merged generations) and fail to read. It is skipped
        # as merged on the next round, not reported as broken.
        merged_now = read_memwal_state(loc).merged
        if any(g.generation <= merged_now.get(g.region_id, 0) for g in gens):
            log.info("generations of this batch were merged by another merger meanwhile; re-reading the rest")
            continue
        if run.dropped is None and _unmatched_fields(deduped.stats):
            run.dropped = _dropped_fields(loc, run.field_ids)  # once per run, only when a generation needs it
            if _unmatched_fields(deduped.stats) & set(run.dropped):
                continue  # re-read: those columns are projected away
        by_region: dict[int, list[sparkpath.GenerationStats]] = {}
        for s in deduped.stats:
            by_region.setdefault(s.region, []).append(s)
        task_cut: dict[str, int] = {}  # region -> the generation the task stopped deduplicating at
        for ridx, rows in sorted(by_region.items()):
            rid = region_index[ridx]
            refusal = sparkpath.first_refused(rows, dict(cfg.own_values).get(ridx))  # what the task decided
            task_cut[rid] = refusal.generation if refusal else max(s.generation for s in rows) + 1
            if refusal is not None:
                result.regions[rid].offending_keys += refusal.offending_rows
                run.stop(rid, Wall(refusal.generation, f"region {rid}: {refusal.message}", refusal.permanent))
            run.establish(rid, rows)
        if deduped.shared:
            _refuse_shared(deduped, gens, region_index, run)
            continue
        if _refuse_across_batches(run, deduped, gens, region_index, merged_now):
            continue
        if any(rid in run.walls and run.walls[rid].generation < cut for rid, cut in task_cut.items()):
            continue  # the driver stopped a region earlier than its task did: re-read without those rows
        gens = _in_order([g for g in gens if run.open(g)], merged_now, run)
        if not gens:
            return
        if _commit_isolating(run, deduped, gens, index):
            return
        conflicts += 1
        result.conflicts += 1
        if conflicts >= run.max_attempts:
            raise MergeError(f"gave up merging a batch after {run.max_attempts} conflicting attempts")
        log.info("merge commit lost to another merger (attempt %d); re-reading progress", conflicts)


def _unmatched_fields(stats: list[sparkpath.GenerationStats]) -> set[tuple[str, int]]:
    """(name, field id) of generation columns the base table's schema does not have as such."""
    return {f for s in stats for f in s.fields}


_SCHEMA_CACHE: dict[tuple[str, int], tuple[tuple[str, int], ...]] = {}  # versions are immutable


def _dropped_fields(loc: TableLocation, current: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """(name, field id) of every top-level column some retained version of the base table had
    and the current one does not (`drop_columns`, or dropped and re-added: a new field id). A
    column whose version was cleaned up cannot be told from a foreign one: it stays refused."""
    ds = open_dataset(loc)
    seen: set[tuple[str, int]] = set()
    for v in sorted((int(v["version"]) for v in ds.versions()), reverse=True):
        key = (loc.lance_uri, v)
        if key not in _SCHEMA_CACHE:
            try:
                _SCHEMA_CACHE[key] = tuple((f.name(), f.id()) for f in ds.checkout_version(v).lance_schema.fields())
            except Exception as e:  # noqa: BLE001 - cleaned up meanwhile: nothing learnt from it
                log.info("base table version %d unreadable while looking for dropped columns: %s", v, e)
                continue
        seen.update(_SCHEMA_CACHE[key])
    return tuple(sorted(seen - set(current)))


def _in_order(gens: list[PlannedGeneration], merged: dict[str, int], run: _Run) -> list[PlannedGeneration]:
    """Each region's generations that continue its progress without a hole (the wall's last
    line of defence: progress is set to the highest generation committed, so a hole would be
    recorded as merged)."""
    out = []
    for rid in sorted({g.region_id for g in gens}):
        want = merged.get(rid, 0) + 1
        for g in sorted((g for g in gens if g.region_id == rid), key=lambda g: g.generation):
            if g.generation != want:
                run.stop(rid, Wall(want, f"region {rid}: generation {want} was not merged before generation "
                                         f"{g.generation} in this run", permanent=False))
                break
            out.append(g)
            want += 1
    return out


def _refuse_shared(deduped: sparkpath.Deduped, gens: list[PlannedGeneration], region_index: dict[int, str],
                   run: _Run) -> None:
    """Keys in several regions break the spec's exclusivity: none of those regions is merged in
    this run (which of their rows is newest is unknowable), the others are."""
    for ridx, rows in deduped.shared.items():
        rid = region_index[ridx]
        others = ", ".join(region_index[i] for i in sorted(deduped.shared) if i != ridx)
        r = run.result.regions[rid]
        r.offending_keys = max(r.offending_keys, rows)
        first = min(g.generation for g in gens if g.region_id == rid)
        run.stop(rid, Wall(first, f"region {rid}: {deduped.shared_keys} primary keys also appear in another "
                                  f"region ({others}); the spec requires mutually exclusive regions, so none "
                                  "of these regions is merged", permanent=True))


_SEEN, _NOW = "_memwal_seen_region", "_memwal_region"


def _refuse_across_batches(run: _Run, deduped: sparkpath.Deduped, gens: list[PlannedGeneration],
                           region_index: dict[int, str], merged: dict[str, int]) -> bool:
    """The exclusivity check of `read_and_dedup` across the batches of the run (and, through
    recorded evidence, across runs): a key of this batch that another region merged earlier in
    this run means which row is newest is unknowable. The region of this batch is refused
    (permanent: a writer broke exclusivity; its record keeps the keys so the next run refuses
    it again while they are pending); the region that merged first stops for this run only
    (its row is in the base table already; nothing of the refused region will overwrite it).
    Also refused: a region whose pending rows hold a key its wall record names. Cost: a join
    of this batch's keys (the build side, bounded by the batch budget) with the keys merged so
    far in the run (memory: the key columns of every row the run merged). True: re-read."""
    pk = list(run.pk)
    parts = [(region_index[r], t) for t, r in zip(deduped.live + deduped.deleted,
                                                  deduped.live_region + deduped.deleted_region) if t.num_rows]
    if not parts or not (run.seen or run.evidence):
        return False
    now = pa.concat_tables([t.select(pk).append_column(_NOW, pa.array([rid] * t.num_rows, pa.string()))
                            for rid, t in parts], promote_options="permissive")
    hits: dict[str, tuple[pa.Table, list[str], bool]] = {}  # region -> (keys, other regions, from evidence)

    def probe(earlier: list[tuple[str, pa.Table]], same: bool) -> None:
        if not earlier:
            return
        seen = pa.concat_tables([t.select(pk).append_column(_SEEN, pa.array([rid] * t.num_rows, pa.string()))
                                 for rid, t in earlier], promote_options="permissive")
        both = seen.join(now, keys=pk, join_type="inner")
        test = pc.equal if same else pc.not_equal
        both = both.filter(test(both[_SEEN], both[_NOW]))
        for rid in sorted(set(both[_NOW].to_pylist())):
            if rid in hits:
                continue
            mine = both.filter(pc.equal(both[_NOW], rid))
            others = ([run.evidence[rid].other_region or "another region"] if same
                      else sorted(set(mine[_SEEN].to_pylist())))
            hits[rid] = (mine.select(pk), others, same)

    probe([(rid, rec.shared_keys) for rid, rec in run.evidence.items()], True)
    probe(run.seen, False)
    if not hits:
        return False
    for rid, (keys, others, recorded) in sorted(hits.items()):
        first = min(g.generation for g in gens if g.region_id == rid)
        run.result.regions[rid].offending_keys = max(run.result.regions[rid].offending_keys, keys.num_rows)
        run.evidence[rid] = walls.WallRecord(rid, first, "", shared_keys=keys, other_region=others[0])
        run.stop(rid, Wall(first, f"region {rid}: {keys.num_rows} primary keys of its generations from {first} on "
                                  f"{'were found earlier in' if recorded else 'were merged in this run from'} "
                                  f"region {', '.join(others)}; the spec requires mutually exclusive regions "
                                  "(repair the generation: which row is newest is unknowable)", permanent=True))
        for other in ([] if recorded else others):
            if other not in run.walls:
                run.stop(other, Wall(merged.get(other, 0) + 1, f"region {other}: primary keys it merged in this "
                                     f"run are also in region {rid}'s pending generation {first} (refused); "
                                     "stopped for this run, the next run continues", permanent=False))
    return True


def _recorded_walls(loc: TableLocation) -> dict[str, walls.WallRecord]:
    try:
        return walls.read_all(loc.store)
    except Exception as e:  # noqa: BLE001 - a report, and evidence that only adds refusals
        log.warning("wall records unreadable: %s: %s", type(e).__name__, e)
        return {}


def _record_walls(loc: TableLocation, plan: MergePlan, result: MergeResult, merged: dict[str, int],
                  evidence: dict[str, walls.WallRecord]) -> None:
    """Record this run's permanent walls (`state/walls.py`) and delete the records of regions
    merged past theirs or looked at without being refused. Failing to write is logged: the
    result reports the walls all the same."""
    old = _recorded_walls(loc)
    looked = set(plan.pending) | set(plan.walls)
    stale = []
    for rid, rec in old.items():
        r = result.regions.get(rid)
        if merged.get(rid, 0) >= rec.generation or (rid in looked and (r is None or r.wall is None)):
            stale.append(rid)
    try:
        walls.clear(loc.store, stale)
        for rid, r in sorted(result.regions.items()):
            if r.wall is None or not r.permanent:
                continue
            ev = evidence.get(rid) or (old.get(rid) if rid not in stale else None)
            walls.write(loc.store, walls.WallRecord(rid, r.wall, r.error or "", time.time(),
                                                    ev.shared_keys if ev else None, ev.other_region if ev else None))
    except Exception as e:  # noqa: BLE001
        log.warning("could not record walls: %s: %s", type(e).__name__, e)


def _commit_isolating(run: _Run, deduped: sparkpath.Deduped, gens: list[PlannedGeneration],
                      index: dict[str, int]) -> bool:
    """Commit `gens` in one commit; if that fails for a reason other than a lost race, commit
    region by region so the failure stops only the region it belongs to. False: a commit lost
    a race (the caller re-reads progress and retries what is left)."""
    try:
        return _commit(run, deduped, gens, index)
    except lease.LeaseLost:
        raise  # not this batch's fault: the whole step stops (another maintainer holds the table)
    except CommitVerificationError as e:
        _verification_failed(run, e, gens)
        return True
    except Exception as e:  # noqa: BLE001 - isolated below
        rids = sorted({g.region_id for g in gens})
        if len(rids) == 1:
            _commit_failed(run, rids[0], gens, e)
            return True
        log.warning("a commit of %d regions failed (%s: %s); committing them one by one",
                    len(rids), type(e).__name__, e)
    for rid in rids:
        mine = [g for g in gens if g.region_id == rid]
        try:
            if not _commit(run, deduped.only({index[rid]}), mine, index):
                return False
        except lease.LeaseLost:
            raise
        except CommitVerificationError as e:
            _verification_failed(run, e, mine)
        except Exception as e:  # noqa: BLE001 - this region only
            _commit_failed(run, rid, mine, e)
    return True


def _verification_failed(run: _Run, e: CommitVerificationError, gens: list[PlannedGeneration]) -> None:
    """Stop every region of a commit whose rows are wrong. The commit recorded their progress
    with the rows, so the wall is right after it: nothing merges over the region again (in
    this run or later ones: the wall record keeps it) until it is repaired. The record is
    written now, not with the run's other walls at its end: a merger killed in a later batch
    would otherwise leave no trace, and the next run would merge on over the wrong rows."""
    for rid in e.regions:
        last = max(g.generation for g in gens if g.region_id == rid)
        wall = Wall(last + 1, f"{COMMIT_CHECK_FAILED}: {e}", permanent=True)
        run.stop(rid, wall)
        try:
            walls.write(run.loc.store, walls.WallRecord(rid, wall.generation, wall.reason, time.time()))
        except Exception as w:  # noqa: BLE001 - written again with the run's walls at its end
            log.error("region %s: could not record the wall of a failed commit verification now: %s", rid, one_line(w))


def _commit_failed(run: _Run, rid: str, gens: list[PlannedGeneration], e: Exception) -> None:
    run.stop(rid, Wall(min(g.generation for g in gens), f"region {rid}: commit failed: {one_line(e)}",
                       permanent=False))


def _commit(run: _Run, deduped: sparkpath.Deduped, gens: list[PlannedGeneration], index: dict[str, int]) -> bool:
    """Commit exactly `gens` from their deduplicated rows: True, or False on a lost race."""
    loc, pk, result = run.loc, list(run.pk), run.result
    deleted = pa.concat_tables(deduped.deleted) if deduped.deleted else None
    progress: dict[str, int] = {}
    for g in gens:
        progress[g.region_id] = max(progress.get(g.region_id, 0), g.generation)
    ds = open_dataset(loc, commit_lock=faults.commit_lock("merge.during_commit"))
    schema = pa.schema([ds.schema.field(c) for c in run.columns])
    builder = ds.merge_insert(pk).when_matched_update_all().when_not_matched_insert_all()
    if deleted is not None and deleted.num_rows:
        builder = builder.when_not_matched_by_source_delete(delete_predicate(deleted, pk))
    builder = builder.mark_sstables_as_compacted(merged_markers(progress))
    source = pa.RecordBatchReader.from_batches(schema, _cast_stream(deduped.live, schema))
    faults.point("merge.before_commit")
    read_version = ds.version  # Lance records the version it rebased onto, not this one
    lease.fence(loc, "merge commit")
    try:
        stats = builder.execute(source)
    except OSError as e:
        if is_commit_conflict(e):
            return False
        raise
    faults.point("merge.after_commit")
    key_types = pa.schema([pa.field(c, schema.field(c).type) for c in pk])
    upserted = pa.concat_tables([t.select(pk).cast(key_types) for t in deduped.live]) \
        if deduped.live else key_types.empty_table()
    try:
        check = verify.verify_commit(loc, ds.version, progress, upserted, deleted, pk)
    except Exception as e:  # noqa: BLE001 - the commit did happen: not a failed commit, not a retry
        log.error("merge commit version %d could not be verified (%s: %s); taking it as committed",
                  ds.version, type(e).__name__, one_line(e))
        check = verify.CommitCheck(ds.version, ds.version, ds.version)
    if not check.landed:  # nothing of it is in the latest version: the generations are still pending
        log.warning("merge commit version %d is not in the latest version %d (%s); merging the batch again",
                    check.version, check.latest, check.describe())
        return False
    if check.bad_rows:
        gens_text = ", ".join(f"region {rid} generations {sorted(g.generation for g in gens if g.region_id == rid)}"
                              for rid in sorted(progress))
        raise CommitVerificationError(
            f"merge commit version {check.version} ({gens_text}) does not hold what was merged: "
            f"{check.describe()}; merge progress was recorded with it, so the region stops here until "
            "the table is repaired (a base-version cleanup shorter than a commit, or a writer that "
            "bypasses memwal, can do this)", sorted(progress))
    log.debug("merge commit version %d verified in %.3f s", check.version, check.seconds)
    run.remember(deduped, {index[rid]: rid for rid in progress})
    new = open_dataset(loc)
    result.commits += 1
    result.rows_upserted += stats["num_inserted_rows"] + stats["num_updated_rows"]
    result.rows_deleted += stats["num_deleted_rows"]
    result.bytes_written += _bytes_written(new, new.version)
    by_gen = {(s.region, s.generation): s for s in deduped.stats}
    for g in gens:
        r = result.regions[g.region_id]
        r.generations_merged.append(g.generation)
        r.merged_generation = max(r.merged_generation, g.generation)
        s = by_gen.get((index[g.region_id], g.generation))
        if s is not None:
            r.rows_read += s.rows
            r.bytes_read += s.bytes
            result.bytes_read += s.bytes
    log.info("merged %d generations of %d regions: +%d upserted, -%d deleted, progress %s "
             "(read version %d, committed version %d)",
             len(gens), len(progress), stats["num_inserted_rows"] + stats["num_updated_rows"],
             stats["num_deleted_rows"], progress, read_version, check.version)
    return True


def _cast_stream(tables: Iterator[pa.Table], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    for t in tables:
        yield from t.select(schema.names).cast(schema).to_batches()


def _bytes_written(ds: lance.LanceDataset, version: int) -> int:
    txn = ds.read_transaction(version)
    op = getattr(txn, "operation", None)
    frags = list(getattr(op, "new_fragments", []) or [])
    return sum((f.file_size_bytes or 0) for frag in frags for f in frag.files)


@lease.step("merge")
def merge(loc: TableLocation, spark, *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
          max_generations: int = DEFAULT_MAX_GENERATIONS, regions: list[str] | None = None,
          progress: ProgressFn | None = None) -> MergeResult:
    """Plan and execute in one call (what the CLI and the Dagster asset run)."""
    plan = plan_merge(loc, budget_bytes=budget_bytes, max_generations=max_generations, regions=regions)
    return execute_merge(loc, plan, spark, progress=progress)
