"""`memwal regions discard`: stale regions' generations recorded as handled, never merged."""

from __future__ import annotations

from .output import CliError, print_json, say
from .target import target


def cmd_regions_discard(a) -> int:
    """Discard the stale generations of regions whose data predates the MemWAL initialization
    (`memwal_core/state/lifecycle.py`): their rows are never merged; GC then collects them."""
    from memwal_core.state import layout, lease, lifecycle
    from memwal_core.state.store import open_store

    targets = list(a.targets)
    a.uri = None if a.config is not None or not targets else targets.pop(0)
    bad = [r for r in targets if not layout.is_region_id(r)]
    if bad:
        raise CliError(f"not a region id (UUID): {', '.join(bad)}")
    if bool(targets) == a.all:
        raise CliError("name the regions to discard (REGION ...) or give --all (every stale region), not both")
    cfg, secrets = target(a)
    loc = open_store(cfg.uri, {**cfg.storage_options, **secrets})
    try:  # holds the table's lease: waits up to lease.wait_seconds (--lease-wait) for a running maintainer
        out = lifecycle.discard(loc, None if a.all else targets, dry_run=a.dry_run, lease=cfg.lease)
    except lease.LeaseHeld as e:
        raise CliError(f"nothing discarded: table {loc.lance_uri} is held by {e.record.describe()}; run again "
                       "when that maintainer is done (or wait longer: --lease-wait SECONDS)") from None
    if a.json:
        print_json({"table": loc.lance_uri, "dry_run": out.dry_run, "discarded": out.discarded,
                    "refused": out.refused, "table_version": out.table_version})
    else:
        verb = "would discard" if a.dry_run else "discarded"
        for rid, g in sorted(out.discarded.items()):
            print(f"{verb} region {rid}: generations through {g} (never merged; GC collects them)")
        if not out.discarded and not out.refused:
            print("no stale region to discard")
        if out.discarded and not a.dry_run:
            print(f"table version {out.table_version}; to collect now: memwal maintain {cfg.uri} --only gc")
    for rid, why in sorted(out.refused.items()):
        say(f"error: {why}" if why.startswith("region ") else f"error: region {rid}: {why}")
    return 1 if out.refused else 0
