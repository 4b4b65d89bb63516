"""What the base table's retained versions still need: a reader time-travelling to version v reads
the generations newer than v's merge progress, so GC keeps them while v is retained. A version
whose table has no MemWAL index yet needs none."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from memwal_core.jobs.gc.holds import Bound, KeepReason
from memwal_core.jobs.gc.items import GcError
from memwal_core.state import table
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.gc")

# (lance uri, version, version timestamp) -> merged by region, or None (no MemWAL index).
# Table versions are immutable; the timestamp tells a re-created table's version N apart.
_MERGED_CACHE: dict[tuple[str, int, str], dict[str, int] | None] = {}
_MERGED_CACHE_LOCK = threading.Lock()
_MERGED_CACHE_MAX = 100_000


def _merged_at(loc: TableLocation, version: int, stamp: str) -> dict[str, int] | None:
    key = (loc.lance_uri, version, stamp)
    with _MERGED_CACHE_LOCK:
        if key in _MERGED_CACHE:
            return _MERGED_CACHE[key]
    try:
        merged: dict[str, int] | None = table.read_memwal_state(loc, version).merged
    except table.MemWalNotInitialized:
        merged = None  # a reader of this version does no MemWAL read: needs no generation
    with _MERGED_CACHE_LOCK:
        if len(_MERGED_CACHE) >= _MERGED_CACHE_MAX:
            _MERGED_CACHE.clear()
        _MERGED_CACHE[key] = merged
    return merged


@dataclass
class Retention:
    """Per region: the lowest merged generation over retained versions, and which version."""

    versions: list[int]
    states: dict[int, dict[str, int]]  # retained versions with a MemWAL index
    stamps: dict[int, float] = field(default_factory=dict)  # version -> commit time (epoch seconds)

    def held_until(self, region_id: str, generation: int, older_than: timedelta | None) -> float | None:
        """When the newest retained version still reading `generation` becomes old enough for
        the base-version cleanup (None: no cleanup configured, or no timestamp)."""
        if older_than is None:
            return None
        needing = [v for v, m in self.states.items() if m.get(region_id, 0) < generation]
        if not needing or max(needing) not in self.stamps:
            return None
        return self.stamps[max(needing)] + older_than.total_seconds()

    def bound(self, region_id: str) -> Bound | None:
        """The time-travel bound of a region: the lowest merge progress over the retained
        versions, at the oldest version that has it (None: no version has a MemWAL index)."""
        best, which = None, None
        for v in sorted(self.states):
            m = self.states[v].get(region_id, 0)
            if best is None or m < best:
                best, which = m, v
        return Bound(KeepReason.GENERATION_TIME_TRAVEL, best, table_version=which) if best is not None else None


def _stamp(value: Any) -> float | None:
    try:
        return value.timestamp() if hasattr(value, "timestamp") else float(value)
    except (TypeError, ValueError, OSError):
        return None


def read_retention(loc: TableLocation, ds, gone: frozenset[int] = frozenset()) -> Retention:
    """What the retained versions need; `gone`: versions taken as removed (a dry run's cleanup)."""
    versions, states, stamps = [], {}, {}
    for info in ds.versions():
        v = int(info["version"])
        if v in gone:
            continue
        stamp = _stamp(info.get("timestamp"))
        if stamp is not None:
            stamps[v] = stamp
        try:
            merged = _merged_at(loc, v, str(info.get("timestamp")))
        except table.TableError as e:
            if "not found" in str(e):  # cleaned up since the listing: no longer retained
                log.info("table version %d vanished while planning GC (cleaned up): %s", v, e)
                continue
            raise GcError(f"cannot read the MemWAL state of retained table version {v}: {e}") from None
        versions.append(v)
        if merged is not None:
            states[v] = merged
    return Retention(sorted(versions), states, stamps)
