"""memwal_core: the maintenance plane of MemWAL Lance tables, as a plain library (no Dagster).

Speaks the spec's words (region, generation, merged); `state/lance_mem_wal.py` is the one
place that maps them to pylance's (shard, SSTable, compacted).

Importing it sets Lance's Rust log filter unless `LANCE_LOG` is set already: errors only, but not
the `ERROR lance::index: Index __lance_mem_wal has no fields` pylance logs on every merge_insert
into a table with a MemWAL index (the system index has no columns; nothing is wrong). The filter
silences that one module target, `lance::index`; its submodules (`lance::index::...`, where the
index implementations log) still report errors. Must run before pylance is imported.
"""

import os

__version__ = "0.1.0"

LANCE_LOG = "error,lance::index=off,lance::index::=error"
os.environ.setdefault("LANCE_LOG", LANCE_LOG)
