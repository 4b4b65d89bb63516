"""What the base table's retained versions still need: a reader time-travelling to version v reads
the generations newer than v's merge progress, so GC keeps them while v is retained. A version
whose table has no MemWAL index yet needs none."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta

from memwal_core.jobs.gc.history import VersionHistory, read_history
from memwal_core.jobs.gc.holds import Bound, KeepReason
from memwal_core.state.store import TableLocation


@dataclass
class Retention:
    """Per region: the lowest merged generation over retained versions, and which version."""

    versions: list[int]
    states: dict[int, dict[str, int]]  # retained versions with a MemWAL index
    stamps: dict[int, float] = field(default_factory=dict)  # version -> commit time (epoch seconds)
    history: VersionHistory | None = None  # how they were learned (what `run_gc` saves)
    _by_state: tuple[int, list[tuple[dict[str, int], int, int]]] | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def held_until(self, region_id: str, generation: int, older_than: timedelta | None) -> float | None:
        """When the newest retained version still reading `generation` becomes old enough for
        the base-version cleanup (None: no cleanup configured, or no timestamp)."""
        if older_than is None:
            return None
        newest = max((hi for m, _, hi in self._runs() if m.get(region_id, 0) < generation), default=None)
        if newest is None or newest not in self.stamps:
            return None
        return self.stamps[newest] + older_than.total_seconds()

    def bound(self, region_id: str) -> Bound | None:
        """The time-travel bound of a region: the lowest merge progress over the retained
        versions, at the oldest version that has it (None: no version has a MemWAL index)."""
        best, which = None, None
        for m, oldest, _ in self._runs():
            g = m.get(region_id, 0)
            if best is None or g < best or (g == best and oldest < which):
                best, which = g, oldest
        return Bound(KeepReason.GENERATION_TIME_TRAVEL, best, table_version=which) if best is not None else None

    def _runs(self) -> list[tuple[dict[str, int], int, int]]:
        """Each distinct merge state (retained versions share few: one per merge commit) with the
        oldest and the newest version that has it; computed once, so that a region's bound and
        holds look at the distinct states, not at every version (the summary decodes equal states
        as one object, so most versions cost an identity lookup). The regions are planned in
        threads: the first to ask groups them, the others wait for it rather than group them too."""
        with self._lock:
            if self._by_state is None or self._by_state[0] != len(self.states):
                self._by_state = (len(self.states), self._group_states())
            return self._by_state[1]

    def _group_states(self) -> list[tuple[dict[str, int], int, int]]:
        vs = sorted(self.states)
        ms = list(map(self.states.__getitem__, vs))
        ids = list(map(id, ms))  # by object first, in C: most versions share their state object
        objs, newest, oldest = dict(zip(ids, ms)), dict(zip(ids, vs)), dict(zip(reversed(ids), reversed(vs)))
        by_content: dict[frozenset, list] = {}
        for i, m in objs.items():
            e = by_content.setdefault(frozenset(m.items()), [m, oldest[i], newest[i]])
            e[1], e[2] = min(e[1], oldest[i]), max(e[2], newest[i])
        return [(m, lo, hi) for m, lo, hi in by_content.values()]


def from_history(history: VersionHistory, gone: frozenset[int] = frozenset()) -> Retention:
    """What the listed versions need; `gone`: versions taken as removed (a dry run's cleanup)."""
    facts = [f for v, f in history.facts.items() if v not in gone]
    return Retention(sorted(f.version for f in facts), {f.version: f.merged for f in facts if f.merged is not None},
                     {f.version: f.stamp for f in facts if f.stamp is not None}, history)


def read_retention(loc: TableLocation, gone: frozenset[int] = frozenset(), **kw) -> Retention:
    """What the retained versions need (`history.read_history`, its arguments: each manifest read once)."""
    return from_history(read_history(loc, **kw), gone)
