"""The tables to maintain: a YAML file (`MEMWAL_CONFIG`, default `memwal.yaml` at the repo root).

Secret storage options are never written in the file: the file names an environment variable
and the Dagster resource resolves it with `dagster.EnvVar` at run time.
"""

from __future__ import annotations

import difflib
import math
import os
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from memwal_core.jobs.compaction import CompactionOptions
from memwal_core.state.store import _S3_OPTION_ALIASES, _opt

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "memwal.yaml"
SECRET_OPTIONS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# Every spelling of a secret option that Lance or memwal's store accepts (keys compared lower-cased).
_SECRET_ALIASES = {a for name in ("aws_secret_access_key", "aws_session_token") for a in _S3_OPTION_ALIASES[name]}


class ConfigError(ValueError):
    pass


# Every key the file may hold (a typo such as `merg:` is refused, not ignored).
TOP_KEYS = ("tables",)
TABLE_KEYS = {
    "name": None, "uri": None, "storage_options": None, "secrets": None,
    "spark": ("master", "conf", "connect"),
    "merge": ("budget_bytes", "max_generations"),
    "snapshot": ("inline_threshold",),
    "gc": ("manifest_retention", "manifest_min_age_seconds", "orphan_grace_seconds",
           "cleanup_base_versions_older_than_seconds"),
    "slo": ("merge_lag_seconds", "catchup_gap_generations"),
    "sensor": ("interval_seconds", "merge_attempts", "max_backoff_seconds", "merge_max_runtime_seconds"),
    "schedule": ("maintenance_cron",),
    "compaction": None,  # checked by CompactionOptions.from_dict
}
# Binary units, as Spark reads sizes ("256m" = 256 MiB); "256MB" and "256MiB" mean the same.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# What Spark accepts as a master (SparkContext: "Master must either be yarn or start with
# spark, k8s, or local", then its local[...] forms), and memwal's Spark Connect URLs.
_SPARK_MASTER = re.compile(r"^(local|local\[(\d+|\*)\]|local\[(\d+|\*)\s*,\s*\d+\]|"
                           r"local-cluster\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]|yarn|"
                           r"spark://\S+|k8s://\S+|sc://\S+)$")


def _unknown(keys, known, where: str) -> None:
    for k in keys:
        if k not in known:
            close = difflib.get_close_matches(str(k), [str(x) for x in known], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(map(str, known))}"
            raise ConfigError(f"{where}: unknown key {k!r}{hint}")


def _section(raw: dict, key: str, where: str) -> dict:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: '{key}' must be a mapping, got {type(value).__name__} {value!r}")
    if TABLE_KEYS.get(key):
        _unknown(value, TABLE_KEYS[key], f"{where}: {key}")
    return value


def parse_size(value: Any, what: str) -> int:
    """Bytes from an int or a size such as "256MB", "1.5g", "64KiB" (binary units)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size in bytes (e.g. 268435456 or 256MB), got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(f"{what}: expected a size in bytes (e.g. 268435456 or 256MB), got {value!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return n


def _number(value: Any, what: str, kind: type, minimum: float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{what}: expected a number, got {value!r}")
    try:
        n = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if kind is int and isinstance(value, float) and value != n:
        raise ConfigError(f"{what}: expected an integer, got {value!r}")
    if not math.isfinite(n) or n < minimum:
        raise ConfigError(f"{what}: must be a finite number >= {minimum:g}, got {value!r}")
    return n


def seconds(value: Any, what: str) -> float:
    """A duration in seconds: finite and >= 0 (`nan`, `inf` and negatives are refused)."""
    return _number(value, what, float, 0)


def check_spark_master(value: Any, what: str = "spark master") -> str:
    """A Spark master Spark can start (checked before a JVM is started for it)."""
    if not isinstance(value, str) or not _SPARK_MASTER.match(value.strip()):
        raise ConfigError(f"{what}: {value!r} is not a Spark master (use local[*], local[N], spark://HOST:PORT, "
                          "yarn, k8s://..., or sc://HOST:PORT)")
    return value.strip()


def table_identity(uri: str, storage_options: dict[str, str] | None = None) -> tuple[str, ...]:
    """What a table URI points at, whatever its spelling: `data/t`, `./data/t` and `/abs/data/t/`
    are one local directory; `s3://b/p/` and `s3://b/p` one prefix (percent-decoded as Lance
    decodes it) on one endpoint."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(uri)
    if parsed.scheme in ("s3", "s3a"):
        prefix = posixpath.normpath("/" + unquote(parsed.path)).strip("/")
        return ("s3", _opt(storage_options or {}, "aws_endpoint") or "", parsed.netloc, prefix)
    path = parsed.path if parsed.scheme == "file" else uri
    return ("file", os.path.realpath(os.path.expanduser(path)))


@dataclass(frozen=True)
class TableConfig:
    name: str
    uri: str
    storage_options: dict[str, str] = field(default_factory=dict)
    secret_env: dict[str, str] = field(default_factory=dict)  # storage option -> env var name
    spark_master: str = "local[*]"
    spark_conf: dict[str, str] = field(default_factory=dict)
    # Dagster runs use a long-lived Spark Connect server here (started on first use, running
    # `spark_master`) instead of a JVM per run; None: each run starts `spark_master` itself.
    spark_connect: str | None = None
    budget_bytes: int = 256 * 1024 * 1024
    max_generations: int = 256
    inline_threshold: int = 100
    manifest_retention: int = 10
    manifest_min_age_seconds: float = 3600.0
    orphan_grace_seconds: float = 86400.0
    cleanup_base_versions_older_than_seconds: float | None = None
    merge_lag_slo_seconds: float = 600.0
    catchup_gap_slo_generations: int = 10
    sensor_interval_seconds: int = 30
    # Merge requests per region while its progress stays put (backoff doubling from the
    # interval, capped); then the region is reported stuck instead of retried forever.
    merge_attempts: int = 6
    merge_retry_max_backoff_seconds: float = 3600.0
    # A merge run still STARTED after this long is failed by run monitoring (its worker may
    # have died with the code server: the default run launcher cannot tell), freeing the pool.
    merge_max_runtime_seconds: float = 3600.0
    maintenance_cron: str = "0 * * * *"
    # Base-table compaction thresholds and per-run bounds (`compaction:` in memwal.yaml).
    compaction: CompactionOptions = field(default_factory=CompactionOptions)

    @property
    def pool(self) -> str:
        return f"memwal_{self.name}"


def _table(raw: Any, where: str) -> TableConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a table must be a mapping (name:, uri:, ...), got {raw!r}")
    _unknown(raw, TABLE_KEYS, where)
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}: 'name' must be an identifier (letters, digits, _), got {name!r}")
    where = f"{where} ({name})"
    if not raw.get("uri") or not isinstance(raw.get("uri"), str):
        raise ConfigError(f"{where}: 'uri' is required (a path or s3://bucket/prefix)")
    secrets = dict(_section(raw, "secrets", where))
    for key in secrets:
        if key not in SECRET_OPTIONS:
            raise ConfigError(f"{where}: secret option {key!r} is not one of {SECRET_OPTIONS}")
    options = {str(k): str(v) for k, v in _section(raw, "storage_options", where).items()}
    leaked = [k for k in options if k.lower() in _SECRET_ALIASES]
    if leaked:
        raise ConfigError(f"{where}: put {leaked} under 'secrets' as an environment variable name, "
                          "not in the file")
    spark = _section(raw, "spark", where)
    merge = _section(raw, "merge", where)
    gc = _section(raw, "gc", where)
    slo = _section(raw, "slo", where)
    snapshot = _section(raw, "snapshot", where)
    sensor = _section(raw, "sensor", where)
    schedule = _section(raw, "schedule", where)
    d = TableConfig.__dataclass_fields__

    def get(section: dict, sec: str, key: str, default: Any, conv) -> Any:
        value = section.get(key, default)
        return conv(value, f"{where}: {sec}.{key}")

    def integer(minimum: int):
        return lambda v, w: _number(v, w, int, minimum)

    older = gc.get("cleanup_base_versions_older_than_seconds")
    try:
        compaction = CompactionOptions.from_dict(_section(raw, "compaction", where))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: compaction: {e}") from None
    return TableConfig(
        name=name, uri=str(raw["uri"]), storage_options=options, secret_env=secrets,
        spark_master=check_spark_master(spark.get("master", d["spark_master"].default), f"{where}: spark.master"),
        spark_conf={str(k): str(v) for k, v in _section(spark, "conf", f"{where}: spark").items()},
        spark_connect=_connect_url(spark.get("connect"), where),
        budget_bytes=get(merge, "merge", "budget_bytes", d["budget_bytes"].default, parse_size),
        max_generations=get(merge, "merge", "max_generations", d["max_generations"].default, integer(1)),
        inline_threshold=get(snapshot, "snapshot", "inline_threshold", 100, integer(0)),
        manifest_retention=get(gc, "gc", "manifest_retention", 10, integer(1)),
        manifest_min_age_seconds=get(gc, "gc", "manifest_min_age_seconds", 3600, seconds),
        orphan_grace_seconds=get(gc, "gc", "orphan_grace_seconds", 86400, seconds),
        cleanup_base_versions_older_than_seconds=(
            seconds(older, f"{where}: gc.cleanup_base_versions_older_than_seconds") if older is not None else None),
        merge_lag_slo_seconds=get(slo, "slo", "merge_lag_seconds", 600, seconds),
        catchup_gap_slo_generations=get(slo, "slo", "catchup_gap_generations", 10, integer(0)),
        sensor_interval_seconds=get(sensor, "sensor", "interval_seconds", 30, integer(1)),
        merge_attempts=get(sensor, "sensor", "merge_attempts", d["merge_attempts"].default, integer(1)),
        merge_retry_max_backoff_seconds=get(sensor, "sensor", "max_backoff_seconds",
                                            d["merge_retry_max_backoff_seconds"].default, seconds),
        merge_max_runtime_seconds=get(sensor, "sensor", "merge_max_runtime_seconds",
                                      d["merge_max_runtime_seconds"].default, seconds),
        maintenance_cron=str(schedule.get("maintenance_cron", "0 * * * *")),
        compaction=compaction,
    )


def _connect_url(value: Any, where: str) -> str | None:
    if value in (None, "", False):
        return None
    if not (isinstance(value, str) and value.startswith("sc://")):
        raise ConfigError(f"{where}: spark.connect must be a Spark Connect URL like sc://127.0.0.1:15002, "
                          f"got {value!r}")
    return value


def resolve_uri(uri: str, base: Path) -> str:
    """Relative local paths are relative to the config file's directory."""
    if "://" in uri or os.path.isabs(uri):
        return uri
    return str((base / uri).resolve())


def load_config(path: str | os.PathLike | None = None) -> list[TableConfig]:
    path = Path(path or os.environ.get("MEMWAL_CONFIG") or DEFAULT_CONFIG)
    if not path.exists():
        raise ConfigError(f"memwal config {path} not found (set MEMWAL_CONFIG or create memwal.yaml)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"memwal config {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"memwal config {path}: expected a mapping with 'tables:', got {type(raw).__name__}")
    _unknown(raw, TOP_KEYS, f"memwal config {path}")
    listed = raw.get("tables") or []
    if not isinstance(listed, list):
        raise ConfigError(f"memwal config {path}: 'tables' must be a list of tables (each item starts with "
                          f"'- name: ...'), got a {type(listed).__name__}")
    tables = []
    for i, t in enumerate(listed):
        cfg = _table(t, f"{path}: tables[{i}]")
        tables.append(TableConfig(**{**cfg.__dict__, "uri": resolve_uri(cfg.uri, path.parent)}))
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: table names must be unique, got {names}")
    # One table under two names (or spellings of its path) would get two pools: its commits
    # would no longer be serialized.
    seen: dict[tuple[str, ...], str] = {}
    for t in tables:
        ident = table_identity(t.uri, t.storage_options)
        if ident in seen:
            raise ConfigError(f"{path}: tables {seen[ident]!r} and {t.name!r} are the same table ({t.uri}); "
                              "configure each table once")
        seen[ident] = t.name
    return tables


def single_table(uri: str, storage_options: dict[str, str] | None = None, name: str = "table",
                 spark_master: str = "local[*]", base_versions_older_than: float | None = None,
                 compaction: CompactionOptions | None = None) -> TableConfig:
    """A config for `memwal maintain URI` (no config file; options given on the command line)."""
    spark_master = check_spark_master(spark_master, "--spark-master")
    if base_versions_older_than is not None:
        base_versions_older_than = seconds(base_versions_older_than, "--base-versions-older-than")
    return TableConfig(name=name, uri=uri, storage_options=dict(storage_options or {}), spark_master=spark_master,
                       cleanup_base_versions_older_than_seconds=base_versions_older_than,
                       compaction=compaction or CompactionOptions())
