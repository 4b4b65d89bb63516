"""The background jobs of the spec's "Background Job Expectations": merge generations into the
base table, snapshot regions into the MemWAL index, catch base indexes up, compact the base
table, collect garbage. Each reads and writes `state`; the merge's data path runs on `spark`."""
