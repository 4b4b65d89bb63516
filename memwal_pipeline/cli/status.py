"""`memwal status`: per-region lag, index gaps, what GC keeps, stuck and blocked regions."""

from __future__ import annotations

import os

from .output import print_json, say
from .target import target


def cmd_status(a) -> int:
    cfg, secrets = target(a)
    return print_status(cfg.uri, {**cfg.storage_options, **secrets}, as_json=a.json)


def print_status(uri: str, storage_options: dict[str, str] | None = None, *, as_json: bool = False) -> int:
    """`memwal status` for a table already resolved (the demos call it after their pass):
    per-region lag, index gaps, what GC keeps; 1 when a region is in error or stuck."""
    from memwal_core.jobs import gc
    from memwal_core.observe import blockers, status
    from memwal_core.state.store import open_store

    loc = open_store(uri, storage_options or {})
    st = status.table_status(loc)
    stuck = _stuck(st)
    try:
        holds = gc.plan_gc(loc, gc.GcOptions(collect_leaked_files=False)).holds  # holds only: no file scan
    except Exception as e:  # noqa: BLE001 - status still shows the lag
        holds = []
        say(f"warning: GC plan failed: {e}")
    try:
        blocked = blockers.merge_blockers(loc)
    except Exception as e:  # noqa: BLE001 - status still shows the lag
        blocked = []
        say(f"warning: merge blockers not checked: {e}")
    bad = 1 if (st.region_errors or stuck or blocked) else 0
    if as_json:
        print_json({**st.to_dict(), "stuck": [s.__dict__ for s in stuck],
                    "merge_blockers": [b.to_dict() for b in blocked],
                    "gc_holds": [h.__dict__ | {"text": h.describe()} for h in holds]})
        return bad
    print(f"table {st.table} (version {st.table_version}): {len(st.regions)} regions, "
          f"{st.pending_generations} pending generations")
    print(f"{'region':36}  {'manifest':>8}  {'epoch':>5}  {'merged':>6}  {'pending':>7}  {'rows':>8}  {'oldest':>8}")
    for r in st.regions:
        if r.error:
            print(f"{r.region_id:36}  error: {r.error}")
            continue
        age = f"{r.oldest_pending_age_s:.0f}s" if r.oldest_pending_age_s is not None else "-"
        print(f"{r.region_id:36}  {r.manifest_version:>8}  {r.writer_epoch:>5}  {r.merged_generation:>6}  "
              f"{len(r.pending_generations):>7}  {r.pending_rows:>8}  {age:>8}")
    for i in st.indexes:
        print(f"index {i.name}: max gap {i.max_gap} generations{' (gates GC)' if i.gating else ''}")
    for h in holds:
        print(f"GC keeps {h.describe()}")
    for s in stuck:
        print(f"STUCK {s.describe()}")
    for b in blocked:
        print(f"MERGE BLOCKED ({b.kind}): {b.message}")
    return bad


def _stuck(st) -> list:
    """Stuck regions as recorded by failed merge runs in the Dagster instance of `DAGSTER_HOME`
    (the daemon's); none without one."""
    if not os.environ.get("DAGSTER_HOME"):
        return []
    from dagster import DagsterInstance

    from ..failures import recent_failures, stuck_regions

    merged = {r.region_id: r.merged_generation for r in st.regions}
    try:
        with DagsterInstance.get() as instance:
            return stuck_regions(recent_failures(instance, regions=merged), merged)
    except Exception as e:  # noqa: BLE001 - no usable instance: say so, show the table anyway
        say(f"warning: cannot read merge failures from DAGSTER_HOME: {e}")
        return []
