"""A region manifest's listed generations as GC plans them, checked once rather than on every pass.

While retained base versions hold them (a week with the shipped retention), a region's manifest
lists every generation flushed since, and every new manifest version lists them again: a pass
that validates each path, builds an object per generation and classifies them one by one costs
what the retention holds, not what changed. So the checked list is kept as *chunks* in the
region's cache (`region_cache.py`): a chunk is a run of records of the manifest's
`flushed_generations` (field 8), exactly as their bytes appear in the file, of the consecutive
generations `first .. first + count - 1` (`first - 1` a multiple of `CHUNK`, as generations
count from 1, all below the next chunk's first), with their `in_memory_bytes` summed and a digest
of those bytes and of what the chunk says of them (its first generation, count and sum).

A pass walks the manifest's bytes field by field. At a record whose generation starts a known
chunk, it compares the digest of the chunk's length of bytes from there with the recorded one;
equal, the bytes are those an earlier pass decoded and validated record by record (a path is
a pure function of its bytes: the region, its manifest version or the writer do not enter), so
they are skipped as a whole. Any other record is decoded and its path validated now. So:
- the cache is content-addressed: a region re-created under the same id, a manifest version
  rewritten, a path changed, a record inserted or reordered give other bytes, and those records
  are validated again; a chunk of a garbled cache, or of another format, matches nothing (the
  cache is sealed and checksummed before that: `sealed.py`), nor does one whose first generation,
  count or sum is not what it was recorded with;
- what the walk does not understand (a record it cannot place, a count that differs from the
  decoded manifest's, an invalid path) sends the pass to the full check, which validates every
  path as listed and names the first invalid one;
- only a list of consecutive ascending generations is planned from chunks (`Listed.run`), as
  every writer lists them; anything else is planned one generation at a time;
- a generation to be deleted has its path validated again where its directory is named, and its
  number compared with the run's (`take`), as are the run's ends with the first and last record.
A wrong cache can only make a pass validate more. The generation numbers are never taken from
the cache: a run is used only when the decoded numbers are exactly it. What a cache forged by
someone who computes the digests (not one garbled, stale or of another region) can do is hide an
unsafe *path* inside a chunk from the check that refuses the region: whoever can write `_memwal/`
is trusted as a writer of the region's manifests is, as with the WAL rows. Even then no delete goes
through such a path: a generation taken to delete has its path validated again (`take`), and the
orphan sweep deletes only directories it listed inside the region. The digest's domain names
this version of the path rules (`_PERSON`): other rules must change it.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Sequence

from google.protobuf.message import DecodeError

from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, region

CHUNK = 32  # generations per chunk: a pass decodes at most this many below the first full one
_RECORD = (8 << 3) | 2  # RegionManifest.flushed_generations, length-delimited
_GENERATION = (1 << 3) | 0  # FlushedGeneration.generation, a varint
_PERSON = b"memwal-gens-1"  # the digest's domain: no other digest of the project matches one


@dataclass(frozen=True)
class Chunk:
    """Records of generations `first .. first + count - 1`, `nbytes` long, with `digest`
    (`_digest`) and their `in_memory_bytes` summed (`mem`)."""

    first: int
    count: int
    nbytes: int
    digest: str
    mem: int

    def to_list(self) -> list:
        return [self.first, self.count, self.nbytes, self.digest, self.mem]

    @staticmethod
    def from_list(x: list) -> "Chunk":
        first, count, nbytes, digest, mem = x
        if not (_nat(first) and _starts(first) and _nat(count) and count <= CHUNK and _nat(nbytes)
                and isinstance(digest, str) and len(digest) == 32 and _nat(mem, 0)):
            raise ValueError(f"a bad generation chunk {x!r}")
        return Chunk(first, count, nbytes, digest, mem)


@dataclass(frozen=True)
class _Seg:
    """Generations `first .. first + count - 1` at bytes `start:end` (a known chunk, or one record)."""

    first: int
    count: int
    mem: int
    start: int
    end: int
    chunk: Chunk | None = None


def _starts(g: int) -> bool:
    """Whether generation `g` is the first of a chunk."""
    return (g - 1) % CHUNK == 0


def _digest(first: int, count: int, mem: int, data: bytes) -> str:
    """The digest of a chunk's records `data` with what the chunk says of them."""
    h = hashlib.blake2b(b"%d,%d,%d;" % (first, count, mem), digest_size=16, person=_PERSON)
    h.update(data)
    return h.hexdigest()


def _nat(x: object, least: int = 1) -> bool:
    return type(x) is int and x >= least


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    """The varint at `i` and the position after it (IndexError past the end)."""
    v = shift = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, i
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def _skip(buf: bytes, i: int, wire_type: int) -> int:
    """The position after a field's value of `wire_type` starting at `i`."""
    if wire_type == 0:
        return _varint(buf, i)[1]
    if wire_type == 1:
        return i + 8
    if wire_type == 2:
        n, i = _varint(buf, i)
        return i + n
    if wire_type == 5:
        return i + 4
    raise ValueError(f"wire type {wire_type}")


def _walk(rid: str, raw: bytes, known: dict[int, Chunk]) -> list[_Seg]:
    """The manifest's records in file order: known chunks whose bytes match, other records
    decoded and their paths validated (`layout.UnsafePath`); ValueError/IndexError/DecodeError
    for bytes the walk cannot place."""
    segs: list[_Seg] = []
    i, n = 0, len(raw)
    while i < n:
        key, j = _varint(raw, i)
        if key != _RECORD:
            i = _skip(raw, j, key & 7)
            continue
        size, k = _varint(raw, j)
        end = k + size
        if end > n:
            raise ValueError("a record past the end")
        c = known.get(_varint(raw, k + 1)[0]) if size and raw[k] == _GENERATION else None
        if c is not None and i + c.nbytes <= n and _digest(c.first, c.count, c.mem, raw[i:i + c.nbytes]) == c.digest:
            segs.append(_Seg(c.first, c.count, c.mem, i, i + c.nbytes, c))
            i += c.nbytes
            continue
        rec = pb.FlushedGeneration.FromString(raw[k:end])
        layout.generation_dir(rid, rec.path, rec.generation)
        segs.append(_Seg(rec.generation, 1, rec.in_memory_bytes, i, end))
        i = end
    if i != n:
        raise ValueError("a field past the end")
    return segs


def _chunks(raw: bytes, segs: list[_Seg]) -> dict[int, Chunk]:
    """The chunks of this list: each run of consecutive generations that starts at a chunk's first
    (`_starts`) and stays below the next one's, adjacent in the file (a known chunk as it is, unless
    records joined it)."""
    out: dict[int, Chunk] = {}
    run: list[_Seg] = []

    def close() -> None:
        if run:
            if len(run) == 1 and run[0].chunk is not None:
                out[run[0].first] = run[0].chunk
            else:
                a, b = run[0].start, run[-1].end
                first, count, mem = run[0].first, sum(s.count for s in run), sum(s.mem for s in run)
                out[first] = Chunk(first, count, b - a, _digest(first, count, mem, raw[a:b]), mem)
        run.clear()

    for s in segs:
        last = run[-1] if run else None
        if (last is not None and s.chunk is None and s.first == last.first + last.count
                and (s.first - 1) // CHUNK == (run[0].first - 1) // CHUNK and s.start == last.end):
            run.append(s)
            continue
        close()
        if _starts(s.first):
            run.append(s)
    close()
    return out


class Listed:
    """The generations a manifest lists, their paths validated. `run`: when they are the
    consecutive ascending generations `run[0] .. run[-1]` (the records in that order), planned
    from aggregates; None: `each()` lists them (sorted, as `RegionManifest.generations`).
    `chunks`: what the region's cache keeps for the next pass."""

    def __init__(self, m: region.RegionManifest, segs: list[_Seg] | None, chunks: dict[int, Chunk]):
        self.m, self.rdir, self.chunks = m, layout.region_dir(m.region_id), chunks
        self._segs = segs
        self.run: range | None = None
        if segs and all(b.first == a.first + a.count for a, b in zip(segs, segs[1:])):
            run = range(segs[0].first, segs[-1].first + segs[-1].count)
            # The decoded numbers themselves, compared in C: chunks (even forged ones, digests and
            # all) never stand in for the numbers the merge-order check and the kept set rely on.
            if m.numbers == list(run):
                self.run = run
        self._each: list[tuple[region.Generation, str]] | None = None

    @property
    def numbers(self) -> Sequence[int]:
        """The generation numbers, ascending when `run` is set."""
        return self.run if self.run is not None else [g.generation for g, _ in self.each()]

    def each(self) -> list[tuple[region.Generation, str]]:
        """Every generation with its directory (every path validated again: the rare paths)."""
        if self._each is None:
            rid = self.m.region_id
            self._each = [(g, layout.generation_dir(rid, g.path, g.generation)) for g in self.m.generations]
        return self._each

    def take(self, i: int, j: int) -> list[tuple[region.Generation, str]]:
        """The `i`-th to `j - 1`-th generations (ascending) with their directories."""
        if self.run is None:
            return self.each()[i:j]
        rid, out = self.m.region_id, []
        for want, r in zip(self.run[i:j], self.m.message.flushed_generations[i:j]):
            if r.generation != want:  # chunks that said otherwise: nothing planned from them
                raise region.CorruptManifest(rid, f"generation {r.generation} listed where the checked list "
                                                  f"has {want}")
            out.append((region.Generation(r.generation, r.path, r.in_memory_bytes, r.physical_rows),
                        layout.generation_dir(rid, r.path, r.generation)))
        return out

    def mem(self, i: int, j: int) -> int:
        """`in_memory_bytes` of the `i`-th to `j - 1`-th generations, summed (by chunk)."""
        if self.run is None:
            return sum(int(g.in_memory_bytes or 0) for g, _ in self.each()[i:j])
        lo, fg, total = self.run[0], self.m.message.flushed_generations, 0
        for s in self._segs:
            a, b = max(i, s.first - lo), min(j, s.first - lo + s.count)
            if a >= b:
                continue
            total += s.mem if b - a == s.count else sum(map(operator.attrgetter("in_memory_bytes"), fg[a:b]))
        return total

    def names(self) -> set[str]:
        """Every listed directory name."""
        return {g.path for g in self.m.generations}


def listed(m: region.RegionManifest, known: dict[int, Chunk]) -> Listed:
    """`m`'s listed generations, validated: by the bytes' walk with the `known` chunks, else
    every path as listed (`layout.UnsafePath` names the first invalid one)."""
    try:
        segs = _walk(m.region_id, m.raw, known) if m.raw else None
    except (ValueError, IndexError, DecodeError, layout.UnsafePath):
        segs = None
    if segs is None or sum(s.count for s in segs) != len(m.message.flushed_generations):
        out = Listed(m, None, {})
        out.each()  # raises UnsafePath for the first invalid path
        return out
    return Listed(m, segs, _chunks(m.raw, segs))
