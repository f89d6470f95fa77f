"""Burn a set share of CPU beside a server, to see what that much contention does to it.

On a small host, Tandem's processes around the engine (Serve's proxy, the ingress, the
engine actor, Ray's daemons) take CPU the engine's own processes need. Running a plain vLLM
server next to this ballast, set to the CPU those processes were measured to take, tells how
much of Tandem's engine-side slowdown that share alone explains (docs/performance.md,
"What the remaining CPU does to the engine"). The ballast is unpinned, like those processes,
and works in short bursts so the kernel spreads it over every core.

    python -m benchmarks.ballast --cores 0.4 [--procs 4] [--period-ms 2] [--seconds 120]

`tandem bench` runs it (`ballast()`) beside its plain vLLM server, set to the extra CPU it
measured around Tandem's colocated engine.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.scenarios import stop_group

DEFAULT_PROCS = 4


def burn(share: float, period_s: float, seconds: float) -> None:
    """Spin for `share` of every `period_s`, sleep the rest, for `seconds`."""
    end = time.monotonic() + seconds
    busy = share * period_s
    while time.monotonic() < end:
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(max(0.0, period_s - (time.perf_counter() - start)))


def ballast_procs(cores: float) -> int:
    """How many processes burn `cores`: DEFAULT_PROCS, or more where each would need over one core."""
    return max(DEFAULT_PROCS, math.ceil(cores))


@contextmanager
def ballast(cores: float, seconds: float, period_ms: float = 2.0) -> Iterator[int]:
    """Burn `cores` from when the block starts until it ends (or `seconds` pass, should this
    process die first); yields the pid whose process tree burns it, to measure what it took."""
    if cores <= 0:
        raise ValueError(f"a ballast burns a positive share of CPU; got {cores} cores")
    cmd = [sys.executable, "-m", "benchmarks.ballast", "--cores", f"{cores:.4f}", "--procs", str(ballast_procs(cores)),
           "--period-ms", f"{period_ms:g}", "--seconds", f"{seconds:.0f}"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True) as proc:  # closes its pipe at the end
        try:
            if not proc.stdout or not proc.stdout.readline():  # it says so once every process burns
                raise RuntimeError(f"the ballast exited with {proc.wait()} before burning; command: {' '.join(cmd)}")
            yield proc.pid
        finally:
            stop_group(proc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ballast", description=__doc__.splitlines()[0])
    ap.add_argument("--cores", type=float, required=True, help="CPU to burn in all, in cores (e.g. 0.4)")
    ap.add_argument("--procs", type=int, default=DEFAULT_PROCS, help=f"processes sharing it (default {DEFAULT_PROCS})")
    ap.add_argument("--period-ms", type=float, default=2.0, help="burst period (default 2 ms)")
    ap.add_argument("--seconds", type=float, default=120.0, help="stop after this long (default 120)")
    args = ap.parse_args(argv)
    share = args.cores / args.procs
    if not 0 < share <= 1:
        ap.error(f"--cores / --procs must be in (0, 1] (one process cannot burn more than one core); got {share:.2f}")
    # SIGTERM (the bench's teardown) ends the burners and reaps them here: a container's init
    # may not reap orphans, and zombies would pile up over a bench.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    procs = [mp.Process(target=burn, args=(share, args.period_ms / 1000, args.seconds)) for _ in range(args.procs)]
    try:
        for p in procs:
            p.start()
        print(f"burning {args.cores:.2f} core in {args.procs} processes for {args.seconds:.0f} s", flush=True)
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            if p.pid is not None:
                p.join()


if __name__ == "__main__":
    main()
