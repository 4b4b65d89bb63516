"""GC's listings inside a region directory: every listed key must lie inside the directory listed
and its region directory, or planning the region stops (`layout.UnsafePath`)."""

from __future__ import annotations

from typing import Iterable

from memwal_core.state import layout
from memwal_core.state.store import ObjectInfo, TableLocation


def _safe_keys(infos: Iterable[ObjectInfo], directory: str, region_dir: str) -> list[ObjectInfo]:
    out = []
    for o in infos:
        if not (layout.is_inside(o.key, directory) and layout.is_inside(o.key, region_dir)):
            raise layout.UnsafePath(f"listed key {o.key!r} is not inside {directory}/")
        out.append(o)
    return out


def list_dir(loc: TableLocation, directory: str, region_dir: str) -> list[ObjectInfo]:
    return _safe_keys(loc.store.list(directory), directory, region_dir)


def listed_positions(loc: TableLocation, directory: str, suffix: str, region_dir: str) -> list[int]:
    """Positions (WAL) or versions (manifests) of the `{bitrev}{suffix}` objects in `directory`."""
    out = []
    for o in list_dir(loc, directory, region_dir):
        name = o.key.rsplit("/", 1)[-1]
        if name.endswith(suffix) and (n := layout.parse_bitrev(name[: -len(suffix)])):
            out.append(n)
    return out
