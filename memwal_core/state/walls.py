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
those keys (`merge._Run.evidence`).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import dataclass

import pyarrow as pa

from memwal_core.state import layout
from memwal_core.state.store import ObjectStore

log = logging.getLogger("memwal.walls")

MAX_EVIDENCE_KEYS = 1000  # keys kept as evidence per record (any one still pending refuses again)


@dataclass(frozen=True)
class WallRecord:
    region_id: str
    generation: int          # the first generation not merged
    reason: str
    recorded_at: float = 0.0
    shared_keys: pa.Table | None = None   # evidence: keys another region's merged rows hold
    other_region: str | None = None

    def to_json(self) -> bytes:
        d = {"region": self.region_id, "generation": self.generation, "reason": self.reason,
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
        d = json.loads(raw)
        keys = None
        if d.get("shared_keys_ipc"):
            keys = pa.ipc.open_stream(pa.py_buffer(base64.b64decode(d["shared_keys_ipc"]))).read_all()
        return WallRecord(str(d["region"]), int(d["generation"]), str(d.get("reason", "")),
                          float(d.get("recorded_at", 0.0)), keys, d.get("other_region"))


def read_all(store: ObjectStore) -> dict[str, WallRecord]:
    """Every recorded wall (region -> record); an unreadable record is logged and skipped (it is
    a report, never what decides a merge on its own)."""
    out: dict[str, WallRecord] = {}
    for o in store.list(layout.WALLS_DIR):
        name = o.key.rsplit("/", 1)[-1].removesuffix(".json")
        if not layout.is_region_id(name) or o.key != layout.wall_key(name):
            continue
        try:
            out[name] = WallRecord.from_json(store.get(o.key))
        except Exception as e:  # noqa: BLE001 - vanished meanwhile or garbled
            log.warning("wall record %s unreadable: %s: %s", o.key, type(e).__name__, e)
    return out


def write(store: ObjectStore, rec: WallRecord) -> None:
    store.put(layout.wall_key(rec.region_id), rec.to_json())


def clear(store: ObjectStore, region_ids: list[str]) -> None:
    if region_ids:
        store.delete_many([layout.wall_key(r) for r in region_ids])
