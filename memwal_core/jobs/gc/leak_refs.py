"""The files the retained base-table versions reference, each manifest read once (`leaks.py`).

The leak scan needs the union of what every retained version references. Versions are immutable
and only ever added above the newest one, so the union is kept beside the table in
`_memwal/gc_refs.json` as, per file (and per index uuid), the runs of consecutive *recorded*
versions that reference it: version v extends a file's last run when that run ends at the newest
version recorded before v, else starts a new one. So every recorded version inside a run
references the file, and a file is referenced by the retained versions exactly when one of them
lies inside one of its runs: removed versions need no re-reading, they just stop counting.

A pure cache: it is used only when every recorded version the listing still shows has the same
manifest key, size and modification time, and every listed version it does not know is newer than
all it recorded (a version slot freed by a cleanup and committed again, a table re-created at the
same URI: read everything again); a missing, garbled or mis-checksummed summary is ignored. Files
whose runs hold no retained version any more are dropped from it (no later version falls inside
an old run).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from memwal_core.errors import one_line
from memwal_core.state import layout, sealed
from memwal_core.state.store import NotFound, ObjectInfo, TableLocation

log = logging.getLogger("memwal.gc")

FORMAT = 1
Runs = list[list[int]]  # [[first, last], ...] ascending


@dataclass
class RefsSummary:
    """Recorded versions (version -> (key, size, mtime)), the newest recorded (`top`), and the runs
    of recorded versions referencing each file and each index uuid."""

    versions: dict[int, tuple[str, int, float]] = field(default_factory=dict)
    top: int = 0
    files: dict[str, Runs] = field(default_factory=dict)
    uuids: dict[str, Runs] = field(default_factory=dict)

    def add(self, version: int, info: ObjectInfo, files: frozenset[str], uuids: frozenset[str]) -> None:
        """Record `version` (newer than every recorded one) and what it references."""
        if version <= self.top:
            raise ValueError(f"version {version} is not newer than {self.top}")
        for names, runs in ((files, self.files), (uuids, self.uuids)):
            for name in names:
                r = runs.setdefault(name, [])
                if r and r[-1][1] == self.top and self.top > 0:
                    r[-1][1] = version
                else:
                    r.append([version, version])
        self.versions[version] = (info.key, info.size, info.mtime)
        self.top = version

    def referenced(self, retained: list[int]) -> tuple[set[str], set[str]]:
        """(files, uuids) some version of `retained` (sorted) references."""
        def live(runs: Runs) -> bool:
            for a, b in runs:
                i = bisect.bisect_left(retained, a)
                if i < len(retained) and retained[i] <= b:
                    return True
            return False

        return {f for f, r in self.files.items() if live(r)}, {u for u, r in self.uuids.items() if live(r)}

    def prune(self, retained: list[int]) -> bool:
        """Forget versions no longer retained and names no retained version references; whether
        anything was forgotten."""
        keep = set(retained)
        before = (len(self.versions), len(self.files), len(self.uuids))
        self.versions = {v: x for v, x in self.versions.items() if v in keep}
        files, uuids = self.referenced(retained)
        self.files = {f: r for f, r in self.files.items() if f in files}
        self.uuids = {u: r for u, r in self.uuids.items() if u in uuids}
        return before != (len(self.versions), len(self.files), len(self.uuids))

    def encode(self) -> bytes:
        return sealed.seal({"versions": [[v, *x] for v, x in sorted(self.versions.items())], "top": self.top,
                            "files": self.files, "uuids": self.uuids}, FORMAT)

    @staticmethod
    def decode(raw: bytes) -> "RefsSummary":
        d = sealed.unseal(raw, FORMAT)
        out = RefsSummary(top=d["top"])
        if type(out.top) is not int or out.top < 0:
            raise ValueError("bad top")
        for v, key, size, mtime in d["versions"]:
            if not (type(v) is int and 1 <= v <= out.top and isinstance(key, str) and type(size) is int
                    and isinstance(mtime, (int, float))):
                raise ValueError("a bad version row")
            out.versions[v] = (key, size, float(mtime))
        for name in ("files", "uuids"):
            runs = d[name]
            if not isinstance(runs, dict):
                raise ValueError(f"bad {name}")
            for k, r in runs.items():
                if not (isinstance(r, list) and r and all(
                        isinstance(x, list) and len(x) == 2 and all(type(y) is int for y in x) and 1 <= x[0] <= x[1]
                        <= out.top for x in r)):
                    raise ValueError(f"bad runs of {k!r}")
            setattr(out, name, {k: [list(x) for x in r] for k, r in runs.items()})
        return out


def load(loc: TableLocation) -> RefsSummary | None:
    try:
        raw = loc.store.get(layout.GC_REFS_KEY)
    except NotFound:
        return None
    except Exception as e:  # noqa: BLE001 - a cache
        log.warning("%s could not be read (%s); reading every retained manifest", layout.GC_REFS_KEY, one_line(e))
        return None
    try:
        return RefsSummary.decode(raw)
    except Exception as e:  # noqa: BLE001 - a cache: anything it cannot be decoded as means reading around it
        log.warning("%s ignored (%s); reading every retained manifest and writing it again", layout.GC_REFS_KEY, e)
        return None


def save(loc: TableLocation, summary: RefsSummary) -> None:
    try:
        loc.store.put(layout.GC_REFS_KEY, summary.encode())
    except Exception as e:  # noqa: BLE001 - a cache
        log.warning("could not write %s: %s", layout.GC_REFS_KEY, one_line(e))


def usable(summary: RefsSummary | None, listed: dict[int, ObjectInfo]) -> bool:
    """Whether `summary` describes the listed versions it recorded, and every other listed
    version is newer than all it recorded (see the module docstring)."""
    if summary is None:
        return False
    for v, info in listed.items():
        known = summary.versions.get(v)
        if known is not None:
            if known != (info.key, info.size, info.mtime):
                return False
        elif v <= summary.top:
            return False
    return True
