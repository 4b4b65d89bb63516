"""memwal_core.state.region against regions written by pylance's ShardWriter.

Load-latest (version hint, HEAD probes, listing only as a fallback), commit-next (put-if-absent,
reload and re-apply), pylance writers accepting memwal's manifest versions, and two OS
processes racing commit_next.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid

import lance
import pyarrow as pa
import pytest

from memwal_core.observe import reader
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, region, wal
from memwal_core.state.store import LocalStore
from memwal_core.tools import demo

HERE = os.path.dirname(os.path.abspath(__file__))
PROCS = os.path.join(HERE, "procs")
REPO = os.path.dirname(HERE)
ENV = dict(os.environ, PYTHONPATH=REPO)


def rows(first: int, n: int, version: int):
    return demo.rows_table([demo.row(k, version) for k in range(first, first + n)])


def model_of(loc) -> dict:
    return {r["id"]: r for r in lance.dataset(loc.lance_uri).to_table().to_pylist()}


def lsm(loc) -> dict:
    return {r["id"]: r for r in reader.lsm_table(loc).to_pylist()}


def manifest_versions_on_disk(loc, rid: str) -> list[int]:
    d = os.path.join(loc.store.root, layout.manifest_dir(rid))
    return sorted(v for v in (layout.parse_bitrev(f) for f in os.listdir(d) if f.endswith(".binpb")))


def snapshot_files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


@pytest.fixture
def pylance_region(table_loc):
    """A manual-sharding table with one region written by pylance: three flushes, then a
    re-open (epoch 2, fence sentinel) and one more flush. Returns (loc, region id, model)."""
    ds = demo.create_table(table_loc, sharding="manual", base_rows=5)
    rid = str(uuid.uuid4())
    with ds.mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(100, 10, 1))
        w.put(rows(110, 10, 1))
        w.put(rows(120, 4, 1))
    with lance.dataset(table_loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(105, 10, 2))
    model = model_of(table_loc)
    for k in range(100, 124):
        model[k] = demo.row(k, 1)
    for k in range(105, 115):
        model[k] = demo.row(k, 2)
    return table_loc, rid, model


# =========================================================================== load-latest
def test_fixture_region_is_what_we_think(pylance_region):
    loc, rid, model = pylance_region
    m = region.load_latest(loc.store, rid)
    assert m.version == max(manifest_versions_on_disk(loc, rid)) >= 6
    assert m.writer_epoch == 2 and m.current_generation == len(m.generations) + 1 >= 4
    assert lsm(loc) == model


def test_load_latest_normal_path_does_not_list(pylance_region):
    loc, rid, _ = pylance_region
    latest = max(manifest_versions_on_disk(loc, rid))
    store = LocalStore(loc.store.root)
    m = region.load_latest(store, rid)
    assert m.version == latest and m.message.version == latest
    assert m.raw == (open(os.path.join(store.root, layout.manifest_key(rid, latest)), "rb").read())
    assert store.stats["list"] == 0
    assert store.stats["head"] == 2  # the hinted version exists, the next one does not


def test_load_latest_without_hint_lists(pylance_region, caplog):
    """No hint: one listing of the manifest directory, not probes from version 1, which would
    stop at the first gap."""
    loc, rid, _ = pylance_region
    latest = max(manifest_versions_on_disk(loc, rid))
    os.unlink(os.path.join(loc.store.root, layout.version_hint_key(rid)))
    store = LocalStore(loc.store.root)
    with caplog.at_level(logging.WARNING, logger="memwal"):
        assert region.load_latest(store, rid).version == latest
    assert store.stats["list"] == 1
    assert store.stats["head"] == 0
    assert not caplog.records  # a missing hint is normal, not worth a warning


def test_load_latest_without_hint_sees_past_a_gap(pylance_region):
    """Hint missing, version 1 left behind by a torn GC delete, 2..k-1 gone: probing
    from 1 would read version 1 as the latest (a silently stale read); listing finds k."""
    loc, rid, _ = pylance_region
    latest = max(manifest_versions_on_disk(loc, rid))
    loc.store.delete_many([layout.manifest_key(rid, v) for v in range(2, latest)])
    loc.store.delete_many([layout.version_hint_key(rid)])
    assert manifest_versions_on_disk(loc, rid) == [1, latest]
    assert region.load_latest(loc.store, rid).version == latest
    assert region.verified_latest_version(loc.store, rid, 1) == latest
    # A hint that names an existing version is trusted (the normal path: no listing).
    loc.store.put(layout.version_hint_key(rid), json.dumps({"version": latest}).encode())
    store = LocalStore(loc.store.root)
    assert region.verified_latest_version(store, rid, 1) == latest and store.stats["list"] == 0


def test_load_latest_with_stale_hint(pylance_region):
    loc, rid, _ = pylance_region
    latest = max(manifest_versions_on_disk(loc, rid))
    for stale in range(1, latest + 1):
        loc.store.put(layout.version_hint_key(rid), json.dumps({"version": stale}).encode())
        store = LocalStore(loc.store.root)
        assert region.load_latest(store, rid).version == latest
        assert store.stats["list"] == 0
        assert store.stats["head"] == latest - stale + 2


@pytest.mark.parametrize("garbage", [
    b"not json", b"", b'{"v": 3}', b'{"version": -2}', b'{"version": 0}', b'{"version": "3"}',
    b'{"version": 2.5}', b'{"version": true}', b'{"version": null}', b"[3]", b"3", b"\xff\xfe\x00",
    b'{"version": 3',
])
def test_load_latest_with_garbage_hint(pylance_region, caplog, garbage):
    loc, rid, _ = pylance_region
    latest = max(manifest_versions_on_disk(loc, rid))
    loc.store.put(layout.version_hint_key(rid), garbage)
    before = snapshot_files(loc.store.root)
    store = LocalStore(loc.store.root)
    with caplog.at_level(logging.WARNING, logger="memwal.region"):
        assert region.load_latest(store, rid).version == latest
    assert store.stats["list"] == 1  # an unusable hint: the latest comes from the listing
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and rid in warnings[0] and "version_hint.json" in warnings[0]
    assert snapshot_files(loc.store.root) == before  # reading never repairs or deletes


def test_load_latest_with_hint_ahead_falls_back_to_listing(pylance_region, caplog):
    loc, rid, _ = pylance_region
    latest = max(manifest_versions_on_disk(loc, rid))
    loc.store.put(layout.version_hint_key(rid), json.dumps({"version": latest + 10}).encode())
    store = LocalStore(loc.store.root)
    with caplog.at_level(logging.WARNING, logger="memwal.region"):
        assert region.load_latest(store, rid).version == latest
    assert store.stats["list"] == 1
    assert any("listing" in r.getMessage() and rid in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("hint", ["missing", "stale-deleted", "garbage"])
def test_load_latest_after_old_versions_deleted(pylance_region, caplog, hint):
    """Old versions garbage-collected and no usable hint: only listing can find the latest."""
    loc, rid, _ = pylance_region
    latest = max(manifest_versions_on_disk(loc, rid))
    loc.store.delete_many([layout.manifest_key(rid, v) for v in range(1, latest - 1)])
    assert manifest_versions_on_disk(loc, rid) == [latest - 1, latest]
    hint_key = layout.version_hint_key(rid)
    if hint == "missing":
        loc.store.delete_many([hint_key])
    elif hint == "stale-deleted":
        loc.store.put(hint_key, b'{"version": 2}')
    else:
        loc.store.put(hint_key, b"{{{")
    before = snapshot_files(loc.store.root)
    store = LocalStore(loc.store.root)
    with caplog.at_level(logging.INFO, logger="memwal.region"):
        m = region.load_latest(store, rid)
    assert m.version == latest and m.message.version == latest
    assert store.stats["list"] == 1
    assert any("by listing" in r.getMessage() for r in caplog.records)
    assert snapshot_files(loc.store.root) == before
    # The region still reads correctly and pylance still opens it.
    with lance.dataset(loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(500, 3, 9))
    assert region.load_latest(LocalStore(loc.store.root), rid).version > latest


def test_load_version_and_generations(pylance_region):
    loc, rid, _ = pylance_region
    latest = region.load_latest(loc.store, rid)
    for v in range(1, latest.version + 1):
        m = region.load_version(loc.store, rid, v)
        assert m.version == v and m.message.region_id.uuid == uuid.UUID(rid).bytes
    gens = latest.generations
    assert [g.generation for g in gens] == list(range(1, latest.current_generation))
    assert all(layout.validate_generation_path(g.path, g.generation) for g in gens)
    assert sum(g.physical_rows for g in gens) == 24 + 10
    with pytest.raises(region.MissingManifest, match=rid):
        region.load_version(loc.store, rid, latest.version + 1)


# =========================================================================== commit_next
def bump_last_seen(value: int):
    def mutate(msg: pb.RegionManifest) -> bool:
        if msg.wal_entry_position_last_seen >= value:
            return False
        msg.wal_entry_position_last_seen = value
        return True
    return mutate


def test_commit_next_basics(pylance_region):
    loc, rid, _ = pylance_region
    cur = region.load_latest(loc.store, rid)
    before = manifest_versions_on_disk(loc, rid)
    # Nothing to change: nothing committed.
    assert region.commit_next(loc.store, cur, bump_last_seen(cur.message.wal_entry_position_last_seen)) is None
    assert manifest_versions_on_disk(loc, rid) == before

    # memwal never touches writer_epoch.
    def steal_epoch(msg):
        msg.writer_epoch += 1
        return True

    with pytest.raises(ValueError, match="writer_epoch"):
        region.commit_next(loc.store, cur, steal_epoch)
    assert manifest_versions_on_disk(loc, rid) == before

    new = region.commit_next(loc.store, cur, bump_last_seen(cur.message.wal_entry_position_last_seen + 1))
    assert new.version == cur.version + 1
    assert manifest_versions_on_disk(loc, rid) == before + [new.version]
    assert json.loads(loc.store.get(layout.version_hint_key(rid))) == {"version": new.version}
    reread = region.load_latest(LocalStore(loc.store.root), rid)
    assert reread.raw == new.raw and reread.version == new.version
    # Only the version and the hint changed.
    expected = pb.RegionManifest()
    expected.CopyFrom(cur.message)
    expected.version = new.version
    expected.wal_entry_position_last_seen = cur.message.wal_entry_position_last_seen + 1
    assert reread.message == expected


def test_commit_next_from_stale_version_keeps_the_winners_fields(pylance_region):
    """Committing from an old loaded version loses the put-if-absent, reloads the latest
    (which has more flushed generations) and applies the change on top of it."""
    loc, rid, _ = pylance_region
    latest = region.load_latest(loc.store, rid)
    stale = next(region.load_version(loc.store, rid, v) for v in range(1, latest.version)
                 if len(region.load_version(loc.store, rid, v).generations) < len(latest.generations))
    new = region.commit_next(loc.store, stale, bump_last_seen(99))
    assert new.version == latest.version + 1
    assert new.message.wal_entry_position_last_seen == 99
    assert list(new.message.flushed_generations) == list(latest.message.flushed_generations)
    assert new.writer_epoch == latest.writer_epoch
    # The versions the race "lost" against are untouched.
    assert region.load_version(loc.store, rid, latest.version).raw == latest.raw
    # A stale loaded version whose change is already satisfied on the latest commits nothing.
    assert region.commit_next(loc.store, stale, bump_last_seen(50)) is None


def test_commit_next_gives_up_after_max_attempts(pylance_region):
    loc, rid, _ = pylance_region
    latest = region.load_latest(loc.store, rid)
    stale = region.load_version(loc.store, rid, latest.version - 2)
    with pytest.raises(region.CommitRaceLost, match=rid):
        region.commit_next(loc.store, stale, bump_last_seen(99), max_attempts=1)
    assert max(manifest_versions_on_disk(loc, rid)) == latest.version


# =========================================================================== pylance accepts memwal's versions
def test_pylance_reopens_after_memwal_commit(pylance_region):
    """A crashed writer leaves WAL entries beyond the manifest's last-seen hint; memwal commits
    the observed tail (only wal_entry_position_last_seen changes); a new pylance writer claims
    the region, replays, writes and flushes, and the LSM read has every row."""
    loc, rid, model = pylance_region
    subprocess.run([sys.executable, os.path.join(PROCS, "crash_writer.py"), loc.lance_uri, rid,
                    "300", "6", "7"], check=True, env=ENV, timeout=60)
    for k in range(300, 306):
        model[k] = demo.row(k, 7)
    cur = region.load_latest(loc.store, rid)
    hint = cur.message.wal_entry_position_last_seen
    tail = wal.probe_tail(loc.store, rid, hint + 1)
    assert tail > hint  # the crashed writer's puts are only in the WAL
    new = region.commit_next(loc.store, cur, bump_last_seen(tail))
    assert new.message.wal_entry_position_last_seen == tail
    ours = new.raw

    ds = lance.dataset(loc.lance_uri)
    with ds.mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(400, 5, 8))
    for k in range(400, 405):
        model[k] = demo.row(k, 8)
    after = region.load_latest(loc.store, rid)
    assert after.version > new.version
    assert after.writer_epoch == new.writer_epoch + 1
    assert after.message.wal_entry_position_last_seen >= tail
    assert region.load_version(loc.store, rid, new.version).raw == ours  # never rewritten
    assert manifest_versions_on_disk(loc, rid) == list(range(1, after.version + 1))
    assert lsm(loc) == model


def test_open_writer_survives_memwal_commit(pylance_region):
    """A ShardWriter opened before memwal's commit flushes afterwards: it reloads the latest
    version, keeps the foreign change and commits after it; its data is readable."""
    loc, rid, model = pylance_region
    ds = lance.dataset(loc.lance_uri)
    w = ds.mem_wal_writer(rid, max_memtable_rows=10)
    try:
        w.put(rows(600, 4, 5))
        for k in range(600, 604):
            model[k] = demo.row(k, 5)
        deadline = time.time() + 10
        while True:  # wait for the put's WAL entry (the hint is not updated on WAL writes)
            cur = region.load_latest(loc.store, rid)
            tail = wal.probe_tail(loc.store, rid, cur.message.wal_entry_position_last_seen + 1)
            if tail > cur.message.wal_entry_position_last_seen or time.time() > deadline:
                break
            time.sleep(0.02)
        assert tail > cur.message.wal_entry_position_last_seen
        new = region.commit_next(loc.store, cur, bump_last_seen(tail))
        ours = new.raw
        w.put(rows(604, 10, 5))  # does not fit: a flush commits a new manifest version
        for k in range(604, 614):
            model[k] = demo.row(k, 5)
        w.put(rows(600, 2, 6))  # and the writer keeps working
        w.delete(pa.table({"id": pa.array([605], pa.int64())}))
        model.update({600: demo.row(600, 6), 601: demo.row(601, 6)})
        model.pop(605)
    finally:
        w.close()
    after = region.load_latest(loc.store, rid)
    assert after.version > new.version
    assert after.writer_epoch == new.writer_epoch  # same writer, no re-claim
    assert after.message.wal_entry_position_last_seen >= tail
    assert len(after.generations) > len(new.generations)
    assert region.load_version(loc.store, rid, new.version).raw == ours
    assert manifest_versions_on_disk(loc, rid) == list(range(1, after.version + 1))
    assert lsm(loc) == model


# =========================================================================== two processes racing
def test_two_processes_race_commit_next(pylance_region, tmp_path):
    loc, rid, model = pylance_region
    start = region.load_latest(loc.store, rid)
    start_seen = start.message.wal_entry_position_last_seen
    ready, go = tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    rounds = 40
    procs = [subprocess.Popen([sys.executable, os.path.join(PROCS, "commit_racer.py"), loc.store.root,
                               rid, str(start.version), str(i), str(rounds), str(ready), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for i in range(2)]
    try:
        deadline = time.time() + 30
        while len(os.listdir(ready)) < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert len(os.listdir(ready)) == 2
        go.touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            results.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    final = region.load_latest(LocalStore(loc.store.root), rid)
    committed = {}
    for r in results:
        for version, value in r["commits"]:
            assert version not in committed, f"version {version} committed twice"
            committed[version] = (r["index"], value)
    # Exactly one winner per version, no gaps, nothing beyond the commits.
    assert sorted(committed) == list(range(start.version + 1, final.version + 1))
    assert final.version - start.version == 2 * rounds
    # Both started from the same version, so at least that first put lost; losers retried.
    assert sum(r["attempts"] for r in results) > 2 * rounds
    # Every version decodes and is exactly its predecessor plus its committer's change.
    prev = start.message
    for v in range(start.version + 1, final.version + 1):
        m = region.load_version(loc.store, rid, v)
        _, value = committed[v]
        expected = pb.RegionManifest()
        expected.CopyFrom(prev)
        expected.version = v
        expected.wal_entry_position_last_seen = max(prev.wal_entry_position_last_seen, value)
        assert m.message == expected, f"version {v} is not built on version {v - 1}"
        prev = m.message
    assert final.message.wal_entry_position_last_seen == max(start_seen, 1000 + 2 * (rounds - 1) + 1)
    # Each process's commits are in its own order.
    for r in results:
        versions = [v for v, _ in r["commits"]]
        assert versions == sorted(versions)
    # pylance still claims and writes the region.
    with lance.dataset(loc.lance_uri).mem_wal_writer(rid, max_memtable_rows=10) as w:
        w.put(rows(700, 3, 3))
    for k in range(700, 703):
        model[k] = demo.row(k, 3)
    assert region.load_latest(loc.store, rid).version > final.version
    assert lsm(loc) == model
