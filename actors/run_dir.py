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

The same goes for the shared memory a tensor-parallel engine's processes make in /dev/shm
(vLLM's executor queue, `psm_*`, 160 MiB; the CPU ranks' buffers, `vllm_dist_*`) and for
Python multiprocessing locks (`sem.mp-*`: tqdm's, in every engine core until actors.executor
gave it a thread lock; the one vLLM's one-rank executor holds while the weights load): vLLM
unlinks its segments only on a clean exit, which an engine core killed after its stop's grace, or
with its actor, never reaches, and Python's resource tracker, which would unlink a lock, is
killed with the actor (Ray kills a dead worker's children). The engine writes the names its
processes map into its run directory while it starts and once it is up
(`recording_shared_memory`, `record_shared_memory`), and they go with it. So does torch's
rendezvous file of a one-rank engine core (actors.executor).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

PREFIX = "tandem-engine-"
# In a run directory: the shared-memory files its engine's processes made, one per line.
SHARED_MEMORY_LIST = "shared-memory"
# Where those files live, and the names vLLM and Python's multiprocessing give them (no
# other engine maps them).
SHM_ROOT = Path("/dev/shm")
SHM_NAMES = ("psm_", "vllm_dist_", "sem.mp-")


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
    if _owned(path):
        shutil.rmtree(path, ignore_errors=True)  # a dead process's, whose pid this one reuses
    path.mkdir(mode=0o700)  # another user's directory of that name stays, and this fails naming it
    return path


def sweep_dead(root: Path) -> list[Path]:
    """Remove the run directories of this host's processes that no longer exist, with the
    shared memory they list; returns them. Only this user's: in a temp dir that users share,
    a directory another user made under such a name is not this engine's to judge."""
    removed = []
    prefix = own_prefix()
    for path in root.glob(f"{prefix}*"):
        pid = path.name.removeprefix(prefix)
        if pid.isdigit() and _owned(path) and not _alive(int(pid)):
            remove(path)
            removed.append(path)
    return removed


def remove(run_dir: Path) -> None:
    """Remove a run directory and the shared-memory files it lists (the engine's processes
    are gone: their mappings, if any are left, outlive the names)."""
    try:
        names = (run_dir / SHARED_MEMORY_LIST).read_text().splitlines()
    except OSError:
        names = []
    unlink_shared_memory(names)
    shutil.rmtree(run_dir, ignore_errors=True)


def unlink_shared_memory(names: Iterable[str]) -> None:
    """Unlink these files of vLLM's in /dev/shm (any other name, a path above all, is left)."""
    for name in names:
        if name.startswith(SHM_NAMES) and "/" not in name:
            (SHM_ROOT / name).unlink(missing_ok=True)


def record_shared_memory(run_dir: Path, pids: Iterable[int]) -> list[str]:
    """Add to `run_dir`'s list the shared-memory files of vLLM's that the engine processes
    `pids` map and this one does not; returns every name listed."""
    listed = run_dir / SHARED_MEMORY_LIST
    try:
        names = set(listed.read_text().split())
    except FileNotFoundError:
        names = set()
    names |= shared_memory(pids)
    listed.write_text("".join(f"{n}\n" for n in sorted(names)))
    return sorted(names)


@contextmanager
def recording_shared_memory(run_dir: Path, period_s: float = 0.1) -> Iterator[None]:
    """While the block runs (vLLM starting the engine), add what this process's children map
    to `run_dir`'s list every `period_s`: an engine killed before it is up (a Ctrl-C, a start
    timeout) leaves its list for the sweep too. vLLM's one-rank executor holds a
    multiprocessing lock, a `sem.mp-*` file, while the weights load. A kill within a period of
    the file's making still leaves it: 1 of 8 Ctrl-Cs at engine start did here at 0.1 s, 2 of 2
    at 1 s."""
    stop = threading.Event()

    def record() -> None:
        while not stop.wait(period_s):
            record_shared_memory(run_dir, [p.pid for p in psutil.Process().children(recursive=True)])

    recorder = threading.Thread(target=record, name="tandem-shm-recorder", daemon=True)
    recorder.start()
    try:
        yield
    finally:
        stop.set()
        recorder.join()


def shared_memory(pids: Iterable[int]) -> set[str]:
    """The names of vLLM's files in /dev/shm that the processes `pids` map and this one does not."""
    return _mapped(pids) - _mapped([os.getpid()])


def _mapped(pids: Iterable[int]) -> set[str]:
    """The names of vLLM's files in /dev/shm that these processes map. Matched by the file,
    not by the path the maps show: glibc makes a named semaphore under a temporary name, maps
    it, links it to its real name and unlinks the temporary one, so a `sem.mp-*` lock shows in
    its process's maps as "/dev/shm/sem.XXXXXX (deleted)"."""
    files = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.readlines()
        except OSError:  # gone, or another user's
            continue
        for line in lines:
            # address perms offset major:minor inode path
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM_ROOT}/"):
                major, minor = fields[3].split(":")
                files.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
    found = set()
    for path in SHM_ROOT.iterdir():
        if not path.name.startswith(SHM_NAMES):
            continue
        try:
            st = path.lstat()
        except OSError:  # unlinked meanwhile
            continue
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) in files:
            found.add(path.name)
    return found


def _owned(path: Path) -> bool:
    """Whether `path` is a directory of this process's user (not a link to one)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _alive(pid: int) -> bool:
    """Whether `pid` runs; a killed process its parent has not reaped yet does not."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
