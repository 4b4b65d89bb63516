"""A dg project of an operator who installed memwal: pyproject.toml with `[tool.dg]`, a root
module (at the project root, so no install is needed to import it) with the `definitions.py`
dg scaffolds (`load_from_defs_folder`), and one `defs/<table>/defs.yaml` per table."""

from __future__ import annotations

import itertools
import os
import textwrap
from pathlib import Path

_ids = itertools.count()


def project(tmp_path: Path, tables: dict[str, str]) -> tuple[Path, str]:
    """A dg project of an operator who installed memwal: one `defs/<table>/defs.yaml` per table
    and the scaffolded `definitions.py` (`load_from_defs_folder`)."""
    module = f"memwal_user_{os.getpid()}_{next(_ids)}"
    root = tmp_path / "project"
    (root / module / "defs").mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""
        [project]
        name = "{module}"
        version = "0"
        [tool.dg]
        directory_type = "project"
        [tool.dg.project]
        root_module = "{module}"
    """))
    (root / module / "__init__.py").write_text("")
    (root / module / "defs" / "__init__.py").write_text("")
    (root / module / "definitions.py").write_text(textwrap.dedent("""
        from pathlib import Path

        import dagster as dg


        @dg.definitions
        def defs():
            return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
    """))
    for folder, attributes in tables.items():
        (root / module / "defs" / folder).mkdir()
        (root / module / "defs" / folder / "defs.yaml").write_text(
            "type: memwal_pipeline.component.MemWalTable\nattributes:\n"
            + textwrap.indent(textwrap.dedent(attributes).strip() + "\n", "  "))
    return root, module
