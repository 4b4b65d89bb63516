"""Per-region lag: what is flushed, what is merged, what is pending and how old it is.

This is what users watch (`memwal status`, Dagster metadata and checks): merge lag as the age
of the oldest pending generation (its flush time is the mtime of the generation's own Lance
manifest: one HEAD per region), pending rows and bytes, and each index's catch-up gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from memwal_core.state import layout, lifecycle, region, walls
from memwal_core.state.store import SymlinkRefused, TableLocation
from memwal_core.state.table import MemWalState, open_dataset, read_memwal_state

# A generation directory is a Lance dataset; its first (and, for pylance, only) version.
_GEN_MANIFEST = "_versions/18446744073709551614.manifest"


@dataclass
class RegionStatus:
    region_id: str
    manifest_version: int = 0
    writer_epoch: int = 0
    current_generation: int = 0
    flushed_generations: list[int] = field(default_factory=list)
    merged_generation: int = 0
    pending_generations: list[int] = field(default_factory=list)
    pending_rows: int = 0
    pending_bytes: int = 0
    oldest_pending_age_s: float | None = None
    error: str | None = None
    wall: int | None = None  # stuck behind this generation: a permanent wall the merger recorded
    stale_through: int | None = None  # data from before the MemWAL initialization up to here (lifecycle)


@dataclass
class IndexStatus:
    name: str
    caught_up: dict[str, int]
    gating: bool
    max_gap: int  # largest (merged - caught up) over regions


@dataclass
class TableStatus:
    table: str
    table_version: int
    regions: list[RegionStatus]
    indexes: list[IndexStatus]
    skipped_dirs: list[tuple[str, str]] = field(default_factory=list)

    @property
    def pending_generations(self) -> int:
        return sum(len(r.pending_generations) for r in self.regions)

    @property
    def oldest_pending_age_s(self) -> float | None:
        ages = [r.oldest_pending_age_s for r in self.regions if r.oldest_pending_age_s is not None]
        return max(ages) if ages else None

    @property
    def region_errors(self) -> dict[str, str]:
        """Regions whose manifest cannot be read or is malformed: region id -> why."""
        return {r.region_id: r.error for r in self.regions if r.error}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pending_generations"] = self.pending_generations
        d["oldest_pending_age_s"] = self.oldest_pending_age_s
        return d


def generation_flush_time(loc: TableLocation, region_id: str, gen: region.Generation) -> float | None:
    info = loc.store.head(f"{layout.generation_dir(region_id, gen.path, gen.generation)}/{_GEN_MANIFEST}")
    return info.mtime if info else None


def region_status(loc: TableLocation, m: region.RegionManifest, merged: int, now: float | None = None,
                  with_age: bool = True, spec_ids: list[int] | None = None) -> RegionStatus:
    pending = [g for g in m.generations if g.generation > merged]
    st = RegionStatus(m.region_id, m.version, m.writer_epoch, m.current_generation,
                      [g.generation for g in m.generations], merged, [g.generation for g in pending],
                      sum(g.physical_rows for g in pending), sum(g.in_memory_bytes for g in pending))
    try:  # what the merger refuses and GC leaves alone (e.g. a reset region) is an error here too
        if spec_ids is not None:
            region.check_spec(m, spec_ids)
        region.pending_generations(m, merged)
    except region.CorruptManifest as e:
        st.error = str(e)
        return st
    if pending and with_age:
        try:
            t = generation_flush_time(loc, m.region_id, pending[0])
        except layout.UnsafePath as e:
            st.error = f"region {m.region_id}: {e}"
            return st
        except SymlinkRefused as e:  # a linked generation directory: refused, never followed
            st.error = f"region {m.region_id}: {e}"
            return st
        st.oldest_pending_age_s = max(0.0, (now or time.time()) - t) if t else None
    return st


def table_status(loc: TableLocation, state: MemWalState | None = None, *, with_age: bool = True) -> TableStatus:
    ds = open_dataset(loc)
    state = state or read_memwal_state(loc, ds.version)
    listing = region.list_regions(loc.store)
    loaded = region.load_many(loc.store, listing.region_ids)
    merged = state.merged
    now = time.time()
    regions = []
    stuck = walls.read_all(loc.store)
    stale = lifecycle.assess(loc, loaded.manifests, current_version=state.table_version, record=False)
    for rid in sorted(loaded):
        got = loaded[rid]
        if got.ok:
            regions.append(region_status(loc, got.manifest, merged.get(rid, 0), now, with_age,
                                         [s.spec_id for s in state.details.region_specs]))
            _stale_status(regions[-1], stale)
        else:
            regions.append(RegionStatus(rid, merged_generation=merged.get(rid, 0), error=got.message))
        st, rec = regions[-1], stuck.get(rid)
        # A record counts while its generation still waits (the merger deletes it once merged
        # past; this also ignores one left behind by a merger that died before deleting it).
        if rec is not None and rec.generation > st.merged_generation and (st.pending_generations or st.error):
            st.wall = rec.generation
            st.error = st.error or f"stuck at generation {rec.generation} (merge refusal): {rec.reason}"
    existing = [i["name"] for i in ds.list_indices()]
    gating = set(state.gating_indexes(existing))
    catchup = state.catchup
    indexes = []
    for name in sorted(set(existing) | gating):
        if name == "__lance_mem_wal":
            continue
        caught = catchup.get(name, {})
        gap = max([merged.get(rid, 0) - caught.get(rid, 0) for rid in merged] or [0])
        indexes.append(IndexStatus(name, dict(caught), name in gating, max(0, gap)))
    return TableStatus(loc.lance_uri, state.table_version, regions, indexes, listing.skipped)


def _stale_status(st: RegionStatus, lc: lifecycle.Lifecycle) -> None:
    """A region with data from before the MemWAL initialization: an error with the repair
    (what the merger refuses and GC keeps), the stale generations not counted as lag."""
    v = lc.verdict(st.region_id)
    if st.region_id in lc.errors:
        st.error = lc.errors[st.region_id]
    if v is None or not lc.blocks(st.region_id, st.merged_generation):
        return
    st.stale_through = v.stale_through if not v.open else (st.current_generation - 1)
    st.error = lc.message(st.region_id, st.merged_generation, st.flushed_generations)
    st.oldest_pending_age_s = None


@dataclass(frozen=True)
class RegionObservation:
    """One look at a region (what a sensor tick needs): its latest manifest version and, when
    that moved past the version the watcher knew, the manifest and its status; or why the
    region could not be observed (`error`, naming the region; the others are unaffected)."""

    region_id: str
    version: int = 0                               # latest manifest version found (0: unknown)
    manifest: region.RegionManifest | None = None  # read only when the version moved
    status: RegionStatus | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def changed(self) -> bool:
        """The version moved and the manifest at it was read."""
        return self.manifest is not None


def observe_regions(loc: TableLocation, known: Mapping[str, int | None], merged: Callable[[], Mapping[str, int]], *,
                    verify: Collection[str] = (), max_workers: int = 16) -> dict[str, RegionObservation]:
    """Observe the regions of `known` (region -> the manifest version the caller saw last; None:
    never seen), cheaply: one HEAD per unchanged region.

    A region seen before is probed from its known version + 1 (that version is taken to
    exist); a region never seen, or one in `verify`, is probed from its version hint instead
    (`region.verified_latest_version`), since a remembered version may have been collected by
    GC meanwhile. Regions whose version moved are read at the version found and get a
    `RegionStatus`; `merged()` (merge progress per region) is called once, and only then.
    """
    rids = list(known)
    if not rids:
        return {}
    workers = max(1, min(max_workers, len(rids)))

    def probe(rid: str) -> RegionObservation:
        seen = known[rid]
        try:
            if seen is None or rid in verify:
                v = region.verified_latest_version(loc.store, rid, seen or 0)
            else:
                v = region.probe_latest_version(loc.store, rid, seen, start_exists=True)
        except Exception as e:  # noqa: BLE001 - one broken region must not stop the others
            return RegionObservation(rid, error=str(region.as_region_error(rid, e)))
        return RegionObservation(rid, v)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        out = {o.region_id: o for o in pool.map(probe, rids)}
    moved = sorted(rid for rid, o in out.items() if o.ok and o.version != known[rid])
    if not moved:
        return out
    progress = merged()

    def read(rid: str) -> RegionObservation:
        v = out[rid].version
        try:
            m = region.load_version(loc.store, rid, v)
            return RegionObservation(rid, v, m, region_status(loc, m, progress.get(rid, 0)))
        except Exception as e:  # noqa: BLE001 - reported, the others proceed
            return RegionObservation(rid, v, error=str(region.as_region_error(rid, e)))

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(moved)))) as pool:
        out.update((o.region_id, o) for o in pool.map(read, moved))
    return out
