"""How memwal writes a quantity for a person: one style everywhere (logs, CLI lines, summaries).

Sizes are binary, as memwal reads them ("256MB" is 256 MiB): `4.1 KiB`, `0 B`. Machine output
(`--json`, Dagster metadata) keeps the raw numbers.
"""

from __future__ import annotations


def size(n: float) -> str:
    """`512 B`, `4.1 KiB`, `256.0 MiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
