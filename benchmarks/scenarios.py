"""The deployments `tandem bench` compares, and bringing each one up and down.

A scenario is named on the command line: `colocated:N` (N engines that prefill and decode
themselves, behind the same router: the baseline), `<P>p<D>d` (P prefill and D decode engines,
KV moved by the configured connector), `vllm-server` (a plain `vllm.entrypoints.openai.
api_server` subprocess with the same model and engine args, to check that Tandem's colocated
figures match vLLM's own), `ray-serve-llm` (Ray Serve LLM's 1P1D with its defaults, the peer
Tandem's 1P1D is measured against: benchmarks/ray_serve_llm.py), or `fault:prefill` /
`fault:decode` (a 1P1D whose prefill or decode engine is SIGKILLed under load:
benchmarks/faults.py). Every Tandem scenario is the bench's
base config with only its pools replaced, so the model, engine args, connector settings and
core binding stay the same; a disaggregated one may also set its routing policy
(`2p1d@kv_aware`, `+conditional`) and any other `routing` field in brackets
(`3p1d@kv_aware[prefill_speed_samples=16,evict_cost=2]`), so that routing options are set
side by side in the same rounds rather than in runs minutes apart on a host whose speed drifts.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, get_args

import httpx
import msgspec
import psutil
import yaml

from actors.run_dir import shared_memory, unlink_shared_memory
from benchmarks import ray_serve_llm
from orchestrator.cluster import NAMESPACE, start_embedded_ray
from orchestrator.config import Policy, PoolConfig, TandemConfig, parse_config
from orchestrator.models import hub_env, resolve_local
from orchestrator.placement import omp_binding
from orchestrator.specs import local_engine_args

# "external": a server someone else runs (`tandem bench --target-url`), never parsed from a name.
ScenarioKind = Literal["colocated", "disaggregated", "vllm-server", "ray-serve-llm", "external"]
FaultRole = Literal["prefill", "decode"]

# On one machine the default also runs a plain vLLM server, the reference Tandem's colocated
# engine is compared with, and Ray Serve LLM's 1P1D, the peer its 1P1D is; on a cluster
# (--address) those would start on the bench's own host, which may have no accelerator, so
# they are left to --scenarios.
DEFAULT_SCENARIOS = "colocated:1,1p1d,vllm-server,ray-serve-llm"
DEFAULT_CLUSTER_SCENARIOS = "colocated:1,1p1d"

_COLOCATED = re.compile(r"^colocated(?::(?P<n>\d+))?$")
_XPYD = re.compile(r"^(?P<p>\d+)p(?P<d>\d+)d(?:@(?P<routing>[a-z_]+)(?P<conditional>\+conditional)?)?"
                   r"(?:\[(?P<overrides>[^\[\]]*)\])?$")
# Routing fields a scenario's brackets may not set: its name sets them (@<policy>, +conditional).
_NAMED_ROUTING = ("policy", "disaggregation")
POLICIES: tuple[str, ...] = get_args(Policy)
_FAULT = re.compile(r"^fault:(?P<role>prefill|decode)$")


class Scenario(msgspec.Struct, frozen=True):
    """One deployment to measure, as parsed from its name."""

    name: str  # as written on the command line, normalised: "colocated:1", "1p1d", "vllm-server"
    kind: ScenarioKind
    num_prefill: int = 0
    num_decode: int = 0  # decode engines, or colocated engines
    # fault:<role>: the role whose first engine is SIGKILLed under load (a disaggregated
    # scenario measured for detection and recovery, not swept); None for every other scenario.
    fault: FaultRole | None = None
    # <P>p<D>d@<policy>[+conditional]: the routing policy (and conditional disaggregation)
    # this deployment runs, so one bench compares policies side by side; None: the config's.
    policy: str | None = None
    conditional: bool = False
    # <P>p<D>d...[field=value,...]: other `routing` fields this deployment sets, in the order
    # written, each value as YAML reads it.
    routing: tuple[tuple[str, Any], ...] = ()

    @property
    def num_engines(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def is_tandem(self) -> bool:
        return self.kind in ("colocated", "disaggregated")


def parse_scenario(text: str) -> Scenario:
    """`colocated[:N]`, `<P>p<D>d`, `vllm-server`, `ray-serve-llm` or `fault:<prefill|decode>`
    (case-insensitive); ValueError otherwise."""
    name = text.strip().lower()
    if name == "vllm-server":
        return Scenario(name, "vllm-server", num_decode=1)
    if name == "ray-serve-llm":
        return Scenario(name, "ray-serve-llm", num_prefill=1, num_decode=1)
    if m := _COLOCATED.match(name):
        n = int(m["n"] or 1)
        if n < 1:
            raise ValueError(f"scenario {text!r}: a colocated pool needs at least 1 engine")
        return Scenario(f"colocated:{n}", "colocated", num_decode=n)
    if m := _XPYD.match(name):
        p, d = int(m["p"]), int(m["d"])
        if p < 1 or d < 1:
            raise ValueError(f"scenario {text!r}: disaggregated serving needs at least 1 prefill and 1 decode engine")
        if m["routing"] and m["routing"] not in POLICIES:
            raise ValueError(f"scenario {text!r}: unknown routing policy {m['routing']!r}; use one of {', '.join(POLICIES)}")
        routing = _routing_overrides(text, m["overrides"]) if m["overrides"] is not None else ()
        return Scenario(name, "disaggregated", num_prefill=p, num_decode=d, policy=m["routing"],
                        conditional=bool(m["conditional"]), routing=routing)
    if m := _FAULT.match(name):
        return Scenario(name, "disaggregated", num_prefill=1, num_decode=1, fault=m["role"])
    raise ValueError(f"unknown scenario {text!r}; use colocated[:N], <P>p<D>d[@<policy>[+conditional]][[<routing field>=<value>,...]] "
                     "(e.g. 1p1d, 2p1d@kv_aware+conditional, 3p1d@kv_aware[evict_cost=2]), vllm-server, ray-serve-llm, "
                     "fault:prefill or fault:decode")


def _routing_overrides(text: str, written: str) -> tuple[tuple[str, Any], ...]:
    """`field=value,...` from a scenario's brackets, each field checked as the config file's
    `routing` section would check it; ValueError naming the field and the fix otherwise."""
    pairs: list[tuple[str, Any]] = []
    for item in written.split(","):
        field, eq, value = item.partition("=")
        field = field.strip()
        if not eq or not field or not value.strip():
            raise ValueError(f"scenario {text!r}: {item.strip()!r} is not <routing field>=<value>; e.g. 3p1d@kv_aware[evict_cost=2]")
        if field in _NAMED_ROUTING:
            raise ValueError(f"scenario {text!r}: routing.{field} is set by the name (@<policy>, +conditional), not in brackets")
        if field in dict(pairs):
            raise ValueError(f"scenario {text!r}: routing.{field} given more than once")
        pairs.append((field, yaml.safe_load(value)))
    try:
        parse_config({"routing": dict(pairs)}, source=f"scenario {text.strip()!r}")
    except ValueError as err:
        raise ValueError(str(err)) from None
    return tuple(pairs)


def parse_scenarios(text: str) -> list[Scenario]:
    """A comma-separated list (commas inside a scenario's brackets do not count), in the
    order given, each name at most once."""
    scenarios = [parse_scenario(part) for part in re.split(r",(?![^\[\]]*\])", text) if part.strip()]
    if not scenarios:
        raise ValueError("no scenario given; e.g. --scenarios colocated:1,1p1d")
    names = [s.name for s in scenarios]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"scenario(s) {dupes} given more than once")
    return scenarios


def round_order(scenarios: list[Scenario], rounds: int) -> list[tuple[int, Scenario]]:
    """(round, scenario) in the order they run: every scenario once per round, every other
    round in reverse, so that a host slowing down or speeding up over the run weighs on the
    first and the last scenario alike."""
    return [(r, s) for r in range(rounds) for s in (scenarios if r % 2 == 0 else scenarios[::-1])]


def scenario_config(base: TandemConfig, scenario: Scenario, port: int, side_channel_base_port: int) -> TandemConfig:
    """The base config with the scenario's pools, served on `port` under the app name "bench".

    `vllm-server` gets the config of one colocated engine, which its command line is built from.
    Pools keep the base config's per-replica settings (CPUs, GPUs, TP, engine args): a
    colocated pool takes them from the base's colocated pool, else its decode pool; prefill
    and decode pools from their own, else the colocated one.
    """

    def pool(*templates: PoolConfig | None, replicas: int) -> PoolConfig:
        template = next((t for t in templates if t is not None), PoolConfig())
        return msgspec.structs.replace(template, replicas=replicas)

    serve = msgspec.structs.replace(base.serve, port=port, app_name="bench")
    routing = base.routing
    if scenario.policy is not None:
        routing = msgspec.structs.replace(routing, policy=scenario.policy,
                                          disaggregation="conditional" if scenario.conditional else "always")
    routing = msgspec.structs.replace(routing, **dict(scenario.routing))
    kv = msgspec.structs.replace(base.kv_transfer, side_channel_base_port=side_channel_base_port)
    if scenario.kind not in ("disaggregated", "ray-serve-llm"):
        pools: dict[str, PoolConfig | None] = {"colocated": pool(base.colocated, base.decode, replicas=scenario.num_decode), "prefill": None, "decode": None}
    else:
        pools = {
            "colocated": None,
            "prefill": pool(base.prefill, base.colocated, replicas=scenario.num_prefill),
            "decode": pool(base.decode, base.colocated, replicas=scenario.num_decode),
        }
    return msgspec.structs.replace(base, serve=serve, kv_transfer=kv, routing=routing, **pools)


# Ports handed to servers are picked from this band, below the kernel's ephemeral range: a port
# picked by binding port 0 comes from that range, where any outgoing connection (a deployment
# opens hundreds while it starts) may take it before the server binds it, which failed a bench
# here with "Address already in use". Ray's workers listen on 10002-19999 by default.
PORT_BAND = (20000, 32768)
_handed_out: set[int] = set()
_rng = random.Random()  # its own: code that seeds the global generator must not repeat our picks


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return PORT_BAND[1]


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive TCP ports, free on `host` now, outside the ephemeral
    range (PORT_BAND) and not handed out before by this process."""
    low, high = PORT_BAND[0], min(PORT_BAND[1], _ephemeral_low()) - count
    for _ in range(1000):
        first = _rng.randrange(low, high) if high > low else _rng.randrange(1024, 65536 - count)
        ports = range(first, first + count)
        if _handed_out.intersection(ports):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        _handed_out.update(ports)
        return first
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def cpus_needed(base: TandemConfig, scenarios: list[Scenario]) -> int:
    """The CPUs an embedded Ray must offer for the largest scenario's pools, plus one."""
    port, side = base.serve.port, base.kv_transfer.side_channel_base_port
    return int(max(sum(p.num_cpus * p.replicas for p in scenario_config(base, s, port, side).pools.values())
                   for s in scenarios)) + 1


@contextmanager
def shared_ray(base: TandemConfig, scenarios: list[Scenario], address: str | None) -> Iterator[None]:
    """One Ray for every scenario: joined at `address`, or embedded on loopback; reused if already up."""
    import ray
    from ray import serve

    if ray.is_initialized() or not any(s.is_tandem for s in scenarios):
        yield
        return
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    else:
        start_embedded_ray(max(os.cpu_count() or 1, cpus_needed(base, scenarios)), log_to_driver=False)
    try:
        yield
    finally:
        if not address:  # Serve on a shared cluster is not ours to stop; our app was deleted
            serve.shutdown()
        ray.shutdown()


class Target(msgspec.Struct, frozen=True):
    """A scenario that is up: where the load goes, and (Tandem only) what runs it."""

    base_url: str  # without /v1: the load generator adds /v1/completions, scrapes /metrics
    model: str
    startup_s: float
    deployment: Any = None  # orchestrator.deploy.Deployment for Tandem scenarios
    pid: int | None = None  # a plain vLLM server's process (its engine core is a child)
    # Whether base_url/metrics serves the engines' Prometheus samples (Ray Serve LLM's are
    # on a port of Ray's own).
    metrics: bool = True


@contextmanager
def deployed(scenario: Scenario, base: TandemConfig, port: int, log_dir: Path) -> Iterator[Target]:
    """Bring the scenario up on `port` (Ray already initialised for Tandem ones); always tear it down.

    Ray Serve keeps the HTTP port it was first started with, so every Tandem scenario of one
    bench must be given the same port; a plain vLLM server takes another free one, since Serve's
    proxy still holds `port` after the Tandem scenarios before it were torn down.
    """
    t0 = time.perf_counter()
    cfg = scenario_config(base, scenario, port if scenario.is_tandem else free_ports(1), free_ports(scenario.num_engines))
    if scenario.is_tandem:
        from orchestrator.job import running

        with running(cfg, own_ray=False) as up:
            yield Target(up.url.removesuffix("/v1"), cfg.model.name, time.perf_counter() - t0, up.deployment)
    elif scenario.kind == "ray-serve-llm":
        log = log_dir / "ray-serve-llm.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        url = f"http://127.0.0.1:{cfg.serve.port}"
        cmd = ray_serve_llm.server_command(cfg, cfg.serve.port, log.with_suffix(".json"))
        # Its models list answers once both engines and its ingress are up.
        with server_process(cmd, dict(os.environ), url, "/v1/models", log, 900.0, "Ray Serve LLM") as pid:
            yield Target(url, cfg.model.name, time.perf_counter() - t0, pid=pid, metrics=False)
    else:
        with vllm_server(cfg, log_dir / "vllm-server.log") as (url, pid):
            yield Target(url, cfg.model.name, time.perf_counter() - t0, pid=pid)


def vllm_server_command(cfg: TandemConfig, model_path: str) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` for a colocated config's one engine, with
    the front-end flags Tandem's ingress runs (orchestrator.openai_app.frontend_args) and the
    engine args Tandem's engines on this host get (orchestrator.specs.local_engine_args)."""
    if cfg.colocated is None:
        raise ValueError("a plain vLLM server stands for one colocated engine; build its config with scenario_config")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", cfg.model.name, "--host", "127.0.0.1", "--port", str(cfg.serve.port),
           "--enable-prompt-tokens-details", *cfg.serve.openai_args]
    if cfg.colocated.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(cfg.colocated.tensor_parallel_size)]
    for key, value in local_engine_args(cfg, "both").items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False:
            cmd.append("--no-" + key.replace("_", "-"))
        else:
            cmd += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return cmd


def vllm_server_env(cfg: TandemConfig) -> dict[str, str]:
    """The process settings a Tandem colocated engine alone on this host gets: KV cache size,
    and OpenMP on every core but the one left for the scheduler (placement.omp_binding; vLLM's
    own "auto" binding also keeps a core for its scheduler). With OpenMP on every core, the
    server would run one more compute thread than the engine it is compared with, sharing a
    core with its busy-waiting scheduler; on two cores that made it slower, not faster."""
    env = dict(os.environ) | hub_env(cfg.model.source)
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu.kvcache_space_gib)
        if cfg.cpu.bind_cores == "auto":
            tp = cfg.colocated.tensor_parallel_size if cfg.colocated is not None else 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_binding(sorted(os.sched_getaffinity(0)), tp)
    return env


@contextmanager
def vllm_server(cfg: TandemConfig, log_path: Path, timeout_s: float = 600.0) -> Iterator[tuple[str, int]]:
    """Run a plain vLLM OpenAI server on 127.0.0.1:<cfg.serve.port> until the block ends; yields its URL and pid.
    Its ipc sockets go to a directory of its own, removed after it: vLLM leaves seven in the
    temp dir at every stop."""
    url = f"http://127.0.0.1:{cfg.serve.port}"
    cmd = vllm_server_command(cfg, resolve_local(cfg.model.source))
    with tempfile.TemporaryDirectory(prefix="tandem-vllm-server-") as sockets:
        env = vllm_server_env(cfg) | {"VLLM_RPC_BASE_PATH": sockets}
        with server_process(cmd, env, url, "/health", log_path, timeout_s, "vllm api_server") as pid:
            yield url, pid


@contextmanager
def server_process(cmd: list[str], env: dict[str, str], url: str, ready_path: str, log_path: Path, timeout_s: float,
                   what: str) -> Iterator[int]:
    """Run `cmd` in a session of its own (so teardown reaches every process it starts) until
    GET url+ready_path answers 200; yield its pid; stop the whole session at the end."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while not _answers(url + ready_path):
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{what} exited with {proc.returncode} during start-up; log {log_path}:\n{tail}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s; see {log_path}")
                time.sleep(1.0)
            yield proc.pid
        finally:
            stop_group(proc)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def stop_group(proc: subprocess.Popen[bytes], linger_s: float = 30.0) -> None:
    """SIGTERM the process group of `proc` (started in a session of its own), SIGKILL it if it
    lingers; then wait up to `linger_s` for the rest of its session (a server's workers may
    outlive it by seconds, some in process groups of their own) and SIGKILL what is left.
    The files in /dev/shm its vLLM processes mapped go too: vLLM unlinks them only on a clean
    exit (a plain server's executor queues, 160-240 MiB each, were left by every killed one)."""
    shm = shared_memory(p.pid for p in _session_left(proc.pid))
    try:
        _stop_session(proc, linger_s)
    finally:
        unlink_shared_memory(shm)


def _stop_session(proc: subprocess.Popen[bytes], linger_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + linger_s
    while _session_left(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    for left in _session_left(proc.pid):
        try:
            left.kill()
        except psutil.NoSuchProcess:
            pass


def _session_left(sid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of session `sid`."""
    left = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return left
