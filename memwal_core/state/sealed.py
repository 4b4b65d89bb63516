"""The envelope of memwal's own records under `_memwal/` (GC's summaries `jobs/gc/history.py`,
`leak_refs.py`, `region_cache.py`; the region value records `state/value_records.py`): a format
number and a checksum around a JSON body, so that a record torn by a crash, garbled on the
store or written by another format is recognised and read around, never used."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def seal(content: Any, fmt: int) -> bytes:
    """`content` (JSON-able) as the bytes of a summary of format `fmt`."""
    return seal_body(json.dumps(content, sort_keys=True, separators=(",", ":")), fmt)


def seal_body(body: str, fmt: int) -> bytes:
    """`body` (the JSON text of the content) as the bytes of a summary of format `fmt`."""
    return json.dumps({"format": fmt, "sha256": _checksum(body), "body": body}).encode()


def unseal(raw: bytes, fmt: int) -> Any:
    """The content of a summary of format `fmt`; ValueError (saying why) for anything else."""
    return json.loads(unseal_body(raw, fmt))


def unseal_body(raw: bytes, fmt: int) -> str:
    """The JSON text of a summary of format `fmt`'s content, checked; ValueError for anything else."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise ValueError(f"format {doc.get('format') if isinstance(doc, dict) else None!r}, expected {fmt}")
    body = doc.get("body")
    if not isinstance(body, str) or doc.get("sha256") != _checksum(body):
        raise ValueError("checksum mismatch")
    return body
