"""The manifest sensor's tick: `observe` (all I/O) -> `decide` (pure) -> `emit` (Dagster's shape).

`observation` holds the plain data `decide` reads; neither imports Dagster. `sensors.py` builds
the Dagster sensor and schedule on top (`sensors.evaluate_tick` runs the three steps).
"""

from . import decide, emit, observe
from .decide import Decision, Verdict
from .observation import Cursor, Observation, Probe, RunCover
from .observe import SensorError, Watched

__all__ = ["Cursor", "Decision", "Observation", "Probe", "RunCover", "SensorError", "Verdict", "Watched", "decide",
           "emit", "observe"]
