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

Kept as aggregates, so that a pass costs the same however much history the retention holds:
- `settled`: the run of entries the last walk classified down to its hole, all kept as fence
  sentinels or entries of kept generations, with how many of each, their lowest generation and
  their highest writer epoch. While the region's limit stays below that lowest generation and the
  current epoch above that epoch (epochs never go back), the same rules keep every one of them
  again, so the walk counts them and goes on at the hole without classifying them one by one
  (`wal.py`). A walk that deleted, or met an unreadable entry, one without a generation or one of
  the current epoch, records none. It is derived from the rows it covers, which stay in the cache
  for the walk that does re-classify them (after the limit moved) without reading them again;
- the rows are decoded a column at a time and turned into entry metadata only when looked up;
  a cache that only gained entries above its rows is written by appending them to its text.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from memwal_core.errors import one_line
from memwal_core.jobs.gc import sealed
from memwal_core.state import layout, wal
from memwal_core.state.store import NotFound, ObjectInfo, ObjectStore

log = logging.getLogger("memwal.gc")

FORMAT = 1
MAX_MISSING = 1000  # deleted positions remembered (older ones are probed again: one read each)


@dataclass(frozen=True)
class Settled:
    """Positions `bottom + 1 .. top` exist and were all kept, as `sentinels` fence sentinels and
    `kept` entries of kept generations (the lowest `min_gen`, None: none), of writer epochs up to
    `max_epoch`; `bottom` is where the walk that classified them stopped (a hole, or 0)."""

    top: int
    bottom: int
    sentinels: int
    kept: int
    min_gen: int | None
    max_epoch: int

    def to_list(self) -> list:
        return [self.top, self.bottom, self.sentinels, self.kept, self.min_gen, self.max_epoch]

    @staticmethod
    def from_list(x: list) -> "Settled":
        top, bottom, sentinels, kept, min_gen, max_epoch = x
        if not (_nat(top) and _nat(bottom, 0) and bottom < top and _nat(sentinels, 0) and _nat(kept, 0)
                and sentinels + kept == top - bottom and (min_gen is None or _nat(min_gen))
                and (min_gen is None) == (kept == 0) and _nat(max_epoch, 0)):
            raise ValueError(f"a bad settled run {x!r}")
        return Settled(top, bottom, sentinels, kept, min_gen, max_epoch)


def _row(m: wal.WalEntryMeta) -> tuple:
    return (m.position, m.writer_epoch, m.generation, m.fence_sentinel, m.size)


class RegionCache:
    """Known WAL entries (position -> metadata) and deleted positions; known manifest versions at
    or below the retention cut (version -> (size, mtime)); the anchors that validate each part;
    the settled run of kept entries (module docstring)."""

    def __init__(self, region_id: str, wal: dict[int, wal.WalEntryMeta] | None = None,
                 missing: set[int] | None = None, wal_anchor: tuple[int, int, float] | None = None,
                 manifests: dict[int, tuple[int, float]] | None = None, settled: Settled | None = None):
        self.region_id = region_id
        self.rows: dict[int, tuple] = {p: _row(m) for p, m in (wal or {}).items()}  # position -> row
        self.missing = set(missing or ())
        self.wal_anchor = wal_anchor
        self.manifests = dict(manifests or {})
        self.settled = settled
        self._text: tuple[str, int, int] | None = None  # (rows' JSON text, how many, highest position)

    @property
    def wal(self) -> dict[int, wal.WalEntryMeta]:
        """Every known entry's metadata (built on each use: passes look entries up one by one)."""
        return {p: wal.WalEntryMeta(*r) for p, r in self.rows.items()}

    def meta(self, p: int) -> wal.WalEntryMeta | None:
        r = self.rows.get(p)
        return None if r is None else wal.WalEntryMeta(*r)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RegionCache):
            return NotImplemented
        return (self.region_id, self.rows, self.missing, self.wal_anchor, self.manifests, self.settled) == \
            (other.region_id, other.rows, other.missing, other.wal_anchor, other.manifests, other.settled)

    def _rows_text(self) -> str:
        """The rows as JSON, appended to the decoded text when the rows only gained higher ones."""
        t = self._text
        if t is not None and len(self.rows) >= t[1]:
            text, n, top = t
            new = sorted(p for p in self.rows if p > top)
            if len(self.rows) == n + len(new):
                more = [list(self.rows[p]) for p in new]
                if not more:
                    return text
                enc = json.dumps(more, separators=(",", ":"))
                return enc if text == "[]" else text[:-1] + "," + enc[1:]
        return json.dumps([list(r) for _, r in sorted(self.rows.items())], separators=(",", ":"))

    def encode(self) -> bytes:
        rest = json.dumps({
            "region": self.region_id, "missing": sorted(self.missing),
            "wal_anchor": list(self.wal_anchor) if self.wal_anchor else None,
            "manifests": [[v, s, t] for v, (s, t) in sorted(self.manifests.items())],
            "settled": self.settled.to_list() if self.settled is not None else None,
        }, sort_keys=True, separators=(",", ":"))
        return sealed.seal_body(rest[:-1] + ',"wal":' + self._rows_text() + "}", FORMAT)

    @staticmethod
    def decode(raw: bytes, region_id: str) -> "RegionCache":
        body = sealed.unseal_body(raw, FORMAT)
        d = json.loads(body)
        if not isinstance(d, dict):
            raise ValueError("not a region cache")
        if d["region"] != region_id:
            raise ValueError(f"written for region {d['region']!r}")
        out = RegionCache(region_id)
        rows = d["wal"]
        if not (isinstance(rows, list) and all(type(r) is list and len(r) == 5 for r in rows)):
            raise ValueError("a bad WAL row")
        ps, epochs, gens, sentinels, sizes = map(list, zip(*rows)) if rows else ([], [], [], [], [])
        if not ({type(x) for x in ps} <= {int} and {type(x) for x in epochs} <= {int}
                and {type(x) for x in gens} <= {int, type(None)} and {type(x) for x in sentinels} <= {bool}
                and {type(x) for x in sizes} <= {int}):
            raise ValueError("a bad WAL row")
        if rows and (min(ps) < 1 or min(epochs) < 0 or min(sizes) < 0 or len(set(ps)) != len(ps)):
            raise ValueError("a bad WAL row")
        out.rows = dict(zip(ps, map(tuple, rows)))
        wi = body.rfind(',"wal":')  # the text of the rows, for the next cache to append to
        if wi > 0 and body.endswith("]}") and ps == sorted(ps):
            out._text = (body[wi + len(',"wal":'):-1], len(ps), max(ps, default=0))
        if not all(_nat(p) for p in d["missing"]):
            raise ValueError("a bad missing position")
        out.missing = set(d["missing"]) - set(out.rows)
        a = d["wal_anchor"]
        if a is not None:
            if not (_nat(a[0]) and _nat(a[1], 0) and isinstance(a[2], (int, float)) and a[0] in out.rows):
                raise ValueError("a bad WAL anchor")
            out.wal_anchor = (a[0], a[1], float(a[2]))
        elif out.rows:
            raise ValueError("WAL entries without an anchor")
        for v, size, mtime in d["manifests"]:
            if not (_nat(v) and _nat(size, 0) and isinstance(mtime, (int, float))):
                raise ValueError("a bad manifest row")
            out.manifests[v] = (size, float(mtime))
        st = d.get("settled")  # absent in caches written before it was kept
        if st is not None:
            out.settled = Settled.from_list(st)
            if out.settled.top not in out.rows:
                raise ValueError("a settled run above the known entries")
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
        if c is None or (p not in c.rows and p not in c.missing) or not self.wal_ok():
            return False, None
        return True, c.meta(p)

    def settled(self) -> Settled | None:
        """The settled run of the last walk, when the WAL part holds."""
        c = self.cache
        return c.settled if c is not None and c.settled is not None and self.wal_ok() else None

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
               manifests: dict[int, ObjectInfo], manifests_deleted: set[int],
               settled: Settled | None = None) -> RegionCache:
    """The cache as the region will be once this pass's deletes went: the entries known to exist
    (the old cache's, when its anchor holds, and those read) minus the deleted, the positions
    known missing, the manifest versions given (the lowest at or below the cut that stays)
    minus the deleted, and the walk's settled run (`settled`, of entries none of which is deleted)."""
    old = checked.cache
    keep_old = old is not None and old.wal_anchor is not None and checked.wal_ok()
    out = RegionCache(region_id)
    known = dict(old.rows) if keep_old else {}
    missing = set(old.missing) if keep_old else set()
    appended = keep_old  # only rows above the old ones added: its text is appended to
    top = max(old.rows, default=0) if keep_old else 0
    for p, m in metas.items():
        if m is None:
            missing.add(p)
            appended = appended and p not in known
            known.pop(p, None)
        elif m.writer_epoch >= 0:  # an unreadable entry is read again next time
            r = _row(m)
            appended = appended and (p > top or known.get(p) == r)
            known[p] = r
    for p in wal_deleted:
        appended = appended and p not in known
        known.pop(p, None)
        missing.add(p)
    missing = {p for p in missing if p not in known}
    out.rows, out.missing = known, set(sorted(missing)[-MAX_MISSING:])
    if appended and old._text is not None and len(old.rows) == old._text[1]:
        out._text = old._text
    if known:
        low = min(known)
        if keep_old and old.wal_anchor[0] == low:
            out.wal_anchor = old.wal_anchor
        else:
            info = checked.store.head(layout.wal_key(region_id, low))
            if info is None:  # gone since it was read: know nothing of the WAL
                out.rows, out.missing, out._text = {}, set(), None
            else:
                out.wal_anchor = (low, info.size, info.mtime)
    if out.rows and settled is not None and settled.top in out.rows \
            and not any(settled.bottom < p <= settled.top for p in wal_deleted):
        out.settled = settled
    out.manifests = {v: (i.size, i.mtime) for v, i in manifests.items() if v not in manifests_deleted}
    return out
