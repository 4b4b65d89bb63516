"""Ctrl-C and SIGTERM during a pass: noticed after the step under way, then nothing more runs."""

from __future__ import annotations

import signal
import socket
import sys


class Interrupted(Exception):
    """The operator interrupted the pass (Ctrl-C, SIGTERM): stop, run nothing more."""

    def __init__(self, signum: int, step: str | None):
        self.signum, self.step = signum, step
        where = f" during {step}" if step else ""
        super().__init__(f"interrupted{where} ({signal.Signals(signum).name}): stopped, no later step was run; "
                         "what committed before stays (every commit is atomic); run it again to continue")


class SignalWatch:
    """Notices SIGINT/SIGTERM even while Dagster has replaced their handlers.

    Dagster turns a Ctrl-C inside a step into a step failure and restores the handlers after
    the run, so the CLI cannot see it from the result alone. The interpreter also writes the
    number of every signal it handles to the wakeup fd, whoever's handler runs: read it after
    each step. (Main thread only; elsewhere it sees nothing and the handlers stay as they are.)
    """

    WATCHED = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> "SignalWatch":
        self.signum: int | None = None
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        try:
            self._old = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def fired(self) -> int | None:
        while self.signum is None:
            try:
                data = self._r.recv(4096)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            self.signum = next((b for b in data if b in self.WATCHED), None)
        return self.signum

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.set_wakeup_fd(self._old)
        self._r.close()
        self._w.close()


def stop_spark() -> None:
    """After an interrupt: cancel the session's jobs and stop it before the interpreter exits.

    Left to the exit, the JVM's scheduler finishes an abandoned task after Python's accumulator
    server is gone and logs that as a Java stack trace under the one-line message."""
    if "pyspark" not in sys.modules:
        return
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None:
        return
    try:
        sc.cancelAllJobs()
        sc.stop()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
