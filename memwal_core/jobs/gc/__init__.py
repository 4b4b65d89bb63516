"""The garbage collector (spec "Garbage Collector"): reclaim what no reader or writer needs.

A pure planner (`plan_gc`) reads committed state only and returns a `GcPlan` listing every
object it would delete, with its kind, key, bytes and the reason it is eligible, plus counts
of what it keeps and why; the executor (`execute_gc`) deletes exactly that, after committing a
region manifest version that no longer lists the deleted generations. `run_gc` does both, after
the optional base-table version cleanup. A dry run (`run_gc(dry_run=True)`, `memwal maintain
--dry-run`) is the same path with execution off: the cleanup is planned by Lance itself
(`explain_cleanup_old_versions`, same settings), and GC is planned as if those versions were gone,
so it lists what the real run deletes. Per region:

1. **Generations** `g <= limit[region]`, where `limit` is the minimum of
   - `merged[region]` of the latest table version,
   - `index_catchup[I][region]` for every index I whose catch-up gates GC
     (`MemWalState.gating_indexes`; an index or region absent from `index_catchup` counts as 0),
   - `merged[region]` of **every retained base-table version** (`history.py`): a reader
     time-travelling to version v reads the generations newer than v's merged, so they stay.
     A version whose table has no MemWAL index yet needs none.
   - 0 for a sharded region whose routing value neither an inline MemWAL index snapshot nor the
     durable record of the lifetime (`state/value_records.py`) holds yet (`unrecorded_regions`):
     its merged generations are the merger's authority for that value.
   A region with data from before the MemWAL initialization (`state/lifecycle.py`) keeps
   everything until discarded; its discarded generations are then held only by versions from
   before the initialization (`_stale_limit`).
2. **WAL entries** at positions `p <= replay_after_wal_entry_position` and below the WAL tail,
   whose entry generation is one of the deleted (or earlier deleted) generations. An entry that
   names no generation (Lance 13 / LanceDB 0.40 write only `writer_epoch`) is decided by its
   position instead (`covered_position`): the spec's flush sets `replay_after` to the last entry
   of the generation it commits, so the newest region manifest version whose
   `current_generation - 1` is at most the collectable bound says up to which position every
   entry lives in a collectable generation; no entry is read to learn its generation. Kept always:
   - every **fence sentinel**: pylance detects fencing when a stale writer's put-if-absent of
     its next WAL position collides, and that position is always a later writer's sentinel
     (each claim writes one at the tip). Delete it and the stale writer's put succeeds into a
     covered position that no replay reads: an acknowledged, lost write (seen on 14.0.2);
   - the entry at the **highest position**: a writer that cannot find the hinted position
     derives its next position from the highest existing file; with the tail gone it would
     reuse covered positions, and its entries there would never be replayed;
   - by default every entry of the region's current `writer_epoch` (`keep_current_epoch_wal`).
   The scan walks down from the cut to the first missing position, skipping the current
   epoch's contiguous run by bisection; below that hole earlier runs left only kept entries,
   unless a delete failed part-way (S3 DeleteObjects answers per key; a crash). Such a delete
   leaves GC's intent marker `_memwal/gc_pending/{region}` (written before a region's WAL and
   manifest deletes, removed once they all went); for a marked region the WAL directory is
   listed once and what lies below the hole classified the same way.
3. **Region manifest versions** below the newest `manifest_retention` and older than
   `manifest_min_age_seconds`, a prefix only (the versions left stay contiguous up to the latest),
   never the latest (for a marked region, versions below a hole are found by one listing of
   the manifest directory). `version_hint.json` is rewritten to the latest version first when it is
   missing or points outside the versions that stay.
4. **Orphan directories** `*_gen_*` in the region directory that the latest manifest does not
   list, whose generation is below its `current_generation` (a flush in progress writes its
   directory before the manifest), and whose newest object is older than `orphan_grace_seconds`.
   The latest manifest is read again right before they are deleted.

5. **Leaked base-table files** (`leaks.py`, when `collect_leaked_files` and the plan covers
   every region): files under `data/`, `_deletions/`, `_transactions/`, `_indices/` that no
   retained version's manifest references (commits that lost a race or crashed), older than
   `leaked_file_grace_seconds` (a week, never below the retention floor); kind `leaked`,
   region "" (deleted after the regions' work). The scan lists the whole table, so it runs once
   per `full_scan_interval_seconds` (an hour) and in every dry run; `GcPlan.leak_scan` says
   when it was skipped and when the next is due.

Every committing step holds the table lease (`state/lease.py`): `run_gc` / `execute_gc` take it,
and the base-version cleanup, each manifest commit and each delete are fenced by it.

Execution (`execute.py`), per region: commit the trimmed manifest, then delete generations and
WAL entries, fix the version hint, delete old manifest versions, re-read the latest manifest and
delete the orphans still unlisted (the order and why: `execute.py`).

Safety: every key comes from `layout` (generation paths are validated) and must lie inside
its region directory; a region whose manifest lists an unsafe path is reported corrupt and
nothing in it is touched; a region whose manifest cannot be read is skipped with an error.
Planning uses gets and existence probes; the only listings are the region directories (one
per region, for orphans), the directories about to be deleted (their keys), GC's intent
markers (one per table), the WAL and manifest directories of marked regions, and the base
table's `_versions/`.

What a pass learns is kept for the next one, since every run is a new process: the retained
versions' merge progress and commit times (`history.py`, `_memwal/gc_versions.json`, the older
versions sealed under `_memwal/gc_versions/` by `fact_segments.py`), the files
they reference (`leak_refs.py`, `_memwal/gc_refs.json`), and per region the WAL entries and
manifest versions that stay (`region_cache.py`, `_memwal/gc_regions/`). Each is a pure cache,
checked against what it describes (manifest sizes and times, anchors, GC's intent markers) and
ignored when missing or garbled, so a pass decides exactly what reading everything again decides
(`plan_gc(use_summary=False)`) while reading only what is new. So that a pass costs about the
same however long the retained history: a region's WAL entries kept whole by its last walk are a
settled run, counted without classifying each while the limit stays below them
(`region_cache.py`); the generations held are counted by runs between bounds (`plan.py`); the
retained versions' facts are columns (`fact_table.py`), checked in C and grouped by distinct
merge state (`retention.py`), the older ones counted by their aggregates (`fact_segments.py`);
a long-lived writer's run of WAL entries is skipped from its first position (`wal.py`). Lance's
own version cleanup, which
reads every manifest, is not run while no retained version is old enough for it.

What GC keeps is typed (`holds.py`): every `kept` counter is keyed by a `KeepReason`
(`kind:why`), and the generations kept above a region's bounds are `Hold`s (which bound, how
many, their bytes, the highest, until when), summed over regions as `GcHold`s. Regions GC cannot
plan or execute are `RegionFailure`s in `GcPlan.failures` / `GcResult.failures`.

The package: `plan.py` (`plan_gc`, `GcPlan`, per-region planning: generations and orphans),
`wal.py` and `manifests.py` (their rules), `retention.py` (what retained base-table versions
read), `leaks.py` (leaked files), `base_cleanup.py` (Lance's version cleanup), `execute.py`
(`execute_gc`), `result.py` (`GcResult`), `run.py` (`run_gc`), `items.py` (`GcItem`, kinds),
`listing.py` (safe listings inside a region directory), `history.py` (with `fact_table.py` and
`fact_segments.py`),
`leak_refs.py` and `region_cache.py` (what earlier passes learned).
"""

from memwal_core.jobs.gc import leaks
from memwal_core.jobs.gc.base_cleanup import BaseCleanupPlan, cleanup_base_versions, plan_base_cleanup
from memwal_core.jobs.gc.execute import CRASH_AFTER_MANIFEST_COMMIT, execute_gc
from memwal_core.jobs.gc.holds import Bound, GcHold, Hold, KeepReason, summarize_holds
from memwal_core.jobs.gc.items import (BASE_VERSION, GENERATION, KINDS, LEAKED, LEAKS_KEY, MANIFEST, ORPHAN, WAL,
                                       GcError, GcItem)
from memwal_core.jobs.gc.plan import GcPlan, RegionGcPlan, plan_gc, unrecorded_regions
from memwal_core.jobs.gc.result import GcResult
from memwal_core.jobs.gc.run import run_gc
from memwal_core.jobs.gc.wal import covered_position
from memwal_core.options import GcOptions

__all__ = ["BASE_VERSION", "CRASH_AFTER_MANIFEST_COMMIT", "GENERATION", "KINDS", "LEAKED", "LEAKS_KEY", "MANIFEST",
           "ORPHAN", "WAL", "BaseCleanupPlan", "Bound", "GcError", "GcHold", "GcItem", "GcOptions", "GcPlan",
           "GcResult", "Hold", "KeepReason", "RegionGcPlan", "cleanup_base_versions", "covered_position",
           "execute_gc", "leaks", "plan_base_cleanup", "plan_gc", "run_gc", "summarize_holds", "unrecorded_regions"]
