"""`tandem bench --scenarios fault:prefill,fault:decode`: one engine SIGKILLed under load.

The scenario's 1P1D (the bench's base config, deployed as `1p1d` is) takes one bounded
Poisson load; `kill_after_s` into it, the process of the role's first engine is SIGKILLed,
which only works where that process runs on this host. Meanwhile a thread polls the
deployment's status every POLL_S and records the victim's state, which gives:

- time to detect: kill to the first sample where the victim is not "healthy" (out of routing);
- time to recover: kill to the first sample where it is "healthy" again with its restart counted;
- requests lost: the load's failed requests, with their errors;
- TTFT before the kill, during the fault (kill to recovery) and after (`fault_windows`);
- the router's failover counters and the engine restarts over the run, from /metrics.

Sending stops `tail_s` after recovery, or `window_s` after the kill at the latest. Status
answers arrive at most `max_gap_s` apart, and detection and recovery are known to within that.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, get_args

import msgspec
import psutil

from benchmarks.loadgen import RunResult, run_load
from benchmarks.scenarios import FaultRole, Scenario, Target
from benchmarks.stats import SLO, Percentiles, RequestResult, percentiles_ms
from benchmarks.workloads import BenchRequest, WorkloadSpec
from orchestrator.protocol import DeploymentStatus, ReplicaState, ReplicaStatus

logger = logging.getLogger("tandem.bench.faults")

# How often the status is polled: detection and recovery are known to within this, or to
# within the longest gap between answers when the pool manager is slow to answer.
POLL_S = 0.05
# The router's failover counters and the engines' restarts, as grown over the run.
FAULT_COUNTERS = ("tandem_migrations_total", "tandem_fallbacks_total", "tandem_prefill_retries_total", "tandem_engine_restarts_total")
# The goals the fault scenarios are held to (the default 1P1D on a 2-core host).
GOAL_DETECT_S = 2.0
GOAL_RECOVER_S = 90.0
GOAL_LOST = 0

WindowName = Literal["before", "during", "after"]


class FaultPlan(msgspec.Struct, frozen=True):
    """When to kill, and how long the load may run."""

    kill_after_s: float  # seconds into the measured load
    window_s: float  # most seconds of load after the kill, recovered or not
    tail_s: float  # seconds of load after recovery (then sending stops)

    def num_requests(self, rate: float) -> int:
        """Enough requests for Poisson arrivals at `rate` to outlast the whole load (three
        standard deviations over the mean count); the load's duration bounds it first."""
        mean = rate * (self.kill_after_s + self.window_s)
        return math.ceil(mean + 3 * math.sqrt(mean)) + 1


class StatusSample(msgspec.Struct, frozen=True, array_like=True):
    """The victim replica as one status answer showed it."""

    t: float  # seconds from the load's start (as RequestResult.start) to the answer's arrival
    state: ReplicaState
    restarts: int
    pid: int | None


class Window(msgspec.Struct, frozen=True):
    """The requests sent during one stretch of the run."""

    name: WindowName  # before the kill, during the fault (kill to recovery), after recovery (fault_windows)
    num_requests: int
    num_failed: int
    ttft_ms: Percentiles  # of the requests that succeeded


class FaultReport(msgspec.Struct, frozen=True):
    """What one fault scenario measured; the run keeps every request."""

    scenario: Scenario
    plan: FaultPlan
    startup_s: float
    victim: str  # the engine killed, e.g. "prefill-0"
    pid: int  # its process, SIGKILLed
    kill_s: float  # seconds from the load's start to the kill
    detect_s: float | None  # kill to out of routing; None: not seen
    recover_s: float | None  # kill to healthy again with the restart counted; None: not within the run
    windows: list[Window]
    timeline: list[StatusSample]  # the first sample and each change of the victim's state, restarts or pid
    num_samples: int
    max_gap_s: float  # the longest wait between two status answers
    run: RunResult

    @property
    def detected_at(self) -> float | None:
        """Seconds from the load's start to detection, as kill_s is."""
        return None if self.detect_s is None else self.kill_s + self.detect_s

    @property
    def recovered_at(self) -> float | None:
        return None if self.recover_s is None else self.kill_s + self.recover_s

    @property
    def num_lost(self) -> int:
        return self.run.summary.num_failed

    def counter(self, name: str) -> float | None:
        """A FAULT_COUNTERS sample's growth over the run; None when /metrics did not show it at
        the run's end (a labelled counter nothing has counted yet, or replica series left out
        because the ingress could not read the pool manager's status)."""
        return self.run.summary.server_metrics.get(name)

    def window(self, name: WindowName) -> Window:
        return next(w for w in self.windows if w.name == name)


def detection(samples: Sequence[StatusSample], kill_s: float, restarts_before: int) -> tuple[float | None, float | None]:
    """(time to detect, time to recover), seconds from the kill; None where no sample shows it.

    Recovery needs the restart counted: a sample from before the manager noticed the kill
    still says "healthy" with the old count.
    """
    after = [s for s in samples if s.t >= kill_s]
    detected = next((s.t - kill_s for s in after if s.state != "healthy"), None)
    recovered = next((s.t - kill_s for s in after if s.state == "healthy" and s.restarts > restarts_before), None)
    return detected, recovered


def changes(samples: Sequence[StatusSample]) -> list[StatusSample]:
    """The first sample and each one whose state, restarts or pid differs from the one before."""
    return [s for k, s in enumerate(samples) if k == 0 or (s.state, s.restarts, s.pid) != (samples[k - 1].state, samples[k - 1].restarts, samples[k - 1].pid)]


def max_gap(samples: Sequence[StatusSample]) -> float:
    return max((b.t - a.t for a, b in zip(samples, samples[1:])), default=0.0)


def window_of(request: RequestResult, kill_s: float, recovered_s: float | None) -> WindowName:
    """The window whose TTFT figures a request belongs to. Before: its first token (or its
    failure) came before the kill, so the fault cannot have touched its TTFT; after: sent once
    the victim was healthy again; during: the rest, sent before recovery (to the end of the run
    when there was none) and answered after the kill."""
    if request.start + (request.ttft if request.ttft is not None else request.latency) < kill_s:
        return "before"
    return "after" if recovered_s is not None and request.start >= recovered_s else "during"


def fault_windows(requests: Sequence[RequestResult], kill_s: float, recovered_s: float | None) -> list[Window]:
    """The requests of each window (`window_of`), failed ones counted, TTFT of the others."""
    windows = []
    for name in get_args(WindowName):
        inside = [r for r in requests if window_of(r, kill_s, recovered_s) == name]
        ttfts = [r.ttft for r in inside if r.ok and r.ttft is not None]
        windows.append(Window(name, len(inside), sum(not r.ok for r in inside), percentiles_ms(ttfts)))
    return windows


def first_replica(status: DeploymentStatus, role: FaultRole) -> tuple[ReplicaStatus, int]:
    """The role's first replica and its pid: it must be healthy, its process on this host."""
    pool = next((p for p in status.pools if p.role == role), None)
    if pool is None or not pool.replicas:
        raise RuntimeError(f"the deployment has no {role} replica to kill")
    victim = pool.replicas[0]
    if victim.state != "healthy" or victim.pid is None:
        raise RuntimeError(f"{victim.id} is {victim.state}, not healthy: no fault is injected into a deployment already degraded")
    if not psutil.pid_exists(victim.pid):
        raise RuntimeError(f"{victim.id}'s process {victim.pid} is not on this host; fault scenarios kill engines on this machine only")
    return victim, victim.pid


def _replica(status: DeploymentStatus, engine_id: str) -> ReplicaStatus | None:
    return next((r for p in status.pools for r in p.replicas if r.id == engine_id), None)


class _Watch(threading.Thread):
    """Polls the deployment's status every POLL_S until closed, keeping the victim's samples
    (at Unix times); sets `stop` `tail_s` after the victim is healthy again with its restart
    counted. A thread of its own, so the load's event loop does not delay the samples."""

    def __init__(self, deployment: Any, victim: ReplicaStatus, tail_s: float) -> None:
        super().__init__(name="fault-watch", daemon=True)
        self.samples: list[StatusSample] = []
        self.stop = threading.Event()
        self._deployment = deployment
        self._victim = victim
        self._tail_s = tail_s
        self._closed = threading.Event()

    def run(self) -> None:
        recovered_at = None
        next_poll = time.monotonic()
        while not self._closed.wait(max(0.0, next_poll - time.monotonic())):
            next_poll = time.monotonic() + POLL_S
            try:
                replica = _replica(self._deployment.status(), self._victim.id)
            except Exception as err:  # a status call lost to the fault is a gap, not the run's end
                logger.warning("status poll failed: %s", err)
                continue
            now = time.time()
            if replica is None:
                continue
            self.samples.append(StatusSample(now, replica.state, replica.restarts, replica.pid))
            if recovered_at is None and replica.state == "healthy" and replica.restarts > self._victim.restarts:
                recovered_at = now
                logger.info("%s healthy again (restart %d), pid %s", replica.id, replica.restarts, replica.pid)
            if recovered_at is not None and now >= recovered_at + self._tail_s:
                self.stop.set()

    def close(self) -> None:
        self._closed.set()
        self.join()


async def _kill_after(pid: int, delay_s: float) -> float:
    """SIGKILL `pid` after `delay_s`; the Unix time of the kill."""
    await asyncio.sleep(delay_s)
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    logger.info("SIGKILLed pid %d", pid)
    return killed


def run_fault(
    target: Target,
    scenario: Scenario,
    plan: FaultPlan,
    requests: Sequence[BenchRequest],
    *,
    warmup: int,
    rate: float,
    seed: int,
    slo: SLO,
    request_timeout_s: float,
    workload: WorkloadSpec | None = None,
) -> FaultReport:
    """Warm the deployment up with the first `warmup` requests, send the rest at `rate` and
    SIGKILL the scenario's victim `plan.kill_after_s` into that load; figures as in the module
    docstring."""
    if scenario.fault is None:
        raise ValueError(f"scenario {scenario.name!r} injects no fault")
    victim, pid = first_replica(target.deployment.status(), scenario.fault)
    logger.info("%s: killing %s (pid %d) %g s into a load at %g req/s", scenario.name, victim.id, pid, plan.kill_after_s, rate)

    async def load() -> tuple[RunResult, float, list[StatusSample]]:
        if warmup:  # all at once, as the sweep's warm-up is
            await run_load(target.base_url, target.model, requests[:warmup], request_timeout_s=request_timeout_s, progress=False)
        watch = _Watch(target.deployment, victim, plan.tail_s)
        watch.start()
        try:
            run, killed = await asyncio.gather(
                run_load(
                    target.base_url, target.model, requests[warmup:], rate=rate, seed=seed, slo=slo, label=scenario.name,
                    duration_s=plan.kill_after_s + plan.window_s, request_timeout_s=request_timeout_s,
                    metric_names=FAULT_COUNTERS, workload=workload, stop=watch.stop,
                ),
                _kill_after(pid, plan.kill_after_s),
            )
        finally:
            await asyncio.to_thread(watch.close)
        return run, killed, watch.samples

    run, killed, unix_samples = asyncio.run(load())
    started = run.started or 0.0  # run_load always records it
    samples = [msgspec.structs.replace(s, t=s.t - started) for s in unix_samples]
    kill_s = killed - started
    detect_s, recover_s = detection(samples, kill_s, victim.restarts)
    return FaultReport(
        scenario=scenario, plan=plan, startup_s=target.startup_s, victim=victim.id, pid=pid,
        kill_s=kill_s, detect_s=detect_s, recover_s=recover_s,
        windows=fault_windows(run.requests, kill_s, None if recover_s is None else kill_s + recover_s),
        timeline=changes(samples), num_samples=len(samples), max_gap_s=max_gap(samples), run=run,
    )
