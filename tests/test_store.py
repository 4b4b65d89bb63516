"""memwal_core.state.store: LocalStore and S3Store (against a real moto_server), and open_store.

Every manifest commit relies on put_if_absent, so it is raced for real: several OS processes
on local disk, several threads against the S3-protocol server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from memwal_core.observe import reader
from memwal_core.state import layout, region, table
from memwal_core.state.store import (
    LocalStore,
    NotFound,
    ObjectInfo,
    S3Store,
    StoreError,
    open_store,
)
from memwal_core.tools import demo

HERE = os.path.dirname(os.path.abspath(__file__))
PROCS = os.path.join(HERE, "procs")
REPO = os.path.dirname(HERE)


def _files(root: str) -> set[str]:
    out = set()
    for d, _dirs, files in os.walk(root):
        for f in files:
            out.add(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return out


def _dirs(root: str) -> set[str]:
    out = set()
    for d, dirs, _files in os.walk(root):
        for x in dirs:
            out.add(os.path.relpath(os.path.join(d, x), root).replace(os.sep, "/"))
    return out


# =========================================================================== LocalStore
def test_local_get_head_exists_put(tmp_path):
    store = LocalStore(str(tmp_path / "root"))
    with pytest.raises(NotFound):
        store.get("a/b.bin")
    assert store.head("a/b.bin") is None
    assert not store.exists("a/b.bin")
    store.put("a/b.bin", b"hello")
    assert store.get("a/b.bin") == b"hello"
    info = store.head("a/b.bin")
    assert isinstance(info, ObjectInfo) and info.key == "a/b.bin" and info.size == 5 and info.mtime > 0
    store.put("a/b.bin", b"replaced")  # plain put overwrites
    assert store.get("a/b.bin") == b"replaced"
    assert (tmp_path / "root" / "a" / "b.bin").read_bytes() == b"replaced"
    assert store.stats["get"] == 3 and store.stats["put"] == 2 and store.stats["head"] == 3
    assert not [f for f in _files(store.root) if ".memwal-tmp-" in f]


def test_local_put_if_absent_keeps_first(tmp_path):
    store = LocalStore(str(tmp_path))
    assert store.put_if_absent("m/v1.binpb", b"first") is True
    assert store.put_if_absent("m/v1.binpb", b"second") is False
    assert store.get("m/v1.binpb") == b"first"
    assert store.stats["put_if_absent"] == 2
    assert _files(store.root) == {"m/v1.binpb"}  # no temp file left behind by either call


def test_local_put_if_absent_race_across_processes(tmp_path):
    """6 processes race put_if_absent on the same 12 keys: exactly one winner per key, and each
    file holds the complete payload of its winner (no torn or mixed content)."""
    root, ready, go = tmp_path / "root", tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    n_procs, n_keys, size = 6, 12, 64_000
    tags = [f"p{i}" for i in range(n_procs)]
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [subprocess.Popen([sys.executable, os.path.join(PROCS, "put_race.py"), str(root), tag,
                               str(n_keys), str(size), str(ready), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for tag in tags]
    try:
        deadline = time.time() + 30
        while len(os.listdir(ready)) < n_procs and time.time() < deadline:
            time.sleep(0.01)
        assert len(os.listdir(ready)) == n_procs, "racers did not get ready"
        go.touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    sys.path.insert(0, PROCS)
    try:
        from put_race import payload
    finally:
        sys.path.remove(PROCS)
    store = LocalStore(str(root))
    winners: dict[str, list[str]] = {}
    for r in results:
        for k in r["won"]:
            winners.setdefault(k, []).append(r["tag"])
    assert sorted(winners) == sorted(f"race/k{i}" for i in range(n_keys))
    for key, who in winners.items():
        assert len(who) == 1, f"{key} won by {who}"
        assert store.get(key) == payload(who[0], key, size)
    assert _files(str(root)) == set(winners)  # every temp file cleaned up


def test_local_list_list_dirs_and_delete_many(tmp_path):
    store = LocalStore(str(tmp_path / "root"))
    keys = ["t/a/1.bin", "t/a/2.bin", "t/a/deep/er/3.bin", "t/b/4.bin", "t/ab/5.bin", "u/6.bin"]
    for k in keys:
        store.put(k, k.encode())
    listed = {o.key: o.size for o in store.list("t/a")}
    assert listed == {k: len(k) for k in ["t/a/1.bin", "t/a/2.bin", "t/a/deep/er/3.bin"]}
    assert "t/ab/5.bin" not in listed  # a prefix is a directory, not a string prefix
    assert {o.key for o in store.list("")} == set(keys)
    assert {o.key for o in store.list("t/")} == set(keys[:5])
    assert list(store.list("missing/dir")) == []
    assert store.list_dirs("t") == ["a", "ab", "b"]
    assert store.list_dirs("t/a") == ["deep"]
    assert store.list_dirs("") == ["t", "u"]
    assert store.list_dirs("nothing/here") == []

    n = store.delete_many(["t/a/deep/er/3.bin", "t/a/1.bin", "t/b/4.bin", "t/not/there.bin"])
    assert n == 3  # the missing key is ignored, not counted
    assert store.stats["delete"] == 4
    assert _files(store.root) == {"t/a/2.bin", "t/ab/5.bin", "u/6.bin"}
    # Directories left empty are removed (deepest first); non-empty ones and the root stay.
    assert _dirs(store.root) == {"t", "t/a", "t/ab", "u"}
    assert store.delete_many(["u/6.bin", "t/a/2.bin", "t/ab/5.bin"]) == 3
    assert _dirs(store.root) == set() and os.path.isdir(store.root)
    assert store.delete_many([]) == 0


@pytest.mark.parametrize("key", ["../x", "/abs/x", "a/../../x", "a//b", "a/./b", "", ".", "a/.."])
def test_local_rejects_unsafe_keys(tmp_path, key):
    (tmp_path / "outside").write_bytes(b"keep")
    store = LocalStore(str(tmp_path / "root"))
    for call in (lambda: store.get(key), lambda: store.put(key, b"x"),
                 lambda: store.put_if_absent(key, b"x"), lambda: store.delete_many([key]),
                 lambda: store.head(key)):
        with pytest.raises(ValueError, match="unsafe object key"):
            call()
    assert (tmp_path / "outside").read_bytes() == b"keep"
    assert not os.path.exists(tmp_path / "x")


# =========================================================================== open_store
def test_open_store_local_forms(tmp_path, monkeypatch):
    loc = open_store(f"file://{tmp_path}/t")
    assert isinstance(loc.store, LocalStore) and loc.lance_uri == f"{tmp_path}/t"
    assert loc.storage_options == {}
    monkeypatch.chdir(tmp_path)
    rel = open_store("rel/t")
    assert rel.lance_uri == os.path.join(str(tmp_path), "rel", "t")
    assert rel.child_uri("_mem_wal/x") == os.path.join(str(tmp_path), "rel", "t") + "/_mem_wal/x"
    with pytest.raises(ValueError, match="unsafe"):
        rel.child_uri("../x")


@pytest.mark.parametrize("uri,msg", [("hdfs://b/t", "unsupported table URI scheme 'hdfs'"),
                                     ("gs:///t", "without a bucket"),
                                     ("s3:///t", "without a bucket"),
                                     ("file://host/t", "with a host")])
def test_open_store_refuses(uri, msg):
    with pytest.raises(ValueError, match=msg):
        open_store(uri)


def test_open_store_s3_options():
    opts = {"aws_endpoint": "http://127.0.0.1:9", "aws_access_key_id": "a",
            "aws_secret_access_key": "b", "s3_max_attempts": "2", "s3_read_timeout": "3"}
    loc = open_store("s3a://bucket/some/prefix/", opts)
    assert isinstance(loc.store, S3Store)
    assert loc.lance_uri == "s3://bucket/some/prefix"
    assert loc.store.bucket == "bucket" and loc.store.prefix == "some/prefix"
    assert loc.storage_options["allow_http"] == "true"
    assert "s3_max_attempts" not in loc.storage_options and "s3_read_timeout" not in loc.storage_options
    assert loc.store.client.meta.endpoint_url == "http://127.0.0.1:9"
    assert open_store("s3://bucket", opts).lance_uri == "s3://bucket"


def test_s3_unreachable_endpoint_is_a_store_error():
    opts = {"aws_endpoint": "http://127.0.0.1:9", "aws_access_key_id": "a",
            "aws_secret_access_key": "b", "s3_max_attempts": "1", "s3_connect_timeout": "1"}
    store = open_store("s3://bucket/t", opts).store
    with pytest.raises(StoreError, match="s3://bucket/t/x/y"):
        store.get("x/y")


# =========================================================================== S3Store (moto)
@pytest.mark.s3
def test_s3_get_head_put_notfound(s3_table_loc):
    store = s3_table_loc.store
    with pytest.raises(NotFound):
        store.get("nope/x.bin")
    assert store.head("nope/x.bin") is None and not store.exists("nope/x.bin")
    store.put("a/b.bin", b"hello")
    assert store.get("a/b.bin") == b"hello"
    info = store.head("a/b.bin")
    assert info.key == "a/b.bin" and info.size == 5 and info.mtime > 0
    # The object really sits under the store's prefix in the bucket.
    raw = store.client.get_object(Bucket=store.bucket, Key="table/a/b.bin")["Body"].read()
    assert raw == b"hello"


@pytest.mark.s3
def test_s3_put_if_absent(s3_table_loc):
    store = s3_table_loc.store
    assert store.put_if_absent("m/1.binpb", b"first") is True
    assert store.put_if_absent("m/1.binpb", b"second") is False
    assert store.get("m/1.binpb") == b"first"
    # Racing threads: exactly one wins.
    results: dict[int, bool] = {}
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        results[i] = store.put_if_absent("m/2.binpb", f"writer {i}".encode())

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in results.items() if ok]
    assert len(winners) == 1
    assert store.get("m/2.binpb") == f"writer {winners[0]}".encode()


@pytest.mark.s3
def test_s3_listing_prefixes_and_dirs(s3_bucket):
    bucket, options = s3_bucket
    store = open_store(f"s3://{bucket}/tbl", options).store
    client = store.client
    for k in ["tbl/a/1", "tbl/a/deep/2", "tbl/ab/3", "tbl/b/4", "tbl/top", "tblx/out", "other/y"]:
        client.put_object(Bucket=bucket, Key=k, Body=k.encode())
    assert {o.key for o in store.list("")} == {"a/1", "a/deep/2", "ab/3", "b/4", "top"}
    assert {o.key: o.size for o in store.list("a")} == {"a/1": 7, "a/deep/2": 12}  # bodies are the full keys
    assert {o.key for o in store.list("a/")} == {"a/1", "a/deep/2"}
    assert list(store.list("zzz")) == []
    assert store.list_dirs("") == ["a", "ab", "b"]
    assert store.list_dirs("a") == ["deep"]
    assert store.list_dirs("missing") == []
    # A store at the bucket root sees everything.
    root = open_store(f"s3://{bucket}", options).store
    assert root.list_dirs("") == ["other", "tbl", "tblx"]
    assert {o.key for o in root.list("tblx")} == {"tblx/out"}


@pytest.mark.s3
def test_s3_listing_pages_and_batched_delete(s3_table_loc):
    """1,050 objects need two list pages; deleting 2,500 keys goes out in 3 batches."""
    from concurrent.futures import ThreadPoolExecutor

    store = s3_table_loc.store
    keys = [f"d/k{i:05d}" for i in range(2500)]
    existing = keys[:1050]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.client.put_object(Bucket=store.bucket, Key=f"table/{k}", Body=b"x"),
                      existing))
    store.put("keep/me", b"k")
    store.stats.clear()
    assert sorted(o.key for o in store.list("d")) == existing
    assert store.stats["list"] == 2  # followed the continuation token
    assert store.delete_many(keys) == 2500
    assert store.stats["delete_batch"] == 3
    assert list(store.list("d")) == []
    assert store.get("keep/me") == b"k"


@pytest.mark.s3
def test_s3_pylance_table_through_open_store(s3_table_loc):
    """pylance writes a MemWAL table on the S3 server through open_store's lance_uri and
    storage_options; memwal reads its regions, manifests and index details back through S3Store."""
    loc = s3_table_loc
    assert loc.lance_uri.startswith("s3://") and loc.storage_options["allow_http"] == "true"
    ds = demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=30)
    assert ds.count_rows() == 30
    w = demo.Workload(loc, key_space=200, max_memtable_rows=50)
    w.write_round(80, delete=0.1)
    w.write_round(80, delete=0.1)
    listing = region.list_regions(loc.store)
    assert sorted(listing.region_ids) == sorted(w.regions.values()) and not listing.skipped
    for rid in listing.region_ids:
        m = region.load_latest(loc.store, rid)
        assert m.writer_epoch == 2 and m.generations
        assert m.message.region_id.uuid == uuid.UUID(rid).bytes
    state = table.read_memwal_state(loc)
    assert state.details.num_regions == 2 and state.merged == {}
    got = {r["id"]: r for r in reader.lsm_table(loc).to_pylist()}
    assert got == w.expected()
    # The objects are where layout says, in the bucket, under the table prefix.
    rid = listing.region_ids[0]
    assert loc.store.exists(layout.version_hint_key(rid))
    assert loc.store.client.head_object(Bucket=loc.store.bucket,
                                        Key="table/" + layout.manifest_key(rid, 1))


def test_local_put_survives_a_concurrent_delete_pruning_its_directory(tmp_path):
    """Found by the concurrency suite: GC processes write and delete their intent markers in
    one directory; `delete_many` prunes it when empty, racing another put's makedirs/mkstemp."""
    import threading

    from memwal_core.state.store import LocalStore

    store = LocalStore(str(tmp_path))
    errors: list[BaseException] = []

    def loop(name: str) -> None:
        try:
            for _ in range(1500):
                store.put(f"_memwal/gc_pending/{name}", b"x")
                store.delete_many([f"_memwal/gc_pending/{name}"])
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(n,)) for n in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
