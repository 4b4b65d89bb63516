"""WAL entries of a region: find the tail by existence probes, read an entry's metadata.

pylance 14 writes each entry as an Arrow IPC stream `wal/{bitrev(position)}.arrow` (positions
start at 1) whose schema metadata carries `writer_epoch` and `generation`; a writer that claims
a region first writes a data-less fence sentinel (`fence_sentinel: true`). Lance 13 (LanceDB
0.40) writes `writer_epoch` only: `generation` is then None, and GC decides by position.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pyarrow as pa

from memwal_core.errors import MemwalError
from memwal_core.state import layout
from memwal_core.state.store import NotFound, ObjectStore


class WalEntryError(MemwalError, ValueError):
    pass


@dataclass(frozen=True)
class WalEntryMeta:
    position: int
    writer_epoch: int
    generation: int | None
    fence_sentinel: bool
    size: int


def probe_tail(store: ObjectStore, region_id: str, start: int) -> int:
    """The last existing position, probing `start`, `start + 1`, ... (`start - 1` if none)."""
    pos = max(1, start)
    while store.exists(layout.wal_key(region_id, pos)):
        pos += 1
    return pos - 1


def read_entry_meta(store: ObjectStore, region_id: str, position: int) -> WalEntryMeta:
    key = layout.wal_key(region_id, position)
    try:
        raw = store.get(key)
    except NotFound:
        raise WalEntryError(f"region {region_id}: WAL entry {position} ({key}) does not exist") from None
    try:
        schema = pa.ipc.open_stream(io.BytesIO(raw)).schema
    except (pa.ArrowInvalid, OSError) as e:
        raise WalEntryError(f"region {region_id}: WAL entry {key} is not an Arrow IPC stream: {e}") from None
    md = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    try:
        epoch = int(md["writer_epoch"])
    except (KeyError, ValueError):
        raise WalEntryError(f"region {region_id}: WAL entry {key} has no writer_epoch") from None
    gen = md.get("generation")
    return WalEntryMeta(position, epoch, int(gen) if gen is not None else None,
                        md.get("fence_sentinel") == "true", len(raw))
