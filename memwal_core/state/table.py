"""The base table: open it, its primary key, and the full MemWAL index details.

pylance only shows a summary of the `__lance_mem_wal` index, so the complete
`MemWalIndexDetails` bytes are read from the table manifest itself (footer -> Manifest ->
IndexSection -> IndexMetadata.index_details). Replacing those details is **guarded**: a commit
built from a stale read would silently erase merge progress recorded in between, so it is
committed as exactly `read_version + 1` or not at all (`state/exclusive_commit.py`).
"""

from __future__ import annotations

import logging
import struct
import uuid
from dataclasses import dataclass

import lance
from google.protobuf.message import DecodeError

from memwal_core.errors import MemwalError
from memwal_core.proto import memwal_pb2 as pb
from memwal_core.state import exclusive_commit
from memwal_core.state.exclusive_commit import manifest_keys  # noqa: F401 - where callers look for it
from memwal_core.state.store import ObjectInfo, TableLocation

log = logging.getLogger("memwal.table")

MEMWAL_INDEX_NAME = "__lance_mem_wal"
MEMWAL_TYPE_URL = "/lance.table.MemWalIndexDetails"
PK_METADATA_KEY = b"lance-schema:unenforced-primary-key"
PK_POSITION_METADATA_KEY = b"lance-schema:unenforced-primary-key:position"


class TableError(MemwalError):
    """The base table cannot be maintained as it is (clear, user-facing message)."""


class NoPrimaryKey(TableError):
    pass


class MemWalNotInitialized(TableError):
    pass


class StableRowIds(TableError):
    pass


class UnknownFeature(TableError):
    """The table uses a Lance feature (flag) or a region transform memwal does not know."""


# Lance manifest feature flags memwal knows what to do with: deletion files (1), stable row
# ids (2, refused with its own reason by `refuse_stable_row_ids`), the deprecated v2-format
# bit (4), table config (8), base paths (16), no transaction file (32). Any other bit (data
# overlay files, MemWAL index catch-up semantics, whatever comes next) changes what a reader
# or writer must do, so memwal refuses the table before any work rather than guess.
KNOWN_FEATURE_FLAGS = 1 | 2 | 4 | 8 | 16 | 32
# Region transforms the spec names (plus pylance's `unsharded`); anything else with no
# expression has no meaning memwal (or the spec) can give it.
KNOWN_TRANSFORMS = ("identity", "year", "month", "day", "hour", "bucket", "multi_bucket", "truncate", "unsharded")


def varint(b: bytes, i: int) -> tuple[int, int]:
    """The protobuf varint at `b[i:]` and the offset after it (for the Lance manifest fields
    memwal's proto does not declare)."""
    r = shift = 0
    while True:
        if i >= len(b) or shift > 63:
            raise ValueError("truncated varint")
        x = b[i]
        i += 1
        r |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return r, i


def feature_flags(head: bytes) -> tuple[int, int]:
    """(reader_feature_flags, writer_feature_flags) of a Lance manifest message (fields 9, 10),
    scanned from the wire format: memwal's proto does not declare them."""
    flags = {9: 0, 10: 0}
    i, n = 0, len(head)
    while i < n:
        tag, i = varint(head, i)
        num, wire = tag >> 3, tag & 7
        if wire == 0:
            v, i = varint(head, i)
            if num in flags:
                flags[num] = v
        elif wire == 1:
            i += 8
        elif wire == 2:
            length, i = varint(head, i)
            i += length
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"wire type {wire}")
    return flags[9], flags[10]


def refuse_unknown_features(where: str, head: bytes, details: pb.MemWalIndexDetails | None) -> None:
    """Refuse a table with feature flags or region transforms memwal does not know, naming them."""
    try:
        reader, writer = feature_flags(head)
    except ValueError as e:
        raise TableError(f"{where}: cannot read the table manifest's feature flags: {e}") from None
    for name, v in (("reader_feature_flags", reader), ("writer_feature_flags", writer)):
        unknown = v & ~KNOWN_FEATURE_FLAGS
        if unknown:
            bits = ", ".join(str(1 << b) for b in range(64) if unknown >> b & 1)
            raise UnknownFeature(
                f"{where}: {name} = {v} has bits memwal does not know ({bits}): a newer Lance wrote this "
                "table with a feature memwal cannot honour; refusing it before any work (upgrade memwal)")
    for spec in details.region_specs if details is not None else []:
        for f in spec.fields:
            if f.HasField("transform") and f.transform not in KNOWN_TRANSFORMS and not f.expression:
                raise UnknownFeature(
                    f"{where}: region spec {spec.spec_id} field {f.field_id!r} has transform {f.transform!r}, "
                    f"which is not one the spec defines ({', '.join(KNOWN_TRANSFORMS)}); refusing the table")


class LostRace(TableError):
    """Another commit landed between our read and our guarded commit: re-read and rebuild."""


def open_dataset(loc: TableLocation, version: int | None = None, commit_lock=None) -> lance.LanceDataset:
    try:
        return lance.dataset(loc.lance_uri, version=version, storage_options=loc.storage_options or None,
                             commit_lock=commit_lock)
    except (ValueError, OSError) as e:
        # One line: Lance's S3 errors embed the server's multi-line XML body (with the S3 code).
        one_line = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
        raise TableError(f"cannot open Lance table {loc.lance_uri}: {one_line}") from None


def open_latest(loc: TableLocation, newest_known: int | None = None) -> lance.LanceDataset:
    """The table at its latest version. `newest_known`: a version the caller found to be the
    newest moments ago (GC probes for it): when it exists and no version above it does, it is
    opened by number, which reads one manifest, where opening the latest makes Lance list
    `_versions/`, a listing that grows with the retained history. A commit landing right after
    the check is the race a listing has too: the caller reads a version that was the latest."""
    if newest_known is not None and head_manifest(loc, newest_known + 1) is None \
            and head_manifest(loc, newest_known) is not None:
        return open_dataset(loc, version=newest_known)
    return open_dataset(loc)


def head_manifest(loc: TableLocation, version: int) -> ObjectInfo | None:
    """The manifest of table `version` (Lance's V2 naming first), or None."""
    for key in manifest_keys(version):
        info = loc.store.head(key)
        if info is not None:
            return info
    return None


def primary_key(ds: lance.LanceDataset) -> list[str]:
    """Primary key columns in key order: the one place memwal learns the key.

    Lance writes the key in two forms: `lance-schema:unenforced-primary-key: true` (pylance's
    `initialize_mem_wal` users, key order = field order) and
    `lance-schema:unenforced-primary-key:position: 'N'` (Lance 13 / LanceDB 0.40
    `set_unenforced_primary_key`, key order = N). pylance's own accessor
    (`lance_schema.unenforced_primary_key()`) knows both and orders them as Lance does
    (positioned fields by position, then the others by field id); memwal takes that order
    so its merge keys and delete predicates match what Lance's LSM readers dedupe on.
    """
    cols = _pk_from_lance(ds)
    if cols is None:  # a pylance without the accessor: parse both forms by hand
        cols = pk_from_metadata(ds.schema)
    if not cols:
        raise NoPrimaryKey(
            f"table {ds.uri} has no primary key: MemWAL merges upsert by primary key, so mark the key "
            "column with field metadata {'lance-schema:unenforced-primary-key': 'true'}")
    top = set(ds.schema.names)
    nested = [c for c in cols if c not in top]
    if nested:
        raise NoPrimaryKey(f"table {ds.uri}: primary key field(s) {nested} are not top-level columns; "
                           "memwal merges by top-level key columns only")
    return cols


def _pk_from_lance(ds: lance.LanceDataset) -> list[str] | None:
    try:
        fields = ds.lance_schema.unenforced_primary_key()
    except AttributeError:
        return None
    return [f.name() for f in fields]


def pk_from_metadata(schema) -> list[str]:
    """Key columns from field metadata, both forms, in Lance's order (see `primary_key`)."""
    positioned, flagged = [], []
    for i, f in enumerate(schema):
        md = f.metadata or {}
        pos = md.get(PK_POSITION_METADATA_KEY)
        if pos is not None:
            try:
                positioned.append((int(pos), i, f.name))
            except ValueError:
                continue
        elif md.get(PK_METADATA_KEY, b"").lower() == b"true":
            flagged.append(f.name)
    return [n for _, _, n in sorted(positioned)] + flagged


def refuse_stable_row_ids(ds: lance.LanceDataset) -> None:
    """The merger cannot keep stable row ids: refuse such a table with the reason.

    A table created with `enable_stable_row_ids=True` promises that a row keeps its `_rowid`
    from the moment it is written. MemWAL generations carry no row ids, so the merger's
    `merge_insert` mints ids for the rows it inserts at merge time (and a key deleted and
    re-put gets a new one): ids would not be those of the write. pylance 14 has no commit that
    takes preassigned row ids, so merging such a table would silently break the promise.
    """
    if ds.has_stable_row_ids:
        raise StableRowIds(
            f"table {ds.uri} uses stable row ids (created with enable_stable_row_ids): the merger's "
            "merge_insert would mint new row ids at merge time for rows written through MemWAL, breaking "
            "the stable-id promise; pylance 14 has no commit with preassigned row ids, so memwal refuses "
            "to merge this table (nothing was changed)")


@dataclass
class MemWalState:
    """The MemWAL index as of one table version."""

    table_version: int
    index: pb.IndexMetadata
    details: pb.MemWalIndexDetails
    raw_details: bytes

    @property
    def merged(self) -> dict[str, int]:
        """merged_generations by region id (spec word; pylance: compacted_sstables)."""
        return {str(uuid.UUID(bytes=m.region_id.uuid)): m.generation for m in self.details.merged_generations}

    @property
    def catchup(self) -> dict[str, dict[str, int]]:
        """index_catchup: index name -> region id -> caught-up generation."""
        return {c.index_name: {str(uuid.UUID(bytes=g.region_id.uuid)): g.generation
                               for g in c.caught_up_generations}
                for c in self.details.index_catchup}

    def gating_indexes(self, existing: list[str]) -> list[str]:
        """Indexes whose catch-up gates GC: `maintained_indexes`, or all when maintain_all."""
        if self.details.HasField("maintain_all_indexes") and self.details.maintain_all_indexes:
            return sorted(n for n in existing if n != MEMWAL_INDEX_NAME)
        return sorted(self.details.maintained_indexes)


def read_manifest_bytes(loc: TableLocation, version: int) -> bytes:
    found = exclusive_commit.read_manifest(loc, version)
    if found is None:
        raise TableError(f"table {loc.lance_uri}: manifest of version {version} not found")
    return found[1]


def parse_index_section(raw: bytes, where: str) -> tuple[int, list[pb.IndexMetadata]]:
    """(table version, indices) from a Lance manifest file's bytes."""
    try:
        if len(raw) < 16 or raw[-4:] != b"LANC":
            raise ValueError("no LANC footer")
        (offset,) = struct.unpack_from("<Q", raw, len(raw) - 16)
        (length,) = struct.unpack_from("<I", raw, offset)
        head = pb.TableManifestHead.FromString(raw[offset + 4: offset + 4 + length])
        refuse_unknown_features(where, raw[offset + 4: offset + 4 + length], None)
        if not head.HasField("index_section"):
            return head.version, []
        (ilen,) = struct.unpack_from("<I", raw, head.index_section)
        section = pb.IndexSection.FromString(raw[head.index_section + 4: head.index_section + 4 + ilen])
        return head.version, list(section.indices)
    except (struct.error, DecodeError, ValueError) as e:
        raise TableError(f"{where}: cannot read the table manifest: {e}") from None


def read_memwal_state(loc: TableLocation, version: int | None = None) -> MemWalState:
    """Full MemWAL index details of `version` (default: latest)."""
    if version is None:
        version = open_dataset(loc).version
    return memwal_state_of(read_manifest_bytes(loc, version), f"table {loc.lance_uri} version {version}")


def commit_timestamp(raw: bytes) -> float | None:
    """Lance's `Manifest.timestamp` (field 7, a protobuf Timestamp) of a manifest file's bytes,
    in epoch seconds to the microsecond (as `LanceDataset.versions()` gives it); None if absent."""
    from google.protobuf.timestamp_pb2 import Timestamp

    try:
        (offset,) = struct.unpack_from("<Q", raw, len(raw) - 16)
        (length,) = struct.unpack_from("<I", raw, offset)
        head = raw[offset + 4: offset + 4 + length]
        i = 0
        while i < len(head):
            tag, i = varint(head, i)
            num, wire = tag >> 3, tag & 7
            if wire == 2:
                n, i = varint(head, i)
                if num == 7:
                    ts = Timestamp.FromString(head[i:i + n])
                    return ts.seconds + (ts.nanos // 1000) / 1e6
                i += n
            elif wire == 0:
                _, i = varint(head, i)
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            else:
                return None
    except (struct.error, ValueError, DecodeError):
        return None
    return None


def memwal_state_of(raw: bytes, where: str) -> MemWalState:
    """The MemWAL index details in a manifest file's bytes (`MemWalNotInitialized`: none)."""
    table_version, indices = parse_index_section(raw, where)
    for idx in indices:
        if idx.name == MEMWAL_INDEX_NAME:
            if idx.index_details.type_url != MEMWAL_TYPE_URL:
                raise TableError(f"{where}: {MEMWAL_INDEX_NAME} has details of type "
                                 f"{idx.index_details.type_url!r}, expected {MEMWAL_TYPE_URL}")
            raw = idx.index_details.value
            try:
                details = pb.MemWalIndexDetails.FromString(raw)
            except DecodeError as e:
                raise TableError(f"{where}: MemWAL index details cannot be decoded: {e}") from None
            refuse_unknown_features(where, b"", details)
            return MemWalState(table_version, idx, details, raw)
    raise MemWalNotInitialized(
        f"{where} has no MemWAL index ({MEMWAL_INDEX_NAME}): MemWAL is not initialized on this "
        "table (call LanceDataset.initialize_mem_wal first)")


def guarded_replace_details(loc: TableLocation, read: MemWalState,
                            details: pb.MemWalIndexDetails, *, index_uuid: str | None = None,
                            files: list[tuple[str, int]] | None = None) -> int:
    """Replace the `__lance_mem_wal` details as version `read.table_version + 1`, or raise
    LostRace if any commit landed since `read` (`exclusive_commit`: neither a rebase over that
    commit nor an overwrite of it).

    Returns the new table version. Never retried inside: the caller must rebuild from a fresh
    read, because the details it built may carry stale merge progress.

    `index_uuid` names the new index (default: a fresh UUID); a caller that stores data under
    `_indices/{uuid}/` (the external region snapshot) writes it there first and passes the same
    UUID. `files` lists those files as (path relative to that directory, size in bytes).
    """
    from lance.dataset import Index, IndexFile, LanceOperation

    old = Index(uuid=str(uuid.UUID(bytes=read.index.uuid.uuid)), name=MEMWAL_INDEX_NAME, fields=[],
                dataset_version=read.index.dataset_version, fragment_ids=set(),
                index_version=read.index.index_version)
    new = Index(uuid=str(uuid.UUID(index_uuid)) if index_uuid else str(uuid.uuid4()),
                name=MEMWAL_INDEX_NAME, fields=[],
                dataset_version=read.table_version, fragment_ids=set(),
                index_version=read.index.index_version,
                files=[IndexFile(path=p, size_bytes=n) for p, n in files] if files else None,
                index_details=(MEMWAL_TYPE_URL, details.SerializeToString()))
    op = LanceOperation.CreateIndex(new_indices=[new], removed_indices=[old])
    try:
        return exclusive_commit.commit_next_version(loc, read.table_version, op, "memwal_index")
    except exclusive_commit.CommitRefused:
        raise LostRace(f"table {loc.lance_uri}: a commit landed after version "
                       f"{read.table_version}; MemWAL index not replaced") from None
