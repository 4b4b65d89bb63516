"""Every setting of a maintained table, defined once: name, type, default and validation.

The jobs take these dataclasses, the `MemWalTable` Dagster component embeds them in its schema,
`memwal.yaml` maps 1:1 onto them (a section per class, a key per field) and the CLI builds them
from flags, so a setting has one name and one default everywhere. `from_mapping` is the one
parser for hand-written mappings: unknown keys get a did-you-mean, sizes accept "256MB",
durations "7d", "12h", "30m", "90s", and an optional setting is turned off by `null`, "none"
or "off".
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Annotated, Any, ClassVar, Mapping, TypeVar

from pydantic import BeforeValidator, WithJsonSchema

from memwal_core.errors import OptionError

T = TypeVar("T")

# Binary units, as Spark reads sizes ("256m" = 256 MiB); "256MB" and "256MiB" mean the same.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# Durations: seconds, or a number with one unit ("7d", "12h", "30m", "90s", "1.5h").
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# What Spark accepts as a master (SparkContext: "Master must either be yarn or start with
# spark, k8s, or local", then its local[...] forms), and Spark Connect URLs.
_SPARK_MASTER = re.compile(r"^(local|local\[(\d+|\*)\]|local\[(\d+|\*)\s*,\s*\d+\]|"
                           r"local-cluster\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]|yarn|"
                           r"spark://\S+|k8s://\S+|sc://\S+)$")


def unknown_keys(keys, known, where: str) -> None:
    """Refuse a key that is not a setting (a typo such as `merg:` is an error, not ignored)."""
    for k in keys:
        if k not in known:
            close = difflib.get_close_matches(str(k), [str(x) for x in known], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(map(str, known))}"
            raise OptionError(f"{where}: unknown key {k!r}{hint}")


def parse_size(value: Any, what: str) -> int:
    """Bytes from an int or a size such as "256MB", "1.5g", "64KiB" (binary units)."""
    if isinstance(value, bool):
        raise OptionError(f"{what}: expected a size in bytes (e.g. 268435456 or 256MB), got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise OptionError(f"{what}: expected a size in bytes (e.g. 268435456 or 256MB), got {value!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if n <= 0:
        raise OptionError(f"{what}: must be positive, got {value!r}")
    return n


def number(value: Any, what: str, kind: type, minimum: float) -> Any:
    """An int or float >= minimum from a number or its string; bools, nan and inf refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise OptionError(f"{what}: expected a number, got {value!r}")
    try:
        n = kind(value)
    except (TypeError, ValueError):
        raise OptionError(f"{what}: expected {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if kind is int and isinstance(value, float) and value != n:
        raise OptionError(f"{what}: expected an integer, got {value!r}")
    if not math.isfinite(n) or n < minimum:
        raise OptionError(f"{what}: must be a finite number >= {minimum:g}, got {value!r}")
    return n


def seconds(value: Any, what: str) -> float:
    """A duration in seconds: finite and >= 0 (`nan`, `inf` and negatives are refused)."""
    return number(value, what, float, 0)


def parse_duration(value: Any, what: str) -> float:
    """Seconds from a number or a duration such as "7d", "12h", "30m", "90s" (finite, >= 0)."""
    if isinstance(value, str):
        m = _DURATION.match(value)
        if not m:
            raise OptionError(f"{what}: expected a duration in seconds or with a unit "
                              f"(e.g. 86400, 7d, 12h, 30m, 90s), got {value!r}")
        return seconds(float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()], what)
    return seconds(value, what)


def check_spark_master(value: Any, what: str = "spark master") -> str:
    """A Spark master Spark can start (checked before a JVM is started for it)."""
    if not isinstance(value, str) or not _SPARK_MASTER.match(value.strip()):
        raise OptionError(f"{what}: {value!r} is not a Spark master (use local[*], local[N], spark://HOST:PORT, "
                          "yarn, k8s://..., or sc://HOST:PORT)")
    return value.strip()


# A size or a duration as its text is written ("256MB", "7d"): what `parse_size` and
# `parse_duration` read, for the JSON schema editors and `dg utils inspect-component` show.
SIZE_TEXT = r"^\s*\d+(\.\d+)?\s*[kmgtKMGT]?([iI]?[bB])?\s*$"
DURATION_TEXT = r"^\s*\d+(\.\d+)?\s*[smhdwSMHDW]?\s*$"

# The pydantic types of the size and duration settings: bytes from an int or "256MB" (binary
# units, as Spark reads sizes), seconds from a number or "7d". Validating an options dataclass
# with pydantic parses them (`TypeAdapter(MergeOptions).validate_python({"budget_bytes": "64MB"})`),
# and its JSON schema takes both spellings; `from_mapping` reads the same fields by their
# `kind` metadata, with the setting's name in its messages.
Size = Annotated[int, BeforeValidator(lambda v: parse_size(v, "size")),
                 WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": SIZE_TEXT}]})]
Duration = Annotated[float, BeforeValidator(lambda v: parse_duration(v, "duration")),
                     WithJsonSchema({"anyOf": [{"type": "number", "minimum": 0},
                                               {"type": "string", "pattern": DURATION_TEXT}]})]


def _minimum(f) -> float:
    return f.metadata.get("min", 0)


def _convert(f, hint: Any, value: Any, what: str) -> Any:
    """One field's value from a hand-written mapping, by the field's type and metadata."""
    args = typing.get_args(hint)
    if type(None) in args:  # `X | None`
        # `off` unquoted is YAML's false: for an optional setting it means off too.
        if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _OFF):
            return None
        hint = next(a for a in args if a is not type(None))
    kind = f.metadata.get("kind")
    if kind == "size":
        return parse_size(value, what)
    if kind == "spark_master":
        return check_spark_master(value, what)
    if kind == "duration":
        return parse_duration(value, what)
    if hint is bool:
        if not isinstance(value, bool):
            raise OptionError(f"{what}: expected true or false, got {value!r}")
        return value
    if hint in (int, float):
        return number(value, what, hint, _minimum(f))
    if hint is str:
        if not isinstance(value, str):
            raise OptionError(f"{what}: expected a string, got {value!r}")
        return value
    if typing.get_origin(hint) is dict:
        if not isinstance(value, Mapping):
            raise OptionError(f"{what}: expected a mapping, got {type(value).__name__} {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    return value


def from_mapping(cls: type[T], raw: Mapping[str, Any] | None, where: str) -> T:
    """`cls` from a hand-written mapping (a memwal.yaml section, CLI flags): every key must be
    a field, every value is converted and checked, missing keys take the field's default."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise OptionError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r}")
    known = {f.name: f for f in fields(cls)}
    for k in raw:
        if k in getattr(cls, "removed_keys", {}):
            raise OptionError(f"{where}: {k!r} is no longer a setting: {cls.removed_keys[k]}")  # type: ignore[attr-defined]
    unknown_keys(raw, known, where)
    hints = typing.get_type_hints(cls)
    values = {k: _convert(known[k], hints[k], v, f"{where}.{k}") for k, v in raw.items()}
    try:
        return cls(**values)
    except OptionError:
        raise
    except (TypeError, ValueError) as e:
        raise OptionError(f"{where}: {e}") from None


class _Checked:
    """Field checks every options class shares: numbers >= their `min` metadata."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if not math.isfinite(v) or v < _minimum(f):
                    raise OptionError(f"{type(self).__name__}.{f.name} must be a finite number >= "
                                      f"{_minimum(f):g}, got {v!r}")


def _min(n: float, **meta: Any) -> dict:
    return {"min": n, **meta}


@dataclass(frozen=True)
class SparkOptions(_Checked):
    """Where the merge's data path runs."""

    master: str = field(default="local[*]", metadata={"kind": "spark_master"})
    conf: dict[str, str] = field(default_factory=dict)
    # Dagster runs use a long-lived Spark Connect server here (started on first use, running
    # `master`) instead of a JVM per run; None: each run starts `master` itself.
    connect: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_spark_master(self.master, "spark.master")
        if self.connect is not None and not (isinstance(self.connect, str) and self.connect.startswith("sc://")):
            raise OptionError(f"spark.connect must be a Spark Connect URL like sc://127.0.0.1:15002, "
                              f"got {self.connect!r}")


@dataclass(frozen=True)
class MergeOptions(_Checked):
    """How much one merge batch takes: generations up to `budget_bytes` (manifest bytes), however
    many they are (one batch, one Spark job and one commit while the backlog fits).
    `max_generations` caps the count as well, for smaller commits; None (the default): no cap."""

    budget_bytes: Size = field(default=256 * 1024 * 1024, metadata=_min(1, kind="size"))
    max_generations: int | None = field(default=None, metadata=_min(1))


@dataclass(frozen=True)
class SnapshotOptions(_Checked):
    """MemWAL index snapshots: up to `inline_threshold` regions inline (carried in every table
    manifest), else an index file. pylance leaves an index file behind at the next commit that
    changes the MemWAL index, so the builder also records each value that never changes under
    `_memwal/region_values/` before committing (`state/value_records.py`); GC collects a sharded
    region's merged generations once an inline snapshot or that record holds its value, whatever
    the threshold (`region_values.unrecorded_regions`)."""

    inline_threshold: int = field(default=100, metadata=_min(0))


@dataclass(frozen=True)
class CatchupOptions(_Checked):
    """How the base-table index catch-up calls `optimize_indices`. The default appends the merged
    rows as a delta segment and keeps the IVF centroids and PQ/SQ codebooks, as the spec requires
    once MemWAL is enabled; `retrain` rebuilds them, for an index no MemTable maintains only
    (a maintained one keeps its model: distances would no longer compare across generations), `num_indices_to_merge` merges that
    many segments into one in the same pass (None: Lance's default, a new delta segment)."""

    retrain: bool = False
    num_indices_to_merge: int | None = field(default=None, metadata=_min(0))


# The base-version retention floor (`GcOptions.cleanup_base_versions_floor_seconds`), see there.
BASE_VERSION_FLOOR_SECONDS = 86400.0
# The shipped base-version retention (`GcOptions.cleanup_base_versions_older_than_seconds`).
DEFAULT_BASE_VERSION_RETENTION_SECONDS = 7 * 86400.0
# What turns an optional setting off when written as text (a CLI flag, `off` in YAML).
_OFF = ("none", "null", "off")


def _duration(default: float | None, minimum: float = 0) -> Any:
    """A duration setting: seconds, or text with a unit ("7d", "12h", "30m", "90s")."""
    return field(default=default, metadata={"kind": "duration", "min": minimum})


@dataclass(frozen=True)
class GcOptions(_Checked):
    """What the garbage collector keeps: the newest `manifest_retention` manifest versions per
    region, anything younger than the ages, and (unless cleaned first) every generation a
    retained base-table version can time-travel to.

    **The retention floor.** Lance commits a transaction by rebasing it over the transactions of
    the versions committed since its read version; when `cleanup_old_versions` has removed those
    versions meanwhile, a merge that read version N and a compaction committed at N+1 produce
    duplicate keys and deleted rows back, and a commit can land in a version slot the cleanup
    just freed (it succeeds, the latest version never sees it). So the base-version cleanup
    never removes a version younger than `cleanup_base_versions_floor_seconds`, whether it is
    configured by age or only by count, and an age below the floor is refused.

    The default floor is a day: a commit's read version is at most one run old, and a merge run
    is failed by run monitoring after `sensor.merge_max_runtime_seconds` (1 h), but monitoring
    only marks the run failed: a worker that lives on can still commit later, and the age is
    measured with the cleaning machine's clock against the committer's. A day leaves 24 times
    the longest run for that (Delta refuses less than 7 days, Iceberg expires after 5, Lance's
    own default is 2 weeks; memwal's shipped retention, `cleanup_base_versions_older_than_seconds`,
    is a week). Its cost: the versions of a day stay readable (about 14,000 for a table merged
    every 30 s, and a GC pass reads each).
    Lower the floor only where no commit can be in flight for that long (tests, a table one
    process maintains); 0 turns it off.
    """

    manifest_retention: int = field(default=10, metadata=_min(1))  # the latest is always kept
    manifest_min_age_seconds: Duration = _duration(3600.0)
    orphan_grace_seconds: Duration = _duration(86400.0)  # a day: far beyond any flush (Iceberg 3 d, Delta 7 d)
    # Lance's own cleanup_old_versions of the base table, run before planning: versions older
    # than this go (a week by default, as LanceDB's `optimize`; Lance's own is 2 weeks; never
    # below the floor). None (`null`, `off`): no cleanup by age, and then every retained version
    # holds its generations forever unless `cleanup_base_versions_retain` limits them by count.
    cleanup_base_versions_older_than_seconds: Duration | None = _duration(DEFAULT_BASE_VERSION_RETENTION_SECONDS)
    cleanup_base_versions_retain: int | None = field(default=None, metadata=_min(1))
    cleanup_base_versions_floor_seconds: Duration = _duration(BASE_VERSION_FLOOR_SECONDS)
    keep_current_epoch_wal: bool = True
    max_workers: int = field(default=16, metadata=_min(1))
    # Regions with data from before the MemWAL initialization (after an overwrite) are reported
    # and kept; this long after they were first reported GC discards them (None: only by hand,
    # `memwal regions discard`). A week, as the shipped base-version retention.
    discard_stale_after_seconds: Duration | None = _duration(7 * 86400.0)
    # Base-table files no retained version references (commits that lost a race or crashed),
    # older than `leaked_file_grace_seconds` (`jobs/gc/leaks.py`; costs a listing of data/,
    # _deletions/, _transactions/ and _indices/ per pass).
    collect_leaked_files: bool = True
    # Not the orphan grace: any writer of the base table (an application's distributed append,
    # a LanceDB backfill) writes its files before its commit and takes no memwal lease, so a
    # file is a leak only once no commit can still be in flight for it. A week, as Lance's own
    # cleanup of unreferenced files; never below the retention floor (`leaked_grace`).
    leaked_file_grace_seconds: Duration = _duration(7 * 86400.0)
    # How often a pass lists the whole base table (`_versions/`, and the leak scan's directories)
    # and each region's directory (the orphan sweep); in between it only probes for new versions
    # and skips both (`jobs/gc/history.py`, `region_cache.py`), so a leaked file is collected
    # within `leaked_grace` plus this, an orphan within `orphan_grace_seconds` plus this.
    full_scan_interval_seconds: Duration = _duration(3600.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        age, floor = self.cleanup_base_versions_older_than_seconds, self.cleanup_base_versions_floor_seconds
        # The shipped age rises to a floor raised above it (`base_cleanup_older_than`); an age
        # written below the floor is refused.
        if age is not None and age < floor and age != DEFAULT_BASE_VERSION_RETENTION_SECONDS:
            raise OptionError(
                f"gc.cleanup_base_versions_older_than_seconds: {age:g} s is below the retention floor of "
                f"{floor:g} s (gc.cleanup_base_versions_floor_seconds): cleaning up base-table versions a "
                "commit in flight still reads can duplicate keys and bring deleted rows back; use at least "
                f"{floor:g} s, or lower gc.cleanup_base_versions_floor_seconds (--base-versions-floor) "
                "only where no commit can be in flight that long")

    @property
    def leaked_grace(self) -> float:
        """How old an unreferenced base-table file must be before GC collects it: the configured
        grace or the retention floor, whichever is longer (a commit in flight is at most that old)."""
        return max(self.leaked_file_grace_seconds, self.cleanup_base_versions_floor_seconds)

    @property
    def base_cleanup(self) -> bool:
        return self.cleanup_base_versions_older_than_seconds is not None or self.cleanup_base_versions_retain is not None

    @property
    def base_cleanup_older_than(self) -> timedelta | None:
        """The age a version must reach before the cleanup removes it: the configured age, or
        the floor for a cleanup by count alone (None: no cleanup configured)."""
        if not self.base_cleanup:
            return None
        s = max(self.cleanup_base_versions_older_than_seconds or 0.0, self.cleanup_base_versions_floor_seconds)
        return timedelta(microseconds=math.ceil(s * 1e6))  # rounded up: never a microsecond below the floor


@dataclass(frozen=True)
class LeaseOptions(_Checked):
    """The table lease (`memwal_core/state/lease.py`): one maintainer commits to a table at a
    time, across processes, hosts and Dagster instances. A holder renews every third of
    `ttl_seconds`; a lease not renewed for `ttl_seconds` (a dead or paused holder) may be taken
    over. A second maintainer waits up to `wait_seconds`, then skips the step ("held by ...").
    `ttl_seconds` must exceed the clock skew between maintainer hosts by a wide margin."""

    enabled: bool = True
    ttl_seconds: Duration = _duration(60.0, minimum=1)
    wait_seconds: Duration = _duration(30.0)


@dataclass(frozen=True)
class SloOptions(_Checked):
    """When the `merge_lag` and `catchup_gap` checks turn red."""

    merge_lag_seconds: Duration = _duration(600.0)
    catchup_gap_generations: int = 10


@dataclass(frozen=True)
class SensorOptions(_Checked):
    """The manifest sensor: how often it looks, and how long it retries a region that stays put."""

    interval_seconds: int = field(default=30, metadata=_min(1))
    # Merge requests per region while its progress stays put (backoff doubling from the
    # interval, capped); then the region is reported stuck instead of retried forever.
    merge_attempts: int = field(default=6, metadata=_min(1))
    max_backoff_seconds: Duration = _duration(3600.0)
    # A merge run still STARTED after this long is failed by run monitoring (its worker may
    # have died with the code server: the default run launcher cannot tell), freeing the pool.
    merge_max_runtime_seconds: Duration = _duration(3600.0)
    # A merge of at most this many pending generations runs in the tick itself on the table's
    # running Spark Connect server, without a run launch (memwal_pipeline/sensor/tick_merge.py);
    # more, or no server, go to a merge run. 0: always a run.
    tick_merge_max_generations: int = field(default=64, metadata=_min(0))


@dataclass(frozen=True)
class ScheduleOptions(_Checked):
    """Periodic maintenance even without merges (orphans, WAL hints, retention)."""

    maintenance_cron: str = "0 * * * *"


@dataclass(frozen=True)
class CompactionOptions(_Checked):
    """Thresholds (when compaction is worth it) and bounds (how much one run does).

    Compaction runs when any data trigger fires: more than `max_fragments` fragments, more than
    `max_small_fragments` small ones (fewer physical rows than `small_fragment_rows`), a small
    share above `max_small_fragment_share` once there are at least `min_small_fragments`, or
    more than `max_deleted_row_ratio` of the physical rows deleted (and at least
    `min_deleted_rows`). A table of at most `cheap_rewrite_bytes` is kept fully compacted
    instead: one extra fragment or one deletion file costs its scans 30-40 % (docs/benchmarks.md
    §7), more than rewriting it (0 turns this off). Index segments are merged when an index has
    more than `max_index_segments`.

    One run rewrites at most `max_bytes_per_run` of data files (the oldest candidate fragments
    first): the bound is in bytes only, so a table of many tiny fragments is not split over
    runs, and a table of at most `cheap_rewrite_bytes` is rewritten whole in one run.
    """

    # Keys of earlier releases, refused by `from_mapping` with what to set instead.
    removed_keys: ClassVar[dict[str, str]] = {
        "max_fragments_per_run": "the per-run bound is in bytes only: set max_bytes_per_run "
                                 "(a table of at most cheap_rewrite_bytes is always compacted whole)"}

    max_fragments: int = 64
    max_small_fragments: int = 16
    min_small_fragments: int = 4
    max_small_fragment_share: float = 0.5
    small_fragment_rows: int = 262_144
    max_deleted_row_ratio: float = 0.1
    min_deleted_rows: int = 10_000
    cheap_rewrite_bytes: Size = field(default=64 << 20, metadata={"kind": "size"})
    max_index_segments: int = 8
    # How Lance rewrites (its own options), and the per-run bounds.
    target_rows_per_fragment: int = 1_048_576
    materialize_deletions_threshold: float = 0.1
    max_bytes_per_run: Size = field(default=1 << 30, metadata={"kind": "size"})
    max_attempts: int = 3  # plans executed before giving up to concurrent commits
    restore_catchup: bool = True
    retrain_vector_indexes: bool = False
    retrain_drift_share: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_attempts < 1 or self.target_rows_per_fragment < 1:
            raise OptionError("compaction options max_attempts and target_rows_per_fragment must be positive")

    def lance_options(self, excluded: list[int] | None = None, *, full: bool = False) -> dict[str, Any]:
        """`lance.optimize.CompactionOptions` for the plan (`full`: materialize every deletion
        file, for a table kept fully compacted).

        The per-run bound is applied by excluding fragments (`bounded_plan`), not with Lance's
        `max_source_bytes` / `max_source_fragments`: those include whole tasks only, so a
        single task over the bound (all small fragments of a table form one task) would never
        be compacted at all.
        """
        out: dict[str, Any] = {"target_rows_per_fragment": self.target_rows_per_fragment,
                               "materialize_deletions": True,
                               "materialize_deletions_threshold": 0.0 if full else self.materialize_deletions_threshold}
        if excluded:
            out["excluded_fragment_ids"] = sorted(excluded)
        return out


# Limits on what one region manifest may hold (read by `state/region.py` on every decode).
# A region listing more generations is refused as too large (`CorruptManifest`), before any
# job plans it: a healthy region lists only its unmerged generations plus those GC has not
# trimmed yet (a few hundred at most), while 10^6 entries cost every job that plans the region
# seconds and hundreds of MB each pass. Decoding itself stays cheap (10^6 entries: 34 MB, 0.06 s).
MAX_REGION_GENERATIONS = 100_000
