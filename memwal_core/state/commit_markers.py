"""The markers of merge commits not verified yet: `_memwal/unverified/{id}.json`, one per commit
in flight (the version it read and the generations it commits, not their rows).

The merger writes one before each commit and deletes it once the commit is verified
(`jobs/merge/unverified.py` settles the ones a crash left). GC reads them too: a commit's
generations must stay until it is verified, since verification derives the commit's keys from
them, even when the commit landed and its progress says they are merged.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Iterable, Protocol

from memwal_core.errors import one_line
from memwal_core.state import layout
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.merge")


class _Generation(Protocol):  # the merger's PlannedGeneration
    region_id: str
    generation: int
    path: str


@dataclass(frozen=True)
class PendingCommit:
    """A merge commit about to be made: the version it read and its generations (region,
    generation, path), contiguous per region from the region's progress at the read."""

    id: str
    read_version: int
    generations: tuple[tuple[str, int, str], ...]
    recorded_at: float = 0.0

    @property
    def key(self) -> str:
        return layout.unverified_key(self.id)

    @property
    def by_region(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rid, g, _ in self.generations:
            out.setdefault(rid, []).append(g)
        return {rid: sorted(gs) for rid, gs in out.items()}

    @property
    def progress(self) -> dict[str, int]:
        """The merged generation each region reaches with the commit."""
        return {rid: gs[-1] for rid, gs in self.by_region.items()}

    @property
    def previous(self) -> dict[str, int]:
        """Each region's merged generation before the commit."""
        return {rid: gs[0] - 1 for rid, gs in self.by_region.items()}

    def to_json(self) -> bytes:
        return json.dumps({"id": self.id, "read_version": self.read_version, "recorded_at": self.recorded_at,
                           "generations": [list(g) for g in self.generations]}).encode()

    @staticmethod
    def from_json(raw: bytes) -> "PendingCommit":
        d = json.loads(raw)
        gens = tuple((str(r), int(g), layout.validate_generation_path(str(p), int(g))) for r, g, p in d["generations"])
        return PendingCommit(str(d["id"]), int(d["read_version"]), gens, float(d.get("recorded_at", 0.0)))


def record(loc: TableLocation, read_version: int, gens: Iterable[_Generation]) -> PendingCommit:
    """Write the marker of a commit about to be made (before it: a crash after the commit finds it)."""
    pending = PendingCommit(uuid.uuid4().hex, read_version,
                            tuple((g.region_id, g.generation, g.path) for g in gens), time.time())
    loc.store.put(pending.key, pending.to_json())
    return pending


def clear(loc: TableLocation, pending: PendingCommit) -> None:
    """Delete a settled commit's marker; failing is logged (a later run settles it again:
    verifying a verified commit once more is harmless)."""
    try:
        loc.store.delete_many([pending.key])
    except Exception as e:  # noqa: BLE001 - see above
        log.warning("could not delete the marker %s of a verified merge commit: %s", pending.key, one_line(e))


def load(loc: TableLocation) -> list[PendingCommit]:
    out = []
    for o in loc.store.list(layout.UNVERIFIED_DIR):
        if layout.unverified_id_of(o.key) is None:
            continue
        out.append(PendingCommit.from_json(loc.store.get(o.key)))
    return sorted(out, key=lambda p: (p.recorded_at, p.id))


def held_from(markers: list[PendingCommit]) -> dict[str, int]:
    """Per region, the highest generation below every unverified commit's first one: GC keeps
    the generations above it until the commits are verified."""
    out: dict[str, int] = {}
    for pending in markers:
        for rid, previous in pending.previous.items():
            out[rid] = min(out.get(rid, previous), previous)
    return out
