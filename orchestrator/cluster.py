"""Joining a Ray cluster, or starting an embedded one for a single machine."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import ray

from actors.affinity import NODE_CORES_ENV, pin_process
from orchestrator.config import TandemConfig

logger = logging.getLogger("tandem.cluster")

# Ray starts its worker processes at niceness 15, to keep its own daemons responsive. Engines
# are workers: at 15, any busy process at 0 on their host (a load generator, a sidecar, Ray's
# daemons) takes CPU time from their schedulers and forward passes, where a vLLM server
# started by hand runs at 0. On a 2-core host a decode step took 8.0 ms at 15 against 6.6 ms
# at 0 (mean of five paired runs). Tandem's embedded Ray starts every worker (engines, Serve's
# proxy and the ingress alike) at 0; on a cluster, `RAY_worker_niceness=0 ray start ...`.
WORKER_NICENESS = 0
# How long a caller waits for the cause of an actor's death before failing its pending calls
# (Ray's default: 1000 ms). The pool manager learns an engine died from a pending call
# failing, so this bounds detection: measured here 1.2-1.4 s after `kill -9` at Ray's
# default, 0.12-0.31 s at 100 ms. On a cluster: `RAY_timeout_ms_task_wait_for_death_info=100
# ray start ...` on every node.
DEATH_INFO_WAIT_MS = 100
# Tandem's named actors (the pool manager, the CPU tier) live in this Ray namespace, so
# `tandem status` and the Serve ingress find them from any driver.
NAMESPACE = "tandem"
# How long a GCS address may take to accept a TCP connection before Tandem gives up on it.
GCS_PROBE_TIMEOUT_S = 5.0


def start_embedded_ray(num_cpus: int, **kwargs: Any) -> None:
    """A new single-machine Ray on the loopback address, workers at WORKER_NICENESS, failing
    calls to a dead actor after DEATH_INFO_WAIT_MS.

    address="local": always a new instance, never a `ray start` cluster that happens to run
    here. Ray 2.60 resolves the loopback address to the machine's own interface. Its
    processes inherit NODE_CORES_ENV, this process's cores, so that engines are still given
    the node's cores once `confine_own_ray` has narrowed Ray's own processes' masks.
    """
    os.environ.setdefault(NODE_CORES_ENV, ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    ray.init(
        address="local",
        num_cpus=num_cpus,
        namespace=NAMESPACE,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _system_config={"worker_niceness": WORKER_NICENESS, "timeout_ms_task_wait_for_death_info": DEATH_INFO_WAIT_MS},
        **kwargs,
    )


def join_ray(address: str, **kwargs: Any) -> None:
    """ray.init() into the running cluster at `address`, with Ray's token when it runs here.

    Ray (2.52 on) turns token authentication on for every cluster a plain ``ray.init()``
    starts, Tandem's embedded one included, keeps the token in ~/.ray/auth_token, and sets
    ``RAY_AUTH_MODE=token`` only in that process and its children. A driver from another
    shell sends the token to a cluster Ray finds itself (``auto``) but never to one named by
    address, so ``tandem status --address`` against a deployment on this very host was
    refused ("InvalidAuthToken") and reported as no cluster. A cluster whose GCS runs on this
    host is the one ``auto`` would find: do what Ray does for it. A cluster elsewhere keeps
    Ray's rule (the operator sets ``RAY_AUTH_MODE=token``), and its refusal says so. An
    address where nothing listens fails at once (``_probe_gcs``) instead of after Ray's retries.
    """
    from ray._private.authentication.authentication_token_setup import (
        AUTH_MODE_ENV_VAR,
        maybe_enable_token_auth_if_token_available,
    )
    from ray._private.services import canonicalize_bootstrap_address, find_gcs_addresses

    canonical = address  # a Ray Client address (ray://) and "local" (a new Ray) are Ray's to resolve
    if "://" not in address:
        try:  # localhost or a host name as Ray's processes give it (the node's IP); "auto" resolved
            resolved = canonicalize_bootstrap_address(address)
        except ValueError:
            raise ConnectionError(f"{address!r} is not a Ray cluster address: give HOST:PORT of its GCS, or auto") from None
        except ConnectionError as err:  # "auto" with no cluster to find
            raise ConnectionError(f"no Ray cluster found for {address!r}: {err}") from None
        if resolved is not None:
            canonical = resolved
            _probe_gcs(canonical, address)
    here = canonical in find_gcs_addresses()
    if AUTH_MODE_ENV_VAR not in os.environ and here:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as err:
        # "auto" and a cluster on this host get the token as above, if there is one.
        sent_token = address == "auto" or here or os.environ.get(AUTH_MODE_ENV_VAR, "").lower() == "token"
        hint = "" if sent_token else (
            f"; if that cluster uses Ray's token authentication, set {AUTH_MODE_ENV_VAR}=token and give "
            "its token (its ~/.ray/auth_token, or RAY_AUTH_TOKEN)"
        )
        raise ConnectionError(f"no Ray cluster accepted a connection at {address!r} ({err}){hint}") from None


def _probe_gcs(canonical: str, given: str, timeout_s: float = GCS_PROBE_TIMEOUT_S) -> None:
    """Fail at once, naming the address, when nothing accepts a TCP connection at `canonical`
    (`given` in Ray's canonical form): Ray's own connect retries a dead GCS address for 40 s
    to several minutes before it gives up."""
    host, _, port = canonical.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as err:
        where = "" if given == canonical else f" ({canonical})"
        if given == "auto":
            where = f" ({canonical}: RAY_ADDRESS, or the cluster `ray start` last started on this host)"
        raise ConnectionError(
            f"nothing accepts connections at {given!r}{where} ({err}): no Ray cluster's GCS listens there"
        ) from None


def init_ray(cfg: TandemConfig, address: str | None) -> bool:
    """Join `address` (or RAY_ADDRESS), else start an embedded single-machine Ray; True if embedded."""
    if address or os.environ.get("RAY_ADDRESS"):
        join_ray(address or os.environ["RAY_ADDRESS"], namespace=NAMESPACE, log_to_driver=True)
        return False
    need = sum(p.num_cpus * p.replicas for p in cfg.pools.values())
    # Logical CPUs cover every engine, whatever the machine has.
    start_embedded_ray(max(os.cpu_count() or 1, int(need) + 1))
    return True


def lower_session_priority(nice: int) -> int | None:
    """Give this process's session (every process it and the embedded Ray start) the
    scheduling group nice value `nice`, where the kernel groups a session's processes
    (autogroup); returns the value it had, or None where nothing changed (no autogroup, or
    already that nice or higher).

    A deployment's processes then run before other sessions' only where those leave a core
    idle: a client from another shell, which waited up to 0.1-1.7 s for a core behind the
    engines' spinning workers at equal weight, saw TTFT p99 at 26-44 ms at 5 or 10
    (docs/performance.md, "A client in another session of the same host").
    """
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            enabled = f.read().strip() == "1"
        with open("/proc/self/autogroup") as f:
            previous = int(f.read().split()[-1])  # "/autogroup-175 nice 0"
    except (OSError, ValueError, IndexError):
        return None
    if not enabled or previous >= nice:
        return None
    return previous if _set_session_nice(nice) else None


@contextmanager
def session_priority(nice: int) -> Iterator[None]:
    """`lower_session_priority(nice)` for the block, then the session's own value back: the
    session (the user's shell, often) outlives the deployment."""
    previous = lower_session_priority(nice)
    try:
        yield
    finally:
        if previous is not None:
            _set_session_nice(previous)


def _set_session_nice(nice: int) -> bool:
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError as err:
        logger.warning("could not set this session's scheduling nice value to %d (%s); it keeps its own", nice, err)
        return False
    return True


def own_ray_processes() -> list[psutil.Process]:
    """The processes of the Ray this driver started (its daemons, their workers and everything
    those started), found as this process's children that run Ray's own programs and their
    descendants; none when the driver joined a cluster started elsewhere."""
    ray_dir = os.path.dirname(ray.__file__) + os.sep
    tops: list[psutil.Process] = []
    for child in psutil.Process().children():
        try:
            if any(arg.startswith(ray_dir) for arg in child.cmdline()):
                tops.append(child)
        except psutil.Error:  # ended, or not ours to read
            continue
    return tops


def serves_actor(proc: psutil.Process, classes: Collection[str]) -> bool:
    """Whether `proc` is a Ray worker serving an actor of one of `classes`, from the title
    Ray gives it: `ray::Class`, `ray::Class.method`, `ray::name:Class.__init__` while a
    named actor starts (`ray::IDLE` for an idle worker)."""
    title = " ".join(proc.cmdline()).strip()
    if not title.startswith("ray::"):
        return False
    head = title.removeprefix("ray::").split(" ", 1)[0].split(".", 1)[0]
    return any(head == c or head.endswith(f":{c}") for c in classes)


def confine_own_ray(cores: list[int], keep: set[int], keep_classes: Collection[str] = ()) -> int:
    """Confine every process of the Ray this driver started to `cores`, except the trees
    rooted at the pids in `keep` or at a worker serving an actor of `keep_classes`: engines,
    which place their own processes, including one still starting whose pid no table lists
    yet. Returns how many processes were confined.

    Workers Ray starts later (a restarted replica, a new ingress) inherit the raylet's mask.
    """
    confined = 0
    todo = own_ray_processes()
    while todo:
        proc = todo.pop()
        try:
            if proc.pid in keep or serves_actor(proc, keep_classes):
                continue
            todo.extend(proc.children())
        except psutil.Error:
            continue
        confined += pin_process(proc.pid, cores)
    return confined
