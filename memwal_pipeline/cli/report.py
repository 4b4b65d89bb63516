"""`PassReport`: what one maintenance pass did, the `--json` report of `memwal maintain`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memwal_core.steps.outcome import SCHEMA_VERSION, StepOutcome


@dataclass
class PassReport:
    """What one `memwal maintain` pass (or its dry run) did: each step's outcome, in the order
    the steps ran, and the checks that failed after them. Its `to_dict()` is the `--json` report."""

    table: str
    dry_run: bool = False
    outcomes: list[StepOutcome] = field(default_factory=list)
    failed_checks: list[str] = field(default_factory=list)  # `check NAME: why`

    @property
    def failed(self) -> list[str]:
        """One line per failure (`step: what`): non-empty makes the command exit 1."""
        lines = [f"{o.step}: {p}" for o in self.outcomes if o.failed for p in o.problems or [o.status.value]]
        return lines + self.failed_checks

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "table": self.table, "dry_run": self.dry_run,
                "ok": not self.failed, "steps": {o.step: o.to_dict() for o in self.outcomes}, "failed": self.failed}
