"""What keeps one table's runs apart in any Dagster instance, not only in this repo's.

Every asset that commits to table T runs in the Dagster pool `memwal_T`. A pool serializes
runs only when the instance gives it a limit, and a Dagster instance has none by default (a
`dg dev` of one's own project, a deployment's dagster.yaml without `concurrency:`): a merge
and two maintenance runs of one table then run at once. So memwal ships the limit with the
package:

- **`POOL_LIMIT` (1)**: the sensor and the maintenance schedule of T give pool `memwal_T` this
  limit on their first evaluation when the instance has none for it (no explicit limit and no
  `concurrency.pools.default_limit`). A limit set by anyone else is never changed: raise it
  with `dagster instance concurrency set memwal_T N` or in the UI (Deployment > Concurrency).
  With Dagster's default op granularity a run starts and its steps wait for the slot; with
  `concurrency.pools.granularity: run` (this repo's dagster_home) the run waits in the queue.
- **A check at definitions load** (`warn_if_unlimited`): when the instance named by
  `DAGSTER_HOME` does not limit a table's pool yet, a warning says so and how to fix it.
- **The table lease** (`memwal_core/state/lease.py`) serializes the commits whatever Dagster
  does: across instances, `memwal maintain` and library callers; a step that finds the lease
  held past `lease.wait_seconds` is skipped, not failed. The pool only spares the wait.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger("memwal.pools")

POOL_LIMIT = 1  # runs of one table at a time (the pool's limit memwal sets when there is none)


@dataclass(frozen=True)
class PoolLimit:
    """How the instance limits one pool: `limit` None means not at all."""

    pool: str
    limit: int | None
    source: str  # "pool" (its own limit), "default" (the instance's default_limit), "none"


def pool_limits(instance, pools: Iterable[str]) -> list[PoolLimit]:
    """Each pool's limit in `instance`: its own, else the instance's default, else none."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return [PoolLimit(p, None, "none") for p in pools]
    own = {p.name: p.limit for p in storage.get_pool_limits()}
    default = instance.get_concurrency_config().pool_config.default_pool_limit
    out = []
    for p in pools:
        if p in own:
            out.append(PoolLimit(p, own[p], "pool"))
        elif default is not None:
            out.append(PoolLimit(p, default, "default"))
        else:
            out.append(PoolLimit(p, None, "none"))
    return out


def ensure_limit(instance, pool: str) -> bool:
    """Give `pool` the limit `POOL_LIMIT` when the instance does not limit it; True when set now.
    Never fails its caller (a sensor tick, a schedule): the lease still serializes the commits."""
    try:
        (got,) = pool_limits(instance, [pool])
        if got.limit is not None or not instance.event_log_storage.supports_global_concurrency_limits:
            return False
        instance.event_log_storage.set_concurrency_slots(pool, POOL_LIMIT)
    except Exception as e:  # noqa: BLE001 - reported; the table lease still holds
        log.warning("could not give pool %s a limit (%s); the table lease still serializes its commits", pool, e)
        return False
    log.info("pool %s had no limit in this Dagster instance: set to %d (one run of the table at a time)",
             pool, POOL_LIMIT)
    return True


def unlimited_message(pools: list[str], where: str) -> str:
    return (f"memwal: the Dagster instance {where} does not limit the pool(s) {', '.join(pools)}: runs of one "
            f"table (merge, maintenance) could run at once. Each table's sensor sets its pool to {POOL_LIMIT} on "
            "its first tick; to have it now, set `concurrency: {pools: {default_limit: 1}}` in dagster.yaml or run "
            f"`dagster instance concurrency set {pools[0]} {POOL_LIMIT}`. The table lease serializes the commits "
            "meanwhile (a second run waits, then skips its step).")


def warn_if_unlimited(pools: list[str]) -> list[str]:
    """At definitions load: warn when the instance of `DAGSTER_HOME` leaves a table's pool
    unlimited (returns those pools). Without DAGSTER_HOME the instance is not known here
    (`dg dev` then uses a temporary one, which the sensor limits on its first tick)."""
    home = os.environ.get("DAGSTER_HOME")
    if not home or not pools:
        return []
    try:
        from dagster import DagsterInstance

        with DagsterInstance.get() as instance:
            unlimited = [p.pool for p in pool_limits(instance, pools) if p.limit is None]
    except Exception as e:  # noqa: BLE001 - a check, never a reason not to load
        log.info("pool limits not checked (DAGSTER_HOME=%s: %s)", home, e)
        return []
    if unlimited:
        log.warning("%s", unlimited_message(unlimited, f"at DAGSTER_HOME={home}"))
    return unlimited
