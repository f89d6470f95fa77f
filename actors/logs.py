"""One log format for every Tandem process: the driver, the pool manager and the engines.

Ray leaves a worker's root logger unconfigured, so without this an actor's INFO lines are
dropped and its warnings reach the worker's log file bare, with no time to line them up
against another process's (a pool manager that restarted three engines at once could not be
placed against the load it was under).
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def setup_logging() -> None:
    """Log INFO and up to stderr with the time and the logger's name (idempotent)."""
    logging.basicConfig(level=logging.INFO, format=FORMAT)
