"""The tables to maintain: a YAML file (`MEMWAL_CONFIG`, default `memwal.yaml` at the repo root).

Secret storage options are never written in the file: the file names an environment variable
and the Dagster resource resolves it with `dagster.EnvVar` at run time.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from memwal_core.compaction import CompactionOptions
from memwal_core.store import _S3_OPTION_ALIASES

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "memwal.yaml"
SECRET_OPTIONS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# Every spelling of a secret option that Lance or memwal's store accepts (keys compared lower-cased).
_SECRET_ALIASES = {a for name in ("aws_secret_access_key", "aws_session_token") for a in _S3_OPTION_ALIASES[name]}


class ConfigError(ValueError):
    pass


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
    orphan_grace_seconds: float = 3600.0
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


def _table(raw: dict[str, Any], where: str) -> TableConfig:
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}: 'name' must be an identifier (letters, digits, _), got {name!r}")
    if not raw.get("uri"):
        raise ConfigError(f"{where} ({name}): 'uri' is required")
    secrets = dict(raw.get("secrets") or {})
    for key in secrets:
        if key not in SECRET_OPTIONS:
            raise ConfigError(f"{where} ({name}): secret option {key!r} is not one of {SECRET_OPTIONS}")
    options = {str(k): str(v) for k, v in (raw.get("storage_options") or {}).items()}
    leaked = [k for k in options if k.lower() in _SECRET_ALIASES]
    if leaked:
        raise ConfigError(f"{where} ({name}): put {leaked} under 'secrets' as an environment variable name, "
                          "not in the file")
    spark = raw.get("spark") or {}
    merge = raw.get("merge") or {}
    gc = raw.get("gc") or {}
    slo = raw.get("slo") or {}
    d = TableConfig.__dataclass_fields__
    try:
        compaction = CompactionOptions.from_dict(raw.get("compaction") or {})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} ({name}): compaction: {e}") from None
    return TableConfig(
        name=name, uri=str(raw["uri"]), storage_options=options, secret_env=secrets,
        spark_master=str(spark.get("master", d["spark_master"].default)),
        spark_conf={str(k): str(v) for k, v in (spark.get("conf") or {}).items()},
        spark_connect=_connect_url(spark.get("connect"), f"{where} ({name})"),
        budget_bytes=int(merge.get("budget_bytes", d["budget_bytes"].default)),
        max_generations=int(merge.get("max_generations", d["max_generations"].default)),
        inline_threshold=int((raw.get("snapshot") or {}).get("inline_threshold", 100)),
        manifest_retention=int(gc.get("manifest_retention", 10)),
        manifest_min_age_seconds=float(gc.get("manifest_min_age_seconds", 3600)),
        orphan_grace_seconds=float(gc.get("orphan_grace_seconds", 3600)),
        cleanup_base_versions_older_than_seconds=(
            float(gc["cleanup_base_versions_older_than_seconds"])
            if gc.get("cleanup_base_versions_older_than_seconds") is not None else None),
        merge_lag_slo_seconds=float(slo.get("merge_lag_seconds", 600)),
        catchup_gap_slo_generations=int(slo.get("catchup_gap_generations", 10)),
        sensor_interval_seconds=int((raw.get("sensor") or {}).get("interval_seconds", 30)),
        merge_attempts=int((raw.get("sensor") or {}).get("merge_attempts", d["merge_attempts"].default)),
        merge_retry_max_backoff_seconds=float((raw.get("sensor") or {}).get(
            "max_backoff_seconds", d["merge_retry_max_backoff_seconds"].default)),
        merge_max_runtime_seconds=float((raw.get("sensor") or {}).get(
            "merge_max_runtime_seconds", d["merge_max_runtime_seconds"].default)),
        maintenance_cron=str((raw.get("schedule") or {}).get("maintenance_cron", "0 * * * *")),
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
    tables = []
    for i, t in enumerate(raw.get("tables") or []):
        cfg = _table(t, f"{path}: tables[{i}]")
        tables.append(TableConfig(**{**cfg.__dict__, "uri": resolve_uri(cfg.uri, path.parent)}))
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: table names must be unique, got {names}")
    return tables


def single_table(uri: str, storage_options: dict[str, str] | None = None, name: str = "table",
                 spark_master: str = "local[*]", base_versions_older_than: float | None = None,
                 compaction: CompactionOptions | None = None) -> TableConfig:
    """A config for `memwal maintain URI` (no config file; options given on the command line)."""
    return TableConfig(name=name, uri=uri, storage_options=dict(storage_options or {}), spark_master=spark_master,
                       cleanup_base_versions_older_than_seconds=base_versions_older_than,
                       compaction=compaction or CompactionOptions())
