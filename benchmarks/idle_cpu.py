"""CPU that an idle deployment burns: the engines' processes, summed over a quiet window.

An idle engine should cost nothing. With vLLM's NixlConnector as shipped it did not: every
engine kept a UCX progress thread polling without sleeping (see docs/performance.md). This
deploys a config (1 prefill + 1 decode on the tiny model by default), serves it, lets start-up
settle, then sums the CPU time (user + system) of every engine process over `--seconds`: each
engine actor and all of its descendants (vLLM's engine core and workers). Ray's and Serve's
own processes are reported beside it, not in the total.

    python -m benchmarks.idle_cpu [--config 1p1d.yaml] [--seconds 30] [--settle 10]

Prints one JSON object and saves it under results/ (idle-cpu-<timestamp>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec
import psutil

from benchmarks.server_cpu import cpu_seconds
from orchestrator.config import load_config, to_dict

# The engines' total must stay under this share of one core (Tandem's idle target).
IDLE_BOUND_CORES = 0.10


class ProcessCpu(msgspec.Struct, frozen=True):
    pid: int
    name: str
    cores: float  # CPU seconds over the window / window seconds (1.0 = one core busy)


class IdleCpu(msgspec.Struct, frozen=True):
    """CPU used during an idle window, in cores (CPU seconds per wall second)."""

    window_s: float
    engine_cores: float  # every engine process together: the figure held to IDLE_BOUND_CORES
    other_cores: float  # the rest of this driver's Ray (GCS, raylet, Serve), for context
    engines: list[ProcessCpu]  # per engine process, busiest first
    bound_cores: float = IDLE_BOUND_CORES

    @property
    def within_bound(self) -> bool:
        return self.engine_cores < self.bound_cores


def engine_processes(engine_pids: Iterable[int]) -> list[psutil.Process]:
    """Each engine actor's process and all of its descendants."""
    procs: dict[int, psutil.Process] = {}
    for pid in engine_pids:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            procs[p.pid] = p
    return list(procs.values())


def _ray_processes(exclude: set[int]) -> list[psutil.Process]:
    """This driver's descendants (the embedded Ray: GCS, raylet, Serve, idle workers), engines excluded."""
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in exclude]


def measure(engine_pids: Iterable[int], seconds: float) -> IdleCpu:
    """Sum CPU time of the engines' processes (and Ray's, apart) over `seconds` of wall time."""
    engines = engine_processes(engine_pids)
    others = _ray_processes({p.pid for p in engines})
    before_e, before_o = cpu_seconds(engines), cpu_seconds(others)
    t0 = time.perf_counter()
    time.sleep(seconds)
    after_e, after_o = cpu_seconds(engines), cpu_seconds(others)
    window = time.perf_counter() - t0
    per = []
    for p in engines:
        if p.pid in before_e and p.pid in after_e:
            try:
                name = " ".join(p.cmdline()[:1]) or p.name()
            except psutil.NoSuchProcess:
                name = "?"
            per.append(ProcessCpu(p.pid, name, (after_e[p.pid] - before_e[p.pid]) / window))
    other = sum(after_o[pid] - before_o[pid] for pid in after_o if pid in before_o) / window
    per.sort(key=lambda x: -x.cores)
    return IdleCpu(window, sum(x.cores for x in per), other, per)


def main() -> int:
    import ray

    from orchestrator.config import parse_config
    from orchestrator.job import running

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="deployment config (default: 1 prefill + 1 decode, tiny model)")
    ap.add_argument("--seconds", type=float, default=30.0, help="idle window measured (default %(default)s)")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds to wait after start-up first (default %(default)s)")
    ap.add_argument("--out", default="results", help="folder for the JSON result (default %(default)s)")
    args = ap.parse_args()
    cfg = load_config(args.config) if args.config else parse_config({"prefill": {}, "decode": {}})
    with running(cfg) as r:
        time.sleep(args.settle)
        result = measure([i.pid for i in r.deployment.infos], args.seconds)
        loadavg = os.getloadavg()
    ray.shutdown()
    record = {
        "command": "python -m benchmarks.idle_cpu " + " ".join(
            f"--{k} {v}" for k, v in (("config", args.config), ("seconds", args.seconds), ("settle", args.settle)) if v is not None
        ),
        "config": to_dict(cfg),
        "loadavg_at_end": loadavg,
        "cpu_count": os.cpu_count(),
        "within_bound": result.within_bound,
        **msgspec.to_builtins(result),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"idle-cpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2))
    print(json.dumps(record | {"config": "..."}, indent=2))
    print(f"saved to {path}")
    return 0 if result.within_bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
