"""Every path and name memwal reads or writes under a table root.

One module builds all keys so that what GC compares and deletes is spelled exactly like what
the planner read (peer systems deleted live data when two spellings of a path disagreed).
Anything taken from a manifest is validated here before it is opened or deleted.
"""

from __future__ import annotations

import functools
import re
import uuid

from memwal_core.errors import MemwalError

MEM_WAL_DIR = "_mem_wal"
MANIFEST_SUFFIX = ".binpb"
WAL_SUFFIX = ".arrow"
VERSION_HINT = "version_hint.json"
# memwal's own bookkeeping, beside Lance's directories and outside pylance's `_mem_wal/`.
MEMWAL_DIR = "_memwal"
GC_PENDING_DIR = f"{MEMWAL_DIR}/gc_pending"
WALLS_DIR = f"{MEMWAL_DIR}/walls"
# Merge commits not verified yet (`jobs/merge/unverified.py`): one marker per commit in flight.
UNVERIFIED_DIR = f"{MEMWAL_DIR}/unverified"
_UNVERIFIED_NAME = re.compile(r"^([0-9a-f]{32})\.json$")
LIFECYCLE_KEY = f"{MEMWAL_DIR}/lifecycle.json"  # stale-region verdicts (`state/lifecycle.py`)
# What GC learned of the retained base-table versions, a cache (`jobs/gc/history.py`).
GC_VERSIONS_KEY = f"{MEMWAL_DIR}/gc_versions.json"
# Its older versions, sealed: one object named by its digest (`jobs/gc/fact_segments.py`).
GC_VERSIONS_DIR = f"{MEMWAL_DIR}/gc_versions"
# The files the retained base-table versions reference, a cache (`jobs/gc/leak_refs.py`).
GC_REFS_KEY = f"{MEMWAL_DIR}/gc_refs.json"
# What GC learned of each region's WAL entries and manifest versions, a cache (`jobs/gc/region_cache.py`).
GC_REGIONS_DIR = f"{MEMWAL_DIR}/gc_regions"
# Trusted region values, one record per MemWAL initialization and region (`state/value_records.py`):
# `region_values/{initialization table version:020d}/{region}.json`.
VALUE_RECORDS_DIR = f"{MEMWAL_DIR}/region_values"
# The table lease (`state/lease.py`): one object per fencing token, `{token:020d}.json`.
LEASE_DIR = f"{MEMWAL_DIR}/lease"
_LEASE_NAME = re.compile(r"^([0-9]{20})\.json$")

_GEN_DIR = re.compile(r"^[0-9a-f]{8}_gen_([1-9][0-9]*)$")
_ORPHAN_CANDIDATE = re.compile(r"^.+_gen_([0-9]+)$")
_BITREV = re.compile(r"^[01]{64}$")


class UnsafePath(MemwalError, ValueError):
    """A manifest-supplied path that could escape its region directory or is not a generation."""


def bitrev(n: int) -> str:
    """Lance's bit-reversed 64-bit name: spreads sequential ids over the S3 key space."""
    if not 0 <= n < 2**64:
        raise ValueError(f"{n} does not fit in 64 bits")
    return format(n, "064b")[::-1]


def parse_bitrev(name: str) -> int | None:
    """Inverse of `bitrev` for a file name (suffix allowed); None if it is not one."""
    stem = name.split(".", 1)[0]
    return int(stem[::-1], 2) if _BITREV.fullmatch(stem) else None


@functools.lru_cache(maxsize=4096)  # every key of a region is built from its id: checked once per process
def is_region_id(name: str) -> bool:
    try:
        return str(uuid.UUID(name)) == name.lower() and len(name) == 36
    except ValueError:
        return False


def _checked(region_id: str) -> str:
    """A region id that is safe inside a key: a UUID, nothing else (it comes from listings)."""
    if not is_region_id(region_id):
        raise UnsafePath(f"not a region id (UUID): {region_id!r}")
    return region_id


def region_dir(region_id: str) -> str:
    return f"{MEM_WAL_DIR}/{_checked(region_id)}"


def manifest_dir(region_id: str) -> str:
    return f"{region_dir(region_id)}/manifest"


def manifest_key(region_id: str, version: int) -> str:
    return f"{manifest_dir(region_id)}/{bitrev(version)}{MANIFEST_SUFFIX}"


def version_hint_key(region_id: str) -> str:
    return f"{manifest_dir(region_id)}/{VERSION_HINT}"


def gc_pending_key(region_id: str) -> str:
    """GC's intent marker for a region: present while (or after) a delete of its WAL entries or
    manifest versions is under way or failed part-way."""
    return f"{GC_PENDING_DIR}/{_checked(region_id)}"


def gc_region_cache_key(region_id: str) -> str:
    """What GC learned of a region's WAL entries and manifest versions (a cache)."""
    return f"{GC_REGIONS_DIR}/{_checked(region_id)}.json"


def wall_key(region_id: str) -> str:
    """The merger's record of a region stuck behind a permanent wall (`state/walls.py`)."""
    return f"{WALLS_DIR}/{_checked(region_id)}.json"


def unverified_key(commit_id: str) -> str:
    """The merger's marker of a merge commit in flight, deleted once the commit is verified."""
    if not _UNVERIFIED_NAME.fullmatch(f"{commit_id}.json"):
        raise UnsafePath(f"not a commit id (32 hex digits): {commit_id!r}")
    return f"{UNVERIFIED_DIR}/{commit_id}.json"


def unverified_id_of(key: str) -> str | None:
    """The commit id of a listed marker key; None for anything else under its directory."""
    m = _UNVERIFIED_NAME.fullmatch(key.removeprefix(UNVERIFIED_DIR + "/"))
    return m.group(1) if m and key == f"{UNVERIFIED_DIR}/{m.group(0)}" else None


def value_records_dir(init_version: int) -> str:
    """The records of region values of the lifetime whose MemWAL initialization is table
    version `init_version`."""
    if not 0 < init_version < 10**20:
        raise ValueError(f"initialization table version {init_version} out of range")
    return f"{VALUE_RECORDS_DIR}/{init_version:020d}"


def value_record_key(init_version: int, region_id: str) -> str:
    """The record of one region's trusted value in the lifetime initialized at `init_version`."""
    return f"{value_records_dir(init_version)}/{_checked(region_id)}.json"


def value_record_region(key: str, init_version: int) -> str | None:
    """The region of a listed record key of that lifetime; None for anything else."""
    name = key.removeprefix(value_records_dir(init_version) + "/")
    if name == key or not name.endswith(".json"):
        return None
    rid = name[: -len(".json")]
    return rid if is_region_id(rid) and key == value_record_key(init_version, rid) else None


def lease_key(token: int) -> str:
    """The lease record of fencing token `token` (zero-padded: names sort as tokens do)."""
    if not 0 < token < 10**20:
        raise ValueError(f"lease token {token} out of range")
    return f"{LEASE_DIR}/{token:020d}.json"


def lease_token_of(key: str) -> int | None:
    """The token of a listed lease key; None for anything else under the lease directory."""
    if not key.startswith(LEASE_DIR + "/"):
        return None
    m = _LEASE_NAME.fullmatch(key[len(LEASE_DIR) + 1:])
    return int(m.group(1)) if m else None


def wal_dir(region_id: str) -> str:
    return f"{region_dir(region_id)}/wal"


def wal_key(region_id: str, position: int) -> str:
    return f"{wal_dir(region_id)}/{bitrev(position)}{WAL_SUFFIX}"


def validate_generation_path(path: str, generation: int | None = None) -> str:
    """Reject a manifest-supplied generation directory unless it is exactly `{8 hex}_gen_{N}`.

    That pattern has no `/`, no `..` and cannot be absolute, so the directory can only be a
    direct child of its region directory. When `generation` is given, N must equal it.
    """
    if not isinstance(path, str) or not path:
        raise UnsafePath(f"empty generation path {path!r}")
    if path.startswith("/") or "\\" in path or "/" in path or ".." in path or ":" in path:
        raise UnsafePath(f"unsafe generation path {path!r}: must be a plain directory name")
    m = _GEN_DIR.fullmatch(path)  # not .match: '$' would also accept a trailing newline
    if not m:
        raise UnsafePath(f"generation path {path!r} does not match '{{8 hex}}_gen_{{N}}'")
    if generation is not None and int(m.group(1)) != generation:
        raise UnsafePath(f"generation path {path!r} does not belong to generation {generation}")
    return path


def generation_dir(region_id: str, path: str, generation: int | None = None) -> str:
    """Key prefix of a flushed generation, after validating the manifest-supplied `path`."""
    rdir = region_dir(region_id)
    try:
        return f"{rdir}/{validate_generation_path(path, generation)}"
    except UnsafePath as e:
        raise UnsafePath(f"region {region_id}: {e}") from None


def generation_of_dir(name: str) -> int | None:
    """The N of a `*_gen_N` directory name (orphan sweep); None if it does not look like one."""
    m = _ORPHAN_CANDIDATE.fullmatch(name)
    return int(m.group(1)) if m else None


def is_inside(key: str, directory: str) -> bool:
    """True when `key` lies strictly inside `directory` (both normalized store keys)."""
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return False
    return key.startswith(directory.rstrip("/") + "/")
