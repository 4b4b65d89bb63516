"""The retained base versions' facts as columns: what a GC pass holds of every retained version,
kept as typed arrays, not as an object per version.

A pass reads the version summary (`history.py`) on every run, and the summary has a row per
retained version: a week of versions is thousands. Decoding thousands of JSON rows into
thousands of tuples, and grouping their merge states again, grew the pass with the history. As
columns the summary is the arrays' raw bytes (`sealed.seal_blob`: nothing escaped or encoded),
copied into arrays and checked a column at a time in C, a version's facts are built only when
asked for (`get`), and what the retention needs of all of them (`retention.py`) is computed over
the columns and the distinct merge states: a merge state is stored once per content, as a row of
a matrix over the regions it names.

A `FactTable` is immutable; `grown` and `of` make new ones. It is a `Mapping[int, VersionFacts]`
in version order, equal to any mapping with the same facts."""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

ABSENT = 2**64 - 1  # a region the merge state does not name (the highest u64: never a generation merged)
_NO_STATE = -1  # a version without a MemWAL index
_U64 = 2**64


class VersionFacts(NamedTuple):
    """What GC needs of one table version, and the manifest (size, modification time) it was
    read from. `merged` None: the version has no MemWAL index (its readers read no generation)."""

    version: int
    size: int
    mtime: float
    stamp: float | None  # commit time, epoch seconds (Lance's manifest timestamp)
    merged: dict[str, int] | None


def _swapped(a: array) -> array:
    c = array(a.typecode, a)
    c.byteswap()
    return c


class FactTable(Mapping):
    """Columns of version facts, sorted by version (see the module docstring)."""

    __slots__ = ("versions", "sizes", "mtimes", "stamps", "state_of", "regions", "matrix", "_dicts", "_index")

    def __init__(self, versions: array, sizes: array, mtimes: array, stamps: array, state_of: array,
                 regions: list[str], matrix: array):
        self.versions = versions  # 'Q', strictly increasing
        self.sizes = sizes  # 'Q'
        self.mtimes = mtimes  # 'd'
        self.stamps = stamps  # 'd', NaN: no commit time
        self.state_of = state_of  # 'q', a row of `matrix`, or -1: no MemWAL index
        self.regions = regions  # the regions the states name, sorted
        self.matrix = matrix  # 'Q', a state per row, a region per column; ABSENT: not named
        self._dicts: dict[int, dict[str, int]] = {}  # states made into maps (one object per state)
        self._index: dict[str, int] | None = None

    # -- building -------------------------------------------------------------------------------

    @classmethod
    def empty(cls) -> FactTable:
        return cls(array("Q"), array("Q"), array("d"), array("d"), array("q"), [], array("Q"))

    @classmethod
    def of(cls, facts: Iterable[VersionFacts]) -> FactTable:
        """A table of `facts` (any order; the last of equal versions wins). ValueError for a
        fact no summary can hold (a negative or too large number)."""
        return cls.empty().grown(facts)

    def grown(self, facts: Iterable[VersionFacts]) -> FactTable:
        """This table with `facts` added (replacing equal versions). Versions above the newest
        are appended to copies of the columns; anything else builds the table again."""
        new = sorted({f.version: f for f in facts}.values())
        if not new:
            return self
        if self.versions and new[0].version <= self.versions[-1]:
            return FactTable.empty().grown(list({**dict(self.items()), **{f.version: f for f in new}}.values()))
        regions = sorted(set(self.regions).union(*(f.merged for f in new if f.merged is not None)))
        matrix = self.matrix if regions == self.regions else self._widened(regions)
        width = len(regions)
        rows = len(matrix) // width if width else self._state_count()
        known: dict[frozenset, int] = {}  # new states by content; an older equal state is stored again
        by_id: dict[int, int] = {}  # and by object: facts taken from a table share their state's map
        last = self._last_state()
        if last is not None:
            known[frozenset(self.state(last).items())] = last
        out = FactTable(array("Q", self.versions), array("Q", self.sizes), array("d", self.mtimes),
                        array("d", self.stamps), array("q", self.state_of), regions, matrix)
        if out.matrix is self.matrix:
            out.matrix = array("Q", self.matrix)
        for f in new:
            s = _NO_STATE
            if f.merged is not None:
                s = by_id.get(id(f.merged), -1)
                if s < 0:
                    key = frozenset(f.merged.items())
                    s = known.get(key, -1)
                    if s < 0:
                        s = known[key] = rows
                        rows += 1
                        out.matrix.extend(_row(f.merged, regions))
                    by_id[id(f.merged)] = s
            _check(f)
            out.versions.append(f.version)
            out.sizes.append(f.size)
            out.mtimes.append(float(f.mtime))
            out.stamps.append(math.nan if f.stamp is None else float(f.stamp))
            out.state_of.append(s)
        return out

    def _widened(self, regions: list[str]) -> array:
        """The matrix over `regions` (a superset of this table's)."""
        out = array("Q")
        for s in range(self._state_count()):
            out.extend(_row(self.state(s), regions))
        return out

    def _state_count(self) -> int:
        if self.regions:
            return len(self.matrix) // len(self.regions)
        return max(self.state_of, default=-1) + 1

    def _last_state(self) -> int | None:
        for s in reversed(self.state_of):
            if s >= 0:
                return s
        return None

    # -- the mapping ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.versions)

    def __iter__(self) -> Iterator[int]:
        return iter(self.versions)

    def position(self, version: Any) -> int | None:
        """Where `version` is in the columns, or None."""
        if type(version) is not int:
            return None
        i = bisect_left(self.versions, version)
        return i if i < len(self.versions) and self.versions[i] == version else None

    def __contains__(self, version: object) -> bool:
        return self.position(version) is not None

    def __getitem__(self, version: int) -> VersionFacts:
        i = self.position(version)
        if i is None:
            raise KeyError(version)
        return self.at(i)

    def at(self, i: int) -> VersionFacts:
        """The facts of the `i`-th version (in version order)."""
        s, stamp = self.state_of[i], self.stamps[i]
        return VersionFacts(self.versions[i], self.sizes[i], self.mtimes[i], None if math.isnan(stamp) else stamp,
                            None if s < 0 else self.state(s))

    def state(self, s: int) -> dict[str, int]:
        """State `s` as a map of region to merged generation (one object per state)."""
        d = self._dicts.get(s)
        if d is None:
            w = len(self.regions)
            d = self._dicts[s] = {r: g for r, g in zip(self.regions, self.matrix[s * w:(s + 1) * w]) if g != ABSENT}
        return d

    def column(self, region_id: str) -> array | None:
        """Each state's merged generation of `region_id` (ABSENT: not named); None when no
        state names it."""
        if self._index is None:
            self._index = {r: j for j, r in enumerate(self.regions)}
        j = self._index.get(region_id)
        return None if j is None else self.matrix[j::len(self.regions)]

    # -- the summary's bytes --------------------------------------------------------------------

    def to_parts(self) -> tuple[dict[str, Any], bytes]:
        """The columns as a small JSON-able map (counts, regions) and their raw little-endian
        bytes (`sealed.seal_blob`), unused states dropped."""
        table = self if _all_used(self.state_of, self._state_count()) else self.select(range(len(self)))
        cols = (table.versions, table.sizes, table.mtimes, table.stamps, table.state_of, table.matrix)
        blob = b"".join((a if sys.byteorder == "little" else _swapped(a)).tobytes() for a in cols)
        return {"count": len(table), "regions": table.regions, "states": table._state_count()}, blob

    def select(self, positions: Iterable[int]) -> FactTable:
        """The versions at `positions` (increasing), with only the states they have."""
        pos = list(positions)
        renumber: dict[int, int] = {}
        state_of = array("q")
        for s in map(self.state_of.__getitem__, pos):
            state_of.append(s if s < 0 else renumber.setdefault(s, len(renumber)))
        w = len(self.regions)
        matrix = array("Q")
        for s in renumber:  # in the order of their new numbers
            matrix.extend(self.matrix[s * w:(s + 1) * w])
        regions = self.regions
        out = FactTable(array("Q", map(self.versions.__getitem__, pos)), array("Q", map(self.sizes.__getitem__, pos)),
                        array("d", map(self.mtimes.__getitem__, pos)), array("d", map(self.stamps.__getitem__, pos)),
                        state_of, regions, matrix)
        out._dicts = {renumber[s]: d for s, d in self._dicts.items() if s in renumber}
        return out

    @classmethod
    def from_parts(cls, meta: Any, blob: memoryview | bytes) -> FactTable:
        """The table `to_parts` wrote; ValueError (with why) for anything else. Checked a column
        at a time, in C (numpy over the arrays' buffers)."""
        if not isinstance(meta, dict):
            raise ValueError("the version columns are not a map")
        n, regions, k = meta.get("count"), meta.get("regions"), meta.get("states")
        if type(n) is not int or n < 0 or type(k) is not int or not 0 <= k <= n:  # each state is a version's
            raise ValueError("a bad version or state count")
        if not (isinstance(regions, list) and all(isinstance(r, str) for r in regions)
                and regions == sorted(set(regions))):
            raise ValueError("a bad region list")
        blob = memoryview(blob).cast("B")
        if len(blob) != 8 * (5 * n + k * len(regions)):
            raise ValueError(f"columns of {len(blob)} bytes, expected {8 * (5 * n + k * len(regions))}")
        cols = [_column(tc, blob[8 * n * i:8 * n * (i + 1)]) for i, tc in enumerate("QQddq")]
        versions, sizes, mtimes, stamps, state_of = cols
        matrix = _column("Q", blob[40 * n:])
        v, so = np.frombuffer(versions, dtype=np.uint64), np.frombuffer(state_of, dtype=np.int64)
        if n and (v[0] < 1 or not (v[1:] > v[:-1]).all()):
            raise ValueError("versions are not distinct and in order")
        if n and (so.min() < _NO_STATE or so.max() >= k):
            raise ValueError("a version's merge state is not in the table")
        if not _all_used(state_of, k):  # `to_parts` drops the states no version has
            raise ValueError("a merge state no version has")
        if not (np.isfinite(np.frombuffer(mtimes, dtype=np.float64)).all()
                and not np.isinf(np.frombuffer(stamps, dtype=np.float64)).any()):
            raise ValueError("a bad manifest or commit time")
        return cls(versions, sizes, mtimes, stamps, state_of, regions, matrix)  # k states: all used, as checked


def _all_used(state_of: array, k: int) -> bool:
    """Whether every one of `k` states is some version's (`state_of` within -1 .. k-1)."""
    so = np.frombuffer(state_of, dtype=np.int64)
    return bool(np.count_nonzero(np.bincount(so[so >= 0], minlength=k)) == k) if k else True


def _column(typecode: str, raw: memoryview) -> array:
    a = array(typecode)
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def _row(merged: Mapping[str, int], regions: list[str]) -> list[int]:
    """A state's cells. The one u64 a state cannot hold (ABSENT marks a region it does not name)
    is held as the one below: lower merge progress only makes GC keep more, and the probe, which
    compares the newest manifest with its row, then reads the table again (no real table merges
    that far)."""
    if any(type(g) is not int or not 0 <= g < _U64 for g in merged.values()):
        raise ValueError("a merged generation out of range")
    return [min(merged.get(r, ABSENT), ABSENT - 1) if r in merged else ABSENT for r in regions]


def _check(f: VersionFacts) -> None:
    """What `from_json` accepts, checked when a fact is added (so that what is written is read)."""
    if not (type(f.version) is int and 1 <= f.version < _U64 and type(f.size) is int and 0 <= f.size < _U64):
        raise ValueError(f"version {f.version!r}: a version or size out of range")
    if not math.isfinite(f.mtime) or (f.stamp is not None and math.isinf(f.stamp)):
        raise ValueError(f"version {f.version!r}: a manifest or commit time that is not a time")
