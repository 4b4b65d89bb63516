"""The `MemWalTable` Dagster component: its schema is the core's options dataclasses, a defs.yaml
and a memwal.yaml item are one schema, bad YAML is refused with a clear message by `dg check
defs`, one table is configured once across components and memwal.yaml, and the repo's dg project
and workspace both load (real `dg` and `dagster` CLIs, real component loading; no Spark)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from dagster import ComponentTree
from pydantic import ValidationError
from support.dg_project import project

from memwal_pipeline import definitions
from memwal_pipeline.component import MemWalTable
from memwal_pipeline.config import SECTIONS, ConfigError, TableConfig, TableSpec, table_from_mapping

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

ASSETS = ("region_generations", "base_table", "base_compaction", "memwal_index", "index_catchup", "garbage")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMWAL_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _load(root: Path, module: str, monkeypatch):
    monkeypatch.syspath_prepend(str(root))
    return ComponentTree.for_project(path_within_project=root)


def _chain(e: BaseException) -> str:
    """Every message of an exception and its causes (Dagster wraps a component's error)."""
    out = []
    while e is not None:
        out.append(str(e))
        e = e.__cause__ or e.__context__
    return "\n".join(out)


def test_schema_is_the_core_dataclasses():
    """One name and one default per setting: the component's fields are TableConfig's, and each
    section's schema is its options dataclass, defaults included."""
    assert set(TableSpec.model_fields) == {f.name for f in dataclasses.fields(TableConfig)}
    assert issubclass(MemWalTable, TableSpec)
    schema = MemWalTable.get_model_cls().model_json_schema()
    for key, cls in SECTIONS.items():
        section = schema["properties"][key]
        assert "additionalProperties" not in section  # refused by validation, with a did-you-mean
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        assert {k: p.get("default") for k, p in section["properties"].items() if k in defaults} == defaults, key
        assert set(section["properties"]) == {f.name for f in dataclasses.fields(cls)}, key
    # Omitted sections are the dataclasses' defaults; sizes take units; Python takes the dataclasses.
    spec = TableSpec(name="t", uri="data/t", merge={"budget_bytes": "64MB"})
    assert spec.gc == SECTIONS["gc"]() and spec.merge.budget_bytes == 64 << 20
    assert TableSpec(name="t", uri="x", merge=SECTIONS["merge"](max_generations=3)).merge.max_generations == 3
    assert TableSpec(name="t", uri="x").merge.max_generations is None  # batches sized by bytes alone
    assert TableSpec(name="t", uri="x", merge={"max_generations": 256}).merge.max_generations == 256  # older configs
    # Unknown keys are refused all the same, by the one did-you-mean memwal.yaml uses.
    for raw, said in (({"name": "t", "uri": "x", "merge": {"budget_byte": 1}}, "did you mean 'budget_bytes'"),
                      ({"name": "t", "ur": "x"}, "unknown key 'ur' (did you mean 'uri'?)")):
        with pytest.raises(ValidationError, match=re.escape(said)):
            TableSpec.model_validate(raw)


def test_defs_yaml_and_memwal_yaml_are_one_schema(tmp_path, monkeypatch):
    attributes = """
        name: events
        uri: data/events
        storage_options: {aws_region: eu-west-1}
        secrets: {aws_secret_access_key: EVENTS_SECRET}
        spark: {master: "local[2]", connect: "sc://127.0.0.1:15999"}
        merge: {budget_bytes: 128MB}
        gc: {cleanup_base_versions_older_than_seconds: 60, cleanup_base_versions_floor_seconds: 30s}
        compaction: {max_small_fragments: 4}
    """
    root, module = project(tmp_path, {"events": attributes})
    (component,) = _load(root, module, monkeypatch).get_all_components(MemWalTable)
    import yaml

    from_file = table_from_mapping(yaml.safe_load(textwrap.dedent(attributes)), "memwal.yaml: tables[0]")
    # A relative uri: against the project root for a component, against memwal.yaml's folder there.
    assert component.table_config() == dataclasses.replace(from_file, uri=str(root / "data" / "events"))
    assert component.merge.budget_bytes == 128 << 20 and component.compaction.max_small_fragments == 4


def test_component_builds_the_table_definitions(tmp_path, monkeypatch):
    root, module = project(tmp_path, {"a": "name: a\nuri: data/a\n", "b": "name: b\nuri: s3://bucket/b\n"})
    defs = _load(root, module, monkeypatch).build_defs()
    keys = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    assert keys == {f"{t}/{a}" for t in "ab" for a in ASSETS}
    assert {s.name for s in defs.sensors} == {"a_manifest_sensor", "b_manifest_sensor"}
    assert defs.resources["a_table"].uri == str(root / "data" / "a")


@pytest.mark.parametrize("attributes, message", [
    ("name: t\nuri: data/t\nmerg: {}\n", r"unknown key 'merg' \(did you mean 'merge'\?\)"),
    ("name: t\nuri: data/t\ngc: {manifest_retension: 3}\n", r"gc: unknown key 'manifest_retension'.*'manifest_retention'"),
    ("name: t\nuri: data/t\nmerge: {budget_bytes: lots}\n", r"merge.budget_bytes: expected a size in bytes"),
    ("name: t\nuri: data/t\nspark: {master: 'lokal[2]'}\n", r"is not a Spark master"),
    ("name: 't-1'\nuri: data/t\n", r"name must be an identifier"),
    ("name: t\nuri: s3://b/t\nstorage_options: {aws_secret_access_key: oops}\n", r"under 'secrets'"),
])
def test_bad_attributes_are_refused_by_name(tmp_path, monkeypatch, attributes, message):
    """The component refuses what memwal.yaml refuses, in the same words."""
    import re

    root, module = project(tmp_path, {"t": attributes})
    with pytest.raises(Exception) as e:
        _load(root, module, monkeypatch).build_defs()
    assert re.search(message, _chain(e.value)), _chain(e.value)
    import yaml

    with pytest.raises(ConfigError, match=message):
        table_from_mapping(yaml.safe_load(attributes), "memwal.yaml: tables[0]")


def test_one_table_is_one_component(tmp_path, monkeypatch):
    root, module = project(tmp_path, {"a": "name: a\nuri: data/t\n", "b": "name: b\nuri: ./data/t/\n"})
    with pytest.raises(Exception) as e:
        _load(root, module, monkeypatch).build_defs()
    assert "tables 'a' and 'b' are the same table" in _chain(e.value)


def test_code_location_refuses_a_table_in_both_defs_and_memwal_yaml(tmp_path, monkeypatch):
    """The repo's code location: the defs folder's components plus memwal.yaml's tables."""
    demo = REPO / "demo_data" / "demo_table"
    config = tmp_path / "memwal.yaml"
    config.write_text(f"tables:\n  - {{name: other, uri: {tmp_path / 'other'}}}\n")
    monkeypatch.setenv("MEMWAL_CONFIG", str(config))
    keys = {k.to_user_string() for k in definitions.location_definitions().resolve_all_asset_keys()}
    assert keys == {f"{t}/{a}" for t in ("demo", "other") for a in ASSETS}
    config.write_text(f"tables:\n  - {{name: demo2, uri: {demo}/}}\n")
    with pytest.raises(ConfigError, match="'demo' and 'demo2' are the same table"):
        definitions.location_definitions()


def test_dg_check_defs(tmp_path):
    """`dg check defs` passes on this project, and names the file, line and key of a mistake in
    an operator's project, with the nearest valid key."""
    out = subprocess.run([str(BIN / "dg"), "check", "defs"], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "All definitions loaded successfully" in out.stdout + out.stderr
    root, module = project(tmp_path, {"events": "name: events\nuri: data/events\nmerge: {budget_byte: 256MB}\n"})
    out = subprocess.run([str(BIN / "dg"), "check", "defs"], cwd=root, env=_env(), capture_output=True,
                         text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert f"{module}/defs/events/defs.yaml:5" in text, text[-3000:]
    assert "merge: unknown key 'budget_byte' (did you mean 'budget_bytes'?)" in text, text[-3000:]


def test_sizes_and_durations_are_pydantic_types():
    """A size or duration setting is a pydantic type (`options.Size`, `options.Duration`):
    validating an options dataclass with pydantic reads "64MB" and "2h" as `from_mapping` does
    and refuses what it refuses, and the component's JSON schema takes both spellings."""
    import re

    from pydantic import TypeAdapter, ValidationError

    from memwal_core.options import CompactionOptions, GcOptions, MergeOptions

    assert TypeAdapter(MergeOptions).validate_python({"budget_bytes": "64MB"}).budget_bytes == 64 << 20
    gc = TypeAdapter(GcOptions).validate_python({"orphan_grace_seconds": "2h"})
    assert gc.orphan_grace_seconds == 7200 and gc.cleanup_base_versions_older_than_seconds == 7 * 86400  # the shipped retention
    assert TypeAdapter(CompactionOptions).validate_python({"max_bytes_per_run": "1.5g"}).max_bytes_per_run == 1536 << 20
    for cls, raw, said in ((MergeOptions, {"budget_bytes": "lots"}, "expected a size in bytes"),
                           (GcOptions, {"orphan_grace_seconds": "a week"}, "expected a duration")):
        with pytest.raises(ValidationError, match=said):
            TypeAdapter(cls).validate_python(raw)
    schema = MemWalTable.get_model_cls().model_json_schema()["properties"]
    for section, key, text in (("merge", "budget_bytes", "256MB"), ("compaction", "cheap_rewrite_bytes", "64 MiB"),
                               ("gc", "cleanup_base_versions_older_than_seconds", "7d")):
        alts = schema[section]["properties"][key]["anyOf"]
        assert any("pattern" in a and re.match(a["pattern"], text) for a in alts), (key, alts)
        assert not any("pattern" in a and re.match(a["pattern"], "lots") for a in alts)


def test_dg_scaffold_writes_a_table_that_loads(tmp_path):
    """`dg scaffold defs memwal_pipeline.component.MemWalTable my-events --uri ...` in an operator's
    project writes a defs.yaml with the table's name (from the folder) and uri, which `dg check
    defs` loads as it is; a mistyped top-level key (`ur:`) is named with the nearest valid one, by the
    component's own did-you-mean (the one `memwal --config defs.yaml` shows: test_cli_output.py)."""
    root, module = project(tmp_path, {})
    scaffold = subprocess.run([str(BIN / "dg"), "scaffold", "defs", "memwal_pipeline.component.MemWalTable", "my-events",
                               "--uri", "data/events"], cwd=root, env=_env(), capture_output=True, text=True,
                              timeout=300)
    assert scaffold.returncode == 0, scaffold.stdout[-3000:] + scaffold.stderr[-3000:]
    written = root / module / "defs" / "my-events" / "defs.yaml"
    spec = yaml.safe_load(written.read_text())
    assert spec == {"type": "memwal_pipeline.component.MemWalTable",
                    "attributes": {"name": "my_events", "uri": "data/events"}}
    check = subprocess.run([str(BIN / "dg"), "check", "defs"], cwd=root, env=_env(), capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    written.write_text(written.read_text().replace("uri: data/events", "ur: data/events"))
    check = subprocess.run([str(BIN / "dg"), "check", "defs"], cwd=root, env=_env(), capture_output=True, text=True,
                           timeout=300)
    text = check.stdout + check.stderr
    assert check.returncode != 0 and "defs/my-events/defs.yaml" in text, text[-3000:]
    assert "table my_events: unknown key 'ur' (did you mean 'uri'?)" in text, text[-3000:]
