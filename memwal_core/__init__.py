"""memwal_core: the maintenance plane of MemWAL Lance tables, as a plain library (no Dagster).

Speaks the spec's words (region, generation, merged); `state/lance_mem_wal.py` is the one
place that maps them to pylance's (shard, SSTable, compacted).
"""

__version__ = "0.1.0"
