"""Benchmark: the merger against the naive per-generation loop and an in-process bound.

Workload (written once by pylance `ShardWriter`s, then copied so every contender starts from
identical bytes): a bucket-sharded table (int64 primary key `id`, an int `n`, a float `x`, a
string `s`) with `--base-rows` rows; `--regions` regions (one per bucket), each with
`--generations-per-region` flushed generations of ~`--rows` rows. In each generation one row
in fifty is a delete of a live key and one write in five overwrites a live key (earlier
generation or base table); the rest are new keys of the region's bucket.

Contenders, in one run:
  (a) memwal  `memwal_core.jobs.merge.merge(loc, spark)` in a process whose SparkSession is up
              (session created and a tiny warm-up merge run first);
  (a2) memwal_2nd  the same merge once more, on a second copy in the same session: a
              long-lived process (Spark Connect server, the CLI in a loop) is past the JVM's
              first-merge JIT warm-up; reported, not used in the ratios;
  (a3) memwal_capped  the same merge with at most `--capped-generations` (256) generations per
              batch, in the same session: what a count cap costs (not a default contender);
  (b) naive   one marked merge_insert per generation, region by region, in Python: read the
              generation through Lance, upsert its live rows and delete its tombstoned keys
              (`when_not_matched_by_source_delete("id IN (...)")`) with
              `mark_sstables_as_compacted([CompactedSsTable(region, gen)])`;
  (c) bound   in-process Arrow dedup of the union of all generations (newest generation wins)
              plus ONE merge_insert with every region's marker;
  (d) cold    `memwal maintain <copy> --only merge` as a subprocess (JVM start included).
  (a4) memwal_blobs  (a) with `memwal.merge.result_files: off`: the rows come back through Spark
              as on a cluster, not as files (run after (a2), on the warmest JVM);
  (e) memwal_local, cold_local  (a) and (d) on `local[*]`, for a `--spark-master` that is a
              cluster (`spark://...`, or `--start-cluster`): the cluster's overhead in one run
              ((a) then stops its session and (e) starts a local one in the same process).
All resulting base tables must be identical (sorted by id) and record every generation as
merged; the script fails loudly otherwise.

Goals: b/a >= 5 and a/c <= 1.3 at 200 generations; b/a >= 10 and a/c <= 1.5 at 2,000.

`--memory`: a backlog of >= `--memory-gb` GB of generations (a `--string-bytes` string column)
merged with a `--budget-mb` budget in a fresh process; prints the driver's peak RSS and the
commit count.

usage:
  python bench/merge.py                                  # 10 regions x 20 generations x 5,000 rows
  python bench/merge.py --generations-per-region 200     # 2,000 generations
  python bench/merge.py --memory                         # >= 1 GB backlog, 64 MB budget
  python bench/merge.py --quick                          # small sizes (smoke test)
  python bench/merge.py --start-cluster --contenders memwal,memwal_local,cold,cold_local
                                                         # a local standalone cluster vs local[*]
Prints `RESULT merge ...`, `RESULT merge_phases ...` and (with --memory) `RESULT merge_memory ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the repo on sys.path, quiets pylance's index log)
import lance  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from lance.mem_wal import CompactedSsTable, evaluate_sharding_spec  # noqa: E402

from memwal_core.spark.results import RESULT_FILES_KEY  # noqa: E402
from memwal_core.state import layout, region, table  # noqa: E402
from memwal_core.state.store import open_store  # noqa: E402
from memwal_core.tools import demo  # noqa: E402

PK = demo.PK
SCHEMA = demo.SCHEMA
TOMB = "_tombstone"


# =============================================================================== workload

@dataclass
class Shape:
    regions: int = 10
    gens: int = 20
    rows: int = 5000
    base_rows: int = 50_000
    string_bytes: int = 0  # 0: short strings "k{id}v{n}"; else ~this many bytes per value
    seed: int = 1


@dataclass
class Backlog:
    path: str
    regions: list[str]
    generations: int = 0
    rows_put: int = 0
    rows_deleted: int = 0
    overwrites: int = 0
    in_memory_bytes: int = 0
    disk_bytes: int = 0
    live_keys: int = 0
    seconds: float = 0.0
    gens_per_region: dict[str, int] = field(default_factory=dict)


class KeyPool:
    """Fresh keys per bucket, computed with pylance's own sharding evaluation."""

    def __init__(self, ds, spec, start: int, chunk: int):
        self.ds, self.spec, self.next, self.chunk = ds, spec, start, max(chunk, 10_000)
        self.free: dict[int, list[np.ndarray]] = {}
        self.offset: dict[int, int] = {}

    def buckets(self, keys: np.ndarray) -> np.ndarray:
        batch = pa.record_batch([pa.array(keys, pa.int64())], names=["id"])
        return evaluate_sharding_spec(batch, self.spec, self.ds.lance_schema).column(0).to_numpy()

    def _refill(self) -> None:
        keys = np.arange(self.next, self.next + self.chunk, dtype=np.int64)
        self.next += self.chunk
        b = self.buckets(keys)
        for v in np.unique(b):
            self.free.setdefault(int(v), []).append(keys[b == v])

    def take(self, bucket: int, n: int) -> np.ndarray:
        out: list[np.ndarray] = []
        while n > 0:
            q = self.free.setdefault(bucket, [])
            if not q:
                self._refill()
                continue
            head = q[0]
            k = min(n, len(head))
            out.append(head[:k])
            if k == len(head):
                q.pop(0)
            else:
                q[0] = head[k:]
            n -= k
        return np.concatenate(out) if out else np.array([], np.int64)


def _strings(keys: np.ndarray, version: int, pool: list[str] | None, rng: random.Random) -> pa.Array:
    if pool is None:
        return pa.array([f"k{k}v{version}" for k in keys.tolist()], pa.string())
    return pa.array([pool[rng.randrange(len(pool))] + f"|{k}v{version}" for k in keys.tolist()], pa.string())


def _rows(keys: np.ndarray, version: int, pool, rng) -> pa.Table:
    n = np.full(len(keys), version, np.int64)
    return pa.table([pa.array(keys, pa.int64()), pa.array(n), pa.array(keys * 0.5 + version),
                     _strings(keys, version, pool, rng)], schema=SCHEMA)


def write_backlog(path: str, shape: Shape, log=common.say) -> Backlog:
    """The base table and every region's generations, through pylance ShardWriters."""
    t0 = time.perf_counter()
    loc = open_store(path)
    ds = demo.create_table(loc, sharding="bucket", num_buckets=shape.regions, base_rows=shape.base_rows)
    spec = ds.mem_wal_index_details()["sharding_specs"][0]
    rng = random.Random(shape.seed)
    pool = None
    if shape.string_bytes:
        pool = [os.urandom(shape.string_bytes // 2).hex() for _ in range(512)]
    keys = KeyPool(ds, spec, shape.base_rows, shape.rows * shape.regions * 4)
    base = np.arange(shape.base_rows, dtype=np.int64)
    base_bucket = keys.buckets(base) if shape.base_rows else np.array([], np.int32)
    ids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(shape.regions)]
    bl = Backlog(path, ids)
    version = 0
    for b, rid in enumerate(ids):
        live: list[int] = base[base_bucket == b].tolist()
        with ds.mem_wal_writer(rid, max_memtable_rows=shape.rows, durable_write=False) as w:
            for _ in range(shape.gens):
                version += 1
                ndel = min(shape.rows // 50, len(live))
                nwrite = shape.rows - ndel
                nover = min(nwrite // 5, len(live) - ndel)
                picked = rng.sample(range(len(live)), ndel + nover)
                dels = [live[i] for i in picked[:ndel]]
                over = [live[i] for i in picked[ndel:]]
                for i in sorted(picked[:ndel], reverse=True):  # swap-remove the deleted keys
                    live[i] = live[-1]
                    live.pop()
                fresh = keys.take(b, nwrite - nover)
                live.extend(fresh.tolist())
                put = np.concatenate([np.array(over, np.int64), fresh])
                # One put plus one delete make one generation: the next put overflows the
                # memtable (max_memtable_rows = rows) and flushes it.
                w.put(_rows(put, version, pool, rng))
                if dels:
                    w.delete(pa.table({"id": pa.array(dels, pa.int64())}))
                bl.rows_put += len(put)
                bl.rows_deleted += len(dels)
                bl.overwrites += len(over)
        bl.live_keys += len(live)
        m = region.load_latest(loc.store, rid)
        bl.gens_per_region[rid] = len(m.generations)
        bl.generations += len(m.generations)
        bl.in_memory_bytes += sum(g.in_memory_bytes for g in m.generations)
        log(f"  region {b + 1}/{shape.regions} {rid}: {len(m.generations)} generations "
            f"({time.perf_counter() - t0:.0f}s)")
    if any(n != shape.gens for n in bl.gens_per_region.values()):
        log(f"NOTE generations per region differ from {shape.gens}: {sorted(set(bl.gens_per_region.values()))}")
    bl.disk_bytes = common.dir_bytes(path)
    bl.seconds = time.perf_counter() - t0
    return bl


def generations(loc, rid: str) -> list[tuple[int, str]]:
    """(generation, Lance URI) of a region's flushed generations, ascending."""
    m = region.load_latest(loc.store, rid)
    return [(g.generation, loc.child_uri(layout.generation_dir(rid, g.path, g.generation))) for g in m.generations]


# =============================================================================== contenders

def in_list(keys: pa.Array) -> str:
    return f"id IN ({', '.join(str(k) for k in keys.to_pylist())})"


def naive_merge(path: str, regions: list[str]) -> dict:
    """(b): what a user writes from the spec, one marked merge_insert per generation."""
    loc = open_store(path)
    ds = lance.dataset(path)
    commits = 0
    phases: dict[str, float] = {}
    for rid in regions:
        for gen, uri in generations(loc, rid):
            with common.timed(phases, "read"):
                t = lance.dataset(uri).to_table()
                dead = pc.fill_null(t[TOMB], False)
                live = t.filter(pc.invert(dead)).drop_columns([TOMB])
                gone = t.filter(dead)["id"]
            with common.timed(phases, "merge_insert"):
                b = ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
                if len(gone):
                    b = b.when_not_matched_by_source_delete(in_list(gone.combine_chunks()))
                b.mark_sstables_as_compacted([CompactedSsTable(rid, gen)]).execute(live)
            commits += 1
    return {"commits": commits, **{f"{k}_s": round(v, 3) for k, v in phases.items()}}


def bound_merge(path: str, regions: list[str]) -> dict:
    """(c): read every generation in process, newest wins per key, one merge_insert."""
    loc = open_store(path)
    phases: dict[str, float] = {}
    tables, markers = [], []
    with common.timed(phases, "read"):
        for rid in regions:
            gens = generations(loc, rid)
            tables.extend(lance.dataset(uri).to_table() for _, uri in gens)
            if gens:
                markers.append(CompactedSsTable(rid, gens[-1][0]))
    with common.timed(phases, "dedup"):
        t = pa.concat_tables(tables)
        del tables
        # Regions own disjoint keys, so the concatenation order (region, generation, row) is
        # "older first" for every key: the highest position wins.
        t = t.append_column("_o", pa.array(np.arange(t.num_rows, dtype=np.int64)))
        last = t.group_by("id").aggregate([("_o", "max")])
        newest = t.take(last["_o_max"])
        del t
        dead = pc.fill_null(newest[TOMB], False)
        live = newest.filter(pc.invert(dead)).drop_columns([TOMB, "_o"])
        gone = newest.filter(dead)["id"].combine_chunks()
    with common.timed(phases, "merge_insert"):
        ds = lance.dataset(path)
        b = ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
        if len(gone):
            b = b.when_not_matched_by_source_delete(in_list(gone))
        b.mark_sstables_as_compacted(markers).execute(live)
    return {"commits": 1, "rows_live": live.num_rows, "keys_deleted": len(gone),
            **{f"{k}_s": round(v, 3) for k, v in phases.items()}}


@contextmanager
def profile_memwal(phases: dict[str, float], counts: dict[str, int]):
    """Time memwal's phases: plan, the Spark job and its collection on the driver
    (read_and_dedup; more than one call means a re-run) and Lance's merge_insert (the commit),
    by wrapping them for the duration."""
    ld = sys.modules["lance.dataset"]  # `lance.dataset` the attribute is the function

    from memwal_core.jobs import merge as mg
    from memwal_core.spark import tasks as sp

    orig = {"read_and_dedup": (sp, "read_and_dedup"),
            "plan": (mg, "plan_merge"), "merge_insert": (ld.MergeInsertBuilder, "execute")}
    saved = {k: getattr(obj, name) for k, (obj, name) in orig.items()}

    def wrap(key, fn):
        def inner(*a, **kw):
            counts[key] = counts.get(key, 0) + 1
            with common.timed(phases, key):
                return fn(*a, **kw)
        return inner

    for key, (obj, name) in orig.items():
        setattr(obj, name, wrap(key, saved[key]))
    try:
        yield
    finally:
        for key, (obj, name) in orig.items():
            setattr(obj, name, saved[key])


def memwal_merge(path: str, spark, budget_bytes: int | None = None,
                 max_generations: int | None = None) -> tuple[dict, dict, dict]:
    from memwal_core.jobs import merge

    loc = open_store(path)
    phases: dict[str, float] = {}
    counts: dict[str, int] = {}
    kw: dict = {"budget_bytes": budget_bytes} if budget_bytes else {}
    if max_generations:
        kw["max_generations"] = max_generations
    batches: list[str] = []
    t = time.perf_counter()
    with profile_memwal(phases, counts):
        r = merge.merge(loc, spark, progress=batches.append, **kw)
    total = time.perf_counter() - t
    if r.region_errors:
        raise SystemExit(f"FAIL memwal merge refused regions: {r.region_errors}")
    phases["other"] = total - sum(phases.values())
    info = {"commits": r.commits, "batches": len(batches), "generations_merged": r.generations_merged,
            "rows_upserted": r.rows_upserted, "rows_deleted": r.rows_deleted, "conflicts": r.conflicts}
    return info, phases, counts


def cold_cli(path: str, master: str) -> dict:
    """(d): `memwal maintain <uri> --only merge` as a fresh process (JVM start included)."""
    exe = os.path.join(common.BIN, "memwal")
    out = subprocess.run([exe, "maintain", path, "--only", "merge", "--spark-master", master, "--json"],
                         capture_output=True, text=True, timeout=24 * 3600)
    if out.returncode != 0:
        raise SystemExit(f"FAIL cold CLI exited {out.returncode}: {out.stderr[-2000:]}")
    step = json.loads(out.stdout)["steps"]["merge"]
    return {"commits": step["metrics"].get("commits"), "step_s": step.get("duration_s")}


def page_in(root: str) -> None:
    """Read every file of a contender's copy once, so each starts with the same warm page
    cache (the copies were just written; whichever ran first otherwise paid for disk reads —
    (c) once took 3.4 s instead of ~1 s that way)."""
    for d, _dirs, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


# =============================================================================== checks

def read_base(path: str) -> pa.Table:
    t = lance.dataset(path).to_table(columns=[f.name for f in SCHEMA])
    return t.sort_by("id").combine_chunks()


def check_identical(paths: dict[str, str], bl: Backlog) -> None:
    ref_name, ref = None, None
    for name, path in paths.items():
        loc = open_store(path)
        merged = table.read_memwal_state(loc).merged
        want = {rid: n for rid, n in bl.gens_per_region.items() if n}
        if merged != want:
            raise SystemExit(f"FAIL {name}: merged progress {merged} != every generation {want}")
        t = read_base(path)
        if t.num_rows != bl.live_keys:
            raise SystemExit(f"FAIL {name}: base table has {t.num_rows} rows, the workload left {bl.live_keys} live keys")
        if ref is None:
            ref_name, ref = name, t
        elif not t.equals(ref):
            diff = "?"
            if t.num_rows == ref.num_rows:
                for c in t.column_names:
                    if not t[c].equals(ref[c]):
                        neq = pc.invert(pc.equal(t[c], ref[c]).fill_null(False))
                        diff = f"column {c}: {pc.sum(neq.cast(pa.int64())).as_py()} rows differ"
                        break
            raise SystemExit(f"FAIL base tables differ: {name} vs {ref_name} ({diff})")
    common.say(f"check: {', '.join(paths)} base tables identical ({ref.num_rows} rows), every generation "
               "marked merged")


# =============================================================================== main runs

def run_compare(args) -> None:
    shape = Shape(args.regions, args.generations_per_region, args.rows, args.base_rows, args.string_bytes, args.seed)
    root = common.workdir("merge", args.workdir)
    contenders = [c.strip() for c in args.contenders.split(",")]
    total_gens = shape.regions * shape.gens
    if total_gens >= 2000 and shape.rows < 5000:
        common.say(f"NOTE {total_gens} generations with {shape.rows} rows per generation (fewer than 5,000 "
                   "to bound disk and time)")
    try:
        src = os.path.join(root, "source")
        common.say(f"writing the backlog: {shape}")
        bl = write_backlog(src, shape)
        common.say(f"backlog: {bl.generations} generations, {bl.rows_put} puts ({bl.overwrites} overwrites), "
                   f"{bl.rows_deleted} deletes, {bl.in_memory_bytes / 1e6:.1f} MB in memory, "
                   f"{bl.disk_bytes / 1e6:.1f} MB on disk, {bl.live_keys} live keys, written in {bl.seconds:.1f}s")
        paths = {}
        t = time.perf_counter()
        for c in contenders:
            paths[c] = os.path.join(root, c)
            shutil.copytree(src, paths[c])
        common.say(f"copied the table {len(contenders)} times in {time.perf_counter() - t:.1f}s")
        if not args.keep:
            shutil.rmtree(src)

        secs: dict[str, float] = {}
        cpu: dict[str, float] = {}
        info: dict[str, dict] = {}
        profiles: dict[str, tuple[dict, dict]] = {}
        spark = None

        def measure(name: str, label: str, fn) -> None:
            page_in(paths[name])
            with common.CpuMeter() as meter:
                t0 = time.perf_counter()
                out = fn()
                secs[name] = time.perf_counter() - t0
            cpu[name] = meter.seconds
            if isinstance(out, tuple):
                out, ph, counts = out
                profiles[name] = (ph, counts)
            info[name] = out
            common.say(f"{label}: {secs[name]:.2f}s wall, {cpu[name]:.1f} CPU-s, {out}")
            if name in profiles:
                ph, counts = profiles[name]
                common.say("    phases: " + ", ".join(f"{k} {v:.2f}s" + (f" x{counts[k]}" if k in counts else "")
                                                  for k, v in ph.items()))

        if "bound" in contenders:
            measure("bound", "(c) bound", lambda: bound_merge(paths["bound"], bl.regions))
        if {"memwal", "memwal_2nd", "memwal_blobs", "memwal_capped"} & set(contenders):
            t = time.perf_counter()
            spark = common.spark_session(args.spark_master)
            start = time.perf_counter() - t
            warm = common.warm_up_merge(spark, root)
            common.say(f"spark session {args.spark_master} up in {start:.1f}s, warm-up merge {warm:.1f}s")
        if "memwal" in contenders:
            measure("memwal", "(a) memwal", lambda: memwal_merge(paths["memwal"], spark,
                                                                 max_generations=args.max_generations))
        if "memwal_2nd" in contenders:
            measure("memwal_2nd", "(a2) memwal, second merge in the session",
                    lambda: memwal_merge(paths["memwal_2nd"], spark, max_generations=args.max_generations))
        if "memwal_blobs" in contenders:  # after (a2): the warmest JVM, so any gain of the files is not order's
            spark.conf.set(RESULT_FILES_KEY, "off")
            try:
                measure("memwal_blobs", "(a4) memwal, rows through Spark as on a cluster (result files off)",
                        lambda: memwal_merge(paths["memwal_blobs"], spark, max_generations=args.max_generations))
            finally:
                spark.conf.unset(RESULT_FILES_KEY)
        if "memwal_capped" in contenders:
            measure("memwal_capped", f"(a3) memwal, <= {args.capped_generations} generations per batch",
                    lambda: memwal_merge(paths["memwal_capped"], spark, max_generations=args.capped_generations))
        if "memwal_local" in contenders:
            if spark is not None:
                spark.stop()  # one SparkContext per JVM: the cluster's goes first
            t = time.perf_counter()
            spark = common.spark_session("local[*]")
            start = time.perf_counter() - t
            warm = common.warm_up_merge(spark, root)
            common.say(f"spark session local[*] up in {start:.1f}s, warm-up merge {warm:.1f}s")
            measure("memwal_local", "(e) memwal on local[*]", lambda: memwal_merge(
                paths["memwal_local"], spark, max_generations=args.max_generations))
        if "naive" in contenders:
            measure("naive", "(b) naive", lambda: naive_merge(paths["naive"], bl.regions))
        if "cold" in contenders:
            measure("cold", "(d) cold CLI", lambda: cold_cli(paths["cold"], args.spark_master))
        if "cold_local" in contenders:
            measure("cold_local", "(e) cold CLI on local[*]", lambda: cold_cli(paths["cold_local"], "local[*]"))

        check_identical(paths, bl)
        kv = {"generations": bl.generations, "regions": shape.regions, "rows_per_gen": shape.rows,
              "rows": bl.rows_put + bl.rows_deleted, "backlog_mb": round(bl.in_memory_bytes / 1e6, 1)}
        keys = {"memwal": "memwal", "memwal_2nd": "memwal_2nd", "memwal_blobs": "memwal_blobs",
                "memwal_capped": "memwal_capped", "naive": "naive",
                "bound": "bound", "cold": "cold_cli",
                "memwal_local": "memwal_local", "cold_local": "cold_cli_local"}
        for name, key in keys.items():
            if name in secs:
                kv[f"{key}_s"] = secs[name]
        if "naive" in secs and "memwal" in secs:
            kv["naive_over_memwal"] = common.ratio(secs["naive"], secs["memwal"])
        if "memwal" in secs and "bound" in secs:
            kv["memwal_over_bound"] = common.ratio(secs["memwal"], secs["bound"])
        if "memwal_2nd" in secs and "bound" in secs:
            kv["memwal_2nd_over_bound"] = common.ratio(secs["memwal_2nd"], secs["bound"])
        if "memwal_blobs" in secs and "bound" in secs:
            kv["memwal_blobs_over_bound"] = common.ratio(secs["memwal_blobs"], secs["bound"])
        if "memwal_blobs" in secs and "memwal_2nd" in secs:
            kv["memwal_2nd_over_memwal_blobs"] = common.ratio(secs["memwal_2nd"], secs["memwal_blobs"])
        if "memwal_capped" in secs and "bound" in secs:
            kv["memwal_capped_over_bound"] = common.ratio(secs["memwal_capped"], secs["bound"])
        if "memwal" in secs and "memwal_local" in secs:
            kv["master"] = args.spark_master
            kv["memwal_over_memwal_local"] = common.ratio(secs["memwal"], secs["memwal_local"])
        if "cold" in secs and "cold_local" in secs:
            kv["cold_cli_over_cold_cli_local"] = common.ratio(secs["cold"], secs["cold_local"])
        if "cold" in secs and "naive" in secs:
            kv["naive_over_cold_cli"] = common.ratio(secs["naive"], secs["cold"])
        if "memwal" in info:
            kv["memwal_commits"] = info["memwal"]["commits"]
        if "memwal_capped" in info:
            kv["memwal_capped_commits"] = info["memwal_capped"]["commits"]
        common.result("merge", **kv)
        common.result("merge_cpu", generations=bl.generations, **{f"{keys[n]}_cpu_s": v for n, v in cpu.items()})
        for name, (ph, counts) in profiles.items():
            common.result("merge_phases", contender=name, generations=bl.generations,
                          **{f"{k}_s": v for k, v in ph.items()},
                          **{f"{k}_calls": v for k, v in counts.items()})
        goals(kv, bl.generations)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            common.say(f"kept {root}")


def goals(kv: dict, gens: int) -> None:
    ba, ac = kv.get("naive_over_memwal"), kv.get("memwal_over_bound")
    if gens >= 200:
        ba_goal, ac_goal = (10, 1.5) if gens >= 2000 else (5, 1.3)
        if ba is not None:
            common.say(f"GOAL b/a >= {ba_goal} at {gens} generations: {'met' if ba >= ba_goal else 'MISSED'} ({ba:.1f})")
        if ac is not None:
            common.say(f"GOAL a/c <= {ac_goal} at {gens} generations: {'met' if ac <= ac_goal else 'MISSED'} ({ac:.2f})")
    else:
        common.say(f"(goals apply at >= 200 generations; this run has {gens})")


def run_memory(args) -> None:
    """>= memory_gb of generations with big strings, merged in a fresh process with a small budget."""
    row_bytes = args.string_bytes + 40
    rows = args.rows
    # +5%: the manifest's in_memory_bytes per row comes out a little under string_bytes + 40
    gens = args.generations_per_region or max(1, int(1.05 * args.memory_gb * 1e9 / (args.regions * rows * row_bytes)) + 1)
    shape = Shape(args.regions, gens, rows, args.base_rows, args.string_bytes, args.seed)
    root = common.workdir("merge-memory", args.workdir)
    try:
        path = os.path.join(root, "table")
        common.say(f"writing the backlog: {shape}")
        bl = write_backlog(path, shape)
        common.say(f"backlog: {bl.generations} generations, {bl.in_memory_bytes / 1e9:.2f} GB in memory "
                   f"(manifest in_memory_bytes), {bl.disk_bytes / 1e9:.2f} GB on disk, written in {bl.seconds:.0f}s")
        if bl.in_memory_bytes < args.memory_gb * 1e9:
            common.say(f"NOTE backlog {bl.in_memory_bytes / 1e9:.2f} GB is below --memory-gb {args.memory_gb}")
        budgets = [int(b) for b in str(args.budget_mb).split(",")]
        for budget in budgets:
            run = os.path.join(root, f"run-{budget}")
            if len(budgets) > 1:
                shutil.copytree(path, run)  # every run starts from the same backlog
            else:
                run = path
            child = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child", run,
                                    "--budget-mb", str(budget), "--spark-master", args.spark_master,
                                    "--backlog-bytes", str(bl.in_memory_bytes)],
                                   timeout=24 * 3600)
            if child.returncode != 0:
                raise SystemExit(f"FAIL memory child exited {child.returncode}")
            loc = open_store(run)
            merged = table.read_memwal_state(loc).merged
            if merged != {rid: n for rid, n in bl.gens_per_region.items() if n}:
                raise SystemExit(f"FAIL not every generation merged: {merged}")
            n = lance.dataset(run).count_rows()
            if n != bl.live_keys:
                raise SystemExit(f"FAIL base table has {n} rows, the workload left {bl.live_keys} live keys")
            if run != path:
                shutil.rmtree(run, ignore_errors=True)
        common.say(f"check: every generation merged, {n} rows as expected")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def memory_child(args) -> None:
    """The merge process of --memory: Spark session, then the merge under the budget."""
    budget = int(args.budget_mb) << 20
    spark = common.spark_session(args.spark_master)
    spark.range(10).count()
    base = common.self_peak_rss_mb()
    with common.RssSampler() as rss:
        info, phases, counts = memwal_merge(args.memory_child, spark, budget_bytes=budget)
    peak = common.self_peak_rss_mb()
    hwm = common.proc_status_kb("self", "VmHWM") / 1024
    common.say(f"memwal merge with a {args.budget_mb} MB budget: {info}")
    common.say("    phases: " + ", ".join(f"{k} {v:.2f}s" + (f" x{counts[k]}" if k in counts else "")
                                      for k, v in phases.items()))
    common.say(f"driver (Python) peak RSS {peak:.0f} MB (VmHWM {hwm:.0f} MB), {base:.0f} MB before the merge: "
               f"+{peak - base:.0f} MB for a {args.budget_mb} MB budget; Spark JVM peak "
               f"{rss.jvm_peak_kb / 1024:.0f} MB; Python workers peak (sampled, summed) {rss.workers_peak_kb / 1024:.0f} MB")
    common.say(f"bound: the driver holds one batch at a time: its deduplicated output (<= the batch's "
               f"generations, <= {args.budget_mb} MB by manifest in_memory_bytes unless one generation is larger), "
               f"as collected IPC blobs and decoded tables, plus merge_insert's working set; measured growth "
               f"{peak - base:.0f} MB = {(peak - base) / int(args.budget_mb):.1f} x the budget, independent of the "
               f"{args.backlog_bytes / 1e9:.2f} GB backlog")
    common.result("merge_memory", backlog_mb=round(args.backlog_bytes / 1e6), budget_mb=args.budget_mb,
                  commits=info["commits"], batches=info["batches"], generations=info["generations_merged"],
                  seconds=round(sum(phases.values()), 2), driver_peak_rss_mb=round(peak),
                  driver_rss_before_mb=round(base), driver_growth_mb=round(peak - base),
                  growth_over_budget=round((peak - base) / int(args.budget_mb), 2),
                  jvm_peak_rss_mb=round(rss.jvm_peak_kb / 1024), workers_peak_rss_mb=round(rss.workers_peak_kb / 1024),
                  **{f"{k}_s": v for k, v in phases.items()})
    spark.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions", type=int, default=10)
    p.add_argument("--generations-per-region", type=int, default=None, help="default 20 (--memory: sized to --memory-gb)")
    p.add_argument("--rows", type=int, default=None, help="rows per generation (default 5000; --memory: 2000)")
    p.add_argument("--base-rows", type=int, default=None, help="rows in the base table before merging (default 50000)")
    p.add_argument("--string-bytes", type=int, default=None, help="bytes per string value (default short; --memory: 1500)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--contenders", default="memwal,memwal_2nd,naive,bound,cold",
                   help="subset of memwal,memwal_2nd,memwal_blobs,memwal_capped,naive,bound,cold,memwal_local,cold_local "
                        "(default: the first five)")
    p.add_argument("--spark-master", default="local[*]", help="the master of (a), (a2) and (d)")
    p.add_argument("--start-cluster", action="store_true",
                   help="start a standalone master and worker on 127.0.0.1 (tests/support/cluster.py, all cores) and "
                        "use it as --spark-master; stopped at the end")
    p.add_argument("--max-generations", type=int, default=None,
                   help="memwal's max generations per batch (default: memwal's own, no cap)")
    p.add_argument("--capped-generations", type=int, default=256,
                   help="the count cap of the memwal_capped contender (default 256)")
    p.add_argument("--memory", action="store_true", help="the >= 1 GB backlog with a small budget instead")
    p.add_argument("--memory-gb", type=float, default=1.0)
    p.add_argument("--budget-mb", default="64", help="--memory: merge budget in MB; a comma-separated list "
                                                     "runs each on its own copy of the backlog (e.g. 32,64,128)")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--workdir", default=None, help="parent directory of the working copies (default: $TMPDIR)")
    p.add_argument("--keep", action="store_true", help="keep the tables")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--backlog-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        common.print_machine("merge_memory_child")
        memory_child(args)
        return
    if args.memory:
        args.rows = args.rows or 2000
        args.string_bytes = 1500 if args.string_bytes is None else args.string_bytes
        args.base_rows = 10_000 if args.base_rows is None else args.base_rows
        if args.quick:
            args.memory_gb, args.regions, args.budget_mb = min(args.memory_gb, 0.1), min(args.regions, 4), "16"
    else:
        quick = args.quick
        args.generations_per_region = args.generations_per_region or (5 if quick else 20)
        args.rows = args.rows or (1000 if quick else 5000)
        args.regions = min(args.regions, 4) if quick else args.regions
        args.base_rows = (args.rows * args.regions) if args.base_rows is None else args.base_rows
        args.string_bytes = args.string_bytes or 0
    cluster = None
    if args.start_cluster:
        sys.path.insert(0, os.path.join(common.REPO, "tests"))
        from support.cluster import StandaloneCluster

        t = time.perf_counter()
        cluster = StandaloneCluster(cores=os.cpu_count() or 2, memory="2g").start()
        args.spark_master = cluster.master_url
        common.say(f"standalone cluster {cluster.master_url} (1 worker, {cluster.cores} cores) up in "
                   f"{time.perf_counter() - t:.1f}s under {cluster.root}")
    common.print_machine("merge_memory" if args.memory else "merge", args)
    try:
        if args.memory:
            run_memory(args)
        else:
            run_compare(args)
    finally:
        if cluster is not None:
            cluster.stop()
            shutil.rmtree(cluster.root, ignore_errors=True)


if __name__ == "__main__":
    main()
