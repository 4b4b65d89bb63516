"""The envelope of memwal's own records under `_memwal/` (GC's summaries `jobs/gc/history.py`,
`leak_refs.py`, `region_cache.py`; the region value records `state/value_records.py`): a format
number and a checksum around a JSON body, so that a record torn by a crash, garbled on the
store or written by another format is recognised and read around, never used.

Two layouts. `seal`: one JSON document whose body is the content's JSON text (readable with any
JSON tool; the value records). `seal_blob`, for GC's caches, which hold thousands of rows read on
every pass: a JSON header line (format, checksum, the body's length), the content's JSON, a
newline, and raw bytes (typed columns, row text) that neither side escapes, encodes or parses."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def _checksum(body: str | bytes | memoryview) -> str:
    return hashlib.sha256(body.encode() if isinstance(body, str) else body).hexdigest()


def seal(content: Any, fmt: int) -> bytes:
    """`content` (JSON-able) as the bytes of a summary of format `fmt`."""
    return seal_body(json.dumps(content, sort_keys=True, separators=(",", ":")), fmt)


def seal_body(body: str, fmt: int) -> bytes:
    """`body` (the JSON text of the content) as the bytes of a summary of format `fmt`."""
    return json.dumps({"format": fmt, "sha256": _checksum(body), "body": body}).encode()


_MAX_HEAD = 4096  # a `seal_blob` header line is far shorter


def seal_blob(content: Any, blob: bytes, fmt: int) -> bytes:
    """`content` (JSON-able) and `blob` (raw bytes) as the bytes of a record of format `fmt`."""
    body = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    payload = b"".join((body, b"\n", blob))
    head = json.dumps({"format": fmt, "sha256": _checksum(payload), "body": len(body)})
    return b"".join((head.encode(), b"\n", payload))


def unseal_blob(raw: bytes, fmt: int) -> tuple[Any, memoryview]:
    """The content and the raw bytes of a record `seal_blob` wrote with format `fmt`, checked;
    ValueError (saying why) for anything else."""
    end = raw.find(b"\n", 0, _MAX_HEAD)
    try:  # parsed before the checksum is checked: bounded, and any garbage a ValueError
        head = json.loads(raw[:end] if end >= 0 else raw[:_MAX_HEAD])  # no newline: what `seal` wrote (its format told)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"not a sealed record ({type(e).__name__})") from None
    if not isinstance(head, dict) or head.get("format") != fmt:
        raise ValueError(f"format {head.get('format') if isinstance(head, dict) else None!r}, expected {fmt}")
    if end < 0:
        raise ValueError("not a record with raw bytes")
    payload = memoryview(raw)[end + 1:]
    n = head.get("body")
    if head.get("sha256") != _checksum(payload):
        raise ValueError("checksum mismatch")
    if type(n) is not int or not 0 < n < len(payload) or payload[n] != 0x0A:
        raise ValueError("a bad body length")
    try:
        return json.loads(bytes(payload[:n])), payload[n + 1:]
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"a body that is not JSON ({e})") from None


def unseal(raw: bytes, fmt: int) -> Any:
    """The content of a summary of format `fmt`; ValueError (saying why) for anything else."""
    return json.loads(unseal_body(raw, fmt))


def unseal_body(raw: bytes, fmt: int) -> str:
    """The JSON text of a summary of format `fmt`'s content, checked; ValueError for anything else."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise ValueError(f"format {doc.get('format') if isinstance(doc, dict) else None!r}, expected {fmt}")
    body = doc.get("body")
    if not isinstance(body, str) or doc.get("sha256") != _checksum(body):
        raise ValueError("checksum mismatch")
    return body
