"""`az://` and `gs://` tables on local emulators started by the tests (tests/support/emulators.py):
the store contract memwal relies on (atomic conditional create, paginated listings, batched
deletes, HEAD, errors that name the object and never a secret), then a table written by
pylance ShardWriters and maintained by the `memwal` command with its credentials in the
environment. The GCS emulator is gcp-storage-emulator with the XML API object_store speaks
(tests/support/gcs_server.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from memwal_core.observe import reader, status
from memwal_core.state import table
from memwal_core.state.cloud_store import CloudStore, obstore_arguments
from memwal_core.state.store import NotFound, StoreError, open_store
from memwal_core.tools import demo

pytestmark = pytest.mark.cloud

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMWAL = os.path.join(os.path.dirname(sys.executable), "memwal")


class Backend:
    """One emulator: fresh buckets/containers, storage options, the secret to look for."""

    def __init__(self, scheme: str, server) -> None:
        self.scheme = scheme
        self.server = server

    def new_uri(self, prefix: str = "table") -> str:
        name = f"memwal{uuid.uuid4().hex[:12]}"
        if self.scheme == "az":
            self.server.create_container(name)
        else:
            self.server.create_bucket(name)
        return f"{self.scheme}://{name}/{prefix}"

    def options(self, **extra: str) -> dict[str, str]:
        return {**self.server.options(), **extra}

    @property
    def secret(self) -> str:
        return self.server.options().get("azure_storage_account_key", "\0no secret\0")


@pytest.fixture(params=["az", "gs"])
def backend(request) -> Backend:
    server = request.getfixturevalue("azurite" if request.param == "az" else "gcs_emulator")
    return Backend(request.param, server)


def _store(backend: Backend, **extra: str) -> CloudStore:
    store = open_store(backend.new_uri(), backend.options(**extra)).store
    assert isinstance(store, CloudStore)
    return store


# ------------------------------------------------------------------------------ the contract

def test_put_if_absent_race_has_exactly_one_winner(backend):
    """Threads create the same key at once, each with its own bytes: the server lets exactly one
    in, the object holds the winner's bytes, and a later create of other bytes is refused."""
    store = _store(backend)
    for round_ in range(3):
        key = f"_mem_wal/r/manifest/{round_:020d}.binpb"
        n = 8
        barrier = threading.Barrier(n)
        results: dict[int, bool] = {}

        def create(i: int) -> None:
            barrier.wait()
            results[i] = store.put_if_absent(key, f"writer-{i}".encode())

        threads = [threading.Thread(target=create, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, won in results.items() if won]
        assert len(results) == n and len(winners) == 1, results
        assert store.get(key) == f"writer-{winners[0]}".encode()
        assert store.put_if_absent(key, b"late") is False
        assert store.get(key) == f"writer-{winners[0]}".encode()


def test_gcs_emulator_preconditions_answer_412(gcs_emulator):
    """The emulator's XML API (tests/support/gcs_server.py) enforces what memwal's safety rests on,
    request by request as object_store sends them: `x-goog-if-generation-match: 0` creates only
    when no object is there (else 412, the object untouched), `N` writes only over generation
    N, and a copy honours the same header; a GET answers the ETag and generation the PUT did."""
    import http.client

    bucket = f"memwal{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(bucket)

    def call(method: str, key: str, body: bytes = b"", **headers: str) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", gcs_emulator.port, timeout=10)
        conn.request(method, f"/{bucket}/{key.replace('/', '%2F')}", body=body,
                     headers={k.replace("_", "-"): v for k, v in headers.items()})
        r = conn.getresponse()
        out = (r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        conn.close()
        return out

    status, h, _ = call("PUT", "m/1", b"first", x_goog_if_generation_match="0")
    assert status == 200 and h["etag"] and h["x-goog-generation"]
    gen = h["x-goog-generation"]
    assert call("PUT", "m/1", b"second", x_goog_if_generation_match="0")[0] == 412
    status, got, body = call("GET", "m/1")
    assert (status, body, got["etag"], got["x-goog-generation"]) == (200, b"first", h["etag"], gen)
    assert call("PUT", "m/1", b"third", x_goog_if_generation_match=str(int(gen) + 1))[0] == 412
    status, h2, _ = call("PUT", "m/1", b"fourth", x_goog_if_generation_match=gen)
    assert status == 200 and int(h2["x-goog-generation"]) > int(gen)
    assert call("GET", "m/1")[2] == b"fourth"
    assert call("PUT", "m/2", x_goog_copy_source=f"{bucket}/m%2F1", x_goog_if_generation_match="0")[0] == 200
    assert call("PUT", "m/2", x_goog_copy_source=f"{bucket}/m%2F1", x_goog_if_generation_match="0")[0] == 412
    assert call("GET", "m/2")[2] == b"fourth"
    assert call("DELETE", "m/2")[0] == 204 and call("GET", "m/2")[0] == 404
    assert call("PUT", "m/2", b"again", x_goog_if_generation_match="0")[0] == 200
    # A precondition the emulator does not implement is refused, never ignored.
    assert call("PUT", "m/3", b"x", x_goog_if_metageneration_match="1")[0] == 501
    assert call("GET", "m/3")[0] == 404
    # The emulator's JSON API reads what the XML API wrote.
    conn = http.client.HTTPConnection("127.0.0.1", gcs_emulator.port, timeout=10)
    conn.request("GET", f"/storage/v1/b/{bucket}/o/m%2F1?alt=media")
    r = conn.getresponse()
    assert (r.status, r.read()) == (200, b"fourth")


def test_gcs_emulator_multipart_ranges_and_copies(gcs_emulator):
    """What Lance asks of GCS beyond memwal's own calls, served by the emulator as by GCS: a
    multipart upload (Lance writes data files past 5 MB so), ranged and suffix reads, a copy
    that refuses an existing target, a rename."""
    import obstore

    store = _store(Backend("gs", gcs_emulator))._store
    data = os.urandom(11 * 1024 * 1024 + 7)
    put = obstore.put(store, "big/x", data, use_multipart=True, chunk_size=5 * 1024 * 1024)
    assert put["e_tag"] and put["version"]
    assert bytes(obstore.get(store, "big/x").bytes()) == data
    assert bytes(obstore.get_range(store, "big/x", start=100, end=200)) == data[100:200]
    assert bytes(obstore.get(store, "big/x", options={"range": {"suffix": 10}}).bytes()) == data[-10:]
    assert obstore.head(store, "big/x")["size"] == len(data)
    obstore.copy(store, "big/x", "big/y", overwrite=False)
    from obstore.exceptions import AlreadyExistsError

    with pytest.raises(AlreadyExistsError):
        obstore.copy(store, "big/x", "big/y", overwrite=False)
    obstore.rename(store, "big/y", "big/z")
    assert sorted(o["path"].rsplit("/", 2)[-2] + "/" + o["path"].rsplit("/", 1)[-1]
                  for chunk in obstore.list(store) for o in chunk) == ["big/x", "big/z"]


def test_listing_pages_past_one_server_page_and_delete_many_batches(backend):
    """More objects than one list page (Azure: 5,000; GCS: 1,000), written concurrently; the
    listing has every one with its size, `list_dirs` the immediate children only; `delete_many`
    goes out in batches (Azure's takes 256 keys a request), a key already gone counts as
    deleted, and exactly the given keys are gone."""
    import obstore

    store = _store(backend, timeout="180s")  # a loaded machine's Azurite takes over 30 s for a 256-key batch
    n = 5_050 if backend.scheme == "az" else 3_150  # GCS: each prefix past a page, and past a delete batch
    keys = [f"_mem_wal/r{i % 3}/wal/{i:08d}.arrow" for i in range(n)]

    async def put_all() -> None:
        sem = asyncio.Semaphore(64)

        async def one(k: str) -> None:
            async with sem:
                await obstore.put_async(store._store, store._key(k), k.encode())

        await asyncio.gather(*(one(k) for k in keys))

    asyncio.run(put_all())
    store.put("_mem_wal/other", b"x")
    listed = {o.key: o.size for o in store.list("_mem_wal/r0")}
    listed.update({o.key: o.size for o in store.list("_mem_wal/r1")})
    listed.update({o.key: o.size for o in store.list("_mem_wal/r2")})
    assert listed == {k: len(k) for k in keys}
    everything = list(store.list(""))
    assert len(everything) == n + 1
    assert store.list_dirs("_mem_wal") == ["r0", "r1", "r2"]
    assert store.list_dirs("_mem_wal/r0") == ["wal"]
    assert list(store.list("_mem_wal/none")) == [] and store.list_dirs("nothing") == []

    # Deletes: a subset (Azurite answers a 256-key batch in ~5 s), across batches, with keys
    # already gone.
    from memwal_core.state.cloud_store import DELETE_BATCH

    batch = DELETE_BATCH[backend.scheme]
    doomed = [k for k in keys if k.startswith("_mem_wal/r0/")][: batch + 40]
    store.delete_many(doomed[:5])
    before = store.stats["delete_batch"]
    assert store.delete_many(doomed + ["_mem_wal/r0/never-written"]) == len(doomed) + 1
    assert store.stats["delete_batch"] - before == 2
    assert {o.key for o in store.list("_mem_wal/r0")} == {k for k in keys if k.startswith("_mem_wal/r0/")} - set(doomed)


def test_head_get_and_not_found(backend):
    store = _store(backend)
    t0 = time.time()
    store.put("a/b.binpb", b"12345")
    info = store.head("a/b.binpb")
    assert info is not None and info.key == "a/b.binpb" and info.size == 5
    assert abs(info.mtime - t0) < 120  # the server's clock, seconds since the epoch
    assert store.exists("a/b.binpb") and not store.exists("a/c")
    assert store.head("a/c") is None
    with pytest.raises(NotFound):
        store.get("a/c")
    store.put("a/b.binpb", b"overwritten")
    assert store.get("a/b.binpb") == b"overwritten"
    with pytest.raises(ValueError, match="unsafe object key"):
        store.get("a/../../x")


def test_errors_name_the_object_and_never_the_secret(backend, tmp_path):
    """A bucket that does not exist, a server nobody listens on (retries bounded by Lance's own
    `client_max_retries` / `client_retry_timeout`), and (Azure) a wrong key: one `StoreError`
    naming the operation and the object; the secret is in no message. (The GCS emulator takes no
    credentials: a wrong one is Azure's case only.)"""
    uri = backend.new_uri()
    missing = uri.split("//", 1)[1].split("/", 1)[0] + "x"
    store = open_store(f"{backend.scheme}://{missing}/t", backend.options()).store
    with pytest.raises(StoreError) as e:
        store.put("k/v", b"1")
    assert f"{backend.scheme}://{missing}/t/k/v" in str(e.value)

    down = dict(backend.options(client_max_retries="1", client_retry_timeout="2"))
    if backend.scheme == "az":
        down["azure_endpoint"] = "http://127.0.0.1:1/devstoreaccount1"
    else:  # the endpoint comes from the service-account file
        account = json.load(open(backend.server.service_account))
        down["google_service_account"] = os.path.join(tmp_path, "down.json")
        with open(down["google_service_account"], "w") as f:
            json.dump({**account, "gcs_base_url": "http://127.0.0.1:1"}, f)
    t0 = time.time()
    with pytest.raises(StoreError) as e:
        open_store(uri, down).store.head("k/v")
    assert time.time() - t0 < 30
    assert f"head {uri}/k/v failed" in str(e.value) and backend.secret not in str(e.value)
    if backend.scheme == "gs":
        return  # the emulator takes no credentials: there is no wrong key to give it

    wrong = "d3Jvbmcta2V5" * 7 + "AA=="
    bad = open_store(uri, backend.options(azure_storage_account_key=wrong, client_max_retries="0")).store
    for call in (lambda: bad.get("k/v"), lambda: bad.put_if_absent("k/v", b"1"), lambda: list(bad.list("k"))):
        with pytest.raises(StoreError) as e:
            call()
        msg = str(e.value)
        assert uri.split("/table")[0] in msg and "access denied" in msg, msg
        assert wrong not in msg and backend.secret not in msg and "\n" not in msg


def test_options_are_lances_names(tmp_path):
    """One dict serves Lance and the store: service keys as they are, client keys as client
    options (obstore would abort on them as service keys), Lance's retry keys as retries."""
    opts = {"azure_storage_account_name": "acct", "azure_storage_account_key": "k", "allow_http": "true",
            "timeout": "30s", "client_max_retries": "3", "client_retry_timeout": "20",
            "google_service_account": "/sa.json", "aws_region": "x", "s3_max_attempts": "2"}
    az = obstore_arguments("az", opts)
    assert az["config"] == {"azure_storage_account_name": "acct", "azure_storage_account_key": "k"}
    assert az["client_options"] == {"allow_http": True, "timeout": "30s"}
    assert az["retry_config"]["max_retries"] == 3 and az["retry_config"]["retry_timeout"].total_seconds() == 20
    assert obstore_arguments("gs", opts)["config"] == {"google_service_account": "/sa.json"}
    with pytest.raises(StoreError, match=r"could not be configured.*storage options given") as e:
        open_store("az://c/t", {"azure_no_such_option": "s3cr3t-value"})
    assert "s3cr3t-value" not in str(e.value)
    with pytest.raises(ValueError, match="without a container"):
        open_store("az:///t")
    with pytest.raises(ValueError, match="azure_storage_account_name"):
        open_store("az://c@acct.blob.core.windows.net/t")
    sa = tmp_path / "sa.json"
    sa.write_text(json.dumps({"gcs_base_url": "http://127.0.0.1:1", "disable_oauth": True, "client_email": "",
                              "private_key": "", "private_key_id": ""}))
    loc = open_store("gs://bucket/a%20b/", {"google_service_account": str(sa)})
    assert loc.lance_uri == "gs://bucket/a%20b" and loc.store.prefix == "a b"
    assert str(sa) not in repr(loc)


def test_config_takes_cloud_secrets_from_the_environment_only(tmp_path, monkeypatch):
    from memwal_pipeline.config import ConfigError, load_config, table_identity

    path = tmp_path / "memwal.yaml"
    path.write_text("tables:\n  - name: t\n    uri: az://c/t\n    storage_options: {azure_storage_account_key: k}\n")
    with pytest.raises(ConfigError, match="secrets"):
        load_config(str(path))
    path.write_text("tables:\n  - name: t\n    uri: az://c/t\n    storage_options: {azure_storage_account_name: a}\n"
                    "    secrets: {azure_storage_account_key: MEMWAL_AZ_KEY}\n")
    (cfg,) = load_config(str(path))
    assert cfg.secrets == {"azure_storage_account_key": "MEMWAL_AZ_KEY"}
    # The table's Dagster resource resolves it from the environment at run time.
    from dagster import EnvVar

    from memwal_pipeline.definitions import table_definitions

    monkeypatch.setenv("MEMWAL_AZ_KEY", "YXotczNjcjN0LXZhbHVl")
    res = table_definitions(cfg).resources["t_table"]
    assert isinstance(res.azure_storage_account_key, EnvVar) and "YXotczNjcjN0LXZhbHVl" not in path.read_text()
    live = res.process_config_and_initialize()
    assert live.location().storage_options["azure_storage_account_key"] == "YXotczNjcjN0LXZhbHVl"
    assert "YXotczNjcjN0LXZhbHVl" not in repr(live.location())
    assert table_identity("az://c/t/", {"azure_storage_account_name": "a"}) == \
        table_identity("az://c/t", {"azure_storage_account_name": "a"}) != \
        table_identity("az://c/t", {"azure_storage_account_name": "b"})


# ------------------------------------------------------------------------------ end to end

def _memwal(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([MEMWAL, *args], cwd=REPO, capture_output=True, text=True, timeout=500,
                          env={**os.environ, **env})


def _cli_credentials(backend: Backend) -> tuple[list[str], dict[str, str]]:
    """The `--storage-option` flags and the environment of a `memwal` run: the credentials (the
    Azure account and key, the GCS service account) in the environment only, which Lance and
    memwal's store both read."""
    if backend.scheme == "az":
        public = backend.server.public_options()
        public.pop("azure_storage_account_name")
        env = {"AZURE_STORAGE_ACCOUNT_NAME": "devstoreaccount1", "AZURE_STORAGE_ACCOUNT_KEY": backend.secret}
    else:
        public = {k: v for k, v in backend.options().items() if k != "google_service_account"}
        env = {"GOOGLE_SERVICE_ACCOUNT": backend.server.service_account}
    return [a for k, v in public.items() for a in ("--storage-option", f"{k}={v}")], env


def test_table_written_by_shard_writers_is_maintained_by_the_cli(backend):
    """pylance writes a MemWAL table on the emulator (ShardWriters, two rounds over three
    regions); `memwal maintain` in a subprocess, the account key in the environment only, merges
    every generation (merge_insert with the merged marker), builds the MemWAL index, catches
    up and GCs the merged generations; the LSM read and the base table equal the model, and
    the secret appears in no output."""
    uri = backend.new_uri()
    loc = open_store(uri, backend.options())
    demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=20, btree_index=True)
    w = demo.Workload(loc, seed=7, key_space=200, max_memtable_rows=50)
    for _ in range(2):
        w.write_round(90, overwrite=0.3, delete=0.05, puts_per_batch=10)
    pending = sum(len(r.pending_generations) for r in status.table_status(loc).regions)
    assert pending >= 3

    flags, env = _cli_credentials(backend)
    run = _memwal("maintain", uri, *flags, "--base-versions-older-than", "0", "--base-versions-floor", "0", "--json",
                  "--spark-master", "local[2]", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert backend.secret not in run.stdout + run.stderr
    rep = json.loads(run.stdout)
    steps = rep["steps"]
    assert rep["failed"] == [] and all(steps[s]["ok"] for s in ("merge", "compact", "catchup", "index", "gc")), rep
    assert steps["index"]["metrics"]["num_regions"] == len(w.regions), steps["index"]
    assert steps["merge"]["metrics"]["generations_merged"] == pending, steps["merge"]
    assert steps["gc"]["metrics"]["generations_deleted"] == pending, steps["gc"]

    state = table.read_memwal_state(loc)
    after = status.table_status(loc)
    assert all(not r.pending_generations for r in after.regions)
    assert set(state.merged) == set(w.regions.values())
    expected = w.expected()
    as_dict = lambda t: {r["id"]: r for r in t.to_pylist()}  # noqa: E731
    assert as_dict(table.open_dataset(loc).to_table()) == expected
    assert as_dict(reader.lsm_table(loc)) == expected

    # More writes after maintenance: the LSM read sees base + the new generations, and
    # `memwal status` (key from the environment) reports them pending.
    w.write_round(60, overwrite=0.3, delete=0.05, puts_per_batch=10)
    assert as_dict(reader.lsm_table(loc)) == w.expected()
    status_run = _memwal("status", uri, *flags, "--json", env=env)
    assert status_run.returncode == 0, status_run.stderr[-2000:]
    assert backend.secret not in status_run.stdout + status_run.stderr
    now_pending = sum(len(r.pending_generations) for r in status.table_status(loc).regions)
    assert now_pending > 0 and str(now_pending) in status_run.stdout


def test_table_written_by_lancedb_is_maintained_by_the_cli(backend):
    """LanceDB 0.40 (its own Lance 13 and object_store) writes a bucket-sharded MemWAL table on
    the emulator, through several table handles (several writer epochs and fence sentinels per
    shard); one `memwal maintain` in a subprocess, secrets in the environment only, merges it
    all: the base table equals what LanceDB wrote, the WAL entries (which name no generation) of
    merged generations are reclaimed but for fence sentinels, the current epoch's and the tail,
    LanceDB's and pylance's LSM reads equal the model, and LanceDB keeps writing."""
    import random

    from support.lancedb_table import LdbTable

    t = LdbTable(backend.new_uri("db"), "bucket", buckets=3, base=20, storage_options=backend.options())
    rng = random.Random(3)
    for rnd in range(3):
        t.upsert(sorted({rng.randrange(400) for _ in range(80)}), f"r{rnd}_", per_call=10)
        t.reopen()
    t.check("writes")
    before = t.wal_entries()

    flags, env = _cli_credentials(backend)
    run = _memwal("maintain", t.loc.lance_uri, *flags, "--base-versions-older-than", "0", "--base-versions-floor",
                  "0", "--json", "--spark-master", "local[2]", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert backend.secret not in run.stdout + run.stderr
    steps = json.loads(run.stdout)["steps"]
    assert all(steps[s]["ok"] for s in ("merge", "compact", "catchup", "index", "gc")), steps
    assert steps["gc"]["metrics"]["objects_deleted"] > 0, steps["gc"]

    as_dict = lambda tbl: {r["id"]: (r["k"], r["v"]) for r in tbl.to_pylist()}  # noqa: E731
    assert as_dict(table.open_dataset(t.loc).to_table()) == t.expected()
    t.check("memwal maintain")
    from memwal_core.state import region, wal

    for rid in region.list_regions(t.loc.store).region_ids:
        epoch = region.load_latest(t.loc.store, rid).writer_epoch
        for p in t.wal_positions(rid)[:-1]:
            e = wal.read_entry_meta(t.loc.store, rid, p)
            assert e.generation is None and (e.fence_sentinel or e.writer_epoch == epoch), (rid, p, e)
    assert t.wal_entries() < before

    t.upsert([5, 6, 7, 401], "after")
    t.flush()
    t.check("LanceDB writes after memwal maintain")


# ------------------------------------------------------------------ faults between client and server

def test_azure_body_cut_and_lost_answer_through_a_proxy(azurite):
    """tests/support/s3proxy.py forwards any path-style HTTP, so it stands between the store and Azurite:
    a GET whose body breaks off mid-read is resumed (and, cut every time, fails naming the
    object after memwal's own GETs); a conditional create whose answer is lost after the server stored it is retried by
    object_store, refused by our own object, read back and counted as written; another writer's
    object still wins."""
    from support.s3proxy import S3Proxy

    backend = Backend("az", azurite)
    uri = backend.new_uri()
    proxy = S3Proxy(f"http://127.0.0.1:{azurite.port}").start()
    try:
        opts = backend.options(azure_endpoint=f"{proxy.endpoint}/devstoreaccount1", client_max_retries="3")
        store = open_store(uri, opts).store
        data = os.urandom(200_000)
        store.put("a/body", data)
        is_body = lambda r: r.key.endswith("/a/body")  # noqa: E731
        proxy.cut_body("get", 2, match=is_body)
        assert store.get("a/body") == data  # object_store resumes a body cut off mid-read itself
        assert proxy.count("get") == 3

        # Cut every time: object_store gives up after `client_max_retries`, memwal sends the GET
        # again (`attempts` in all), then fails naming the object.
        proxy.cut_body("get", 1000, match=is_body)
        with pytest.raises(StoreError, match=rf"get {uri}/a/body failed: reading the body broke off "
                                             rf"{store.attempts} times") as e:
            store.get("a/body")
        assert store.stats["get_body_retry"] == store.attempts - 1
        assert backend.secret not in str(e.value) and "\n" not in str(e.value)
        proxy.clear_faults()

        key = "_mem_wal/r/manifest/00000000000000000001.binpb"
        proxy.drop_answer("put_if_absent", 1, match=lambda r: r.key.endswith(key))
        assert store.put_if_absent(key, b"mine") is True
        assert store.get(key) == b"mine"
        assert proxy.count("put_if_absent") == 2  # the lost one, then memwal's resend
        assert store.stats["put_if_absent_retry"] == 1

        other = "_mem_wal/r/manifest/00000000000000000002.binpb"
        assert store.put_if_absent(other, b"theirs") is True
        proxy.drop_answer("put_if_absent", 1, match=lambda r: r.key.endswith(other))
        assert store.put_if_absent(other, b"mine") is False
        assert store.get(other) == b"theirs"
    finally:
        proxy.stop()


def test_azure_delete_whose_connection_breaks_is_sent_again(azurite):
    """A delete request that never got an answer (Azurite drops idle pooled connections; object_store
    does not resend a batch POST) is sent again, deletes being idempotent: a whole batch, and a
    single delete of the one-by-one pass that follows a batch refused for a key already gone."""
    from support.s3proxy import S3Proxy

    backend = Backend("az", azurite)
    proxy = S3Proxy(f"http://127.0.0.1:{azurite.port}").start()
    try:
        opts = backend.options(azure_endpoint=f"{proxy.endpoint}/devstoreaccount1", client_max_retries="0")
        store = open_store(backend.new_uri(), opts).store
        keys = [f"_mem_wal/r/wal/{i:08d}.arrow" for i in range(6)]
        for k in keys:
            store.put(k, b"x")
        is_delete = lambda r: r.method in ("POST", "DELETE")  # noqa: E731 - a batch POST or a DELETE

        proxy.drop_answer("*", 1, match=is_delete)
        assert store.delete_many(keys[:3]) == 3
        assert store.stats["delete_batch_resent"] == 1
        assert {o.key for o in store.list("_mem_wal")} == set(keys[3:])

        # keys[0] is gone: the batch is refused, then each key is deleted alone; the first of
        # those loses its answer and is sent again.
        seen: list[int] = []

        def second_delete(r) -> bool:  # the batch passes; the first single delete loses its answer
            if is_delete(r) and id(r) not in seen:
                seen.append(id(r))
            return is_delete(r) and seen.index(id(r)) == 1

        requests_before = store.stats["delete"]
        proxy.drop_answer("*", 1, match=second_delete)
        assert store.delete_many([keys[0]] + keys[3:]) == 4
        assert store.stats["delete"] - requests_before == 4
        assert store.stats["delete_batch_resent"] == 2
        assert list(store.list("_mem_wal")) == []
    finally:
        proxy.stop()


def test_messages_never_quote_a_secret():
    """object_store's errors quote the request URL, where a SAS token travels: its signature and
    every secret option's value are cut out of memwal's messages."""
    from memwal_core.state.cloud_store import _first_line, secret_values

    sas = "sv=2022-11-02&ss=b&sig=AbCdEf%2Bgh%3D"
    err = RuntimeError(f"Error performing GET http://h/c/k?{sas}&se=1 in 2ms - 403 Forbidden\nsecond line")
    msg = _first_line(err, secret_values({"azure_storage_sas_token": sas, "azure_storage_account_name": "a"}))
    assert "AbCdEf" not in msg and "second line" not in msg and "403 Forbidden" in msg
    msg = _first_line(RuntimeError("signature of KEYVALUE1 did not match"), secret_values({"account_key": "KEYVALUE1"}))
    assert "KEYVALUE1" not in msg and "[redacted]" in msg
    # Alone, the signature of a signed URL is cut out too.
    assert "AbCdEf" not in _first_line(RuntimeError(f"GET http://h/c/k?{sas}"))


# ------------------------------------------------------------------------------ the lease's clock

@pytest.mark.parametrize("offset", [30.0, -30.0, 3.0])
def test_the_lease_checks_this_hosts_clock_against_the_stores(backend, monkeypatch, offset):
    """The lease compares this host's clock with the store's (the time the store gives the lease
    record): 30 s off either way is refused with the skew, and the record is given back; 3 s is
    normal between hosts and accepted."""
    from memwal_core.options import LeaseOptions
    from memwal_core.state import lease

    loc = open_store(backend.new_uri(), backend.options())
    real = time.time
    monkeypatch.setattr(lease, "_now", lambda: real() + offset)
    if abs(offset) < 15:
        held = lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=60, wait_seconds=0))
        assert held.renew() is True
        held.check()
        held.release()
        return
    with pytest.raises(lease.ClockSkew, match="ahead of" if offset > 0 else "behind"):
        lease.acquire(loc, "merge", LeaseOptions(ttl_seconds=60, wait_seconds=0))
    assert lease.newest(loc).released
    monkeypatch.setattr(lease, "_now", real)
    lease.acquire(loc, "gc", LeaseOptions(ttl_seconds=60, wait_seconds=0)).release()
