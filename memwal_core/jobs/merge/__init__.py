"""The merge service: flushed generations -> base table (`execute.py` says how)."""

from memwal_core.jobs.merge import verify
from memwal_core.jobs.merge.execute import *  # noqa: F401,F403
from memwal_core.jobs.merge.execute import (  # noqa: F401 - names the tests reach
    _batches, _record_walls, _Run, log, merge_tasks, region_values, routing_check)
