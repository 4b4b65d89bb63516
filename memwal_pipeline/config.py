"""A maintained table's settings: `TableConfig` (what the definitions and jobs take), its schema
`TableSpec` (the attributes of the `MemWalTable` component in `defs/<table>/defs.yaml`, and of
each `tables:` item of a `memwal.yaml`: one schema, so both accept and refuse the same settings),
and `load_config` for `memwal.yaml` (`MEMWAL_CONFIG`, default `memwal.yaml` at the repo root).

Secret storage options are never written in a file: the file names an environment variable
and the Dagster resource resolves it with `dagster.EnvVar` at run time.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Mapping

import dagster as dg
import yaml
from pydantic import (
    BeforeValidator,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from memwal_core.errors import OptionError
from memwal_core.options import (
    CatchupOptions,
    CompactionOptions,
    GcOptions,
    LeaseOptions,
    MergeOptions,
    ScheduleOptions,
    SensorOptions,
    SloOptions,
    SnapshotOptions,
    SparkOptions,
    check_spark_master,
    from_mapping,
    unknown_keys,
)
from memwal_core.state.store import _S3_OPTION_ALIASES, _opt

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "memwal.yaml"
SECRET_OPTIONS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token", "azure_storage_account_key",
                  "azure_storage_sas_key", "azure_client_secret", "google_service_account_key")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# Every spelling of a secret option that Lance or memwal's store accepts (keys compared lower-cased).
_SECRET_ALIASES = {a for name in SECRET_OPTIONS if name != "aws_access_key_id" for a in _S3_OPTION_ALIASES[name]}


class ConfigError(OptionError):
    """The config file (or a table's settings) cannot be used as written."""


# A table's sections: each maps 1:1 onto an options dataclass of memwal_core.options.
SECTIONS: dict[str, type] = {
    "spark": SparkOptions, "merge": MergeOptions, "snapshot": SnapshotOptions, "gc": GcOptions,
    "slo": SloOptions, "sensor": SensorOptions, "schedule": ScheduleOptions, "compaction": CompactionOptions,
    "lease": LeaseOptions, "catchup": CatchupOptions,
}
TOP_KEYS = ("tables",)


def table_identity(uri: str, storage_options: dict[str, str] | None = None) -> tuple[str, ...]:
    """What a table URI points at, whatever its spelling: `data/t`, `./data/t` and `/abs/data/t/`
    are one local directory; `s3://b/p/` and `s3://b/p` one prefix (percent-decoded as Lance
    decodes it) on one endpoint."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(uri)
    if parsed.scheme in ("s3", "s3a"):
        prefix = posixpath.normpath("/" + unquote(parsed.path)).strip("/")
        return ("s3", _opt(storage_options or {}, "aws_endpoint") or "", parsed.netloc, prefix)
    if parsed.scheme in ("gs", "az"):
        prefix = posixpath.normpath("/" + unquote(parsed.path)).strip("/")
        options = {k.lower(): v for k, v in (storage_options or {}).items()}
        where = options.get("azure_endpoint") or options.get("azure_storage_account_name") or ""
        return (parsed.scheme, where, parsed.netloc, prefix)
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
    lease: LeaseOptions = field(default_factory=LeaseOptions)
    catchup: CatchupOptions = field(default_factory=CatchupOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(f"table name must be an identifier (letters, digits, _), got {self.name!r}")
        if not self.uri or not isinstance(self.uri, str):
            raise ConfigError(f"table {self.name}: 'uri' is required (a path, s3://, gs:// or az://)")
        for key in self.secrets:
            if key not in SECRET_OPTIONS:
                raise ConfigError(f"table {self.name}: secret option {key!r} is not one of {', '.join(SECRET_OPTIONS)}")
        leaked = [k for k in self.storage_options if k.lower() in _SECRET_ALIASES]
        if leaked:
            raise ConfigError(f"table {self.name}: put {', '.join(leaked)} under 'secrets' as an environment variable "
                              "name, not in storage_options")

    @property
    def pool(self) -> str:
        return f"memwal_{self.name}"


def _leave_unknown_keys_to_validation(schema: dict[str, Any]) -> None:
    """Why the component's JSON schema does not refuse unknown keys (nor list required ones):
    `dg check defs` first checks each defs.yaml against that schema, and a JSON-schema refusal
    says only "'budget_byte' was unexpected" (or "'uri' is a required property" for `ur:`) and
    stops there. Open, the file reaches the component, whose validation refuses the key with the
    did-you-mean memwal.yaml and `memwal --config` give (`memwal_core.options.unknown_keys`),
    naming the file and line. Editors still complete the known keys and check their types."""
    schema.pop("additionalProperties", None)
    schema.pop("required", None)


def _section_schema(cls: type) -> dict[str, Any]:
    """A section's JSON schema (editors, `dg utils inspect-component`): the dataclass's own
    (unknown keys are refused by validation: `_leave_unknown_keys_to_validation`); sizes and
    durations take their units from their pydantic types (`memwal_core.options.Size`,
    `Duration`: "256MB", "7d")."""
    schema = TypeAdapter(cls).json_schema()
    _leave_unknown_keys_to_validation(schema)
    hints = typing.get_type_hints(cls, include_extras=False)
    for f in dataclasses.fields(cls):  # an optional duration is also turned off by "off" (YAML: false)
        if f.metadata.get("kind") == "duration" and type(None) in typing.get_args(hints[f.name]):
            prop = schema["properties"][f.name]
            alts = prop.get("anyOf", [prop])
            prop["anyOf"] = alts + [{"type": "string", "enum": ["off", "none", "null"]}, {"type": "boolean", "const": False}]
    return schema


def _section(cls: type) -> Any:
    """A section of the schema: the options dataclass itself (its fields and defaults), parsed
    by the core's `from_mapping` (did-you-mean for unknown keys, sizes with units)."""

    def parse(value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, cls):  # from Python: TableSpec(..., merge=MergeOptions(...))
            return value
        return from_mapping(cls, value, info.field_name or cls.__name__)

    return Annotated[cls, PlainValidator(parse, json_schema_input_type=cls), WithJsonSchema(_section_schema(cls))]


def _strings(value: Any) -> Any:
    """Storage options as strings, as Lance takes them (YAML reads `true` or `443` as non-strings)."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    return value


_Strings = Annotated[dict[str, str], BeforeValidator(_strings)]


class TableSpec(dg.Model):
    """One maintained table as written by hand: `TableConfig`'s fields, one section per options
    dataclass of `memwal_core.options` (same keys, same defaults: pydantic reads them from the
    dataclass). A relative local `uri` is relative to the file that names it (memwal.yaml) or
    to the project root (a component's defs.yaml)."""

    model_config = dg.Model.model_config | {"json_schema_extra": _leave_unknown_keys_to_validation}

    name: str = Field(description="Identifier (letters, digits, _): prefixes asset keys, jobs and the pool.")
    uri: str = Field(description="The table: a local path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix.")
    storage_options: _Strings = Field(default_factory=dict, description="Lance storage options, no secrets.")
    secrets: _Strings = Field(default_factory=dict, description=(
        f"Secret storage option ({', '.join(SECRET_OPTIONS)}) -> the environment variable holding it, "
        "resolved with dagster.EnvVar at run time."))
    spark: _section(SparkOptions) = SparkOptions()
    merge: _section(MergeOptions) = MergeOptions()
    snapshot: _section(SnapshotOptions) = SnapshotOptions()
    gc: _section(GcOptions) = GcOptions()
    slo: _section(SloOptions) = SloOptions()
    sensor: _section(SensorOptions) = SensorOptions()
    schedule: _section(ScheduleOptions) = ScheduleOptions()
    compaction: _section(CompactionOptions) = CompactionOptions()
    lease: _section(LeaseOptions) = LeaseOptions()
    catchup: _section(CatchupOptions) = CatchupOptions()

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, raw: Any) -> Any:
        """An unknown key gets a did-you-mean (pydantic alone says "extra inputs are not permitted")."""
        if isinstance(raw, Mapping):
            name = raw.get("name")
            unknown_keys(raw, list(cls.model_fields), f"table {name}" if isinstance(name, str) else "table")
        return raw

    @model_validator(mode="after")
    def _valid_table(self) -> "TableSpec":
        self.table_config()  # TableConfig's own checks (name, uri, secrets) at validation time
        return self

    def table_config(self, base: Path | None = None) -> TableConfig:
        """The table as the definitions and jobs take it; a relative local `uri` against `base`."""
        return TableConfig(name=self.name, uri=resolve_uri(self.uri, base) if base else self.uri,
                           storage_options=dict(self.storage_options), secrets=dict(self.secrets),
                           **{k: getattr(self, k) for k in SECTIONS})


def validation_message(e: ValidationError) -> str:
    """A pydantic ValidationError in memwal's words: our own message when one of our checks
    refused the value (it names the key and what to do), else pydantic's with the key's path."""
    lines = []
    for err in e.errors():
        cause = (err.get("ctx") or {}).get("error")
        loc = ".".join(str(p) for p in err["loc"])
        if isinstance(cause, OptionError):
            lines.append(str(cause))
        elif err["type"] == "missing":
            lines.append(f"{loc!r} is required")
        else:
            lines.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(lines)


def table_from_mapping(raw: Any, where: str) -> TableConfig:
    """A table from a hand-written mapping (a memwal.yaml `tables:` item): `TableSpec` validates
    it, so memwal.yaml maps 1:1 onto the `MemWalTable` component's attributes."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: a table must be a mapping (name:, uri:, ...), got {raw!r}")
    try:
        return TableSpec.model_validate(raw).table_config()
    except ValidationError as e:
        raise ConfigError(f"{where}: {validation_message(e)}") from None
    except OptionError as e:
        raise ConfigError(f"{where}: {e}") from None


def check_tables(tables: list[TableConfig], where: str = "memwal") -> None:
    """What no single table can check: unique names, each table configured once, one master per
    Spark Connect server."""
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: table names must be unique, got {', '.join(names)}")
    # One table under two names (or spellings of its path) would get two pools: its commits
    # would no longer be serialized.
    seen: dict[tuple[str, ...], str] = {}
    for t in tables:
        ident = table_identity(t.uri, t.storage_options)
        if ident in seen:
            raise ConfigError(f"{where}: tables {seen[ident]!r} and {t.name!r} are the same table ({t.uri}); "
                              "configure each table once")
        seen[ident] = t.name
    check_connect_servers(tables)


def check_connect_servers(tables: list[TableConfig]) -> None:
    """Tables sharing a Spark Connect URL share its server, whose master is fixed at start:
    refuse different masters at load time (per-session settings are fine; other fixed settings
    are checked against the running server by `spark_connect.apply_session_conf`)."""
    by_url: dict[str, TableConfig] = {}
    for t in tables:
        if not t.spark.connect:
            continue
        first = by_url.setdefault(t.spark.connect, t)
        if first.spark.master != t.spark.master:
            raise ConfigError(f"tables {first.name!r} and {t.name!r} share the Spark Connect server "
                              f"{t.spark.connect} but ask for different masters ({first.spark.master!r}, "
                              f"{t.spark.master!r}); one server runs one master: give one of them its own "
                              "spark.connect port")


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
    check_tables(tables, str(path))
    return tables


def single_table(uri: str, storage_options: dict[str, str] | None = None, name: str = "table",
                 spark_master: str = "local[*]", base_versions_older_than: float | str | None = None,
                 compaction: CompactionOptions | None = None,
                 base_versions_floor: float | str | None = None) -> TableConfig:
    """A config for `memwal maintain URI` (no config file; options given on the command line).
    A cleanup age below the retention floor is refused (`GcOptions`) unless the floor is lowered."""
    try:
        spark = SparkOptions(master=check_spark_master(spark_master, "--spark-master"))
        raw: dict[str, Any] = {}
        if base_versions_older_than is not None:
            raw["cleanup_base_versions_older_than_seconds"] = base_versions_older_than
        if base_versions_floor is not None:
            raw["cleanup_base_versions_floor_seconds"] = base_versions_floor
        gc = from_mapping(GcOptions, raw, "gc")
    except OptionError as e:
        raise ConfigError(str(e)) from None
    return TableConfig(name=name, uri=uri, storage_options=dict(storage_options or {}), spark=spark,
                       gc=gc,
                       compaction=compaction or CompactionOptions())
