"""The fault matrix, for real: a 1P1D deployment (Ray, two vLLM engines, NIXL, the CPU tier,
Serve, the openai client) under a bounded load while real processes (engines, the CPU tier's
store and index) are SIGKILLed, a KV load fails, clients leave at every phase, and the decode
pool grows and shrinks.

After each fault: every request completed with the text an undisturbed run gives, nothing
leaked (engine KV, the tier's pins, requests in flight), and the pool is back at full
strength with the restart counted. Timings (detection, recovery) are figures for
`tandem bench` (benchmarks/faults.py), not assertions here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import ray

from actors.run_dir import SHM_ROOT, own_prefix, shared_memory
from orchestrator.config import parse_config
from orchestrator.job import Running, running
from orchestrator.protocol import DeploymentStatus
from tests.conftest import free_port
from tests.faults import HOLD_MARK, HOLD_S, KV_LOAD_FAILURE_MARK
from tests.shm import vllm_shm

pytestmark = pytest.mark.engines

MODEL = "tandem-tiny"
BIN = Path(sys.executable).parent
MAX_TOKENS = 48
# The decode pool may grow to two replicas when each carries more than 3 requests on
# average; the kill tests keep at most 3 in flight, so only the scaling test grows it.
CONFIG = {
    "engine_args": {"max_model_len": 1024},
    "decode": {"replicas": 1, "max_replicas": 2,
               "autoscaling": {"target_per_replica": 3, "upscale_delay_s": 2, "downscale_delay_s": 8}},
    "prefill": {"replicas": 1},
    "health": {"period_s": 0.5},
    # KV loads of requests whose id carries KV_LOAD_FAILURE_MARK fail, and those whose id carries
    # HOLD_MARK wait HOLD_S in their engine's queue (tests/faults.py).
    "kv_transfer": {"connector": "FailingLoadNixlConnector", "module_path": "tests.faults"},
}
RECOVERY_TIMEOUT_S = 300
# The scaling test's load runs LOAD_S, then pauses BREATH_S (idle cores once vLLM's engines stop
# spinning, 1 s after their last message): shorter than its downscale delay.
LOAD_S, BREATH_S = 6.0, 2.5


@pytest.fixture(scope="module")
def shm_before() -> set[str]:
    """vLLM's and Python's files in /dev/shm before the module's engines start."""
    return vllm_shm()


@pytest.fixture(scope="module")
def pd(ray_local: None, tiny_model: object, shm_before: set[str]) -> Iterator[Running]:
    cfg = parse_config({
        **CONFIG,
        "serve": {"port": free_port()},
        "kv_transfer": {**CONFIG["kv_transfer"], "side_channel_base_port": free_port(8)},  # type: ignore[dict-item]
    })
    with running(cfg, own_ray=False) as up:
        yield up
        pids = engine_pids(up)
        actors = {r.pid for pool in status(up).pools for r in pool.replicas if r.pid is not None}
        assert all(run_dir(pid).is_dir() for pid in actors)
        # torch's rendezvous file of each engine core is there too (actors.executor), so it goes with the dir
        assert all(any(run_dir(pid).glob("vllm_dist_*")) for pid in actors), [sorted(run_dir(pid).iterdir()) for pid in actors]
    deadline = time.monotonic() + 30  # killed processes take a moment to be reaped
    while (alive := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"engine processes left after stop: {alive}"
    left = [str(run_dir(pid)) for pid in actors if run_dir(pid).exists()]
    assert not left, f"engines' socket directories left after stop: {left}"


def run_dir(pid: int) -> Path:
    """Where the engine actor `pid` on this host keeps vLLM's sockets (actors.run_dir)."""
    return Path(tempfile.gettempdir()) / f"{own_prefix()}{pid}"


def _alive(pids: set[int]) -> list[str]:
    found = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{pid} {p.name()} {' '.join(p.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            pass
    return found


def engine_pids(up: Running) -> set[int]:
    """The pids of every engine process now: actors and their vLLM children."""
    return {pid for pool in status(up).pools for r in pool.replicas if r.pid is not None for pid in (r.pid, *r.child_pids)}


def status(up: Running) -> DeploymentStatus:
    return up.deployment.status()


def replica(st: DeploymentStatus, engine_id: str) -> Any:
    return next(r for p in st.pools for r in p.replicas if r.id == engine_id)


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"
        time.sleep(0.5)


def restarts(up: Running, plus_one: str | None = None) -> dict[str, int]:
    """Each replica's restart count now, with one more for `plus_one` (the one to kill)."""
    counts = {r.id: r.restarts for p in status(up).pools for r in p.replicas}
    if plus_one is not None:
        counts[plus_one] += 1
    return counts


def full_strength(up: Running, restarts: dict[str, int]) -> None:
    """Every replica healthy and each named one restarted exactly that many times."""
    def ok() -> bool:
        st = status(up)
        return all(r.state == "healthy" for p in st.pools for r in p.replicas) and all(
            replica(st, eid).restarts == n for eid, n in restarts.items()
        )

    wait_until(ok, RECOVERY_TIMEOUT_S, "the pools came back to full strength")


def scrape(up: Running) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(up.url.removesuffix("/v1") + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def metric(m: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= ls)


def nothing_leaked(up: Running, within_s: float = 10) -> None:
    """Idle engines hold no KV blocks, the tier holds no pins and no slot reserved for a save,
    no request is in flight."""
    left: dict[str, object] = {}

    def idle() -> bool:
        st = status(up)
        m = scrape(up)
        left.clear()
        left.update({
            "engine KV usage": {dict(ls).get("engine"): v for (n, ls), v in m.items() if n == "tandem_engine_kv_cache_usage" and v},
            "requests in flight": metric(m, "tandem_requests_in_flight"),
            "outstanding": {r.id: r.outstanding for p in st.pools for r in p.replicas if r.outstanding},
            "tier pins/grants": None if st.cpu_tier is None else (st.cpu_tier.pinned, st.cpu_tier.open_grants),
        })
        return (not left["engine KV usage"] and not left["requests in flight"] and not left["outstanding"]
                and left["tier pins/grants"] in (None, (0, 0)))

    # By default far below NIXL's 30-s lease: held blocks are released, not left to expire.
    try:
        wait_until(idle, within_s, "engine KV, tier pins and requests in flight went back to idle")
    except AssertionError as e:
        raise AssertionError(f"{e}; still held: {left}") from None


def prompt(i: int) -> list[int]:
    return [20 + (i * 37 + k * 11) % 400 for k in range(60 + 13 * i)]


async def _one(client: openai.AsyncOpenAI, i: int, stream: bool, request_id: str | None = None) -> tuple[str, str | None, int]:
    """(text, finish_reason, completion tokens) of one greedy request of prompt(i)."""
    kw: dict[str, Any] = {
        "model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0,
        "extra_body": {"ignore_eos": True},
        "extra_headers": {"X-Request-Id": request_id} if request_id else None,
    }
    if not stream:
        r = await client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    text, finish, usage = [], None, None
    async for ev in await client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if ev.choices:
            text.append(ev.choices[0].text)
            finish = ev.choices[0].finish_reason or finish
        if ev.usage:
            usage = ev.usage.completion_tokens
    return "".join(text), finish, usage or 0


def load(up: Running, indices: list[int], concurrency: int, during: Any = None, delay_s: float = 1.5,
         held: int = 0) -> list[Any]:
    """Send the requests (streaming and not, alternating) `concurrency` at a time; call
    `during()` once `delay_s` into the load. The first `held` requests carry HOLD_MARK: each
    waits HOLD_S in its engines' queues, so a prefill is surely in flight when `during` runs
    however fast the host computes. Returns each request's result or exception."""
    async def main() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=up.url, api_key="unused", max_retries=0, timeout=300)
        gate = asyncio.Semaphore(concurrency)

        async def guarded(n: int, i: int) -> Any:
            async with gate:
                return await _one(client, i, stream=i % 2 == 0, request_id=f"{HOLD_MARK}-{n}" if n < held else None)

        tasks = [asyncio.ensure_future(guarded(n, i)) for n, i in enumerate(indices)]
        if during is not None:
            await asyncio.sleep(delay_s)
            await asyncio.to_thread(during)
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def reference(pd: Running) -> dict[int, tuple[str, str | None, int]]:
    """Undisturbed answers of every prompt the tests send (greedy, so reproducible)."""
    results = load(pd, list(range(24)), concurrency=3)
    assert all(not isinstance(r, BaseException) for r in results), results
    return dict(enumerate(results))


def check_answers(results: list[Any], reference: dict[int, Any], indices: list[int]) -> None:
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} requests failed: {errors[:3]}"
    for i, r in zip(indices, results):
        assert r == reference[i], f"request {i}: {r!r} != undisturbed {reference[i]!r}"
        assert r[1] == "length" and r[2] == MAX_TOKENS


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def kill_while_serving(up: Running, engine_id: str, pid: int, timeout_s: float = 30) -> None:
    """SIGKILL `pid` once the router has a request in flight on `engine_id`: the kill lands
    under load however fast the host serves (a fixed delay missed it once requests got faster;
    a prefill engine's requests are in flight for milliseconds, so a load aimed at one holds a
    request there, `load(held=1)`, for these scrapes to see)."""
    deadline = time.monotonic() + timeout_s
    while metric(scrape(up), "tandem_router_outstanding_requests", engine=engine_id) == 0:
        assert time.monotonic() < deadline, f"no request was in flight on {engine_id} within {timeout_s:.0f} s"
        time.sleep(0.02)
    kill(pid)


def test_status_json_names_every_replica_with_the_pid_an_operator_kills(pd: Running) -> None:
    gcs = ray.get_runtime_context().gcs_address
    # An operator's shell, not this process's child: Ray set RAY_AUTH_MODE=token here when it
    # started the cluster, and a shell of the operator's has no such variable.
    shell = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    out = subprocess.run([str(BIN / "tandem"), "status", "--json", "--address", gcs], capture_output=True, text=True, timeout=120, env=shell)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    pools = {p["role"]: p["replicas"] for p in data["pools"]}
    assert set(pools) == {"prefill", "decode"}
    infos = {e.engine_id: ray.get(e.handle.info.remote()) for e in pd.deployment.routing_engines()}
    for replicas in pools.values():
        (r,) = replicas
        assert r["state"] == "healthy" and r["restarts"] == 0 and r["pid"] == infos[r["id"]].pid
        assert r["node"] == infos[r["id"]].node_ip and psutil.pid_exists(r["pid"])
        # vLLM's engine core and worker: what a profiler attaches to
        assert r["child_pids"] == infos[r["id"]].child_pids and all(psutil.pid_exists(p) for p in r["child_pids"])
        assert r["child_pids"] and r["cores"] == infos[r["id"]].cores
    assert data["cpu_tier"]["capacity"] > 0
    text = subprocess.run([str(BIN / "tandem"), "status", "--address", gcs], capture_output=True, text=True, timeout=120, env=shell)
    assert "deployment tandem: ok" in text.stdout and "prefill-0" in text.stdout


def test_killing_the_prefill_engine_under_load_loses_no_request(pd: Running, reference: dict, shm_before: set[str]) -> None:
    victim, expected = replica(status(pd), "prefill-0"), restarts(pd, plus_one="prefill-0")
    indices = list(range(24)) * 2
    results = load(pd, indices, concurrency=3, during=lambda: kill_while_serving(pd, "prefill-0", victim.pid), delay_s=0.3, held=1)
    check_answers(results, reference, indices)
    full_strength(pd, expected)
    after = replica(status(pd), "prefill-0")
    assert after.pid != victim.pid and after.incarnation != victim.incarnation
    # The killed actor could not remove its sockets and shared memory; the engine started after it did.
    assert not run_dir(victim.pid).exists() and run_dir(after.pid).is_dir()
    # Nor does anything of the killed engine's stay in /dev/shm (its engine core's
    # multiprocessing lock did: actors.executor, actors.run_dir).
    left = vllm_shm() - shm_before - shared_memory(engine_pids(pd))
    assert not left, f"the killed engine left in {SHM_ROOT}: {sorted(left)}"
    m = scrape(pd)
    assert metric(m, "tandem_engine_restarts_total", engine="prefill-0") == 1
    assert metric(m, "tandem_fallbacks_total") > 0, "requests met no prefill engine while it restarted"
    nothing_leaked(pd)
    # The restarted prefill engine serves over NIXL again (its handshake was pre-warmed).
    before = metric(m, "tandem_kv_transfers_total", pool="decode")
    check_answers(load(pd, [0, 1], concurrency=1), reference, [0, 1])
    assert metric(scrape(pd), "tandem_kv_transfers_total", pool="decode") >= before + 2


def test_killing_the_decode_engine_mid_stream_loses_no_request(pd: Running, reference: dict) -> None:
    victim, expected = replica(status(pd), "decode-0"), restarts(pd, plus_one="decode-0")
    before = metric(scrape(pd), "tandem_migrations_total")
    indices = list(range(24)) * 2
    results = load(pd, indices, concurrency=3, during=lambda: kill_while_serving(pd, "decode-0", victim.pid), delay_s=0.3)
    check_answers(results, reference, indices)  # streams continued unbroken, same text, right usage
    assert metric(scrape(pd), "tandem_migrations_total") > before, "streams in flight moved to another engine"
    full_strength(pd, expected)
    nothing_leaked(pd)


def test_killing_vllms_engine_core_under_a_live_actor_restarts_the_replica(pd: Running, reference: dict) -> None:
    """The actor process lives on with a dead engine: its health check fails, the manager
    kills it so Ray restarts it, and it rejoins only as a new incarnation."""
    victim, expected = replica(status(pd), "prefill-0"), restarts(pd, plus_one="prefill-0")
    (core,) = [c for c in psutil.Process(victim.pid).children() if c.name() == "VLLM::EngineCore"]
    indices = list(range(24))
    results = load(pd, indices, concurrency=3, during=lambda: kill_while_serving(pd, "prefill-0", core.pid), delay_s=0.3, held=1)
    check_answers(results, reference, indices)
    full_strength(pd, expected)
    after = replica(status(pd), "prefill-0")
    assert after.pid != victim.pid and after.incarnation != victim.incarnation
    # The killed actor could not remove its sockets; the engine started after it did.
    assert not run_dir(victim.pid).exists() and run_dir(after.pid).is_dir()
    assert "EngineDeadError" in (after.last_error or "")
    nothing_leaked(pd)


def test_an_engine_that_stalls_through_one_health_check_is_not_restarted(pd: Running, reference: dict) -> None:
    """SIGSTOP the prefill engine's process past one health-check timeout, then let it run:
    it misses one check and answers the second, so it is a stall (a loaded host stalls
    every engine at once), not a failure, and keeps its process. Requests sent meanwhile
    wait for it and are answered."""
    from orchestrator.config import HealthConfig

    victim, expected = replica(status(pd), "prefill-0"), restarts(pd)

    def stall() -> None:  # from the SIGSTOP: 1.5 s of load, then 1.4 timeouts
        time.sleep(1.4 * HealthConfig().timeout_s)
        os.kill(victim.pid, signal.SIGCONT)

    os.kill(victim.pid, signal.SIGSTOP)
    try:
        indices = list(range(6))
        results = load(pd, indices, concurrency=3, during=stall)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    check_answers(results, reference, indices)
    full_strength(pd, expected)
    after = replica(status(pd), "prefill-0")
    assert after.missed_checks == victim.missed_checks + 1, "the stall outlasted exactly one health check"
    assert (after.pid, after.incarnation) == (victim.pid, victim.incarnation)
    nothing_leaked(pd)


def test_killing_the_cpu_tier_store_under_load_loses_no_request(pd: Running, reference: dict) -> None:
    (store,) = pd.deployment.kv_stores.values()
    old, expected = ray.get(store.stats.remote()), restarts(pd)
    indices = list(range(24))
    results = load(pd, indices, concurrency=3, during=lambda: kill(old.pid), delay_s=0.3)
    check_answers(results, reference, indices)
    wait_until(lambda: getattr(_answer_or_none(store.stats), "incarnation", old.incarnation) != old.incarnation,
               RECOVERY_TIMEOUT_S, "the store restarted")
    full_strength(pd, expected)  # the engines never noticed
    nothing_leaked(pd)


def _answer_or_none(method: Any) -> Any:
    """An actor method's answer, or None while the actor is dead or restarting."""
    try:
        return ray.get(method.remote(), timeout=5)
    except (ray.exceptions.RayError, TimeoutError):
        return None


def test_killing_the_cpu_tier_index_under_load_loses_no_request_and_engines_reach_it_again(
    pd: Running, reference: dict
) -> None:
    """The index dies with engines' calls in flight on its channel; Ray restarts it on the same
    port and the engines' sockets reconnect by themselves: once its restart quarantine is
    over, the prefill engine's saves land in it again."""
    from actors.kv_index import RESTART_QUARANTINE_S

    index = pd.deployment.kv_index
    old, expected = ray.get(index.get_stats.remote()).pid, restarts(pd)
    indices = list(range(24))
    results = load(pd, indices, concurrency=3, during=lambda: kill(old), delay_s=0.3)
    check_answers(results, reference, indices)
    wait_until(lambda: getattr(_answer_or_none(index.get_stats), "pid", old) != old, RECOVERY_TIMEOUT_S, "the index restarted")
    full_strength(pd, expected)  # the engines never noticed
    fresh = iter(range(10_000))

    def saved_again() -> bool:
        n = next(fresh)
        tokens = [30 + (k * 11 + n) % 300 for k in range(300)]  # two full blocks, new each time
        body = {"model": MODEL, "prompt": tokens, "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"{pd.url}/completions", json=body, timeout=60).status_code == 200
        return ray.get(index.get_stats.remote(), timeout=10).num_saved_blocks > 0

    wait_until(saved_again, RESTART_QUARANTINE_S + 60, "the engines saved into the restarted index")
    nothing_leaked(pd)


def test_a_failed_kv_load_is_recomputed_never_returned_as_an_error(pd: Running, reference: dict) -> None:
    before = scrape(pd)

    async def main() -> tuple[Any, Any]:
        client = openai.AsyncOpenAI(base_url=pd.url, api_key="unused", max_retries=0, timeout=300)
        return (await _one(client, 3, stream=False, request_id=f"{KV_LOAD_FAILURE_MARK}-a"),
                await _one(client, 4, stream=True, request_id=f"{KV_LOAD_FAILURE_MARK}-b"))

    plain, streamed = asyncio.run(main())
    assert plain == reference[3] and streamed == reference[4]
    after = scrape(pd)
    assert metric(after, "tandem_kv_transfer_failures_total", pool="decode") >= metric(before, "tandem_kv_transfer_failures_total", pool="decode") + 2
    # The decode engine computed those prompts itself instead of loading them.
    computed = metric(after, "tandem_prompt_tokens_total", pool="decode", source="local_compute") - metric(
        before, "tandem_prompt_tokens_total", pool="decode", source="local_compute")
    assert computed >= len(prompt(3)) + len(prompt(4)) - 2
    # A pull that failed never tells the prefill side it is done (in a real failure it could
    # not): vLLM's 30-s lease frees those blocks.
    nothing_leaked(pd, within_s=45)


def test_clients_leaving_at_every_phase_are_aborted_everywhere_and_free_their_kv(pd: Running) -> None:
    before = scrape(pd)
    # Where a request is when its client leaves after these delays depends on the host's speed
    # (and on how soon the ingress notices): they cover the phases' edges. The held ones stay
    # in their prefill HOLD_S whatever the host, so some clients surely leave mid-prefill.
    delays = [0.0, 0.002, 0.01, 0.03, 0.06, 0.1, 0.15, 0.25, 0.4, 0.7]
    held = [0.1, 0.4]
    assert max(held) < HOLD_S / 2

    async def leave(i: int, delay: float, stream: bool, request_id: str | None = None) -> None:
        long_prompt = [20 + (k * 7 + i) % 400 for k in range(500)]  # its prefill takes a while
        body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": stream}
        headers = {"X-Request-Id": request_id} if request_id else None
        async with httpx.AsyncClient(timeout=60) as c:
            try:
                await asyncio.wait_for(c.post(f"{pd.url}/completions", json=body, headers=headers), delay or 0.0005)
            except asyncio.TimeoutError:
                pass

    async def leave_mid_stream(i: int) -> None:
        """Leave once a few tokens have streamed: in the decode phase whatever the host's speed."""
        body = {"model": MODEL, "prompt": [20 + (k * 5 + i) % 400 for k in range(200)], "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", f"{pd.url}/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    return

    async def main() -> None:
        for i, delay in enumerate(delays):
            await leave(i, delay, stream=i % 2 == 1)
        for i, delay in enumerate(held):
            await leave(len(delays) + i, delay, stream=i % 2 == 1, request_id=f"{HOLD_MARK}-leave-{i}")
        for i in range(2):
            await leave_mid_stream(i)

    asyncio.run(main())
    # Each abandoned request had 400 tokens to generate (seconds of work): none still runs.
    wait_until(lambda: metric(scrape(pd), "tandem_engine_running_requests") + metric(scrape(pd), "tandem_engine_waiting_requests") == 0,
               10, "the engines stopped every abandoned request")
    after = scrape(pd)
    aborted = {ph: metric(after, "tandem_requests_aborted_total", phase=ph) - metric(before, "tandem_requests_aborted_total", phase=ph)
               for ph in ("queued", "prefill", "handoff", "decode")}
    # A client gone within a few ms may never have reached the ingress (Serve's proxy drops
    # it); every one still there after 0.1 s was, and each was aborted, none ran to its end.
    assert len(delays) + len(held) + 2 >= sum(aborted.values()) >= sum(d >= 0.1 for d in delays) + len(held) + 2, aborted
    assert aborted["decode"] >= 2 and aborted["prefill"] + aborted["handoff"] >= len(held), aborted
    # A prefill that had just answered when its client left is not aborted on its engine but
    # released through the decode engine; every other abandoned request was aborted there.
    assert metric(after, "tandem_engine_requests_aborted_total") > metric(before, "tandem_engine_requests_aborted_total")
    nothing_leaked(pd)


def test_a_decode_cancelled_before_it_started_releases_the_prefills_blocks(pd: Running) -> None:
    """A client that leaves just as its decode request is sent: the router's abort (a Ray call)
    can reach the decode engine before the request does (the token path is another channel),
    and the prefill's blocks would stay held for NIXL's whole lease. The abort carries the
    prefill's answer; the decode engine, having never started that request, releases the
    blocks itself, and the request, when it arrives, does not run."""
    from vllm.sampling_params import SamplingParams

    from actors.protocol import EngineRequest
    from actors.stream import stream

    engines = pd.deployment.routing_engines()
    prefill = next(e for e in engines if e.role == "prefill")
    decode = next(e for e in engines if e.role == "decode")

    async def prefill_only() -> dict[str, Any]:
        req = EngineRequest("cancelled-before-start-p", [20 + k % 400 for k in range(300)],
                            SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True})
        chunks = [out async for out in stream(prefill.stream_address, req)]
        assert chunks[-1].kv_transfer_params, chunks[-1]
        return chunks[-1].kv_transfer_params

    kv_params = asyncio.run(prefill_only())
    assert ray.get(prefill.handle.get_stats.remote()).kv_cache_usage > 0, "the prefill holds its blocks for the decode"
    aborted = ray.get(decode.handle.get_stats.remote()).num_requests_aborted
    assert ray.get(decode.handle.abort.remote("cancelled-before-start-d", kv_params)) is None

    async def late_decode() -> list[Any]:
        req = EngineRequest("cancelled-before-start-d", [20 + k % 400 for k in range(300)],
                            SamplingParams(max_tokens=8, temperature=0), kv_params)
        return [out async for out in stream(decode.stream_address, req)]

    assert asyncio.run(late_decode()) == [], "a request aborted before it arrived must not run"
    # Counted where it was dropped, as an abort of a running request is.
    assert ray.get(decode.handle.get_stats.remote()).num_requests_aborted == aborted + 1
    nothing_leaked(pd)


def test_prefills_aborted_just_as_they_finish_hand_back_their_held_blocks(pd: Running) -> None:
    """A client that leaves just as its prefill finishes in the engine core, while the answer
    (kv_transfer_params) is still on its way to the engine's front end: vLLM's own abort drops
    that answer, and the blocks it names stay held for NIXL's whole lease. The abort must hand
    the answer back so that the router releases them through a decode engine. The aborts come
    the router's way (orchestrator.router.stream_engine), on a staircase around the moment a
    prefill's answer comes back from its abort: most land within a few ms of the window."""
    from vllm.sampling_params import SamplingParams

    from actors.protocol import EngineRequest
    from actors.stream import EngineStreams
    from orchestrator.router import stream_engine

    engines = pd.deployment.routing_engines()
    prefill = next(e for e in engines if e.role == "prefill")
    decode = next(e for e in engines if e.role == "decode")
    streams = EngineStreams()
    released: set[str] = set()

    def request(i: int) -> EngineRequest:  # a prompt of its own: no prefix cache hit shortens it
        return EngineRequest(f"abort-at-finish-{i}", [20 + (k * 3 + i) % 400 for k in range(300)],
                             SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True})

    async def release(kv_params: dict[str, Any]) -> None:
        """What the router does with a held answer: the decode engine tells the prefill it is done."""
        released.add(kv_params["remote_request_id"].rsplit("-", 1)[0])
        await decode.handle.release_remote_kv.remote(f"{kv_params['remote_request_id']}-release", kv_params)

    async def prefill_for(i: int, leave_after: float | None) -> bool:
        """Whether the prefill finished: its answer reached this consumer, or its abort gave it back."""
        async def consume() -> None:
            async with contextlib.aclosing(stream_engine(streams, prefill, request(i), release)) as outs:
                last = [out async for out in outs][-1]
            await release(last.kv_transfer_params)  # no decode will come for it either

        task = asyncio.create_task(consume())
        done, _ = await asyncio.wait([task], timeout=leave_after)
        if not done:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return request(i).request_id in released

    async def main() -> int:
        took = math.inf
        for i in range(5):
            start = time.perf_counter()
            assert await prefill_for(i, None)
            took = min(took, time.perf_counter() - start)
        # Leave sooner after each prefill that finished, later after each aborted in time.
        finished, leave_after = 0, took
        for i in range(5, 85):
            got = await prefill_for(i, leave_after)
            finished += got
            leave_after *= 0.97 if got else 1.03
        streams.close()
        return finished

    finished = asyncio.run(main())
    assert 0 < finished < 80, finished  # some were aborted in time, some had finished
    nothing_leaked(pd)


def test_the_decode_pool_grows_under_load_and_drains_before_it_shrinks(pd: Running, reference: dict) -> None:
    """8 requests at a time ask for two decode replicas (3 each at most); one at a time, for
    one. Requests keep flowing while the pool shrinks, so the drained replica has requests in
    flight when it leaves routing: none may be cut off.

    The load pauses for BREATH_S every LOAD_S, shorter than the downscale delay: on a 2-core
    host a load that never lets the cores idle starves the kernel's khugepaged (niceness 19),
    which holds the mutex that the new engine's start waits on (vLLM's NUMA memory binding,
    docs/performance.md), and the new replica then took over 10 minutes to start."""
    workers_wanted = 8
    results: list[Any] = []
    flowing = asyncio.Event()

    async def breathe() -> None:
        while True:
            flowing.set()
            await asyncio.sleep(LOAD_S)
            flowing.clear()
            await asyncio.sleep(BREATH_S)

    async def steady(client: openai.AsyncOpenAI, k: int) -> None:
        i = k
        while k < workers_wanted:
            await flowing.wait()
            try:
                results.append((i % 24, await _one(client, i % 24, stream=i % 2 == 0)))
            except Exception as err:  # counted below: no request may fail
                results.append((i % 24, err))
            i += 8

    def decode_replicas() -> list[Any]:
        return status(pd).pools[1].replicas

    async def until(predicate: Any, what: str, timeout_s: float = RECOVERY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(predicate):
            assert time.monotonic() < deadline, what
            await asyncio.sleep(1)

    async def main() -> float:
        nonlocal workers_wanted
        client = openai.AsyncOpenAI(base_url=pd.url, api_key="unused", max_retries=0, timeout=300)
        breathing = asyncio.ensure_future(breathe())
        workers = [asyncio.ensure_future(steady(client, k)) for k in range(8)]
        # The new engine starts on cores the loaded ones are computing on: on a 2-core CI host
        # its vLLM worker took 4 minutes just to import.
        await until(lambda: sum(r.state == "healthy" for r in decode_replicas()) == 2, "the decode pool grew under load",
                    2 * RECOVERY_TIMEOUT_S)
        await asyncio.sleep(5)  # the new replica takes part of the load
        served = metric(await asyncio.to_thread(scrape, pd), "tandem_engine_requests_finished_total", engine="decode-1")
        workers_wanted = 1  # the load drops to one request at a time, which keeps flowing
        await until(lambda: len(decode_replicas()) == 1, "the decode pool shrank back to one replica")
        workers_wanted = 0
        await asyncio.gather(*workers)
        breathing.cancel()
        return served

    served_by_new = asyncio.run(main())
    assert served_by_new > 0, "the added replica served requests"
    errors = [r for _, r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(r == reference[i] for i, r in results)
    check_answers(load(pd, [5, 6], concurrency=2), reference, [5, 6])
    nothing_leaked(pd)
