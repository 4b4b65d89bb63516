"""The CLI's tables, drawn by rich: aligned columns on a terminal, and the same columns as plain,
stable text when stdout is a file or a pipe.

Plain means what `grep`, `cut` or `awk` read: no ANSI codes, no box characters, one row per line
(cells never wrap, whatever the width), columns separated by two spaces, each row starting with
its first cell. On a terminal the header is bold and a long cell is cut with an ellipsis to fit.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import IO

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

PLAIN_WIDTH = 100_000  # a file or a pipe: rows are never cut nor wrapped


@dataclass(frozen=True)
class Column:
    header: str
    right: bool = False     # numbers
    max_width: int | None = None  # on a terminal: longer cells are cut with "…"
    min_width: int | None = None  # on a narrow terminal the other columns give way (default: a number's header)


def console(file: IO[str] | None = None) -> Console:
    """A console on `file` (default stdout): a terminal's width and styles on a terminal, plain
    text and no width limit otherwise."""
    file = file if file is not None else sys.stdout
    tty = bool(getattr(file, "isatty", lambda: False)())
    if tty:
        return Console(file=file, highlight=False, soft_wrap=False)
    return Console(file=file, width=PLAIN_WIDTH, force_terminal=False, no_color=True, color_system=None,
                   highlight=False, emoji=False, soft_wrap=False)


def fitted(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> list[Column]:
    """On a terminal `width` wide: the columns with a `max_width` (values) narrowed first, so the
    numbers keep their room (rich would crop the last column instead)."""
    natural = [max([cell_len(c.header), *(cell_len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    shown = [min(n, c.max_width) if c.max_width else n for n, c in zip(natural, columns)]
    over = sum(shown) + 2 * (len(columns) - 1) - width
    out = list(columns)
    for i, c in enumerate(columns):
        if over <= 0:
            break
        if c.max_width:
            narrower = max(4, shown[i] - over)
            over -= shown[i] - narrower
            out[i] = replace(c, max_width=narrower)
    return out


def table(columns: Sequence[Column], rows: Sequence[Sequence[str]], *, tty: bool) -> Table:
    """A borderless table: columns two spaces apart, no edge padding, header in the first line."""
    t = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=False,
              header_style="bold" if tty else "", expand=False)
    for c in columns:
        keep = c.min_width if c.min_width is not None else (max(len(c.header), 4) if c.right else None)
        t.add_column(c.header, justify="right" if c.right else "left", no_wrap=True, overflow="ellipsis",
                     max_width=c.max_width if tty else None, min_width=keep)
    for row in rows:
        t.add_row(*row)
    return t


def print_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], file: IO[str] | None = None) -> None:
    """Print the table (plain when `file` is not a terminal); trailing spaces are left out."""
    out = console(file)
    if out.is_terminal:
        columns = fitted(columns, rows, out.width)
    drawn = table(columns, rows, tty=out.is_terminal)
    if out.is_terminal:
        out.print(drawn, markup=False)
    else:
        with out.capture() as captured:
            out.print(drawn, markup=False, crop=False)
        out.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    out.file.flush()
