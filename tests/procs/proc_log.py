"""memwal's INFO lines (retries, skips, lifted walls), timed, on a test process's stderr: what a
failing concurrency run needs to be explained after the fact."""

import logging
import sys


def log_memwal_to_stderr() -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    memwal_log = logging.getLogger("memwal")
    memwal_log.addHandler(handler)
    memwal_log.setLevel(logging.INFO)
    memwal_log.propagate = False
    return memwal_log
