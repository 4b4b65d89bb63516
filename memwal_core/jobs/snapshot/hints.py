"""WAL-position hints: the index builder raises a region's `wal_entry_position_last_seen` to the
WAL tail it observes, so a writer that opens the region replays from close to the tail.

Reading the tail is the plan's (`probe_hint`), committing the raised hint the execution's
(`raise_hint`): a dry run or a plan can look without writing.
"""

from __future__ import annotations

import logging

from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import region, wal
from memwal_core.state.store import TableLocation

log = logging.getLogger("memwal.snapshot")


def hint_mutation(observed: int) -> region.Mutation:
    """A manifest change that raises only `wal_entry_position_last_seen`, only upwards."""

    def mutate(msg: pb.RegionManifest) -> bool:
        if msg.wal_entry_position_last_seen >= observed:
            return False
        msg.wal_entry_position_last_seen = observed
        return True

    return mutate


def probe_hint(loc: TableLocation, m: region.RegionManifest) -> tuple[int | None, str | None]:
    """(WAL position observed beyond the region's hint or None, error of a failed probe).

    A sealed region has none: its last manifest version stays the last one (writers never
    come back)."""
    if m.sealed:
        return None, None
    old = m.message.wal_entry_position_last_seen
    try:
        observed = wal.probe_tail(loc.store, m.region_id, old + 1)
    except Exception as e:  # noqa: BLE001 - best effort
        log.info("region %s: WAL tail probe failed (%s)", m.region_id, e)
        return None, f"WAL probe: {type(e).__name__}: {e}"
    return (observed if observed > old else None), None


def raise_hint(loc: TableLocation, m: region.RegionManifest, observed: int, *, max_attempts: int = 10
               ) -> tuple[region.RegionManifest, tuple[int, int] | None, str | None]:
    """Commit the hint `observed` on top of `m` (best effort).

    Returns (latest manifest known, (old, new) if committed, error if the commit failed).
    Raises `region.ManifestGap`: not a hint problem, the manifest read is stale and the region
    cannot be snapshotted."""
    old = m.message.wal_entry_position_last_seen
    try:
        committed = region.commit_next(loc.store, m, hint_mutation(observed), max_attempts=max_attempts)
    except region.ManifestGap:
        raise
    except Exception as e:  # noqa: BLE001 - best effort: log and carry on with what we read
        log.info("region %s: WAL hint not raised to %d (%s)", m.region_id, observed, e)
        return m, None, f"{type(e).__name__}: {e}"
    if committed is not None:
        return committed, (old, observed), None
    # Someone (a flushing writer) already committed a hint >= observed: show their version.
    try:
        return region.load_latest(loc.store, m.region_id, start=m.version), None, None
    except Exception:  # noqa: BLE001
        return m, None, None


def refresh_hint(loc: TableLocation, m: region.RegionManifest, *, max_attempts: int = 10
                 ) -> tuple[region.RegionManifest, tuple[int, int] | None, str | None]:
    """Probe the WAL tail after the hint; commit a raised hint where the tail is newer
    (`raise_hint`'s returns)."""
    observed, error = probe_hint(loc, m)
    if observed is None:
        return m, None, error
    return raise_hint(loc, m, observed, max_attempts=max_attempts)
