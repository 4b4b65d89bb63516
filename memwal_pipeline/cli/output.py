"""What the CLI prints: one-line errors and notes on stderr, the progress line, the formatting
of numbers a person reads. stdout is the command's result (the `--json` report)."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from memwal_core.steps.outcome import SCHEMA_VERSION


class CliError(Exception):
    pass


def say(msg: str) -> None:
    if live is not None:
        live.end()
    print(msg, file=sys.stderr, flush=True)


class ProgressLine:
    """Progress events of the jobs a pass runs, on stderr (stdout stays the --json report):
    one line updated in place on a terminal, one plain line per event otherwise."""

    def __init__(self, table: str, stream=None):
        self.table = table
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.open = False

    def __call__(self, event: Any) -> None:
        from memwal_core.jobs.progress import MergeProgress

        step = "merge: " if isinstance(event, MergeProgress) else ""
        line = f"[{self.table}] {step}{event}"
        if not self.tty:
            print(line, file=self.stream, flush=True)
            return
        width = shutil.get_terminal_size((120, 24)).columns - 1
        self.stream.write("\r\x1b[K" + line[:width])
        self.stream.flush()
        self.open = True

    def end(self) -> None:
        """Clear the line in place (the step's summary follows)."""
        if self.open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.open = False


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
