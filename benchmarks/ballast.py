"""Burn a set share of CPU beside a server, to see what that much contention does to it.

On a small host, Tandem's processes around the engine (Serve's proxy, the ingress, the
engine actor, Ray's daemons) take CPU the engine's own processes need. Running a plain vLLM
server next to this ballast, set to the CPU those processes were measured to take, tells how
much of Tandem's engine-side slowdown that share alone explains (docs/performance.md,
"What the remaining CPU does to the engine"). The ballast is unpinned, like those processes,
and works in short bursts so the kernel spreads it over every core.

    python -m benchmarks.ballast --cores 0.4 [--procs 4] [--period-ms 2] [--seconds 120]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time


def burn(share: float, period_s: float, seconds: float) -> None:
    """Spin for `share` of every `period_s`, sleep the rest, for `seconds`."""
    end = time.monotonic() + seconds
    busy = share * period_s
    while time.monotonic() < end:
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(max(0.0, period_s - (time.perf_counter() - start)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ballast", description=__doc__.splitlines()[0])
    ap.add_argument("--cores", type=float, required=True, help="CPU to burn in all, in cores (e.g. 0.4)")
    ap.add_argument("--procs", type=int, default=4, help="processes sharing it (default 4)")
    ap.add_argument("--period-ms", type=float, default=2.0, help="burst period (default 2 ms)")
    ap.add_argument("--seconds", type=float, default=120.0, help="stop after this long (default 120)")
    args = ap.parse_args(argv)
    share = args.cores / args.procs
    if not 0 < share <= 1:
        ap.error(f"--cores / --procs must be in (0, 1] (one process cannot burn more than one core); got {share:.2f}")
    procs = [mp.Process(target=burn, args=(share, args.period_ms / 1000, args.seconds)) for _ in range(args.procs)]
    for p in procs:
        p.start()
    print(f"burning {args.cores:.2f} core in {args.procs} processes for {args.seconds:.0f} s", flush=True)
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
