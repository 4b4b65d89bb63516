"""What the CLI prints: one-line errors and notes on stderr (clearing the progress display,
`progress.py`, first), the `--json` result on stdout. Tables are drawn by `tables.py`."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import sys
from pathlib import Path
from typing import Any

from memwal_core.steps.outcome import SCHEMA_VERSION

from .progress import ProgressLine


class CliError(Exception):
    pass


def say(msg: str) -> None:
    if live is not None:
        live.end()
    print(msg, file=sys.stderr, flush=True)


live: ProgressLine | None = None  # the line `say` clears before it prints (set by a pass)


def one_line(msg: str) -> str:
    """The first line of an error, without the Rust source locations Lance appends."""
    first = (msg.strip().splitlines() or [""])[0]
    return re.sub(r",\s*/\S+\.rs:\d+:\d+", "", first).strip()


def _plain(obj: Any) -> Any:
    """A value json cannot write, as data (never its repr): an enum's value, a dataclass's fields."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def print_json(data: dict[str, Any]) -> None:
    """A command's `--json` result on stdout (`schema_version` first)."""
    print(json.dumps({"schema_version": SCHEMA_VERSION, **data}, indent=2, default=_plain), flush=True)


def print_json_error(message: str, kind: str) -> None:
    """A failed command's `--json` result: stdout is never empty for a program reading it."""
    print_json({"ok": False, "error": {"type": kind, "message": message}})
