"""Merge commits whose verification a crash may have cut short.

A merge commit records its regions' progress together with its rows; `verify.py` checks the
rows right after. A merger killed between the two (SIGKILL, OOM, a lost node) would leave
progress over rows nobody checked, and the next run would merge on over them. So before each
commit the merger writes a small marker (`state/commit_markers.py`), and deletes it once the commit is verified
(or walled, or lost its race). Every run starts by settling the markers left behind
(`settle`, under the table lease): a commit that did not land is forgotten (its generations
are still pending: merged and verified again); one that landed is verified now, its keys
derived again from its generations (key columns only, on the driver; GC keeps the generations
of every unverified commit, so they are there), and the regions whose keys are
wrong are walled, as after a check in the run that made it.

Cost: one small PUT and one DELETE per commit, and one listing per run. A marker that cannot be
settled (its generations unreadable, the store failing) stops its regions for the run and
stays for the next one; one that cannot be read or listed stops every planned region.
"""

from __future__ import annotations

import logging

import lance
import pyarrow as pa
import pyarrow.compute as pc

from memwal_core.errors import one_line
from memwal_core.failures import RegionFailure
from memwal_core.jobs.merge import verify
from memwal_core.jobs.merge.run import BaseTable
from memwal_core.jobs.merge.walls import Walls
from memwal_core.spark import tasks as sparkpath
from memwal_core.state import commit_markers, layout
from memwal_core.state.commit_markers import PendingCommit, clear, record  # noqa: F401 - the merger's names
from memwal_core.state.store import TableLocation
from memwal_core.state.table import read_memwal_state

log = logging.getLogger("memwal.merge")

AFTER_CRASH = " (found unverified: the run that committed it ended before checking it)"


def settle(loc: TableLocation, base: BaseTable, walls: Walls, merged: dict[str, int], planned: set[str]) -> None:
    """Settle the markers earlier runs left (see the module docstring). `merged`: progress as
    planned; `planned`: the regions this run would merge (stopped when markers are unknown)."""
    try:
        markers = commit_markers.load(loc)
    except Exception as e:  # noqa: BLE001 - which regions have an unverified commit is unknown
        for rid in sorted(planned):
            walls.stop(RegionFailure(rid, merged.get(rid, 0) + 1, f"region {rid}: the markers of unverified merge "
                                     f"commits ({layout.UNVERIFIED_DIR}) could not be read ({one_line(e)}); not "
                                     "merged until they can be (one may hold this region's last commit)",
                                     permanent=False))
        return
    for pending in markers:
        try:
            _settle_one(loc, base, walls, pending)
        except Exception as e:  # noqa: BLE001 - its regions wait; the marker stays for the next run
            for rid, p in sorted(pending.progress.items()):
                walls.stop(RegionFailure(rid, p + 1, f"region {rid}: merge commit of generations "
                                         f"{pending.by_region[rid]}{AFTER_CRASH} could not be verified: "
                                         f"{one_line(e)}; not merged on until it is", permanent=False))


def _settle_one(loc: TableLocation, base: BaseTable, walls: Walls, pending: PendingCommit) -> None:
    merged = read_memwal_state(loc).merged
    if any(merged.get(rid, 0) < p for rid, p in pending.progress.items()):
        log.info("merge commit %s (read version %d) did not land; its generations are still pending",
                 pending.id, pending.read_version)
        clear(loc, pending)
        return
    version, exact = verify.commit_version(loc, pending.read_version, pending.progress, pending.previous)
    origins = {rid: _region_keys(loc, base, rid, [(g, p) for r, g, p in pending.generations if r == rid])
               for rid in pending.by_region}
    live = [t for t, _ in origins.values() if t.num_rows]
    gone = [t for _, t in origins.values() if t.num_rows]
    check = verify.verify_commit(loc, version if version is not None else read_memwal_state(loc).table_version,
                                 pending.progress, pa.concat_tables(live) if live else base.key_types.empty_table(),
                                 pa.concat_tables(gone) if gone else None, list(base.pk),
                                 at_version=version is not None and exact)
    if check.bad_rows:
        wrong = verify.regions_with_bad_keys(check, [(rid, t) for rid, pair in origins.items() for t in pair],
                                             list(base.pk))
        if not walls.stop_recorded(loc, verify.bad_commit_failures(check, pending.by_region, wrong, AFTER_CRASH)):
            return  # the marker stays: the next run finds the wrong rows again
    else:
        log.info("merge commit version %s%s verified: %s", check.version, AFTER_CRASH, check.describe())
    clear(loc, pending)


def _region_keys(loc: TableLocation, base: BaseTable, rid: str, gens: list[tuple[int, str]]
                 ) -> tuple[pa.Table, pa.Table]:
    """(keys upserted, keys tombstoned) by a region's generations `gens` (generation, path), as
    the Spark tasks decide it: the newest row per key, in write order."""
    pk = list(base.pk)
    tables = []
    for g, path in sorted(gens):
        ds = lance.dataset(loc.child_uri(layout.generation_dir(rid, path, g)),
                           storage_options=loc.storage_options or None)
        t = ds.to_table(columns=pk + [sparkpath.TOMBSTONE], with_row_address=True)
        addr = t.column_names[-1]
        tables.append(t.sort_by(addr).drop_columns([addr]))
    newest = sparkpath.newest_rows(tables, pk)
    dead = newest.column(sparkpath.TOMBSTONE).fill_null(False)
    types = base.key_types
    return newest.filter(pc.invert(dead)).select(pk).cast(types), newest.filter(dead).select(pk).cast(types)
