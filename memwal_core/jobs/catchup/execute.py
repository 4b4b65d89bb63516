"""Base-table index rebuild and the recorded `index_catchup` (spec "Base Table Index Builder").

For every base-table index except `__lance_mem_wal`, `optimize_indices(index_names=[name])`
adds the merged data to the index incrementally: `retrain=False` keeps the IVF centroids and
PQ/SQ codebooks (the spec requires a stable codebook once MemWAL is enabled), and leaving
`num_indices_to_merge` unset appends a delta segment. pylance 14 then records
`index_catchup[name][region] = merged_generations[region]` in that same commit by itself; this
module never writes catch-up, it reads the recorded progress back and reports it per index and
region next to the merged generation, the gap and the unindexed rows before and after.

Observed on pylance 14.0.2 (tests/test_catchup.py keeps these honest):
- `optimize_indices` on an index with nothing to add and catch-up already equal to merged
  commits nothing; with catch-up behind it commits (even with 0 unindexed rows, e.g. after a
  merge of an empty generation) and records catch-up.
- At commit time Lance (re)derives catch-up for *every* index that covers all fragments, not
  only the one optimized.
- `ds.index_statistics(name)["num_unindexed_rows"]` (same dict as `ds.stats.index_stats`).

Gating (`MemWalState.gating_indexes`): the indexes named in `maintained_indexes`, or all when
`maintain_all_indexes`, gate GC; a gating index missing from `index_catchup` (or a region
missing under it) is reported as not caught up. (The Rust docs say an index absent from the
list is "assumed caught up"; for GC memwal takes the safe reading.)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import lance

from memwal_core.errors import one_line
from memwal_core.state import lease, table
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.catchup")


@dataclass(frozen=True)
class RegionCatchup:
    """One index's progress in one region."""

    index_name: str
    region_id: str
    merged_generation: int
    caught_up_generation: int | None  # None: not recorded for this index / region

    @property
    def gap(self) -> int:
        """Merged generations the index does not cover yet."""
        return max(0, self.merged_generation - (self.caught_up_generation or 0))

    @property
    def caught_up(self) -> bool:
        if self.caught_up_generation is None:
            return self.merged_generation == 0
        return self.caught_up_generation >= self.merged_generation


def region_progress(state: table.MemWalState, index_name: str) -> list[RegionCatchup]:
    """Per merged region: merged vs caught-up generation of `index_name` in `state`."""
    recorded = state.catchup.get(index_name, {})
    return [RegionCatchup(index_name, rid, merged, recorded.get(rid))
            for rid, merged in sorted(state.merged.items())]


@dataclass
class IndexPlan:
    name: str
    index_type: str
    gating: bool  # its catch-up gates GC
    recorded: bool  # present in index_catchup
    unindexed_rows: int | None
    regions: list[RegionCatchup]
    optimize: bool
    reason: str

    @property
    def caught_up(self) -> bool:
        return all(r.caught_up for r in self.regions) and not self.unindexed_rows


@dataclass
class CatchupPlan:
    table_version: int
    merged: dict[str, int]
    gating_indexes: list[str]
    indexes: list[IndexPlan]
    missing_gating: list[str]  # gating names with no such index on the table

    @property
    def to_optimize(self) -> list[str]:
        return [i.name for i in self.indexes if i.optimize]


@dataclass(frozen=True)
class CatchupRow:
    """One row of the report: an index in a region."""

    index_name: str
    region_id: str
    gating: bool
    caught_up_generation: int | None
    merged_generation: int
    gap: int
    caught_up: bool
    unindexed_rows_before: int | None
    unindexed_rows_after: int | None


@dataclass
class IndexOutcome:
    name: str
    index_type: str
    gating: bool
    optimized: bool
    error: str | None
    unindexed_rows_before: int | None
    unindexed_rows_after: int | None
    regions: list[RegionCatchup]  # after

    @property
    def caught_up(self) -> bool:
        return self.error is None and all(r.caught_up for r in self.regions)


@dataclass
class CatchupResult:
    plan: CatchupPlan
    indexes: list[IndexOutcome]
    table_version: int  # latest version after the rebuilds
    duration_s: float
    missing_gating: list[str] = field(default_factory=list)

    @property
    def rows(self) -> list[CatchupRow]:
        out = []
        for o in self.indexes:
            for r in o.regions:
                out.append(CatchupRow(o.name, r.region_id, o.gating, r.caught_up_generation,
                                      r.merged_generation, r.gap, r.caught_up,
                                      o.unindexed_rows_before, o.unindexed_rows_after))
        return out

    @property
    def not_caught_up(self) -> list[tuple[str, str]]:
        """(index, region) pairs of gating indexes that still lag (GC must keep those gens)."""
        lag = [(r.index_name, r.region_id) for r in self.rows if r.gating and not r.caught_up]
        for name in self.missing_gating:
            lag.extend((name, rid) for rid in sorted(self.plan.merged))
        return lag

    @property
    def errors(self) -> dict[str, str]:
        return {o.name: o.error for o in self.indexes if o.error}


def base_indexes(ds: lance.LanceDataset) -> dict[str, str]:
    """Base-table index name -> type URL, without `__lance_mem_wal`."""
    return {d.name: d.type_url for d in ds.describe_indices() if d.name != table.MEMWAL_INDEX_NAME}


def unindexed_rows(ds: lance.LanceDataset, name: str) -> int | None:
    try:
        return int(ds.index_statistics(name)["num_unindexed_rows"])
    except Exception as e:  # noqa: BLE001 - a statistics failure must not stop the rebuild
        log.warning("index %s: statistics unavailable (%s)", name, e)
        return None


def _index_type(ds: lance.LanceDataset, name: str, type_url: str) -> str:
    try:
        return str(ds.index_statistics(name).get("index_type") or type_url)
    except Exception:  # noqa: BLE001
        return type_url


def plan_catchup(loc: TableLocation, index_names: list[str] | None = None) -> CatchupPlan:
    """What the rebuild will do: every base index (or `index_names`), behind or not, and why."""
    ds = table.open_dataset(loc)
    state = table.read_memwal_state(loc, ds.version)
    existing = base_indexes(ds)
    gating = state.gating_indexes(list(existing))
    names = sorted(existing) if index_names is None else list(index_names)
    unknown = [n for n in names if n not in existing]
    if unknown:
        raise table.TableError(f"table {loc.lance_uri} has no index named {', '.join(unknown)} "
                               f"(indexes: {', '.join(sorted(existing)) or 'none'})")
    plans = []
    for name in names:
        regions = region_progress(state, name)
        unindexed = unindexed_rows(ds, name)
        behind = [r for r in regions if not r.caught_up]
        if unindexed:
            reason = f"{unindexed} unindexed rows"
        elif behind:
            reason = (f"catch-up behind merge progress in {len(behind)} region(s)"
                      if name in state.catchup else "no index_catchup recorded yet")
        else:
            reason = "up to date"
        plans.append(IndexPlan(name, _index_type(ds, name, existing[name]), name in gating,
                               name in state.catchup, unindexed, regions,
                               optimize=bool(unindexed) or bool(behind) or unindexed is None,
                               reason=reason if unindexed is not None else "statistics unavailable"))
    missing = sorted(set(gating) - set(existing))
    for name in missing:
        log.warning("maintained index %s does not exist on table %s: counted as not caught up",
                    name, loc.lance_uri)
    return CatchupPlan(ds.version, state.merged, gating, plans, missing)


@lease.step("catchup")
def execute_catchup(loc: TableLocation, plan: CatchupPlan | None = None, *, retrain: bool = False,
                    num_indices_to_merge: int | None = None) -> CatchupResult:
    """Run `optimize_indices` for each planned index, then read the recorded catch-up back.

    One failing index is reported in its outcome and does not stop the others.
    """
    t0 = time.monotonic()
    plan = plan or plan_catchup(loc)
    kw: dict = {"retrain": retrain}
    if num_indices_to_merge is not None:
        kw["num_indices_to_merge"] = num_indices_to_merge
    pending: list[tuple[IndexPlan, bool, str | None, int | None]] = []
    for ip in plan.indexes:
        before = ip.unindexed_rows
        error = None
        optimize = ip.optimize
        if optimize:
            ds = table.open_dataset(loc)
            before = unindexed_rows(ds, ip.name)
            if before == 0 and all(r.caught_up for r in region_progress(
                    table.read_memwal_state(loc, ds.version), ip.name)):
                # An earlier rebuild's commit recorded this index too (Lance derives catch-up
                # for every index that covers all fragments): nothing left to do.
                log.info("index %s: caught up by an earlier commit, skipped", ip.name)
                optimize = False
        if optimize:
            try:
                lease.fence(loc, f"index {ip.name} catch-up")
                ds.optimize.optimize_indices(index_names=[ip.name], **kw)
                log.info("index %s optimized (%s)", ip.name, ip.reason)
            except Exception as e:  # noqa: BLE001
                error = one_line(e)
                log.warning("index %s: optimize_indices failed: %s", ip.name, error)
        pending.append((ip, optimize, error, before))

    ds = table.open_dataset(loc)
    state = table.read_memwal_state(loc, ds.version)
    outcomes = []
    for ip, optimized, error, before in pending:
        regions = region_progress(state, ip.name)
        outcomes.append(IndexOutcome(ip.name, ip.index_type, ip.gating, optimized and error is None,
                                     error, before, unindexed_rows(ds, ip.name), regions))
        lag = [r for r in regions if not r.caught_up]
        if lag and error is None:
            log.info("index %s still behind in %d region(s) (merges landed during the rebuild?)",
                     ip.name, len(lag))
    return CatchupResult(plan, outcomes, ds.version, time.monotonic() - t0,
                         missing_gating=list(plan.missing_gating))


@lease.step("catchup")
def run_catchup(loc: TableLocation, index_names: list[str] | None = None, **kw) -> CatchupResult:
    """Plan and execute in one call."""
    return execute_catchup(loc, plan_catchup(loc, index_names), **kw)
