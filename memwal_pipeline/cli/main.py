"""The `memwal` command line: its parser, and the one-line errors and exit statuses of every command."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys

from memwal_core.steps.outcome import STEPS

from .demo import cmd_demo
from .interrupts import Interrupted, stop_spark
from .maintain import cmd_maintain
from .output import one_line, print_json_error, say
from .regions import cmd_regions_discard
from .spark import cmd_spark_archive, cmd_spark_env, cmd_spark_server
from .status import cmd_status


class _Parser(argparse.ArgumentParser):
    """argparse with a did-you-mean for a mistyped flag or command, and a JSON error on stdout
    when the command line asks for `--json`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str):
        argv = getattr(self, "argv", None) or sys.argv[1:]
        message += _suggestion(self, message, argv)
        if "--json" in argv:
            print_json_error(message, "usage")
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _suggestion(parser: argparse.ArgumentParser, message: str, argv: list[str]) -> str:
    """` (did you mean --dry-run?)` for the first unknown flag or command of `message`."""
    if "unrecognized arguments:" in message:
        words = [w.split("=", 1)[0] for w in message.split(":", 1)[1].split() if w.startswith("-")]
        cmd = next((w for w in argv if w in getattr(parser, "commands", {})), None)
        known = [o for p in (parser, parser.commands.get(cmd)) if p for a in p._actions for o in a.option_strings]
    elif "invalid choice:" in message:
        words = [message.split("invalid choice:", 1)[1].split("'")[1]] if "'" in message else []
        known = [c for a in parser._actions for c in (a.choices or ())]
    else:
        return ""
    for w in words:
        close = difflib.get_close_matches(w, known, n=1, cutoff=0.6)
        if close:
            return f" (did you mean {close[0]}?)"
    return ""


def _version() -> str:
    import memwal_core

    return memwal_core.__version__


def _table_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", nargs="?", help="the table (or --config FILE --table NAME)")
    p.add_argument("--config", metavar="FILE", help="a memwal.yaml, a MemWalTable defs.yaml or a defs folder: work on one of its "
                        "tables, with its settings")
    p.add_argument("--table", metavar="NAME", help="the table's name in --config (optional if it has one)")
    p.add_argument("--storage-option", action="append", metavar="K=V", default=[],
                   help="over the table's storage_options (prefer the environment for secrets: `ps` shows flags)")


def main(argv: list[str] | None = None) -> int:
    """`memwal`: parse the command line and run the command (one clear line per error, the exit
    status of the command). Long because it is the argument parser's declaration."""
    p = _Parser(prog="memwal", description="Maintenance plane for MemWAL Lance tables.")
    p.argv = sys.argv[1:] if argv is None else list(argv)
    p.add_argument("--verbose", "-v", action="store_true", help="full tracebacks and Dagster logs")
    p.add_argument("--version", action="version", version=f"memwal {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="write a demo table with pylance ShardWriters and maintain it once")
    d.add_argument("--path", default="demo_data/demo_table")
    d.add_argument("--regions", type=int, default=4)
    d.add_argument("--rows", type=int, default=400)
    d.add_argument("--spark-master", default="local[*]")
    d.add_argument("--force", action="store_true",
                   help="replace --path even if it is not a previous demo table")
    d.set_defaults(fn=cmd_demo)

    m = sub.add_parser("maintain", help="one full maintenance pass over a MemWAL table",
                       description="One maintenance pass over a table: its URI, or a table of a memwal.yaml or defs.yaml "
                                   "(--config FILE --table NAME, its settings; the flags below override "
                                   "them). Progress goes to stderr; --json prints the report on stdout.")
    _table_args(m)
    m.add_argument("--budget", metavar="SIZE", help="merge.budget_bytes: bytes of generations per merge batch "
                                                    "(e.g. 256MB)")
    m.add_argument("--max-generations", metavar="N",
                   help="merge.max_generations: at most N generations per merge batch (default: no cap, batches are "
                        "sized by --budget; off lifts a configured cap)")
    m.add_argument("--spark-master", metavar="MASTER",
                   help="spark.master (default: the table's, else local[*]); the CLI runs its own session, "
                        "not the table's spark.connect server (sc://HOST:PORT here asks for one)")
    m.add_argument("--spark-conf", action="append", metavar="K=V", default=[],
                   help="a Spark setting, merged over the table's spark.conf (repeatable)")
    m.add_argument("--only", help=f"comma-separated subset of {','.join(STEPS)}")
    m.add_argument("--base-versions-older-than", metavar="DURATION",  # checked by GcOptions: one line
                   help="let GC first clean up base-table versions older than this (Lance's "
                        "cleanup_old_versions; seconds or 7d, 12h, 30m, 90s); generations a retained "
                        "version needs are always kept; refused below the retention floor (a day)")
    m.add_argument("--base-versions-floor", metavar="DURATION",
                   help="gc.cleanup_base_versions_floor_seconds: base-table versions younger than this are "
                        "never cleaned up (default a day); lower it only where no commit can be in flight "
                        "that long")
    m.add_argument("--retrain-vector-indexes", action="store_true",
                   help="compact step: retrain vector indexes that drifted past the threshold (never one "
                        "MemTables maintain: the spec requires a stable codebook)")
    m.add_argument("--lease-wait", metavar="SECONDS",
                   help="lease.wait_seconds: how long a step waits for the table's lease while another "
                        "maintainer holds it, before it is skipped (\"skipped: lease held by ... until ...\")")
    m.add_argument("--dry-run", action="store_true",
                   help="print what the chosen steps would do, with the same settings, and change nothing: "
                        "GC lists what it would delete (base-table versions its cleanup removes included)")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_maintain)

    s = sub.add_parser("status", help="per-region lag of a MemWAL table")
    _table_args(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    r = sub.add_parser("regions", help="act on regions of a MemWAL table")
    rsub = r.add_subparsers(dest="regions_cmd", required=True)
    rd = rsub.add_parser("discard", help="never merge the generations of regions written before the MemWAL "
                                         "initialization (after an overwrite); GC then collects them",
                         description="memwal regions discard URI REGION... | --all  (or --config FILE [--table "
                                     "NAME] REGION...). Records the regions' stale generations as handled in one "
                                     "commit without rows: they never reach the table, later generations merge. "
                                     "Only regions `memwal status` reports as stale are accepted.")
    rd.add_argument("targets", nargs="*", metavar="URI|REGION", help="the table's URI (unless --config), then "
                                                                    "region ids")
    rd.add_argument("--config", metavar="FILE", help="a memwal.yaml, a defs.yaml or a defs folder: work on one of its tables")
    rd.add_argument("--table", metavar="NAME", help="the table's name in --config (optional if it has one)")
    rd.add_argument("--storage-option", action="append", metavar="K=V", default=[],
                    help="over the table's storage_options")
    rd.add_argument("--all", action="store_true", help="every stale region of the table")
    rd.add_argument("--dry-run", action="store_true", help="say what would be discarded, change nothing")
    rd.add_argument("--lease-wait", metavar="SECONDS",
                    help="lease.wait_seconds: how long to wait for the table's lease while a maintainer holds "
                         "it (then nothing is discarded, exit 1)")
    rd.add_argument("--json", action="store_true")
    rd.set_defaults(fn=cmd_regions_discard)

    c = sub.add_parser("spark-server", help="start/stop the long-lived local Spark Connect server "
                                            "(tables configured with spark master sc://127.0.0.1:PORT)")
    c.add_argument("action", choices=["start", "stop", "status"])
    c.add_argument("--port", type=int, default=15002)
    c.add_argument("--master", default="local[*]")
    c.set_defaults(fn=cmd_spark_server)

    j = sub.add_parser("spark-archive", help="build/show/remove the class-data-sharing archive that starts "
                                             "local Spark driver JVMs ~3 s sooner (make builds it)")
    j.add_argument("action", nargs="?", default="build", choices=["build", "status", "remove"])
    j.add_argument("--force", action="store_true", help="rebuild even if present")
    j.set_defaults(fn=cmd_spark_archive)

    e = sub.add_parser("spark-env", help="pack this virtualenv for spark.archives, so remote executors get "
                                         "pylance and memwal's other dependencies")
    e.add_argument("output", nargs="?", default="memwal-env.tar.gz", help="a .tar.gz or .tgz")
    e.add_argument("--alias", default="memwal_env", help="directory the executors unpack it to")
    e.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="leave out paths inside the env (fnmatch, * spans /; e.g. "
                        "'lib/python3.11/site-packages/dagster*')")
    e.add_argument("--force", action="store_true", help="overwrite OUTPUT")
    e.set_defaults(fn=cmd_spark_env)

    p.commands = dict(sub.choices)
    for c in _parsers(p):
        c.argv = p.argv
    a = p.parse_args(p.argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return _run(a)


def _parsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`p` and every subcommand's parser, nested ones included."""
    subs = [c for action in p._actions if isinstance(action, argparse._SubParsersAction)
            for c in action.choices.values()]
    return [p, *(q for c in subs for q in _parsers(c))]


def _run(a) -> int:
    """Run the command: its exit status, one clear line per error (and under `--json` an error
    object on stdout), a traceback only with --verbose."""
    as_json = getattr(a, "json", False)
    try:
        return a.fn(a)
    except BrokenPipeError as e:
        if _stdout_gone():  # `memwal status | head`: the reader has what it wanted
            _quiet_stdout()
            return 128 + signal.SIGPIPE
        return _failed(a, e, as_json)
    except KeyboardInterrupt:
        return _interrupted(Interrupted(signal.SIGINT, None), as_json)
    except Interrupted as e:
        if a.verbose:
            raise
        return _interrupted(e, as_json)
    except Exception as e:  # noqa: BLE001 - one clear line unless --verbose
        return _failed(a, e, as_json)


def _failed(a, e: BaseException, as_json: bool) -> int:
    if a.verbose:
        raise e
    message = one_line(str(e)) or type(e).__name__
    if as_json:
        print_json_error(message, type(e).__name__)
    say(f"error: {message}")
    return 1


def _interrupted(e: Interrupted, as_json: bool) -> int:
    if as_json:
        print_json_error(str(e), "interrupted")
    say(f"error: {e}")
    stop_spark()
    return 128 + e.signum


def _stdout_gone() -> bool:
    """Whether stdout is a pipe nobody reads any more (and not, say, a broken socket elsewhere)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _quiet_stdout() -> None:
    """After the reader of stdout went away: point stdout at /dev/null, so that the interpreter's
    final flush does not fail again ("Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
