"""The stateful randomized harness of issue #13 (tests/harness_machine.py says what it checks).

`make test` runs a bounded, seeded profile (MEMWAL_HARNESS_STEPS steps, default 1,000);
`make soak` (MEMWAL_SOAK=1, -m slow) a long one (default 100,000 steps). Shrunk failures
become the named regression tests at the end of this file.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import run_state_machine_as_test

import harness_machine as hm

SOAK = bool(os.environ.get("MEMWAL_SOAK"))


def _run(spark, tmp_path, steps: int, first_seed: int, per_example: int, examples: int,
         merge_crashes: int) -> None:
    hm.Stats.steps = hm.Stats.examples = hm.Stats.merges = hm.Stats.merge_crashes = 0
    hm.Stats.rule_counts = {}
    t0 = time.monotonic()
    s = first_seed
    while hm.Stats.steps < steps:
        machine = type("Machine", (hm.MemWalMachine,), {"spark": spark, "workdir": str(tmp_path),
                                                        "merge_crash_cap": merge_crashes})
        print(f"harness seed {s} (steps so far {hm.Stats.steps})", flush=True)
        run_state_machine_as_test(seed(s)(machine), settings=settings(
            max_examples=examples, stateful_step_count=per_example, deadline=None, database=None,
            phases=[Phase.generate, Phase.target, Phase.shrink],
            suppress_health_check=list(HealthCheck), print_blob=True))
        s += 1
    print(f"harness: {hm.Stats.steps} steps, {hm.Stats.examples} state machines, {hm.Stats.merges} merges, "
          f"{hm.Stats.merge_crashes} merge crashes in {time.monotonic() - t0:.0f} s; seeds {first_seed}..{s - 1}; "
          f"rules {dict(sorted(hm.Stats.rule_counts.items()))}", flush=True)


def test_harness_bounded(spark, tmp_path):
    """The bounded profile: fixed seeds, >= 1,000 steps, 0 violations."""
    steps = int(os.environ.get("MEMWAL_HARNESS_STEPS", 1000)) if not SOAK else 1000
    _run(spark, tmp_path, steps, first_seed=int(os.environ.get("MEMWAL_HARNESS_SEED", 1)), per_example=40,
         examples=8, merge_crashes=1)


@pytest.mark.slow
@pytest.mark.skipif(not SOAK, reason="soak variant: run with MEMWAL_SOAK=1 (make soak)")
def test_harness_soak(spark, tmp_path):
    steps = int(os.environ.get("MEMWAL_HARNESS_STEPS", 100_000))
    _run(spark, tmp_path, steps, first_seed=int(os.environ.get("MEMWAL_HARNESS_SEED", int(time.time()))),
         per_example=80, examples=50, merge_crashes=steps // 2000)
