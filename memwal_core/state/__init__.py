"""Table state as the spec defines it: the object store, `_mem_wal/` layout, region manifests,
WAL entries, the base table's MemWAL index, routing (region specs) and the one mapping of the
spec's words onto pylance's (`lance_mem_wal`). No job logic, no Spark."""
