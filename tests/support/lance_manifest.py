"""A Lance table manifest edited in place, the way a newer Lance would write it."""

from __future__ import annotations

import struct

import lance

from memwal_core.state import table


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def set_feature_flags(loc, *, writer: int | None = None, reader: int | None = None) -> str:
    """Set feature flags in the latest table manifest, as a newer Lance would write them
    (appended fields: the last occurrence of a scalar field wins)."""
    version = lance.dataset(loc.lance_uri).version
    key = table.manifest_keys(version)[0]
    raw = loc.store.get(key)
    (offset,) = struct.unpack_from("<Q", raw, len(raw) - 16)
    (length,) = struct.unpack_from("<I", raw, offset)
    msg = raw[offset + 4: offset + 4 + length]
    assert offset + 4 + length == len(raw) - 16  # the message ends at the footer
    for num, v in ((9, reader), (10, writer)):
        if v is not None:
            msg += _varint(num << 3) + _varint(v)
    loc.store.put(key, raw[:offset] + struct.pack("<I", len(msg)) + msg + raw[-16:])
    return key
