"""What one sensor tick saw, as plain frozen data: the input of `decide`.

`observe` fills these from the object store, the table and the Dagster instance; `decide` reads
them and nothing else, so every rule of the tick can be tested by building them by hand. No
Dagster import here, nor in `decide` (`tests/test_sensor_decide.py` checks both).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memwal_pipeline.liveness import RegionState


@dataclass(frozen=True)
class Cursor:
    """The sensor cursor Dagster stores with every tick (small: the per-region memory lives in
    the instance's key-value rows, `liveness.SensorState`). `epoch` names that memory (a reset
    cursor starts a fresh one), `maintained_after` is the base_table materialization the last
    maintenance request followed, `digest` a digest of the memory (so a tick that changed it
    is not reported as a skip), `first_maintenance` whether a maintenance run was requested yet
    (an instance that never maintained the table gets one at once)."""

    epoch: str
    maintained_after: int = 0
    digest: str = ""
    first_maintenance: bool = False  # a maintenance run was requested under this cursor

    @classmethod
    def parse(cls, raw: str | None) -> "Cursor":
        data = json.loads(raw) if raw else {}
        # A cursor of the old format (one version per region) starts a fresh state: the first
        # tick re-probes every region from its hint, which is also what a reset cursor means.
        return cls(data.get("epoch") or uuid.uuid4().hex[:8], int(data.get("maintained_after", 0)),
                   data.get("state", ""), bool(data.get("first", False)))

    def dump(self) -> str:
        return json.dumps({"epoch": self.epoch, "maintained_after": self.maintained_after, "state": self.digest,
                           **({"first": True} if self.first_maintenance else {})}, sort_keys=True)


@dataclass(frozen=True)
class Probe:
    """One region's probe this tick: the latest manifest version found and, when it moved past
    the remembered one, what that manifest says (`top`, `sealed`); or why the region could not
    be observed (`error`; the other regions are unaffected)."""

    region_id: str
    version: int = 0
    changed: bool = False     # the version moved and the manifest at it was read
    top: int = 0              # newest flushed generation of that manifest (changed only)
    sealed: bool = False      # (changed only)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def applied(self, known: RegionState | None) -> RegionState | None:
        """The region's remembered state with this probe's news applied (None: never seen and
        not readable now)."""
        if not self.ok or not self.changed:
            return known
        base = known or RegionState()
        return RegionState(self.version, self.top, self.sealed, base.base, base.attempts, base.last_request,
                           base.stuck_since, base.retired)


@dataclass(frozen=True)
class RunCover:
    """A merge run queued, starting or running: its one partition, or its partition range."""

    partition: str | None = None
    range_start: str | None = None
    range_end: str | None = None


@dataclass(frozen=True)
class Wall:
    """A permanent merge refusal the merger recorded for a region: the first generation it will
    not merge and why. Retrying cannot pass it; only a repair (and a merge by hand) can."""

    generation: int
    reason: str


@dataclass(frozen=True)
class Maintenance:
    """What decides a maintenance request: is one queued already, the newest base_table
    materialization by a merge (its storage id; 0: none newer than the watermark), and whether
    this instance ever recorded a maintenance run (a `garbage` materialization). And what
    decides the sensor's record that an idle table is current (`memwal_pipeline/freshness.py`):
    `latest_at`, when base_table was last materialized by either (None: never), and
    `idle_record`, the storage id of such a record newer than every merge (0: none), which
    moves the watermark without a maintenance run."""

    queued: bool = False
    latest_merge: int = 0
    ever: bool = True
    latest_at: float | None = None
    idle_record: int = 0


@dataclass(frozen=True)
class Observation:
    """Everything one tick decides from.

    `memory`: the per-region state remembered from earlier ticks (`liveness.RegionState`, keyed
    by region), `last_tick` / `ticks` when and how often the sensor ran (None: never, or its
    memory was reset). `listed`: the regions under `_mem_wal/`, in listing order; `probes`: one
    per region probed (every listed region not retired). `partitions`: the merge partitions, in
    Dagster's order. `merged`: merge progress per region, None when not read (nothing could
    need it: no region changed, none pending or sealed); `in_flight`: the merge runs covering
    partitions (read with `merged`); `catchup`: per gating index, its recorded catch-up per
    region, None when not read (no sealed, fully merged region that could retire).
    `walls`: the permanent merge refusals recorded in the table (region -> the refused
    generation and why), read when a region the sensor requested a merge for is still pending
    (None: not read).
    `statuses` / `labels`: what the observation events of changed regions show (emit only).
    """

    table: str
    now: float
    memory: Mapping[str, RegionState] = field(default_factory=dict)
    last_tick: float | None = None
    ticks: int = 0
    listed: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    recheck: frozenset[str] = frozenset()
    probes: Mapping[str, Probe] = field(default_factory=dict)
    partitions: tuple[str, ...] = ()
    merged: Mapping[str, int] | None = None
    in_flight: tuple[RunCover, ...] = ()
    catchup: Mapping[str, Mapping[str, int]] | None = None
    maintenance: Maintenance = Maintenance()
    walls: Mapping[str, "Wall"] | None = None
    statuses: Mapping[str, Any] = field(default_factory=dict, compare=False)
    labels: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def active(self) -> list[str]:
        """Listed regions not retired, in listing order (the ones probed)."""
        return [rid for rid in self.listed if not (rid in self.memory and self.memory[rid].retired)]
