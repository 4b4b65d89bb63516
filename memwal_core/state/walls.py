"""Permanent walls, recorded where `status` and the checks can see them.

The merger decides its walls afresh in every run and reports them in its result; a reader of
the table (`memwal status`, the `merge_lag` check) sees only manifests, where a region stuck
behind a refused generation looks like a region with a backlog. So the merger records each
permanent wall at `_memwal/walls/{region}.json` and deletes the record when the region merges
past it or a later run finds the region no longer refused. One small object per *stuck*
region: healthy tables have none, and reading them is one listing.

A record may carry evidence the next run needs: the primary keys a region shares with
another region's already merged rows (found across batches of a run). A later run cannot
see those rows again, so it refuses the region again while its pending rows still hold one of
those keys (`jobs/merge/exclusivity.py`).

A record the merger cannot read is not a record it may ignore: some records are the only
trace of a verdict (a failed commit verification, shared keys), so `load` says which regions'
records are unknown and the merger stops those regions for the run (`jobs/merge/walls.py`).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import dataclass, field

import pyarrow as pa

from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.state import layout
from memwal_core.state.objects import NotFound
from memwal_core.state.store import ObjectStore

log = logging.getLogger("memwal.walls")

MAX_EVIDENCE_KEYS = 1000  # keys kept as evidence per record (any one still pending refuses again)


@dataclass(frozen=True)
class WallRecord:
    """A recorded wall: the region's failure (its generation: the first one not merged), when
    it was recorded, and the evidence a later run needs."""

    failure: RegionFailure
    recorded_at: float = 0.0
    shared_keys: pa.Table | None = None   # evidence: keys another region's merged rows hold
    other_region: str | None = None

    @property
    def region_id(self) -> str:
        return self.failure.region_id

    @property
    def generation(self) -> int:
        """The first generation not merged (a recorded wall always has one)."""
        return self.failure.generation or 0

    @property
    def reason(self) -> str:
        return self.failure.reason

    def to_json(self) -> bytes:
        f = self.failure
        d = {"region": f.region_id, "generation": f.generation, "reason": f.reason, "permanent": f.permanent,
             "step": f.step, "offending_rows": f.offending_rows,
             "recorded_at": self.recorded_at or time.time(), "other_region": self.other_region}
        if self.shared_keys is not None and self.shared_keys.num_rows:
            sink = pa.BufferOutputStream()
            keys = self.shared_keys.slice(0, MAX_EVIDENCE_KEYS)
            with pa.ipc.new_stream(sink, keys.schema) as w:
                w.write_table(keys)
            d["shared_keys_ipc"] = base64.b64encode(sink.getvalue().to_pybytes()).decode()
        return json.dumps(d).encode()

    @staticmethod
    def from_json(raw: bytes) -> "WallRecord":
        """A record as written by `to_json`, or by earlier versions (no `permanent`, `step` or
        `offending_rows`: only permanent walls were ever recorded)."""
        d = json.loads(raw)
        keys = None
        if d.get("shared_keys_ipc"):
            keys = pa.ipc.open_stream(pa.py_buffer(base64.b64decode(d["shared_keys_ipc"]))).read_all()
        failure = RegionFailure(str(d["region"]), int(d["generation"]), str(d.get("reason", "")),
                                bool(d.get("permanent", True)), str(d.get("step", "merge")),
                                int(d.get("offending_rows", 0)))
        return WallRecord(failure, float(d.get("recorded_at", 0.0)), keys, d.get("other_region"))


@dataclass
class RecordedWalls:
    """What `load` found: the readable records, the regions whose record exists but could not
    be read (region -> why), and why the listing itself failed (then nothing is known)."""

    records: dict[str, WallRecord] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    def unknown(self, region_id: str) -> str | None:
        """Why whether `region_id` has a record is not known (None: it is known)."""
        if self.error is not None:
            return self.error
        return self.unreadable.get(region_id)


def load(store: ObjectStore) -> RecordedWalls:
    """Every recorded wall, and what could not be read. A record deleted between the listing
    and its read is no record; any other failure (a store error, a garbled object) makes its
    region's record unknown."""
    try:
        listed = list(store.list(layout.WALLS_DIR))
    except Exception as e:  # noqa: BLE001 - reported: every region's record is unknown
        error = f"wall records under {layout.WALLS_DIR} could not be listed: {one_line(e)}"
        log.error("%s", error)
        return RecordedWalls(error=error)
    return _read(store, listed)


def read_all(store: ObjectStore) -> dict[str, WallRecord]:
    """Every readable recorded wall (region -> record), for reports: a failed listing raises, an
    unreadable record is logged and left out (the merger uses `load`, which keeps it)."""
    return _read(store, list(store.list(layout.WALLS_DIR))).records


def _read(store: ObjectStore, listed: list) -> RecordedWalls:
    out = RecordedWalls()
    for o in listed:
        name = o.key.rsplit("/", 1)[-1].removesuffix(".json")
        if not layout.is_region_id(name) or o.key != layout.wall_key(name):
            continue
        try:
            out.records[name] = WallRecord.from_json(store.get(o.key))
        except NotFound:
            continue  # cleared meanwhile
        except Exception as e:  # noqa: BLE001 - garbled, or the store failed: unknown, not absent
            out.unreadable[name] = f"wall record {o.key} unreadable: {one_line(e)}"
            log.error("%s", out.unreadable[name])
    return out


def write(store: ObjectStore, rec: WallRecord) -> None:
    store.put(layout.wall_key(rec.region_id), rec.to_json())


def clear(store: ObjectStore, region_ids: list[str]) -> None:
    if region_ids:
        store.delete_many([layout.wall_key(r) for r in region_ids])
