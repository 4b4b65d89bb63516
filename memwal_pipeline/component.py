"""`MemWalTable`: one maintained table as a Dagster component, one `defs/<table>/defs.yaml` each.

```yaml
type: memwal_pipeline.component.MemWalTable
attributes:
  name: events
  uri: s3://my-bucket/lake/events
  merge: {budget_bytes: 256MB}
```

Its schema is `config.TableSpec`: `name`, `uri`, `storage_options`, `secrets` and one section
per options dataclass of `memwal_core.options`, embedded as it is (keys, types and defaults are
the dataclass's). A `memwal.yaml` `tables:` item is validated by the same schema.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from .config import ConfigError, TableSpec, check_tables
from .definitions import build_definitions
from .scaffold import MemWalTableScaffolder


@dg.scaffold_with(MemWalTableScaffolder)
class MemWalTable(dg.Component, TableSpec):
    """A Lance MemWAL table that memwal maintains: its region assets, manifest sensor, asset
    checks, merge / maintenance / checks jobs and schedules, table and Spark resources.

    Sections spark, merge, snapshot, gc, slo, sensor, schedule, compaction, lease and catchup are the options
    dataclasses of the same names in `memwal_core.options` (same keys, same defaults). A
    relative local `uri` is relative to the project root (the folder of pyproject.toml).
    """

    @classmethod
    def get_model_cls(cls) -> type[TableSpec]:
        return TableSpec  # attributes: the table's settings, nothing else

    @classmethod
    def load(cls, attributes: Any, context: dg.ComponentLoadContext) -> "MemWalTable":
        if attributes is None:
            raise ConfigError(f"{context.path}: a MemWalTable needs attributes (name:, uri:, ...)")
        # The working directory must not decide which table a relative path names.
        uri = attributes.table_config(base=context.project_root).uri
        return cls(**{**dict(attributes), "uri": uri})

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        # Two components for one table (or one name) would get two pools, and its commits would
        # no longer be serialized: every component checks the project's tables together.
        tables = [c.table_config() for c in context.component_tree.get_all_components(MemWalTable)]
        check_tables(tables, f"{context.project_root}: MemWalTable components")
        return build_definitions([self.table_config()])
