"""Read-only views for operators: status (lag, stuck regions), the checks Dagster runs, and a
reader that sees base table + unmerged generations the way a MemWAL reader does."""
