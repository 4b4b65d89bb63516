"""The retained base-table versions and what GC needs of each, each manifest read once.

Of every retained version GC needs its merge progress (a reader time-travelling to it reads the
generations above it) and its commit time (when the base-version cleanup removes it). A table
version is immutable, so GC reads only the manifests it does not know yet. What it knows is kept
beside the table in `_memwal/gc_versions.json` (written by `run_gc` after a pass that learned
something), because every GC run is a new process (CLI, Dagster run).

Finding the versions without listing `_versions/` (its listing grows with the history). Lance
only ever adds a version above the newest (a commit makes latest + 1, and the manifest key of a
version is computable), so a pass:
1. reads the newest version the summary knows again (HEAD and GET) and compares it with the
   summary's row (size, commit time to the microsecond, merge progress): a table removed and
   created again at this URI has another manifest there, or none (when it is shorter);
2. HEADs the oldest version the summary knows (there, with its size): anyone's
   `cleanup_old_versions` removes the oldest versions first (by age, and by count among those
   old enough);
3. probes upward from the newest known version (HEAD of the next key until there is none; the
   plan checks that it reached the latest version Lance opened, else a gap: list).
Any surprise in 1-3 (a manifest missing or different), a summary that is missing or not usable,
a base-version cleanup run by this pass, and a listing older than `full_scan_interval_seconds`
(`GcOptions`; its time is in the summary) make the pass list `_versions/` instead.

Why a summary that was not listed is safe: a version believed retained but removed since (a tagged
oldest version left while younger ones went, a cleanup between listings) only holds more: it
lowers the time-travel bound (merge progress is a minimum over the versions), its older commit
time can only make `run_gc` run Lance's cleanup (`run._nothing_old_enough`), which decides from
the manifests themselves, and the leak scan lists `_versions/` itself. The rows of the versions
below the newest are not checked against their manifests between listings: a version's manifest
never changes, and the one way to get other manifests at the same keys (the table created again)
changes or removes the newest one first, which step 1 sees. The summary is written by GC alone,
sealed with a checksum. A version *missing* from what a pass believes would let it collect what
that version reads; the probe cannot miss one above the newest known (it goes up to the latest),
and one below can only appear in a slot a cleanup freed (a commit that read a version older than
the retention floor, `GcOptions`, which rules that out); the next listing would see it.

When `_versions/` is listed (at least once per interval):
- an entry is used only for a version the listing shows now, with the same manifest size and
  modification time as when it was read; any other listed version is read from its manifest.
  Versions removed since are simply not listed, so they hold nothing; a table re-created at the
  same URI writes new manifests, usually with new times, but a store whose times have whole
  seconds (S3) can show the same key, size and time: so the newest manifest the summary vouches
  for is read and its commit time compared (to the microsecond) with the recorded one; a
  difference drops the summary (`recreated`), and the leak scan's and the regions' caches with it;
- a summary that is missing, garbled, of another format or whose checksum does not match is
  ignored (every manifest is read, and the summary written again); writing it may fail;
- whatever it holds was true of a manifest with that exact size and time: it can never make GC
  keep less than reading every manifest again would (the property tests compare the two).
A pass between listings only adds versions above the ones it read, so the summary is written
again by appending their rows to the text it was read as (`Encoded`), and read a column at a
time; what a pass does with the facts looks at the distinct merge states (`retention.py`).
The summary also records when the leak scan last completed (`leaks.py`: it runs once per
interval). A process that reads it without writing (`plan_gc` from `memwal status`, a dry run)
only saves the reads it can.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from memwal_core.errors import MemwalError, one_line
from memwal_core.jobs.gc.items import GcError
from memwal_core.state import layout, sealed, table
from memwal_core.state.store import NotFound, ObjectInfo, TableLocation

log = logging.getLogger("memwal.gc")

VERSIONS_DIR = "_versions"
FORMAT = 1
_U64_MAX = 2**64 - 1
_NUM_TYPES = {int, float}
_STAMP_TYPES = {int, float, type(None)}


class VersionFacts(NamedTuple):
    """What GC needs of one table version, and the manifest (size, modification time) it was
    read from. `merged` None: the version has no MemWAL index (its readers read no generation).
    A tuple: a summary decodes one per retained version on every pass."""

    version: int
    size: int
    mtime: float
    stamp: float | None  # commit time, epoch seconds (Lance's manifest timestamp)
    merged: dict[str, int] | None


@dataclass
class VersionHistory:
    """The listed versions' facts, and how they were learned this pass."""

    facts: dict[int, VersionFacts] = field(default_factory=dict)
    read: int = 0  # manifests read this pass
    known: int = 0  # facts taken from the summary
    summary: str = "missing"  # used, missing, or why it was ignored
    listing: list[ObjectInfo] | None = None  # `_versions/` as listed (the leak scan's too); None: probed
    changed: bool = True  # the summary to write differs from the one found
    recreated: bool = False  # the summary described another table at this URI: every cache is dropped
    listed_at: float | None = None  # when `_versions/` was last listed (now, when this pass did)
    leaks_at: float | None = None  # when the leak scan last completed (`leaks.py`)
    must_list: bool = False  # a later read in this pass lists (a base-version cleanup ran in between)
    text: Encoded | None = None  # the summary's encoded rows, reused when writing it again

    @property
    def listed(self) -> bool:
        return self.listing is not None

    def to_dict(self) -> dict[str, Any]:
        return {"versions": len(self.facts), "manifests_read": self.read, "from_summary": self.known,
                "summary": self.summary, "listed": self.listed}


@dataclass
class Summary:
    """What `_memwal/gc_versions.json` holds: the facts, and when the table was last listed in full."""

    facts: dict[int, VersionFacts] = field(default_factory=dict)
    listed_at: float | None = None
    leaks_at: float | None = None
    text: Encoded | None = None  # how its facts were written (the next summary reuses it)


def due(at: float | None, now: float, interval: float) -> bool:
    """Whether what was done at `at` is due again (never done, an interval passed, a clock that
    went back)."""
    return at is None or not 0 <= now - at < interval


def version_of(key: str) -> int | None:
    """The table version of a `_versions/` manifest key (Lance's V2 naming: `u64::MAX - version`
    in 20 digits; V1: the version); None for anything else (detached versions, the hint, temporary
    files)."""
    name = key[len(VERSIONS_DIR) + 1:] if key.startswith(VERSIONS_DIR + "/") else ""
    stem = name[: -len(".manifest")] if name.endswith(".manifest") else ""
    if not stem.isdigit() or "/" in name:
        return None
    return _U64_MAX - int(stem) if len(stem) == 20 else int(stem)


def list_versions(loc: TableLocation, listing: list[ObjectInfo] | None = None) -> dict[int, ObjectInfo]:
    """The retained versions' manifests (from one listing of `_versions/`, or `listing`); V2
    naming first when both exist."""
    out: dict[int, ObjectInfo] = {}
    for o in loc.store.list(VERSIONS_DIR) if listing is None else listing:
        v = version_of(o.key)
        if v is not None and (v not in out or o.key == table.manifest_keys(v)[0]):
            out[v] = o
    return out


@dataclass
class Encoded:
    """The JSON text of a summary's states and version rows, and the facts and states it holds
    (the very objects decoded): a summary that only gained newer versions is written by
    appending their rows to this text, not by encoding every retained version again."""

    states_text: str
    rows_text: str
    facts: dict[int, VersionFacts]
    states: list[dict[str, int] | None]


def _json(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"))


def _append(text: str, items: list) -> str:
    """The JSON array `text` with `items` appended."""
    if not items:
        return text
    more = _json(items)
    return more if text == "[]" else text[:-1] + "," + more[1:]


_RECENT_STATES = 8


def _content(m: dict[str, int] | None) -> frozenset | None:
    return None if m is None else frozenset(m.items())


def _reusable(prior: Encoded | None, facts: dict[int, VersionFacts]) -> bool:
    """Whether `facts` are `prior`'s (the same objects) plus versions above them only."""
    if prior is None or len(prior.facts) > len(facts):
        return False
    if any(facts.get(v) is not f for v, f in prior.facts.items()):
        return False
    top = max(prior.facts, default=0)
    return all(v > top for v in facts if v not in prior.facts)


def encode(facts: dict[int, VersionFacts], listed_at: float | None = None, leaks_at: float | None = None,
           prior: Encoded | None = None) -> bytes:
    """The summary's bytes: versions in order, equal merge states stored once. `prior`: how the
    summary these facts were read from was written; when the facts are its facts plus newer
    versions, their rows are appended to its text (a pass between listings only adds versions)."""
    if not _reusable(prior, facts):
        prior = None
    states: list[dict[str, int] | None] = list(prior.states) if prior is not None else []
    known = len(states)
    # Equal states are stored once: by object (decoded rows share them), and by content among the
    # new rows and the last states of `prior` (a new version's progress is new or the latest's);
    # an older equal state stored again costs a few bytes, never a wrong row.
    by_obj = dict(zip(map(id, reversed(states)), range(known - 1, -1, -1)))
    by_content: dict[Any, int] = {}
    for i in range(max(0, known - _RECENT_STATES), known):
        by_content.setdefault(_content(states[i]), i)
    rows = []
    for v in sorted(facts):
        if prior is not None and v in prior.facts:
            continue
        f = facts[v]
        i = by_obj.get(id(f.merged))
        if i is None:
            key = _content(f.merged)
            i = by_content.get(key)
            if i is None:
                i = by_content[key] = len(states)
                states.append(f.merged)
            by_obj[id(f.merged)] = i
        rows.append([v, f.size, f.mtime, f.stamp, i])
    states_text = _append(prior.states_text if prior is not None else "[]", states[known:])
    rows_text = _append(prior.rows_text if prior is not None else "[]", rows)
    # The layout `json.dumps(sort_keys=True)` gives (keys in order, `versions` last), written by hand
    # so that the reused text is not encoded again.
    body = (f'{{"leaks_at":{_json(leaks_at)},"listed_at":{_json(listed_at)},'
            f'"states":{states_text},"versions":{rows_text}}}')
    return sealed.seal_body(body, FORMAT)


def _encoded(body: str, summary: Summary, states: list[dict[str, int] | None]) -> Encoded | None:
    """The text of a decoded summary's states and rows (None: not in the layout `encode` writes)."""
    si, vi = body.rfind('"states":'), body.rfind(',"versions":')
    if not (0 < si < vi and body.endswith("}")):
        return None
    states_text, rows_text = body[si + len('"states":'):vi], body[vi + len(',"versions":'):-1]
    if not (states_text.startswith("[") and states_text.endswith("]") and rows_text.startswith("[")
            and rows_text.endswith("]")):
        return None
    return Encoded(states_text, rows_text, summary.facts, states)


def decode(raw: bytes) -> dict[int, VersionFacts]:
    """The summary's facts; ValueError (with why) for anything but a summary this code wrote."""
    return decode_summary(raw).facts


def decode_summary(raw: bytes) -> Summary:
    """The summary; ValueError (with why) for anything but a summary this code wrote."""
    body = sealed.unseal_body(raw, FORMAT)
    d = json.loads(body)
    if not isinstance(d, dict):
        raise ValueError("not a summary")
    times = [d.get("listed_at"), d.get("leaks_at")]  # absent in summaries written before they were kept
    if not all(t is None or (isinstance(t, (int, float)) and type(t) is not bool) for t in times):
        raise ValueError("a bad listing time")
    states = d["states"]
    if not isinstance(states, list):
        raise ValueError("states is not a list")
    checked: list[dict[str, int] | None] = []
    for s in states:
        if s is not None and not (isinstance(s, dict) and all(
                isinstance(k, str) and type(g) is int and g >= 0 for k, g in s.items())):
            raise ValueError("a merge state is not a map of region to generation")
        checked.append(s)
    rows = d["versions"]
    if not (isinstance(rows, list) and set(map(type, rows)) <= {list} and set(map(len, rows)) <= {5}):
        raise ValueError("a bad version row")
    # Checked a column at a time, in C (a summary holds a row per retained version, read every pass).
    vs, sizes, mtimes, stamps, idx = zip(*rows) if rows else ((), (), (), (), ())
    if not (set(map(type, vs)) <= {int} and set(map(type, sizes)) <= {int} and set(map(type, idx)) <= {int}
            and set(map(type, mtimes)) <= _NUM_TYPES and set(map(type, stamps)) <= _STAMP_TYPES):
        raise ValueError("a bad version row")
    if rows and (min(vs) < 1 or min(idx) < 0 or max(idx) >= len(checked) or len(set(vs)) != len(vs)):
        raise ValueError("a bad version row")
    make = functools.partial(tuple.__new__, VersionFacts)
    # A stamp stays as JSON gave it (an int compares equal to the float it stands for).
    out = dict(zip(vs, map(make, zip(vs, sizes, map(float, mtimes), stamps, map(checked.__getitem__, idx)))))
    summary = Summary(out, *(None if t is None else float(t) for t in times))
    summary.text = _encoded(body, summary, checked)
    return summary


def load_summary(loc: TableLocation) -> tuple[dict[int, VersionFacts], str]:
    """The summary's facts and "used"; or nothing, and why (a summary is never needed)."""
    summary, why = _load(loc)
    return summary.facts, why


def _load(loc: TableLocation) -> tuple[Summary, str]:
    try:
        raw = loc.store.get(layout.GC_VERSIONS_KEY)
    except NotFound:
        return Summary(), "missing"
    except Exception as e:  # noqa: BLE001 - a cache: every manifest is read instead
        log.warning("%s could not be read (%s); reading every retained manifest", layout.GC_VERSIONS_KEY, one_line(e))
        return Summary(), f"unreadable: {one_line(e)}"
    try:
        return decode_summary(raw), "used"
    except (ValueError, KeyError, TypeError) as e:
        log.warning("%s ignored (%s); reading every retained manifest and writing it again",
                    layout.GC_VERSIONS_KEY, e)
        return Summary(), f"ignored: {e}"


def save_summary(loc: TableLocation, history: VersionHistory) -> None:
    """Write what `history` knows (when it learned something); failing only costs reads later."""
    if not history.changed:
        return
    try:
        loc.store.put(layout.GC_VERSIONS_KEY, encode(history.facts, history.listed_at, history.leaks_at, history.text))
        history.changed = False
    except Exception as e:  # noqa: BLE001 - a cache
        log.warning("could not write %s: %s", layout.GC_VERSIONS_KEY, one_line(e))


def _read(loc: TableLocation, v: int, info: ObjectInfo) -> VersionFacts | None:
    """One version's facts from its manifest; None when it vanished since the listing (cleaned up)."""
    try:
        raw = loc.store.get(info.key)
    except NotFound:
        log.info("table version %d vanished while planning GC (cleaned up)", v)
        return None
    where = f"table {loc.lance_uri} version {v}"
    try:
        state = table.memwal_state_of(raw, where)
        merged: dict[str, int] | None = state.merged
        got = state.table_version
    except table.MemWalNotInitialized:
        merged, got = None, table.parse_index_section(raw, where)[0]
    except table.TableError as e:
        raise GcError(f"cannot read the MemWAL state of retained table version {v}: {e}") from None
    if got != v:
        raise GcError(f"{where}: its manifest {info.key} says version {got}")
    return VersionFacts(v, info.size, info.mtime, table.commit_timestamp(raw), merged)


def _another_table(loc: TableLocation, known: dict[int, VersionFacts], listed: dict[int, ObjectInfo]) -> bool:
    """Whether the newest listed version the summary vouches for (same size and time) has another
    commit time than recorded: the table was re-created at this URI within the store's time
    resolution. One manifest read per pass; a manifest gone meanwhile proves nothing."""
    vouched = [v for v, info in listed.items()
               if (k := known.get(v)) is not None and k.size == info.size and k.mtime == info.mtime
               and k.stamp is not None]
    if not vouched:
        return False
    v = max(vouched)
    try:
        raw = loc.store.get(listed[v].key)
    except NotFound:
        return False
    return table.commit_timestamp(raw) != known[v].stamp


def _head_version(loc: TableLocation, v: int) -> ObjectInfo | None:
    """The manifest of version `v` (Lance's V2 naming first), or None."""
    for key in table.manifest_keys(v):
        info = loc.store.head(key)
        if info is not None:
            return info
    return None


class _Mismatch(MemwalError):
    """The newest known version's manifest is not the one the summary describes."""

    def __init__(self, another_table: bool):
        super().__init__()
        self.another_table = another_table


def _probe(loc: TableLocation, known: dict[int, VersionFacts], checked: bool,
           latest: int | None) -> list[tuple[int, ObjectInfo]] | None:
    """The versions committed above the newest known one (steps 1-3 of the module docstring);
    None: versions may be missing, list `_versions/`; `_Mismatch`: the newest known manifest is
    another one (nothing of the summary is used). `checked`: steps 1-2 were done in this pass."""
    top = max(known)
    if not checked:
        info = _head_version(loc, top)
        if info is None:
            return None
        got = _read(loc, top, info)
        if got is None:
            return None
        k = known[top]  # not the modification time: a HEAD may give it less precisely than a listing
        if (got.size, got.stamp, got.merged) != (k.size, k.stamp, k.merged):
            raise _Mismatch(got.stamp != k.stamp)
        low = min(known)
        info = _head_version(loc, low)
        if info is None or info.size != known[low].size:
            return None
    new = []
    v = top + 1
    while (info := _head_version(loc, v)) is not None:
        new.append((v, info))
        v += 1
    if latest is not None and v <= latest:  # a version below the latest is missing: list
        return None
    return new


def read_history(loc: TableLocation, *, use_summary: bool = True, earlier: VersionHistory | None = None,
                 max_workers: int = 16, interval: float = 0.0, now: float | None = None,
                 latest: int | None = None, for_leaks: bool = False) -> VersionHistory:
    """Every retained version's facts: from the summary when it knows that very manifest, else read.
    `use_summary=False`: list and read every manifest (what the summary must always agree with).
    `earlier`: a history read earlier in this pass, taken as the summary (its reads count in
    this one). `interval`: list `_versions/` when the last listing is older (0: every pass), or
    when the leak scan is due (`for_leaks`, so that it takes this listing); else probe for new
    versions (module docstring). `latest`: a version known to exist (the one the plan opened)."""
    now = time.time() if now is None else now
    if earlier is not None:
        base, why = Summary(earlier.facts, earlier.listed_at, earlier.leaks_at, earlier.text), earlier.summary
    else:
        base, why = _load(loc) if use_summary else (Summary(), "not used")
    listed_before = earlier is not None and earlier.listed  # earlier in this pass: the leak scan takes it
    must_list = (why != "used" or not base.facts or (earlier is not None and earlier.must_list)
                 or due(base.listed_at, now, interval)
                 or (for_leaks and not listed_before and due(base.leaks_at, now, interval)))
    recreated = earlier.recreated if earlier is not None else False
    try:
        probed = None if must_list else _probe(loc, base.facts, earlier is not None, latest)
    except _Mismatch as e:
        probed, base, recreated = None, Summary(), e.another_table
        why = ("ignored: it describes another table at this URI (re-created)" if recreated
               else "ignored: its newest version is not that version's manifest")
        log.warning("%s %s; reading every retained manifest", layout.GC_VERSIONS_KEY, why[len("ignored: "):])
    out = VersionHistory(summary=why, recreated=recreated, listed_at=base.listed_at, leaks_at=base.leaks_at,
                         text=base.text)
    if probed is not None:
        known, todo = base.facts, probed
        out.facts = dict(known)
        if listed_before:  # a version committed since is the leak scan's step 3
            out.listing = earlier.listing
    else:
        known, todo = _listed(loc, base.facts, out, earlier is None)
        out.listed_at = now
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(todo)))) as pool:
            for got in pool.map(lambda vi: _read(loc, *vi), todo):
                if got is not None:
                    out.facts[got.version] = got
                    out.read += 1
    out.facts = dict(sorted(out.facts.items()))
    # Whether the summary on the store differs from what is known now.
    out.changed = (earlier.changed if earlier is not None else why != "used") or bool(todo) \
        or out.facts.keys() != known.keys() or out.listed
    out.read += earlier.read if earlier is not None else 0
    out.known = max(0, len(out.facts) - out.read)
    return out


def _listed(loc: TableLocation, known: dict[int, VersionFacts], out: VersionHistory,
            check_table: bool) -> tuple[dict[int, VersionFacts], list[tuple[int, ObjectInfo]]]:
    """One listing of `_versions/`: the summary's facts for the listed manifests it knows (same
    size and time; all of them dropped when it describes another table: `check_table`), into
    `out`, and the versions to read."""
    out.listing = list(loc.store.list(VERSIONS_DIR))
    listed = list_versions(loc, out.listing)
    if check_table and known and _another_table(loc, known, listed):
        known, out.recreated, out.text = {}, True, None
        out.summary = "ignored: it describes another table at this URI (re-created)"
        out.leaks_at = None
        log.warning("%s %s; reading every retained manifest", layout.GC_VERSIONS_KEY,
                    out.summary[len("ignored: "):])
    todo = []
    for v, info in sorted(listed.items()):
        k = known.get(v)
        if k is not None and k.size == info.size and k.mtime == info.mtime:
            out.facts[v] = k
        else:
            todo.append((v, info))
    return known, todo
