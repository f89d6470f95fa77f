"""The directory an engine actor's vLLM processes bind their ipc sockets in.

vLLM names the ipc sockets of an engine (front end <-> engine core, its shared-memory queues'
notifiers) `$VLLM_RPC_BASE_PATH/<uuid>`, the temp dir by default, and leaves the files behind
when its processes exit, cleanly or not: seven per engine start here, plus the KV-events
socket Tandem gives each engine. A host that starts engines often (tests, benchmarks, fault
recovery) collected thousands in /tmp. So each engine actor gets a directory of its own,
named after its host and pid, for all of them: removed when the engine shuts down, and, for
an actor that was killed (SIGKILL runs no clean-up), by the next engine that starts on the
host. The host name keeps containers that share a /tmp out of each other's directories.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import psutil

PREFIX = "tandem-engine-"


def _own_prefix() -> str:
    return f"{PREFIX}{socket.gethostname()}-"


def make_run_dir(root: Path | None = None) -> Path:
    """A new, empty directory for this process's sockets; the directories of this host's
    engine processes that are gone are removed first."""
    root = Path(tempfile.gettempdir()) if root is None else root
    sweep_dead(root)
    path = root / f"{_own_prefix()}{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)  # a dead process's, whose pid this one reuses
    path.mkdir(mode=0o700)
    return path


def sweep_dead(root: Path) -> list[Path]:
    """Remove the run directories of this host's processes that no longer exist; returns them."""
    removed = []
    for path in root.glob(f"{_own_prefix()}*"):
        pid = path.name.removeprefix(_own_prefix())
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether `pid` runs; a killed process its parent has not reaped yet does not."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
