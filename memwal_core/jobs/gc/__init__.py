"""The garbage collector (spec "Garbage Collector"): plan, execute, result; see `plan.py`."""

from memwal_core.jobs.gc import leaks
from memwal_core.jobs.gc.plan import (BASE_VERSION, CRASH_AFTER_MANIFEST_COMMIT, GENERATION, KINDS, LEAKED, LEAKS_KEY,
                                      MANIFEST, ORPHAN, WAL, BaseCleanupPlan, GcError, GcHold, GcItem, GcOptions,
                                      GcPlan, GcResult, RegionGcPlan, cleanup_base_versions, covered_position,
                                      execute_gc, plan_base_cleanup, plan_gc, run_gc, summarize_holds,
                                      unrecorded_regions)

__all__ = ["BASE_VERSION", "CRASH_AFTER_MANIFEST_COMMIT", "GENERATION", "KINDS", "LEAKED", "LEAKS_KEY", "MANIFEST",
           "ORPHAN", "WAL", "BaseCleanupPlan", "GcError", "GcHold", "GcItem", "GcOptions", "GcPlan", "GcResult",
           "RegionGcPlan", "cleanup_base_versions", "covered_position", "execute_gc", "leaks", "plan_base_cleanup",
           "plan_gc", "run_gc", "summarize_holds", "unrecorded_regions"]
