"""Which region manifest versions GC deletes (rule 3 of the package docstring): below the newest
`manifest_retention` and older than `manifest_min_age_seconds`, a prefix only (the versions left
stay contiguous up to the latest), never the latest."""

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
    existing: dict[int, ObjectInfo] = field(default_factory=dict)  # the versions at or below the cut found


def _candidates(loc: TableLocation, rid: str, first_candidate: int, leftover_scan: bool,
                cache: region_cache.Checked | None = None) -> list[tuple[int, ObjectInfo]]:
    """The versions at or below `first_candidate` that exist, oldest first: probed down to the
    first missing one (earlier runs deleted from there down) and, for a region whose last delete
    may have left survivors below that hole, one listing of the (small: retained and young
    versions) manifest directory. Versions `cache` knows are not probed again."""
    store = loc.store
    existing: list[tuple[int, ObjectInfo]] = []
    v = first_candidate
    while v >= 1:
        info = (cache.manifest_info(v) if cache is not None else None) or store.head(layout.manifest_key(rid, v))
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


def plan_manifests(loc: TableLocation, m: region.RegionManifest, config: GcOptions, now: float, *,
                   leftover_scan: bool, cache: region_cache.Checked | None = None) -> ManifestPlan:
    rid, latest = m.region_id, m.version
    out = ManifestPlan(hint=region.read_version_hint(loc.store, rid))
    first_candidate = latest - config.manifest_retention
    out.kept[KeepReason.MANIFEST_LATEST] += 1
    out.kept[KeepReason.MANIFEST_RETENTION_COUNT] += min(config.manifest_retention, latest) - 1
    existing = _candidates(loc, rid, first_candidate, leftover_scan, cache)
    out.existing = dict(existing)
    lowest_kept = latest
    for i, (v, info) in enumerate(existing):
        age = now - info.mtime
        if age < config.manifest_min_age_seconds:
            out.kept[KeepReason.MANIFEST_YOUNG] += len(existing) - i
            lowest_kept = v
            break
        out.items.append(GcItem(MANIFEST, rid, info.key, info.size,
                                f"version {v} < latest {latest} - {config.manifest_retention}, {age:.0f}s old",
                                (info.key,), v))
    else:
        lowest_kept = max(1, first_candidate + 1)
    out.lowest_kept_version = min(lowest_kept, latest)
    return out
