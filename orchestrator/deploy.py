"""Bringing a deployment up and down: placement groups, engine pools, handshakes, teardown.

Order of start-up: reserve one placement group per replica (fails fast with what the
cluster lacks), probe the chosen nodes, give every engine its side channel and cores,
start all engines in parallel, pre-warm every prefill->decode handshake, then report.
Teardown reverses it and never leaves an engine process behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from actors.engine import EngineActor, EngineSpec
from actors.kv_index import KVIndexActor
from actors.kv_store import KVStoreActor, TierSettings, index_actor_name, store_actor_name
from actors.protocol import EngineInfo, Role, SamplingOptions
from orchestrator.cluster import WORKER_NICENESS
from orchestrator.config import TandemConfig
from orchestrator.models import hub_env
from orchestrator.placement import EngineSlot, assign_slots
from orchestrator.router import EngineRef, RequestTrace, Router

logger = logging.getLogger("tandem.deploy")

KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


class DeployError(RuntimeError):
    """The deployment could not start; the message says which part and why."""


def kv_transfer_for(cfg: TandemConfig, role: Role, tier: TierSettings | None = None) -> dict[str, Any] | None:
    """The vLLM kv_transfer_config of an engine in `role` (None: no connector).

    With the CPU tier enabled, the engine runs TandemMultiConnector with children
    [P/D connector (disaggregated only), CPU tier connector]. `tier` is the engine's tier
    settings (its node's store); None leaves the tier child's extra config empty, which is
    enough for validation (orchestrator.preflight) but not for an engine.
    """
    kv = cfg.kv_transfer
    children: list[dict[str, Any]] = []
    if cfg.disaggregated:
        from connectors.registry import tandem_module_path

        pd: dict[str, Any] = {
            "kv_connector": kv.connector,
            "kv_role": KV_ROLES[role],
            "kv_buffer_device": kv.buffer_device,
            "kv_connector_extra_config": dict(kv.extra_config),
        }
        module_path = kv.module_path or tandem_module_path(kv.connector)
        if module_path is not None:
            pd["kv_connector_module_path"] = module_path
        if module_path == "connectors.nixl":
            pd["kv_connector_extra_config"].setdefault("tandem_nixl", msgspec.to_builtins(kv.nixl))
        children.append(pd)
    if cfg.cpu_tier.enabled:
        children.append({
            "kv_connector": "TandemCpuTierConnector",
            "kv_connector_module_path": "connectors.offload",
            "kv_role": "kv_both",
            "kv_connector_extra_config": msgspec.to_builtins(tier) if tier is not None else {},
        })
    if not cfg.cpu_tier.enabled:
        return children[0] if children else None
    # Even a lone tier child runs under the multi connector, which counts hits and fallbacks.
    return {
        "kv_connector": "TandemMultiConnector",
        "kv_connector_module_path": "connectors.multi",
        "kv_role": KV_ROLES[role],
        "kv_buffer_device": kv.buffer_device,
        # A failed load (a dead store, a lost block) recomputes instead of failing the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": children},
    }


def engine_env(cfg: TandemConfig, slot: EngineSlot) -> dict[str, str]:
    """The engine process's environment: what vLLM only reads from env vars."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": slot.node_ip,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(slot.side_channel_port),
    }
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu.kvcache_space_gib)
        if slot.cpu_binding is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = slot.cpu_binding
    env.update(hub_env(cfg.model.source))
    if cfg.disaggregated:
        env.update(cfg.kv_transfer.nixl.ucx_env)
    return env


def niceness_warning(infos: Sequence[EngineInfo]) -> str | None:
    """What to tell the operator when engines run at a lower priority than Tandem's embedded
    Ray gives them (orchestrator/cluster.py); None when none does."""
    lowered = [i for i in infos if i.niceness > WORKER_NICENESS]
    if not lowered:
        return None
    return (
        f"engines {[i.engine_id for i in lowered]} run at niceness {max(i.niceness for i in lowered)} "
        "(Ray's default for worker processes is 15), so any busy process on their hosts takes CPU time from "
        f"their schedulers and forward passes. Start the cluster with RAY_worker_niceness={WORKER_NICENESS} "
        "in the environment of `ray start`, as Tandem's embedded Ray does"
    )


class Deployment:
    """The engine pools of one config on a Ray cluster (Ray must already be initialised)."""

    def __init__(self, cfg: TandemConfig) -> None:
        self.cfg = cfg
        self.engines: list[EngineRef] = []
        self.infos: list[EngineInfo] = []
        self._pgs: list[PlacementGroup] = []
        # CPU tier actors (cfg.cpu_tier.enabled): the index, and a store per engine node.
        self.kv_index: Any = None
        self.kv_stores: dict[str, Any] = {}

    def start(self, timeout_s: float = 900.0) -> list[EngineRef]:
        """Start every pool and pre-warm handshakes; on any failure, tear down and raise."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.engines

    def _start(self, timeout_s: float) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        replicas: list[tuple[Role, int]] = [
            (role, i) for role, pool in cfg.pools.items() for i in range(pool.replicas)  # type: ignore[misc]
        ]
        for role, i in replicas:
            pool = cfg.pools[role]
            bundle = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
            bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
            self._pgs.append(placement_group([bundle], strategy="STRICT_PACK", name=f"{cfg.serve.app_name}-{role}-{i}"))
        self._wait_for_placement(replicas, timeout_s=120.0)
        nodes = [placement_group_table(pg)["bundles_to_node_id"][0] for pg in self._pgs]
        slots = assign_slots(
            nodes,
            [cfg.pools[r].tensor_parallel_size for r, _ in replicas],
            cfg.kv_transfer.side_channel_base_port,
            bind_cores=cfg.device == "cpu" and cfg.cpu.bind_cores == "auto",
            model_source=cfg.model.source,
        )
        if cfg.cpu_tier.enabled:
            self._start_cpu_tier(sorted(set(nodes)))
        handles = []
        for (role, i), pg, slot in zip(replicas, self._pgs, slots):
            pool = cfg.pools[role]
            engine_args = cfg.engine_args_for(role)
            kv_transfer = kv_transfer_for(cfg, role, self._tier_settings(role, slot.node_id))
            if cfg.cpu_tier.enabled:
                # The tier connector handles one KV cache group (no hybrid KV cache manager).
                engine_args = {**engine_args, "disable_hybrid_kv_cache_manager": True}
            spec = EngineSpec(
                engine_id=f"{role}-{i}",
                role=role,
                model_path=slot.model_path,
                served_name=cfg.model.name,
                engine_args=engine_args,
                tensor_parallel_size=pool.tensor_parallel_size,
                kv_transfer=kv_transfer,
                cores=slot.cores,
                slow_transfer_s=cfg.kv_transfer.slow_transfer_s,
            )
            handle = EngineActor.options(
                name=f"{cfg.serve.app_name}:{spec.engine_id}",
                num_cpus=pool.num_cpus,
                num_gpus=pool.num_gpus,
                resources=dict(pool.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
                runtime_env={"env_vars": engine_env(cfg, slot)},
            ).remote(spec)
            handles.append(handle)
            self.engines.append(EngineRef(spec.engine_id, role, handle))
            logger.info(
                "starting engine %s on node %s (side channel %s:%d, cores %s)",
                spec.engine_id, slot.node_ip, slot.node_ip, slot.side_channel_port, slot.cpu_binding or "unbound",
            )
        self.infos = self._wait_for_engines(handles, timeout_s)
        logger.info("%d engines up in %.1f s", len(self.engines), time.perf_counter() - t0)
        if warning := niceness_warning(self.infos):
            logger.warning(warning)
        if cfg.disaggregated and cfg.kv_transfer.prewarm_handshakes:
            asyncio.run(self.prewarm())

    def _start_cpu_tier(self, node_ids: list[str]) -> None:
        """Start the tier's index and one store per engine node, and wait until every store
        has registered its pool, so the engines' first saves find them."""
        tier, app = self.cfg.cpu_tier, self.cfg.serve.app_name
        self.kv_index = KVIndexActor.options(name=index_actor_name(app)).remote()
        namespace = ray.get_runtime_context().namespace
        for node_id in node_ids:
            self.kv_stores[node_id] = KVStoreActor.options(
                name=store_actor_name(app, node_id),
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(node_id[:12], int(tier.size_gib * 2**30), index_actor_name(app), namespace)
        try:
            ray.get([s.info.remote() for s in self.kv_stores.values()], timeout=600)
        except Exception as err:
            raise DeployError(
                f"CPU tier stores did not start ({err}); check that each node has "
                f"{tier.size_gib} GiB of free host memory (cpu_tier.size_gib) and that nixl is installed"
            ) from err
        logger.info("CPU tier up: %d store(s) of %.2f GiB", len(self.kv_stores), tier.size_gib)

    def _tier_settings(self, role: Role, node_id: str) -> TierSettings | None:
        tier = self.cfg.cpu_tier
        if not tier.enabled:
            return None
        return TierSettings(
            ray_address=ray.get_runtime_context().gcs_address,
            namespace=ray.get_runtime_context().namespace,
            index_actor=index_actor_name(self.cfg.serve.app_name),
            store_id=node_id[:12] if role in tier.save_from else None,
            load=role in tier.load_into,
        )

    def _wait_for_placement(self, replicas: list[tuple[Role, int]], timeout_s: float) -> None:
        ready, _ = ray.wait([pg.ready() for pg in self._pgs], num_returns=len(self._pgs), timeout=timeout_s)
        if len(ready) < len(self._pgs):
            missing = [f"{r}-{i}" for (r, i), pg in zip(replicas, self._pgs) if pg.ready() not in ready]
            raise DeployError(
                f"could not reserve resources for engines {missing} within {timeout_s:.0f} s; the cluster has "
                f"{ray.available_resources()} available. Fix: lower num_cpus/num_gpus per replica or the "
                "replica counts, or add nodes"
            )

    def _wait_for_engines(self, handles: list[Any], timeout_s: float) -> list[EngineInfo]:
        refs = [h.start.remote() for h in handles]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            slow = [e.engine_id for e, r in zip(self.engines, refs) if r in pending]
            raise DeployError(f"engines {slow} did not start within {timeout_s:.0f} s; see their logs above")
        infos = []
        for engine, ref in zip(self.engines, refs):
            try:
                infos.append(ray.get(ref))
            except Exception as err:
                raise DeployError(f"engine {engine.engine_id} failed to start: {err}") from err
        return infos

    async def prewarm(self) -> None:
        """Send one request through every prefill->decode pair so the NIXL handshakes (seconds
        each) happen now, not on a user's first request."""
        router = Router(self.engines, "round_robin")
        info = {i.engine_id: i for i in self.infos}
        t0 = time.perf_counter()
        for p in router.pools["prefill"].engines:
            for d in router.pools["decode"].engines:
                # Long enough to fill at least one KV block, so real bytes move.
                n = min(info[p.engine_id].block_size + 1, info[p.engine_id].max_model_len - 2)
                trace = RequestTrace()
                async for _ in router.generate(
                    f"prewarm-{p.engine_id}-{d.engine_id}",
                    list(range(10, 10 + n)),
                    SamplingOptions(max_tokens=1, temperature=0.0),
                    trace,
                    prefill_engine=p,
                    decode_engine=d,
                ):
                    pass
                if trace.fallback:
                    raise DeployError(
                        f"handshake pre-warm {p.engine_id} -> {d.engine_id} failed ({trace.fallback}); "
                        "check the kv_transfer settings and that the side-channel ports are reachable between nodes"
                    )
        logger.info("pre-warmed %d prefill->decode handshakes in %.1f s",
                    len(router.pools["prefill"].engines) * len(router.pools["decode"].engines),
                    time.perf_counter() - t0)

    def stop(self) -> None:
        """Stop engines (their vLLM engine-core processes first), then free the reservations."""
        if self.engines:
            shutdowns = [e.handle.shutdown.remote() for e in self.engines]
            ray.wait(shutdowns, num_returns=len(shutdowns), timeout=60)
            for e in self.engines:
                ray.kill(e.handle, no_restart=True)
            logger.info("stopped %d engines", len(self.engines))
        for actor in [*self.kv_stores.values(), self.kv_index]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self.kv_index is not None:
            logger.info("stopped the CPU tier (%d stores)", len(self.kv_stores))
        for pg in self._pgs:
            remove_placement_group(pg)
        self.engines, self.infos, self._pgs = [], [], []
        self.kv_index, self.kv_stores = None, {}
