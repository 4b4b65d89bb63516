"""The one failure type for a region that cannot go on.

"This region cannot be merged (or maintained) from generation g on, for this reason,
permanently or not" is one fact. It is found in a Spark task (a refused generation), in the
planner (a corrupt manifest, a stale region), at commit (verification) or in a recorded
wall, and it is read by the merge loop (progress never passes it), by `memwal status`, by
the Dagster checks and by the sensor (a permanent failure is not retried). Every one of them
uses this type, so a failure keeps its generation and its permanence from where it is found
to where a person reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_REASON_CHARS = 2000  # a reason kept in run tags / JSON (Lance and Spark messages run long)


@dataclass(frozen=True)
class RegionFailure:
    """Region `region_id` cannot go on from `generation` (None: before any generation, e.g.
    its manifest cannot be read) because of `reason`.

    `permanent`: the region itself is wrong (a refused generation, a corrupt manifest, keys
    another region owns) and stays stuck until an operator repairs it; retrying cannot help.
    Otherwise (a read that failed after retries, a lost commit race) the next run tries again.
    `step`: the service that found it (merge, snapshot, gc, ...).
    """

    region_id: str
    generation: int | None
    reason: str
    permanent: bool
    step: str = "merge"
    offending_rows: int = 0

    def describe(self) -> str:
        kind = "permanent" if self.permanent else "transient"
        at = f" at generation {self.generation}" if self.generation is not None else ""
        reason = self.reason.removeprefix(f"region {self.region_id}: ")
        return f"region {self.region_id}{at} ({kind}): {reason}"

    def lowest(self, other: "RegionFailure | None") -> "RegionFailure":
        """Of two failures of one region, the one progress must stop at (the lower
        generation; a failure without a generation stops the region before any)."""
        if other is None:
            return self
        mine = -1 if self.generation is None else self.generation
        theirs = -1 if other.generation is None else other.generation
        return self if mine <= theirs else other

    def to_dict(self) -> dict[str, Any]:
        return {"region": self.region_id, "generation": self.generation, "permanent": self.permanent,
                "step": self.step, "reason": self.reason[:MAX_REASON_CHARS],
                "offending_rows": self.offending_rows}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RegionFailure":
        g = d.get("generation")
        return RegionFailure(str(d["region"]), None if g is None else int(g), str(d.get("reason", "")),
                             bool(d.get("permanent", False)), str(d.get("step", "merge")),
                             int(d.get("offending_rows", 0)))
