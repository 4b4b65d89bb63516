"""Region manifests: list regions, load the latest version, commit the next one.

Loading follows the spec: read `version_hint.json`, then HEAD-probe the following versions
until one is missing (no listing of the manifest directory on the normal path). Committing is
put-if-absent of version N+1; a lost race reloads, re-applies the change to the fresh manifest
and tries again, so a writer's concurrent flush is never overwritten.
"""

from __future__ import annotations

import json
import logging
import operator
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
from google.protobuf.message import DecodeError

from memwal_core.errors import MemwalError
from memwal_core.options import MAX_REGION_GENERATIONS
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import layout, lease
from memwal_core.state.store import NotFound, ObjectStore

log = logging.getLogger("memwal.region")


class RegionError(MemwalError):
    """Something is wrong with one region; other regions are unaffected."""

    def __init__(self, region_id: str, message: str):
        super().__init__(f"region {region_id}: {message}")
        self.region_id = region_id
        self.detail = message


class CorruptManifest(RegionError):
    pass


class MissingManifest(RegionError):
    pass


class CommitRaceLost(RegionError):
    pass


class MalformedRegion(CorruptManifest):
    """A manifest whose generations cannot be merged (or collected) in order as listed."""


class SealedRegion(RegionError):
    """The region is sealed: no writer claims it again, and memwal commits nothing on it."""


class ManifestGap(CorruptManifest):
    """A later manifest version exists past a missing one: the loaded "latest" is stale."""


class FieldOutOfRange(CorruptManifest):
    """A manifest field holds a value memwal (and the spec) cannot work with; names the field."""

    def __init__(self, region_id: str, key: str, field_name: str, value: object, why: str):
        super().__init__(region_id, f"manifest {key}: field {field_name} = {value!r} is out of range ({why})")
        self.key, self.field, self.value = key, field_name, value


# Versions, epochs, WAL positions, generation numbers and sizes are uint64 on the wire, but
# memwal adds 1 to them (the next version, position or generation), Lance's bit-reversed
# names hold 64 bits, and the snapshot's and Spark's columns are signed 64-bit: anything at
# or above 2^63 is damage, never a value a writer produced.
MAX_COUNTER = 2**63 - 1
_COUNTERS = ("writer_epoch", "replay_after_wal_entry_position", "wal_entry_position_last_seen",
             "current_generation")
_GEN_SIZES = ("in_memory_bytes", "physical_rows", "primary_key_bytes")
KNOWN_STATUS = {pb.ACTIVE: "ACTIVE", pb.SEALED: "SEALED"}
# The largest manifest of MAX_REGION_GENERATIONS generations: an entry is at most ~90 bytes
# (five 10-byte varints, a `{8 hex}_gen_{N}` path, tags), plus 1 MiB for everything else.
MAX_MANIFEST_BYTES = MAX_REGION_GENERATIONS * 128 + (1 << 20)


@dataclass(frozen=True)
class Generation:
    generation: int
    path: str
    in_memory_bytes: int
    physical_rows: int


@dataclass
class RegionManifest:
    """One decoded version of a region manifest, with the exact bytes it was read from."""

    region_id: str
    version: int
    message: pb.RegionManifest  # never changed in place (a commit changes a copy)
    raw: bytes = b""
    _generations: tuple[Generation, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _numbers: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def writer_epoch(self) -> int:
        return self.message.writer_epoch

    @property
    def current_generation(self) -> int:
        return self.message.current_generation

    @property
    def sealed(self) -> bool:
        """Status SEALED: writers refuse to claim the region, so nothing new will be flushed."""
        return self.message.status == pb.SEALED

    @property
    def top_generation(self) -> int:
        """The newest flushed generation the manifest lists (0: none)."""
        return max(self.numbers, default=0)

    @property
    def numbers(self) -> list[int]:
        """The listed generations' numbers, in the file's order. Read once per manifest (each
        is an object built from the message): the field checks and GC's checked list share it."""
        if self._numbers is None:
            self._numbers = list(map(_by_generation, self.message.flushed_generations))
        return self._numbers

    @property
    def generations(self) -> list[Generation]:
        """Flushed generations in ascending order (paths not yet validated). Built once per
        manifest (a region holding its history lists thousands, and a GC pass asks more than
        once); a new list each call, so a caller may change its copy."""
        if self._generations is None:
            gens = [Generation(g.generation, g.path, g.in_memory_bytes, g.physical_rows)
                    for g in self.message.flushed_generations]
            self._generations = tuple(sorted(gens, key=_by_generation))
        return list(self._generations)


_by_generation = operator.attrgetter("generation")


@dataclass
class RegionListing:
    region_ids: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)


def list_regions(store: ObjectStore) -> RegionListing:
    """Region directories under `_mem_wal/`; a name that is not a UUID is skipped with a warning."""
    ids, skipped = [], []
    for name in store.list_dirs(layout.MEM_WAL_DIR):
        if layout.is_region_id(name):
            ids.append(name)
        else:
            reason = "directory name is not a region UUID"
            log.warning("skipping %s/%s: %s", layout.MEM_WAL_DIR, name, reason)
            skipped.append((name, reason))
    return RegionListing(ids, skipped)


def read_version_hint(store: ObjectStore, region_id: str) -> int | None:
    """The hinted latest version, or None when it is missing or garbage (with a warning)."""
    key = layout.version_hint_key(region_id)
    try:
        raw = store.get(key)
    except NotFound:
        return None
    try:
        v = json.loads(raw)["version"]
        if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_COUNTER:
            return v
        raise ValueError(f"bad version {v!r}")
    except Exception as e:  # noqa: BLE001 - any garbage means "no hint"
        log.warning("region %s: ignoring unreadable %s (%s)", region_id, key, e)
        return None


def write_version_hint(store: ObjectStore, region_id: str, version: int) -> None:
    """Best effort, as the spec allows: a failed hint only costs readers extra probes."""
    try:
        store.put(layout.version_hint_key(region_id),
                  json.dumps({"version": version}, separators=(",", ":")).encode())
    except Exception as e:  # noqa: BLE001
        log.info("region %s: version hint not updated (%s)", region_id, e)


def decode_manifest(region_id: str, version: int, raw: bytes) -> RegionManifest:
    key = _manifest_key_or_raise(region_id, version)
    if not raw:
        raise CorruptManifest(region_id, f"manifest {key} (version {version}) is empty")
    if len(raw) > MAX_MANIFEST_BYTES:  # refused before decoding: it cannot hold fewer entries than the limit
        raise FieldOutOfRange(region_id, key, "flushed_generations", f"{len(raw)} bytes",
                              f"more than {MAX_MANIFEST_BYTES} bytes, so more than {MAX_REGION_GENERATIONS} "
                              "generations; the region is refused as too large to plan")
    try:
        msg = pb.RegionManifest.FromString(raw)
    except DecodeError as e:
        raise CorruptManifest(region_id, f"manifest {key} (version {version}) cannot be decoded: {e}") from None
    if msg.version != version:
        raise CorruptManifest(region_id, f"manifest {key} says version {msg.version}, expected "
                                         f"version {version} (truncated or misplaced file)")
    if not msg.HasField("region_id"):
        # pylance writes region_id (field 11) last but for defaults, so a file cut short at a
        # field boundary still decodes: without this check it would silently lose generations.
        raise CorruptManifest(region_id, f"manifest {key} (version {version}) has no region_id "
                                         "(truncated, or not a region manifest)")
    if msg.region_id.uuid != uuid.UUID(region_id).bytes:
        raise CorruptManifest(region_id, f"manifest {key} (version {version}) belongs to region "
                                         f"{_uuid_str(msg.region_id.uuid)}")
    out = RegionManifest(region_id, version, msg, raw)
    check_fields(region_id, key, msg, raw, out.numbers)
    return out


def _manifest_key_or_raise(region_id: str, version: int) -> str:
    if not 1 <= version <= MAX_COUNTER:  # a file named past 2^63 (listing) or a hint: damage
        raise FieldOutOfRange(region_id, f"{layout.manifest_dir(region_id)}/<version {version}>", "version",
                              version, "versions run from 1 to 2^63-1")
    return layout.manifest_key(region_id, version)


def check_fields(region_id: str, key: str, msg: pb.RegionManifest, raw: bytes | None = None,
                 numbers: list[int] | None = None) -> None:
    """Refuse a manifest whose fields memwal cannot do arithmetic on, or does not know.

    Each failure is a `FieldOutOfRange` naming the region, the file, the field and its value,
    so the region is refused (walled, skipped by GC, its previous snapshot row kept) instead of
    failing later with a bare `ValueError` deep inside a job. `raw`: the bytes `msg` was decoded
    from, when known: the generations' sizes are then read only if the bytes could hold a value
    past 2^63-1 (`_may_exceed_counter`). `numbers`: the generations' numbers as listed, when
    already read (`RegionManifest.numbers`).
    """
    def bad(name: str, value: object, why: str) -> FieldOutOfRange:
        return FieldOutOfRange(region_id, key, name, value, why)

    for name in _COUNTERS:  # (version equals the file's, checked in range by the caller)
        v = getattr(msg, name)
        if v > MAX_COUNTER:
            raise bad(name, v, "at most 2^63-1")
    if msg.status not in KNOWN_STATUS:
        raise bad("status", msg.status, "memwal knows ACTIVE (0) and SEALED (1) only; a newer writer's "
                                        "status may forbid what memwal would do")
    n = len(msg.flushed_generations)
    if n > MAX_REGION_GENERATIONS:
        raise bad("flushed_generations", f"{n} entries", f"more than {MAX_REGION_GENERATIONS} generations; "
                  "the region is refused as too large to plan (a healthy region lists only the generations "
                  "not yet merged or trimmed: repair the manifest)")
    # Loose here (<= current_generation: the spec's flush steps can be read either way); the
    # merger's `pending_generations` insists on < for what it merges, as pylance writes it.
    cur = msg.current_generation
    fg = msg.flushed_generations
    # Checked a field at a time (a region may list thousands of generations, read on every pass);
    # when one is out of range, one entry at a time, to name the first offending one.
    if numbers is None:
        numbers = list(map(_by_generation, fg))
    if numbers and (min(numbers) < 1 or max(numbers) > cur or _may_exceed_counter(raw) and any(
            max(map(operator.attrgetter(name), fg)) > MAX_COUNTER for name in _GEN_SIZES)):
        for i, g in enumerate(fg):
            if not 1 <= g.generation <= cur:
                raise bad(f"flushed_generations[{i}].generation", g.generation,
                          f"generations run from 1 to current_generation = {cur}")
            for name in _GEN_SIZES:
                v = getattr(g, name)
                if v > MAX_COUNTER:
                    raise bad(f"flushed_generations[{i}].{name}", v, "at most 2^63-1")


# A varint of 2^63 or more has at least 64 significant bits, so at least ten bytes, the first nine
# with the continuation bit set; bytes without nine such in a row hold no such value in any field.
_NINE_CONTINUED = b"\x01" * 9


def _may_exceed_counter(raw: bytes | None) -> bool:
    """Whether a field in `raw` may hold a varint past `MAX_COUNTER` (unknown bytes: yes). A
    region manifest lists thousands of generations on every read; one scan of its bytes (their
    continuation bits, in numpy: a tenth of the time of `bytes.translate`) spares reading three
    sizes of each."""
    return raw is None or _NINE_CONTINUED in (np.frombuffer(raw, np.uint8) >> 7).tobytes()


def check_spec(m: RegionManifest, spec_ids: Iterable[int]) -> None:
    """Refuse a region bound to a region spec the MemWAL index does not define (0 = manual).

    Its rows cannot be routed or checked against a spec memwal cannot see; merging them would
    accept whatever a writer with another index wrote."""
    known = sorted(set(spec_ids))
    sid = m.message.region_spec_id
    if sid and sid not in known:
        raise FieldOutOfRange(m.region_id, layout.manifest_key(m.region_id, m.version), "region_spec_id", sid,
                              f"not a region spec of the MemWAL index (known: 0 = manual"
                              f"{', ' if known else ''}{', '.join(map(str, known))})")


def _uuid_str(b: bytes) -> str:
    try:
        return str(uuid.UUID(bytes=b))
    except ValueError:
        return b.hex()


def load_version(store: ObjectStore, region_id: str, version: int) -> RegionManifest:
    try:
        raw = store.get(_manifest_key_or_raise(region_id, version))
    except NotFound:
        raise MissingManifest(region_id, f"manifest version {version} does not exist") from None
    return decode_manifest(region_id, version, raw)


def probe_latest_version(store: ObjectStore, region_id: str, start: int | None = None, *,
                         start_exists: bool = False) -> int:
    """Latest existing manifest version by existence probes from `start` (or the hint).

    `start_exists=True` (a version seen before, e.g. a sensor cursor) skips re-probing `start`
    itself, so an unchanged region costs exactly one request. The manifest directory is listed
    (one bounded request: retention keeps it short) only when probing could return a stale
    version: the start version is missing (collected by GC, or a garbage or stale hint), or
    there is no usable `version_hint.json` to start from — probing from version 1 would stop
    at the first gap (a torn GC delete leaves old versions behind) and silently read an old
    manifest as the latest.
    """
    if start is None:
        hint = read_version_hint(store, region_id)
        if hint is None:
            return _latest_by_listing(store, region_id, None)
        start, start_exists = hint, False
    if not start_exists and not store.exists(layout.manifest_key(region_id, start)):
        return _latest_by_listing(store, region_id, start)
    v = start
    while store.exists(layout.manifest_key(region_id, v + 1)):
        v += 1
    return v


def verified_latest_version(store: ObjectStore, region_id: str, known: int = 0) -> int:
    """Latest version without trusting a remembered one: for a reader whose `known` version
    may have been collected since it was seen (a sensor after downtime).

    Starts at max(hint, known) when that version still exists (probing forward), else lists
    the manifest directory; with no usable hint it lists too, since `known` alone may sit
    below a gap. Costs a GET and a HEAD (plus the forward probes) when the hint is good.
    """
    hint = read_version_hint(store, region_id)
    if hint is None:
        return _latest_by_listing(store, region_id, None)
    return probe_latest_version(store, region_id, max(hint, known))


def listed_versions(store: ObjectStore, region_id: str) -> list[int]:
    """Every manifest version on disk, ascending (one listing of the manifest directory)."""
    return sorted(v for v in (layout.parse_bitrev(o.key.rsplit("/", 1)[-1])
                              for o in store.list(layout.manifest_dir(region_id))
                              if o.key.endswith(layout.MANIFEST_SUFFIX)) if v)


def _latest_by_listing(store: ObjectStore, region_id: str, start: int | None) -> int:
    versions = listed_versions(store, region_id)
    if not versions:
        raise MissingManifest(region_id, f"no manifest under {layout.manifest_dir(region_id)}/")
    latest = versions[-1]
    if start is None:  # no usable hint: normal after a crash before the hint write; say it quietly
        log.info("region %s: no usable version hint; found latest version %d by listing", region_id, latest)
    else:
        log.warning("region %s: manifest version %d not found; found latest version %d by listing",
                    region_id, start, latest)
    return latest


def load_latest(store: ObjectStore, region_id: str, start: int | None = None) -> RegionManifest:
    return load_version(store, region_id, probe_latest_version(store, region_id, start))


@dataclass(frozen=True)
class RegionRead:
    """One region's latest manifest, or why it could not be read: the one per-region outcome
    every job and report works from (never a manifest-or-exception to tell apart by type)."""

    region_id: str
    manifest: RegionManifest | None = None
    error: RegionError | None = None

    def __post_init__(self) -> None:
        if (self.manifest is None) == (self.error is None):
            raise ValueError("a RegionRead holds a manifest or an error, exactly one")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def permanent(self) -> bool:
        """The manifest itself is wrong (corrupt, a gap): it stays so until repaired; anything
        else (I/O, a missing manifest) may pass, and the next run reads again."""
        return isinstance(self.error, CorruptManifest)

    @property
    def message(self) -> str:
        """The error as reported (it names the region); empty when the read succeeded."""
        return str(self.error) if self.error is not None else ""


class RegionReads(dict[str, RegionRead]):
    """Region id -> `RegionRead`, as `load_many` returns them."""

    @property
    def manifests(self) -> dict[str, RegionManifest]:
        """The regions that were read, by region id."""
        return {rid: r.manifest for rid, r in self.items() if r.manifest is not None}

    @property
    def region_errors(self) -> dict[str, str]:
        """The regions that could not be read: region id -> what went wrong."""
        return {rid: r.message for rid, r in self.items() if r.error is not None}


def read_region(store: ObjectStore, region_id: str, start: int | None = None) -> RegionRead:
    """`load_latest` as an outcome: a failure is returned (as a `RegionError`), never raised."""
    try:
        return RegionRead(region_id, manifest=load_latest(store, region_id, start))
    except Exception as e:  # noqa: BLE001 - one broken region must not stop the others
        return RegionRead(region_id, error=as_region_error(region_id, e))


def as_region_error(region_id: str, e: BaseException) -> RegionError:
    """`e` as a `RegionError` naming the region (unchanged when it is one already)."""
    return e if isinstance(e, RegionError) else RegionError(region_id, f"{type(e).__name__}: {e}")


def load_many(store: ObjectStore, region_ids: Iterable[str], *, max_workers: int = 16,
              starts: dict[str, int] | None = None) -> RegionReads:
    """Latest manifests of many regions, probed in parallel; a failure is returned, not raised."""
    starts = starts or {}
    ids = list(region_ids)
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(ids) or 1))) as pool:
        return RegionReads(zip(ids, pool.map(lambda rid: read_region(store, rid, starts.get(rid)), ids)))


# A change applied to a fresh copy of the latest manifest; returns False when, on that fresh
# manifest, there is nothing left to change (the commit is then skipped).
Mutation = Callable[[pb.RegionManifest], bool]


def commit_next(store: ObjectStore, current: RegionManifest, mutate: Mutation, *,
                max_attempts: int = 10) -> RegionManifest | None:
    """Commit `mutate(latest)` as the next version with put-if-absent.

    On a lost race the latest manifest is reloaded and `mutate` re-applied, so fields written
    by the winner (a writer's flush, its epoch) are kept. Returns the committed manifest, or
    None when `mutate` found nothing to change. Never touches `writer_epoch`. Refuses
    (`SealedRegion`) to commit on a sealed region: whoever sealed it expects that version to
    stay the last one, so a caller that must not act on the old version (GC's trim) stops too.
    """
    for _ in range(max_attempts):
        if current.sealed:
            raise SealedRegion(current.region_id, f"sealed at manifest version {current.version}; "
                                                  "memwal commits no new manifest version on a sealed region")
        msg = pb.RegionManifest()
        msg.CopyFrom(current.message)
        if not mutate(msg):
            return None
        if msg.writer_epoch != current.message.writer_epoch:
            raise ValueError("memwal never changes a region's writer_epoch")
        version = current.version + 1
        msg.version = version
        raw = msg.SerializeToString()
        _refuse_gap(store, current.region_id, version)
        lease.fence_store(store, f"region {current.region_id} manifest version {version}")
        if store.put_if_absent(layout.manifest_key(current.region_id, version), raw):
            write_version_hint(store, current.region_id, version)
            return RegionManifest(current.region_id, version, msg, raw)
        log.info("region %s: manifest version %d taken by another committer; reloading",
                 current.region_id, version)
        current = load_latest(store, current.region_id, start=version)
    raise CommitRaceLost(current.region_id, f"gave up committing after {max_attempts} lost races")


def _refuse_gap(store: ObjectStore, region_id: str, version: int) -> None:
    """Refuse to commit `version` when `version + 1` already exists but `version` does not.

    Existence probes stop at the first missing version, so with versions 1, 2, 4 on disk (3
    deleted by hand, or lost) and no usable hint, "latest" is 2. Committing 3 there would put
    memwal's change *under* version 4, where every reader and writer ignores it (a GC trim
    would then delete generations that version 4 still lists). Committers never leave gaps, so
    N+2 without N+1 is damage, not a race: a racing committer cannot write N+2 before N+1
    exists, hence N+1 is probed after N+2. Costs one HEAD per commit attempt (gaps wider than
    one version are found by listing only; see docs/reliability.md).
    """
    if store.exists(layout.manifest_key(region_id, version + 1)) and \
            not store.exists(layout.manifest_key(region_id, version)):
        raise ManifestGap(region_id, f"manifest version {version} is missing but version {version + 1} "
                                     f"exists (a gap in {layout.manifest_dir(region_id)}/): the latest "
                                     f"version found by probing, {version - 1}, is stale; not committing "
                                     "on it (restore the missing version or repair the region)")


def region_uuid_bytes(region_id: str) -> bytes:
    return uuid.UUID(region_id).bytes


def region_id_str(raw: bytes) -> str:
    return _uuid_str(raw)


def pending_generations(m: RegionManifest, merged: int) -> list[Generation]:
    """The generations of `m` above merge progress `merged`, checked to be mergeable in order.

    The spec's writers flush generations 1, 2, 3, ... and list each one; progress claims every
    generation up to it. So what is listed above progress must be exactly merged+1, merged+2, ...
    below `current_generation`. Anything else (a gap, a number listed twice, progress ahead of
    what the region ever flushed: a reset directory or a reused UUID) means merging as listed
    could skip or shadow a write, and collecting by progress could delete a generation nobody
    merged: `MalformedRegion`. The merger refuses such a region and GC collects nothing in it.
    """
    listed = m.generations
    numbers = [g.generation for g in listed]
    twice = sorted(n for n, c in Counter(numbers).items() if c > 1)
    if twice:
        raise MalformedRegion(m.region_id, f"generation(s) {twice} are listed more than once")
    if merged and merged >= m.current_generation:
        raise MalformedRegion(m.region_id, f"recorded merge progress {merged} is at or past the region's "
                                           f"current_generation {m.current_generation}: the region was reset "
                                           "or its UUID reused; merging (and GC) would treat new generations as merged")
    pending = [g for g in listed if g.generation > merged]
    for want, g in zip(range(merged + 1, merged + 1 + len(pending)), pending):
        if g.generation != want:
            raise MalformedRegion(m.region_id, f"generation {want} is not listed but {g.generation} is (merged "
                                               f"progress {merged}): generations above progress must be contiguous")
    if pending and pending[-1].generation >= m.current_generation:
        raise MalformedRegion(m.region_id, f"generation {pending[-1].generation} is listed but current_generation "
                                           f"is {m.current_generation}")
    return pending
