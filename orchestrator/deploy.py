"""Bringing a deployment up and down, from the driver.

Start-up: the pool manager actor (orchestrator.pools) reserves one placement group per
replica (failing fast with what the cluster lacks), probes the chosen nodes, gives every
engine its side channel and cores, starts the CPU tier and every engine in parallel,
pre-warms every prefill->decode handshake, and from then on keeps the pools healthy.
Teardown asks it to stop everything, then removes it: no engine process is left behind.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from actors.affinity import node_cores
from actors.engine import EngineActor
from actors.protocol import EngineInfo
from orchestrator.cluster import NAMESPACE, confine_own_ray, own_ray_processes
from orchestrator.config import TandemConfig, to_dict
from orchestrator.placement import ON_HEAD_NODE, binding_cores, control_cores
from orchestrator.pools import DeployError, PoolManager, manager_name
from orchestrator.protocol import DeploymentStatus, EngineRef, ReplicaStatus

logger = logging.getLogger("tandem.deploy")

__all__ = ["DeployError", "Deployment", "keep_own_ray_off_engines"]

# The engine actor's class, as Ray's process titles name it: confinement leaves its
# processes, even while one starts and no table lists it.
ENGINE_CLASS = EngineActor.__ray_metadata__.class_name
# Stopping waits this long for the manager to stop the engines before killing it anyway.
STOP_TIMEOUT_S = 180.0


class Deployment:
    """The engine pools of one config on a Ray cluster (Ray must already be initialised)."""

    def __init__(self, cfg: TandemConfig) -> None:
        self.cfg = cfg
        self.manager: Any = None
        # The engines serving when start() returned, and their facts (the live set is the
        # manager's routing table).
        self.engines: list[EngineRef] = []
        self.infos: list[EngineInfo] = []

    def start(self, timeout_s: float = 900.0) -> list[EngineRef]:
        """Start every pool and pre-warm handshakes; on any failure, tear down and raise."""
        self.manager = PoolManager.options(  # type: ignore[attr-defined]
            name=manager_name(self.cfg.serve.app_name), resources=ON_HEAD_NODE).remote(to_dict(self.cfg))
        try:
            self.infos = ray.get(self.manager.start.remote(timeout_s))
            self.engines = ray.get(self.manager.routing_table.remote(-1, 0)).engines
        except RayTaskError as err:
            self.stop()
            if isinstance(err.cause, DeployError):
                raise DeployError(str(err.cause)) from None
            raise
        except BaseException:
            self.stop()
            raise
        return self.engines

    def status(self) -> DeploymentStatus:
        return ray.get(self.manager.status.remote(), timeout=60)

    def routing_engines(self) -> list[EngineRef]:
        """The engines in routing now."""
        return ray.get(self.manager.routing_table.remote(-1, 0), timeout=60).engines

    @property
    def kv_index(self) -> Any:
        return ray.get(self.manager.tier_actors.remote(), timeout=60)[0]

    @property
    def kv_stores(self) -> dict[str, Any]:
        return ray.get(self.manager.tier_actors.remote(), timeout=60)[1]

    def stop(self) -> None:
        """Stop engines (their vLLM engine-core processes first), free the reservations, stop the tier."""
        if self.manager is None:
            return
        try:
            ray.get(self.manager.stop.remote(), timeout=STOP_TIMEOUT_S)
        except (RayError, TimeoutError) as err:
            logger.warning("the pool manager did not stop every engine cleanly (%s); killing it, which ends them", err)
        ray.kill(self.manager, no_restart=True)
        self.manager = None
        self.engines, self.infos = [], []


def keep_own_ray_off_engines(leaving: str | None = None) -> list[int] | None:
    """Run the processes of the Ray this driver started, engines aside (Ray's daemons,
    Serve's proxy and controller, the ingress, the pool managers, the CPU tier), on the
    cores `placement.control_cores` picks beside the engines of every live Tandem deployment
    on it (but `leaving`, an app being torn down); back on the node's cores when no
    deployment is left. Returns the cores they were given, None where nothing was done: the
    driver joined a cluster started elsewhere, or a deployment did not say where its engines
    run. (On a cluster, `taskset` at `ray start` does the same; see NODE_CORES_ENV.)

    On a small host these processes would otherwise take turns on the decode engines' cores
    with every decode step (docs/performance.md, "A client in another session of the same
    host").
    """
    if not own_ray_processes():
        return None
    suffix = manager_name("")  # every deployment's pool manager is "<app>:pools"
    engines: list[tuple[str, ReplicaStatus]] = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if actor["namespace"] != NAMESPACE or not name.endswith(suffix) or name == manager_name(leaving or ""):
            continue
        try:
            status = ray.get(ray.get_actor(name, namespace=NAMESPACE).status.remote(), timeout=60)
        except (RayError, ValueError, TimeoutError) as err:
            logger.warning("left Ray's processes where they run: deployment %s did not say where its engines run (%s)",
                           name.removesuffix(suffix), err)
            return None
        # A replica restarting counts where it will run again.
        engines += [(pool.role, r) for pool in status.pools for r in pool.replicas]
    node = node_cores()
    cores = control_cores(node, [(role, r.cpu_binding) for role, r in engines])
    n = confine_own_ray(cores or node, keep={r.pid for _, r in engines if r.pid is not None}, keep_classes=(ENGINE_CLASS,))
    if cores:
        streaming = sorted({c for role, r in engines if role != "prefill" and r.cpu_binding for c in binding_cores(r.cpu_binding)})
        logger.info("Ray's own processes (%d: its daemons, Serve, the ingress, the pool managers, the CPU tier) now run "
                    "on cores %s of the node's %s, off the cores decode steps run on (%s)", n, cores, node, streaming)
    else:
        logger.info("Ray's own processes (%d) run on any of the node's cores %s", n, node)
    return cores or node
