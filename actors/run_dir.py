"""The directory an engine actor's vLLM processes bind their ipc sockets in.

vLLM names the ipc sockets of an engine (front end <-> engine core, its shared-memory queues'
notifiers) `$VLLM_RPC_BASE_PATH/<uuid>`, the temp dir by default, and leaves the files behind
when its processes exit, cleanly or not: seven per engine start here, plus the KV-events
socket Tandem gives each engine. A host that starts engines often (tests, benchmarks, fault
recovery) collected thousands in /tmp. So each engine actor gets a directory of its own,
named after its host and pid, for all of them: removed when the engine shuts down, and, for
an actor that was killed (SIGKILL runs no clean-up), by the next engine that starts on the
host. The host's name keeps containers that share a /tmp out of each other's directories; it
goes in as a short hash, since a Unix socket's path must fit in 107 bytes and a Kubernetes
pod's host name alone may take 63. A `VLLM_RPC_BASE_PATH` set by the user stays the parent.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from pathlib import Path

import psutil

PREFIX = "tandem-engine-"


def own_prefix() -> str:
    """The start of this host's run directories' names: "tandem-engine-<host hash>-"."""
    return f"{PREFIX}{hashlib.blake2s(socket.gethostname().encode(), digest_size=4).hexdigest()}-"


def make_run_dir(root: Path | None = None) -> Path:
    """A new, empty directory for this process's sockets (under `root`, by default the
    user's VLLM_RPC_BASE_PATH or the temp dir); the directories of this host's engine
    processes that are gone are removed first."""
    root = Path(os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()) if root is None else root
    sweep_dead(root)
    path = root / f"{own_prefix()}{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)  # a dead process's, whose pid this one reuses
    path.mkdir(mode=0o700)
    return path


def sweep_dead(root: Path) -> list[Path]:
    """Remove the run directories of this host's processes that no longer exist; returns them."""
    removed = []
    prefix = own_prefix()
    for path in root.glob(f"{prefix}*"):
        pid = path.name.removeprefix(prefix)
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
