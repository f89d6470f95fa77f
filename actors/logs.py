"""One log format for every Tandem process: the driver, the pool manager and the engines; and
the last error a child process wrote to the log its parent shares with it.

Ray leaves a worker's root logger unconfigured, so without this an actor's INFO lines are
dropped and its warnings reach the worker's log file bare, with no time to line them up
against another process's (a pool manager that restarted three engines at once could not be
placed against the load it was under).
"""

from __future__ import annotations

import logging
import os
import re

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def setup_logging() -> None:
    """Log INFO and up to stderr with the time and the logger's name (idempotent)."""
    logging.basicConfig(level=logging.INFO, format=FORMAT)


# The last line of a Python traceback: "module.Class: message" (no space before the colon).
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: \S")
# How much of the log's end an error is looked for in.
_TAIL_BYTES = 64 * 1024


def stderr_size() -> int | None:
    """The size of this process's stderr where it is a file (a Ray worker's log), else None:
    where `last_error` starts looking later."""
    try:
        return os.stat("/proc/self/fd/2").st_size if os.path.isfile(os.readlink("/proc/self/fd/2")) else None
    except OSError:
        return None


def last_error(since: int | None) -> str | None:
    """The last traceback's error line written to this process's stderr after byte `since`
    (stderr_size), by this process or a child that shares it: vLLM's engine core prints the
    cause of a failed start there, and its parent is told only that it failed. None when
    there is none, or stderr is no file."""
    if since is None:
        return None
    try:
        with open("/proc/self/fd/2", "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(since, end - _TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), default=None)
    if start is None:
        return None
    return next((line for line in reversed(lines[start:]) if _EXCEPTION_LINE.match(line)), None)
