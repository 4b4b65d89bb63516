"""Keys in more than one region: the spec requires mutually exclusive regions.

Within a batch the Spark path finds them (`tasks.shared_keys`); across the batches of a run,
and through recorded evidence across runs, `KeyLedger` does: it keeps the keys each commit of
the run merged, per region.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from memwal_core.failures import RegionFailure
from memwal_core.jobs.merge.plan import PlannedGeneration
from memwal_core.jobs.merge.walls import Evidence, Walls
from memwal_core.spark import tasks as sparkpath
from memwal_core.state import walls as records

_SEEN, _NOW = "_memwal_seen_region", "_memwal_region"


@dataclass
class KeyLedger:
    """`seen`: the keys this run merged, by region; `evidence`: region -> keys it must not merge
    (recorded by an earlier run, or found in this one)."""

    pk: tuple[str, ...]
    evidence: dict[str, Evidence] = field(default_factory=dict)
    seen: list[tuple[str, pa.Table]] = field(default_factory=list)

    @classmethod
    def start(cls, pk: tuple[str, ...], recorded: records.RecordedWalls, pending: set[str]) -> "KeyLedger":
        return cls(pk, {rid: Evidence(rec.shared_keys, rec.other_region) for rid, rec in recorded.records.items()
                        if rid in pending and rec.shared_keys is not None})

    def remember(self, deduped: sparkpath.Deduped, regions: dict[int, str]) -> None:
        """Keep the keys a commit merged, per region, for the cross-batch exclusivity check."""
        for tables, owners in ((deduped.live, deduped.live_region), (deduped.deleted, deduped.deleted_region)):
            for t, ridx in zip(tables, owners):
                if ridx in regions and t.num_rows:  # a copy: the batch's rows (mapped files) are freed with it
                    self.seen.append((regions[ridx], pa.table({c: _copy(t.column(c)) for c in self.pk})))


def _copy(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """`col` in buffers of its own, chunk by chunk (a slice keeps the whole buffer it is cut from)."""
    return pa.chunked_array([pa.concat_arrays([c]) for c in col.chunks], col.type)


def sample_keys(keys: pa.Table, n: int = 3) -> str:
    """A few keys of `keys` as a person looks them up (`id=5, id=9, ...`)."""
    rows = keys.slice(0, n).to_pylist()
    shown = "; ".join(", ".join(f"{c}={v!r}" if isinstance(v, str) else f"{c}={v}" for c, v in r.items())
                      for r in rows)
    return f"e.g. {shown}" + (f" and {keys.num_rows - n} more" if keys.num_rows > n else "")


def refuse_shared(deduped: sparkpath.Deduped, gens: list[PlannedGeneration], region_index: dict[int, str],
                  walls: Walls) -> bool:
    """Keys in several regions of this batch break the spec's exclusivity: none of those regions
    is merged in this run (which of their rows is newest is unknowable), the others are. True:
    some were refused (re-read without them)."""
    for ridx, rows in deduped.shared.items():
        rid = region_index[ridx]
        others = ", ".join(region_index[i] for i in sorted(deduped.shared) if i != ridx)
        first = min(g.generation for g in gens if g.region_id == rid)
        walls.stop(RegionFailure(rid, first, f"region {rid}: {deduped.shared_keys} primary keys also appear in "
                                 f"another region ({others}); the spec requires mutually exclusive regions, so "
                                 "none of these regions is merged", permanent=True, offending_rows=rows))
    return bool(deduped.shared)


def refuse_across_batches(ledger: KeyLedger, walls: Walls, deduped: sparkpath.Deduped,
                          gens: list[PlannedGeneration], region_index: dict[int, str], merged: dict[str, int]) -> bool:
    """The exclusivity check of `read_and_dedup` across the batches of the run (and, through
    recorded evidence, across runs): a key of this batch that another region merged earlier in
    this run means which row is newest is unknowable. The region of this batch is refused
    (permanent: a writer broke exclusivity; its record keeps the keys so the next run refuses
    it again while they are pending); the region that merged first stops for this run only
    (its row is in the base table already; nothing of the refused region will overwrite it).
    Also refused: a region whose pending rows hold a key its wall record names. Cost: a join
    of this batch's keys (the build side, bounded by the batch budget) with the keys merged so
    far in the run (memory: the key columns of every row the run merged). True: re-read."""
    pk = list(ledger.pk)
    parts = [(region_index[r], t) for t, r in zip(deduped.live + deduped.deleted,
                                                  deduped.live_region + deduped.deleted_region) if t.num_rows]
    if not parts or not (ledger.seen or ledger.evidence):
        return False
    now = pa.concat_tables([t.select(pk).append_column(_NOW, pa.array([rid] * t.num_rows, pa.string()))
                            for rid, t in parts], promote_options="permissive")
    hits: dict[str, tuple[pa.Table, list[str], bool]] = {}  # region -> (keys, other regions, from evidence)

    def probe(earlier: list[tuple[str, pa.Table]], same: bool) -> None:
        if not earlier:
            return
        seen = pa.concat_tables([t.select(pk).append_column(_SEEN, pa.array([rid] * t.num_rows, pa.string()))
                                 for rid, t in earlier], promote_options="permissive")
        both = seen.join(now, keys=pk, join_type="inner")
        test = pc.equal if same else pc.not_equal
        both = both.filter(test(both[_SEEN], both[_NOW]))
        for rid in sorted(set(both[_NOW].to_pylist())):
            if rid in hits:
                continue
            mine = both.filter(pc.equal(both[_NOW], rid))
            others = ([ledger.evidence[rid].other_region or "another region"] if same
                      else sorted(set(mine[_SEEN].to_pylist())))
            hits[rid] = (mine.select(pk), others, same)

    probe([(rid, ev.shared_keys) for rid, ev in ledger.evidence.items() if ev.shared_keys is not None], True)
    probe(ledger.seen, False)
    for rid, (keys, others, recorded) in sorted(hits.items()):
        first = min(g.generation for g in gens if g.region_id == rid)
        ledger.evidence[rid] = Evidence(keys, others[0])
        walls.stop(RegionFailure(
            rid, first, f"region {rid}: {keys.num_rows} primary keys of its generations from {first} on "
            f"({sample_keys(keys)}) "
            f"{'were found earlier in' if recorded else 'were merged in this run from'} region {', '.join(others)}; "
            "the spec requires mutually exclusive regions (repair the generation: which row is newest is "
            "unknowable)", permanent=True, offending_rows=keys.num_rows))
        for other in ([] if recorded else others):
            if walls.failure(other) is None:
                walls.stop(RegionFailure(other, merged.get(other, 0) + 1, f"region {other}: primary keys it merged "
                                         f"in this run are also in region {rid}'s pending generation {first} "
                                         "(refused); stopped for this run, the next run continues", permanent=False))
    return bool(hits)
