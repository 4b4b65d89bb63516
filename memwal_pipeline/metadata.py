"""Bounded Dagster metadata: summaries whose size does not grow with the number of regions.

Every materialization and check result is stored in the event log and shipped to the UI on
each view; at thousands of regions a per-region listing would be tens of KB per event. So
lists and maps are cut to the `TOP_N` worst entries (with a count of the rest), texts to
`MAX_TEXT` characters and floats rounded; error maps, which a reader needs verbatim, keep whole
entries within a character budget (`fit`). Metadata is for the UI only: `memwal maintain` reads
the steps' outcomes (`memwal_core.steps`), never metadata, so these bounds never change what the
command reports. `tests/test_pipeline.py` holds the bound (4 KB per
event at 3,000 regions).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

TOP_N = 10
MAX_TEXT = 300
MORE = "…more"


def short(text: Any, limit: int = MAX_TEXT) -> str:
    s = str(text)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def top(mapping: Mapping[str, Any], n: int = TOP_N, *, key: Callable[[tuple[str, Any]], Any] | None = None,
        text_limit: int = 160) -> dict[str, Any]:
    """The first `n` entries (by `key`, else in order), texts shortened, plus `…more: k`."""
    items = sorted(mapping.items(), key=key) if key else list(mapping.items())
    out: dict[str, Any] = {}
    for k, v in items[:n]:
        out[str(k)] = short(v, text_limit) if isinstance(v, str) else v
    if len(items) > n:
        out[MORE] = len(items) - n
    return out


def encoded_size(metadata: Mapping[str, Any]) -> int:
    """Bytes of the metadata as the event log stores it (serialized Dagster metadata)."""
    from dagster import serialize_value

    return len(serialize_value(dict(metadata)).encode())


def fit(mapping: Mapping[str, Any], budget: int = 2500) -> dict[str, Any]:
    """Whole entries (texts not cut) while their total length fits `budget` characters, in
    order, plus `…more: k`: for errors a reader needs verbatim."""
    out: dict[str, Any] = {}
    used = 0
    items = list(mapping.items())
    for i, (k, v) in enumerate(items):
        size = len(str(k)) + len(str(v)) + 8
        if used + size > budget:
            out[MORE] = len(items) - i
            break
        out[str(k)] = v
        used += size
    return out
