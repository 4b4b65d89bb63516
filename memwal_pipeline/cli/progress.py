"""The progress display of `memwal maintain` on stderr (stdout stays the `--json` report).

On a terminal: a rich progress bar labelled with the table's name, the merged bytes of the plan
against its total and the latest event's text, redrawn in place and cleared when a line is
printed (`output.say`) or the pass ends. Otherwise (a file, a pipe, CI's log): one plain line per
event, `[table] merge: batch 1/2 ...`, no control codes.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Column


BAR_WIDTH = 24
LABEL_WIDTH = 32  # a longer table name is cut with an ellipsis


class ProgressLine:
    """Progress events of the jobs a pass runs (`memwal_core.jobs.progress`), for a person."""

    def __init__(self, table: str, stream: IO[str] | None = None):
        self.table = table
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    @property
    def open(self) -> bool:
        """Whether the bar is on the screen (`end` clears it)."""
        return self._bar is not None

    def __call__(self, event: Any) -> None:
        from memwal_core.jobs.progress import MergeProgress

        text = f"merge: {event}" if isinstance(event, MergeProgress) else str(event)
        if not self.tty:
            print(f"[{self.table}] {text}", file=self.stream, flush=True)
            return
        total, done = (event.bytes or 1, event.bytes_merged) if isinstance(event, MergeProgress) else (None, 0)
        starting = self._bar is None
        if starting:
            self._bar = self._new_bar()
            self._task = self._bar.add_task(self.table, total=total, detail="")
        # The text gives way on a narrow terminal (rich would drop the label first).
        room = max(8, self._bar.console.width - min(len(self.table), LABEL_WIDTH) - BAR_WIDTH - 3)
        self._bar.update(self._task, total=total, completed=done,
                         detail=text if len(text) <= room else text[:room - 1] + "…")
        if starting:
            self._bar.start()  # draws it
        else:
            self._bar.refresh()

    def _new_bar(self) -> Progress:
        console = Console(file=self.stream, force_terminal=True, highlight=False, soft_wrap=False)
        # Redrawn on each event only (no refresh thread): a merge batch takes seconds.
        return Progress(TextColumn("{task.description}", markup=False, style="bold",
                                   table_column=Column(no_wrap=True, overflow="ellipsis",
                                                       min_width=min(len(self.table), LABEL_WIDTH),
                                                       max_width=LABEL_WIDTH)),
                        BarColumn(bar_width=BAR_WIDTH, table_column=Column(min_width=BAR_WIDTH, no_wrap=True)),
                        TextColumn("{task.fields[detail]}", markup=False,
                                   table_column=Column(no_wrap=True, overflow="ellipsis")),
                        console=console, auto_refresh=False, transient=True,
                        redirect_stdout=False, redirect_stderr=False)

    def end(self) -> None:
        """Clear the bar (the step's summary follows)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar, self._task = None, None
