"""A failed merge-commit verification: its permanent stop is crash-safe and stops only the
regions whose keys are wrong.

A commit that fails verification has already recorded its regions' progress; the merger then
stops them with a permanent wall. Were that wall kept only in the run's memory until the run
ended (`Walls.record` after the last batch), a merger killed in a later batch (SIGKILL, OOM, a
node lost, or any exception escaping a batch) would never write it, and the next run would
merge the region on over the wrong rows, the evidence lost. The record is written at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import lance
from support.walls import append_behind_memwal, two_regions_pending

from memwal_core.jobs import merge
from memwal_core.state import layout, table, walls
from memwal_core.tools import demo

PROCS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "procs")


def test_a_failed_verification_keeps_its_region_stopped_after_the_merger_is_killed(table_loc, spark):
    loc = table_loc
    demo.create_table(loc, sharding="bucket", num_buckets=2, base_rows=20)
    w = demo.Workload(loc, seed=3, key_space=20, max_memtable_rows=10)
    w.write_round(40, overwrite=0.0, delete=0.0)
    assert not merge.merge(loc, spark).region_errors
    for _ in range(3):
        w.write_round(40, overwrite=0.5, delete=0.0)
    plan = merge.plan_merge(loc, budget_bytes=1)  # one batch per generation, regions in turn
    first = plan.batches[0].generations[0]
    bad = first.region_id
    assert len(plan.pending[bad]) >= 2, plan.pending  # something left to merge over the wrong rows
    assert len(plan.batches) >= 2 and any(g.region_id != bad for b in plan.batches[1:] for g in b.generations)
    # Region `bad`'s first pending keys once more, straight into the base table (behind memwal's
    # back): its first commit then holds them twice and fails verification; the other region is clean.
    gen = lance.dataset(loc.child_uri(layout.generation_dir(bad, first.path, first.generation)))
    append_behind_memwal(loc, sorted(set(gen.to_table(columns=["id"]).column("id").to_pylist())))
    before = table.read_memwal_state(loc).merged.get(bad, 0)

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MEMWAL_")},
           "MEMWAL_PAUSE_AT": "merge.after_commit", "MEMWAL_PAUSE_SECONDS": "3"}
    p = subprocess.Popen([sys.executable, os.path.join(PROCS, "merge_proc.py"), loc.lance_uri, "--budget", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pauses, tail = 0, []
    try:
        for line in p.stderr:
            tail.append(line)
            if "memwal paused at merge.after_commit" in line:
                pauses += 1
                if pauses == 2:  # the second commit: the first one's verification failed before it
                    os.kill(p.pid, signal.SIGKILL)
                    break
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=60)
    assert pauses == 2, "".join(tail[-40:])
    assert any(merge.COMMIT_CHECK_FAILED in line for line in tail) or "keys present more than once" in "".join(tail), \
        "".join(tail[-40:])
    stopped_at = table.read_memwal_state(loc).merged.get(bad, 0)
    assert stopped_at > before  # the bad commit recorded its progress (verification runs after it)

    again = merge.merge(loc, spark)  # the next run (the crashed one's lease holder is dead: taken over)
    recorded = walls.read_all(loc.store)
    assert table.read_memwal_state(loc).merged.get(bad, 0) == stopped_at, (
        f"region {bad} merged on past its failed verification: merged {stopped_at} -> "
        f"{table.read_memwal_state(loc).merged.get(bad, 0)}; wall records {sorted(recorded)}; "
        f"result {json.dumps(again.to_dict())[:500]}")


def test_a_failed_verification_stops_only_the_regions_whose_keys_are_wrong(table_loc, spark):
    """Duplicates only among region A's keys (written behind memwal's back); A and B merge in
    one commit. The check names the keys and the rows' origins name their region: A is walled
    for good, B (all its rows as planned) is not, and merges on in the next run."""
    loc = table_loc
    w, bad, good, keys = two_regions_pending(loc, spark)
    append_behind_memwal(loc, sorted(keys))
    result = merge.merge(loc, spark)
    assert bad in result.stuck_regions
    assert good not in result.stuck_regions, result.stuck_regions[good]
    assert good not in result.region_errors and result.regions[good].generations_merged
    assert set(walls.read_all(loc.store)) == {bad}
    stopped = table.read_memwal_state(loc).merged
    w.write_round(40, overwrite=0.5, delete=0.0)
    again = merge.merge(loc, spark)
    assert set(again.stuck_regions) == {bad}
    after = table.read_memwal_state(loc).merged
    assert after[bad] == stopped[bad] and after[good] > stopped[good]
