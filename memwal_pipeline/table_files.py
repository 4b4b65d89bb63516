"""The tables a file configures, whichever file a person points the CLI at: a `memwal.yaml`
(`tables:`), a component's `defs.yaml` (`type: ...MemWalTable`, its `attributes` the table), or
a defs folder (every MemWalTable `defs.yaml` under it). One schema (`TableSpec`) checks them all,
with the same did-you-mean for a mistyped key."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from memwal_core.errors import OptionError
from memwal_core.options import unknown_keys

from .config import ConfigError, TableConfig, check_tables, load_config, resolve_uri, table_from_mapping

COMPONENT_KEYS = ("type", "attributes", "template_vars_module", "requirements", "post_processing")
COMPONENT_TYPE = "MemWalTable"  # memwal_pipeline.component.MemWalTable, or a subclass of that name
DEFS_FILES = ("defs.yaml", "defs.yml")


def load_tables(path: str | os.PathLike) -> list[TableConfig]:
    """The tables configured at `path` (a memwal.yaml, a defs.yaml, or a defs folder)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for name in DEFS_FILES for f in p.rglob(name))
        if not files:
            raise ConfigError(f"{p}: a folder, and no defs.yaml under it (give a memwal.yaml or a defs.yaml)")
        tables = [t for f in files for t in _component_tables(f, _documents(f), required=False)]
        if not tables:
            raise ConfigError(f"{p}: no {COMPONENT_TYPE} component in its defs.yaml files")
        check_tables(tables, str(p))
        return tables
    docs = _documents(p) if p.exists() else []
    if docs and isinstance(docs[0], dict) and ("type" in docs[0] or "attributes" in docs[0]):
        tables = _component_tables(p, docs, required=True)
        check_tables(tables, str(p))
        return tables
    return load_config(p)


def _documents(path: Path) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None


def _component_tables(path: Path, docs: list[Any], *, required: bool) -> list[TableConfig]:
    """The MemWalTable components of one defs.yaml (documents separated by `---`); a relative
    local uri is relative to the project root, as the component resolves it."""
    tables, types = [], []
    for i, doc in enumerate(docs):
        where = f"{path}" + (f" (document {i + 1})" if len(docs) > 1 else "")
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: expected a component (type:, attributes:), got {type(doc).__name__}")
        try:
            unknown_keys(doc, COMPONENT_KEYS, where)
        except OptionError as e:
            raise ConfigError(str(e)) from None
        kind = str(doc.get("type", ""))
        types.append(kind)
        if kind.rsplit(".", 1)[-1] != COMPONENT_TYPE:
            continue
        attributes = doc.get("attributes") or {}
        if "{{" in yaml.safe_dump(attributes):
            raise ConfigError(f"{where}: its attributes use a Dagster template ({{{{ ... }}}}), which only Dagster "
                              "resolves: give memwal the table's URI (and --storage-option) instead")
        cfg = table_from_mapping(attributes, f"{where}: attributes")
        tables.append(replace(cfg, uri=resolve_uri(cfg.uri, project_root(path))))
    if required and not tables:
        raise ConfigError(f"{path}: no {COMPONENT_TYPE} component (its type: {', '.join(types) or 'none'})")
    return tables


def project_root(path: Path) -> Path:
    """The folder of the nearest pyproject.toml above `path` (the dg project's root), else its folder."""
    here = path.resolve().parent
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file():
            return d
    return here
