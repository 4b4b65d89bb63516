"""The manifest sensor's tick: `observe` (all I/O) -> `decide` (pure) -> `emit` (Dagster's shape).

`observation` holds the plain data `decide` reads. Importing this package, `observation` or
`decide` loads no Dagster (tests/test_sensor_decide.py checks it): `observe` and `emit` are
imported by name where the sensor is built (`sensors.py` runs the three steps).
"""

from .decide import Decision, MergeRequest, RegionDecision, Verdict
from .observation import Cursor, Maintenance, Observation, Probe, RunCover

__all__ = ["Cursor", "Decision", "Maintenance", "MergeRequest", "Observation", "Probe", "RegionDecision", "RunCover",
           "Verdict"]
