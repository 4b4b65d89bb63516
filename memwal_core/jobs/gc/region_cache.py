"""What GC learned of one region's WAL entries, old manifest versions and listed generations, and
when it last swept the region for orphans, kept for the next pass.

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
- the rows of settled runs (at or below `cold_top`) stay the JSON text they were read as, checked
  without decoding (as many rows as recorded, the last at or below the top), until one of them is
  looked up (the walk re-classifies the run; the bisection for the current epoch starts above a
  run whose epochs are all older); the rows that join a settled run are appended to that text.
  Rows that turn out not to be the ones recorded make the pass know nothing of the WAL.

- `epoch_run`: the first position of the current writer epoch's run, as the last pass found it
  (by bisection), with that epoch. GC keeps the current epoch's entries (by default), and a
  long-lived writer's run grows with every flush: the run's entries above its first are not
  remembered (each would be a row read on every pass), and the next pass takes the run from its
  first position while the cache holds that entry with that epoch and the writer's epoch is
  still it (epochs never go back along the WAL: every entry from there to the cut is of it).

Two more parts, each safe on its own terms:
- `gens`: the chunks of the region manifest's generation list already validated (`listed.py`).
  They are content-addressed (a digest of the manifest's bytes), so no anchor is needed: a
  chunk whose bytes are not in the manifest any more matches nothing, and its records are
  validated again;
- `orphans_at`: when the last pass planned the region's orphan sweep. The next sweep is due a
  `full_scan_interval_seconds` later (a clock that went back, or no cache: at once). A sweep only
  ever takes an orphan older than `orphan_grace_seconds`, so a time that is wrong, or a sweep
  that did not finish, only keeps an orphan up to an interval longer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from memwal_core.errors import one_line
from memwal_core.jobs.gc.listed import CHUNK, Chunk
from memwal_core.state import layout, sealed, wal
from memwal_core.state.store import NotFound, ObjectInfo, ObjectStore

log = logging.getLogger("memwal.gc")

FORMAT = 2  # 1: the settled rows' text inside the JSON (escaped again on every write)
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
    the settled run of kept entries (module docstring). The rows at or below `cold_top` (those
    of settled runs) stay the JSON text they were read as until one of them is looked up."""

    def __init__(self, region_id: str, wal: dict[int, wal.WalEntryMeta] | None = None,
                 missing: set[int] | None = None, wal_anchor: tuple[int, int, float] | None = None,
                 manifests: dict[int, tuple[int, float]] | None = None, settled: Settled | None = None):
        self.region_id = region_id
        self._rows: dict[int, tuple] = {p: _row(m) for p, m in (wal or {}).items()}  # position -> row
        self.missing = set(missing or ())
        self.wal_anchor = wal_anchor
        self.manifests = dict(manifests or {})
        self.settled = settled
        self.cold_top = 0  # the rows at or below it are the text's (and those that joined it since)
        self._cold: str | None = None  # the text, while not decoded into `_rows`
        self._cold_n = 0  # how many rows the text holds
        self._cold_below = 0  # every row of the text is at or below it; those that join are above
        self.gens: dict[int, Chunk] = {}  # first generation -> chunk of the checked list (`listed.py`)
        self.orphans_at: float | None = None  # when the last orphan sweep was planned
        self.epoch_run: tuple[int, int] | None = None  # (first position, epoch) of the current epoch's run

    @property
    def rows(self) -> dict[int, tuple]:
        """Every known entry's row (the text decoded first)."""
        if self._cold is not None:
            rows = _decode_rows(json.loads(self._cold))
            if len(rows) != self._cold_n or any(p > self._cold_below for p in rows):
                raise ValueError("settled rows that are not the ones recorded")
            self._cold = None
            rows.update(self._rows)
            self._rows = rows
        return self._rows

    @rows.setter
    def rows(self, rows: dict[int, tuple]) -> None:
        self._rows, self._cold, self.cold_top, self._cold_n, self._cold_below = rows, None, 0, 0, 0

    def known(self, p: int) -> bool:
        return p in self.missing or p in (self.rows if p <= self._cold_below else self._rows)

    def meta(self, p: int) -> wal.WalEntryMeta | None:
        r = (self.rows if p <= self._cold_below else self._rows).get(p)
        return None if r is None else wal.WalEntryMeta(*r)

    @property
    def wal(self) -> dict[int, wal.WalEntryMeta]:
        """Every known entry's metadata (built on each use: passes look entries up one by one)."""
        return {p: wal.WalEntryMeta(*r) for p, r in self.rows.items()}

    def __eq__(self, other: object) -> bool:
        """The same knowledge (and, to be written the same, the same settled top); the text of
        settled rows compared as text while neither decoded it (a pass compares its cache with
        the one it read to know whether to write it)."""
        if not isinstance(other, RegionCache):
            return NotImplemented
        same = (self.region_id, self.missing, self.wal_anchor, self.manifests, self.settled, self.cold_top,
                self.gens, self.orphans_at, self.epoch_run) == \
            (other.region_id, other.missing, other.wal_anchor, other.manifests, other.settled, other.cold_top,
             other.gens, other.orphans_at, other.epoch_run)
        if not same:
            return False
        if self._cold is not None and other._cold is not None and self._cold_below == other._cold_below:
            return self._cold == other._cold and self._rows == other._rows
        try:
            return self.rows == other.rows
        except ValueError:  # settled rows not as recorded: not the same as anything
            return False

    def encode(self) -> bytes:
        joined = sorted(p for p in self._rows if p <= self.cold_top)
        if self._cold is not None and all(p > self._cold_below for p in joined):  # the text, appended to
            cold = _append(self._cold, [list(self._rows[p]) for p in joined])
            n = self._cold_n + len(joined)
        else:
            cold, n = json.dumps([list(self._rows[p]) for p in joined], separators=(",", ":")), len(joined)
        return sealed.seal_blob({
            "region": self.region_id, "missing": sorted(self.missing),
            "wal_anchor": list(self.wal_anchor) if self.wal_anchor else None,
            "manifests": [[v, s, t] for v, (s, t) in sorted(self.manifests.items())],
            "settled": self.settled.to_list() if self.settled is not None else None,
            "cold": [self.cold_top, n, len(cold)] if self.cold_top else None,  # the text: the blob
            "wal": [list(self._rows[p]) for p in sorted(self._rows) if p > self.cold_top],
            "gens": [CHUNK, [c.to_list() for _, c in sorted(self.gens.items())]],
            "orphans_at": self.orphans_at,
            "epoch_run": list(self.epoch_run) if self.epoch_run is not None else None,
        }, cold.encode("ascii") if self.cold_top else b"", FORMAT)

    @staticmethod
    def decode(raw: bytes, region_id: str) -> "RegionCache":
        d, blob = sealed.unseal_blob(raw, FORMAT)
        if not isinstance(d, dict):
            raise ValueError("not a region cache")
        if d["region"] != region_id:
            raise ValueError(f"written for region {d['region']!r}")
        out = RegionCache(region_id)
        out._rows = _decode_rows(d["wal"])
        cold = d["cold"]
        if cold is None and len(blob):
            raise ValueError("bytes after the cache")
        if cold is not None:
            top, n, length = cold
            if not (_nat(length, 2) and len(blob) == length):
                raise ValueError("bad settled rows")
            text = bytes(blob).decode("ascii")
            if not (_nat(top) and _nat(n, 0) and text.startswith("[")
                    and text.endswith("]") and all(p > top for p in out._rows)):
                raise ValueError("bad settled rows")
            # Checked without decoding them: as many rows as recorded (rows hold no list), the
            # last (they are in order) at or below the top. Decoding checks each.
            if (0 if text == "[]" else text.count("],[") + 1) != n or (n and not _nat(
                    last := json.loads(text[text.rfind("[", 0, len(text) - 1):-1])[0]) or n and last > top):
                raise ValueError("settled rows that are not the ones recorded")
            out.cold_top, out._cold, out._cold_n, out._cold_below = top, text, n, top
        if not all(_nat(p) for p in d["missing"]):
            raise ValueError("a bad missing position")
        out.missing = {p for p in d["missing"] if p not in out._rows}
        a = d["wal_anchor"]
        if a is not None:
            if not (_nat(a[0]) and _nat(a[1], 0) and isinstance(a[2], (int, float))
                    and (a[0] in out._rows or a[0] <= out.cold_top)):
                raise ValueError("a bad WAL anchor")
            out.wal_anchor = (a[0], a[1], float(a[2]))
        elif out._rows or out.cold_top:
            raise ValueError("WAL entries without an anchor")
        for v, size, mtime in d["manifests"]:
            if not (_nat(v) and _nat(size, 0) and isinstance(mtime, (int, float))):
                raise ValueError("a bad manifest row")
            out.manifests[v] = (size, float(mtime))
        st = d["settled"]
        if st is not None:
            out.settled = Settled.from_list(st)
            if not (out.settled.top in out._rows or out.settled.top <= out.cold_top):
                raise ValueError("a settled run above the known entries")
        out.gens, out.orphans_at = _decode_gens(d["gens"]), d["orphans_at"]
        if out.orphans_at is not None and type(out.orphans_at) not in (int, float):
            raise ValueError("a bad orphan sweep time")
        run = d["epoch_run"]
        if run is not None:
            if not (isinstance(run, list) and len(run) == 2 and _nat(run[0]) and _nat(run[1], 0)
                    and run[0] in out._rows and out._rows[run[0]][1] == run[1]):
                raise ValueError("a bad current epoch run")
            out.epoch_run = (run[0], run[1])
        return out


def _decode_gens(gens: object) -> dict[int, Chunk]:
    """The checked chunks (none when absent, or chunked by another size); ValueError for a bad one."""
    if gens is None:
        return {}
    size, chunks = gens
    if size != CHUNK:
        return {}
    out = {c.first: c for c in map(Chunk.from_list, chunks)}
    if len(out) != len(chunks):
        raise ValueError("a generation chunk twice")
    return out


def _append(text: str, rows: list[list]) -> str:
    """The JSON array `text` with `rows` appended."""
    if not rows:
        return text
    more = json.dumps(rows, separators=(",", ":"))
    return more if text == "[]" else text[:-1] + "," + more[1:]


def _decode_rows(rows: object) -> dict[int, tuple]:
    """WAL rows checked a column at a time; ValueError for anything else."""
    if not (isinstance(rows, list) and set(map(type, rows)) <= {list} and set(map(len, rows)) <= {5}):
        raise ValueError("a bad WAL row")
    ps, epochs, gens, sentinels, sizes = zip(*rows) if rows else ((), (), (), (), ())
    if not (set(map(type, ps)) <= {int} and set(map(type, epochs)) <= {int}
            and set(map(type, gens)) <= {int, type(None)} and set(map(type, sentinels)) <= {bool}
            and set(map(type, sizes)) <= {int}):
        raise ValueError("a bad WAL row")
    if rows and (min(ps) < 1 or min(epochs) < 0 or min(sizes) < 0 or len(set(ps)) != len(ps)):
        raise ValueError("a bad WAL row")
    return dict(zip(ps, map(tuple, rows)))


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
    except Exception as e:  # noqa: BLE001 - a cache: anything it cannot be decoded as means reading around it
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
        """Whether the WAL is as the cache saw it: the anchor entry (the lowest the cache knows)
        has the size and time recorded. The anchor vouches for the WAL, not for the cache's own
        rows: those are trusted as this code wrote them, and a cache edited by other means is
        caught only where its text fails a check (then the WAL is read in full)."""
        if self._wal_ok is None:
            p, size, mtime = self.cache.wal_anchor
            self._wal_ok = _same(self.store.head(layout.wal_key(self.cache.region_id, p)), size, mtime)
        return self._wal_ok

    def wal_meta(self, p: int) -> tuple[bool, wal.WalEntryMeta | None]:
        """(known, metadata or None for a deleted position)."""
        c = self.cache
        if c is None or not self.wal_ok():
            return False, None
        try:
            if not c.known(p):
                return False, None
            return True, c.meta(p)
        except ValueError as e:  # its settled rows are not what it recorded: know nothing of the WAL
            log.warning("%s ignored (%s); reading the region's WAL in full",
                        layout.gc_region_cache_key(c.region_id), e)
            self._wal_ok = False
            return False, None

    def settled(self) -> Settled | None:
        """The settled run of the last walk, when the WAL part holds."""
        c = self.cache
        return c.settled if c is not None and c.settled is not None and self.wal_ok() else None

    def gens(self) -> dict[int, Chunk]:
        """The checked chunks of the generation list (content-addressed: no anchor to check)."""
        return self.cache.gens if self.cache is not None else {}

    def orphans_at(self) -> float | None:
        return self.cache.orphans_at if self.cache is not None else None

    def epoch_run(self, epoch: int) -> int | None:
        """The first position of writer epoch `epoch`'s run, as the last pass found it, when
        the WAL part holds and the cache holds that entry with that epoch (None: not known)."""
        c = self.cache
        if c is None or c.epoch_run is None or c.epoch_run[1] != epoch or not self.wal_ok():
            return None
        row = c._rows.get(c.epoch_run[0])
        return c.epoch_run[0] if row is not None and row[1] == epoch else None

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
               settled: Settled | None = None, gens: dict[int, Chunk] | None = None,
               orphans_at: float | None = None, epoch_run: tuple[int, int] | None = None) -> RegionCache:
    """The cache as the region will be once this pass's deletes went: the entries known to exist
    (the old cache's, when its anchor holds, and those read) minus the deleted, the positions
    known missing, the manifest versions given (the lowest at or below the cut that stays)
    minus the deleted, the walk's settled run (`settled`, of entries none of which is deleted),
    the checked chunks of the generation list (`gens`), the last orphan sweep (`orphans_at`) and
    the current epoch's run (`epoch_run`: its entries above its first are dropped).
    The old cache's text of settled rows is carried over as it is when none of them was looked
    up (then none changed: a row is looked up before it is deleted or found missing)."""
    old = checked.cache
    keep_old = old is not None and old.wal_anchor is not None and checked.wal_ok()
    out = RegionCache(region_id)
    if keep_old and old._cold is not None and any(p <= old._cold_below for p in list(wal_deleted) + list(metas)):
        try:
            old.rows  # noqa: B018 - decoded: those rows change
        except ValueError:
            keep_old = False
    as_text = keep_old and old._cold is not None
    known = dict(old._rows) if keep_old else {}
    missing = set(old.missing) if keep_old else set()
    for p, m in metas.items():
        if m is None:
            missing.add(p)
            known.pop(p, None)
        elif m.writer_epoch >= 0:  # an unreadable entry is read again next time
            known[p] = _row(m)
    for p in wal_deleted:
        known.pop(p, None)
        missing.add(p)
    if epoch_run is not None:  # the run is taken from its first entry (module docstring)
        first, epoch = epoch_run
        known = {p: r for p, r in known.items() if p <= first or r[1] != epoch}
    missing = {p for p in missing if p not in known}
    out._rows, out.missing = known, set(sorted(missing)[-MAX_MISSING:])
    if keep_old:
        out.cold_top = old.cold_top
        if as_text:
            out._cold, out._cold_n, out._cold_below = old._cold, old._cold_n, old._cold_below
    if known or out._cold_n:
        low = min(list(known) + ([old.wal_anchor[0]] if as_text and out._cold_n else []))
        if keep_old and old.wal_anchor[0] == low:
            out.wal_anchor = old.wal_anchor
        else:
            info = checked.store.head(layout.wal_key(region_id, low))
            if info is None:  # gone since it was read: know nothing of the WAL
                out.rows, out.missing = {}, set()
            else:
                out.wal_anchor = (low, info.size, info.mtime)
    if (out._rows or out._cold_n) and settled is not None \
            and (settled.top in out._rows or settled.top <= out.cold_top) \
            and not any(settled.bottom < p <= settled.top for p in wal_deleted):
        out.settled = settled
        out.cold_top = max(out.cold_top, settled.top)
    out.manifests = {v: (i.size, i.mtime) for v, i in manifests.items() if v not in manifests_deleted}
    out.gens, out.orphans_at = dict(gens or {}), orphans_at
    if epoch_run is not None and epoch_run[0] > out.cold_top and out._rows.get(epoch_run[0], (0, -1))[1] == epoch_run[1]:
        out.epoch_run = epoch_run  # (a run start among the settled rows' text is not kept: a row looked up there decodes it)
    return out
