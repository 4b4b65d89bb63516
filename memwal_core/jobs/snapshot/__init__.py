"""The MemWAL index builder (region snapshots and WAL-position hints) as a package."""

from memwal_core.jobs.snapshot.execute import *  # noqa: F401,F403 - the module's names, unchanged
from memwal_core.jobs.snapshot.execute import (  # noqa: F401 - private names some callers use
    _hint_mutation, _previous_field_values, _previous_rows, _previous_snapshot, _region_pass,
)
