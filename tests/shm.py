"""A process holding a file in /dev/shm as vLLM's processes do, for clean-up tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

from actors.run_dir import SHM_NAMES, SHM_ROOT

# Each makes a file that Python's resource tracker will not unlink (vLLM's queue is not left to
# it; an engine core's lock is, but the tracker dies with the engine's actor), prints its name
# in /dev/shm and waits to be killed.
_MAKERS = {
    # vLLM's executor queue: psm_*
    "shared_memory": (
        "from multiprocessing import resource_tracker, shared_memory\n"
        "shm = shared_memory.SharedMemory(create=True, size=4096)\n"
        "resource_tracker.unregister(shm._name, 'shared_memory')\n"
        "print(shm.name, flush=True)\n"
    ),
    # tqdm's write lock in an engine core: sem.mp-*, mapped under a name already unlinked
    "semaphore": (
        "import multiprocessing\n"
        "from multiprocessing import resource_tracker\n"
        "lock = multiprocessing.get_context('spawn').RLock()\n"
        "resource_tracker.unregister(lock._semlock.name, 'semaphore')\n"
        "print('sem.' + lock._semlock.name.lstrip('/'), flush=True)\n"
    ),
}
_PREFIXES = {"shared_memory": "psm_", "semaphore": "sem.mp-"}


def start_segment_maker(kind: Literal["shared_memory", "semaphore"] = "shared_memory",
                        **popen: Any) -> tuple[subprocess.Popen[str], Path]:
    """Start a maker of `kind` (extra Popen arguments in `popen`); returns it and its file, made."""
    code = f"import time\n{_MAKERS[kind]}time.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **popen)
    assert proc.stdout is not None
    segment = SHM_ROOT / proc.stdout.readline().strip()
    assert segment.name.startswith(_PREFIXES[kind]) and segment.exists(), segment
    return proc, segment


def vllm_shm() -> set[str]:
    """The files in /dev/shm named as vLLM's and Python's multiprocessing's (actors.run_dir)."""
    return {p.name for p in SHM_ROOT.iterdir() if p.name.startswith(SHM_NAMES)}
