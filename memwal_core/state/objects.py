"""What every object store speaks: object info, the two errors, key checking, and the resend of
a request that broke off (`resend`, with tenacity; `store.S3Store` and `cloud_store.CloudStore`
share them; `store` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import MutableMapping

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

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


class BrokeOff(MemwalError):
    """A request that broke off where the client does not retry it (a body cut mid-read, a
    conditional create whose connection broke): `resend` tries it again. The cause is
    `__cause__`."""


def resend(attempts: int, stats: MutableMapping[str, int], counter: str) -> Retrying:
    """Up to `attempts` tries in all of a request whose `BrokeOff` may pass, waiting
    `BODY_RETRY_BACKOFF_S` before the second and doubling up to `BODY_RETRY_MAX_BACKOFF_S`; each
    retry counted in `stats[counter]`; the last `BrokeOff` is raised. Anything else the request
    raises (not found, denied, an error answer) ends it at once."""

    def count(_state) -> None:
        stats[counter] += 1

    return Retrying(stop=stop_after_attempt(max(1, attempts)), reraise=True,
                    wait=wait_exponential(multiplier=BODY_RETRY_BACKOFF_S, max=BODY_RETRY_MAX_BACKOFF_S),
                    retry=retry_if_exception_type(BrokeOff), before_sleep=count)
