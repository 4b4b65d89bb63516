"""The stateful randomized harness (used by tests/test_harness.py; docs/reliability.md
"Stateful harness" describes it).

State: a real MemWAL table written by pylance `ShardWriter`s, plus a model of every flushed
generation's rows (read back once, when the generation first appears in the newest manifest,
found by listing), of everything the writers were asked to write, and of the merge progress
each base-table version records. One Hypothesis rule draws a step from the weighted mix `OPS`:
writes, deletes, flushes, reopens (epoch bump); merges (random byte budget and
`max_generations`), plans executed later, a generation unreadable during a merge (or flapping
back mid-merge); bad generations planted and repaired; the MemWAL index builder; catch-up; GC
with random retention (checked by an independent plan oracle before it executes);
compaction, also racing a merge in its own thread; a second maintainer thread; stale,
removed or garbled version hints; fenced writers; orphan directories; a job killed by
SIGKILL in a subprocess before its k-th write; and the table's lifecycle: the table overwritten
and MemWAL initialized again while regions hold unmerged generations (old region ids re-opened
or new ones), stale regions discarded by the operator (one, all, a dry run, or by mistake a
region of this lifetime) or by GC after its grace, and regions sealed.

Invariants after every step:
- merge progress never decreases and never passes a generation that could not be merged
  (bad, or unreadable during that merge): every generation at or below progress was good;
- the base table, at the latest and at every retained version, equals the model applied up
  to that version's progress (nothing merged is lost, nothing unmerged leaked in);
- pylance's LSM read, at the latest and at older retained versions, equals the model of
  everything flushed, except the keys of bad generations not yet repaired (the wall);
- no listed generation is missing on disk; nothing outside the table directory changed;
- a merge refuses whole, and reports stuck, a region whose manifest lists a hole above
  progress (none of its generations merges, not even those below the hole);
- lifecycle: no row of a generation that was unmerged when the table was overwritten at any
  retained version, no row of an earlier lifetime at a version of this one, in the base table
  or an LSM read; progress passes a stale generation only through a discard, exactly to the
  model's stale boundary; memwal's stale verdicts equal the model's after an overwrite; the merger
  reports every stale region with listed generations as stuck; a discard never changes the
  progress or a file of a region of this lifetime; GC deletes nothing of a stale region until it
  is discarded, then stale generations only up to the discard and the progress of versions from
  before the initialization; a sealed region gets no manifest version after the sealing one.
At teardown every bad generation is repaired and one merge runs: the base table alone then
equals the model. `Stats.did` counts the steps that did something (see test_harness.py).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import lance
import pyarrow as pa
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from lance.mem_wal import evaluate_sharding_spec

from memwal_core.jobs import catchup, compaction, gc, merge, snapshot
from memwal_core.jobs.gc import fact_segments
from memwal_core.jobs.gc import run as gc_run
from memwal_core.observe import checks, reader
from memwal_core.options import GcOptions
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, lifecycle, region, table, wal
from memwal_core.state.lance_mem_wal import lsm_read
from memwal_core.state.store import open_store

from .helpers import tree, wait_flushed

PK = {b"lance-schema:unenforced-primary-key": b"true"}
SCHEMA = pa.schema([
    pa.field("id", pa.int64(), nullable=False, metadata=PK),
    pa.field("c", pa.int64()),
    pa.field("n", pa.int64()),
    pa.field("s", pa.string()),
])
GEN_SCHEMA = SCHEMA.append(pa.field("_tombstone", pa.bool_()))
KINDS = ["bucket_key", "bucket_nonkey", "identity", "unsharded"]
KEYS = 24  # writer keys 0..KEYS-1; deletes also hit a few never-written keys
ABSENT = 4
BASE_KEYS = 5  # keys 0..4 are in the base table from the start
PLANTED_FROM = 1000  # planted generations use fresh keys from here on
MAX_MEMTABLE_ROWS = 4
BAD_KINDS = ["extra_column", "wrong_type", "misrouted_some", "misrouted_all", "null_key", "gap"]
LSM_MAY_FAIL = {"extra_column", "wrong_type", "null_key"}  # pylance's own LSM read cannot read these either
TRANSIENT = not os.environ.get("MEMWAL_HARNESS_NO_TRANSIENT")
ENABLED_BAD = [k for k in os.environ.get("MEMWAL_HARNESS_BAD_KINDS", ",".join(BAD_KINDS)).split(",") if k]
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(TESTS, "procs", "reliability_job.py")
WORKTREE = os.path.dirname(TESTS)


def c_of(kind: str, key: int) -> int:
    """The non-key column: a function of the key, so a key's region never changes."""
    return key % 3 if kind == "identity" else key % 5


def row(kind: str, key: int, version: int) -> dict[str, Any]:
    return {"id": key, "c": c_of(kind, key), "n": version, "s": f"k{key}v{version}"}


def apply(state: dict[int, dict], rows: list[dict]) -> None:
    for r in rows:
        if r["_tombstone"]:
            state.pop(r["id"], None)
        else:
            state[r["id"]] = {k: v for k, v in r.items() if k != "_tombstone"}


def unleased(loc):
    """The concurrent rules run their jobs without the table lease (in every entry point they
    call): the lease serializes memwal's own maintainers, and what these rules check is that the
    commits stay correct when they do overlap (an application's or another client's commit)."""
    from memwal_core.options import LeaseOptions
    from memwal_core.state import lease

    return lease.hold(loc, "harness", LeaseOptions(enabled=False))


@dataclass
class Bad:
    kind: str
    keys: set[int]  # every key the bad or the good version holds (held behind the wall)
    good: list[dict]  # the rows the repair writes
    missing: int = 0  # "gap": the generation number the manifest skipped
    unlisted: str = ""  # "gap": its directory, written but never listed (a writer died in between)
    fill: list[dict] | None = None  # "gap": the rows of that directory


class Stats:
    steps = 0
    examples = 0
    merges = 0
    merge_crashes = 0
    rule_counts: dict[str, int] = {}
    # Steps that did something worth counting: a merge that committed, a GC that deleted a
    # generation, a compaction that rewrote, a read of an older retained version, ...
    did: dict[str, int] = {}
    summary: list[str] = []  # one line per harness run, printed by conftest at session end

    @classmethod
    def reset(cls) -> None:
        cls.steps = cls.examples = cls.merges = cls.merge_crashes = 0
        cls.rule_counts, cls.did = {}, {}


_did_lock = threading.Lock()


def did(what: str, n: int = 1) -> None:
    if n > 0:
        with _did_lock:
            Stats.did[what] = Stats.did.get(what, 0) + n


# The mix of steps: (weight, argument strategies) per rule. One Hypothesis rule draws the name
# from this weighted list, then the arguments (Hypothesis's own rule choice with its swarm
# feature flags skewed the mix: hundreds of flushes for a handful of puts).
GC_RETENTIONS = ["count1", "count1", "count2", "count4", "none", "long"]
OPS: dict[str, tuple[int, dict[str, Any]]] = {
    "put": (13, {"keys": st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=3, unique=True)}),
    "overwrite": (4, {"picks": st.lists(st.integers(0, 10_000), min_size=1, max_size=3)}),
    "delete": (5, {"keys": st.lists(st.integers(0, KEYS + ABSENT - 1), min_size=1, max_size=2, unique=True),
                   "whole_rows": st.booleans()}),
    "flush": (8, {"r": st.integers(0, 7)}),
    "reopen": (3, {"r": st.integers(0, 7)}),
    "merge": (12, {"budget": st.sampled_from([1, 3_000, 10**9]), "max_gens": st.integers(1, 4),
                   "via_plan": st.booleans()}),
    "merge_with_unreadable_generation": (3, {"pick": st.integers(0, 10_000),
                                             "budget": st.sampled_from([1, 3_000, 10**9]),
                                             "max_gens": st.integers(1, 4), "back_at": st.integers(0, 2)}),
    "plan_for_later": (2, {"budget": st.sampled_from([1, 3_000, 10**9]), "max_gens": st.integers(1, 4)}),
    "execute_stale_plan": (2, {"keep": st.booleans()}),
    # A hole in the listed generations twice as often as each other kind: only a merge or GC run
    # while one is listed sees it (a repair, an overwrite or the machine's end come first otherwise).
    "plant_bad": (3, {"r": st.integers(0, 7), "kind": st.sampled_from(BAD_KINDS + ["gap"]), "n": st.integers(1, 2)}),
    "repair": (3, {"pick": st.integers(0, 10_000)}),
    "build_snapshot": (3, {"external": st.booleans(), "hints": st.booleans()}),
    "catch_up": (3, {"named": st.booleans(), "retrain": st.booleans()}),
    "collect_garbage": (11, {"keep": st.integers(1, 3), "min_age": st.sampled_from([0.0, 3600.0]),
                            "grace": st.sampled_from([0.0, 3600.0]), "base_retain": st.none(),
                            "retention": st.sampled_from(GC_RETENTIONS), "prep": st.sampled_from(["full", "snapshot", "full", "catchup", "none"]),
                            "keep_epoch": st.booleans(),
                            # a stale region discarded by GC after its grace (0 s), or never
                            "discard_after": st.sampled_from([None, None, 0.0])}),
    "compact": (3, {"race_merge": st.booleans(), "attempts": st.integers(1, 3)}),
    "race_compaction": (4, {"attempts": st.integers(1, 3), "overlap": st.booleans(), "keys": st.integers(1, 3)}),
    "second_maintainer": (3, {"first": st.sampled_from(["merge", "gc", "snapshot", "catchup", "compact", "discard"]),
                              "second": st.sampled_from(["merge", "gc", "compact"]),
                              "budget": st.sampled_from([3_000, 10**9])}),
    "stale_hint": (3, {"r": st.integers(0, 7), "back": st.integers(0, 4)}),
    "fenced_writer": (2, {"r": st.integers(0, 7), "keep_current_epoch": st.booleans()}),
    "plant_orphan": (2, {"r": st.integers(0, 7), "old": st.booleans()}),
    "add_index": (2, {"column": st.sampled_from(["n", "s"])}),
    "crash": (1, {"job": st.sampled_from(["gc", "snapshot", "merge"]), "k": st.integers(1, 6)}),
    "overwrite_reinit": (2, {"keys": st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=6, unique=True),
                             "reuse": st.booleans()}),
    "discard_stale": (3, {"mode": st.sampled_from(["one", "one", "all", "live", "dry"]),
                          "pick": st.integers(0, 10_000)}),
    "seal_region": (1, {"r": st.integers(0, 7)}),
}
WEIGHTED = [name for name, (w, _) in OPS.items() for _ in range(w)]


class MemWalMachine(RuleBasedStateMachine):
    """Set `spark` and `workdir` on the class (or a subclass) before running."""

    spark = None
    workdir: str = tempfile.gettempdir()

    def __init__(self) -> None:
        super().__init__()
        self.loc = None
        self.trace: list[str] = []  # this machine's steps, named in any failure (a soak's replay may not repeat them)
        Stats.examples += 1
        # GC's version summary seals all but its 2 newest versions once it holds more than 4, so
        # the sealed part and its aggregates are in play after a few commits (restored in teardown).
        self._tail = fact_segments.TAIL_MAX, fact_segments.TAIL_KEEP
        fact_segments.TAIL_MAX, fact_segments.TAIL_KEEP = 4, 2

    # ------------------------------------------------------------------ setup
    @initialize(kind=st.sampled_from(KINDS))
    def init_table(self, kind: str) -> None:
        self.kind = kind
        self.root = tempfile.mkdtemp(prefix="h-", dir=self.workdir)
        os.makedirs(os.path.join(self.root, "outside"))
        with open(os.path.join(self.root, "outside", "sentinel"), "w") as f:
            f.write("not the table's")
        self.outside = tree(os.path.join(self.root, "outside"))
        self.loc = open_store(os.path.join(self.root, "table"))
        base0 = [row(kind, k, 0) for k in range(BASE_KEYS)]
        self.create(base0, mode="create")
        self.spec = (self.ds.mem_wal_index_details() or {})["sharding_specs"][0]
        self.base0 = {r["id"]: r for r in base0}
        self.written = dict(self.base0)  # what writers were asked to write (flushed or not)
        self.value_cache: dict[int, Any] = {}
        self.values = sorted({self.value(k) for k in range(KEYS + ABSENT)})
        self.rids = {v: str(uuid.uuid4()) for v in self.values}
        self.writers: dict[Any, Any] = {}
        self.gens: dict[str, dict[int, list[dict]]] = {rid: {} for rid in self.rids.values()}
        self.bad: dict[tuple[str, int], Bad] = {}
        self.last_merged: dict[str, int] = {}
        self.next_planted = PLANTED_FROM
        self.version = 0
        self.crashes = 0
        self.broken = False
        self.stale = None
        self.scratch: dict[str, tuple[str, Any]] = {}
        self.version_merged: dict[int, dict[str, int] | None] = {}  # base version -> merged (the model's view)
        self.base_checked: set[int] = set()  # base versions whose rows were compared with the model
        self.deep = True  # next check reads every retained version (after anything that deletes)
        self.last_gc_ok: set[str] = set()
        # Table lifecycle (overwrite + MemWAL initialized again): the model's stale boundary of
        # every region written before the current initialization, the discards recorded, and
        # the rows of earlier lifetimes (as (id, s): every written row's `s` is unique).
        self.floor: dict[str, int] = {}
        self.discarded: dict[str, int] = {}
        self.old_rows: set[tuple[int, str]] = set()  # never at a version of this lifetime
        self.never_rows: set[tuple[int, str]] = set()  # unmerged when overwritten: never at any version
        # Sealed regions: the manifest version that sealed them (nothing may come after it).
        self.sealed: dict[str, int] = {}
        self.sealed_values: set[Any] = set()
        self.open_regions: set[str] = set()  # stale with WAL rows past the replay position (no boundary yet)

    def create(self, rows: list[dict], mode: str) -> None:
        """Write the base table (or overwrite it), its key index, and initialize MemWAL with
        the run's sharding: the first version of a MemWAL lifetime."""
        ds = lance.write_dataset(pa.Table.from_pylist(rows, schema=SCHEMA), self.loc.lance_uri, schema=SCHEMA,
                                 mode=mode)
        ds.create_scalar_index("id", "BTREE", name="id_btree")
        if self.kind == "bucket_key":
            ds.initialize_mem_wal(bucket_column="id", num_buckets=3)
        elif self.kind == "bucket_nonkey":
            ds.initialize_mem_wal(bucket_column="c", num_buckets=3)
        elif self.kind == "identity":
            ds.initialize_mem_wal(identity_column="c")
        else:
            ds.initialize_mem_wal(unsharded=True)
        self.ds = lance.dataset(self.loc.lance_uri)
        self.init_version = self.ds.version

    # ------------------------------------------------------------ the step
    @rule(op=st.sampled_from(WEIGHTED), data=st.data())
    def act(self, op: str, data) -> None:
        """One step: a rule drawn by weight (OPS), then its arguments."""
        if self.loc is None:
            return
        kw = {name: data.draw(strat, label=name) for name, strat in OPS[op][1].items()}
        self.trace.append(f"{op}({', '.join(f'{k}={v!r}' for k, v in kw.items())})")
        try:
            getattr(self, op)(**kw)
        except AssertionError as e:
            raise AssertionError(self.traced(e)) from e

    def value(self, key: int) -> Any:
        if key not in self.value_cache:
            if self.kind == "unsharded":
                self.value_cache[key] = 0
            else:
                batch = pa.record_batch([pa.array([key], pa.int64()), pa.array([c_of(self.kind, key)], pa.int64())],
                                        names=["id", "c"])
                self.value_cache[key] = evaluate_sharding_spec(batch, self.spec, self.ds.lance_schema).column(0)[0].as_py()
        return self.value_cache[key]

    def value_of_rid(self, rid: str) -> Any:
        return next(v for v, r in self.rids.items() if r == rid)

    def rid_of(self, key: int) -> str:
        return self.rids[self.value(key)]

    def count(self, name: str) -> None:
        self.broken = True  # until the invariants pass after this step (teardown checks only then)
        Stats.steps += 1
        Stats.rule_counts[name] = Stats.rule_counts.get(name, 0) + 1

    # ------------------------------------------------------------ writers
    def writer(self, v: Any):
        if self.writers.get(v) is None:
            self.writers[v] = self.ds.mem_wal_writer(self.rids[v], max_memtable_rows=MAX_MEMTABLE_ROWS,
                                                     durable_write=False)
        return self.writers[v]

    def settle(self) -> None:
        """Wait until no open writer has a frozen MemTable still being flushed: pylance
        flushes a full MemTable in the background, and the model reads generations once."""
        wait_flushed(self.writers.values())
        self.discover()

    def close(self, v: Any) -> None:
        w = self.writers.pop(v, None)
        if w is not None:
            w.close()
            self.discover()
            self.check_flushed(v)

    def check_flushed(self, v: Any) -> None:
        """A closed writer's region: its generations hold exactly what it was asked to write."""
        rid = self.rids[v]
        state = {k: r for k, r in self.base0.items() if self.rid_of(k) == rid}
        for g in sorted(self.gens[rid]):
            apply(state, self.gens[rid][g])
        mine = {k for k in range(KEYS + ABSENT) if self.rid_of(k) == rid}
        got = {k: state.get(k) for k in mine}
        want = {k: self.written.get(k) for k in mine}
        assert got == want, f"region {rid}: flushed generations differ from what was written"

    def by_region(self, keys: list[int]) -> dict[Any, list[int]]:
        """Keys by region value; keys of a sealed region's value are left out (no writer may
        claim a sealed region, and a second region for its value would break exclusivity)."""
        out: dict[Any, list[int]] = {}
        for k in keys:
            if self.value(k) not in self.sealed_values:
                out.setdefault(self.value(k), []).append(k)
        return out

    def put_rows(self, keys: list[int]) -> None:
        self.version += 1
        for v, ks in self.by_region(keys).items():
            rows = [row(self.kind, k, self.version) for k in ks]
            self.writer(v).put(pa.Table.from_pylist(rows, schema=SCHEMA))
            for r in rows:
                self.written[r["id"]] = r
        self.settle()

    def put(self, keys: list[int]) -> None:
        self.count("put")
        self.put_rows(keys)

    def overwrite(self, picks: list[int]) -> None:
        self.count("overwrite")
        live = sorted(self.written)
        if live:
            self.put_rows(sorted({live[p % len(live)] for p in picks}))

    def delete(self, keys: list[int], whole_rows: bool) -> None:
        """Delete by key, or by whole rows (pylance ignores the non-key columns): either way the
        tombstone's other columns, a non-key region column too, are NULL."""
        self.count("delete")
        for v, ks in self.by_region(keys).items():
            if whole_rows:
                self.writer(v).delete(pa.Table.from_pylist([row(self.kind, k, 0) for k in ks], schema=SCHEMA))
            else:
                self.writer(v).delete(pa.table({"id": pa.array(ks, pa.int64())}))
            for k in ks:
                self.written.pop(k, None)
        self.settle()

    def flush(self, r: int) -> None:
        """Close the region's writer: its MemTable becomes a generation."""
        self.count("flush")
        self.close(self.values[r % len(self.values)])

    def reopen(self, r: int) -> None:
        """Close and reopen: the new writer claims the region with a bumped epoch."""
        self.count("reopen")
        v = self.values[r % len(self.values)]
        self.close(v)
        if v not in self.sealed_values:
            self.writer(v)

    # ------------------------------------------------------------- merges
    def merged(self) -> dict[str, int]:
        return table.read_memwal_state(self.loc).merged

    def run_merge(self, budget: int, max_gens: int, via_plan: bool, loc=None) -> merge.MergeResult:
        Stats.merges += 1
        loc = loc or self.loc
        gaps = {rid for (rid, _), b in self.bad.items() if b.kind == "gap"}
        before = self.merged() if gaps else {}
        try:
            if via_plan:
                plan = merge.plan_merge(loc, budget_bytes=budget, max_generations=max_gens)
                res = merged_result(merge.execute_merge(loc, plan, self.spark))
            else:
                res = merged_result(merge.merge(loc, self.spark, budget_bytes=budget, max_generations=max_gens))
        except Exception as e:
            # One region's bad generation must fail that region only, never the whole run.
            raise AssertionError(f"MERGE RAISED: {type(e).__name__}: {str(e)[:300]}") from e
        if gaps:
            self.check_gap_refused(gaps, before, res)
        return res

    def check_gap_refused(self, gaps: set[str], before: dict[str, int], res: merge.MergeResult) -> None:
        """A region whose manifest lists generations above progress with a hole among them
        cannot be merged as listed: the merger refuses the whole region (none of its
        generations merges, not even those below the hole) and reports it stuck (a verdict on
        the manifest: only a repair moves it), never a wall that the next run retries."""
        after = self.merged()
        for rid in sorted(gaps):
            assert rid in res.stuck_regions, (
                f"GAP: region {rid} lists a hole above progress {before.get(rid, 0)}; the merge did not report "
                f"it stuck (failures: {res.region_errors.get(rid)})")
            if rid not in self.floor:  # a stale region's progress moves by a discard (a concurrent one)
                assert after.get(rid, 0) == before.get(rid, 0), (
                    f"GAP: region {rid} lists a hole above progress {before.get(rid, 0)}; the merge moved it to "
                    f"{after.get(rid, 0)}")
        did("gap_refused")

    def merge(self, budget: int, max_gens: int, via_plan: bool) -> None:
        self.count("merge")
        waiting = self.undiscarded()
        res = self.run_merge(budget, max_gens, via_plan)
        listed = {rid for rid in waiting if (m := self.latest_manifest(rid)) is not None and m.generations}
        missing = listed - set(res.stuck_regions)
        assert not missing, f"STALE: the merge did not report stale regions {sorted(missing)} as stuck"
        if listed:
            did("stale_region_refused")

    def plan_for_later(self, budget: int, max_gens: int) -> None:
        """Plan a merge now and execute it some steps later (a slow scheduler): by then other
        merges, GC, repairs and new writes may have happened."""
        self.count("stale_plan")
        self.stale = merge.plan_merge(self.loc, budget_bytes=budget, max_generations=max_gens)

    def execute_stale_plan(self, keep: bool) -> None:
        if self.stale is None:
            return
        self.count("stale_execute")
        Stats.merges += 1
        plan = self.stale
        self.stale = plan if keep else None  # keep: it may run yet again later
        try:
            merged_result(merge.execute_merge(self.loc, plan, self.spark))
        except Exception as e:
            raise AssertionError(f"MERGE RAISED: {type(e).__name__}: {str(e)[:300]}") from e

    def pending(self) -> list[tuple[str, int]]:
        """(region, generation) of every listed generation above progress."""
        merged = self.merged()
        out = []
        for rid in sorted(self.gens):
            try:
                m = region.load_latest(self.loc.store, rid)
            except Exception:  # noqa: BLE001 - region not created yet
                continue
            out += [(rid, g.generation) for g in m.generations if g.generation > merged.get(rid, 0)]
        return out

    def gen_path(self, rid: str, g: int) -> str:
        m = region.load_latest(self.loc.store, rid)
        path = next(x.path for x in m.generations if x.generation == g)
        return os.path.join(self.root, "table", layout.generation_dir(rid, path, g))

    def merge_with_unreadable_generation(self, pick: int, budget: int, max_gens: int, back_at: int) -> None:
        """One pending generation is unreadable (moved away) from the start of a merge until the
        merge ends (`back_at` 0: the region must stop below it) or until batch `back_at + 1`
        starts (it flaps back mid-run: merging it then is fine, passing it is not)."""
        self.count("merge_transient")
        pending = self.pending() if TRANSIENT else []
        if not pending:
            return
        rid, g = pending[pick % len(pending)]
        path = self.gen_path(rid, g)
        away = path + ".away"
        batches = []

        def progress(msg: str) -> None:
            batches.append(msg)
            if back_at and len(batches) == back_at + 1 and os.path.exists(away):
                os.rename(away, path)

        os.rename(path, away)
        try:
            Stats.merges += 1
            try:
                if pick % 2 == 0:
                    plan = merge.plan_merge(self.loc, budget_bytes=budget, max_generations=max_gens)
                    merged_result(merge.execute_merge(self.loc, plan, self.spark, progress=progress))
                else:
                    merged_result(merge.merge(self.loc, self.spark, budget_bytes=budget, max_generations=max_gens,
                                              progress=progress))
            except Exception as e:
                raise AssertionError(f"MERGE RAISED: {type(e).__name__}: {str(e)[:300]}") from e
            after = self.merged().get(rid, 0)
            restored_mid_run = not os.path.exists(away)
        finally:
            if os.path.exists(away):
                os.rename(away, path)
        if not restored_mid_run:
            assert after < g, (f"WALL: region {rid} progress {after} passed generation {g}, "
                               "which was unreadable during the merge")
        # Either way the invariants check that the base table holds every generation up to progress.

    # ---------------------------------------------------- bad generations
    def fresh_keys(self, n: int, want, own: Any) -> list[int]:
        out = []
        while len(out) < n:
            k = self.next_planted
            self.next_planted += 1
            if want(self.value(k), own):
                out.append(k)
        return out

    def writer_made(self, schema: pa.Schema, rows: list[dict]) -> str:
        """A generation directory written by a real `ShardWriter` (so it has the `_pk_index`
        and bloom filter pylance's LSM reader needs) into a scratch table of `schema`."""
        name = ",".join(f"{f.name}:{f.type}" for f in schema)
        if name not in self.scratch:
            uri = os.path.join(self.root, "scratch", uuid.uuid4().hex[:8])
            ds = lance.write_dataset(pa.Table.from_pylist([], schema=schema), uri, schema=schema)
            ds.initialize_mem_wal(unsharded=True)
            self.scratch[name] = (uri, lance.dataset(uri))
        uri, ds = self.scratch[name]
        rid = str(uuid.uuid4())
        with ds.mem_wal_writer(rid, max_memtable_rows=len(rows) + 1, durable_write=False) as w:
            w.put(pa.Table.from_pylist(rows, schema=schema))
        m = region.load_latest(open_store(uri).store, rid)
        (g,) = m.generations
        return os.path.join(uri, layout.generation_dir(rid, g.path, g.generation))

    def plant_dir(self, rid: str, src: str | None, rows: int, gen: int | None = None,
                  data: pa.Table | None = None, path: str | None = None) -> int:
        """List a copy of `src` (or `data` written by hand, or the existing directory `path`)
        as a generation of the region (a foreign writer's flush): the next one unless `gen`
        says which."""
        latest = region.load_latest(self.loc.store, rid)
        gen = gen or latest.current_generation
        dest = None
        if path is None:
            path = f"{uuid.uuid4().hex[:8]}_gen_{gen}"
            dest = os.path.join(self.root, "table", layout.generation_dir(rid, path, gen))
        if dest is None:
            pass
        elif src is not None:
            shutil.copytree(src, dest)
        else:
            lance.write_dataset(data, dest)

        def add(m) -> bool:
            m.flushed_generations.add(generation=gen, path=path, physical_rows=rows)
            m.current_generation = max(m.current_generation, gen + 1)
            return True

        region.commit_next(self.loc.store, latest, add)
        return gen

    def plant_bad(self, r: int, kind: str, n: int) -> None:
        """A foreign writer flushes a generation that cannot be merged as it is."""
        self.count("plant_bad")
        kind = kind if kind in ENABLED_BAD else ENABLED_BAD[0]
        v = self.values[r % len(self.values)]
        if v in self.sealed_values:
            return
        rid = self.rids[v]
        if kind.startswith("misrouted") and self.kind == "unsharded":
            kind = "extra_column"
        merged_live = any(not r["_tombstone"] for g, rows in self.gens[rid].items()
                          if g <= self.merged().get(rid, 0) for r in rows)
        if kind == "misrouted_all" and not merged_live:
            # Nothing authoritative says which value the region owns yet (no merged live row:
            # tombstones carry no region value): "all rows elsewhere" is then
            # indistinguishable from "the region owns that value".
            kind = "misrouted_some"
        self.close(v)
        self.writer(v)
        self.close(v)  # the region exists, and no open writer holds a MemTable generation number
        self.version += 1
        own = self.fresh_keys(n, lambda x, o: x == o, v)
        good = [row(self.kind, k, self.version) for k in own]
        keys = set(own)
        if kind == "extra_column":
            schema = SCHEMA.append(pa.field("other", pa.string()))
            data = [{**r, "other": "x"} for r in good]
        elif kind == "wrong_type":
            schema = SCHEMA.set(2, pa.field("n", pa.string()))
            data = [{**r, "n": f"v{r['n']}"} for r in good]  # not castable to the table's int64
        elif kind == "null_key":
            # A writer refuses a nullable key column: this one is written by hand (no `_pk_index`).
            null = pa.Table.from_pylist([{**r, "_tombstone": False} for r in good]
                                        + [{"id": None, "c": 0, "n": self.version, "s": "null", "_tombstone": False}],
                                        schema=GEN_SCHEMA.set(0, pa.field("id", pa.int64())))
            g = self.plant_dir(rid, None, null.num_rows, data=null)
        elif kind == "gap":
            schema, data = SCHEMA, good
            did("gap_planted")
        else:
            schema = SCHEMA
            stray = self.fresh_keys(n if kind == "misrouted_all" else 1, lambda x, o: x != o, v)
            keys |= set(stray)
            stray_rows = [row(self.kind, k, self.version) for k in stray]
            data = stray_rows if kind == "misrouted_all" else good + stray_rows
        missing, unlisted, fill = 0, "", None
        if kind == "gap":  # the manifest skips a generation number: listed [.., g-1, g+1]
            missing = region.load_latest(self.loc.store, rid).current_generation
            g = self.plant_dir(rid, self.writer_made(schema, data), len(data), gen=missing + 1)
            if n == 2:  # the skipped generation's directory exists, unlisted: GC must not take it
                fill = [row(self.kind, k, self.version) for k in self.fresh_keys(1, lambda x, o: x == o, v)]
                unlisted = f"{uuid.uuid4().hex[:8]}_gen_{missing}"
                shutil.copytree(self.writer_made(SCHEMA, fill),
                                os.path.join(self.root, "table", layout.generation_dir(rid, unlisted, missing)))
        elif kind != "null_key":
            g = self.plant_dir(rid, self.writer_made(schema, data), len(data))
        self.gens[rid][g] = [{**r, "_tombstone": False} for r in good]
        self.bad[(rid, g)] = Bad(kind, keys, good, missing, unlisted, fill)

    def repair_one(self, rid: str, g: int) -> None:
        b = self.bad.pop((rid, g))
        if b.kind == "gap" and b.unlisted:  # list the directory that was there all along
            where = os.path.join(self.root, "table", layout.generation_dir(rid, b.unlisted, b.missing))
            assert os.path.isdir(where), (f"GC deleted generation {b.missing} of region {rid}: unlisted behind "
                                          "a manifest gap, but the only copy of its rows")
            self.plant_dir(rid, None, len(b.fill), gen=b.missing, path=b.unlisted)
            self.gens[rid][b.missing] = [{**r, "_tombstone": False} for r in b.fill]
            return
        if b.kind == "gap":  # list the skipped generation (one fresh row of the region)
            self.version += 1
            fill = [row(self.kind, k, self.version) for k in self.fresh_keys(1, lambda x, o: x == o, self.value_of_rid(rid))]
            self.plant_dir(rid, self.writer_made(SCHEMA, fill), 1, gen=b.missing)
            self.gens[rid][b.missing] = [{**r, "_tombstone": False} for r in fill]
            return
        path = self.gen_path(rid, g)
        src = self.writer_made(SCHEMA, b.good)
        shutil.rmtree(path)
        shutil.copytree(src, path)

    def repair(self, pick: int) -> None:
        """The operator rewrites a bad generation with good data of the same rows."""
        if not self.bad:
            return
        self.count("repair")
        rid, g = sorted(self.bad)[pick % len(self.bad)]
        self.repair_one(rid, g)

    def compact(self, race_merge: bool, attempts: int) -> None:
        """Base-table compaction with every trigger at its lowest; with `race_merge` a merge
        commits between its rewrite and its commit (the Rewrite conflicts and re-plans, or
        gives up cleanly after `attempts` plans)."""
        self.count("compact")
        opts = compaction.CompactionOptions(max_fragments=1, max_small_fragments=1, min_small_fragments=1,
                                            min_deleted_rows=1, max_deleted_row_ratio=0.0, max_index_segments=1,
                                            max_attempts=attempts)
        raced = []

        def before_commit(attempt: int) -> None:
            if race_merge and not raced:
                raced.append(attempt)
                self.run_merge(3_000, 2, False)

        compacted(compaction.compact(self.loc, self.spark, opts, before_commit=before_commit))

    def pending_work(self, keys: int) -> None:
        """Make sure a merge has something to commit that touches the base table's fragments:
        overwrite a few base keys and flush their regions."""
        self.put_rows(list(range(min(keys, BASE_KEYS))))
        for v in list(self.writers):
            self.close(v)

    def race_compaction(self, attempts: int, overlap: bool, keys: int) -> None:
        """Compaction in its own thread, with its own table handle, while a merge commits.
        Without `overlap` the merge starts once the compaction has rewritten (so its commit
        conflicts: retried, or given up after `attempts` plans with the rewrite cleaned up);
        with it both start at once."""
        self.count("race_compaction")
        self.pending_work(keys)
        opts = compaction.CompactionOptions(max_fragments=1, max_small_fragments=1, min_small_fragments=1,
                                            min_deleted_rows=1, max_deleted_row_ratio=0.0, max_index_segments=1,
                                            max_attempts=attempts)
        rewritten, merged_done = threading.Event(), threading.Event()
        out: dict[str, Any] = {}

        def before_commit(attempt: int) -> None:
            rewritten.set()
            if attempt == 1:
                merged_done.wait(120)

        def run() -> None:
            try:
                with unleased(self.loc):
                    out["res"] = compaction.compact(open_store(self.loc.lance_uri), self.spark, opts,
                                                    before_commit=before_commit)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                out["error"] = e
            finally:
                rewritten.set()

        t = threading.Thread(target=run, name="harness-compaction")
        t.start()
        try:
            if not overlap:
                rewritten.wait(120)
            with unleased(self.loc):
                self.run_merge(10**9, 4, False, loc=open_store(self.loc.lance_uri))
        finally:
            merged_done.set()
            t.join(300)
        assert not t.is_alive(), "compaction thread did not finish"
        if "error" in out:
            raise AssertionError(f"COMPACTION RAISED: {type(out['error']).__name__}: {out['error']}") from out["error"]
        res = compacted(out["res"])
        if res.conflicts:
            did("compaction_merge_conflict")
        self.deep = True

    def second_maintainer(self, first: str, second: str, budget: int) -> None:
        """Two maintenance jobs at once, each in its own thread with its own table handle (a
        second maintainer on another machine). GC's base-version cleanup here only removes
        versions older than a few seconds: a cleanup racing a commit must leave young versions."""
        self.count("second_maintainer")
        if first == second == "gc":
            second = "merge"

        def job(name: str):
            loc = open_store(self.loc.lance_uri)
            if name == "discard":
                return lifecycle.discard(loc, None)
            if name == "merge":
                return self.run_merge(budget, 4, False, loc=loc)
            if name == "gc":
                return self.gc_run(loc, GcOptions(manifest_retention=1, manifest_min_age_seconds=0.0,
                                                  orphan_grace_seconds=3600.0,
                                                  cleanup_base_versions_older_than_seconds=5.0,
                                                  cleanup_base_versions_floor_seconds=5.0, max_workers=2))
            if name == "snapshot":
                return snapshot.build_snapshot(loc, max_workers=2)
            if name == "catchup":
                return catchup.run_catchup(loc, None)
            opts = compaction.CompactionOptions(max_fragments=1, max_small_fragments=1, min_small_fragments=1,
                                                min_deleted_rows=1, max_deleted_row_ratio=0.0, max_index_segments=1)
            return compacted(compaction.compact(loc, self.spark, opts))

        out: dict[str, Any] = {}

        def run(name: str, slot: str) -> None:
            try:
                with unleased(self.loc):
                    out[slot] = job(name)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                out[slot + "_error"] = e

        ts = [threading.Thread(target=run, args=(first, "a")), threading.Thread(target=run, args=(second, "b"))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        assert not any(t.is_alive() for t in ts), "a maintainer thread did not finish"
        for slot in ("a", "b"):
            if slot + "_error" in out:
                e = out[slot + "_error"]
                raise AssertionError(f"CONCURRENT {first}/{second}: {type(e).__name__}: {e}") from e
            res = out.get(slot)
            if isinstance(res, lifecycle.DiscardResult):
                self.record_discards(res.discarded, "a discard next to a maintainer")
            elif isinstance(res, gc.GcResult):
                self.record_discards(res.stale_discarded, "GC's grace")
        did("concurrent_jobs")
        self.deep = True

    def stale_hint(self, r: int, back: int) -> None:
        """Roll a region's version_hint.json back (by `back` >= 2 versions, never below the
        oldest kept one), or remove it (`back` 0) or garble it (`back` 1): readers, writers and
        jobs must still find the newest manifest."""
        self.count("stale_hint")
        rid = self.rids[self.values[r % len(self.values)]]
        vs = self.manifest_versions(rid)
        if not vs:
            return
        key = os.path.join(self.root, "table", layout.version_hint_key(rid))
        if back == 0:
            if os.path.exists(key):
                os.unlink(key)
        elif back == 1:
            with open(key, "w") as f:
                f.write("{not json")
        else:
            target = max(vs[0], vs[-1] - back)
            region.write_version_hint(self.loc.store, rid, target)
            if vs[-1] - target >= 2:
                did("hint_stale_by_2+")

    def fenced_writer(self, r: int, keep_current_epoch: bool) -> None:
        """Writer A writes; B claims the region (fencing A), replays and flushes A's entry; C
        claims and closes; GC collects everything it may; A's next write must be refused."""
        self.count("fenced_writer")
        v = self.values[r % len(self.values)]
        rid = self.rids[v]
        mine = [k for k in range(KEYS) if self.value(k) == v]
        if not mine or v in self.sealed_values:
            return
        self.close(v)

        def open_writer():
            return self.ds.mem_wal_writer(rid, max_memtable_rows=100, durable_write=True)

        a = open_writer()
        self.version += 1
        rows = [row(self.kind, k, self.version) for k in mine[:2]]
        a.put(pa.Table.from_pylist(rows, schema=SCHEMA))
        for x in rows:
            self.written[x["id"]] = x
        b = open_writer()  # fences A; its sentinel is A's next WAL position
        b.close()
        open_writer().close()
        self.discover()
        self.check_flushed(v)
        # Merged, recorded and caught up: B's generation and its WAL (the sentinel's epoch is
        # not the current one) are collectable; only the sentinel rule keeps A fenced.
        self.run_merge(10**9, 4, False)
        snapshot.build_snapshot(self.loc, max_workers=2)
        catchup.run_catchup(self.loc, None)
        self.gc_run(self.loc, GcOptions(manifest_retention=1, manifest_min_age_seconds=0.0, orphan_grace_seconds=3600.0,
                                        keep_current_epoch_wal=keep_current_epoch, max_workers=2,
                                        cleanup_base_versions_older_than_seconds=None))
        self.version += 1
        try:
            a.put(pa.Table.from_pylist([row(self.kind, mine[0], self.version)], schema=SCHEMA))
        except OSError as e:
            assert "fenced" in str(e).lower(), f"FENCED WRITER: unexpected error {e}"
            did("fenced_write_refused")
        else:
            raise AssertionError(f"FENCED WRITER: region {rid}: a fenced writer's write was accepted after GC")
        finally:
            try:
                a.close()
            except OSError:
                pass
        self.discover()
        self.check_flushed(v)

    def plant_orphan(self, r: int, old: bool) -> None:
        """A generation directory no manifest lists (a flush that died before listing it, or a
        GC that died after unlisting it): `old` ones are past any grace period."""
        self.count("plant_orphan")
        v = self.values[r % len(self.values)]
        rid = self.rids[v]
        m = self.latest_manifest(rid)
        if m is None or m.current_generation < 2 or m.sealed:
            return
        gaps = {b.missing for (x, _), b in self.bad.items() if x == rid and b.kind == "gap"}
        g = next((n for n in range(1, m.current_generation) if n not in gaps), None)
        if g is None:
            return
        self.version += 1
        keys = self.fresh_keys(1, lambda x, o: x == o, v)
        src = self.writer_made(SCHEMA, [row(self.kind, k, self.version) for k in keys])
        dest = os.path.join(self.root, "table", layout.generation_dir(rid, f"{uuid.uuid4().hex[:8]}_gen_{g}", g))
        shutil.copytree(src, dest)
        if old:
            t = time.time() - 3 * 86400
            for dp, _, fs in os.walk(dest):
                for f in fs:
                    os.utime(os.path.join(dp, f), (t, t))

    # ------------------------------------------------------- lifecycle
    def overwrite_reinit(self, keys: list[int], reuse: bool) -> None:
        """The table is overwritten (`write_dataset(mode="overwrite")`) while regions hold
        unmerged generations, and MemWAL is initialized again. Every region written so far is
        stale through its last flushed generation: never merged, never shown to readers, kept
        whole by GC until discarded. The new base is `keys`; writers then continue the old
        region ids (`reuse`: their new generations wait behind the stale ones) or new ones."""
        self.count("overwrite_reinit")
        for v in list(self.writers):
            self.close(v)
        merged = self.merged()
        unmerged, done = set(), {(k, r["s"]) for k, r in self.base0.items()}
        self.open_regions = set()
        for rid, gens in self.gens.items():
            m = self.latest_manifest(rid)
            if m is None:
                continue
            self.floor[rid] = m.current_generation - 1
            # pylance's own record: a WAL entry with rows above the replay position is one a
            # writer claiming the region would replay (even when its rows are in a generation
            # already): memwal cannot fix the stale boundary until that flush (an open verdict).
            covered = m.message.replay_after_wal_entry_position
            if any(p > covered and not wal.read_entry_meta(self.loc.store, rid, p).fence_sentinel
                   for p in self.wal_positions(rid)):
                self.open_regions.add(rid)
            for g, rows in gens.items():
                sigs = {(r["id"], r["s"]) for r in rows if not r["_tombstone"]}
                (unmerged if g > merged.get(rid, 0) else done).update(sigs)
            gens.clear()
        for (rid, g), b in self.bad.items():  # planted rows behind a wall: never merged either
            unmerged |= {(r["id"], r["s"]) for r in b.good + (b.fill or [])}
        self.old_rows |= unmerged | done
        self.never_rows |= unmerged - done
        self.bad.clear()
        # A merge planned before the overwrite stays pending: executed after it, it must merge
        # nothing (`execute_merge` re-checks the plan's MemWAL initialization).
        self.version += 1
        base = [row(self.kind, k, self.version) for k in sorted(keys)]
        self.create(base, mode="overwrite")
        self.base0 = {r["id"]: r for r in base}
        self.written = dict(self.base0)
        self.last_merged = {}
        self.discarded = {}
        self.deep = True
        for v in self.values:  # an open region is left alone (its boundary would move on a claim)
            if not reuse or v in self.sealed_values or self.rids[v] in self.open_regions:
                self.rids[v] = str(uuid.uuid4())
                self.gens[self.rids[v]] = {}
        self.sealed_values.clear()  # a new region takes a sealed region's value in the new lifetime
        did("overwrite_reinit")
        # memwal's verdicts are the model's: every region written before is stale through its
        # last flushed generation (closed: every writer was closed), and no other region is.
        lc = lifecycle.assess_table(self.loc).lifecycle
        assert lc.init is not None and lc.init.table_version == self.init_version, (
            f"LIFECYCLE: initialization {lc.init} is not table version {self.init_version}")
        got = {rid: v.stale_through for rid, v in lc.stale.items()}
        want = {rid: None if rid in self.open_regions else f for rid, f in self.floor.items()}
        assert got == want, f"LIFECYCLE: stale verdicts {got}, the model says {want} (None: open)"
        if self.open_regions:
            did("stale_open_boundary")

    def undiscarded(self) -> set[str]:
        """Stale regions not discarded yet: the merger refuses them (and reports it)."""
        merged = self.merged()
        return {rid for rid, f in self.floor.items() if f > merged.get(rid, 0)}

    def record_discards(self, discarded: dict[str, int], by: str) -> None:
        """Regions whose stale generations were just discarded: only stale ones, through exactly
        the model's boundary."""
        for rid, through in discarded.items():
            assert rid in self.floor, f"DISCARD ({by}): region {rid} was written after the MemWAL initialization"
            assert through == self.floor[rid], (
                f"DISCARD ({by}): region {rid} discarded through {through}, its stale boundary is {self.floor[rid]}")
            self.discarded[rid] = through
            did("stale_discarded")

    def region_files(self, rids: list[str]) -> dict[str, Any]:
        out = {}
        for rid in rids:
            d = os.path.join(self.root, "table", layout.region_dir(rid))
            out[rid] = tree(d) if os.path.isdir(d) else None
        return out

    def discard_stale(self, mode: str, pick: int) -> None:
        """The operator discards stale regions (`lifecycle.discard`, what `memwal regions
        discard` runs): one, all, a dry run, or by mistake a region of this lifetime (refused).
        Regions of this lifetime keep their progress and every file."""
        live = sorted(rid for rid in self.gens if rid not in self.floor and self.manifest_versions(rid))
        stale = sorted(self.floor)
        if mode == "live" and not live or mode != "live" and not stale:
            return
        self.count("discard")
        before = self.merged()
        files = self.region_files(live)
        if mode == "live":  # one holding unmerged generations if any: what a wrong discard would lose
            merged = before
            pending = [rid for rid in live if any(g.generation > merged.get(rid, 0)
                                                  for g in self.latest_manifest(rid).generations)]
            rid = (pending or live)[pick % len(pending or live)]
            res = lifecycle.discard(self.loc, [rid])
            assert rid in res.refused and not res.discarded, f"DISCARD: region {rid} of this lifetime was not refused"
            did("live_discard_refused")
        elif mode == "dry":
            res = lifecycle.discard(self.loc, None, dry_run=True)
            assert self.merged() == before, "DISCARD: a dry run changed merge progress"
            for rid, through in res.discarded.items():
                assert self.floor.get(rid) == through, f"DISCARD (dry run): region {rid} through {through}"
        else:
            targets = [stale[pick % len(stale)]] if mode == "one" else None
            res = lifecycle.discard(self.loc, targets)
            self.record_discards(res.discarded, "operator")
            for rid in targets or stale:
                if rid in self.open_regions:
                    assert rid not in res.discarded, f"DISCARD: region {rid} discarded with its boundary open"
                elif self.floor[rid] > before.get(rid, 0):
                    assert rid in res.discarded, f"DISCARD: stale region {rid} refused: {res.refused.get(rid)}"
        after = self.merged()
        changed = {rid for rid in live if after.get(rid, 0) != before.get(rid, 0)}
        assert not changed, f"DISCARD: progress of regions of this lifetime changed: {sorted(changed)}"
        now = self.region_files(live)
        # Open writers may add files and rewrite the hint, and their background flusher renames
        # its in-flight upload (`<name>.tmp.<id>`) when it lands: neither is the discard's doing.
        for rid, was in files.items():
            gone = {p for p, v in (was or {}).items()
                    if not p.endswith(layout.VERSION_HINT) and ".tmp." not in os.path.basename(p)
                    and (now[rid] or {}).get(p) != v}
            assert not gone, f"DISCARD: files of region {rid} (of this lifetime) changed or went: {sorted(gone)[:5]}"

    def seal_region(self, r: int) -> None:
        """A region whose writer is closed for good: its manifest is SEALED (pylance 14: writers
        refuse to claim it). Its generations still merge to the end; memwal commits no manifest
        version after the sealing one (so GC trims nothing there); no writer writes its value
        again (a second region for it would break the regions' exclusivity)."""
        v = self.values[r % len(self.values)]
        rid = self.rids[v]
        if len(self.values) < 2 or v in self.sealed_values or any(x == rid for x, _ in self.bad):
            return
        self.count("seal")
        self.close(v)
        if self.latest_manifest(rid) is None:
            self.writer(v)
            self.close(v)

        def mutate(msg) -> bool:
            msg.status = pb.SEALED
            return True

        sealed = region.commit_next(self.loc.store, self.latest_manifest(rid), mutate)
        self.sealed[rid] = sealed.version
        self.sealed_values.add(v)
        k = next(k for k in range(KEYS) if self.value(k) == v)
        try:
            with self.ds.mem_wal_writer(rid, max_memtable_rows=MAX_MEMTABLE_ROWS, durable_write=False) as w:
                w.put(pa.Table.from_pylist([row(self.kind, k, -1)], schema=SCHEMA))
        except OSError as e:
            assert "sealed" in str(e).lower(), f"SEALED: unexpected error claiming region {rid}: {e}"
            did("sealed_claim_refused")
        else:
            raise AssertionError(f"SEALED: a writer claimed sealed region {rid} and wrote to it")
        did("region_sealed")

    # ----------------------------------------------------- other jobs
    def build_snapshot(self, external: bool, hints: bool) -> None:
        """The MemWAL index builder; `external` forces the snapshot out of line."""
        self.count("snapshot")
        snapshot.build_snapshot(self.loc, max_workers=2, update_hints=hints,
                                **({"inline_threshold": 0} if external else {}))

    def catch_up(self, named: bool, retrain: bool) -> None:
        self.count("catchup")
        catchup.run_catchup(self.loc, ["id_btree"] if named else None, retrain=retrain)

    def add_index(self, column: str) -> None:
        """A new base-table index (the table maintains all indexes): no region has caught it
        up yet, so GC must keep every generation until catch-up runs for it."""
        self.count("add_index")
        name = f"{column}_idx"
        ds = table.open_dataset(self.loc)
        if any(i["name"] == name for i in ds.list_indices()):
            return
        ds.create_scalar_index(column, "BTREE", name=name)
        did("index_added")

    def collect_garbage(self, keep: int, min_age: float, grace: float, base_retain: int | None,
                        retention: str = "none", prep: str = "none", keep_epoch: bool = True,
                        discard_after: float | None = None) -> None:
        """GC with random manifest/orphan ages and base-version retention (by count, or by an
        age no version reaches in a run). `prep`: the maintenance job's order first, index
        builder and catch-up ("full", so that merged generations become collectable), the
        index builder alone ("snapshot": catch-up lags, new regions are missing from it) or
        catch-up alone ("catchup": merged generations of regions no snapshot records yet, whose
        routing value only they still show, are collectable but for that)."""
        self.count("gc")
        if prep in ("full", "snapshot"):
            snapshot.build_snapshot(self.loc, max_workers=2)
        if prep in ("full", "catchup"):
            catchup.run_catchup(self.loc, None)
        kw: dict[str, Any] = {"cleanup_base_versions_older_than_seconds": None}  # by count, or none
        if base_retain is not None:
            kw["cleanup_base_versions_retain"] = base_retain
        elif retention.startswith("count"):
            kw["cleanup_base_versions_retain"] = int(retention[5:])
        elif retention == "long":
            kw["cleanup_base_versions_older_than_seconds"] = 3600.0
        # The retention floor lowered: nothing else commits while this rule runs (one process).
        # Without grace every pass lists the table and scans for leaked files (collected at
        # once); with it, passes probe for new versions between the hourly full scans.
        if grace == 0.0:
            kw["full_scan_interval_seconds"] = 0.0
        self.gc_run(self.loc, GcOptions(manifest_retention=keep, manifest_min_age_seconds=min_age,
                                        orphan_grace_seconds=grace, leaked_file_grace_seconds=grace,
                                        keep_current_epoch_wal=keep_epoch, max_workers=2,
                                        discard_stale_after_seconds=discard_after,
                                        cleanup_base_versions_floor_seconds=0, **kw))

    def gc_run(self, loc, config: GcOptions) -> gc.GcResult:
        """`gc.run_gc` with the plan checked by the oracle before it executes, and what it must
        keep checked after."""
        before = self.wal_facts()
        checked = []
        real_execute = gc_run.execute_gc  # the name `run_gc` calls

        def execute_checked(where, plan: gc.GcPlan) -> gc.GcResult:
            self.check_gc_plan(plan)
            checked.append(plan)
            return real_execute(where, plan)

        gc_run.execute_gc = execute_checked
        try:
            res = gc.run_gc(loc, config)
        finally:
            gc_run.execute_gc = real_execute
        assert checked, "GC executed no plan"
        unexpected = set(res.region_errors) - {rid for rid, _ in self.bad}
        assert not unexpected, f"GC: region errors in regions with nothing bad planted: {res.region_errors}"
        self.deep = True
        counts = res.counts()
        for kind in gc.KINDS:
            if counts[kind]:
                did(f"gc_deleted_{kind}")
        self.record_discards(res.stale_discarded, "GC's grace")
        if any(i.kind == gc.GENERATION and i.number <= self.floor.get(i.region_id, 0) for i in res.deleted):
            did("stale_collected")
        after = self.wal_facts()
        for rid, (fences, tail) in before.items():
            now_fences, now_positions = after.get(rid, (set(), set()))[0], self.wal_positions(rid)
            assert fences <= now_fences, f"GC: region {rid} lost fence sentinels {sorted(fences - now_fences)}"
            assert tail is None or tail in now_positions, f"GC: region {rid} lost its WAL tail {tail}"
        for rid in self.gens:
            m = self.latest_manifest(rid)
            hint = region.read_version_hint(self.loc.store, rid)
            if m is not None and hint is not None:
                assert hint in self.manifest_versions(rid), (
                    f"GC: region {rid} version hint {hint} points at a deleted manifest version")
        return res

    # ------------------------------------------------------- GC oracle
    def manifest_versions(self, rid: str) -> list[int]:
        d = os.path.join(self.root, "table", layout.manifest_dir(rid))
        if not os.path.isdir(d):
            return []
        return sorted(v for v in (layout.parse_bitrev(f) for f in os.listdir(d) if f.endswith(layout.MANIFEST_SUFFIX)) if v)

    def latest_manifest(self, rid: str) -> region.RegionManifest | None:
        """The region's newest manifest, found by listing its directory: independent of the
        version hint and of memwal's probe."""
        vs = self.manifest_versions(rid)
        return region.load_version(self.loc.store, rid, vs[-1]) if vs else None

    def wal_positions(self, rid: str) -> set[int]:
        """WAL entries on disk: complete files only (a writer's object store stages an entry as
        `<name>.arrow#<n>` and renames it when complete; that staging file is not an entry)."""
        d = os.path.join(self.root, "table", layout.wal_dir(rid))
        if not os.path.isdir(d):
            return set()
        return {p for p in (layout.parse_bitrev(f) for f in os.listdir(d) if f.endswith(layout.WAL_SUFFIX)) if p}

    def wal_facts(self) -> dict[str, tuple[set[int], int | None]]:
        """Per region: the fence sentinels and the highest WAL position on disk."""
        out = {}
        for rid in self.gens:
            ps = self.wal_positions(rid)
            fences = {p for p in ps if wal.read_entry_meta(self.loc.store, rid, p).fence_sentinel}
            out[rid] = (fences, max(ps, default=None))
        return out

    def check_value_record(self, rid: str, spec_id: int, want: dict[str, Any], what: str) -> None:
        """The durable record of region `rid`'s value, read here from its file (not through
        `state/value_records.py`): of this lifetime (the model's initialization version), this
        region and its manifest's spec, sealed intact, holding the model's value."""
        path = os.path.join(self.root, "table", "_memwal", "region_values", f"{self.init_version:020d}",
                            f"{rid}.json")
        assert os.path.exists(path), (f"{what}: the region's value is in no inline MemWAL snapshot and has no "
                                      f"value record of this lifetime ({path})")
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        assert hashlib.sha256(doc["body"].encode()).hexdigest() == doc["sha256"], f"{what}: value record garbled"
        body = json.loads(doc["body"])
        rows = pa.ipc.open_stream(base64.b64decode(body["values"])).read_all().to_pylist()
        got = (body["region_id"], body["initialization"]["table_version"], body["region_spec_id"], rows)
        assert got == (rid, self.init_version, spec_id, [want]), (
            f"{what}: its value record holds (region, lifetime, spec, values) {got}, the model "
            f"{(rid, self.init_version, spec_id, [want])}")

    def check_gc_plan(self, plan: gc.GcPlan) -> None:
        """Every item the plan would delete is allowed by the spec, computed here from scratch:
        a generation only at or below merged progress at the latest and at the OLDEST retained
        base version, below every gating index's catch-up (a region missing from it counts 0),
        flushed, and (sharded tables) in a region whose value an inline MemWAL snapshot or the
        lifetime's durable record holds; a WAL
        entry only if covered by replay, not a fence sentinel, not the tail, not the current
        epoch's (when kept) and of a collectable generation no listed generation still needs;
        a manifest version only outside the newest `manifest_retention` and old enough; an
        orphan only if unlisted, below current_generation and older than the grace period."""
        cfg = plan.config
        now = time.time()
        ds = table.open_dataset(self.loc)
        state = table.read_memwal_state(self.loc, ds.version)
        indexes = [i["name"] for i in ds.list_indices()]
        gating = state.gating_indexes(indexes)
        retained = [int(i["version"]) for i in ds.versions()]
        merged_by_version = {v: self.merged_at(v) for v in retained}
        # A value is recorded for good in an inline snapshot or in the durable record of this
        # lifetime (`state/value_records.py`); an external snapshot is left behind by the next
        # commit that changes the MemWAL index (`region_values.unrecorded_regions`).
        inline = None
        if self.kind != "unsharded":
            inline = snapshot.recorded_values(self.loc, state) if state.details.HasField("inline_snapshots") else {}
        field_id = self.spec["fields"][0]["field_id"] if self.spec.get("fields") else None
        truth = {r: v for v, r in self.rids.items()}  # the model's value of each current region

        def allowed(rid: str) -> int:
            bounds = [state.merged.get(rid, 0)]
            bounds += [m.get(rid, 0) for m in merged_by_version.values() if m is not None]
            bounds += [state.catchup.get(name, {}).get(rid, 0) for name in gating]
            return min(bounds)

        referenced = None
        for item in plan.items:
            rid = item.region_id
            if item.kind == gc.LEAKED:  # a base-table file of a lost commit: no retained version uses it
                if referenced is None:
                    referenced = self.referenced_base_files(retained)
                for key in item.keys:
                    used = key.split("/")[1] if key.startswith("_indices/") else key.rsplit("/", 1)[-1]
                    assert used not in referenced, (
                        f"GC ORACLE: leaked-file item {key} is referenced by a retained base version")
                    age = now - os.stat(os.path.join(self.root, "table", key)).st_mtime
                    assert age >= cfg.leaked_grace - 1, f"GC ORACLE: leaked file {key} only {age:.0f} s old"
                continue
            m = self.latest_manifest(rid)
            assert m is not None, f"GC ORACLE: plan deletes {item.path} of region {rid} with no manifest"
            listed = {g.generation: g.path for g in m.generations}
            lim = allowed(rid)
            what = f"GC ORACLE: {item.kind} {item.path} (number {item.number}) of region {rid}"
            # A region written before the MemWAL initialization: nothing of it goes until it is
            # discarded (its files are the evidence); then its stale generations only at or below
            # the discard and the progress of versions from before the initialization (a time
            # travel to the old table still reads them), never this lifetime's generations.
            floor = self.floor.get(rid, 0)
            assert floor <= state.merged.get(rid, 0), (
                f"{what}: the region was written before the MemWAL initialization and is not discarded")
            stale_lim = min([state.merged.get(rid, 0)] + [mv.get(rid, 0) for v, mv in merged_by_version.items()
                                                          if mv is not None and v < self.init_version])
            if item.kind == gc.GENERATION and item.number <= floor:
                g = item.number
                assert g in listed and not m.sealed, f"{what}: not a listed stale generation"
                assert g <= stale_lim, f"{what}: stale generation {g} above {stale_lim} (discard, older lifetimes)"
                continue
            if item.kind == gc.GENERATION:
                g = item.number
                assert g in listed and g < m.current_generation and not m.sealed, f"{what}: not a flushed listed generation"
                assert g <= lim, (f"{what}: generation {g} above the allowed limit {lim} (merged {state.merged.get(rid, 0)}, "
                                  f"retained versions {sorted(merged_by_version)}, gating {gating}, catch-up "
                                  f"{ {n: state.catchup.get(n, {}).get(rid, 0) for n in gating} })")
                if inline is not None:
                    assert rid in truth, f"{what}: a region the model does not know the value of"
                    want = {field_id: truth[rid]}
                    if inline.get(rid) != want:
                        self.check_value_record(rid, m.message.region_spec_id, want, what)
            elif item.kind == gc.WAL:
                p = item.number
                e = wal.read_entry_meta(self.loc.store, rid, p)
                assert not e.fence_sentinel, f"{what}: a fence sentinel"
                assert p != max(self.wal_positions(rid)), f"{what}: the WAL tail"
                assert p <= m.message.replay_after_wal_entry_position, f"{what}: not covered by replay"
                if e.generation is not None and e.generation <= floor:
                    lim = stale_lim
                assert e.generation is not None and e.generation <= lim and e.generation < m.current_generation, (
                    f"{what}: entry of generation {e.generation}, allowed limit {lim}")
                assert e.generation not in listed or any(
                    i.kind == gc.GENERATION and i.region_id == rid and i.number == e.generation for i in plan.items), (
                    f"{what}: entry of generation {e.generation}, still listed and kept")
                if cfg.keep_current_epoch_wal:
                    assert e.writer_epoch != m.writer_epoch, f"{what}: the current writer epoch's entry"
            elif item.kind == gc.MANIFEST:
                v = item.number
                assert v <= m.version - cfg.manifest_retention, f"{what}: within the newest {cfg.manifest_retention}"
                age = now - os.stat(os.path.join(self.root, "table", item.path)).st_mtime
                assert age >= cfg.manifest_min_age_seconds - 1, f"{what}: only {age:.0f} s old"
            else:
                name = item.path.rsplit("/", 1)[-1]
                assert name not in listed.values(), f"{what}: listed"
                g = layout.generation_of_dir(name)
                assert g is not None and g < m.current_generation, f"{what}: not below current generation"
                assert not any(b.unlisted == name for b in self.bad.values()), f"{what}: the rows behind a manifest gap"
                d = os.path.join(self.root, "table", item.path)
                newest = max((os.stat(os.path.join(dp, f)).st_mtime for dp, _, fs in os.walk(d) for f in fs),
                             default=os.stat(d).st_mtime)
                assert now - newest >= cfg.orphan_grace_seconds - 1, f"{what}: only {now - newest:.0f} s old"

    def referenced_base_files(self, versions: list[int]) -> set[str]:
        """File names (data and deletion files) and index uuids every retained base version
        reads, through pylance's own metadata: independent of GC's manifest parsing."""
        names: set[str] = set()
        for v in versions:
            at = table.open_dataset(self.loc).checkout_version(v)
            names.update(str(i["uuid"]) for i in at.list_indices())
            for frag in at.get_fragments():
                names.update(f.path.rsplit("/", 1)[-1] for f in frag.data_files())
                d = frag.deletion_file()
                if d:
                    names.add(str(d).rsplit("/", 1)[-1])
        return names

    def merged_at(self, v: int) -> dict[str, int] | None:
        """merged progress recorded by base version v (None: no MemWAL index at v)."""
        if v not in self.version_merged:
            try:
                self.version_merged[v] = table.read_memwal_state(self.loc, v).merged
            except table.MemWalNotInitialized:
                self.version_merged[v] = None
        return self.version_merged[v]

    def crash(self, job: str, k: int) -> None:
        """The job in its own process, killed by SIGKILL right before its k-th write. It must die
        by that signal or finish: a job that exits with an error of its own is a failure, unless
        the only regions it reports are ones holding a planted bad generation."""
        if self.crashes >= 2:
            return
        self.count("crash")
        if job == "merge":
            # A merge crash starts a Spark JVM (~15 s): only for k == 6. Decided by the drawn
            # values alone, so that Hypothesis replays the same steps (no global counter).
            if k != 6:
                job = "gc"
            else:
                Stats.merge_crashes += 1
        self.crashes += 1
        env = {**os.environ, "MEMWAL_CRASH_AFTER_OPS": str(k), "MEMWAL_CRASH_SIGNAL": "1",
               "PYTHONPATH": os.pathsep.join([WORKTREE, os.environ.get("PYTHONPATH", "")])}
        p = subprocess.run([sys.executable, JOB, job, self.loc.lance_uri, "--budget", "3000"],
                           env=env, capture_output=True, text=True, timeout=300)
        self.deep = True
        if p.returncode == -9:
            did("crash_killed")
            return
        assert p.returncode in (0, 1), f"CRASH: {job} exited {p.returncode} (not by SIGKILL): {p.stderr[-3000:]}"
        out = json.loads(p.stdout.strip().splitlines()[-1])["result"]
        errors = out.get("region_errors") or out.get("errors") or {}
        bad_regions = {rid for rid, _ in self.bad} | self.undiscarded()
        assert p.returncode == 0 or (errors and set(errors) <= bad_regions), (
            f"CRASH: {job} failed by itself (exit {p.returncode}), errors {errors}: {p.stderr[-3000:]}")
        did("crash_finished")

    # ---------------------------------------------------------- the model
    def discover(self) -> None:
        """Record the rows of every generation that appeared since the last look."""
        for rid, known in self.gens.items():
            m = self.latest_manifest(rid)
            if m is None:  # the region has no manifest yet
                continue
            top = max(max(known, default=0), self.floor.get(rid, 0))  # stale ones are not this lifetime's
            for g in m.generations:
                if g.generation > top and g.generation not in known:
                    uri = self.loc.child_uri(layout.generation_dir(rid, g.path, g.generation))
                    known[g.generation] = lance.dataset(uri).to_table().to_pylist()

    def expected(self, upto: dict[str, int] | None) -> dict[int, dict]:
        state = dict(self.base0)
        for rid, gens in self.gens.items():
            for g in sorted(gens):
                if upto is None or g <= upto.get(rid, 0):
                    apply(state, gens[g])
        return state

    def held_keys(self) -> set[int]:
        return set().union(*(b.keys for b in self.bad.values())) if self.bad else set()

    @invariant()
    def invariants_hold(self) -> None:
        try:
            self.check_all()
        except AssertionError as e:
            raise AssertionError(self.traced(e)) from e

    def traced(self, e: AssertionError) -> str:
        """The failure with the steps that led to it, as run: Hypothesis prints the steps of its
        replay, and a replay of a machine driving real processes and threads may not fail again."""
        if "\nsteps of this state machine" in str(e):
            return str(e)
        steps = "\n".join(f"  {i}. {t}" for i, t in enumerate(self.trace, 1))
        return (f"{e}\nsteps of this state machine ({getattr(self, 'kind', '?')} table {getattr(self, 'root', '?')}), "
                f"in order:\n{steps}")

    def check_all(self) -> None:
        if self.loc is None:
            return
        self.discover()
        merged = self.merged()
        for rid, p in merged.items():
            last = self.last_merged.get(rid, 0)
            assert p >= last, f"PROGRESS REGRESSED: region {rid} {last} -> {p}"
            for g in range(last + 1, p + 1):
                if g <= self.floor.get(rid, 0):  # stale: passed by a discard only, never merged
                    assert self.discarded.get(rid) == self.floor[rid], (
                        f"STALE: region {rid} progress {p} passed generation {g}, written before the MemWAL "
                        f"initialization at version {self.init_version}, with no discard")
                    continue
                assert g in self.gens.get(rid, {}), f"WALL: region {rid} progress {p} passed unknown generation {g}"
                assert (rid, g) not in self.bad, (
                    f"WALL: region {rid} progress {p} passed bad generation {g} ({self.bad[(rid, g)].kind})")
        self.last_merged = dict(merged)
        assert checks.missing_generations(self.loc) == {}, "a listed generation is missing on disk"
        ds = table.open_dataset(self.loc)
        self.version_merged.setdefault(ds.version, dict(merged))
        base = {r["id"]: r for r in ds.to_table().to_pylist()}
        self.no_stale_rows(base, f"the base table (version {ds.version})", ds.version)
        want_base = self.expected(merged)
        assert base == want_base, diff("BASE", base, want_base)
        self.base_checked.add(ds.version)
        held = self.held_keys()
        try:
            lsm = {r["id"]: r for r in reader.lsm_table(self.loc).to_pylist()}
        except Exception:
            if any(b.kind in LSM_MAY_FAIL for b in self.bad.values()):
                lsm = None  # pylance cannot read a generation with other columns: nor can readers
            else:
                raise
        want = {k: v for k, v in self.expected(None).items() if k not in held}
        if lsm is not None:
            self.no_stale_rows(lsm, "memwal's LSM read", ds.version)
            got = {k: v for k, v in lsm.items() if k not in held}
            assert got == want, diff("LSM", got, want)
        self.check_versions(ds, merged, want, held)
        self.check_sealed()
        assert tree(os.path.join(self.root, "outside")) == self.outside, "something outside the table changed"
        assert set(os.listdir(self.root)) <= {"outside", "table", "scratch"}, "something appeared next to the table"
        self.broken = False

    def check_versions(self, ds, merged: dict[str, int], want: dict[int, dict], held: set[int]) -> None:
        """Every retained base version: its rows equal the model at its merged progress (once:
        a version never changes), and the LSM read at it (its base plus the generations above
        its merged progress) equals the model of everything flushed. The LSM reads cover every
        retained version after anything that deletes (GC, a crash, concurrent maintainers),
        else the oldest and the newest."""
        versions = sorted(int(i["version"]) for i in ds.versions())
        for v in versions:
            if v in self.base_checked:
                continue
            m = self.merged_at(v)
            got = {r["id"]: r for r in lance.dataset(self.loc.lance_uri, version=v).to_table().to_pylist()}
            self.no_stale_rows(got, f"retained version {v}", v)
            exp = self.expected(m or {})
            assert got == exp, diff(f"BASE at retained version {v}", got, exp)
            self.base_checked.add(v)
        # Versions of earlier lifetimes were read while they were current; their LSM reads are
        # of another table (the one the overwrite replaced).
        with_index = [v for v in versions if self.merged_at(v) is not None and v != ds.version
                      and v >= self.init_version]
        if not self.deep:
            with_index = with_index[:1]
        self.deep = False
        manifests = None
        seen = {tuple(sorted(merged.items()))}
        for v in with_index:
            m = self.merged_at(v)
            key = tuple(sorted(m.items()))
            if key in seen:
                continue  # same progress as a version read already: the same logical read
            seen.add(key)
            if manifests is None:  # without the stale generations (the model's boundary)
                manifests = {rid: lifecycle.without_stale(mf, lifecycle.RegionVerdict(rid, self.floor[rid], 0.0))
                             if rid in self.floor else mf
                             for rid in self.gens if (mf := self.latest_manifest(rid)) is not None}
            state = table.read_memwal_state(self.loc, v)
            try:
                rows = lsm_read(lance.dataset(self.loc.lance_uri, version=v), reader.pending_snapshots(state, manifests))
            except Exception as e:
                if any(b.kind in LSM_MAY_FAIL for b in self.bad.values()):
                    continue
                raise AssertionError(f"LSM read at retained version {v} failed: {type(e).__name__}: {e}") from e
            every = {r["id"]: r for r in rows.to_pylist()}
            self.no_stale_rows(every, f"the LSM read at retained version {v}", v)
            got = {k: r for k, r in every.items() if k not in held}
            assert got == want, diff(f"LSM at retained version {v} (merged {m})", got, want)
            did("old_version_read")

    def no_stale_rows(self, rows: dict[int, dict], where: str, version: int) -> None:
        """No row of a generation that was unmerged when the table was overwritten, at any
        version; no row of an earlier lifetime (base rows and generations) at a version of this
        one (the overwrite replaced them; only writes made since may bring a key back)."""
        got = {(k, r["s"]) for k, r in rows.items()}
        never = got & self.never_rows
        assert not never, f"STALE ROWS in {where}: {sorted(never)[:5]} were unmerged when the table was overwritten"
        if version >= self.init_version:
            old = got & self.old_rows
            assert not old, (f"STALE ROWS in {where}: {sorted(old)[:5]} are from before the MemWAL initialization "
                             f"at version {self.init_version}")

    def check_sealed(self) -> None:
        """A sealed region stays sealed at the manifest version that sealed it: memwal commits
        no manifest version after it (no GC trim, no WAL hint)."""
        for rid, version in self.sealed.items():
            vs = self.manifest_versions(rid)
            assert vs and vs[-1] == version, f"SEALED: region {rid} sealed at manifest version {version}, now {vs[-1:]}"

    def teardown(self) -> None:
        fact_segments.TAIL_MAX, fact_segments.TAIL_KEEP = self._tail
        if self.loc is None:
            return
        try:
            if self.broken:  # a step already failed: report that, not its consequences
                return
            for v in list(self.writers):
                self.close(v)
            if self.bad:  # one last merge against the walls: nothing may pass a bad generation
                self.run_merge(merge.DEFAULT_BUDGET_BYTES, merge.DEFAULT_MAX_GENERATIONS, False)
                self.check_all()
            for rid, g in sorted(self.bad):
                self.repair_one(rid, g)
            if self.floor:  # the operator's decision: the overwrite meant to replace those rows
                self.record_discards(lifecycle.discard(self.loc, None).discarded, "operator")
            self.check_all()
            for _ in range(2):
                self.run_merge(merge.DEFAULT_BUDGET_BYTES, merge.DEFAULT_MAX_GENERATIONS, False)
                self.check_all()
                if not merge.plan_merge(self.loc).batches:
                    break
            assert not merge.plan_merge(self.loc).batches, "FINAL: generations left unmerged after repair"
            base = {r["id"]: r for r in table.open_dataset(self.loc).to_table().to_pylist()}
            want = self.expected(None)
            assert base == want, diff("FINAL BASE", base, want)
        except AssertionError as e:
            raise AssertionError(self.traced(e)) from e
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def diff(what: str, got: dict, want: dict) -> str:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    changed = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    return (f"{what} differs from the model: missing keys {missing}, unexpected keys {extra}, "
            f"changed {[(k, got[k], want[k]) for k in changed[:5]]}")


def merged_result(res: merge.MergeResult) -> merge.MergeResult:
    if res.commits:
        did("merge_committed")
    did("merge_conflict_retried", res.conflicts)
    return res


def compacted(res: compaction.CompactionResult) -> compaction.CompactionResult:
    if res.fragments_removed:
        did("compaction_rewrote")
    if res.conflicts:
        did("compaction_conflict")
    if res.status.startswith("gave up"):
        did("compaction_gave_up")
    return res
