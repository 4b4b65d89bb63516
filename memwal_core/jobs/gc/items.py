"""What GC deletes: the kinds of item, `GcItem`, and `GcError` (GC cannot tell what is safe to
delete for the whole table). Every other GC module speaks of these."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memwal_core.errors import MemwalError

GENERATION = "generation"
WAL = "wal"
MANIFEST = "manifest"
ORPHAN = "orphan"
LEAKED = "leaked"  # a base-table file of a lost or crashed commit (`gc/leaks.py`); region_id ""
KINDS = (GENERATION, WAL, MANIFEST, ORPHAN, LEAKED)
BASE_VERSION = "base_version"  # a base-table version Lance's cleanup removes (not a GcItem)

# The region id under which a failed leak scan is reported (`region_errors`, `failures`): it is
# table-wide, but it fails the step like a region does.
LEAKS_KEY = "leaked files"


class GcError(MemwalError):
    """GC cannot establish what is safe to delete for the whole table (nothing is deleted)."""


@dataclass(frozen=True)
class GcItem:
    """One thing to delete: a directory (generation, orphan) or one object (WAL, manifest)."""

    kind: str
    region_id: str
    path: str  # directory prefix or object key, relative to the table root
    bytes: int
    reason: str
    keys: tuple[str, ...]  # the objects deleted for this item
    number: int | None = None  # generation, WAL position or manifest version

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["objects"] = len(self.keys)
        del d["keys"]
        return d
