"""`dg scaffold defs memwal_pipeline.component.MemWalTable NAME --uri URI`: a defs.yaml that
`dg check defs` accepts as written (a table needs its name and uri; Dagster's default scaffold
writes `attributes: {}`, which no table can load)."""

from __future__ import annotations

import re

import dagster as dg
import yaml
from pydantic import BaseModel, Field


class MemWalTableScaffoldParams(BaseModel):
    uri: str = Field(description="The table: a local path (relative to the project root), s3://, gs:// or az://.")
    name: str | None = Field(default=None, description="The table's name (default: the defs folder's name).")


def table_name(folder: str) -> str:
    """An identifier from a defs folder's name (`my-events` -> `my_events`), as table names must be."""
    name = re.sub(r"\W", "_", folder)
    return name if re.match(r"^[A-Za-z]", name) else f"t_{name}"


class MemWalTableScaffolder(dg.Scaffolder[MemWalTableScaffoldParams]):
    @classmethod
    def get_scaffold_params(cls) -> type[MemWalTableScaffoldParams]:
        return MemWalTableScaffoldParams

    def scaffold(self, request: dg.ScaffoldRequest[MemWalTableScaffoldParams]) -> None:
        params = request.params
        attributes = {"name": params.name or table_name(request.target_path.name), "uri": params.uri}
        text = ("# A table memwal maintains. Sections (spark, merge, snapshot, gc, slo, sensor, schedule,\n"
                "# compaction, lease) take their defaults when omitted: `dg utils inspect-component\n"
                f"# {request.type_name}` lists them.\n"
                + yaml.safe_dump({"type": request.type_name, "attributes": attributes}, sort_keys=False))
        path = request.target_path if request.append else request.target_path / "defs.yaml"
        with open(path, "a" if request.append else "w") as f:
            f.write(("---\n" if request.append else "") + text)
