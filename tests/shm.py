"""A process holding a segment in /dev/shm as vLLM's executor queue does, for clean-up tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from actors.run_dir import SHM_ROOT

# Makes a psm_* segment that Python's resource tracker will not unlink (vLLM's queue is not
# left to it either), prints its name and waits to be killed.
_MAKER = (
    "import time\n"
    "from multiprocessing import resource_tracker, shared_memory\n"
    "shm = shared_memory.SharedMemory(create=True, size=4096)\n"
    "resource_tracker.unregister(shm._name, 'shared_memory')\n"
    "print(shm.name, flush=True)\n"
    "time.sleep(120)\n"
)


def start_segment_maker(**popen: Any) -> tuple[subprocess.Popen[str], Path]:
    """Start the maker (extra Popen arguments in `popen`); returns it and its segment, made."""
    proc = subprocess.Popen([sys.executable, "-c", _MAKER], stdout=subprocess.PIPE, text=True, **popen)
    assert proc.stdout is not None
    segment = SHM_ROOT / proc.stdout.readline().strip()
    assert segment.name.startswith("psm_") and segment.exists(), segment
    return proc, segment
