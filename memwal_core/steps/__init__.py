"""Maintenance steps as one call each: `run_step` -> `StepOutcome` (see runner.py, outcome.py).

The names below are loaded on first use: `outcome` is light (the CLI imports it to parse its
arguments), `runner` imports every job and with them Lance and Arrow (seconds on a cold start).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SCHEMA_VERSION", "STEPS", "SparkProvider", "StepOptions", "StepOutcome", "StepStatus", "adapt",
           "describe_error", "run_step"]

_HOME = {"SCHEMA_VERSION": "outcome", "STEPS": "outcome", "StepOutcome": "outcome", "StepStatus": "outcome",
         "SparkProvider": "runner", "StepOptions": "runner", "describe_error": "runner", "run_step": "runner"}


def __getattr__(name: str) -> Any:
    if name == "adapt":
        return importlib.import_module("memwal_core.steps.adapt")
    if name in _HOME:
        return getattr(importlib.import_module(f"memwal_core.steps.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
