"""Progress of long jobs as typed events, for whoever watches: a log, a terminal.

A job reports each event to its caller's `progress` callback (the Dagster asset passes
`context.log.info`, which logs `str(event)`) and to the listeners registered in this process.
Listeners are how `memwal maintain` sees the progress of a job that runs inside a Dagster asset
it materializes in process: it cannot hand the asset a callback, so it listens for the run's
duration instead.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from memwal_core.units import size

ProgressFn = Callable[[Any], None]  # gets an event; str(event) is its log line

_listeners: list[ProgressFn] = []
_lock = threading.Lock()


@dataclass(frozen=True)
class MergeProgress:
    """Where a merge run is: batch `batch` of `batches` starts (`finished` False) or has
    committed (True); the totals are the plan's, the `*_merged` counts what committed so far
    (sizes as planned: the generations' bytes on storage)."""

    batch: int
    batches: int
    batch_generations: int
    batch_bytes: int
    batch_regions: int
    generations: int        # planned in the run
    bytes: int
    regions: int
    generations_merged: int
    bytes_merged: int
    finished: bool

    def __str__(self) -> str:
        if not self.finished:
            return (f"batch {self.batch}/{self.batches}: merging {self.batch_generations} generations "
                    f"({size(self.batch_bytes)}) of {self.batch_regions} regions")
        return (f"batch {self.batch}/{self.batches} merged: {self.generations_merged}/{self.generations} "
                f"generations, {size(self.bytes_merged)} of {size(self.bytes)}, {self.regions} regions")


def report(progress: ProgressFn | None, event: Any) -> None:
    """Hand `event` to the caller's callback and every listener; a failing listener never fails
    the job (progress is for watching, not part of the work)."""
    if progress is not None:
        progress(event)
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        try:
            fn(event)
        except Exception:  # noqa: BLE001 - see above
            pass


@contextmanager
def listening(fn: ProgressFn) -> Iterator[None]:
    """Call `fn` with every event any job in this process reports while the block runs."""
    with _lock:
        _listeners.append(fn)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(fn)
