"""The whole pipeline on `s3://bucket/table` against a real S3-protocol server (moto), with
faults injected by a proxy in front of it (`tests/support/s3proxy.py`) and a secret key that must
never show up anywhere.

Both S3 clients talk to the proxy as their endpoint: memwal's boto3 store (region manifests,
WAL probes, GC deletes) and Lance's object_store (data, and the Spark tasks that read
generations with the same storage options). The proxy counts every request by kind, answers
`503 SlowDown` on demand, plants objects at exact moments, and can go down (connection
refused) and come back on the same port with the data intact. One test also stops and restarts
a real moto server on the same port.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    SkipReason,
    build_sensor_context,
    partition_loading_context,
    serialize_value,
)
from support.s3proxy import Request, S3Proxy
from support.webserver import LOCATIONS, WebServer

from memwal_core.jobs import catchup, gc, merge, snapshot
from memwal_core.jobs.snapshot import _hint_mutation
from memwal_core.observe import reader, status
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.options import LeaseOptions
from memwal_core.state import layout, lease, region, table, wal
from memwal_core.state.store import StoreError, make_s3_client, open_store
from memwal_core.tools import demo
from memwal_pipeline.config import ConfigError, load_config
from memwal_pipeline.definitions import build_definitions, table_definitions
from support.s3_server import LocalS3
from memwal_pipeline.sensors import evaluate_tick

pytestmark = pytest.mark.s3

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMWAL = os.path.join(os.path.dirname(sys.executable), "memwal")
SECRET_ENV = "MEMWAL_TEST_S3_SECRET"
PREFIX = "table"
FAST_GC = gc.GcOptions(manifest_retention=2, manifest_min_age_seconds=0, orphan_grace_seconds=0,
                      cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0)


# ------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def secret() -> str:
    return "sEcReT-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def proxy(moto_server):
    p = S3Proxy(moto_server.endpoint).start()
    yield p
    p.stop()


@pytest.fixture
def px(proxy):
    """The module's proxy, up, with no faults and fresh counts."""
    proxy.up()
    proxy.clear_faults()
    proxy.reset_counts()
    yield proxy
    proxy.clear_faults()
    proxy.up()


@pytest.fixture
def raw(moto_server):
    """A boto3 client straight to moto (no proxy): what the test itself reads and plants."""
    return make_s3_client(moto_server.options())


def new_bucket(raw) -> str:
    name = f"memwal-{uuid.uuid4().hex[:12]}"
    raw.create_bucket(Bucket=name)
    return name


def s3_options(endpoint: str, secret: str, **extra: str) -> dict[str, str]:
    return {"aws_endpoint": endpoint, "aws_region": "us-east-1", "aws_access_key_id": "testing",
            "aws_secret_access_key": secret, **extra}


def bucket_keys(raw, bucket: str, prefix: str = PREFIX + "/") -> dict[str, int]:
    out = {}
    for page in raw.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["Size"]
    return out


def make_table(loc, *, regions=3, rounds=2, seed=1, btree=True) -> demo.Workload:
    demo.create_table(loc, sharding="bucket", num_buckets=regions, base_rows=20, btree_index=btree)
    w = demo.Workload(loc, seed=seed, key_space=200, max_memtable_rows=50)
    for _ in range(rounds):
        w.write_round(90, overwrite=0.3, delete=0.05, puts_per_batch=10)
    return w


def as_dict(t) -> dict:
    return {r["id"]: r for r in t.to_pylist()}


def is_manifest(r: Request) -> bool:
    return "/manifest/" in r.key and r.key.endswith(layout.MANIFEST_SUFFIX)


def by_memwal(r: Request) -> bool:
    """boto3 (memwal's store) rather than Lance's object_store / pylance writers."""
    return "botocore" in r.headers.get("user-agent", "").lower()


def one_line_error(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    assert "Traceback" not in text
    return lines[0]


# ------------------------------------------------------------------------ throttling: 503

def test_throttling_503_slowdown_is_retried_by_both_clients(px, raw, secret):
    bucket = new_bucket(raw)
    loc = open_store(f"s3://{bucket}/{PREFIX}", s3_options(px.endpoint, secret))
    store = loc.store
    assert store.client.meta.config.retries == {"total_max_attempts": 8, "mode": "standard"}
    K = {"put": 1, "put_if_absent": 2, "get": 2, "head": 1, "list": 1, "delete_batch": 1}
    for kind, k in K.items():
        px.throttle(kind, k)
    t0 = time.monotonic()
    store.put("x/a", b"a")
    assert store.put_if_absent("x/b", b"b") is True
    assert store.get("x/a") == b"a"
    assert store.head("x/b").size == 1
    assert sorted(o.key for o in store.list("x")) == ["x/a", "x/b"]
    assert store.delete_many(["x/a", "x/b"]) == 2
    took = time.monotonic() - t0
    # memwal saw one call of each kind succeed; the proxy saw K throttled attempts before each.
    for kind, k in K.items():
        assert store.stats[kind] == 1, kind
        assert px.count(kind, injected=True) == k, kind
        assert px.count(kind, injected=False) == 1, kind
    assert took > 0.05  # botocore's standard mode sleeps (jittered exponential backoff) between attempts
    assert bucket_keys(raw, bucket) == {}

    # More throttling than attempts: a one-line StoreError naming the request and the S3 code.
    px.reset_counts()
    short = open_store(f"s3://{bucket}/{PREFIX}", s3_options(px.endpoint, secret, s3_max_attempts="2")).store
    px.throttle("get", 5)
    with pytest.raises(StoreError) as ei:
        short.get("x/a")
    msg = one_line_error(str(ei.value))
    assert f"s3://{bucket}/{PREFIX}/x/a" in msg and "SlowDown" in msg and secret not in msg
    assert px.count("get", injected=True) == 2

    # Lance's object_store retries 503 on its own (3 retries with backoff per request, and
    # lance-io retries reads again on top): a fresh reader process opens the table through
    # throttled GETs. (Without a limit it gives up after ~64 attempts, ~10 s, for one GET.)
    px.clear_faults()
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=5)
    px.reset_counts()
    px.throttle("get", 3)
    code = ("import json, sys, lance; a = json.loads(sys.argv[1]); "
            "print(lance.dataset(a['uri'], storage_options=a['options']).count_rows())")
    out = subprocess.run([sys.executable, "-c", code, json.dumps({"uri": loc.lance_uri, "options": loc.storage_options})],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "5", out.stderr[-2000:]
    assert px.count("get", injected=True) == 3 and px.count("get", injected=False) >= 1

    # 403 (wrong credentials or bucket policy): memwal says so in one line.
    px.throttle("list", 1, status=403, code="AccessDenied", message="Access Denied")
    with pytest.raises(StoreError) as ei:
        region.list_regions(store)
    msg = one_line_error(str(ei.value))
    assert "AccessDenied" in msg and "check the credentials" in msg and secret not in msg


# ------------------------------------------------------------- conditional region commits

def test_store_conditional_put_semantics_and_the_documented_check(px, raw, secret):
    """docs/object-stores.md's check of a store (a second `If-None-Match: *` PUT must get 412), and what
    memwal does with a store that answers 412, or refuses the header (501)."""
    import botocore

    bucket = new_bucket(raw)
    raw.put_object(Bucket=bucket, Key="memwal-check", Body=b"1", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as ei:
        raw.put_object(Bucket=bucket, Key="memwal-check", Body=b"2", IfNoneMatch="*")
    assert ei.value.response["Error"]["Code"] == "PreconditionFailed"
    store = open_store(f"s3://{bucket}/{PREFIX}", s3_options(px.endpoint, secret)).store
    assert store.put_if_absent("m/1", b"a") is True and store.put_if_absent("m/1", b"b") is False
    assert store.get("m/1") == b"a"
    px.throttle("put_if_absent", 1, status=501, code="NotImplemented", message="IfNoneMatch")
    with pytest.raises(StoreError) as ei:
        store.put_if_absent("m/2", b"a")
    msg = one_line_error(str(ei.value))
    assert "put_if_absent" in msg and "NotImplemented" in msg and f"s3://{bucket}/{PREFIX}/m/2" in msg
    assert px.count("put_if_absent", injected=True) == 1  # 501 is not retried
    assert not store.exists("m/2")


def test_region_commit_reloads_when_a_writer_commits_first(px, raw, secret):
    """memwal loads version N; a real pylance writer then claims the region (commits N+1 with a
    new epoch, writes its fence sentinel) and appends a durable WAL entry; memwal commits its
    raised WAL hint: put-if-absent of N+1 fails (412), memwal reloads and lands on top of the
    writer's version, which stays byte-identical; the writer then flushes on top of memwal's."""
    bucket = new_bucket(raw)
    loc = open_store(f"s3://{bucket}/{PREFIX}", s3_options(px.endpoint, secret))
    w = make_table(loc, regions=2, rounds=1, btree=False)
    rid = sorted(w.regions.values())[0]
    value = next(v for v, r in w.regions.items() if r == rid)
    m = region.load_latest(loc.store, rid)
    n = m.version

    px.reset_counts()
    writer = w.dataset().mem_wal_writer(rid, max_memtable_rows=50, durable_write=True)
    try:
        candidates = list(range(500, 900))
        keys = [k for k, v in zip(candidates, w.region_value(candidates)) if v == value][:5]
        rows = [demo.row(k, 77) for k in keys]
        writer.put(demo.rows_table(rows))
        w.model.update({r["id"]: r for r in rows})
        theirs = region.probe_latest_version(loc.store, rid, n)
        assert theirs > n
        planted = {v: raw.get_object(Bucket=bucket, Key=f"{PREFIX}/{layout.manifest_key(rid, v)}")["Body"].read()
                   for v in range(n + 1, theirs + 1)}
        claimed = region.decode_manifest(rid, theirs, planted[theirs])
        assert claimed.writer_epoch == m.writer_epoch + 1
        observed = wal.probe_tail(loc.store, rid, claimed.message.wal_entry_position_last_seen)
        assert observed > claimed.message.wal_entry_position_last_seen  # the durable entry

        out = region.commit_next(loc.store, m, _hint_mutation(observed))  # built on stale N

        assert out is not None and out.version == theirs + 1
        for v, data in planted.items():  # never overwritten
            assert raw.get_object(Bucket=bucket, Key=f"{PREFIX}/{layout.manifest_key(rid, v)}")["Body"].read() == data
        assert out.writer_epoch == claimed.writer_epoch  # the writer's claim is kept
        assert out.message.wal_entry_position_last_seen == observed
        assert region.read_version_hint(loc.store, rid) == out.version
        # On the wire: memwal's manifest commits are conditional; the stale one got 412.
        mine = [r for r in px.requests if by_memwal(r) and is_manifest(r) and r.method == "PUT"]
        assert [r.headers.get("if-none-match") for r in mine] == ["*", "*"]
        assert [r.status for r in mine] == [412, 200]
        assert [r.key for r in mine] == [f"{PREFIX}/{layout.manifest_key(rid, n + 1)}",
                                         f"{PREFIX}/{layout.manifest_key(rid, theirs + 1)}"]
        more = [demo.row(k, 78) for k in keys[:2]]
        writer.put(demo.rows_table(more))
        w.model.update({r["id"]: r for r in more})
    finally:
        writer.close()
    # The writer, still open while memwal committed, flushed on top of memwal's version.
    latest = region.load_latest(loc.store, rid)
    assert latest.version > out.version and latest.writer_epoch == claimed.writer_epoch
    assert region.load_version(loc.store, rid, out.version).raw == out.raw
    assert as_dict(reader.lsm_table(loc)) == w.expected()
    # Every manifest PUT on the wire, pylance's included, was conditional.
    puts = [r for r in px.requests if is_manifest(r) and r.method == "PUT"]
    assert len(puts) > 2 and all(r.headers.get("if-none-match") == "*" for r in puts)


# --------------------------------------------------- differential merge + GC on S3

@pytest.mark.parametrize("seed", [5])
def test_randomized_differential_then_gc_on_s3(px, raw, secret, spark, seed):
    """tests/test_merge.py's differential check on S3 (with some throttling thrown in), then GC
    with a foreign manifest version planted at the moment memwal commits its trim."""
    bucket = new_bucket(raw)
    loc = open_store(f"s3://{bucket}/{PREFIX}", s3_options(px.endpoint, secret))
    demo.create_table(loc, sharding="bucket", num_buckets=3, base_rows=30, btree_index=True)
    w = demo.Workload(loc, seed=seed, key_space=300, max_memtable_rows=30)
    progress_seen: dict[str, int] = {}
    for step in range(2):
        w.write_round(150, overwrite=0.3, delete=0.05, absent_delete=0.02, puts_per_batch=15)
        px.throttle("get", 2)   # Spark tasks and the driver read through a throttled server
        px.throttle("head", 2)
        budget = [6_000, 10**9][step]  # several small commits, then one big one
        result = merge.merge(loc, spark, budget_bytes=budget)
        assert not result.region_errors
        assert result.commits >= (2 if step == 0 else 1)
        assert as_dict(reader.lsm_table(loc)) == w.expected()
        merged = table.read_memwal_state(loc).merged
        for rid, g in merged.items():
            assert g >= progress_seen.get(rid, 0)
        progress_seen = merged
    assert merge.plan_merge(loc).batches == []
    assert as_dict(table.open_dataset(loc).to_table()) == w.expected()
    assert px.count(injected=True) == 8

    # Catch the index up, clean old base versions, then plan GC.
    assert not catchup.run_catchup(loc).errors
    snapshot.build_snapshot(loc)  # region values recorded (the index builder runs before GC)
    gc.cleanup_base_versions(loc, FAST_GC)
    plan = gc.plan_gc(loc, FAST_GC)
    assert not plan.region_errors
    counts = plan.counts()
    assert counts["generation"] == sum(len(region.load_latest(loc.store, r).generations) for r in w.regions.values())
    assert counts["manifest"] > 0

    # The first trim commit of a region meets a version planted right before it reaches the
    # server: a copy of the latest with an extra field (as a newer writer might write).
    marker = b"\x98\x06\x2a"  # field 99 (unknown to memwal and pylance 14) = 42
    planted: dict = {}

    def plant(req: Request) -> None:
        rid = req.key.split("/")[2]
        version = layout.parse_bitrev(req.key.rsplit("/", 1)[-1])
        prev = raw.get_object(Bucket=bucket, Key=f"{PREFIX}/{layout.manifest_key(rid, version - 1)}")["Body"].read()
        msg = pb.RegionManifest.FromString(prev)
        msg.version = version
        data = msg.SerializeToString() + marker
        raw.put_object(Bucket=bucket, Key=req.key, Body=data)
        planted.update(rid=rid, key=req.key, data=data, version=version)

    px.reset_counts()
    px.throttle("delete_batch", 1)
    px.before(lambda r: by_memwal(r) and is_manifest(r) and r.method == "PUT", plant)
    res = gc.execute_gc(loc, plan)
    assert not res.region_errors and res.manifest_commits == 3
    assert res.deleted_objects == plan.objects
    assert loc.store.stats["delete_batch"] >= 1 and loc.store.stats.get("delete", 0) == 0
    assert px.count("delete_batch", injected=True) == 1
    assert px.count("delete", match=by_memwal) == 0  # deletes went out in batches only

    # The planted version is untouched; memwal's trim landed after it and kept its field.
    rid, key, n1 = planted["rid"], planted["key"], planted["version"]
    assert raw.get_object(Bucket=bucket, Key=key)["Body"].read() == planted["data"]
    latest = region.load_latest(loc.store, rid)
    assert latest.version == n1 + 1
    assert marker in latest.raw and latest.generations == []  # re-applied on top of the planted one
    statuses = [r.status for r in px.requests if by_memwal(r) and is_manifest(r) and r.method == "PUT"]
    assert statuses.count(412) == 1 and statuses.count(200) == 3

    # Nothing the executed plan listed is left under the table prefix.
    left = bucket_keys(raw, bucket)
    for item in plan.items:
        for k in item.keys:
            assert f"{PREFIX}/{k}" not in left, (item.kind, k)
        if item.kind in (gc.GENERATION, gc.ORPHAN):
            assert not any(k.startswith(f"{PREFIX}/{item.path}/") for k in left), item.path
    assert as_dict(reader.lsm_table(loc)) == w.expected()


# ------------------------------------------------------------------ the CLI, cut mid-run

def _memwal(*args: str, env: dict | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([MEMWAL, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_cli_on_s3_cut_mid_run_then_rerun_converges(px, raw, secret, spark):
    """`memwal status` / `memwal maintain` with --storage-option flags against the proxy. The
    "server" dies right after the merge commit of a maintenance pass (the CLI's own `run_pass`,
    run in this process to share its Spark session): every failed step is one line naming what
    failed. With the server back (same port, data intact) `memwal maintain` converges, without
    starting Spark since nothing is left to merge."""
    from memwal_pipeline.cli import STEPS, run_pass, split_secrets
    from memwal_pipeline.config import single_table

    bucket = new_bucket(raw)
    uri = f"s3://{bucket}/{PREFIX}"
    opts = s3_options(px.endpoint, secret, s3_max_attempts="2", client_max_retries="0")
    loc = open_store(uri, opts)
    w = make_table(loc, regions=2, rounds=2)
    flags = [a for k, v in opts.items() for a in ("--storage-option", f"{k}={v}")]

    assert [len(r.pending_generations) for r in status.table_status(loc).regions] == [2, 2]

    # Cut: the first base-table commit (Lance's conditional PUT of a _versions manifest) is
    # answered, then the server is gone.
    version = table.open_dataset(loc).version
    px.cut_after(lambda r: r.kind == "put_if_absent" and r.key.startswith(f"{PREFIX}/_versions/"))
    plain, secrets = split_secrets(opts)  # a TableConfig holds no secret values
    cfg = single_table(uri, plain, spark_master="local[2]", base_versions_older_than=0, base_versions_floor=0)
    report = run_pass(cfg, list(STEPS), secrets=secrets)
    assert px.cut_at is not None and px.is_down
    failed = report.failed
    assert [f.split(":", 1)[0] for f in failed] == ["merge", "compact", "catchup", "index", "gc"], failed
    for line in failed:
        assert "\n" not in line and "Traceback" not in line, line
        assert px.endpoint in line or uri in line, line  # names the table or the endpoint
        assert secret not in line
    px.up()
    # The pass's lease release never reached the server: for everyone else the lease stays held
    # by this (live) process until its TTL; this process knows that acquisition ended and takes
    # it back at once (a `memwal maintain` that exits is taken over at once by its dead pid).
    lease.acquire(loc, "test", LeaseOptions(wait_seconds=0)).release()
    # The merge committed before the cut: progress is recorded, nothing is merged twice later.
    state = table.read_memwal_state(loc)
    assert table.open_dataset(loc).version == version + 1
    assert all(state.merged[r] == region.load_latest(loc.store, r).current_generation - 1
               for r in w.regions.values())

    # The server is back on the same port with its data: the CLI converges. Nothing is left to
    # merge, so the merge never starts Spark (a master nobody listens on proves it; a malformed
    # one is refused before anything runs). Compaction is left out here: this small table is
    # kept fully compacted, so the merged fragment is work for its Spark tasks.
    run = _memwal("maintain", uri, *flags, "--base-versions-older-than", "0", "--base-versions-floor", "0", "--json",
                  "--only", "merge,index,catchup,gc", "--spark-master", "spark://127.0.0.1:1")
    assert run.returncode == 0, run.stderr[-3000:]
    rep = json.loads(run.stdout)
    assert rep["steps"]["merge"]["metrics"]["generations_merged"] == 0
    assert rep["steps"]["gc"]["metrics"]["generations_deleted"] == 4
    assert as_dict(table.open_dataset(loc).to_table()) == w.expected()
    assert as_dict(reader.lsm_table(loc)) == w.expected()
    # Credentials from the environment instead of the command line (where `ps` shows them):
    # boto3 and Lance both pick them up.
    px.reset_counts()
    public = [a for k, v in opts.items() if not k.startswith("aws_") or k in ("aws_endpoint", "aws_region")
              for a in ("--storage-option", f"{k}={v}")]
    st2 = _memwal("status", uri, *public, "--json",
                  env={"AWS_ACCESS_KEY_ID": "env-key-id", "AWS_SECRET_ACCESS_KEY": secret})
    assert st2.returncode == 0 and json.loads(st2.stdout)["pending_generations"] == 0
    signers = {(r.headers["user-agent"].split("/")[0], r.headers["authorization"].split("/")[0])
               for r in px.requests}
    assert signers == {("Boto3", "AWS4-HMAC-SHA256 Credential=env-key-id"),
                       ("pylance", "AWS4-HMAC-SHA256 Credential=env-key-id")}, signers
    for p in (run, st2):
        assert secret not in p.stdout and secret not in p.stderr


# ------------------------------------------------------------- the Dagster pipeline on S3

RUNS = """
query Runs { runsOrError { __typename ... on Runs { results { runId jobName status runConfigYaml
  tags { key value } } } } }
"""
RESOURCES = """
query Resources($selector: RepositorySelector!) {
  allTopLevelResourceDetailsOrError(repositorySelector: $selector) {
    __typename
    ... on ResourceDetailsList { results { name configuredValues { key value type }
      configFields { name isSecret defaultValueAsJson } } }
  }
  utilizedEnvVarsOrError(repositorySelector: $selector) {
    __typename ... on EnvVarWithConsumersList { results { envVarName envVarConsumers { name } } }
  }
}
"""
LAUNCHPAD = """
query Launchpad($selector: PipelineSelector!) {
  runConfigSchemaOrError(selector: $selector) {
    __typename ... on RunConfigSchema { rootDefaultYaml }
  }
}
"""
LOGS = """
query Logs($runId: ID!) {
  logsForRun(runId: $runId) { __typename ... on EventConnection { events { __typename
    ... on MessageEvent { message level }
    ... on ExecutionStepFailureEvent { error { message stack causes { message } } } } } }
}
"""
MATERIALIZATIONS = """
query Mats($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) { __typename ... on AssetNode {
    assetMaterializations(limit: 50) { metadataEntries { label __typename
      ... on JsonMetadataEntry { jsonString } ... on TextMetadataEntry { text }
      ... on MarkdownMetadataEntry { mdStr } } } } }
}
"""


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001 - a record that cannot format is kept raw
            self.lines.append(repr(record.__dict__))


@pytest.fixture
def captured_logs():
    """Every Python log record at DEBUG (botocore, dagster, memwal, ...) while the test runs."""
    cap = _LogCapture()
    root = logging.getLogger()
    old = root.level
    quiet = {n: logging.getLogger(n).level for n in ("py4j", "py4j.clientserver", "py4j.java_gateway")}
    root.addHandler(cap)
    root.setLevel(logging.DEBUG)
    for n in quiet:
        logging.getLogger(n).setLevel(logging.WARNING)  # every JVM call otherwise
    yield cap
    root.removeHandler(cap)
    root.setLevel(old)
    for n, lvl in quiet.items():
        logging.getLogger(n).setLevel(lvl)


def _tick(defs, td, instance, cursor):
    """One sensor evaluation applied to the instance as the daemon applies it (as in
    tests/test_pipeline.py: ticks that add partitions call the sensor body directly)."""
    resources = {k: v.process_config_and_initialize() for k, v in td.resources.items()
                 if k.endswith("_table")}
    loc = resources[f"{td.cfg.name}_table"].location()
    ctx = build_sensor_context(instance=instance, cursor=cursor, definitions=defs, resources=td.resources)
    known = set(instance.get_dynamic_partitions(td.partitions.name))
    if set(region.list_regions(loc.store).region_ids) <= known:
        with partition_loading_context(dynamic_partitions_store=instance):
            data = defs.get_sensor_def(td.sensor.name).evaluate_tick(ctx)
    else:
        data = evaluate_tick(ctx, td.cfg, td.partitions, td.merge_job.name, td.maintenance_job.name, loc)
        if isinstance(data, SkipReason):
            return [], cursor
    for req in data.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    for ev in data.asset_events or []:
        instance.report_runless_asset_event(ev)
    return list(data.run_requests or []), (data.cursor if data.cursor is not None else cursor)


def test_pipeline_on_s3_from_config_with_env_secret_and_ui(px, raw, secret, spark, tmp_path, monkeypatch,
                                                         captured_logs, capfd):
    """Config file with `secrets:` -> build_definitions -> sensor ticks -> merge runs (Spark
    tasks on S3) -> maintenance (index, catch-up, GC with batched deletes), all on s3://, then:
    the secret is in no log line, event, metadata, run config, UI answer or error message."""
    bucket = new_bucket(raw)
    monkeypatch.setenv(SECRET_ENV, secret)
    loc = open_store(f"s3://{bucket}/{PREFIX}", s3_options(px.endpoint, secret))
    w = make_table(loc, regions=2, rounds=2)
    public = f'{{aws_endpoint: "{px.endpoint}", aws_region: us-east-1, aws_access_key_id: testing}}'
    config = tmp_path / "memwal.yaml"
    config.write_text(textwrap.dedent(f"""
        tables:
          - name: s3t
            uri: s3://{bucket}/{PREFIX}
            storage_options: {public}
            secrets: {{aws_secret_access_key: {SECRET_ENV}}}
            spark: {{master: "local[2]"}}
            gc: {{manifest_retention: 2, manifest_min_age_seconds: 0, orphan_grace_seconds: 0,
                 cleanup_base_versions_older_than_seconds: 0, cleanup_base_versions_floor_seconds: 0}}
          - name: s3bad
            uri: s3://memwal-no-such-bucket/{PREFIX}
            storage_options: {{aws_endpoint: "{px.endpoint}", aws_region: us-east-1, aws_access_key_id: testing,
                              s3_max_attempts: "2", client_max_retries: "0"}}
            secrets: {{aws_secret_access_key: {SECRET_ENV}}}
    """))
    assert secret not in config.read_text()
    tables = load_config(config)
    defs = build_definitions(tables)
    td = table_definitions(tables[0])
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(f"storage:\n  sqlite:\n    base_dir: {home}\ntelemetry:\n  enabled: false\n")

    with DagsterInstance.from_config(str(home)) as instance:
        instance.get_runs()  # create the SQLite storage before the server opens it
        # The webserver knows the secret (same environment) and loads while Spark merges.
        server = WebServer(str(home), str(config), str(tmp_path / "webserver.log"))
        try:
            px.reset_counts()
            cursor, runs = None, []
            for _ in range(6):
                reqs, cursor = _tick(defs, td, instance, cursor)
                if not reqs:
                    break
                for req in reqs:
                    out = defs.resolve_job_def(req.job_name).execute_in_process(
                        instance=instance, partition_key=req.partition_key, tags=req.tags)
                    assert out.success, req.job_name
                    runs.append(req.job_name)
            assert sorted(runs) == ["s3t_maintenance", "s3t_merge"]  # one merge run for both regions

            # Converged: the base table is the model, every generation merged, caught up, collected.
            state = table.read_memwal_state(loc)
            assert as_dict(table.open_dataset(loc).to_table()) == w.expected()
            for rid in w.regions.values():
                m = region.load_latest(loc.store, rid)
                assert m.generations == [] and state.merged[rid] == m.current_generation - 1
                assert state.catchup["id_btree"][rid] == state.merged[rid]
            assert state.details.num_regions == 2
            assert not [k for k in bucket_keys(raw, bucket) if "_gen_" in k]
            # On the wire: GC deleted in batches only, and memwal's manifest commits were conditional.
            assert px.count("delete_batch", match=by_memwal) >= 1
            assert px.count("delete", match=by_memwal) == 0
            commits = [r for r in px.requests if by_memwal(r) and is_manifest(r) and r.method == "PUT"]
            assert commits and all(r.headers.get("if-none-match") == "*" for r in commits)
            md = instance.fetch_materializations(AssetKey(["s3t", "garbage"]), limit=1).records[0] \
                .asset_materialization.metadata
            assert md["generations_deleted"].value == 4 and md["regions_failed"].value == 0

            # A forced error: the same secret against a bucket that does not exist.
            bad = table_definitions(tables[1])
            out = defs.resolve_job_def("s3bad_maintenance").execute_in_process(instance=instance,
                                                                              raise_on_error=False)
            assert not out.success
            failures = [e for e in out.all_events if e.is_step_failure]
            assert failures
            for f in failures:
                err = f.step_failure_data.error
                text = serialize_value(err)
                assert secret not in text
                assert "memwal-no-such-bucket" in text
            bad_loc = bad.resources["s3bad_table"].process_config_and_initialize().location()
            with pytest.raises(StoreError) as ei:
                evaluate_tick(build_sensor_context(instance=instance), bad.cfg, bad.partitions,
                              "m", "x", bad_loc)
            msg = one_line_error(str(ei.value))
            assert "NoSuchBucket" in msg and secret not in msg
            with pytest.raises(table.TableError) as ei:
                merge.plan_merge(bad_loc)
            msg = one_line_error(str(ei.value))
            assert "memwal-no-such-bucket" in msg and secret not in msg
            assert secret not in repr(bad_loc) and secret not in repr(loc)

            # --- the secret is nowhere the instance, the logs or the process output hold it.
            all_runs = instance.get_runs()
            assert len(all_runs) == 3  # one merge run (both regions), maintenance, s3bad maintenance
            for run in all_runs:
                assert secret not in serialize_value(run)
                for entry in instance.all_logs(run.run_id):
                    assert secret not in (entry.message or ""), entry.message
                    assert secret not in serialize_value(entry)
            for name in ("s3t", "s3bad"):
                for short in ("region_generations", "base_table", "base_compaction", "memwal_index", "index_catchup",
                              "garbage"):
                    key = AssetKey([name, short])
                    for rec in instance.fetch_materializations(key, limit=100).records:
                        assert secret not in serialize_value(rec.asset_materialization)
                    for rec in instance.fetch_observations(key, limit=100).records:
                        assert secret not in serialize_value(rec.event_log_entry)
            for dirpath, _dirs, files in os.walk(home):
                for f in files:
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        assert secret.encode() not in fh.read(), os.path.join(dirpath, f)
            assert captured_logs.lines and any("botocore" in ln for ln in captured_logs.lines)
            leaked = [ln for ln in captured_logs.lines if secret in ln]
            assert not leaked, leaked[:3]
            outerr = capfd.readouterr()
            assert secret not in outerr.out and secret not in outerr.err

            # --- what the UI's GraphQL API shows.
            server.wait_ready()
            location = server.graphql(LOCATIONS)["workspaceOrError"]["locationEntries"][0]["name"]
            selector = {"repositoryName": "__repository__", "repositoryLocationName": location}
            answers = []
            data = server.graphql(RUNS)
            answers.append(data)
            ui_runs = data["runsOrError"]["results"]
            assert len(ui_runs) == 3
            for r in ui_runs:
                assert secret not in r["runConfigYaml"]
                answers.append(server.graphql(LOGS, {"runId": r["runId"]}))
            data = server.graphql(RESOURCES, {"selector": selector})
            answers.append(data)
            res = {r["name"]: r for r in data["allTopLevelResourceDetailsOrError"]["results"]}
            for name in ("s3t_table", "s3bad_table"):
                values = {v["key"]: v for v in res[name]["configuredValues"]}
                assert values["aws_secret_access_key"] == {"key": "aws_secret_access_key", "value": SECRET_ENV,
                                                           "type": "ENV_VAR"}
                assert json.loads(values["storage_options"]["value"])["aws_access_key_id"] == "testing"
            env_vars = {e["envVarName"] for e in data["utilizedEnvVarsOrError"]["results"]}
            assert SECRET_ENV in env_vars
            for job in ("s3t_merge", "s3t_maintenance"):
                data = server.graphql(LAUNCHPAD, {"selector": {**selector, "pipelineName": job}})
                answers.append(data)
                assert SECRET_ENV in data["runConfigSchemaOrError"]["rootDefaultYaml"]
            for short in ("base_table", "garbage"):
                answers.append(server.graphql(MATERIALIZATIONS, {"key": {"path": ["s3t", short]}}))
            blob = json.dumps(answers)
            assert secret not in blob
            assert "memwal-no-such-bucket" in blob  # the forced error is what the UI shows
        finally:
            server.stop()
        with open(server.log_path, "rb") as f:
            assert secret.encode() not in f.read()


# -------------------------------------------------- a real moto stopped and restarted

def test_server_stopped_then_restarted_on_the_same_port(secret):
    """A real moto server dies under memwal: status, merge, GC and `memwal maintain` fail with
    one line naming what failed. Restarted on the same port it is reachable again through the
    same clients (their pooled connections are dead), but empty, which is also said clearly."""
    with LocalS3() as s3:
        opts = s3_options(s3.endpoint, secret, s3_max_attempts="2", client_max_retries="0")
        make_s3_client(opts).create_bucket(Bucket="memwal-restart")
        uri = f"s3://memwal-restart/{PREFIX}"
        loc = open_store(uri, opts)
        make_table(loc, regions=2, rounds=1, btree=False)
        assert len(status.table_status(loc).regions) == 2
        port = s3.port
        s3.stop()

        failures = {}
        for name, fn in (("status", lambda: status.table_status(loc)),
                         ("merge", lambda: merge.merge(loc, None)),  # fails while planning: no Spark needed
                         ("gc", lambda: gc.run_gc(loc, FAST_GC))):
            with pytest.raises(Exception) as ei:
                fn()
            failures[name] = one_line_error(str(ei.value))
        for name, msg in failures.items():
            assert s3.endpoint in msg or uri in msg, (name, msg)
            assert secret not in msg
        flags = [a for k, v in opts.items() for a in ("--storage-option", f"{k}={v}")]
        run = _memwal("maintain", uri, *flags)
        assert run.returncode == 1
        line = one_line_error("\n".join(ln for ln in run.stderr.splitlines() if ln.startswith("error")))
        assert "Could not connect" in line and f"{uri}/_mem_wal" in line, line
        assert secret not in run.stderr + run.stdout

        s3.start()
        assert s3.port == port
        with pytest.raises(StoreError) as ei:
            region.list_regions(loc.store)
        msg = one_line_error(str(ei.value))
        assert "NoSuchBucket" in msg and uri in msg


# -------------------------------------------------------------------- secrets in config

def test_config_refuses_secret_option_aliases(tmp_path):
    """Lance and memwal both accept `secret_access_key` / `session_token` / `token` for the
    AWS secret options: those belong under `secrets:` too, or the UI would show them."""
    for name in ("secret_access_key", "AWS_SECRET_ACCESS_KEY", "session_token", "token"):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(f"tables:\n  - name: x\n    uri: s3://b/x\n    storage_options: {{{name}: oops}}\n")
        with pytest.raises(ConfigError, match="secrets"):
            load_config(cfg)


def test_s3_demo_steps_against_moto(moto_server, spark, capsys, monkeypatch):
    """`make s3-demo`'s steps (`s3_demo.main` runs exactly `run_demo` inside its own server)
    against the session's moto server: the table, the pass, the status (the step that crashed
    on a hand-made argparse Namespace), the LSM check; the secret is never printed."""
    from support import s3_demo

    monkeypatch.setenv(s3_demo.SECRET_ENV, "")  # restored after: run_demo sets it
    bucket = f"demo{uuid.uuid4().hex[:12]}"
    rc = s3_demo.run_demo(moto_server, bucket=bucket, regions=2, rows=60, spark_master="local[2]")
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert f"table s3://{bucket}/demo_table" in out and "2 regions, 0 pending generations" in out, out
    assert "LSM read equals what the writers wrote: yes" in out
    assert os.environ[s3_demo.SECRET_ENV] not in out + err


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMWAL_SOAK"), reason="runs `make s3-demo` (~1 min); MEMWAL_SOAK=1")
def test_s3_demo_runs():
    out = subprocess.run([sys.executable, "-m", "support.s3_demo", "--regions", "2", "--rows", "100",
                          "--spark-master", "local[1]"], cwd=os.path.join(REPO, "tests"), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LSM read equals what the writers wrote: yes" in out.stdout
    assert "demo-" not in out.stdout + out.stderr.replace("memwal-demo", "")
