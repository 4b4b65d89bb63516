"""What GC learned of one region's WAL entries and old manifest versions, kept for the next pass.

A GC pass walks a region's WAL down from the covered position, reading every entry's metadata,
and probes its manifest versions down from the retention cut, until the first missing one. While
retained base versions hold the generations (a week with the shipped retention), nothing there
is deleted and every pass would read the same entries again. WAL entries and manifest versions
are immutable (written once, put-if-absent), and only GC deletes them, so a pass keeps what it
learned in `_memwal/gc_regions/{region}.json`: the metadata of the entries it saw that stay, the
positions it deleted, and the size and time of the lowest manifest version at or below the
retention cut that stays (versions go oldest first and stay contiguous up to the latest, so the
next pass walks up from it: `manifests.py`).

It is a pure cache, used only where it is checked:
- it is written before the region's deletes, as the state after them, and GC's intent marker
  (`gc_pending`, written before it, removed once every delete went) makes the next pass ignore it
  while a delete may have failed part-way; a region planned with its marker present is planned
  without the cache, as is a region whose cache is missing, garbled or has a bad checksum;
- the WAL part is used only while the entry at its lowest known position still has the size and
  modification time recorded (HEAD), the manifest part only while its lowest version does: a region
  re-created under the same id, or a GC run elsewhere that deleted what the cache says stays,
  changes or removes exactly those objects first (deletes go lowest first);
- an entry it lists is taken to exist: if another process deleted it, the walk continues below
  where a full read would stop at the hole, and classifies entries by the same rules (a hole only
  ends the walk early, it never makes an entry deletable), and a planned delete of a missing key
  deletes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from memwal_core.errors import one_line
from memwal_core.jobs.gc import sealed
from memwal_core.state import layout, wal
from memwal_core.state.store import NotFound, ObjectInfo, ObjectStore

log = logging.getLogger("memwal.gc")

FORMAT = 1
MAX_MISSING = 1000  # deleted positions remembered (older ones are probed again: one read each)


@dataclass
class RegionCache:
    """Known WAL entries (position -> metadata) and deleted positions; known manifest versions at
    or below the retention cut (version -> (size, mtime)); the anchors that validate each part."""

    region_id: str
    wal: dict[int, wal.WalEntryMeta] = field(default_factory=dict)
    missing: set[int] = field(default_factory=set)
    wal_anchor: tuple[int, int, float] | None = None  # (position, size, mtime) of the lowest known entry
    manifests: dict[int, tuple[int, float]] = field(default_factory=dict)

    def encode(self) -> bytes:
        return sealed.seal({
            "region": self.region_id,
            "wal": [[m.position, m.writer_epoch, m.generation, m.fence_sentinel, m.size]
                    for _, m in sorted(self.wal.items())],
            "missing": sorted(self.missing), "wal_anchor": list(self.wal_anchor) if self.wal_anchor else None,
            "manifests": [[v, s, t] for v, (s, t) in sorted(self.manifests.items())],
        }, FORMAT)

    @staticmethod
    def decode(raw: bytes, region_id: str) -> "RegionCache":
        d = sealed.unseal(raw, FORMAT)
        if d["region"] != region_id:
            raise ValueError(f"written for region {d['region']!r}")
        out = RegionCache(region_id)
        for p, epoch, gen, sentinel, size in d["wal"]:
            if not (_nat(p) and type(epoch) is int and epoch >= 0 and (gen is None or type(gen) is int)
                    and type(sentinel) is bool and _nat(size, 0)):
                raise ValueError(f"a bad WAL row {[p, epoch, gen, sentinel, size]!r}")
            out.wal[p] = wal.WalEntryMeta(p, epoch, gen, sentinel, size)
        if not all(_nat(p) for p in d["missing"]):
            raise ValueError("a bad missing position")
        out.missing = set(d["missing"]) - set(out.wal)
        a = d["wal_anchor"]
        if a is not None:
            if not (_nat(a[0]) and _nat(a[1], 0) and isinstance(a[2], (int, float)) and a[0] in out.wal):
                raise ValueError("a bad WAL anchor")
            out.wal_anchor = (a[0], a[1], float(a[2]))
        elif out.wal:
            raise ValueError("WAL entries without an anchor")
        for v, size, mtime in d["manifests"]:
            if not (_nat(v) and _nat(size, 0) and isinstance(mtime, (int, float))):
                raise ValueError("a bad manifest row")
            out.manifests[v] = (size, float(mtime))
        return out


def _nat(x, least: int = 1) -> bool:
    return type(x) is int and x >= least


def load(store: ObjectStore, region_id: str) -> RegionCache | None:
    """The region's cache, or None (missing, unreadable, garbled: the region is read in full)."""
    key = layout.gc_region_cache_key(region_id)
    try:
        raw = store.get(key)
    except NotFound:
        return None
    except Exception as e:  # noqa: BLE001 - a cache
        log.warning("%s could not be read (%s); reading the region in full", key, one_line(e))
        return None
    try:
        return RegionCache.decode(raw, region_id)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        log.warning("%s ignored (%s); reading the region in full", key, e)
        return None


def save(store: ObjectStore, cache: RegionCache) -> bool:
    """Write the cache; on failure remove the old one (it may describe entries about to go)."""
    key = layout.gc_region_cache_key(cache.region_id)
    try:
        store.put(key, cache.encode())
        return True
    except Exception as e:  # noqa: BLE001 - a cache
        log.warning("could not write %s (%s); removing it", key, one_line(e))
        try:
            store.delete_many([key])
        except Exception as e2:  # noqa: BLE001
            log.warning("could not remove %s either (%s)", key, one_line(e2))
        return False


class Checked:
    """A region's cache as one pass uses it: each part checked against its anchor on first use."""

    def __init__(self, store: ObjectStore, cache: RegionCache | None):
        self.store, self.cache = store, cache
        self._wal_ok: bool | None = None if cache is not None and cache.wal_anchor else False

    def wal_ok(self) -> bool:
        if self._wal_ok is None:
            p, size, mtime = self.cache.wal_anchor
            self._wal_ok = _same(self.store.head(layout.wal_key(self.cache.region_id, p)), size, mtime)
        return self._wal_ok

    def wal_meta(self, p: int) -> tuple[bool, wal.WalEntryMeta | None]:
        """(known, metadata or None for a deleted position)."""
        c = self.cache
        if c is None or (p not in c.wal and p not in c.missing) or not self.wal_ok():
            return False, None
        return True, c.wal.get(p)

    def manifest_low(self) -> tuple[int, ObjectInfo] | None:
        """The lowest manifest version the cache knows, as a HEAD shows it now, when that is the
        object it recorded (None: not known, or another object: walk the versions down)."""
        c = self.cache
        if c is None or not c.manifests:
            return None
        low = min(c.manifests)
        info = self.store.head(layout.manifest_key(c.region_id, low))
        return (low, info) if _same(info, *c.manifests[low]) else None


def _same(info: ObjectInfo | None, size: int, mtime: float) -> bool:
    return info is not None and info.size == size and info.mtime == mtime


def after_pass(checked: Checked, region_id: str, metas: dict[int, wal.WalEntryMeta | None], wal_deleted: set[int],
               manifests: dict[int, ObjectInfo], manifests_deleted: set[int]) -> RegionCache:
    """The cache as the region will be once this pass's deletes went: the entries known to exist
    (the old cache's, when its anchor holds, and those read) minus the deleted, the positions
    known missing, and the manifest versions given (the lowest at or below the cut that stays)
    minus the deleted."""
    old = checked.cache
    keep_old = old is not None and old.wal_anchor is not None and checked.wal_ok()
    known = dict(old.wal) if keep_old else {}
    missing = set(old.missing) if keep_old else set()
    for p, m in metas.items():
        if m is None:
            missing.add(p)
            known.pop(p, None)
        elif m.writer_epoch >= 0:  # an unreadable entry is read again next time
            known[p] = m
    for p in wal_deleted:
        known.pop(p, None)
        missing.add(p)
    missing -= set(known)
    out = RegionCache(region_id, known, set(sorted(missing)[-MAX_MISSING:]))
    if known:
        low = min(known)
        if keep_old and old.wal_anchor[0] == low:
            out.wal_anchor = old.wal_anchor
        else:
            info = checked.store.head(layout.wal_key(region_id, low))
            if info is None:  # gone since it was read: know nothing of the WAL
                out.wal, out.missing = {}, set()
            else:
                out.wal_anchor = (low, info.size, info.mtime)
    out.manifests = {v: (i.size, i.mtime) for v, i in manifests.items() if v not in manifests_deleted}
    return out
