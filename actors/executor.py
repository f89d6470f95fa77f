"""The executor of a one-rank engine: vLLM's one-process executor, leaving nothing on the host
when its engine is killed.

vLLM's engine core joins a torch process group even alone, through a file store it names
`$TMPDIR/vllm_dist_<uuid>` and removes only on a clean stop: every killed engine left one in
the host's temp dir (about 36 per test run here, hundreds on a host that restarts engines),
and nothing ties such a file to the engine that made it. Kept in the run directory instead
(`VLLM_RPC_BASE_PATH`, which the engine actor points at it: actors.run_dir), it goes when
the engine stops or, for a killed engine, when the next engine on the host sweeps the
directory. The temp dir itself is not moved, so what should outlive an engine there
(torch.compile's cache, vLLM's download locks) stays shared.

The engine core's progress bars (loading weights) take tqdm's default lock, a Python
multiprocessing lock: a named semaphore in /dev/shm (`sem.mp-*`) that Python's resource tracker
unlinks when the process dies, unless the tracker dies with it, as when Ray kills the engine's
actor. No other process writes this process's bars, so a thread lock serves (tqdm.set_lock),
and a killed engine, even one killed while it starts, leaves no semaphore behind.

Imported by vLLM's engine core process, so this module imports only vLLM and its tqdm.
"""

from __future__ import annotations

import threading
from pathlib import Path

from tqdm import tqdm
from vllm import envs
from vllm.v1.executor.uniproc_executor import UniProcExecutor

FILE_STORE = "file://"


class RunDirExecutor(UniProcExecutor):
    """UniProcExecutor whose file-store rendezvous lives under VLLM_RPC_BASE_PATH and whose
    progress bars take a thread lock."""

    def _init_executor(self) -> None:
        tqdm.set_lock(threading.RLock())  # before the weights load, the first bar
        super()._init_executor()

    def _distributed_args(self) -> tuple[str, int, int]:
        method, rank, local_rank = super()._distributed_args()
        if method.startswith(FILE_STORE):  # a TCP rendezvous (ROCm's AITER) leaves no file
            method = f"{FILE_STORE}{Path(envs.VLLM_RPC_BASE_PATH) / Path(method[len(FILE_STORE):]).name}"
        return method, rank, local_rank
