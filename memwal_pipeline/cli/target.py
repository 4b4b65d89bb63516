"""The table a command works on: a URI, or a table of a config file; the flags over its settings,
checked by the same rules as the file, and its secret storage options resolved."""

from __future__ import annotations

import os
from typing import Any

from .output import CliError


def key_values(pairs: list[str], flag: str = "--storage-option") -> dict[str, str]:
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise CliError(f"{flag} expects KEY=VALUE, got {p!r}")
        k, v = p.split("=", 1)
        out[k.strip()] = v
    return out


def split_secrets(options: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain storage options, secret ones): a TableConfig holds no secret value (its
    `secrets` name environment variables), so secrets given as flags travel beside it."""
    from memwal_core.state.store import _S3_OPTION_ALIASES

    from ..config import SECRET_OPTIONS

    canonical = {alias: name for name in SECRET_OPTIONS for alias in _S3_OPTION_ALIASES[name]}
    plain = {k: v for k, v in options.items() if k.lower() not in canonical}
    return plain, {canonical[k.lower()]: v for k, v in options.items() if k.lower() in canonical}


def secret_values(cfg, given: dict[str, str]) -> dict[str, str]:
    """The table's secret storage options: `given` (flags), then each `secrets:` entry from
    its environment variable. Values are never printed, not even in errors."""
    out = dict(given)
    for option, var in cfg.secrets.items():
        if option in given:
            continue
        value = os.environ.get(var)
        if not value:
            raise CliError(f"table {cfg.name}: secret {option} is read from the environment variable {var}, "
                           f"which is not set: export {var} (or pass --storage-option {option}=...)")
        out[option] = value
    return out


def _configured_table(path: str, name: str | None):
    """Table `name` of the config file at `path` (`name` may be omitted when it has one table)."""
    import difflib

    from ..table_files import load_tables

    tables = load_tables(path)
    names = [t.name for t in tables]
    if name is None:
        if len(tables) == 1:
            return tables[0]
        raise CliError(f"{path} configures {len(tables)} tables ({', '.join(names) or 'none'}): "
                       "choose one with --table NAME")
    for t in tables:
        if t.name == name:
            return t
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise CliError(f"{path} has no table {name!r}{hint}; configured tables: {', '.join(names) or 'none'}")


def _flag_value(value: str) -> Any:
    """A flag's value read as memwal.yaml would read it (`0` is a number, `256MB` a string), so a
    flag is checked by the same rule as the setting in the file, with the same message."""
    import yaml

    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, (int, float, str, bool)) else value


def _override(options: Any, section: str, key: str, flag: str, value: Any, keep: tuple[str, ...] = ()) -> Any:
    """`options` (a section of TableConfig) with `key` set from a flag, converted and checked
    by `from_mapping` exactly as the config file's `section.key` is (`keep`: the settings the
    check weighs it against, taken from `options`: the retention floor for a cleanup age)."""
    from dataclasses import replace

    from memwal_core.errors import OptionError
    from memwal_core.options import from_mapping

    try:
        parsed = from_mapping(type(options), {**{k: getattr(options, k) for k in keep}, key: value},
                              f"{flag}: {section}")
    except OptionError as e:
        raise (e if str(e).startswith(flag) else OptionError(f"{flag}: {e}")) from None
    return replace(options, **{key: getattr(parsed, key)})


def apply_flags(cfg, a) -> Any:
    """`cfg` with the command line's settings over its own (flags win; `--spark-conf` keys are
    merged over `spark.conf`)."""
    from dataclasses import replace

    merge, spark, gc, compaction = cfg.merge, cfg.spark, cfg.gc, cfg.compaction
    if getattr(a, "budget", None) is not None:
        merge = _override(merge, "merge", "budget_bytes", "--budget", _flag_value(a.budget))
    if getattr(a, "max_generations", None) is not None:
        merge = _override(merge, "merge", "max_generations", "--max-generations", _flag_value(a.max_generations))
    if getattr(a, "spark_master", None) is not None:
        spark = _override(spark, "spark", "master", "--spark-master", a.spark_master)
    if getattr(a, "spark_conf", None):
        spark = replace(spark, conf={**spark.conf, **key_values(a.spark_conf, "--spark-conf")})
    # The CLI is one short process: it runs its own session (`spark.master`), never the table's
    # long-lived Connect server; `--spark-master sc://HOST:PORT` asks for a Connect server.
    spark = replace(spark, connect=None)
    if getattr(a, "base_versions_floor", None) is not None:  # first: the age below is checked against it
        gc = _override(gc, "gc", "cleanup_base_versions_floor_seconds", "--base-versions-floor",
                       _flag_value(a.base_versions_floor), keep=("cleanup_base_versions_older_than_seconds",))
    if getattr(a, "base_versions_older_than", None) is not None:
        gc = _override(gc, "gc", "cleanup_base_versions_older_than_seconds", "--base-versions-older-than",
                       _flag_value(a.base_versions_older_than), keep=("cleanup_base_versions_floor_seconds",))
    if getattr(a, "retrain_vector_indexes", False):
        compaction = replace(compaction, retrain_vector_indexes=True)
    lease = cfg.lease
    if getattr(a, "lease_wait", None) is not None:
        lease = _override(lease, "lease", "wait_seconds", "--lease-wait", _flag_value(a.lease_wait))
    return replace(cfg, merge=merge, spark=spark, gc=gc, compaction=compaction, lease=lease)


def name_of(uri: str) -> str:
    """The name a table given by its URI goes by (progress lines, the pass's Dagster assets):
    its folder's name as an identifier (`s3://b/lake/my-events` -> `my_events`)."""
    from ..scaffold import table_name

    path = uri if "://" in uri else os.path.abspath(uri)
    return table_name(path.rstrip("/").rsplit("/", 1)[-1] or "table")


def target(a) -> tuple[Any, dict[str, str]]:
    """The table a command works on (`URI`, or `--config FILE [--table NAME]`: exactly one),
    with the flags applied, and its secret storage options resolved."""
    from dataclasses import replace

    from ..config import single_table

    if a.table is not None and a.config is None:
        raise CliError("--table NAME needs --config FILE (the file that configures the table)")
    if a.config is None and a.uri is None:
        raise CliError("which table? give its URI, or --config FILE [--table NAME]")
    if a.config is not None and a.uri is not None:
        raise CliError(f"give either a URI ({a.uri}) or --config FILE [--table NAME], not both")
    plain, secrets = split_secrets(key_values(a.storage_option))
    if a.config is None:
        cfg = single_table(a.uri, plain, name=name_of(a.uri))
    else:
        cfg = _configured_table(a.config, a.table)
        cfg = replace(cfg, storage_options={**cfg.storage_options, **plain})
    return apply_flags(cfg, a), secret_values(cfg, secrets)
