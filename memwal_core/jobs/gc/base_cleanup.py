"""The base table's own version cleanup, before GC plans: Lance's `cleanup_old_versions` with
GC's settings (tagged versions are left alone, never a version younger than the retention floor,
`GcOptions`), and for a dry run Lance's own explanation of what it would remove."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from memwal_core import faults
from memwal_core.jobs.gc.items import GcError
from memwal_core.options import GcOptions
from memwal_core.state import lease, table
from memwal_core.state.store import TableLocation


@dataclass
class BaseCleanupPlan:
    """What Lance's `cleanup_old_versions` would remove with GC's settings, as Lance itself
    explains it (`explain_cleanup_old_versions`): the base-table versions (never the latest, never
    a tagged one) and the files that go with them. Age-based settings are relative to when it was
    planned: a version that turns old enough after that is not in it."""

    versions: list[int]
    bytes: int = 0
    files: dict[str, int] = field(default_factory=dict)  # Lance's kinds: manifest, data, transaction, ...
    paths: list[str] = field(default_factory=list)  # the first files, table-relative
    paths_truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"versions": self.versions, "old_versions": len(self.versions), "bytes": self.bytes,
                "files": dict(self.files), "paths": self.paths, "paths_truncated": self.paths_truncated}



def _cleanup_kwargs(config: GcOptions) -> dict[str, Any]:
    """Lance's `cleanup_old_versions` arguments for GC's settings (the cleanup and its dry run)."""
    kw: dict[str, Any] = {"error_if_tagged_old_versions": False}
    if config.base_cleanup_older_than is not None:
        kw["older_than"] = config.base_cleanup_older_than
    if config.cleanup_base_versions_retain is not None:
        kw["retain_versions"] = config.cleanup_base_versions_retain
    return kw


def _manifest_version(path: str) -> int | None:
    """The table version of a `_versions/*.manifest` path: Lance's V2 naming stores
    `u64::MAX - version` zero-padded to 20 digits (newest first), V1 the version itself."""
    name = path.rsplit("/", 1)[-1]
    stem = name[: -len(".manifest")] if name.endswith(".manifest") else ""
    if "/_versions/" not in "/" + path or not stem.isdigit():
        return None
    n = int(stem)
    return (2**64 - 1) - n if len(stem) == 20 else n


def plan_base_cleanup(loc: TableLocation, config: GcOptions, *, max_paths: int = 1000) -> BaseCleanupPlan | None:
    """What `cleanup_base_versions` would remove now, from Lance's own explanation with the same
    arguments (None when no cleanup is configured). Every file is listed to find the versions
    (each removed version's manifest is one of them); `paths` keeps the first `max_paths`."""
    if not config.base_cleanup:
        return None
    ds = table.open_dataset(loc)
    ex = ds.explain_cleanup_old_versions(**_cleanup_kwargs(config), include_files=True, max_files=2**31 - 1)
    # Lance names files by their object-store path: the table root (local) or the key in the bucket.
    root = loc.lance_uri.rstrip("/").split("://", 1)[-1].lstrip("/")
    roots = [r + "/" for r in (root, root.split("/", 1)[-1] if "://" in loc.lance_uri else root) if r]
    paths, versions = [], set()
    for c in ex.candidate_files:
        rel = c.path.lstrip("/")
        rel = next((rel[len(r):] for r in roots if rel.startswith(r)), rel)
        paths.append(rel)
        if c.kind == "manifest" and (v := _manifest_version(rel)) is not None:
            versions.add(v)
    if len(versions) != ex.stats.old_versions or ex.candidate_files_truncated:
        raise GcError(f"cannot tell which base-table versions the cleanup would remove: Lance explains "
                      f"{ex.stats.old_versions} old versions, {len(versions)} manifests were recognized")
    files = collections.Counter(c.kind for c in ex.candidate_files)
    return BaseCleanupPlan(sorted(versions), int(ex.stats.bytes_removed), dict(sorted(files.items())),
                           paths[:max_paths], len(paths) > max_paths)


def cleanup_base_versions(loc: TableLocation, config: GcOptions) -> dict[str, int]:
    """Option 5: Lance's own `cleanup_old_versions` (tagged versions are left alone). No version
    listing here: the plan that follows lists them anyway (`run_gc` fills in the counts), and
    `run_gc` does not call this while no retained version is old enough (Lance reads every
    manifest to find that out).

    `older_than` is always passed, at least the retention floor (`GcOptions`): Lance removes a
    version only when it is older than `older_than` *and* not among the newest `retain_versions`
    (given only `retain_versions`, it removes every older version whatever its age), so a
    cleanup by count alone would otherwise remove versions a commit in flight still reads."""
    if not config.base_cleanup:
        return {"old_versions": 0, "bytes_removed": 0}
    ds = table.open_dataset(loc)
    kw = _cleanup_kwargs(config)
    lease.fence(loc, "base-table version cleanup")
    faults.op("lance_cleanup_old_versions")  # reliability tests: a crash point
    stats = ds.cleanup_old_versions(**kw)
    return {"old_versions": int(getattr(stats, "old_versions", 0)),
            "bytes_removed": int(getattr(stats, "bytes_removed", 0))}

