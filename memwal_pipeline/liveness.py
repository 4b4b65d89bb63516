"""The manifest sensor's memory of each region, and when a region gets another merge run.

Why not the sensor cursor: Dagster stores the cursor with every tick, so one version per region
there costs ~46 bytes × regions per tick, forever (138 KB per tick at 3,000 regions). The
per-region state lives instead in the instance's key-value store (`run_storage` cursor values),
in `SHARDS` rows of JSON keyed by a hash of the region id; a tick rewrites only the rows whose
regions changed, so an unchanged table costs one row update (the tick record). The cursor keeps
an epoch (naming the state, so resetting the cursor in the UI starts from scratch), the
maintenance watermark and a digest of the state.

Retry policy (contract 5, nothing waits forever): a region whose merged progress stayed at the
same generation gets at most `max_attempts` merge requests, each after a backoff doubling from
the sensor interval; a request while a merge run covering the region is queued or running is
never made. Progress moving resets the count. After the cap the region is *stuck*: no more
automatic runs, an error in the sensor log, an observation, and an entry in
`stuck_regions(instance, table)` for the checks, until its progress moves (a manual merge of
its partition, after the repair).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, replace
from typing import Any, Iterable

SHARDS = 64


@dataclass(frozen=True)
class RegionState:
    version: int = 0          # manifest version last read
    top: int = 0              # newest flushed generation that manifest lists (0: none)
    sealed: bool = False
    base: int = 0             # merged progress last seen; attempts count against it
    attempts: int = 0         # merge requests made while progress stayed at `base`
    last_request: float = 0.0
    stuck_since: float = 0.0  # 0: not stuck
    retired: bool = False     # sealed, merged and caught up: partition deleted

    def encode(self) -> list:
        return [self.version, self.top, int(self.sealed), self.base, self.attempts, int(self.last_request),
                int(self.stuck_since), int(self.retired)]

    @classmethod
    def decode(cls, raw: list) -> "RegionState":
        v, top, sealed, base, attempts, last, stuck, retired = (list(raw) + [0] * 8)[:8]
        return cls(int(v), int(top), bool(sealed), int(base), int(attempts), float(last), float(stuck), bool(retired))

    @property
    def pending(self) -> bool:
        """Generations above the progress last seen (merged only grows, so `False` is final)."""
        return self.top > self.base


def shard_of(region_id: str) -> int:
    return zlib.crc32(region_id.encode()) % SHARDS


def _prefix(table: str) -> str:
    return f"memwal/{table}/sensor"


class SensorState:
    """Per-region state of one table's sensor, in `instance.run_storage`'s key-value rows."""

    def __init__(self, instance, table: str, epoch: str):
        self.instance, self.table, self.epoch = instance, table, epoch
        self.regions: dict[str, RegionState] = {}
        self.last_tick: float | None = None
        self.ticks = 0
        self._stored: dict[str, str] = {}

    def _key(self, shard: int | str) -> str:
        return f"{_prefix(self.table)}/{self.epoch}/{shard}"

    @classmethod
    def load(cls, instance, table: str, epoch: str) -> "SensorState":
        st = cls(instance, table, epoch)
        keys = {st._key(i) for i in range(SHARDS)} | {st._key("tick"), _stuck_key(table)}
        st._stored = dict(instance.run_storage.get_cursor_values(keys))
        for key, raw in st._stored.items():
            if key == _stuck_key(table):
                continue
            try:
                data = json.loads(raw)
                if key.endswith("/tick"):
                    st.last_tick, st.ticks = float(data["t"]), int(data["n"])
                else:
                    st.regions.update({rid: RegionState.decode(v) for rid, v in data.items()})
            except (ValueError, TypeError, KeyError, AttributeError):
                # A damaged row only costs a re-check: its regions are probed as new (from
                # their hints) and their retry counts start over; the row is rewritten.
                continue
        return st

    def get(self, region_id: str) -> RegionState | None:
        return self.regions.get(region_id)

    def forget(self, region_ids: Iterable[str]) -> None:
        for rid in region_ids:
            self.regions.pop(rid, None)

    def _rows(self) -> dict[str, str]:
        shards: dict[int, dict[str, list]] = {}
        for rid, st in self.regions.items():
            shards.setdefault(shard_of(rid), {})[rid] = st.encode()
        rows = {self._key(i): json.dumps(shards.get(i, {}), separators=(",", ":"), sort_keys=True)
                for i in range(SHARDS)}
        return {k: v for k, v in rows.items() if v != "{}" or k in self._stored}

    def stuck(self) -> dict[str, dict[str, Any]]:
        return {rid: {"generation": st.base + 1, "attempts": st.attempts, "since": int(st.stuck_since)}
                for rid, st in sorted(self.regions.items()) if st.stuck_since and not st.retired}

    def save(self, now: float) -> str:
        """Write the rows that changed and the tick record; returns a digest of the state."""
        all_rows = self._rows()
        h = hashlib.sha1()
        for k, v in sorted(all_rows.items()):
            h.update(k.encode() + b"=" + v.encode() + b";")
        rows = {k: v for k, v in all_rows.items() if self._stored.get(k) != v}
        rows[self._key("tick")] = json.dumps({"t": round(now, 3), "n": self.ticks + 1})
        stuck = json.dumps(self.stuck(), separators=(",", ":"), sort_keys=True)
        if self._stored.get(_stuck_key(self.table), "{}") != stuck:
            rows[_stuck_key(self.table)] = stuck
        # set_cursor_values cannot mix new and existing keys (the insert fails as a whole and
        # the update only touches existing rows), so write the two kinds separately.
        new = {k: v for k, v in rows.items() if k not in self._stored}
        old = {k: v for k, v in rows.items() if k in self._stored}
        for part in (new, old):
            if part:
                self.instance.run_storage.set_cursor_values(part)
        self._stored.update(rows)
        return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# Retry policy

REQUEST, IN_FLIGHT, BACKOFF, STUCK = "request", "in_flight", "backoff", "stuck"


@dataclass(frozen=True)
class RetryPolicy:
    interval_s: float
    max_attempts: int = 6
    max_backoff_s: float = 3600.0

    def backoff(self, attempts: int) -> float:
        """Wait after the `attempts`-th request before the next: interval, 2×, 4×, … capped."""
        return min(self.max_backoff_s, self.interval_s * 2 ** max(0, attempts - 1))

    def decide(self, st: RegionState, now: float, in_flight: bool) -> str:
        """For a region with pending generations: request a run now, or why not."""
        if in_flight:
            return IN_FLIGHT
        if st.attempts and now - st.last_request < self.backoff(st.attempts):
            return BACKOFF
        if st.attempts >= self.max_attempts:
            return STUCK
        return REQUEST


def observe_progress(st: RegionState, merged: int) -> RegionState:
    """The region's state with its merged progress recorded: when it moved, attempts and stuck
    start over."""
    if merged == st.base:
        return st
    return replace(st, base=merged, attempts=0, last_request=0.0, stuck_since=0.0)


def verify_this_tick(region_id: str, tick: int, every: int) -> bool:
    """The rotating slice of regions whose cursor version is re-checked against the hint."""
    return zlib.crc32(region_id.encode()) % every == tick % every


# ------------------------------------------------------------------------------------------
# What the checks and the CLI read


def _stuck_key(table: str) -> str:
    return f"{_prefix(table)}/stuck"


def stuck_regions(instance, table: str) -> dict[str, dict[str, Any]]:
    """Regions the sensor gave up on: region id -> {"generation": first unmerged generation,
    "attempts": merge runs requested without progress, "since": unix time it became stuck}.
    One key-value read; empty when nothing is stuck (or the sensor never ran)."""
    raw = instance.run_storage.get_cursor_values({_stuck_key(table)}).get(_stuck_key(table))
    return json.loads(raw) if raw else {}

