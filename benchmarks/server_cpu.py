"""CPU a server under test burns while it is measured: vLLM's engine processes, and the rest.

On a small host the processes around an engine (an HTTP front end, Ray's daemons, Tandem's
actors) take CPU the engine needs. The bench reads this for every server it compares, over
each measured run, and sizes a ballast (`benchmarks.ballast`) from the difference: a plain
vLLM server run beside the extra CPU Tandem's stack took shows what that CPU alone costs an
engine ("CPU-matched" runs, in the comparison table of summary.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import psutil

# vLLM titles its engine processes "VLLM::EngineCore" (the scheduler) and "VLLM::Worker" (the
# forward pass, where the executor runs it in processes of its own, as on CPU), with suffixes
# for data, tensor and pipeline ranks.
ENGINE_TITLES = ("::EngineCore", "::Worker")


class ServerCpu(msgspec.Struct, frozen=True):
    """Cores (CPU seconds per wall second, 1.0 = one core busy) over a measured run."""

    engine: float  # vLLM's engine-core and worker processes: the scheduler and the forward pass
    other: float  # every other process of the server: front end, actors, Ray's daemons


class CpuReading(msgspec.Struct, frozen=True):
    """Cumulative CPU seconds per process at one moment."""

    at: float  # time.perf_counter() when read
    engine: dict[int, float]  # pid -> CPU seconds, vLLM's engine processes
    other: dict[int, float]  # pid -> CPU seconds, the rest


def cpu_seconds(procs: Iterable[psutil.Process]) -> dict[int, float]:
    """User + system CPU seconds of each process still alive."""
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def is_engine(p: psutil.Process) -> bool:
    """Whether vLLM titled the process as one of its engine's (its full title is argv[0])."""
    try:
        title = next(iter(p.cmdline()), "")
    except psutil.Error:
        return False
    return any(t in title for t in ENGINE_TITLES)


def cpu_between(before: CpuReading, after: CpuReading) -> ServerCpu:
    """Cores used between two readings. A process that started in between counts from zero;
    one that ended in between is lost (its last interval cannot be read)."""
    window = after.at - before.at
    if window <= 0:
        raise ValueError(f"the second reading must be later than the first (window {window} s)")

    def cores(a: Mapping[int, float], b: Mapping[int, float]) -> float:
        return sum(seconds - a.get(pid, 0.0) for pid, seconds in b.items()) / window

    return ServerCpu(engine=cores(before.engine, after.engine), other=cores(before.other, after.other))


class CpuMeter:
    """Reads the CPU of every process under `roots` (the roots too, unless include_roots=False).

    Processes are listed afresh at each reading, so engines or workers started during a run
    are counted. The bench measures an embedded Ray as the bench process's descendants, and
    a vLLM server as its process tree.
    """

    def __init__(self, roots: Sequence[int], include_roots: bool = True) -> None:
        self.roots = list(roots)
        self.include_roots = include_roots

    def processes(self) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for pid in self.roots:
            try:
                root = psutil.Process(pid)
                tree = [root, *root.children(recursive=True)] if self.include_roots else root.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            found.update((p.pid, p) for p in tree)
        return list(found.values())

    def read(self) -> CpuReading:
        procs = self.processes()
        engine = [p for p in procs if is_engine(p)]
        rest = [p for p in procs if p not in engine]
        return CpuReading(time.perf_counter(), cpu_seconds(engine), cpu_seconds(rest))
