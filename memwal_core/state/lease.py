"""The table lease: one maintainer commits to a table at a time, across processes and hosts.

Why: Dagster pools serialize the runs of one instance only. `memwal maintain` runs its steps on
an ephemeral instance, so two CLI runs, or a CLI run and a Dagster run, overlapped. The table
stayed correct (Lance's commit protocol and memwal's guards resolve every race), but each lost
race left the data, deletion and transaction files of an abandoned commit behind, and a
maintainer that keeps losing does its Spark work for nothing. The lease removes the overlap,
the way Delta's and Hudi's lock providers serialize writers; **correctness never depends on
it** (a holder that loses its lease mid-commit is resolved by Lance exactly as before), which
is why a lease based on expiry, whose guarantees need bounded clock skew, is good enough here.

Design (the table's own storage, no other service): the lease is a log of records
`_memwal/lease/{token:020d}.json`, each created with put-if-absent (a hard link locally,
`IfNoneMatch='*'` on S3), never overwritten. The record with the highest token is the lease's
state: `{holder, step, acquired_at, expires_at, released}`.

- **acquire**: list the directory, read the newest record; when it is released, expired, or
  its holder is known dead (a pid gone on this machine, or an acquisition of this very process
  whose release never reached the store), create token+1 for oneself. A put that finds the key taken lost a race: someone else holds
  it now (read again). Otherwise poll until `wait_seconds` pass, then `LeaseHeld` names the
  holder and until when.
- **renew** (a daemon thread, every `ttl/3`): create token+1 for the same holder with a new
  expiry. Every state change is "the next token", so the only writer of token N+1 is whoever
  wins its put-if-absent: a holder whose lease expired and was taken over cannot renew it (its
  put finds N+1 taken) and learns that it lost it. No overwrite, so S3 needs nothing beyond
  conditional puts.
- **release**: create token+1 with `released: true`; the next maintainer takes over at once.
- **fence**: before each commit a job calls `fence(loc)`: the lease this process holds must be
  unexpired with a margin and its token still the newest (no higher token listed: one LIST, at
  most every TTL/20), else `LeaseLost` aborts the step before its commit. The token is the fencing token: monotonic,
  and a holder is fenced by any later one.
- **bounded**: after each new record the writer deletes the records below it; readers that
  race with the delete re-list. The newest record is never deleted, so tokens never restart.

A process holds at most one lease per table; a nested `hold` in the thread that holds it
re-enters (the Dagster asset holds it around plan + execute, the library entry point inside
re-enters; GC's worker threads fence through it). Expiry uses wall-clock time on every host:
`ttl_seconds` must exceed the clock skew between maintainer hosts by far (60 s by default).

- **clock check**: that assumption is checked, not trusted. Every record this process writes
  (acquire, renew) carries the store's own time (its modification time, read back in the
  listing the write does anyway); a host whose clock is off the store's by more than a quarter
  of the TTL (at least `MIN_SKEW_SECONDS`, the stores' time resolution) gives the lease back
  at once (`ClockSkew`) or, when renewing, loses it (the fence refuses the next commit). Two
  hosts that both pass are within half a TTL of each other, which the fence's quarter-TTL
  margin and the renewal every TTL/3 tolerate.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator

from memwal_core.errors import MemwalError
from memwal_core.options import LeaseOptions
from memwal_core.state import layout
from memwal_core.state.store import NotFound, TableLocation

log = logging.getLogger("memwal.lease")

POLL_SECONDS = 0.5  # between looks at a held lease while waiting (with jitter)
MIN_SKEW_SECONDS = 2.0  # S3 keeps modification times to the second: a smaller bound would refuse by rounding


def _now() -> float:
    """This host's wall clock (the one the lease's expiry is written in)."""
    return time.time()


class LeaseError(MemwalError):
    """Base of the lease's refusals."""


class LeaseHeld(LeaseError):
    """Another maintainer holds the table's lease past the wait: the step is skipped, not failed."""

    def __init__(self, table: str, step: str, record: "LeaseRecord"):
        self.table, self.step, self.record = table, step, record
        super().__init__(f"{step} skipped: table {table} is held by {record.describe()}")


class LeaseLost(LeaseError):
    """The lease expired or was taken over before a commit: the commit is refused."""


class ClockSkew(LeaseError):
    """This host's clock is too far from the store's for expiry times to mean the same on every
    host: the lease is given back, and the step does not run."""


def max_skew(options: LeaseOptions) -> float:
    return max(options.ttl_seconds / 4, MIN_SKEW_SECONDS)


def _skew_problem(loc: TableLocation, token: int, sent: tuple[float, float], stored_at: float | None,
                  options: LeaseOptions) -> str | None:
    """Why this host's clock cannot be trusted for the lease (None: it can). `sent`: our clock
    before and after the put; `stored_at`: the store's time for the same object, somewhere in
    between (kept to the second on S3). Only a store time outside that window widened by the
    bound counts: a slow put is not a skewed clock."""
    if stored_at is None:
        return None  # pruned already: nothing to compare this time
    before, after = sent
    bound = max_skew(options)
    if before - bound - 1.0 <= stored_at <= after + bound:
        return None
    skew = (before + after) / 2 - stored_at
    way = "ahead of" if skew > 0 else "behind"
    return (f"this host's clock is {abs(skew):.1f} s {way} the store's clock (lease record "
            f"{layout.lease_key(token)} of table {loc.lance_uri}); the lease needs them within "
            f"{max_skew(options):.1f} s (a quarter of lease.ttl_seconds = {options.ttl_seconds:g} s): "
            "synchronise this host's clock (NTP) or raise lease.ttl_seconds")


def _machine() -> str:
    """This kernel boot and pid namespace ("" when unknown): a holder with the same one and a pid
    that no longer exists is dead, and its lease is taken over without waiting for the TTL."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


_MACHINE = _machine()
# Nonces of this process's acquisitions still under way or held: one of our own records whose
# nonce is not here ended without a release reaching the store (the store was down), and is free.
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    run_id: str
    nonce: str  # one per acquisition: two holds in one process are two holders
    machine: str = ""

    @classmethod
    def me(cls, run_id: str | None = None) -> "Holder":
        return cls(socket.gethostname(), os.getpid(), run_id or "", uuid.uuid4().hex, _MACHINE)

    def dead(self) -> bool:
        """Known dead: same boot and pid namespace as this process, and no such pid (a crashed
        `memwal maintain`). A reused pid only makes us wait for the TTL: the safe direction."""
        if not self.machine or self.machine != _MACHINE:
            return False
        if self.pid == os.getpid():
            with _LIVE_LOCK:
                return self.nonce not in _LIVE
        return pid_gone(self.pid)


def pid_gone(pid: int) -> bool:
    """Known gone: no process has `pid` in this PID namespace. Another user's process, a pid
    that cannot be one, or a pid reused since all read as not gone: the safe direction for
    whoever would otherwise take over or remove what the process held."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):
        return False
    return False


@dataclass(frozen=True)
class LeaseRecord:
    token: int
    holder: Holder
    step: str
    acquired_at: float
    expires_at: float
    released: bool = False

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, token: int, raw: bytes) -> "LeaseRecord":
        d = json.loads(raw)
        return cls(token, Holder(**d["holder"]), str(d["step"]), float(d["acquired_at"]), float(d["expires_at"]),
                   bool(d.get("released", False)))

    def free(self, now: float) -> bool:
        return self.released or self.expires_at <= now or self.holder.dead()

    def describe(self) -> str:
        h = self.holder
        run = f", run {h.run_id}" if h.run_id else ""
        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.expires_at))
        return f"{h.host} pid {h.pid} ({self.step}{run}) until {until} (lease token {self.token})"


def newest(loc: TableLocation) -> LeaseRecord | None:
    """The lease's current state: its record with the highest token (None: never taken)."""
    store = loc.store
    for _ in range(20):
        tokens = [t for o in store.list(layout.LEASE_DIR) if (t := layout.lease_token_of(o.key)) is not None]
        if not tokens:
            return None
        top = max(tokens)
        try:
            return LeaseRecord.decode(top, store.get(layout.lease_key(top)))
        except NotFound:
            continue  # pruned after a newer record was written between the list and the get
        except (ValueError, KeyError, TypeError) as e:
            raise LeaseError(f"table {loc.lance_uri}: lease record {layout.lease_key(top)} is unreadable ({e}); "
                             "delete it once no maintainer runs") from None
    raise LeaseError(f"table {loc.lance_uri}: the lease directory keeps changing under its listing")


def _later_token(loc: TableLocation, token: int) -> int | None:
    """The highest token above `token` in the lease directory (None: `token` is the newest)."""
    return _look_above(loc, token)[0]


def _look_above(loc: TableLocation, token: int) -> tuple[int | None, float | None]:
    """(the highest token above `token` or None, the store's modification time of `token`'s
    record or None), from one listing.

    Why not a HEAD of `token + 1`: pruning deletes old records, so a token that was written
    and pruned is absent again. A holder paused past its TTL while the next holder renewed a
    few times would find `token + 1` absent (its fence passes) and could even write it as its
    renewal (its put succeeds); only a listing shows the newer records above it."""
    later, stored_at = [], None
    for o in loc.store.list(layout.LEASE_DIR):
        t = layout.lease_token_of(o.key)
        if t is None:
            continue
        if t > token:
            later.append(t)
        elif t == token:
            stored_at = o.mtime
    return (max(later) if later else None), stored_at


KEEP_RECORDS = 4  # the newest records kept (the rest deleted in one batch: fewer writes per step)


def _prune(loc: TableLocation, newest_token: int) -> None:
    """Delete the records older than the newest `KEEP_RECORDS` (never the newest): bounded."""
    try:
        old = [o.key for o in loc.store.list(layout.LEASE_DIR)
               if (t := layout.lease_token_of(o.key)) is not None and t <= newest_token - KEEP_RECORDS]
        if old:
            loc.store.delete_many(old)
    except Exception as e:  # noqa: BLE001 - pruning is housekeeping; the next writer prunes again
        log.warning("lease of %s: could not remove old records: %s", loc.lance_uri, e)


class Lease:
    """A held lease: renewed by a daemon thread until released; `check` is the fence."""

    def __init__(self, loc: TableLocation, record: LeaseRecord, options: LeaseOptions):
        self.loc, self.options = loc, options
        self.record = record
        self.lost: str | None = None
        self.owner = threading.get_ident()
        self.depth = 1
        self._headed_at = 0.0  # monotonic time of the fence's last look for a later token
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"memwal-lease-{record.token}", daemon=True)

    @property
    def token(self) -> int:
        return self.record.token

    def start(self) -> "Lease":
        self._thread.start()
        return self

    def _beat(self) -> None:
        interval = self.options.ttl_seconds / 3
        while not self._stop.wait(interval):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - retried next beat; the fence refuses once it expires
                log.warning("lease of %s: renewal failed: %s", self.loc.lance_uri, e)
            if self.lost:
                return

    def renew(self) -> bool:
        """Extend by writing the next token for the same holder; False once the lease is lost."""
        with self._lock:
            if self.lost or self._stop.is_set():
                return not self.lost
            now = _now()
            nxt = replace(self.record, token=self.record.token + 1, expires_at=now + self.options.ttl_seconds)
            if not self.loc.store.put_if_absent(layout.lease_key(nxt.token), nxt.encode()):
                self.lost = f"token {nxt.token} was written by another maintainer (the lease expired and was taken over)"
                log.warning("lease of %s lost: %s", self.loc.lance_uri, self.lost)
                return False
            sent = (now, _now())
            self.record = nxt
            self._headed_at = 0.0  # a new token: the next fence looks for its successor
            later, stored_at = _look_above(self.loc, nxt.token)
            if later is not None:  # our put filled a pruned slot
                self.lost = f"token {later} was written by another maintainer (the lease expired and was taken over)"
                log.warning("lease of %s lost: %s", self.loc.lance_uri, self.lost)
                return False
            if (skew := _skew_problem(self.loc, nxt.token, sent, stored_at, self.options)) is not None:
                self.lost = skew
                log.error("lease of %s lost: %s", self.loc.lance_uri, skew)
                return False
        _prune(self.loc, nxt.token)
        return True

    def check(self, what: str = "commit") -> None:
        """The fence: refuse `what` unless this lease is unexpired (with a margin of a quarter
        of the TTL, for the commit itself) and still the newest record. The expiry is checked
        every time; the listing for a later token at most every TTL/20 (3 s by default), so a step
        committing thousands of region manifests does not double its requests."""
        with self._lock:
            if self.lost is None:
                left = self.record.expires_at - _now()
                if left < self.options.ttl_seconds / 4:
                    self.lost = f"it expired (or nearly: {left:.1f} s left; not renewed in time)"
                elif time.monotonic() - self._headed_at >= self.options.ttl_seconds / 20:
                    if (later := _later_token(self.loc, self.record.token)) is not None:
                        self.lost = f"token {later} was written by another maintainer"
                    else:
                        self._headed_at = time.monotonic()
            if self.lost:
                raise LeaseLost(f"table {self.loc.lance_uri}: {what} refused: the lease (token "
                                f"{self.record.token}) is no longer held: {self.lost}")

    def release(self) -> None:
        try:
            self._release()
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(self.record.holder.nonce)

    def _release(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.get_ident() != self._thread.ident:
            self._thread.join(timeout=self.options.ttl_seconds)
        with self._lock:
            # Also after the fence gave up on it (expired by our clock): when nobody took it
            # over, the put of the next token frees it now instead of at its expiry; when
            # somebody did, the put finds the token taken and writes nothing.
            now = _now()
            done = replace(self.record, token=self.record.token + 1, expires_at=now, released=True)
            try:
                if self.loc.store.put_if_absent(layout.lease_key(done.token), done.encode()):
                    self.record = done
                else:
                    self.lost = self.lost or "taken over before the release"
                    return
            except Exception as e:  # noqa: BLE001 - it expires by itself after the TTL
                log.warning("lease of %s: release failed (it expires at its TTL): %s", self.loc.lance_uri, e)
                return
        _prune(self.loc, done.token)


# table (Lance URI) -> the lease this process holds on it
_HELD: dict[str, Lease] = {}
_HELD_LOCK = threading.Lock()


def held(loc: TableLocation) -> Lease | None:
    with _HELD_LOCK:
        return _HELD.get(loc.lance_uri)


def acquire(loc: TableLocation, step: str, options: LeaseOptions | None = None, *,
            run_id: str | None = None, on_wait: Callable[[LeaseRecord], None] | None = None) -> Lease:
    """Take the table's lease (see the module docstring), waiting up to `options.wait_seconds`;
    `LeaseHeld` after that. `on_wait` is called once when the lease is found held."""
    options = options or LeaseOptions()
    me = Holder.me(run_id)
    with _LIVE_LOCK:
        _LIVE.add(me.nonce)
    try:
        return _acquire(loc, step, options, me, on_wait)
    except BaseException:
        with _LIVE_LOCK:
            _LIVE.discard(me.nonce)
        raise


def _acquire(loc: TableLocation, step: str, options: LeaseOptions, me: Holder,
             on_wait: Callable[[LeaseRecord], None] | None) -> Lease:
    deadline = time.monotonic() + options.wait_seconds
    told = False
    while True:
        cur = newest(loc)
        now = _now()
        if cur is None or cur.free(now):
            token = (cur.token if cur else 0) + 1
            rec = LeaseRecord(token, me, step, now, now + options.ttl_seconds)
            if loc.store.put_if_absent(layout.lease_key(token), rec.encode()):
                sent = (now, _now())
                later, stored_at = _look_above(loc, token)
                if later is not None:  # a pruned slot: newer records exist
                    continue
                if (skew := _skew_problem(loc, token, sent, stored_at, options)) is not None:
                    Lease(loc, rec, options).release()  # give it back at once: the next maintainer need not wait
                    raise ClockSkew(f"{step} refused: {skew}")
                if cur is not None and not cur.released:
                    why = "expired" if cur.expires_at <= now else "its holder is gone"
                    log.warning("lease of %s: took over from %s (%s)", loc.lance_uri, cur.describe(), why)
                _prune(loc, token)
                return Lease(loc, rec, options).start()
            continue  # lost the race for this token: look again
        if not told:
            told = True
            log.info("lease of %s held by %s: waiting up to %.0f s", loc.lance_uri, cur.describe(),
                     options.wait_seconds)
            if on_wait:
                on_wait(cur)
        left = deadline - time.monotonic()
        if left <= 0:
            raise LeaseHeld(loc.lance_uri, step, cur)
        time.sleep(min(left, POLL_SECONDS * (0.5 + random.random()), max(0.05, cur.expires_at - now)))


# Tables whose lease a caller disabled for the block running in this context (`hold`).
_DISABLED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("memwal_lease_disabled", default=frozenset())


@contextlib.contextmanager
def hold(loc: TableLocation, step: str, options: LeaseOptions | None = None, *,
         run_id: str | None = None) -> Iterator[Lease | None]:
    """Hold the table's lease for the block (re-entrant in the holding thread). Disabled
    (`options.enabled` false): yields None and fences nothing, and the entry points called
    inside the block without options of their own (`compact` runs `execute_compaction`) take
    none either. `LeaseHeld` when it stays held."""
    if options is None and loc.lance_uri in _DISABLED.get():
        yield None
        return
    options = options or LeaseOptions()
    if not options.enabled:
        token = _DISABLED.set(_DISABLED.get() | {loc.lance_uri})
        try:
            yield None
        finally:
            _DISABLED.reset(token)
        return
    with _HELD_LOCK:
        mine = _HELD.get(loc.lance_uri)
        if mine is not None and mine.owner == threading.get_ident():
            mine.depth += 1
        else:
            mine = None
    if mine is not None:
        try:
            yield mine
        finally:
            with _HELD_LOCK:
                mine.depth -= 1
        return
    while True:
        lease = acquire(loc, step, options, run_id=run_id)
        with _HELD_LOCK:
            if loc.lance_uri not in _HELD:  # another thread of this process holds it: wait for it
                _HELD[loc.lance_uri] = lease
                break
        lease.release()
        time.sleep(POLL_SECONDS)
    try:
        yield lease
    finally:
        with _HELD_LOCK:
            if _HELD.get(loc.lance_uri) is lease:
                del _HELD[loc.lance_uri]
        lease.release()


def fence(loc: TableLocation, what: str = "commit") -> None:
    """Refuse `what` (raise `LeaseLost`) when this process holds the table's lease and lost it.

    No-op when no lease is held here (a caller that disabled it)."""
    lease = held(loc)
    if lease is not None:
        lease.check(what)


def fence_store(store: Any, what: str = "commit") -> None:
    """`fence` for code that has the table's store only (its `uri` is the table's Lance URI)."""
    with _HELD_LOCK:
        lease = _HELD.get(getattr(store, "uri", None))
    if lease is not None:
        lease.check(what)


def step(name: str) -> Callable:
    """Decorator for a library entry point `fn(loc, ...)` that commits: it runs holding the
    table's lease (`lease=` keyword: `LeaseOptions`, default on). A `dry_run=True` call takes none."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(loc: TableLocation, *args: Any, lease: LeaseOptions | None = None, **kw: Any) -> Any:
            if kw.get("dry_run"):
                return fn(loc, *args, **kw)
            with hold(loc, name, lease):
                return fn(loc, *args, **kw)

        return run

    return wrap


__all__ = ["ClockSkew", "Lease", "LeaseError", "LeaseHeld", "LeaseLost", "LeaseRecord", "Holder", "acquire", "hold", "fence",
           "fence_store", "held", "newest", "step"]
