"""Commit a Lance operation as exactly version `read_version + 1`, or not at all (`LostRace`).

Why not `LanceDataset.commit`: each of its two ways to refuse a concurrent commit loses one.

- Without a lock, Lance rebases the operation over the commits that landed since its read. A
  CreateIndex that replaces the MemWAL index details then erases the merge progress those
  commits recorded (tests/test_table.py shows it).
- With a `commit_lock` that admits only `read_version + 1`, Lance looks for the version's
  manifest (a HEAD) and then writes it with a plain put. A writer without the lock (a merge,
  an index catch-up, an application: none takes one) whose manifest lands in between is
  overwritten: its `execute()` returned, yet its rows and its recorded merge progress are in no
  version of the table (tests/procs/lance_commit_lock_overwrite.py reproduces it with pylance
  alone; pylance documents the lock as the mutual exclusion of *every* writer of a table).

So Lance builds version `read_version + 1` in a private scratch table that holds only the read
version's manifest (nothing to rebase over, nobody to race), and memwal publishes what it wrote
the way Lance's own writers take a version: the transaction file first, then the manifest with
put-if-absent (a hard link locally, a conditional put on object stores). The version is taken
atomically or not at all. Only the transaction file and the manifest are published; the
version hint under `_versions/` is a hint (readers look past it), and a file of any other kind
in the scratch table stops the commit before anything is written, since copying it could
overwrite one of the table's own. A crash between the two writes leaves an unreferenced transaction
file, as a commit Lance loses does.
"""

from __future__ import annotations

import os
import tempfile

import lance

from memwal_core import faults
from memwal_core.errors import MemwalError
from memwal_core.state.store import NotFound, TableLocation

_U64_MAX = 2**64 - 1
VERSIONS_DIR = "_versions"
TRANSACTIONS_DIR = "_transactions"


class CommitRefused(MemwalError):
    """The version after the read version was committed by someone else: nothing was written."""


def manifest_keys(version: int) -> list[str]:
    """Candidate manifest keys of a table version: Lance's V2 naming first, then V1."""
    return [f"{VERSIONS_DIR}/{_U64_MAX - version:020d}.manifest", f"{VERSIONS_DIR}/{version}.manifest"]


def read_manifest(loc: TableLocation, version: int) -> tuple[int, bytes] | None:
    """(naming scheme: index into `manifest_keys`, bytes) of a version's manifest; None if absent."""
    for scheme, key in enumerate(manifest_keys(version)):
        try:
            return scheme, loc.store.get(key)
        except NotFound:
            continue
    return None


def commit_next_version(loc: TableLocation, read_version: int, operation, what: str) -> int:
    """Commit `operation` as version `read_version + 1` of the table, or raise `CommitRefused`
    when that version exists (nothing of ours is left then). `what` names the commit's crash
    point (`faults.op`). Returns the version committed."""
    found = read_manifest(loc, read_version)
    if found is None:
        raise MemwalError(f"table {loc.lance_uri}: manifest of version {read_version} not found")
    scheme, raw = found
    version = read_version + 1
    with tempfile.TemporaryDirectory(prefix="memwal-commit-") as scratch:
        _write_file(scratch, manifest_keys(read_version)[scheme], raw)
        built = lance.LanceDataset.commit(scratch, operation, read_version=read_version, max_retries=0)
        if built.version != version:
            raise MemwalError(f"table {loc.lance_uri}: Lance built version {built.version} from version "
                              f"{read_version} in a scratch copy, expected {version}")
        manifest_key = manifest_keys(version)[scheme]
        with open(os.path.join(scratch, manifest_key), "rb") as f:
            manifest = f.read()
        written = [key for key in _files(scratch) if not key.startswith(VERSIONS_DIR + "/")]
        unexpected = [k for k in written if not k.startswith(TRANSACTIONS_DIR + "/")]
        if unexpected:  # publish nothing we do not understand: it could overwrite a table file
            raise MemwalError(f"table {loc.lance_uri}: Lance wrote {', '.join(unexpected)} when committing "
                              f"version {version}; memwal publishes only the transaction file and the "
                              f"manifest, so nothing was committed")
        others = {key: _read_file(scratch, key) for key in written}
    store = faults.raw_store(loc.store)  # one counted write: the commit point below
    for key, data in others.items():  # the transaction file: a fresh name, never overwritten
        store.put(key, data)
    faults.op(f"lance_commit {what} v{version}")
    if store.put_if_absent(manifest_key, manifest):
        return version
    try:
        store.delete_many(list(others))
    except Exception:  # noqa: BLE001 - an unreferenced transaction file is harmless
        pass
    raise CommitRefused(f"table {loc.lance_uri}: version {version} was committed by someone else "
                        f"after version {read_version} was read")


def _write_file(root: str, key: str, data: bytes) -> None:
    path = os.path.join(root, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _read_file(root: str, key: str) -> bytes:
    with open(os.path.join(root, key), "rb") as f:
        return f.read()


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")
                  for d, _, names in os.walk(root) for n in names)
