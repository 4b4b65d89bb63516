"""`memwal status`: per-region lag (a table: `tables.py`), index gaps, what GC keeps, stuck and
blocked regions."""

from __future__ import annotations

import os

from .output import print_json, say
from .tables import Column, print_table
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

    from memwal_pipeline.partitions import RegionLabels

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
    labels = RegionLabels.of(loc)  # each region's value (`bucket=2`), from the MemWAL index snapshot
    if as_json:
        print_json({**st.to_dict(), "region_values": {r.region_id: labels.label(r.region_id) for r in st.regions},
                    "stuck": [s.__dict__ for s in stuck],
                    "merge_blockers": [b.to_dict() for b in blocked],
                    "gc_holds": [h.__dict__ | {"text": h.describe()} for h in holds]})
        return bad
    print(f"table {st.table} (version {st.table_version}): {len(st.regions)} regions, "
          f"{st.pending_generations} pending generations", flush=True)
    print_table(REGION_COLUMNS, [_row(r, labels.label(r.region_id)) for r in st.regions if not r.error])
    for r in st.regions:  # after the table: an error is one line, not a row of cells
        if r.error:
            print(f"{r.region_id}  error: {r.error} (region value: {labels.label(r.region_id)})")
    for i in st.indexes:
        print(f"index {i.name}: max gap {i.max_gap} generations{' (gates GC)' if i.gating else ''}")
    for h in holds:
        print(f"GC keeps {h.describe()}")
    for s in stuck:
        print(f"STUCK {s.describe(labels.label(s.region_id))}")
    for b in blocked:
        print(f"MERGE BLOCKED ({b.kind}): {b.message}")
    return bad


# `lag`: age of the region's oldest unmerged generation (what merge_lag and the SLO measure).
REGION_COLUMNS = (Column("region", min_width=36), Column("value", max_width=24), Column("manifest", right=True),
                  Column("epoch", right=True), Column("merged", right=True), Column("pending", right=True),
                  Column("rows", right=True), Column("lag", right=True))


def _row(r, value: str) -> list[str]:
    return [r.region_id, value, str(r.manifest_version), str(r.writer_epoch), str(r.merged_generation),
            str(len(r.pending_generations)), str(r.pending_rows), _age(r.oldest_pending_age_s)]


def _age(seconds: float | None) -> str:
    """A lag as one short figure: 42s, 12m, 3.5h, 2.1d ("-": nothing pending)."""
    if seconds is None:
        return "-"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f}{unit}" if seconds < 10 * n else f"{seconds / n:.0f}{unit}"
    return f"{seconds:.0f}s"


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
