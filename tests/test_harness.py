"""The stateful randomized harness (tests/support/harness_machine.py says what it checks).

`make test` runs a bounded, seeded profile (MEMWAL_HARNESS_STEPS steps, default 1,000);
`make soak` (MEMWAL_SOAK=1, -m slow) a long one (default 100,000 steps). Shrunk failures
become the named regression tests at the end of this file.
"""

from __future__ import annotations

import os
import shutil
import time

from support import harness_machine as hm
import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import run_state_machine_as_test

SOAK = bool(os.environ.get("MEMWAL_SOAK"))


def _run(spark, tmp_path, steps: int, first_seed: int, per_example: int, examples: int) -> None:
    hm.Stats.reset()
    t0 = time.monotonic()
    s = first_seed
    # MEMWAL_HARNESS_NO_SHRINK=1 (make mutate): report the first failure as found, unshrunk.
    phases = [Phase.generate] if os.environ.get("MEMWAL_HARNESS_NO_SHRINK") else [Phase.generate, Phase.target,
                                                                                 Phase.shrink]
    try:
        while hm.Stats.steps < steps:
            machine = type("Machine", (hm.MemWalMachine,), {"spark": spark, "workdir": str(tmp_path)})
            print(f"harness seed {s} (steps so far {hm.Stats.steps})", flush=True)
            run_state_machine_as_test(seed(s)(machine), settings=settings(
                max_examples=examples, stateful_step_count=per_example, deadline=None, database=None,
                phases=phases, suppress_health_check=list(HealthCheck), print_blob=True))
            s += 1
    except BaseException:
        print(f"HARNESS FAILED after {hm.Stats.steps} steps (seed {s})", flush=True)
        raise
    finally:
        line = (f"harness: {hm.Stats.steps} steps, {hm.Stats.examples} state machines, {hm.Stats.merges} merges, "
                f"{hm.Stats.merge_crashes} merge crashes in {time.monotonic() - t0:.0f} s; seeds {first_seed}..{s}; "
                f"rules {dict(sorted(hm.Stats.rule_counts.items()))}; "
                f"did {dict(sorted(hm.Stats.did.items()))}")
        print(line, flush=True)
        hm.Stats.summary.append(line)
    # A harness that never merged, collected, compacted or read an older version proves nothing.
    missing = ALL_RULES - set(hm.Stats.rule_counts)
    assert not missing, f"rules never run: {sorted(missing)}"
    idle = EFFECTS - {k for k, n in hm.Stats.did.items() if n}
    assert not idle, f"never did: {sorted(idle)}"
    if hm.Stats.steps >= 1000:  # what 1,000 steps must reach at least (per 1,000 steps)
        short = {k: (hm.Stats.did.get(k, 0), n * hm.Stats.steps // 1000) for k, n in PER_1000_STEPS.items()
                 if hm.Stats.did.get(k, 0) < n * hm.Stats.steps // 1000}
        assert not short, f"too few (did, needed): {short}"


ALL_RULES = {"put", "overwrite", "delete", "flush", "reopen", "merge", "merge_transient", "plant_bad", "repair",
             "snapshot", "catchup", "gc", "crash", "stale_plan", "stale_execute", "compact", "race_compaction",
             "second_maintainer", "stale_hint", "fenced_writer", "plant_orphan", "add_index", "overwrite_reinit",
             "discard", "seal"}
EFFECTS = {"merge_committed", "gc_deleted_generation", "gc_deleted_orphan", "gc_deleted_wal", "compaction_rewrote",
           "old_version_read", "fenced_write_refused", "hint_stale_by_2+", "overwrite_reinit", "stale_region_refused",
           "stale_discarded", "stale_collected", "live_discard_refused", "sealed_claim_refused"}


# ~4 min when green; shrinking a failure may take 10 more. MEMWAL_HARNESS_TIMEOUT (0: none) for
# a loaded machine: `make mutate` runs without one (a timeout must not count as a kill).
PER_1000_STEPS = {"merge_committed": 50, "gc_deleted_generation": 20, "compaction_rewrote": 10,
                  "compaction_merge_conflict": 5, "old_version_read": 5, "overwrite_reinit": 3, "stale_discarded": 3}


@pytest.mark.timeout(int(os.environ.get("MEMWAL_HARNESS_TIMEOUT", 1800)))
def test_harness_bounded(spark, tmp_path):
    """The bounded profile: fixed seeds, >= 1,000 steps, 0 violations."""
    steps = int(os.environ.get("MEMWAL_HARNESS_STEPS", 1000)) if not SOAK else 1000
    _run(spark, tmp_path, steps, first_seed=int(os.environ.get("MEMWAL_HARNESS_SEED", 1)), per_example=40,
         examples=8)


@pytest.mark.slow
@pytest.mark.timeout(0)  # 100,000 steps: hours (about 5 steps/s on 2 cores)
@pytest.mark.skipif(not SOAK, reason="soak variant: run with MEMWAL_SOAK=1 (make soak)")
def test_harness_soak(spark, tmp_path):
    steps = int(os.environ.get("MEMWAL_HARNESS_STEPS", 100_000))
    _run(spark, tmp_path, steps, first_seed=int(os.environ.get("MEMWAL_HARNESS_SEED", int(time.time()))),
         per_example=80, examples=50)


# ---------------------------------------------------------------------------------------------
# Regression tests: shrunk (then hand-trimmed) failing examples, replayed step by step.
# Each runs the invariants after every step and the final "repair everything and merge".


@pytest.fixture
def machine(spark, tmp_path):
    made = []

    def make(kind: str) -> hm.MemWalMachine:
        cls = type("Machine", (hm.MemWalMachine,), {"spark": spark, "workdir": str(tmp_path)})
        m = cls()
        m.init_table(kind=kind)
        m.invariants_hold()
        made.append(m)
        return m

    yield make
    for m in made:
        shutil.rmtree(m.root, ignore_errors=True)


def steps(m: hm.MemWalMachine, *calls) -> None:
    """Run `(rule name, kwargs)` steps with the invariants after each, then the teardown checks."""
    for name, kw in calls:
        getattr(m, name)(**kw)
        m.invariants_hold()
    m.teardown()


def test_regression_unreadable_generation_in_a_later_batch_is_a_wall(machine):
    """Generation 2 unreadable during a merge whose batches hold one generation each: batch 3
    merged generation 3 and recorded progress 3, past the unmerged generation 2."""
    m = machine("unsharded")
    steps(m, ("put", {"keys": [1]}), ("flush", {"r": 0}), ("put", {"keys": [2]}), ("flush", {"r": 0}),
          ("put", {"keys": [3]}), ("flush", {"r": 0}),
          ("merge_with_unreadable_generation", {"pick": 1, "budget": 1, "max_gens": 1, "back_at": 0}))


def test_regression_wrong_typed_generation_fails_its_region_only(machine):
    """A generation whose `n` column is a string (not castable) made the whole merge raise
    (pyarrow concat / cast in the Spark task) instead of refusing that region."""
    m = machine("bucket_key")
    steps(m, ("put", {"keys": [1, 2, 3]}), ("flush", {"r": 0}), ("flush", {"r": 1}), ("flush", {"r": 2}),
          ("plant_bad", {"r": 0, "kind": "wrong_type", "n": 1}), ("put", {"keys": [1, 2, 3]}),
          ("reopen", {"r": 0}), ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": False}),
          ("merge", {"budget": 1, "max_gens": 1, "via_plan": True}))


def test_regression_tombstones_on_a_non_key_bucket_column(machine):
    """Deletes on a table bucketed on a non-key column carry NULL there; their
    generations must merge (routing applies to live rows only)."""
    m = machine("bucket_nonkey")
    steps(m, ("put", {"keys": [1, 2, 3]}), ("delete", {"keys": [1, 2], "whole_rows": False}), ("flush", {"r": 0}),
          ("flush", {"r": 1}), ("flush", {"r": 2}), ("merge", {"budget": 1, "max_gens": 1, "via_plan": False}),
          ("delete", {"keys": [3, 25], "whole_rows": True}), ("reopen", {"r": 0}), ("reopen", {"r": 1}), ("reopen", {"r": 2}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": True}))


def test_regression_unlisted_generation_behind_a_gap_survives_gc(machine):
    """A manifest skips generation g whose directory exists unlisted (a writer died between
    writing and listing it); GC with no grace took it as an orphan, so listing it later (the
    repair) pointed at nothing and its rows were gone."""
    m = machine("bucket_key")
    steps(m, ("put", {"keys": [1, 2, 3]}), ("flush", {"r": 0}), ("flush", {"r": 1}), ("flush", {"r": 2}),
          ("plant_bad", {"r": 0, "kind": "gap", "n": 2}),
          ("collect_garbage", {"keep": 1, "min_age": 0.0, "grace": 0.0, "base_retain": 1}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": False}),
          ("collect_garbage", {"keep": 1, "min_age": 0.0, "grace": 0.0, "base_retain": None}),
          ("repair", {"pick": 0}), ("merge", {"budget": 1, "max_gens": 1, "via_plan": True}))


def test_regression_misrouted_generation_after_gc_trimmed_the_merged_ones(machine):
    """Soak (seed 9003): GC trimmed a region's merged generations before any MemWAL index
    snapshot recorded its routing value; the merger then had nothing authoritative to check a
    generation whose rows all route to another region, took that generation's own value as the
    region's (first routed generation, unanimous, owner unknown) and merged it. GC now keeps a
    sharded region's merged generations until a snapshot records its value."""
    m = machine("bucket_key")
    steps(m, ("put", {"keys": [1, 2, 3, 4, 5, 6]}), ("flush", {"r": 0}), ("flush", {"r": 1}), ("flush", {"r": 2}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": False}), ("catch_up", {"named": False, "retrain": False}),
          ("collect_garbage", {"keep": 1, "min_age": 0.0, "grace": 0.0, "base_retain": 1}),
          ("plant_bad", {"r": 0, "kind": "misrouted_all", "n": 1}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": False}),
          ("build_snapshot", {"external": False, "hints": False}), ("catch_up", {"named": False, "retrain": False}),
          ("collect_garbage", {"keep": 1, "min_age": 0.0, "grace": 0.0, "base_retain": 1}),
          ("plant_bad", {"r": 1, "kind": "misrouted_all", "n": 1}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": True}))


def test_lifecycle_overwrite_reinit_discard_and_seal(machine):
    """The lifecycle rules end to end, with the invariants after every step: regions with
    merged and unmerged generations; the table overwritten and MemWAL initialized again; old
    region ids re-opened (their new generations wait behind the stale ones); a merge refuses
    the stale regions; a region of this lifetime named for a discard is refused; one stale
    region discarded by hand, the rest by GC's grace; GC collects the stale generations; a
    region sealed (its claim refused) still merges to the end."""
    m = machine("bucket_key")
    steps(m, ("put", {"keys": [1, 2, 3, 4, 5, 6]}), ("flush", {"r": 0}), ("flush", {"r": 1}), ("flush", {"r": 2}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": False}),
          ("put", {"keys": [1, 2, 3, 7, 8, 9]}), ("flush", {"r": 0}), ("flush", {"r": 1}), ("flush", {"r": 2}),
          ("overwrite_reinit", {"keys": [2, 3, 10], "reuse": True}),
          ("put", {"keys": [1, 11, 12]}), ("flush", {"r": 0}), ("flush", {"r": 1}), ("flush", {"r": 2}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": False}),
          ("discard_stale", {"mode": "dry", "pick": 0}), ("discard_stale", {"mode": "one", "pick": 0}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": True}),
          ("collect_garbage", {"keep": 1, "min_age": 0.0, "grace": 0.0, "base_retain": 1, "prep": "full",
                               "discard_after": 0.0}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": False}),
          ("put", {"keys": [13, 14, 15]}), ("seal_region", {"r": 1}), ("put", {"keys": [1, 2, 3, 4, 5, 6]}),
          ("flush", {"r": 0}), ("flush", {"r": 2}), ("discard_stale", {"mode": "live", "pick": 1}),
          ("collect_garbage", {"keep": 1, "min_age": 0.0, "grace": 0.0, "base_retain": 1, "prep": "full"}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": False}))
    assert m.discarded and m.sealed


def test_lifecycle_a_merge_planned_before_the_overwrite_runs_after_it(machine):
    """A merge planned in the old lifetime and executed after the overwrite and the new
    initialization (a slow scheduler, a run between its plan and its commits) must not bring
    the stale rows into the new table. Found by the harness (plan_for_later, overwrite_reinit,
    execute_stale_plan)."""
    m = machine("unsharded")
    for name, kw in [("put", {"keys": [1, 2, 3]}), ("flush", {"r": 0}), ("put", {"keys": [4, 5]}),
                     ("flush", {"r": 0}), ("plan_for_later", {"budget": 10**9, "max_gens": 4})]:
        getattr(m, name)(**kw)
        m.invariants_hold()
    plan = m.stale
    m.overwrite_reinit(keys=[1, 9], reuse=False)
    m.invariants_hold()
    m.stale = plan
    steps(m, ("execute_stale_plan", {"keep": False}))


def test_regression_a_hole_above_progress_refuses_the_whole_region(machine):
    """A manifest lists generations 1 and 3 above progress 0 (2 never listed): the merger must
    refuse the region whole and report it stuck. Merging generation 1 and stopping before the
    hole with a wall the next run retries hides a manifest that only a repair can fix."""
    m = machine("bucket_key")
    steps(m, ("put", {"keys": [1, 2, 3]}), ("flush", {"r": 0}), ("flush", {"r": 1}), ("flush", {"r": 2}),
          ("plant_bad", {"r": 0, "kind": "gap", "n": 1}),
          ("merge", {"budget": 10**9, "max_gens": 4, "via_plan": False}))
