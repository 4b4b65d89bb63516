"""What one maintenance step did: the `StepOutcome` every caller of a step reads.

A step (merge, compact, catchup, index, gc) is planned and, unless it is a dry run, executed by
`runner.run_step`; its outcome says how it ended (`StepStatus`), which regions could not go on
(`RegionFailure`, the one failure type), what else failed (an index), the numbers it reports
(`metrics`, what a Dagster asset plots), and the typed plan and result it came from. The
Dagster assets turn an outcome into events; `memwal maintain` formats outcomes and takes its
exit status from them. Neither reads the other's output back, so a metadata key can be renamed
without changing what the command says or returns.

`to_dict()` is the `--json` shape of one step, versioned by `SCHEMA_VERSION` (bumped when a key
changes meaning or goes away; adding a key is not a change). It is plain data for a program:
one duration (`duration_s`, the step's wall time), numbers unformatted, and no key with a `/`:
a metric Dagster names `would_delete/generation/items` is `{"would_delete": {"generation":
{"items": ...}}}` there.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

from memwal_core.failures import RegionFailure

SCHEMA_VERSION = 2
STEPS = ("merge", "compact", "catchup", "index", "gc")  # in the order a maintenance pass runs them

Number = int | float


class StepStatus(enum.Enum):
    """How a step ended. A dry run ends PLANNED (or NOTHING_TO_DO, REFUSED, FAILED)."""

    OK = "ok"                        # it did its work
    NOTHING_TO_DO = "nothing_to_do"  # nothing was pending (or the table is healthy)
    PLANNED = "planned"              # a dry run: the plan is what a real run would do now
    PARTIAL = "partial"              # it ran; some regions (or indexes) could not go on
    REFUSED = "refused"              # the table cannot be maintained by this step as it is
    SKIPPED = "skipped"              # another maintainer held the table's lease past the wait
    FAILED = "failed"                # the step itself failed (an error, no result)


@dataclass(frozen=True)
class StepOutcome:
    """One step's outcome (see the module docstring).

    `error`: why the step failed, was refused or skipped (one line, no secret: memwal's
    messages name the table, never its credentials). `errors`: other things that failed, one
    line each (an index that could not be caught up). `notes`: what a person should know that
    is not a failure (a compaction that gave up on conflicts, a base cleanup that could not be
    planned). `exception`: the error as raised, for a caller that re-raises it (kept out of
    `to_dict` and comparisons).
    """

    step: str
    status: StepStatus
    executed: bool = True
    failures: list[RegionFailure] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    metrics: Mapping[str, Number] = field(default_factory=dict)
    summary: str = ""
    plan: Any = None
    result: Any = None
    seconds: float = 0.0
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def failed(self) -> bool:
        """Whether this outcome fails the command that ran it: the step failed, or, run for
        real, it was refused or left regions (or indexes) behind. A dry run that finds the
        table refused or regions stuck reports them and is not a failure."""
        if self.status is StepStatus.FAILED:
            return True
        return self.executed and self.status in (StepStatus.PARTIAL, StepStatus.REFUSED)

    @property
    def problems(self) -> list[str]:
        """Every failure as one line (without the step's name): the region failures as the
        step found them, the other errors, the step's own error when it failed or was refused."""
        lines = [f"region {f.region_id}: {f.reason.removeprefix(f'region {f.region_id}: ')}" for f in self.failures]
        lines += self.errors
        if self.error and self.status in (StepStatus.FAILED, StepStatus.REFUSED):
            lines.append(self.error)
        return lines

    def __str__(self) -> str:
        """One line for a log: `merge ok in 3.1 s: generations merged 8, ...`."""
        head = f"{self.step} {self.status.value} in {self.seconds:.1f} s"
        tail = self.error if self.error and not self.summary else self.summary
        return f"{head}: {tail}" if tail else head

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "step": self.step,
            "status": self.status.value,
            "ok": not self.failed,
            "executed": self.executed,
            "duration_s": round(self.seconds, 3),
            "summary": self.summary,
            "error": self.error,
            "failures": [f.to_dict() for f in self.failures],
            "errors": list(self.errors),
            "notes": list(self.notes),
            "metrics": nested({k: v for k, v in self.metrics.items() if k not in DURATIONS}),
            "plan": _without_durations(as_dict(self.plan)),
            "result": _without_durations(as_dict(self.result)),
        }


DURATIONS = ("duration_s", "plan_seconds", "execute_seconds")  # the job's own timings: `duration_s` is the step's


def _without_durations(d: Any) -> Any:
    return {k: v for k, v in d.items() if k not in DURATIONS} if isinstance(d, dict) else d


def nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`{"a/b/c": 1}` as `{"a": {"b": {"c": 1}}}` (Dagster's metadata keys as JSON objects). A key
    under a prefix that is itself a value (`a` and `a/b`) keeps its flat spelling."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split("/")
        if any("/".join(parts[:i]) in flat for i in range(1, len(parts))):
            out[key] = value
            continue
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def as_dict(obj: Any) -> Any:
    """A plan or result as JSON-able data: its own `to_dict()`, else its dataclass fields."""
    if obj is None:
        return None
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj
