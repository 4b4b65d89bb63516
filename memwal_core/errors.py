"""The one base class of memwal's own errors, so callers (the CLI, the Dagster layer) can tell
"memwal refused this, here is why" from a bug, whatever job raised it."""

from __future__ import annotations


class MemwalError(Exception):
    """Something memwal refuses or cannot do; the message says what and what to do about it."""


class OptionError(MemwalError, ValueError):
    """A setting has a wrong name, type or value (config file, component YAML, command line)."""


def one_line(e: BaseException) -> str:
    """`Type: first line of the message`: how every job reports a foreign exception in one line
    (Lance and Spark messages run to stack traces)."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
