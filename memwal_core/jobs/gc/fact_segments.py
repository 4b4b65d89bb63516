"""The older retained versions' facts, sealed in an object of their own and described by what a
pass needs of them.

A GC pass reads the version summary (`history.py`) on every run, and the retention holds a week
of versions: thousands. Of the older ones a pass needs little: the oldest version (the probe
HEADs it, with its size), per region the lowest merge progress and the oldest version that has
it (the time-travel bound: `retention.py`), the oldest commit time (whether Lance's cleanup has
anything to remove: `run.py`), the oldest version with a MemWAL index and the newest without one
(the lifetime check asks which versions carry it), and per region the progress at the newest
sealed version with an index and the newest version below it, with their commit times (until
when a region no newer version reads holds its last generation). So the summary keeps
its newest versions as columns (the *tail*, read and written on each pass) and, once the tail
holds more than `TAIL_MAX`, seals all but the newest `TAIL_KEEP` into
`_memwal/gc_versions/{digest}.bin`: written once, named by the digest of its bytes, described in
the summary by those aggregates (`SealedPart`). A pass reads the sealed object only for what the
aggregates do not answer: a version's own facts (the lifetime check at an old version, a dry
run's cleanup), the end of a hold that no tail version reads, the versions before an
initialization older than the tail, and on every pass that lists `_versions/` (once per
interval), which seals again what it read.

The aggregates are computed from the sealed facts when they are sealed, and the summary that
carries them is checksummed (`sealed.py`): they are as exact as the facts. The object is checked
when read (its digest is its name; its count and ends are the summary's). One that cannot be
read (gone, garbled) is read around: the versions it held are read from their manifests, and
the summary is written again.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from memwal_core.jobs.gc.fact_table import ABSENT, FactTable
from memwal_core.state import layout, sealed

# Every pass reads and writes the tail; a reseal reads and writes every sealed version (numpy
# columns). A tail of 64-192 versions keeps the per-pass part small and reseals once per 128
# commits (on every pass where more than 128 land between two passes: the cost of one summary).
TAIL_MAX = 192  # versions the summary's tail holds before the older ones are sealed
TAIL_KEEP = 64  # versions left in the tail when they are
FORMAT = 1
DIR = layout.GC_VERSIONS_DIR
_SUFFIX = ".bin"


@dataclass(frozen=True)
class SealedPart:
    """The sealed versions (`count` of them, `first` .. `last`) and what a pass needs of them."""

    key: str
    count: int
    first: int  # the oldest version
    first_size: int  # its manifest's size
    last: int  # the newest (every tail version is above it)
    min_stamp: float | None  # the oldest commit time (None: no version has one)
    no_stamp: bool  # some version has no commit time
    indexed_first: int | None  # the oldest version with a MemWAL index (None: none has one)
    unindexed_last: int | None  # the newest version without one (None: every one has it)
    lowest: dict[str, tuple[int, int]]  # region -> (lowest merge progress, the oldest version with it)
    last_indexed: tuple[int, float | None] | None = None  # the newest version with an index, its commit time
    # region -> (its progress at `last_indexed`, the newest version below that progress, its commit time)
    top: dict[str, tuple[int, int | None, float | None]] = field(default_factory=dict)

    def lowest_of(self, region_id: str) -> tuple[int, int] | None:
        """A region's lowest merge progress over the sealed versions with a MemWAL index (a
        region a version's index does not name: 0), with the oldest version that has it; None
        when no sealed version has an index."""
        if self.indexed_first is None:
            return None
        return self.lowest.get(region_id, (0, self.indexed_first))

    def newest_below(self, region_id: str, generation: int) -> tuple[bool, float | None]:
        """(told, commit time) of the newest sealed version whose progress in a region is below
        `generation`, when the aggregates tell (above or at the progress of the newest version
        with an index); (False, None) when the facts must be read."""
        if self.last_indexed is None:
            return True, None  # no sealed version reads a generation
        top, version, stamp = self.top.get(region_id, (0, None, None))
        if generation > top:
            return True, self.last_indexed[1]
        if generation == top:
            return True, stamp if version is not None else None
        return False, None

    def indexed(self, version: int) -> bool | None:
        """Whether sealed `version` carries the MemWAL index, when the aggregates tell (the
        versions are contiguous and it is above the newest without one); None: not told."""
        if not (self.first <= version <= self.last and self.count == self.last - self.first + 1):
            return None
        return True if self.unindexed_last is None or version > self.unindexed_last else None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "count": self.count, "first": self.first, "first_size": self.first_size,
                "last": self.last, "min_stamp": self.min_stamp, "no_stamp": self.no_stamp,
                "indexed_first": self.indexed_first, "unindexed_last": self.unindexed_last,
                "last_indexed": list(self.last_indexed) if self.last_indexed is not None else None,
                "top": {r: list(x) for r, x in sorted(self.top.items())}, "lowest": {r: list(x) for r, x in sorted(self.lowest.items())}}

    @staticmethod
    def from_json(d: Any) -> SealedPart:
        """What `to_json` wrote; ValueError (with why) for anything else."""
        try:
            key, count, first, first_size, last = (d["key"], d["count"], d["first"], d["first_size"], d["last"])
            min_stamp, no_stamp, indexed_first, lowest = d["min_stamp"], d["no_stamp"], d["indexed_first"], d["lowest"]
            unindexed_last, last_indexed, top = d["unindexed_last"], d["last_indexed"], d["top"]
        except (TypeError, KeyError):
            raise ValueError("a bad sealed part") from None
        ok = (isinstance(key, str) and key.startswith(DIR + "/") and key.endswith(_SUFFIX) and "/" not in key[len(DIR) + 1:]
              and all(type(x) is int for x in (count, first, first_size, last)) and count >= 1 and first >= 1
              and first_size >= 0 and first <= last and count <= last - first + 1 and type(no_stamp) is bool
              and (min_stamp is None or (type(min_stamp) in (int, float) and _finite(min_stamp)))
              and (indexed_first is None or (type(indexed_first) is int and first <= indexed_first <= last))
              and (unindexed_last is None or (type(unindexed_last) is int and first <= unindexed_last <= last))
              and (indexed_first is not None or unindexed_last is not None)
              and isinstance(lowest, dict) and (indexed_first is not None or not lowest))
        ok = ok and (last_indexed is None) == (indexed_first is None) and (last_indexed is None or (
            isinstance(last_indexed, list) and len(last_indexed) == 2 and type(last_indexed[0]) is int
            and indexed_first <= last_indexed[0] <= last and _stamp(last_indexed[1]))) and isinstance(top, dict) \
            and (indexed_first is not None or not top)
        tops: dict[str, tuple[int, int | None, float | None]] = {}
        for r, x in (top.items() if ok else ()):
            if not (isinstance(x, list) and len(x) == 3 and type(x[0]) is int and 0 <= x[0] < 2**64
                    and (x[1] is None or (type(x[1]) is int and first <= x[1] <= last)) and _stamp(x[2])):
                ok = False
                break
            tops[r] = (x[0], x[1], x[2])
        rows: dict[str, tuple[int, int]] = {}
        for r, x in (lowest.items() if ok else ()):
            if not (isinstance(x, list) and len(x) == 2 and all(type(v) is int for v in x) and 0 <= x[0] < 2**64
                    and indexed_first <= x[1] <= last):
                ok = False
                break
            rows[r] = (x[0], x[1])
        if not ok:
            raise ValueError("a bad sealed part")
        return SealedPart(key, count, first, first_size, last, min_stamp, no_stamp, indexed_first, unindexed_last,
                          rows, None if last_indexed is None else (last_indexed[0], last_indexed[1]), tops)


def _finite(x: int | float) -> bool:
    return type(x) is float and math.isfinite(x)


def _stamp(x: Any) -> bool:
    """A commit time as `seal` writes it: a finite float, or None."""
    return x is None or _finite(x)


def seal(table: FactTable) -> tuple[SealedPart, bytes]:
    """`table` (not empty) as a sealed object's bytes, and its description."""
    meta, blob = table.to_parts()
    raw = sealed.seal_blob({"facts": meta}, blob, FORMAT)
    key = _key(raw)
    stamps = np.frombuffer(table.stamps, dtype=np.float64)
    have = stamps[~np.isnan(stamps)]
    versions = np.frombuffer(table.versions, dtype=np.uint64)
    so = np.frombuffer(table.state_of, dtype=np.int64)
    with_index = np.nonzero(so >= 0)[0]  # positions of the versions with a MemWAL index
    without = versions[so < 0]
    lowest: dict[str, tuple[int, int]] = {}
    top: dict[str, tuple[int, int | None, float | None]] = {}

    def stamp(i: int) -> float | None:
        return None if math.isnan(stamps[i]) else float(stamps[i])

    if len(with_index) and table.regions:
        states = np.frombuffer(table.matrix, dtype=np.uint64).reshape(-1, len(table.regions))
        for j, rid in enumerate(table.regions):  # a region a state does not name counts as 0
            of_state = np.where(states[:, j] == ABSENT, np.uint64(0), states[:, j])
            values = of_state[so[with_index]]
            low = values.min()
            lowest[rid] = (int(low), int(versions[with_index[int(np.argmax(values == low))]]))
            below = np.nonzero(values < values[-1])[0]
            i = int(with_index[below[-1]]) if len(below) else None
            top[rid] = (int(values[-1]), None if i is None else int(versions[i]), None if i is None else stamp(i))
    part = SealedPart(key, len(table), table.versions[0], table.sizes[0], table.versions[-1],
                      float(have.min()) if len(have) else None, bool(len(have) < len(stamps)),
                      int(versions[with_index[0]]) if len(with_index) else None,
                      int(without.max()) if len(without) else None, lowest,
                      (int(versions[with_index[-1]]), stamp(int(with_index[-1]))) if len(with_index) else None, top)
    return part, raw


def _key(raw: bytes) -> str:
    """A sealed object's name: the digest of its bytes."""
    return f"{DIR}/{hashlib.sha256(raw).hexdigest()[:32]}{_SUFFIX}"


def unseal(part: SealedPart, raw: bytes) -> FactTable:
    """The facts of `part`'s object `raw`; ValueError (with why) for anything else."""
    if _key(raw) != part.key:
        raise ValueError("its bytes are not the ones it is named by")
    d, blob = sealed.unseal_blob(raw, FORMAT)
    table = FactTable.from_parts(d.get("facts") if isinstance(d, dict) else None, blob)
    if (len(table), table.versions[0] if len(table) else None, table.sizes[0] if len(table) else None,
            table.versions[-1] if len(table) else None) != (part.count, part.first, part.first_size, part.last):
        raise ValueError("it holds other versions than the summary says")
    return table


class VersionList(Sequence):
    """The retained versions, counted without reading the sealed ones (`len`); anything else
    reads them (`full`: all the versions' facts)."""

    def __init__(self, count: int, full: Callable[[], FactTable]):
        self._count, self._full = count, full
        self._list: list[int] | None = None

    def _versions(self) -> list[int]:
        if self._list is None:
            self._list = self._full().versions.tolist()
        return self._list

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):  # noqa: ANN001 - an index or a slice, as a list's
        return self._versions()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._versions())

    def __contains__(self, v: object) -> bool:
        return v in self._versions()

    def __eq__(self, other: object) -> bool:
        return list(self) == (list(other) if isinstance(other, (list, tuple, VersionList)) else other)

    def __repr__(self) -> str:
        return repr(self._versions())
