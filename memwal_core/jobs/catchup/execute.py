"""Execute a catch-up plan: `optimize_indices` per planned index, then the recorded catch-up
read back (Lance records it in the same commit; this service never writes it)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from memwal_core.errors import one_line
from memwal_core.options import CatchupOptions
from memwal_core.state import lease, table
from memwal_core.state.store import TableLocation

from .indexes import region_progress, unindexed_rows
from .plan import CatchupPlan, IndexPlan, plan_catchup
from .result import CatchupResult, IndexOutcome

log = logging.getLogger("memwal.catchup")


def _kwargs(kw: dict[str, Any], ip: IndexPlan) -> dict[str, Any]:
    """`optimize_indices`'s arguments for one index: `retrain` never for an index the MemTables
    maintain (the spec keeps its centroids and codebooks once MemWAL is enabled: a retrained
    model's distances no longer compare with the MemTables' index)."""
    if kw.get("retrain") and ip.gating:
        log.warning("index %s: not retrained (the MemTables maintain it); caught up with its model kept", ip.name)
        return {**kw, "retrain": False}
    return kw


@lease.step("catchup")
def execute_catchup(loc: TableLocation, plan: CatchupPlan | None = None, **overrides: Any) -> CatchupResult:
    """Run `optimize_indices` for each planned index, then read the recorded catch-up back.

    The plan's options rule (`overrides`: CatchupOptions fields, e.g. `retrain=True`). One
    failing index is reported in its outcome and does not stop the others.
    """
    t0 = time.monotonic()
    plan = plan or plan_catchup(loc)
    options = replace(plan.options, **overrides) if overrides else plan.options
    kw: dict[str, Any] = {"retrain": options.retrain}
    if options.num_indices_to_merge is not None:
        kw["num_indices_to_merge"] = options.num_indices_to_merge
    pending: list[tuple[IndexPlan, bool, str | None, int | None]] = []
    for ip in plan.indexes:
        before = ip.unindexed_rows
        error = None
        optimize = ip.optimize
        if optimize:
            ds = table.open_dataset(loc)
            before = unindexed_rows(ds, ip.name)
            if before == 0 and all(r.caught_up for r in region_progress(
                    table.read_memwal_state(loc, ds.version), ip.name)):
                # An earlier rebuild's commit recorded this index too (Lance derives catch-up
                # for every index that covers all fragments): nothing left to do.
                log.info("index %s: caught up by an earlier commit, skipped", ip.name)
                optimize = False
        if optimize:
            try:
                lease.fence(loc, f"index {ip.name} catch-up")
                ds.optimize.optimize_indices(index_names=[ip.name], **_kwargs(kw, ip))
                log.info("index %s optimized (%s)", ip.name, ip.reason)
            except Exception as e:  # noqa: BLE001
                error = one_line(e)
                log.warning("index %s: optimize_indices failed: %s", ip.name, error)
        pending.append((ip, optimize, error, before))

    ds = table.open_dataset(loc)
    state = table.read_memwal_state(loc, ds.version)
    outcomes = []
    for ip, optimized, error, before in pending:
        regions = region_progress(state, ip.name)
        outcomes.append(IndexOutcome(ip.name, ip.index_type, ip.gating, optimized and error is None,
                                     error, before, unindexed_rows(ds, ip.name), regions))
        lag = [r for r in regions if not r.caught_up]
        if lag and error is None:
            log.info("index %s still behind in %d region(s) (merges landed during the rebuild?)",
                     ip.name, len(lag))
    return CatchupResult(plan, outcomes, ds.version, time.monotonic() - t0,
                         missing_gating=list(plan.missing_gating))


@lease.step("catchup")
def run_catchup(loc: TableLocation, index_names: list[str] | None = None, options: CatchupOptions | None = None,
                **overrides: Any) -> CatchupResult:
    """Plan and execute in one call (`overrides`: CatchupOptions fields over `options`)."""
    options = options or CatchupOptions()
    return execute_catchup(loc, plan_catchup(loc, index_names, replace(options, **overrides) if overrides else options))
