"""The tables to maintain: a YAML file (`MEMWAL_CONFIG`, default `memwal.yaml` at the repo root).

Secret storage options are never written in the file: the file names an environment variable
and the Dagster resource resolves it with `dagster.EnvVar` at run time.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from memwal_core.errors import OptionError
from memwal_core.options import (
    CompactionOptions,
    GcOptions,
    MergeOptions,
    ScheduleOptions,
    SensorOptions,
    SloOptions,
    SnapshotOptions,
    SparkOptions,
    check_spark_master,
    from_mapping,
    seconds,
    unknown_keys,
)
from memwal_core.state.store import _S3_OPTION_ALIASES, _opt

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "memwal.yaml"
SECRET_OPTIONS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# Every spelling of a secret option that Lance or memwal's store accepts (keys compared lower-cased).
_SECRET_ALIASES = {a for name in ("aws_secret_access_key", "aws_session_token") for a in _S3_OPTION_ALIASES[name]}


class ConfigError(OptionError):
    """The config file (or a table's settings) cannot be used as written."""


# A table's sections: each maps 1:1 onto an options dataclass of memwal_core.options.
SECTIONS: dict[str, type] = {
    "spark": SparkOptions, "merge": MergeOptions, "snapshot": SnapshotOptions, "gc": GcOptions,
    "slo": SloOptions, "sensor": SensorOptions, "schedule": ScheduleOptions, "compaction": CompactionOptions,
}
TOP_KEYS = ("tables",)
TABLE_KEYS = ("name", "uri", "storage_options", "secrets", *SECTIONS)


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
    """One maintained table: where it is, and its settings (one options dataclass per section)."""

    name: str
    uri: str
    storage_options: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)  # storage option -> env var name
    spark: SparkOptions = field(default_factory=SparkOptions)
    merge: MergeOptions = field(default_factory=MergeOptions)
    snapshot: SnapshotOptions = field(default_factory=SnapshotOptions)
    gc: GcOptions = field(default_factory=GcOptions)
    slo: SloOptions = field(default_factory=SloOptions)
    sensor: SensorOptions = field(default_factory=SensorOptions)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    compaction: CompactionOptions = field(default_factory=CompactionOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(f"table name must be an identifier (letters, digits, _), got {self.name!r}")
        if not self.uri or not isinstance(self.uri, str):
            raise ConfigError(f"table {self.name}: 'uri' is required (a path or s3://bucket/prefix)")
        for key in self.secrets:
            if key not in SECRET_OPTIONS:
                raise ConfigError(f"table {self.name}: secret option {key!r} is not one of {SECRET_OPTIONS}")
        leaked = [k for k in self.storage_options if k.lower() in _SECRET_ALIASES]
        if leaked:
            raise ConfigError(f"table {self.name}: put {leaked} under 'secrets' as an environment variable "
                              "name, not in storage_options")

    @property
    def pool(self) -> str:
        return f"memwal_{self.name}"


def table_from_mapping(raw: Any, where: str) -> TableConfig:
    """A table from a hand-written mapping (memwal.yaml's `tables:` item): keys as the fields."""
    try:
        return _table(raw, where)
    except ConfigError:
        raise
    except OptionError as e:
        raise ConfigError(str(e)) from None


def _table(raw: Any, where: str) -> TableConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a table must be a mapping (name:, uri:, ...), got {raw!r}")
    unknown_keys(raw, TABLE_KEYS, where)
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}: 'name' must be an identifier (letters, digits, _), got {name!r}")
    where = f"{where} ({name})"
    if not raw.get("uri") or not isinstance(raw.get("uri"), str):
        raise ConfigError(f"{where}: 'uri' is required (a path or s3://bucket/prefix)")
    plain = {}
    for key in ("storage_options", "secrets"):
        value = raw.get(key) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: '{key}' must be a mapping, got {type(value).__name__} {value!r}")
        plain[key] = {str(k): str(v) for k, v in value.items()}
    sections = {key: from_mapping(cls, raw.get(key), f"{where}: {key}") for key, cls in SECTIONS.items()}
    try:
        return TableConfig(name=name, uri=raw["uri"], **plain, **sections)
    except OptionError as e:
        raise ConfigError(f"{where}: {e}") from None


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
    try:
        unknown_keys(raw, TOP_KEYS, f"memwal config {path}")
    except OptionError as e:
        raise ConfigError(str(e)) from None
    listed = raw.get("tables") or []
    if not isinstance(listed, list):
        raise ConfigError(f"memwal config {path}: 'tables' must be a list of tables (each item starts with "
                          f"'- name: ...'), got a {type(listed).__name__}")
    tables = []
    for i, t in enumerate(listed):
        cfg = table_from_mapping(t, f"{path}: tables[{i}]")
        tables.append(replace(cfg, uri=resolve_uri(cfg.uri, path.parent)))
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
    try:
        spark = SparkOptions(master=check_spark_master(spark_master, "--spark-master"))
        if base_versions_older_than is not None:
            base_versions_older_than = seconds(base_versions_older_than, "--base-versions-older-than")
    except OptionError as e:
        raise ConfigError(str(e)) from None
    return TableConfig(name=name, uri=uri, storage_options=dict(storage_options or {}), spark=spark,
                       gc=GcOptions(cleanup_base_versions_older_than_seconds=base_versions_older_than),
                       compaction=compaction or CompactionOptions())
