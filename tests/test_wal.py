"""memwal_core.state.wal on WAL entries written by pylance's ShardWriter.

The tail found by existence probes is checked against the files on disk, and each entry's
metadata against the region manifest and the flushed generation that holds its rows.
"""

from __future__ import annotations

import io
import os
import uuid

import lance
import pyarrow as pa
import pytest

from memwal_core.state import layout, region, wal
from memwal_core.state.store import LocalStore
from memwal_core.tools import demo


def rows(first: int, n: int, version: int):
    return demo.rows_table([demo.row(k, version) for k in range(first, first + n)])


@pytest.fixture
def claimed_three_times(table_loc):
    """One region claimed by three writers in turn (epochs 1, 2, 3), with puts and deletes."""
    ds = demo.create_table(table_loc, sharding="manual", base_rows=10)
    rid = str(uuid.uuid4())
    with ds.mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(100, 6, 1))
        w.put(rows(106, 6, 1))  # does not fit: generation 1 is flushed first
        w.put(rows(112, 3, 1))
    with lance.dataset(table_loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(100, 2, 2))
        w.delete(pa.table({"id": pa.array([3, 104], pa.int64())}))
    with lance.dataset(table_loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(200, 4, 3))
    return table_loc, rid


def wal_positions_on_disk(loc, rid: str) -> list[int]:
    d = os.path.join(loc.store.root, layout.wal_dir(rid))
    return sorted(layout.parse_bitrev(f) for f in os.listdir(d))


def test_probe_tail_matches_the_files(claimed_three_times):
    loc, rid = claimed_three_times
    on_disk = wal_positions_on_disk(loc, rid)
    tail = len(on_disk)
    assert on_disk == list(range(1, tail + 1)) and tail >= 7
    store = LocalStore(loc.store.root)
    assert wal.probe_tail(store, rid, 1) == tail
    assert store.stats["head"] == tail + 1 and store.stats["list"] == 0
    assert wal.probe_tail(store, rid, 0) == tail
    assert wal.probe_tail(store, rid, tail - 2) == tail
    assert wal.probe_tail(store, rid, tail) == tail
    assert wal.probe_tail(store, rid, tail + 1) == tail  # nothing new after the hint
    m = region.load_latest(store, rid)
    assert m.message.replay_after_wal_entry_position <= m.message.wal_entry_position_last_seen <= tail
    assert wal.probe_tail(store, rid, m.message.wal_entry_position_last_seen + 1) == tail


def test_read_entry_meta_epochs_generations_and_fence_sentinels(claimed_three_times):
    loc, rid = claimed_three_times
    tail = wal.probe_tail(loc.store, rid, 1)
    metas = [wal.read_entry_meta(loc.store, rid, p) for p in range(1, tail + 1)]
    assert [m.position for m in metas] == list(range(1, tail + 1))
    for m in metas:
        path = os.path.join(loc.store.root, layout.wal_key(rid, m.position))
        assert m.size == os.path.getsize(path)

    epochs = [m.writer_epoch for m in metas]
    assert epochs == sorted(epochs) and set(epochs) == {1, 2, 3}
    sentinels = [m for m in metas if m.fence_sentinel]
    # Each re-claim writes exactly one data-less sentinel, first in its epoch; the first claim none.
    assert [s.writer_epoch for s in sentinels] == [2, 3]
    for s in sentinels:
        assert s.generation is None
        assert min(m.position for m in metas if m.writer_epoch == s.writer_epoch) == s.position
        raw = loc.store.get(layout.wal_key(rid, s.position))
        assert pa.ipc.open_stream(io.BytesIO(raw)).read_all().num_rows == 0

    data = [m for m in metas if not m.fence_sentinel]
    manifest = region.load_latest(loc.store, rid)
    assert manifest.writer_epoch == 3
    gens = [m.generation for m in data]
    assert gens == sorted(gens) and 1 <= min(gens) and max(gens) < manifest.current_generation
    # A WAL entry's generation is the flushed generation that holds its rows.
    flushed = {g.generation: g.path for g in manifest.generations}
    for m in data:
        entry = pa.ipc.open_stream(io.BytesIO(loc.store.get(layout.wal_key(rid, m.position)))).read_all()
        assert entry.num_rows > 0 and "_tombstone" in entry.column_names
        gen_dir = os.path.join(loc.store.root, layout.generation_dir(rid, flushed[m.generation], m.generation))
        gen_ids = set(lance.dataset(gen_dir).to_table(columns=["id"]).column("id").to_pylist())
        assert set(entry.column("id").to_pylist()) <= gen_ids, m
    # The delete went to the WAL as tombstones.
    tomb = [pa.ipc.open_stream(io.BytesIO(loc.store.get(layout.wal_key(rid, m.position)))).read_all()
            for m in data if m.writer_epoch == 2]
    dead = {i for t in tomb for i, d in zip(t.column("id").to_pylist(), t.column("_tombstone").to_pylist()) if d}
    assert dead == {3, 104}


def test_read_entry_meta_of_a_freshly_claimed_region(table_loc):
    """A writer that claims an existing region writes its sentinel at once, before any put."""
    ds = demo.create_table(table_loc, sharding="unsharded")
    rid = str(uuid.uuid4())
    with ds.mem_wal_writer(rid) as w:
        w.put(rows(1, 3, 1))
    w2 = lance.dataset(table_loc.lance_uri).mem_wal_writer(rid)
    try:
        tail = wal.probe_tail(table_loc.store, rid, 1)
        meta = wal.read_entry_meta(table_loc.store, rid, tail)
        assert meta.fence_sentinel and meta.writer_epoch == 2 and meta.generation is None
        first = wal.read_entry_meta(table_loc.store, rid, 1)
        assert not first.fence_sentinel and first.writer_epoch == 1 and first.generation == 1
    finally:
        w2.close()


def test_read_entry_meta_errors_name_region_and_key(claimed_three_times):
    loc, rid = claimed_three_times
    tail = wal.probe_tail(loc.store, rid, 1)
    with pytest.raises(wal.WalEntryError) as e:
        wal.read_entry_meta(loc.store, rid, tail + 5)
    assert rid in str(e.value) and layout.wal_key(rid, tail + 5) in str(e.value)

    garbage_key = layout.wal_key(rid, tail + 1)
    loc.store.put(garbage_key, b"\x00garbage, not arrow")
    with pytest.raises(wal.WalEntryError, match="not an Arrow IPC stream") as e:
        wal.read_entry_meta(loc.store, rid, tail + 1)
    assert rid in str(e.value) and garbage_key in str(e.value)

    sink = io.BytesIO()
    t = pa.table({"id": pa.array([1], pa.int64())})
    with pa.ipc.new_stream(sink, t.schema.with_metadata({"generation": "1"})) as s:
        s.write_table(t)
    no_epoch_key = layout.wal_key(rid, tail + 2)
    loc.store.put(no_epoch_key, sink.getvalue())
    with pytest.raises(wal.WalEntryError, match="no writer_epoch") as e:
        wal.read_entry_meta(loc.store, rid, tail + 2)
    assert no_epoch_key in str(e.value)
