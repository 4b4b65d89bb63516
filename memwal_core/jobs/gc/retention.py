"""What the base table's retained versions still need: a reader time-travelling to version v reads
the generations newer than v's merge progress, so GC keeps them while v is retained. A version
whose table has no MemWAL index yet needs none.

Computed over the facts' columns (`fact_table.py`) and the distinct merge states the retained
versions have (with each state's oldest and newest version): a region's bound and a hold's end
cost a look at each distinct state, not at each version. The older versions' facts, sealed
(`fact_segments.py`), count by their aggregates: each region's lowest merge progress and the
oldest version with it. Their own facts are read only for what those do not answer (the end of a
hold no newer version reads, the versions before an older initialization)."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

from memwal_core.jobs.gc.fact_segments import SealedPart, VersionList
from memwal_core.jobs.gc.fact_table import ABSENT, FactTable
from memwal_core.jobs.gc.history import VersionHistory, read_history
from memwal_core.jobs.gc.holds import Bound, KeepReason
from memwal_core.state.store import TableLocation


@dataclass
class Retention:
    """The retained versions' facts, and per region the lowest merged generation over them.
    `facts`: the newest versions' (every one's when `sealed` is None); `sealed`: the older ones'
    aggregates (their facts read from `history` when needed)."""

    facts: FactTable
    history: VersionHistory | None = None  # how they were learned (what `run_gc` saves)
    sealed: SealedPart | None = None
    _used: list[int] = field(default_factory=list, repr=False, compare=False)  # the states retained versions have
    _first: list[int] = field(default_factory=list, repr=False, compare=False)  # state -> its oldest position (-1: none)
    _last: list[int] = field(default_factory=list, repr=False, compare=False)  # state -> its newest position (-1: none)
    _by_first: list[int] = field(default_factory=list, repr=False, compare=False)
    _by_last: list[int] = field(default_factory=list, repr=False, compare=False)
    _every: Retention | None = field(default=None, repr=False, compare=False)  # over every version, once built

    def __post_init__(self) -> None:
        n = len(self.facts)
        so = np.frombuffer(self.facts.state_of, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
        # Each state's first and last position, in C (numpy); -1 (no MemWAL index) is not a state.
        states, first = np.unique(so, return_index=True)
        last = n - 1 - np.unique(so[::-1], return_index=True)[1]
        keep = states >= 0
        states, first, last = states[keep], first[keep], last[keep]
        by_state = np.full((2, self.facts._state_count()), -1, dtype=np.int64)
        by_state[0, states], by_state[1, states] = first, last
        self._first, self._last = by_state.tolist()
        self._used = states.tolist()
        # The states by their oldest and by their newest version: the version a bound names and
        # a hold's end are then usually the first state looked at (progress grows with versions).
        self._by_first = states[np.argsort(first, kind="stable")].tolist()
        self._by_last = states[np.argsort(-last, kind="stable")].tolist()

    @property
    def versions(self) -> VersionList:
        """Every retained version (counted without reading the sealed ones)."""
        if self.sealed is not None and self.history is not None:
            return self.history.versions()
        return VersionList(len(self.facts), lambda: self.facts)

    def _all(self) -> Retention:
        """The retention over every version's facts (the sealed ones read; built once)."""
        if self._every is None:
            self._every = Retention(self.history.full(), self.history)
        return self._every

    def _value(self, column, s: int) -> int:
        """State `s`'s merged generation of the region of `column` (not named: 0)."""
        g = ABSENT if column is None else column[s]
        return 0 if g == ABSENT else g

    def bound(self, region_id: str) -> Bound | None:
        """The time-travel bound of a region: the lowest merge progress over the retained
        versions, at the oldest version that has it (None: no version has a MemWAL index)."""
        newer = self._bound(region_id)
        older = self.sealed.lowest_of(region_id) if self.sealed is not None else None
        if older is None or (newer is not None and newer.generation < older[0]):
            return newer
        # The sealed versions are the older ones: at an equal minimum, theirs is the oldest.
        return Bound(KeepReason.GENERATION_TIME_TRAVEL, older[0], table_version=older[1])

    def _bound(self, region_id: str) -> Bound | None:
        if not self._used:
            return None
        col = self.facts.column(region_id)
        if col is None:
            best = 0
        elif len(self._used) == len(col):  # every state is retained: the minimum in C
            best = 0 if ABSENT in col else min(col)
        else:
            best = min(self._value(col, s) for s in self._used)
        s = next(s for s in self._by_first if self._value(col, s) == best)
        return Bound(KeepReason.GENERATION_TIME_TRAVEL, best, table_version=self.facts.versions[self._first[s]])

    def held_until(self, region_id: str, generation: int, older_than: timedelta | None) -> float | None:
        """When the newest retained version still reading `generation` becomes old enough for
        the base-version cleanup (None: no cleanup configured, or no timestamp)."""
        if older_than is None:
            return None
        col = self.facts.column(region_id)
        s = next((s for s in self._by_last if self._value(col, s) < generation), None)
        if s is None:  # no newer version reads it: the newest sealed one that does, if any
            older = self.sealed.lowest_of(region_id) if self.sealed is not None else None
            if older is None or older[0] >= generation:
                return None
            told, stamp = self.sealed.newest_below(region_id, generation)
            if not told:
                return self._all().held_until(region_id, generation, older_than)
            return None if stamp is None else stamp + older_than.total_seconds()
        if math.isnan(self.facts.stamps[self._last[s]]):
            return None
        return self.facts.stamps[self._last[s]] + older_than.total_seconds()

    def lowest_before(self, region_id: str, version: int) -> int | None:
        """The lowest merged generation of a region over the retained versions below `version`
        with a MemWAL index (None: there are none)."""
        if self.sealed is not None:
            if version <= self.sealed.last:
                return self._all().lowest_before(region_id, version)
            older = self.sealed.lowest_of(region_id)
            newer = Retention(self.facts).lowest_before(region_id, version)
            return min((x for x in (older and older[0], newer) if x is not None), default=None)
        cut = bisect_left(self.facts.versions, version)
        states = set(self.facts.state_of[:cut])
        states.discard(-1)
        col = self.facts.column(region_id)
        return min((self._value(col, s) for s in states), default=None)


def from_history(history: VersionHistory, gone: frozenset[int] = frozenset()) -> Retention:
    """What the listed versions need; `gone`: versions taken as removed (a dry run's cleanup)."""
    if gone:
        facts = history.full()
        return Retention(facts.select(i for i, v in enumerate(facts.versions) if v not in gone), history)
    return Retention(history.tail, history, history.sealed)


def read_retention(loc: TableLocation, gone: frozenset[int] = frozenset(), **kw) -> Retention:
    """What the retained versions need (`history.read_history`, its arguments: each manifest read once)."""
    return from_history(read_history(loc, **kw), gone)
