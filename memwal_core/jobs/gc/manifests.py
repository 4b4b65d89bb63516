"""Which region manifest versions GC deletes (rule 3 of the package docstring): below the newest
`manifest_retention` and older than `manifest_min_age_seconds`, a prefix only (the versions left
stay contiguous up to the latest), never the latest.

The candidates are found by walking down from the retention cut to the first missing version;
a pass that knows the lowest version left (`region_cache.py`, checked by a HEAD) walks up from
it instead, only as far as the first version young enough to stay: the versions above it up to
the cut exist (the rest is contiguous) and are counted as young without being read (a version
is written after the one below it, so it is not older). Either way a version is deleted only
after its own age was read, and a missing version on the way up makes the pass walk down."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from memwal_core.jobs.gc import region_cache
from memwal_core.jobs.gc.holds import KeepReason
from memwal_core.jobs.gc.items import MANIFEST, GcItem
from memwal_core.jobs.gc.listing import list_dir
from memwal_core.options import GcOptions
from memwal_core.state import layout, region
from memwal_core.state.store import ObjectInfo, TableLocation


@dataclass
class ManifestPlan:
    """One region's manifest versions to delete (oldest first), what is kept and why, the
    `version_hint.json` as read and the lowest version that stays."""

    hint: int | None = None
    lowest_kept_version: int = 0
    items: list[GcItem] = field(default_factory=list)
    kept: collections.Counter[KeepReason] = field(default_factory=collections.Counter)
    # The lowest version at or below the cut that stays (what the next pass walks up from).
    kept_low: dict[int, ObjectInfo] = field(default_factory=dict)


def _candidates(loc: TableLocation, rid: str, first_candidate: int,
                leftover_scan: bool) -> list[tuple[int, ObjectInfo]]:
    """The versions at or below `first_candidate` that exist, oldest first: probed down to the
    first missing one (earlier runs deleted from there down) and, for a region whose last delete
    may have left survivors below that hole, one listing of the (small: retained and young
    versions) manifest directory."""
    store = loc.store
    existing: list[tuple[int, ObjectInfo]] = []
    v = first_candidate
    while v >= 1:
        info = store.head(layout.manifest_key(rid, v))
        if info is None:
            break  # a hole: earlier runs deleted from here down
        existing.append((v, info))
        v -= 1
    if v > 1 and leftover_scan:
        mdir = layout.manifest_dir(rid)
        for o in list_dir(loc, mdir, layout.region_dir(rid)):
            name = o.key.rsplit("/", 1)[-1]
            n = layout.parse_bitrev(name[: -len(layout.MANIFEST_SUFFIX)]) \
                if name.endswith(layout.MANIFEST_SUFFIX) else None
            if n and n < v:
                existing.append((n, o))
        existing.sort(key=lambda x: -x[0])
    existing.reverse()  # oldest first: delete a prefix only, so the rest stays contiguous
    return existing


def _walk_up(loc: TableLocation, rid: str, low: tuple[int, ObjectInfo], first_candidate: int, now: float,
             min_age: float) -> list[tuple[int, ObjectInfo]] | None:
    """From the lowest version left up to the first one young enough to stay (or the cut),
    oldest first; None: a version on the way is missing (not the contiguous run the cache says)."""
    v, info = low
    out = [low]
    while now - info.mtime >= min_age and v < first_candidate:
        v += 1
        info = loc.store.head(layout.manifest_key(rid, v))
        if info is None:
            return None
        out.append((v, info))
    return out


def plan_manifests(loc: TableLocation, m: region.RegionManifest, config: GcOptions, now: float, *,
                   leftover_scan: bool, cache: region_cache.Checked | None = None) -> ManifestPlan:
    rid, latest = m.region_id, m.version
    out = ManifestPlan(hint=region.read_version_hint(loc.store, rid))
    first_candidate = latest - config.manifest_retention
    out.kept[KeepReason.MANIFEST_LATEST] += 1
    out.kept[KeepReason.MANIFEST_RETENTION_COUNT] += min(config.manifest_retention, latest) - 1
    low = cache.manifest_low() if cache is not None and not leftover_scan else None
    walked = None
    if low is not None:  # nothing at or below the cut when the lowest version left is above it
        walked = [] if low[0] > first_candidate else _walk_up(loc, rid, low, first_candidate, now,
                                                              config.manifest_min_age_seconds)
    existing = walked if walked is not None else _candidates(loc, rid, first_candidate, leftover_scan)
    lowest_kept = latest
    for i, (v, info) in enumerate(existing):
        age = now - info.mtime
        if age < config.manifest_min_age_seconds:  # walked up: the versions above it to the cut exist
            out.kept[KeepReason.MANIFEST_YOUNG] += first_candidate - v + 1 if walked is not None else len(existing) - i
            out.kept_low = {v: info}
            lowest_kept = v
            break
        out.items.append(GcItem(MANIFEST, rid, info.key, info.size,
                                f"version {v} < latest {latest} - {config.manifest_retention}, {age:.0f}s old",
                                (info.key,), v))
    else:
        lowest_kept = max(1, first_candidate + 1)
    out.lowest_kept_version = min(lowest_kept, latest)
    return out
