"""Correct LSM reads of a MemWAL table through pylance.

pylance's LSM readers do not skip merged generations: a listed generation always beats the
base table, and a listed generation whose directory is gone is an error. So a reader must list
only generations newer than `merged_generations[region]`, read fresh; this module does that.
"""

from __future__ import annotations

import pyarrow as pa

from memwal_core.state import layout, lifecycle, region
from memwal_core.state.lance_mem_wal import lsm_read, region_snapshot
from memwal_core.state.store import TableLocation
from memwal_core.state.table import MemWalState, open_dataset, read_memwal_state


def _checked(region_id: str, g: region.Generation) -> str:
    layout.generation_dir(region_id, g.path, g.generation)  # raises UnsafePath naming the region
    return g.path


def pending_snapshots(state: MemWalState, manifests: dict[str, region.RegionManifest]) -> list:
    """One pylance snapshot per region, listing only its generations newer than merged."""
    merged = state.merged
    snaps = []
    for rid, m in sorted(manifests.items()):
        gens = [(g.generation, _checked(rid, g))
                for g in m.generations if g.generation > merged.get(rid, 0)]
        snaps.append(region_snapshot(rid, m.current_generation, gens, m.message.region_spec_id))
    return snaps


def lsm_table(loc: TableLocation) -> pa.Table:
    """The table as a reader should see it: base table plus every unmerged flushed generation,
    except generations written before the MemWAL initialization (`state/lifecycle.py`: rows an
    overwrite replaced).

    The table version is pinned first and manifests read after it, so a merge landing in
    between can only make a generation appear in both (harmless) and never in neither.
    """
    ds = open_dataset(loc)
    state = read_memwal_state(loc, ds.version)
    loaded = region.load_many(loc.store, region.list_regions(loc.store).region_ids)
    for got in loaded.values():
        if got.error is not None:
            raise got.error
    stale = lifecycle.assess(loc, loaded.manifests, current_version=ds.version, record=False)
    for rid, why in sorted(stale.errors.items()):  # unknown whether its generations are stale
        raise region.RegionError(rid, why.removeprefix(f"region {rid}: "))
    manifests = {rid: lifecycle.without_stale(m, stale.verdict(rid)) for rid, m in loaded.manifests.items()}
    return lsm_read(ds, pending_snapshots(state, manifests))
