"""The merge run's bookkeeping, without Spark: walls (`jobs/merge/walls.py`), the retry budget
that bounds a batch's attempts (`jobs/merge/attempt.py`), the wall records and unverified-commit
markers on storage (their JSON, old records included), and the result's failure views."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from memwal_core.failures import RegionFailure
from memwal_core.jobs.merge import attempt, unverified
from memwal_core.jobs.merge.plan import MergeBatch, MergePlan, PlannedGeneration
from memwal_core.jobs.merge.result import COMMIT_CHECK_FAILED, MergeResult, RegionMergeResult
from memwal_core.jobs.merge.walls import Walls
from memwal_core.state import layout
from memwal_core.state import walls as records
from memwal_core.state.store import open_store

A, B = "00000000-0000-4000-8000-00000000000a", "00000000-0000-4000-8000-00000000000b"


def _gen(rid: str, g: int) -> PlannedGeneration:
    return PlannedGeneration(rid, g, f"abcdef01_gen_{g}", 10, 1)


def test_the_lowest_wall_wins_and_only_transient_walls_are_lifted():
    w = Walls()
    w.stop(RegionFailure(A, 5, "late", permanent=False))
    w.stop(RegionFailure(A, 3, "early", permanent=False))
    w.stop(RegionFailure(A, 3, "same generation, later", permanent=True))  # a tie keeps the first
    w.stop(RegionFailure(A, 4, "higher", permanent=True))
    assert (w.failure(A).generation, w.failure(A).reason) == (3, "early")
    assert w.open(_gen(A, 2)) and not w.open(_gen(A, 3)) and not w.open(_gen(A, 9)) and w.open(_gen(B, 9))
    w.stop(RegionFailure(B, 2, "refused", permanent=True, offending_rows=7))
    w.lift({A: 2, B: 5})  # A's wall is not merged past yet; B's is permanent
    assert w.failure(A).generation == 3 and w.failure(B).generation == 2
    w.lift({A: 3, B: 5})  # another merger merged A's walled generation: nothing left to stop
    assert w.failure(A) is None and w.failure(B).permanent
    result = MergeResult("t")
    w.report(result)
    assert result.regions[A].failure is None and result.regions[A].error is None  # stopped once, lifted
    assert (result.regions[B].wall, result.regions[B].permanent, result.regions[B].offending_keys) == (2, True, 7)
    assert [f.region_id for f in result.failures] == [B] and result.stuck_regions == {B: "refused"}


def test_a_hole_in_a_regions_generations_is_a_wall_at_the_missing_one():
    w = Walls()
    out = w.in_order([_gen(A, 4), _gen(A, 6), _gen(A, 5), _gen(B, 3), _gen(B, 2)], {A: 3, B: 0})
    assert [(g.region_id, g.generation) for g in out] == [(A, 4), (A, 5), (A, 6)]
    assert (w.failure(B).generation, w.failure(B).permanent) == (1, False) and "generation 1" in w.failure(B).reason


def test_a_run_starts_behind_recorded_verification_walls_and_unreadable_records():
    plan = MergePlan("t", 1, {A: 2, B: 4}, [MergeBatch([_gen(A, 3), _gen(B, 5)])])
    recorded = records.RecordedWalls(
        records={A: records.WallRecord(RegionFailure(A, 3, f"{COMMIT_CHECK_FAILED}: x", permanent=True))},
        unreadable={B: "wall record _memwal/walls/b.json unreadable: boom"})
    w = Walls.start(plan, recorded)
    assert (w.failure(A).generation, w.failure(A).permanent) == (3, True)
    assert (w.failure(B).generation, w.failure(B).permanent) == (5, False) and "boom" in w.failure(B).reason
    listing = records.RecordedWalls(error="wall records could not be listed: down")
    w = Walls.start(plan, listing)
    assert {w.failure(A).generation, w.failure(B).generation} == {3, 5}


def test_every_retry_must_shrink_what_its_reason_names_and_grow_nothing():
    before = attempt.Budget(open_generations=4, dropped_unknown=1, commits_left=5)
    attempt._check_progress(attempt.RetryReason.SHARED_KEYS, before, attempt.Budget(3, 1, 5))
    attempt._check_progress(attempt.RetryReason.DROPPED_COLUMNS, before, attempt.Budget(4, 0, 5))
    attempt._check_progress(attempt.RetryReason.COMMIT_LOST, before, attempt.Budget(4, 1, 4))
    with pytest.raises(AssertionError, match="MERGED_MEANWHILE made no progress"):
        attempt._check_progress(attempt.RetryReason.MERGED_MEANWHILE, before, attempt.Budget(4, 1, 5))
    with pytest.raises(AssertionError, match="COMMIT_LOST"):  # shrank something else than its own part
        attempt._check_progress(attempt.RetryReason.COMMIT_LOST, before, attempt.Budget(3, 1, 5))
    with pytest.raises(AssertionError):  # shrank its part, grew another
        attempt._check_progress(attempt.RetryReason.STOPPED_BELOW_TASK, before, attempt.Budget(3, 1, 6))
    assert {r.shrinks for r in attempt.RetryReason} == {"open_generations", "dropped_unknown", "commits_left"}
    assert len(set(attempt.RetryReason)) == 6  # one member per reason, none an alias of another


def test_wall_records_written_before_the_failure_type_still_parse():
    old = json.dumps({"region": A, "generation": 7, "reason": "region a: refused", "recorded_at": 12.5,
                      "other_region": None}).encode()
    rec = records.WallRecord.from_json(old)
    assert (rec.region_id, rec.generation, rec.reason, rec.recorded_at) == (A, 7, "region a: refused", 12.5)
    assert rec.failure.permanent and rec.failure.step == "merge"  # only permanent walls were ever recorded
    keys = pa.table({"id": pa.array([1, 2], pa.int64())})
    new = records.WallRecord(RegionFailure(A, 7, "shared", permanent=True, offending_rows=2), 1.0, keys, B)
    back = records.WallRecord.from_json(new.to_json())
    assert back.failure == new.failure and back.shared_keys.equals(keys) and back.other_region == B
    assert set(json.loads(new.to_json())) >= {"region", "generation", "reason", "recorded_at"}  # readable by old code


def test_a_garbled_wall_record_is_unknown_not_absent(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    records.write(loc.store, records.WallRecord(RegionFailure(A, 3, "refused", permanent=True)))
    loc.store.put(layout.wall_key(B), b"{not json")
    got = records.load(loc.store)
    assert set(got.records) == {A} and set(got.unreadable) == {B} and got.unknown(B) and got.unknown(A) is None
    assert set(records.read_all(loc.store)) == {A}  # reports leave it out


def test_unverified_commit_markers_say_what_the_commit_merged(tmp_path):
    loc = open_store(str(tmp_path / "t"))
    p = unverified.record(loc, 41, [_gen(A, 3), _gen(A, 4), _gen(B, 9)])
    assert [o.key for o in loc.store.list(layout.UNVERIFIED_DIR)] == [p.key]
    back = unverified.PendingCommit.from_json(loc.store.get(p.key))
    assert back == p and back.progress == {A: 4, B: 9} and back.previous == {A: 2, B: 8}
    unverified.clear(loc, p)
    assert list(loc.store.list(layout.UNVERIFIED_DIR)) == []
    with pytest.raises(layout.UnsafePath):
        layout.unverified_key("../walls/x")
    assert layout.unverified_id_of(f"{layout.UNVERIFIED_DIR}/{p.id}.json") == p.id
    assert layout.unverified_id_of(f"{layout.UNVERIFIED_DIR}/x/{p.id}.json") is None


def test_a_region_result_reads_its_failure():
    r = RegionMergeResult(A, generations_merged=[1, 2], merged_generation=2)
    assert (r.error, r.wall, r.permanent) == (None, None, False)
    r.failure = RegionFailure(A, 3, "region a: commit failed", permanent=False)
    assert (r.error, r.wall, r.permanent) == ("region a: commit failed", 3, False)
    d = MergeResult("t", regions={A: r}, commits=1).to_dict()
    assert d["regions"][A]["wall"] == 3 and d["regions"][A]["failure"]["generation"] == 3
    assert d["region_errors"] == {A: "region a: commit failed"} and d["stuck_regions"] == {}
    m = MergeResult("t", regions={A: r}, commits=1)
    assert m.metrics()["regions_failed"] == 1 and "1 regions stopped" in m.summary()
