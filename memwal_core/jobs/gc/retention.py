"""What the base table's retained versions still need: a reader time-travelling to version v reads
the generations newer than v's merge progress, so GC keeps them while v is retained. A version
whose table has no MemWAL index yet needs none.

Computed over the facts' columns (`fact_table.py`) and the distinct merge states the retained
versions have (with each state's oldest and newest version): a region's bound and a hold's end
cost a look at each distinct state, not at each version."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import timedelta

from memwal_core.jobs.gc.fact_table import ABSENT, FactTable
from memwal_core.jobs.gc.history import VersionHistory, read_history
from memwal_core.jobs.gc.holds import Bound, KeepReason
from memwal_core.state.store import TableLocation


@dataclass
class Retention:
    """The retained versions' facts, and per region the lowest merged generation over them."""

    facts: FactTable
    history: VersionHistory | None = None  # how they were learned (what `run_gc` saves)
    _used: set[int] = field(default_factory=set, repr=False, compare=False)  # the states retained versions have
    _first: dict[int, int] = field(default_factory=dict, repr=False, compare=False)  # state -> its oldest position
    _last: dict[int, int] = field(default_factory=dict, repr=False, compare=False)  # state -> its newest position
    _by_first: list[int] = field(default_factory=list, repr=False, compare=False)
    _by_last: list[int] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, state_of = len(self.facts), self.facts.state_of
        # Built in C: for a state, its last position wins in `_last`, its first in `_first`.
        self._last = dict(zip(state_of, range(n)))
        self._first = dict(zip(reversed(state_of), range(n - 1, -1, -1)))
        self._last.pop(-1, None)
        self._first.pop(-1, None)
        self._used = set(self._last)
        # The states by their oldest and by their newest version: the version a bound names and
        # a hold's end are then usually the first state looked at (progress grows with versions).
        self._by_first = sorted(self._first, key=self._first.__getitem__)
        self._by_last = sorted(self._last, key=self._last.__getitem__, reverse=True)

    @property
    def versions(self) -> list[int]:
        return list(self.facts.versions)

    def _value(self, column, s: int) -> int:
        """State `s`'s merged generation of the region of `column` (not named: 0)."""
        g = ABSENT if column is None else column[s]
        return 0 if g == ABSENT else g

    def bound(self, region_id: str) -> Bound | None:
        """The time-travel bound of a region: the lowest merge progress over the retained
        versions, at the oldest version that has it (None: no version has a MemWAL index)."""
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
        if s is None or math.isnan(self.facts.stamps[self._last[s]]):
            return None
        return self.facts.stamps[self._last[s]] + older_than.total_seconds()

    def lowest_before(self, region_id: str, version: int) -> int | None:
        """The lowest merged generation of a region over the retained versions below `version`
        with a MemWAL index (None: there are none)."""
        cut = bisect_left(self.facts.versions, version)
        states = set(self.facts.state_of[:cut])
        states.discard(-1)
        col = self.facts.column(region_id)
        return min((self._value(col, s) for s in states), default=None)


def from_history(history: VersionHistory, gone: frozenset[int] = frozenset()) -> Retention:
    """What the listed versions need; `gone`: versions taken as removed (a dry run's cleanup)."""
    facts = history.facts
    if gone:
        facts = facts.select(i for i, v in enumerate(facts.versions) if v not in gone)
    return Retention(facts, history)


def read_retention(loc: TableLocation, gone: frozenset[int] = frozenset(), **kw) -> Retention:
    """What the retained versions need (`history.read_history`, its arguments: each manifest read once)."""
    return from_history(read_history(loc, **kw), gone)
