"""What every object store speaks: object info, the two errors, key checking, and the body-read
retry pacing (`store.S3Store` and `cloud_store.CloudStore` share them; `store` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass

from memwal_core.errors import MemwalError


class StoreError(MemwalError, OSError):
    """An object-store request failed for a reason other than "not found"."""


class NotFound(MemwalError, KeyError):
    """The object does not exist."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch


def _clean(key: str) -> str:
    if key.startswith("/") or any(p in ("", ".", "..") for p in key.rstrip("/").split("/")):
        raise ValueError(f"unsafe object key {key!r}")
    return key


# A body read that broke off: the first wait before the GET is sent again, doubling up to the cap.
BODY_RETRY_BACKOFF_S = 0.1
BODY_RETRY_MAX_BACKOFF_S = 2.0
