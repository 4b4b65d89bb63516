"""The bad-input catalogue: damaged or unexpected tables through `memwal maintain URI`.

Each case is run through the user-facing CLI (a subprocess, as a user runs it) and checked for
(1) the exact message it gives: one line naming the region where there is one, and the exit
status; (2) what was kept: the file tree (paths, sizes, mtimes) before and after, where only
legitimate changes are allowed (healthy regions merged and collected, base-table versions
added and cleaned).

To save JVM starts most region cases share one table ("table A": healthy regions next to
broken ones, one `memwal maintain` run); the table-level and S3 cases get a table each, and
all CLI runs go at once. The messages are printed (`pytest -s`) and copied into
docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

import lance
import pyarrow as pa
import pytest
from support.helpers import plant_generation, tree
from lance.mem_wal import CompactedSsTable, evaluate_sharding_spec

from memwal_core.jobs import gc, snapshot
from memwal_core.observe import checks
from memwal_core.state import layout, region, table
from memwal_core.state.store import make_s3_client, open_store
from memwal_core.tools import demo
from support.s3_server import LocalS3

N_BUCKETS = 16


# ---------------------------------------------------------------------------------- helpers

def s3_tree(client, bucket: str) -> dict[str, tuple[int, str]]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            if f"/{layout.LEASE_DIR}/" not in f"/{o['Key']}":  # the lease's records (see helpers.tree)
                out[o["Key"]] = (o["Size"], o["ETag"])
    return out


def maintain_cmd(uri: str, *extra: str, options: dict | None = None) -> list[str]:
    opts = [a for k, v in (options or {}).items() for a in ("--storage-option", f"{k}={v}")]
    return [sys.executable, "-m", "memwal_pipeline.cli", "maintain", uri, *opts, *extra]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MEMWAL_")}


@dataclass
class Run:
    """A finished `memwal maintain` run and the trees around it."""

    cmd: list[str]
    returncode: int = 0
    stderr: str = ""
    seconds: float = 0.0
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)

    NOISE = ("WARNING: Using incubator modules", "Setting default log level", "To adjust logging level",
             "warnings.warn(", "lance is not fork-safe", "log4j", "Index __lance_mem_wal has no fields")

    @property
    def lines(self) -> list[str]:
        """stderr without the JVM's and pylance's own start-up noise."""
        return [ln for ln in self.stderr.splitlines() if ln.strip() and not any(n in ln for n in self.NOISE)]

    def about(self, text: str) -> list[str]:
        return [ln for ln in self.lines if text in ln]

    def errors(self) -> list[str]:
        return [ln for ln in self.lines if ln.startswith("error: ")]


def rows(keys: list[int], version: int) -> pa.Table:
    return demo.rows_table([demo.row(k, version) for k in keys])


class Buckets:
    """Keys by bucket value of a table's region spec (pylance's own routing)."""

    def __init__(self, ds: lance.LanceDataset, first: int = 1000, count: int = 6000):
        spec = ds.mem_wal_index_details()["sharding_specs"][0]
        keys = list(range(first, first + count))
        values = evaluate_sharding_spec(pa.record_batch([pa.array(keys, pa.int64())], names=["id"]), spec,
                                        ds.lance_schema).column(0).to_pylist()
        self.free: dict[int, list[int]] = {}
        for k, v in zip(keys, values):
            self.free.setdefault(v, []).append(k)

    def take(self, bucket: int, n: int) -> list[int]:
        out, self.free[bucket] = self.free[bucket][:n], self.free[bucket][n:]
        return out


def write_generation(uri: str, rid: str, data: pa.Table) -> None:
    """One writer session = one flushed generation (pylance flushes on close)."""
    with lance.dataset(uri).mem_wal_writer(rid, max_memtable_rows=10_000) as w:
        if data.num_rows:
            w.put(data)


def manifest_versions(root: str, rid: str) -> list[int]:
    d = os.path.join(root, layout.manifest_dir(rid))
    return sorted(v for v in (layout.parse_bitrev(f) for f in os.listdir(d)) if v)


def under(path: str, rid: str) -> bool:
    return path.startswith(f"{layout.region_dir(rid)}/")


# ------------------------------------------------------------------- a TCP proxy to pull away

class Proxy:
    """Forwards 127.0.0.1:port to a server; `stop()` makes the server disappear for clients."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                c.close()
                continue
            self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopped = True
        self.sock.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass


class Moto(LocalS3):
    """A moto S3 server of this module's own (its auth switch is server-wide), started at once."""

    def __init__(self) -> None:
        super().__init__()
        self.start()

    def options(self, endpoint: str | None = None) -> dict[str, str]:
        return {"aws_endpoint": endpoint or self.endpoint, "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing-secret", "aws_region": "us-east-1"}

    def require_auth(self, on: bool) -> None:
        """moto's switch: "0" = every request needs known IAM credentials ("testing" is not)."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0" if on else b"inf",
                                     method="POST", headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(req, timeout=10).read()


# ------------------------------------------------------------------------- the tables

REGION_CASES = ["healthy_1", "healthy_2", "truncated_manifest", "garbage_manifest", "version_gap",
                "garbage_hint", "stale_hint", "missing_generation", "unsafe_path", "schema_mismatch",
                "misrouted_rows", "no_generations"]
BROKEN = {"truncated_manifest", "garbage_manifest", "version_gap", "unsafe_path", "no_generations"}


@dataclass
class TableA:
    root: str
    rids: dict[str, str]  # case -> region id
    gens: dict[str, dict[int, list[int]]]  # case -> generation -> keys written in it
    base: dict[int, dict]  # the base table's rows before maintain
    stray: list[int]  # misrouted keys
    planted: list[int]  # keys of the wrong-schema generation
    bad_generation: dict[str, int]  # case -> the generation memwal must refuse
    outside: str  # where the unsafe path points (a real Lance dataset)


def build_table_a(root: str) -> TableA:
    loc = open_store(root)
    ds = demo.create_table(loc, sharding="bucket", num_buckets=N_BUCKETS, base_rows=20)
    uri = loc.lance_uri
    keys = Buckets(ds)
    rids = {case: str(uuid.UUID(int=i + 1, version=4)) for i, case in enumerate(REGION_CASES)}
    gens: dict[str, dict[int, list[int]]] = {}
    bad: dict[str, int] = {}
    n_gens = {"version_gap": 3, "missing_generation": 3, "no_generations": 0, "schema_mismatch": 1,
              "misrouted_rows": 1}
    for b, case in enumerate(REGION_CASES):
        gens[case] = {}
        rid = rids[case]
        if case == "no_generations":
            write_generation(uri, rid, rows([], 0))  # a writer that opened and closed, nothing put
            continue
        for g in range(1, n_gens.get(case, 2) + 1):
            ks = keys.take(b, 5)
            write_generation(uri, rid, rows(ks, 10 * b + g))
            gens[case][g] = ks

    # Rows of another region value (bucket 15, used by no region) in a flushed generation.
    stray = keys.take(N_BUCKETS - 1, 7)
    own = keys.take(REGION_CASES.index("misrouted_rows"), 3)
    write_generation(uri, rids["misrouted_rows"], rows(own + stray, 99))
    gens["misrouted_rows"][2] = own + stray
    bad["misrouted_rows"] = 2
    # A generation whose columns differ from the base table's.
    planted = keys.take(REGION_CASES.index("schema_mismatch"), 2)
    wrong = pa.table({"id": pa.array(planted, pa.int64()), "n": pa.array([1, 2], pa.int64()),
                      "other": pa.array(["x", "y"]), "_tombstone": pa.array([False, False])})
    bad["schema_mismatch"] = plant_generation(loc, rids["schema_mismatch"], wrong)
    # A generation whose path leaves the region directory, pointing at a real Lance dataset.
    outside = os.path.join(root, "outside")
    lance.write_dataset(rows([9001, 9002], 9).append_column("_tombstone", pa.array([False, False])), outside)
    bad["unsafe_path"] = plant_generation(loc, rids["unsafe_path"], rows([9001, 9002], 9), path="../../outside")
    # A listed generation whose directory is gone.
    m = region.load_latest(loc.store, rids["missing_generation"])
    g2 = next(g for g in m.generations if g.generation == 2)
    shutil.rmtree(os.path.join(root, layout.generation_dir(rids["missing_generation"], g2.path, 2)))
    bad["missing_generation"] = 2
    # Manifests: truncated, garbage, and a version gap (the one before the latest deleted, a stale hint).
    for case in ("truncated_manifest", "garbage_manifest"):
        rid = rids[case]
        key = os.path.join(root, layout.manifest_key(rid, region.load_latest(loc.store, rid).version))
        raw = open(key, "rb").read()
        with open(key, "wb") as f:
            f.write(raw[: len(raw) * 2 // 3] if case == "truncated_manifest" else b"\x00\xffnot a manifest")
    rid = rids["version_gap"]
    latest = region.load_latest(loc.store, rid).version
    os.unlink(os.path.join(root, layout.manifest_key(rid, latest - 1)))
    # A stale hint naming a version below the gap (with no usable hint, loading lists the
    # directory and finds the real latest).
    loc.store.put(layout.version_hint_key(rid), json.dumps({"version": latest - 2}).encode())
    # Version hints: garbage, and stale (points at version 1).
    loc.store.put(layout.version_hint_key(rids["garbage_hint"]), b"{broken")
    loc.store.put(layout.version_hint_key(rids["stale_hint"]), b'{"version": 1}')
    # A directory under _mem_wal/ that is not a region.
    loc.store.put(f"{layout.MEM_WAL_DIR}/not-a-region/manifest/{layout.bitrev(1)}.binpb", b"junk")
    base = {r["id"]: r for r in lance.dataset(uri).to_table().to_pylist()}
    return TableA(root, rids, gens, base, stray, planted, bad, outside)


def build_simple(root: str, case: str) -> None:
    loc = open_store(root)
    if case == "no_primary_key":
        schema = pa.schema([f.remove_metadata() for f in demo.SCHEMA])
        ds = lance.write_dataset(rows([1, 2], 0).cast(schema), root)
        ds.initialize_mem_wal(unsharded=True)
        write_generation(root, str(uuid.uuid4()), rows([3, 4], 1).cast(schema))
    elif case == "not_initialized":
        lance.write_dataset(rows([1, 2], 0), root)
    elif case == "index_removed":
        demo.create_table(loc, sharding="bucket", num_buckets=4, base_rows=10)
        w = demo.Workload(loc, seed=3, key_space=100, max_memtable_rows=30)
        w.write_round(40)
        # Overwritten by a plain write: the new version has no MemWAL index, _mem_wal/ is left.
        lance.write_dataset(rows([1, 2], 5), root, mode="overwrite")
    elif case == "empty":
        demo.create_table(loc, sharding="bucket", num_buckets=4, base_rows=10)
    else:
        raise ValueError(case)


SIMPLE = ["not_initialized", "index_removed", "empty"]  # through the CLI; no primary key: library


def _run_all(jobs: dict[str, Run], servers: dict[str, Moto], proxy: Proxy, stopped_at: list[str]) -> None:
    """Make the S3 tables, then run every job at once (threads, one subprocess each)."""
    s3: dict[str, tuple[str, object]] = {}
    for case, moto in servers.items():
        client = make_s3_client(moto.options())
        bucket = f"b{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        loc = open_store(f"s3://{bucket}/t", moto.options())
        demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=10)
        w = demo.Workload(loc, seed=5, key_space=100, max_memtable_rows=30)
        w.write_round(40)
        s3[case] = (bucket, client)
    jobs["s3_403"] = Run(maintain_cmd(f"s3://{s3['s3_403'][0]}/t", options=servers["s3_403"].options()),
                         before=s3_tree(s3["s3_403"][1], s3["s3_403"][0]))
    jobs["s3_gone"] = Run(maintain_cmd(f"s3://{s3['s3_gone'][0]}/t",
                                       options=servers["s3_gone"].options(f"http://127.0.0.1:{proxy.port}")),
                          before=s3_tree(s3["s3_gone"][1], s3["s3_gone"][0]))
    servers["s3_403"].require_auth(True)

    def run(name: str) -> None:
        job = jobs[name]
        t0 = time.monotonic()
        p = subprocess.Popen(job.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
        out = []
        for line in p.stderr:
            out.append(line)
            if name == "s3_gone" and "] merge ..." in line and not stopped_at:
                proxy.stop()  # the regions are listed; the server disappears under the merge
                stopped_at.append(line.strip())
        p.wait(timeout=600)
        p.stdout.read()
        job.returncode, job.stderr, job.seconds = p.returncode, "".join(out), time.monotonic() - t0

    threads = [threading.Thread(target=run, args=(n,)) for n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    servers["s3_403"].require_auth(False)
    for case in servers:
        jobs[case].after = s3_tree(s3[case][1], s3[case][0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Build every table, then run every `memwal maintain` at once; the S3 ones on a moto
    server of their own (403: its auth switch flipped; gone: a proxy pulled away mid-run)."""
    tmp = tmp_path_factory.mktemp("catalogue")
    a = build_table_a(str(tmp / "a"))
    jobs: dict[str, Run] = {}
    jobs["A"] = Run(maintain_cmd(a.root, "--base-versions-older-than", "0", "--base-versions-floor", "0"), before=tree(a.root))
    for case in SIMPLE:
        root = str(tmp / case)
        build_simple(root, case)
        jobs[case] = Run(maintain_cmd(root), before=tree(root))

    # Two servers: the 403 one has its (server-wide) auth switch flipped during the runs.
    servers: dict[str, Moto] = {}
    proxy = None
    try:
        for name in ("s3_403", "s3_gone"):
            servers[name] = Moto()
        proxy = Proxy(servers["s3_gone"].port)
        stopped_at: list[str] = []
        _run_all(jobs, servers, proxy, stopped_at)
    finally:
        if proxy is not None:
            proxy.stop()
        for moto in servers.values():
            moto.stop()
    jobs["A"].after = tree(a.root)
    for case in SIMPLE:
        jobs[case].after = tree(str(tmp / case))
    print("\n[catalogue] CLI runs:")
    for name, job in jobs.items():
        print(f"--- {name}: exit {job.returncode} in {job.seconds:.0f} s")
        for ln in job.lines:
            print(f"    {ln}")
    return {"A": a, "jobs": jobs, "stopped_at": stopped_at, "tmp": tmp}


# ---------------------------------------------------------------------------------- table A

HEALTHY = ["healthy_1", "healthy_2", "garbage_hint", "stale_hint"]
PARTIAL = ["missing_generation", "schema_mismatch", "misrouted_rows", "version_gap"]  # merged up to a point


def expected_merged(a: TableA, case: str) -> int:
    if case in HEALTHY:
        return max(a.gens[case])
    if case == "version_gap":
        return 2  # what the stale view (version 6) lists: generations 1 and 2
    if case in a.bad_generation and case != "unsafe_path":
        return a.bad_generation[case] - 1
    return 0


def test_table_a_exit_status_and_one_line_per_region_and_step(runs):
    a, job = runs["A"], runs["jobs"]["A"]
    assert job.returncode == 1
    rid = a.rids
    errors = job.errors()
    for ln in errors:
        assert "Traceback" not in ln
    # Each broken region: exactly one `error:` line per step that touched it, naming it.
    def lines(case: str, step: str) -> list[str]:
        return [ln for ln in errors if ln.startswith(f"error: {step}: region {rid[case]}: ")]

    for case in ("truncated_manifest", "garbage_manifest"):
        key = layout.manifest_key(rid[case], manifest_versions(a.root, rid[case])[-1])
        for step in ("merge", "index", "gc"):
            (ln,) = lines(case, step)
            assert f"manifest {key} (version " in ln and "cannot be decoded" in ln, ln
    (ln,) = lines("version_gap", "index")
    assert "manifest version 7 is missing but version 8 exists" in ln and "is stale; not committing" in ln, ln
    # GC plans nothing there to commit on the stale view: the index builder could not record the
    # region's value, so its merged generations are held (`value_unrecorded`) and no trim is tried.
    assert not lines("version_gap", "gc")
    assert not lines("version_gap", "merge")  # merging what the stale view lists is harmless
    (ln,) = lines("missing_generation", "merge")
    assert "generation 2: unreadable after 3 tries: ValueError: Dataset at path" in ln and "was not found" in ln, ln
    (ln,) = lines("unsafe_path", "merge")
    assert f"corrupt manifest version {manifest_versions(a.root, rid['unsafe_path'])[-1]}: " in ln, ln
    assert "unsafe generation path '../../outside': must be a plain directory name" in ln, ln
    (ln,) = lines("unsafe_path", "gc")
    assert "unsafe generation path '../../outside'" in ln and ln.endswith("nothing collected here"), ln
    (ln,) = lines("schema_mismatch", "merge")
    assert ln.endswith("generation 2: columns differ from the base table: extra ['other'], "
                       "missing ['s', 'x']"), ln
    (ln,) = lines("misrouted_rows", "merge")
    assert "generation 2: 7 rows route to another region (region value [10]; they route to [" in ln, ln
    assert ln.endswith("the spec requires mutually exclusive regions"), ln
    for case in HEALTHY + ["no_generations"]:
        for step in ("merge", "compact", "catchup", "index", "gc"):
            assert not lines(case, step), (case, step)
    assert "warning: skipping _mem_wal/not-a-region: directory name is not a region UUID" in job.lines
    hint = layout.version_hint_key(rid["garbage_hint"])
    assert (f"WARNING memwal.region: region {rid['garbage_hint']}: ignoring unreadable {hint} (Expecting "
            "property name enclosed in double quotes: line 1 column 2 (char 1))") in job.lines
    assert not job.about(rid["stale_hint"])  # a stale hint only costs probes: silent
    (ln,) = [x for x in errors if x.startswith("error: check gc_consistency: ")]
    assert f"'{rid['missing_generation']}': [2]" in ln and f"'{rid['unsafe_path']}': [3]" in ln, ln


def test_table_a_progress_and_data(runs):
    a = runs["A"]
    loc = open_store(a.root)
    merged = table.read_memwal_state(loc).merged
    base = {r["id"]: r for r in lance.dataset(a.root).to_table().to_pylist()}
    for case, rid in a.rids.items():
        want = expected_merged(a, case)
        assert merged.get(rid, 0) == want, case
        for g, keys in a.gens[case].items():
            for k in keys:
                if g <= want:
                    assert base[k] == demo.row(k, 10 * REGION_CASES.index(case) + g) or case == "misrouted_rows", (case, g, k)
                elif k not in a.base:
                    assert k not in base, (case, g, k)
    assert not set(a.stray) & set(base) and not set(a.planted) & set(base) and 9001 not in base


def test_table_a_nothing_deleted_but_what_is_legitimate(runs):
    a, job = runs["A"], runs["jobs"]["A"]
    loc = open_store(a.root)
    merged = table.read_memwal_state(loc).merged
    before, after = job.before, job.after
    gone = set(before) - set(after)
    changed = {p for p in set(before) & set(after) if before[p] != after[p]}
    added = set(after) - set(before)
    by_rid = {rid: case for case, rid in a.rids.items()}

    def region_case(p: str) -> str | None:
        parts = p.split("/")
        return by_rid.get(parts[1]) if parts[0] == layout.MEM_WAL_DIR and len(parts) > 2 else None

    def legit_delete(p: str) -> bool:
        if not p.startswith(layout.MEM_WAL_DIR + "/"):
            return not p.startswith("outside/")  # base-table versions cleaned (--base-versions-older-than 0)
        case = region_case(p)
        if case not in HEALTHY + PARTIAL or case == "version_gap":
            return False
        name = p.split("/")[2]
        if name == "wal":
            return True
        gen = layout.generation_of_dir(name)
        return gen is not None and gen <= merged[a.rids[case]]

    assert all(legit_delete(p) for p in gone), sorted(p for p in gone if not legit_delete(p))[:10]
    for p in changed | added:
        case = region_case(p)
        if p.startswith(layout.MEM_WAL_DIR + "/"):
            assert case in HEALTHY + PARTIAL and case != "version_gap" and "/manifest/" in p, p
        else:
            assert not p.startswith("outside/"), p
    # Untouched: broken regions, the region with nothing flushed, the stray directory, the
    # generation the unsafe path points at, every generation not merged.
    for case in sorted(BROKEN):
        prefix = f"{layout.region_dir(a.rids[case])}/"
        assert {p: v for p, v in before.items() if p.startswith(prefix)} == \
               {p: v for p, v in after.items() if p.startswith(prefix)}, case
    for prefix in (f"{layout.MEM_WAL_DIR}/not-a-region/", "outside/"):
        assert {p: v for p, v in before.items() if p.startswith(prefix)} == \
               {p: v for p, v in after.items() if p.startswith(prefix)}, prefix
    for case in PARTIAL:
        rid = a.rids[case]
        m = region.load_latest(loc.store, rid) if case != "version_gap" else None
        if m is not None:
            assert [g.generation for g in m.generations] == [g for g in sorted(a.gens[case]) if g > merged[rid]] \
                   or case == "schema_mismatch", case
    # Merged generations of healthy regions were collected, and their hints are right again.
    for case in HEALTHY:
        rid = a.rids[case]
        assert region.load_latest(loc.store, rid).generations == []
        assert region.read_version_hint(loc.store, rid) == manifest_versions(a.root, rid)[-1]
    assert checks.missing_generations(loc) == {a.rids["missing_generation"]: [2], a.rids["unsafe_path"]: [3]}


# ------------------------------------------------------------------------ table-level cases

def test_memwal_not_initialized(runs):
    job = runs["jobs"]["not_initialized"]
    assert job.returncode == 1
    msg = ("table {} version 1 has no MemWAL index (__lance_mem_wal): "
           "MemWAL is not initialized on this table (call LanceDataset.initialize_mem_wal first)")
    root = str(runs["tmp"] / "not_initialized")
    assert job.errors() == [f"error: {s}: {msg.format(root)}" for s in ("compact", "catchup", "index", "gc")]
    assert job.after == job.before


def test_memwal_index_gone_from_the_latest_version(runs):
    """Regions with unmerged generations, then the base table overwritten by a plain write
    (the MemWAL index is gone): every step refuses; nothing under _mem_wal/ is touched."""
    job = runs["jobs"]["index_removed"]
    root = str(runs["tmp"] / "index_removed")
    assert job.returncode == 1
    msg = (f"table {root} version 3 has no MemWAL index "
           "(__lance_mem_wal): MemWAL is not initialized on this table (call LanceDataset.initialize_mem_wal first)")
    assert job.errors() == [f"error: {s}: {msg}" for s in ("merge", "compact", "catchup", "index", "gc")]
    assert job.after == job.before


def test_empty_table(runs):
    job = runs["jobs"]["empty"]
    assert job.returncode == 0, job.lines
    assert job.errors() == []
    assert any("index done" in ln and "num regions 0" in ln for ln in job.lines), job.lines
    assert not [p for p in job.after if p.startswith(layout.MEM_WAL_DIR)]
    assert all(job.after.get(p) == v for p, v in job.before.items() if p.startswith("data/"))


def test_no_primary_key_library(tmp_path):
    """A table whose schema marks no primary key: the merger refuses before reading anything
    (the CLI starts Spark first when generations are pending, so this case runs in-process)."""
    from memwal_core.jobs import merge

    root = str(tmp_path / "nopk")
    build_simple_no_pk(root)
    loc = open_store(root)
    before = tree(root)
    with pytest.raises(table.NoPrimaryKey) as e:
        merge.execute_merge(loc, merge.plan_merge(loc), spark=None)
    assert str(e.value) == (f"table {root} has no primary key: MemWAL merges upsert by primary key, so mark the "
                            "key column with field metadata {'lance-schema:unenforced-primary-key': 'true'}")
    print(f"\n[catalogue] no primary key: {e.value}")
    assert tree(root) == before


def build_simple_no_pk(root: str) -> None:
    schema = pa.schema([f.remove_metadata() for f in demo.SCHEMA])
    ds = lance.write_dataset(rows([1, 2], 0).cast(schema), root)
    ds.initialize_mem_wal(unsharded=True)
    write_generation(root, str(uuid.uuid4()), rows([3, 4], 1).cast(schema))


# ----------------------------------------------------------------------------------- S3

def test_s3_access_denied(runs):
    job = runs["jobs"]["s3_403"]
    assert job.returncode == 1
    bucket = job.cmd[4].split("/")[2]
    assert job.errors() == [f"error: S3 list s3://{bucket}/t/_mem_wal/ failed: InvalidAccessKeyId "
                            "(access denied: check the credentials and the bucket policy)"]
    assert "testing-secret" not in job.stderr
    assert job.after == job.before


def test_s3_server_disappears_mid_run(runs):
    job = runs["jobs"]["s3_gone"]
    assert runs["stopped_at"], job.lines  # pulled away once the regions were listed
    assert job.returncode == 1
    errors = job.errors()
    steps = [ln.split(":")[1].strip() for ln in errors]
    # One line per step that lost the server (the merge may, rarely, have finished first).
    assert steps in (["merge", "compact", "catchup", "index", "gc"], ["compact", "catchup", "index", "gc"]), errors
    for ln in errors:
        assert "error sending request" in ln or "Could not connect to the endpoint URL" in ln, ln
        assert "testing-secret" not in ln
    assert job.seconds < 300
    assert job.after == job.before


# ------------------------------------------------------------------------- version gap (library)

def test_version_gap_gc_alone_does_not_act_on_the_stale_view(tmp_path):
    """Versions 1..6 and 8 on disk, the hint says 6: probing stops at 6. GC run on its own (no index
    builder before it) must not commit its trim as version 7 *under* version 8 and then delete
    generations that version 8 still lists (what it did before `region._refuse_gap`)."""
    root = str(tmp_path / "gap")
    loc = open_store(root)
    ds = demo.create_table(loc, sharding="unsharded", base_rows=5)
    rid = str(uuid.uuid4())
    gens = {g: list(range(100 * g, 100 * g + 5)) for g in (1, 2, 3)}
    for g, keys in gens.items():
        write_generation(root, rid, rows(keys, g))
    m = region.load_latest(loc.store, rid)
    assert m.version == 8 and [g.generation for g in m.generations] == [1, 2, 3]
    # Merge generations 1 and 2 (a marked merge_insert; no Spark needed for this check).
    src = rows(gens[1] + gens[2], 1)
    (lance.dataset(root).merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
     .mark_sstables_as_compacted([CompactedSsTable(rid, 2)]).execute(src))
    os.unlink(os.path.join(root, layout.manifest_key(rid, 7)))
    os.unlink(os.path.join(root, layout.version_hint_key(rid)))
    # No usable hint: the manifest directory is listed, which sees past the gap ...
    assert region.load_latest(loc.store, rid).version == 8
    # ... but a stale hint below the gap is trusted, and probing from it stops at the gap.
    loc.store.put(layout.version_hint_key(rid), json.dumps({"version": 6}).encode())
    assert region.load_latest(loc.store, rid).version == 6
    before = tree(root)

    res = gc.run_gc(loc, gc.GcOptions(manifest_min_age_seconds=0, orphan_grace_seconds=0,
                                     cleanup_base_versions_older_than_seconds=0, cleanup_base_versions_floor_seconds=0))
    err = res.region_errors[rid]
    assert err == (f"region {rid}: manifest version 7 is missing but version 8 exists (a gap in "
                   f"{layout.manifest_dir(rid)}/): the latest version found by probing, 6, is stale; not "
                   "committing on it (restore the missing version or repair the region)")
    print(f"\n[catalogue] version gap, GC alone: {err}")
    prefix = f"{layout.MEM_WAL_DIR}/"
    assert {p: v for p, v in tree(root).items() if p.startswith(prefix)} == \
           {p: v for p, v in before.items() if p.startswith(prefix)}
    assert checks.missing_generations(loc) == {}
    # The index builder refuses the region too (left out of the snapshot, reported).
    r = snapshot.build_snapshot(loc)
    assert r.region_errors == {rid: err}
    # Restoring the missing version heals it: GC then trims on top of version 8.
    region.write_version_hint(loc.store, rid, 8)
    res = gc.run_gc(loc, gc.GcOptions(manifest_min_age_seconds=3600, orphan_grace_seconds=0))
    assert not res.region_errors and res.counts()["generation"] == 2
    assert [g.generation for g in region.load_latest(loc.store, rid).generations] == [3]
    assert checks.missing_generations(loc) == {}


def test_table_a_prints(runs):
    """Prints the per-region lines of table A (copied into docs/reliability.md)."""
    a, job = runs["A"], runs["jobs"]["A"]
    for case, rid in a.rids.items():
        print(f"{case} ({rid}):")
        for ln in job.about(rid):
            if ln.startswith("error: ") and "check merge_lag" not in ln:
                print(f"    {ln}")


# ------------------------------------------------------------ hostile manifests and layouts

HOSTILE = ["healthy", "out_of_range", "huge", "symlink", "unknown_status"]


def build_hostile(root: str, outside: str) -> dict:
    """A table whose regions are: healthy, one with current_generation 2^64-1, one listing 10^6
    generations, one whose directory is a symlink to outside the root (a real region moved
    there), one with an unknown status. The MemWAL snapshot is built before the damage."""
    loc = open_store(root)
    ds = demo.create_table(loc, sharding="bucket", num_buckets=len(HOSTILE), base_rows=10)
    keys = Buckets(ds)
    rids = {case: str(uuid.UUID(int=100 + i, version=4)) for i, case in enumerate(HOSTILE)}
    gens: dict[str, list[int]] = {}
    for b, case in enumerate(HOSTILE):
        gens[case] = []
        for g in (1, 2):
            ks = keys.take(b, 4)
            write_generation(loc.lance_uri, rids[case], rows(ks, g))
            gens[case] += ks
    snapshot.build_snapshot(loc)

    def rewrite(case: str, edit) -> None:
        m = region.load_latest(loc.store, rids[case])
        msg = region.pb.RegionManifest()
        msg.CopyFrom(m.message)
        edit(msg)
        loc.store.put(layout.manifest_key(rids[case], m.version), msg.SerializeToString())

    rewrite("out_of_range", lambda m: setattr(m, "current_generation", 2**64 - 1))
    rewrite("unknown_status", lambda m: setattr(m, "status", 9))

    def huge(m):
        for g in range(3, 10**6 + 1):
            m.flushed_generations.add(generation=g, path=f"0000abcd_gen_{g}", in_memory_bytes=100)
        m.current_generation = 10**6 + 1
    rewrite("huge", huge)
    os.makedirs(outside)
    src = os.path.join(root, layout.region_dir(rids["symlink"]))
    shutil.move(src, os.path.join(outside, "region"))
    os.symlink(os.path.join(outside, "region"), src)
    old = time.time() - 10 * 86400  # old enough for every GC age limit: GC would take all it may
    for d, dirs, files in os.walk(outside):
        for f in dirs + files:
            os.utime(os.path.join(d, f), (old, old))
    return {"loc": loc, "rids": rids, "keys": gens}


def _outside_tree(path: str) -> dict:
    out = {}
    for d, _dirs, files in os.walk(path, followlinks=False):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), path)] = (st.st_size, st.st_mtime_ns)
    return out


def test_hostile_manifests_and_layouts_through_the_cli(tmp_path):
    root, outside = str(tmp_path / "t"), str(tmp_path / "outside")
    h = build_hostile(root, outside)
    loc, rids = h["loc"], h["rids"]
    before_outside = _outside_tree(outside)
    assert len(before_outside) > 5
    prev_rows = {str(uuid.UUID(bytes=r["region_id"])): r for r in snapshot.read_snapshot(loc).to_pylist()}

    t0 = time.monotonic()
    p = subprocess.run(maintain_cmd(root, "--base-versions-older-than", "0", "--base-versions-floor", "0"), capture_output=True, text=True,
                       env=clean_env(), timeout=900)
    took = time.monotonic() - t0
    job = Run([], p.returncode, p.stderr)
    print(f"\n[hostile] memwal maintain: exit {p.returncode} in {took:.0f} s")
    for ln in job.lines:
        print(f"    {ln}")
    assert p.returncode == 1
    errors = "\n".join(job.errors())
    for case, text in (("out_of_range", "field current_generation = 18446744073709551615 is out of range"),
                       ("huge", "field flushed_generations = '"),
                       ("huge", "too large"),
                       ("symlink", "is a symbolic link"),
                       ("unknown_status", "field status = 9 is out of range")):
        assert rids[case] in errors and text in errors, (case, text)
    assert "ValueError" not in p.stderr and "Traceback" not in p.stderr
    # The healthy region is merged in the same run; its rows are in the base table.
    state = table.read_memwal_state(loc)
    assert state.merged.get(rids["healthy"]) == 2
    assert {r["id"] for r in lance.dataset(root).to_table().to_pylist()} >= set(h["keys"]["healthy"])
    for case in HOSTILE[1:]:
        assert state.merged.get(rids[case], 0) == 0, case
    # The broken regions keep their previous snapshot rows: readers still see their generations.
    now_rows = {str(uuid.UUID(bytes=r["region_id"])): r for r in snapshot.read_snapshot(loc).to_pylist()}
    for case in HOSTILE[1:]:
        assert now_rows[rids[case]]["flushed_generations"] == prev_rows[rids[case]]["flushed_generations"], case
        assert now_rows[rids[case]]["version"] == prev_rows[rids[case]]["version"], case
    # Nothing outside the root was touched, however old it looked.
    assert _outside_tree(outside) == before_outside

    # `memwal status` names every error (never `error: None`), in bounded time.
    t0 = time.monotonic()
    s = subprocess.run([sys.executable, "-m", "memwal_pipeline.cli", "status", root], capture_output=True,
                       text=True, env=clean_env(), timeout=300)
    took = time.monotonic() - t0
    print(f"[hostile] memwal status: exit {s.returncode} in {took:.1f} s\n{s.stdout}")
    assert s.returncode == 1 and took < 120
    lines = {ln.split()[0]: ln for ln in s.stdout.splitlines() if ln[:36] in set(rids.values())}
    for case in HOSTILE[1:]:
        assert "error: region" in lines[rids[case]] and "None" not in lines[rids[case]], lines[rids[case]]
    assert "error" not in lines[rids["healthy"]]


def test_unknown_feature_flag_refused_before_any_spark_work(tmp_path):
    from support.lance_manifest import set_feature_flags

    root = str(tmp_path / "t")
    build_simple(root, "empty")
    loc = open_store(root)
    write_generation(root, str(uuid.uuid4()), rows([1, 2, 3], 1))  # pending work: Spark would start
    set_feature_flags(loc, writer=1 | 512)
    before = tree(root)
    t0 = time.monotonic()
    p = subprocess.run(maintain_cmd(root), capture_output=True, text=True, env=clean_env(), timeout=300)
    took = time.monotonic() - t0
    job = Run([], p.returncode, p.stderr)
    print(f"\n[feature flags] exit {p.returncode} in {took:.1f} s: {job.lines}")
    assert p.returncode != 0 and len(job.errors()) == 1
    assert "writer_feature_flags = 513 has bits memwal does not know (512)" in job.errors()[0]
    assert not any("] merge" in ln or "spark" in ln.lower() for ln in job.lines)
    assert tree(root) == before
