"""Storage errors and retries of memwal's own store (`state/store.py`).

S3: a real moto_server behind the fault-injecting proxy (`tests/support/s3proxy.py`). botocore retries
a request, not the body it streams afterwards: a connection reset mid-body must be retried by
the store (`S3Store.get`), and every error the store raises names the operation and the
object, so a failed step says which object failed. Local disk: OS errors name the path.
"""

from __future__ import annotations

import os
import uuid

import pytest
from support.s3proxy import S3Proxy

from memwal_core.state import layout, region
from memwal_core.state.store import LocalStore, NotFound, StoreError, make_s3_client, open_store
from memwal_core.tools import demo


@pytest.fixture(scope="module")
def proxy(moto_server):
    p = S3Proxy(moto_server.endpoint).start()
    yield p
    p.stop()


@pytest.fixture
def px(proxy):
    proxy.up()
    proxy.clear_faults()
    proxy.reset_counts()
    yield proxy
    proxy.clear_faults()


def _store(px, moto_server, attempts: int = 3):
    """A store through the proxy, with a fresh bucket; `attempts` per request and per body."""
    bucket = f"r{uuid.uuid4().hex[:12]}"
    make_s3_client(moto_server.options()).create_bucket(Bucket=bucket)
    opts = {**moto_server.options(), "aws_endpoint": px.endpoint, "s3_max_attempts": str(attempts)}
    return open_store(f"s3://{bucket}/table", opts)


pytestmark = pytest.mark.s3


def test_get_body_cut_once_is_read_again(px, moto_server):
    """The connection resets after half the body: the store GETs again and returns the whole object."""
    store = _store(px, moto_server).store
    data = os.urandom(200_000)
    store.put("a/obj.bin", data)
    px.reset_counts()
    px.cut_body("get", 1)
    assert store.get("a/obj.bin") == data
    assert px.count("get", injected=True) == 1 and px.count("get", injected=False) == 1
    assert store.stats["get_body_retry"] == 1


def test_get_body_cut_every_time_names_the_object(px, moto_server):
    """Cut on every attempt: after exactly `s3_max_attempts` GETs, one StoreError naming the
    operation and the object (bucket and key) and why; nothing else of the store is affected."""
    loc = _store(px, moto_server, attempts=3)
    store = loc.store
    store.put("a/obj.bin", b"x" * 50_000)
    px.reset_counts()
    px.cut_body("get", 100)
    with pytest.raises(StoreError) as e:
        store.get("a/obj.bin")
    msg = str(e.value)
    assert f"S3 get s3://{store.bucket}/table/a/obj.bin failed" in msg and "3 times" in msg, msg
    assert "\n" not in msg
    assert px.count("get") == 3
    px.clear_faults()
    assert store.get("a/obj.bin") == b"x" * 50_000
    with pytest.raises(NotFound):  # "not found" stays NotFound, not retried
        store.get("a/none.bin")


def test_listing_body_cut_is_retried_then_named(px, moto_server):
    """A listing's XML body is read inside botocore's request: a cut is retried there; cut on
    every attempt, the error names the operation and the prefix."""
    store = _store(px, moto_server, attempts=3).store
    for i in range(40):
        store.put(f"l/{i:03d}", b"z")
    px.cut_body("list", 1)
    assert len(list(store.list("l"))) == 40
    assert px.count("list", injected=True) == 1
    px.cut_body("list", 100)
    with pytest.raises(StoreError, match=rf"S3 list s3://{store.bucket}/table/l/ failed"):
        list(store.list("l"))
    with pytest.raises(StoreError, match=rf"S3 list s3://{store.bucket}/table/l/ failed"):
        store.list_dirs("l")


def test_head_put_and_delete_errors_name_the_object(px, moto_server):
    """HEAD (no body), PUT and the batched delete (whose answer is a body): failing on every
    attempt, each error names the operation and the object."""
    store = _store(px, moto_server, attempts=2).store
    store.put("h/obj", b"1")
    px.throttle("head", 100, status=500, code="InternalError", message="boom")
    with pytest.raises(StoreError, match=rf"S3 head s3://{store.bucket}/table/h/obj failed: 500"):
        store.head("h/obj")
    px.clear_faults()
    px.throttle("put", 100, status=500, code="InternalError", message="boom")
    with pytest.raises(StoreError, match=rf"S3 put s3://{store.bucket}/table/h/new failed: InternalError"):
        store.put("h/new", b"2")
    px.clear_faults()
    px.cut_body("delete_batch", 100)
    with pytest.raises(StoreError, match=rf"S3 delete_batch s3://{store.bucket}/table/h/obj \(and 1 more keys\)"):
        store.delete_many(["h/obj", "h/other"])
    px.clear_faults()
    assert store.delete_many(["h/obj"]) == 1 and store.head("h/obj") is None


def test_region_manifests_load_through_body_cuts(px, moto_server):
    """What the jobs read through the store (region manifests, version hints) survives a reset
    mid-body on each object's first GET."""
    loc = _store(px, moto_server)
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=5)
    w = demo.Workload(loc, seed=3, key_space=40, max_memtable_rows=10)
    w.write_round(30, puts_per_batch=5)
    seen: set[str] = set()

    def first_get(r) -> bool:  # each object's first GET is cut
        if r.key in seen:
            return False
        seen.add(r.key)
        return True

    px.reset_counts()
    px.cut_body("get", 1000, match=first_get)
    got = {rid: region.load_latest(loc.store, rid) for rid in region.list_regions(loc.store).region_ids}
    assert sorted(got) == sorted(w.regions.values())
    assert all(m.generations for m in got.values())
    cut = px.count("get", injected=True)
    assert cut >= 2 and loc.store.stats["get_body_retry"] == cut
    assert loc.store.exists(layout.version_hint_key(next(iter(got))))


def test_conditional_put_whose_answer_was_lost(px, moto_server):
    """The server stores a conditional PUT and the connection drops before its answer: botocore
    sends it again and gets 412 from our own object. The store reads it back: ours, so True.
    A retried PUT that meets another writer's object (planted between the attempts) stays False."""
    store = _store(px, moto_server).store
    px.drop_answer("put_if_absent", 1)
    assert store.put_if_absent("m/1", b"mine") is True
    assert px.count("put_if_absent") == 2 and store.get("m/1") == b"mine"
    assert store.put_if_absent("m/1", b"mine") is False  # a plain second writer: no retry, False

    raw = make_s3_client(moto_server.options())
    px.throttle("put_if_absent", 1)  # the first attempt is refused (503), not stored
    px.before(lambda r: r.kind == "put_if_absent",
              lambda r: raw.put_object(Bucket=store.bucket, Key="table/m/2", Body=b"theirs"))
    assert store.put_if_absent("m/2", b"mine") is False
    assert store.get("m/2") == b"theirs"


def test_region_commit_whose_answer_was_lost_is_one_commit(px, moto_server):
    """A region manifest commit (`region.commit_next`) whose conditional PUT answer is lost
    returns the version it committed; no second version is written on top of it."""
    from memwal_core.jobs.snapshot import _hint_mutation

    loc = _store(px, moto_server)
    demo.create_table(loc, sharding="unsharded")
    w = demo.Workload(loc, seed=4, key_space=20, max_memtable_rows=10)
    w.write_round(10, puts_per_batch=5)
    rid = next(iter(w.regions.values()))
    before = region.load_latest(loc.store, rid)
    px.drop_answer("put_if_absent", 1, match=lambda r: "/manifest/" in r.key)
    committed = region.commit_next(loc.store, before, _hint_mutation(before.message.wal_entry_position_last_seen + 7))
    assert committed is not None and committed.version == before.version + 1
    latest = region.load_latest(loc.store, rid)
    assert latest.version == committed.version and latest.raw == committed.raw
    assert region.read_version_hint(loc.store, rid) == committed.version


# ------------------------------------------------------------------ local disk


def test_local_errors_name_the_operation_and_path(tmp_path):
    """An OS error other than "not found" is a StoreError naming the operation and the path."""
    store = LocalStore(str(tmp_path))
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    with pytest.raises(StoreError, match=rf"local get {tmp_path}/dir failed: IsADirectoryError"):
        store.get("dir")
    store.put("file", b"x")
    with pytest.raises(StoreError, match=rf"local put {tmp_path}/file/below failed"):
        store.put("file/below", b"y")
    with pytest.raises(NotFound):
        store.get("missing")
    assert store.head("missing") is None and store.head("file/below") is None
    assert list(store.list("file")) == [] and store.list_dirs("file") == []  # a file is no directory
    assert list(store.list("missing")) == [] and store.list_dirs("missing") == []
    assert store.delete_many(["missing", "file"]) == 1
    with pytest.raises(StoreError, match=rf"local delete {tmp_path}/dir failed"):
        store.delete_many(["dir"])
