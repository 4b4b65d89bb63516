"""Which WAL entries of a region GC deletes (rule 2 of the package docstring): covered entries of
collectable generations, never a fence sentinel, the tail, or (by default) the current epoch.

The scan walks down from the cut (the covered position below the tail) to the first missing
position, skipping the current epoch's contiguous run by bisection; below that hole earlier runs
left only kept entries, unless a delete failed part-way, which GC's intent marker says: then the
WAL directory is listed once and what lies below the hole is classified the same way."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Collection

from memwal_core.jobs.gc import region_cache
from memwal_core.jobs.gc.holds import KeepReason
from memwal_core.jobs.gc.items import WAL, GcItem
from memwal_core.jobs.gc.listing import listed_positions
from memwal_core.state import layout, region, wal
from memwal_core.state.store import ObjectStore, TableLocation

log = logging.getLogger("memwal.gc")


@dataclass
class WalPlan:
    """One region's WAL entries to delete, what is kept and why, and the tail that was found."""

    tail: int = 0
    items: list[GcItem] = field(default_factory=list)
    kept: collections.Counter[KeepReason] = field(default_factory=collections.Counter)
    metas: dict[int, wal.WalEntryMeta | None] = field(default_factory=dict)  # what the scan knew (None: missing)
    settled: region_cache.Settled | None = None  # the run the walk kept whole (`region_cache.py`)
    epoch_run: tuple[int, int] | None = None  # (first position, epoch) of the current epoch's run skipped


def covered_position(store, rid: str, m: region.RegionManifest, bound: int) -> tuple[int, int | None]:
    """(position, manifest version): the highest WAL position whose entries all went into
    generations <= `bound`, read from the region manifest history; (0, None) when unknown.

    Spec (Region Manifest): a flush commits the manifest version that lists the new generation,
    advances `current_generation` past it and sets `replay_after_wal_entry_position` to the last
    WAL entry it contains; so at any version v, every entry at a position <= replay_after(v)
    lives in a generation < current_generation(v). Any version read with
    `current_generation - 1 <= bound` therefore gives a position below which every entry is in a
    generation <= bound, without reading a single entry: that check on a version actually read is
    the whole safety argument. Which version is found is only a matter of how much is reclaimed:
    `current_generation` never decreases from one version to the next and the versions GC leaves
    are a contiguous suffix, so two bisections (the oldest version still there, then the newest
    that qualifies) find the best one in O(log versions) reads; a version that cannot be read is
    taken for part of the collected prefix and never returned (at worst less is reclaimed)."""
    if m.current_generation - 1 <= bound:
        return m.message.replay_after_wal_entry_position, m.version
    cache: dict[int, region.RegionManifest | None] = {m.version: m}

    def load(v: int) -> region.RegionManifest | None:
        if v not in cache:
            try:
                cache[v] = region.load_version(store, rid, v)
            except region.RegionError:
                cache[v] = None
        return cache[v]

    lo, hi = 1, m.version  # the oldest version still there: missing ones are a prefix
    while lo < hi:
        mid = (lo + hi) // 2
        if store.exists(layout.manifest_key(rid, mid)):
            hi = mid
        else:
            lo = mid + 1
    best: region.RegionManifest | None = None
    lo, hi = lo, m.version - 1  # the newest qualifying version in [oldest, latest - 1]
    while lo <= hi:
        mid = (lo + hi) // 2
        got = load(mid)
        if got is None:  # unreadable: like the missing prefix (a delete that failed part-way)
            lo = mid + 1
        elif got.current_generation - 1 <= bound:
            best, lo = got, mid + 1
        else:
            hi = mid - 1
    if best is None:
        return 0, None
    return best.message.replay_after_wal_entry_position, best.version


def _tail(store: ObjectStore, m: region.RegionManifest) -> int:
    """The last WAL position: probed forward from the manifest's hint (or the one after it,
    which GC may have left as the first survivor when the hinted entry itself was covered and
    deleted); 0 for an empty WAL, or no entry where the manifest says (delete nothing)."""
    rid = m.region_id
    hint = max(m.message.replay_after_wal_entry_position, m.message.wal_entry_position_last_seen)
    for start in (hint, hint + 1):
        if start >= 1 and store.exists(layout.wal_key(rid, start)):
            return wal.probe_tail(store, rid, start)
    return 0


class _Scan:
    """Classifies one region's WAL entries below the cut into `out` (entry metadata read once)."""

    def __init__(self, loc: TableLocation, m: region.RegionManifest, limit: int, kept_listed: Collection[int],
                 keep_current_epoch: bool, out: WalPlan, cache: region_cache.Checked | None = None):
        self.loc, self.store, self.m, self.rid, self.out = loc, loc.store, m, m.region_id, out
        self.cache = cache
        self.limit, self.kept_listed, self.keep_current_epoch = limit, kept_listed, keep_current_epoch
        self.replay_after = m.message.replay_after_wal_entry_position
        # Entries without a `generation` in their metadata (Lance 13, LanceDB 0.40) are decided
        # by position: those at or below `nogen_cut` went into generations that are all
        # collectable now (<= limit, < current_generation) and none of which is still listed as kept.
        self.nogen_bound = min([limit, m.current_generation - 1] + ([min(kept_listed) - 1] if kept_listed else []))
        self._nogen_cut: int | None = None  # found once, on the first such entry: pylance 14 tables never need it
        self._metas = out.metas

    def nogen_cut(self) -> int:
        if self._nogen_cut is None:
            self._nogen_cut = (covered_position(self.store, self.rid, self.m, self.nogen_bound)[0]
                               if self.nogen_bound >= 1 else 0)
        return self._nogen_cut

    def meta(self, p: int) -> wal.WalEntryMeta | None:
        """Entry metadata; None when the position does not exist (known from the cache, or read)."""
        if p not in self._metas and self.cache is not None:
            known, got = self.cache.wal_meta(p)
            if known:
                self._metas[p] = got
        if p not in self._metas:
            try:
                self._metas[p] = wal.read_entry_meta(self.store, self.rid, p)
            except wal.WalEntryError as e:
                if "does not exist" in str(e):
                    self._metas[p] = None
                else:
                    self._metas[p] = wal.WalEntryMeta(p, -1, None, False, 0)  # unreadable: keep
                    log.warning("%s", e)
        return self._metas[p]

    def skip_current_epoch(self, cut: int) -> int:
        """The position below the current epoch's run ending at `cut` (kept); `cut` itself when
        the entry there is of an earlier epoch or the current epoch is not kept."""
        if not self.keep_current_epoch:
            return cut
        top = self.meta(cut)
        if top is None or top.writer_epoch != self.m.writer_epoch:
            return cut
        # Positions from the current epoch's sentinel up to the cut are all this epoch's
        # (epochs do not decrease along the WAL). Its first position is the one the last pass
        # found, when the cache vouches for it (that entry is of this epoch: the run still starts
        # there, and every entry from it to the cut is of this epoch); else it is found by
        # bisection, above the last walk's settled run when its epochs are all older (its entries
        # are not looked up). The bisection rests on that order, as the walk without a settled
        # run does: a writer fenced by a higher epoch cannot append, so a WAL never holds a lower
        # epoch above a higher.
        known = self.cache.epoch_run(self.m.writer_epoch) if self.cache is not None else None
        if known is not None and known <= cut:
            lo = known
        else:
            run = self.cache.settled() if self.cache is not None else None
            lo, hi = (run.top + 1 if run is not None and run.max_epoch < self.m.writer_epoch and run.top < cut
                      else 1), cut
            while lo < hi:
                mid = (lo + hi) // 2
                e = self.meta(mid)
                if e is not None and e.writer_epoch == self.m.writer_epoch:
                    hi = mid
                else:
                    lo = mid + 1
        self.out.epoch_run = (lo, self.m.writer_epoch)
        self.out.kept[KeepReason.WAL_CURRENT_EPOCH] += cut - lo + 1
        return lo - 1

    def walk_down(self, p: int) -> int:
        """Classify `p`, `p - 1`, ... down to the first missing position (returned; 0: none).
        A settled run the last walk kept (`region_cache.py`) that these rules keep whole again
        is counted without classifying its entries one by one. The run walked is recorded as
        settled when every entry in it was kept as a sentinel or an entry of a kept generation."""
        start, prior = p, self.cache.settled() if self.cache is not None else None
        sentinels = kept = max_epoch = 0
        min_gen: int | None = None
        clean = True
        while p >= 1:
            if prior is not None and p == prior.top and self._keeps(prior):
                for why, n in ((KeepReason.WAL_FENCE_SENTINEL, prior.sentinels),
                               (KeepReason.WAL_GENERATION_KEPT, prior.kept)):
                    if n:  # counted as classifying each would count them
                        self.out.kept[why] += n
                sentinels, kept, max_epoch = sentinels + prior.sentinels, kept + prior.kept, max(max_epoch,
                                                                                                 prior.max_epoch)
                if prior.min_gen is not None:
                    min_gen = prior.min_gen if min_gen is None else min(min_gen, prior.min_gen)
                p = prior.bottom
                continue
            e = self.meta(p)
            if e is None:
                break  # a hole: earlier runs deleted from here down
            why = self.classify(p, e)
            if why is KeepReason.WAL_FENCE_SENTINEL:
                sentinels += 1
            elif why is KeepReason.WAL_GENERATION_KEPT:
                kept += 1
                min_gen = e.generation if min_gen is None else min(min_gen, e.generation)
            else:
                clean = False
            max_epoch = max(max_epoch, e.writer_epoch)
            p -= 1
        if clean and start > p:
            self.out.settled = region_cache.Settled(start, p, sentinels, kept, min_gen, max_epoch)
        return p

    def _keeps(self, run: region_cache.Settled) -> bool:
        """Whether the rules keep every entry of a settled run again, as they did: each is a
        sentinel (always kept) or of a generation above the limit, and none is of the current
        epoch when that is kept (epochs never go back: the run's are all older)."""
        return ((run.min_gen is None or self.limit < run.min_gen)
                and not (self.keep_current_epoch and self.m.writer_epoch <= run.max_epoch))

    def below_hole(self, hole: int, region_dir: str) -> None:
        """Below the hole, a run whose delete batch failed for some keys (S3 DeleteObjects
        answers per key) left survivors: list the directory once and classify what is there
        (sentinels and other kept entries are classified again, and kept again)."""
        listed = listed_positions(self.loc, layout.wal_dir(self.rid), layout.WAL_SUFFIX, region_dir)
        for q in sorted(listed, reverse=True):
            if q < hole and (e := self.meta(q)) is not None:
                self.classify(q, e)

    def classify(self, p: int, e: wal.WalEntryMeta) -> KeepReason | None:
        """Count entry `p` as kept (its reason, returned) or plan its delete (None)."""
        kept, m = self.out.kept, self.m
        if e.writer_epoch < 0:
            why = KeepReason.WAL_UNREADABLE
        elif e.fence_sentinel:
            why = KeepReason.WAL_FENCE_SENTINEL
        elif self.keep_current_epoch and e.writer_epoch == m.writer_epoch:
            why = KeepReason.WAL_CURRENT_EPOCH
        elif e.generation is None:
            if p > self.nogen_cut():
                why = KeepReason.WAL_NO_GENERATION
            else:
                self._delete(p, e, f"covered (<= {self.nogen_cut()}) entry of generations <= {self.nogen_bound}")
                return None
        elif e.generation > self.limit or e.generation >= m.current_generation or e.generation in self.kept_listed:
            why = KeepReason.WAL_GENERATION_KEPT
        else:
            self._delete(p, e, f"covered (<= {self.replay_after}) entry of deleted generation {e.generation}")
            return None
        kept[why] += 1
        return why

    def _delete(self, p: int, e: wal.WalEntryMeta, reason: str) -> None:
        key = layout.wal_key(self.rid, p)
        self.out.items.append(GcItem(WAL, self.rid, key, e.size, reason, (key,), p))


def plan_wal(loc: TableLocation, m: region.RegionManifest, limit: int, kept_listed: Collection[int], *,
             keep_current_epoch: bool, leftover_scan: bool, cache: region_cache.Checked | None = None) -> WalPlan:
    """The WAL entries of region `m.region_id` GC deletes: covered (at or below
    `replay_after_wal_entry_position`, below the tail) entries of generations <= `limit` that are
    not listed any more (`kept_listed`: the generations the manifest keeps listing). `cache`: what
    earlier passes learned of the entries (`region_cache.py`), instead of reading them again."""
    out = WalPlan()
    replay_after = m.message.replay_after_wal_entry_position
    out.tail = tail = _tail(loc.store, m)
    if tail < 1:
        return out
    out.kept[KeepReason.WAL_TAIL] += 1
    if tail - replay_after - 1 > 0:
        out.kept[KeepReason.WAL_UNCOVERED] += tail - replay_after - 1  # positions strictly between
    cut = min(replay_after, tail - 1)
    if cut < 1:
        return out
    scan = _Scan(loc, m, limit, kept_listed, keep_current_epoch, out, cache)
    hole = scan.walk_down(scan.skip_current_epoch(cut))
    if hole > 1 and leftover_scan:
        scan.below_hole(hole, layout.region_dir(m.region_id))
    return out
