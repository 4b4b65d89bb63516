"""`memwal`: demo, maintain and status, running the same Dagster definitions in process.

A command works on one table: a URI (default settings), or `--config FILE --table NAME` (that
table's settings); flags override settings and are checked by the same rules as the file.
Progress of long jobs goes to stderr (a bar labelled with the table's name on a terminal, plain
lines otherwise), so `--json` keeps stdout for the report; tables are plain, grep-stable columns
when stdout is not a terminal.
Errors are one clear line naming the region (a traceback only with --verbose). What a step did
is its `StepOutcome` (`memwal_core.steps`): the lines printed, the `--json` report (versioned by
`schema_version`) and the exit status (non-zero when a step failed, was refused, left regions
behind, or a check failed) all come from outcomes, never from Dagster metadata; `--dry-run`
is the same runner with `execute=False`. Ctrl-C (SIGINT) or SIGTERM stops the pass: the step
under way is abandoned (its commits are atomic: either in or not), no later step runs, and the
exit status is 128 + the signal number (130 for Ctrl-C).

Modules: `main` (the parser), `target` (which table, flags over its settings), `maintain` and
`dry_run`, `status`, `regions`, `demo`, `spark`, `interrupts`, `output` (what is printed, and how),
`tables` and `progress` (drawn by rich).
"""

from memwal_core.steps.outcome import STEPS

from .demo import DEMO_MARKER, _clear_demo_path
from .dry_run import dry_run
from .main import main
from .maintain import run_pass
from .report import PassReport
from .output import CliError, ProgressLine
from .status import print_status
from .target import apply_flags, split_secrets, target

__all__ = ["DEMO_MARKER", "STEPS", "CliError", "PassReport", "ProgressLine", "apply_flags", "dry_run", "main",
           "print_status", "run_pass", "split_secrets", "target", "_clear_demo_path"]
