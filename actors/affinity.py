"""Which cores a process runs on: the node's cores, confining a whole process to some, and
what those cores compute natively.

`sched_setaffinity(pid)` moves one thread only; a process's other threads (event loops,
NIXL/UCX progress, gRPC) keep the mask they had, so every thread is moved, and the threads
and processes started later inherit the mask of whichever thread starts them.
"""

from __future__ import annotations

import os

# The cores of this host's Ray node, for when its processes run under a narrower mask than
# the node has: an embedded Ray whose own processes Tandem keeps off the engines' compute
# cores (orchestrator.cluster), or `TANDEM_NODE_CORES=0-15 taskset -c 0 ray start ...` on a
# CPU cluster. Comma-separated cores or ranges; unset: the asking process's own mask.
NODE_CORES_ENV = "TANDEM_NODE_CORES"


def parse_cores(text: str) -> list[int]:
    """Cores written as `taskset -c` takes them ("0-3,8"), sorted."""
    cores: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"{NODE_CORES_ENV}={text!r} is not a core list; write it as taskset -c does, e.g. 0-3,8") from None
    if not cores:
        raise ValueError(f"{NODE_CORES_ENV}={text!r} names no core; unset it or list the node's cores, e.g. 0-3")
    return sorted(cores)


def node_cores() -> list[int]:
    """The cores this node's engines may use: NODE_CORES_ENV where set, else this process's mask."""
    text = os.environ.get(NODE_CORES_ENV)
    return parse_cores(text) if text else sorted(os.sched_getaffinity(0))


def pin_process(pid: int, cores: list[int]) -> bool:
    """Confine every thread of process `pid` to `cores`; False if the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return True


# The CPU flags torch's AVX512 kernels (its "AVX512" capability) ask for.
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})


def cpu_flags() -> set[str]:
    """This host's CPU flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def lacks_half_precision() -> bool:
    """Whether this host's CPU computes bfloat16 and float16 matmuls without native
    instructions: an x86 CPU without AVX-512 (AVX512_FLAGS). vLLM's CPU build serves half
    precision on every x86 host, but on an AMD EPYC with AVX2 only (2026-12-02) torch's
    128x512x2048 matmul ran at 0.5 GFLOP/s in bfloat16 and 0.4 in float16 against 67 in
    float32, and builtin:medium's prefill took 80x what it took on an AVX-512 host. Read from
    /proc/cpuinfo, not torch: the placement probe asks it of every node at start-up, where
    importing torch took about 2 s of a core."""
    import platform

    return platform.machine().lower() in ("x86_64", "amd64") and not AVX512_FLAGS <= cpu_flags()
