"""What each engine is told: its vLLM engine args, KV-connector config, environment and
placement resources, derived from the config and the slot placement gave it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from actors import affinity
from actors.engine import EngineSpec
from actors.nixl_agent import GPU_UCX_ENV
from actors.kv_store import TierSettings
from actors.protocol import EngineInfo, Role
from connectors.config import TANDEM_CONNECTORS
from orchestrator.cluster import WORKER_NICENESS
from orchestrator.config import TandemConfig
from orchestrator.models import hub_env
from orchestrator.placement import EngineSlot

KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


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
        pd: dict[str, Any] = {
            "kv_connector": kv.connector,
            "kv_role": KV_ROLES[role],
            "kv_buffer_device": kv.buffer_device,
            "kv_connector_extra_config": dict(kv.extra_config),
        }
        module_path = kv.module_path or TANDEM_CONNECTORS.get(kv.connector)
        if module_path is not None:
            pd["kv_connector_module_path"] = module_path
        if module_path == TANDEM_CONNECTORS["TandemNixlConnector"]:
            pd["kv_connector_extra_config"].setdefault("tandem_nixl", msgspec.to_builtins(kv.nixl))
        children.append(pd)
    if cfg.cpu_tier.enabled:
        children.append({
            "kv_connector": cfg.cpu_tier.connector,
            "kv_connector_module_path": cfg.cpu_tier.module_path,
            "kv_role": "kv_both",
            "kv_connector_extra_config": msgspec.to_builtins(tier) if tier is not None else {},
        })
    if not cfg.cpu_tier.enabled:
        # A failed KV pull recomputes the prompt on the decode engine instead of ending the
        # request with finish_reason "error" (vLLM's default policy is "fail").
        return {**children[0], "kv_load_failure_policy": "recompute"} if children else None
    # Even a lone tier child runs under the multi connector, which counts hits and fallbacks.
    return {
        "kv_connector": "TandemMultiConnector",
        "kv_connector_module_path": TANDEM_CONNECTORS["TandemMultiConnector"],
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
        if cfg.device == "cuda":  # under the operator's ucx_env, which wins
            env.update(GPU_UCX_ENV)
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


def dtype_warning(infos: Sequence[EngineInfo]) -> str | None:
    """What to tell the operator when CPU engines serve a half-precision dtype their hosts
    compute without native instructions (EngineInfo.emulated_dtype); None when none does."""
    slow = [i for i in infos if i.emulated_dtype]
    if not slow:
        return None
    return (
        f"engines {[i.engine_id for i in slow]} serve {slow[0].dtype} on CPUs without AVX-512, which compute it "
        "without native instructions: matmuls there ran about 100x slower than in float32 (an AVX2-only EPYC: "
        "0.5 against 67 GFLOP/s), and every step with them. Set `engine_args: {dtype: float32}` (the KV cache "
        "then takes twice the bytes per block), or serve on hosts with AVX-512"
    )


def native_engine_args(engine_args: dict[str, Any], lacks_half_precision: bool) -> dict[str, Any]:
    """`engine_args` with `dtype: float32` where they name no dtype ("auto" included) and the
    deployment's CPU engines run where some node lacks native half precision
    (actors.affinity.lacks_half_precision), since a model's own dtype is most often a half
    one; as they are otherwise. The float32 goes to every engine of the deployment, so that
    their KV bytes match (NIXL, the CPU tier); a dtype the config names is served as named,
    with dtype_warning where its hosts emulate it."""
    if not lacks_half_precision or engine_args.get("dtype", "auto") != "auto":
        return engine_args
    return {**engine_args, "dtype": "float32"}


def local_engine_args(cfg: TandemConfig, role: Role) -> dict[str, Any]:
    """Pool `role`'s engine args for an engine started on this host outside a deployment (the
    benchmark's plain vLLM server and Ray Serve LLM), with the dtype a deployment here gives."""
    return native_engine_args(cfg.engine_args_for(role), cfg.device == "cpu" and affinity.lacks_half_precision())


def float32_notice(nodes: Sequence[str]) -> str:
    """What to tell the operator when native_engine_args gave the engines float32."""
    return (f"engines serve float32: the config names no dtype and the CPUs of nodes {list(nodes)} lack AVX-512, "
            "where half precision runs about 100x slower (every engine gets it, so that KV bytes match between "
            "them); the KV cache takes twice the bytes a block of bfloat16's. Name `engine_args.dtype` to serve another")


def dtype_mismatch(info: EngineInfo, others: Sequence[EngineInfo]) -> str | None:
    """Why an engine cannot join a deployment whose engines move KV between them (NIXL, the
    CPU tier): it serves another dtype than one of `others` (pools naming different dtypes);
    None when it can."""
    other = next((o for o in others if o.dtype != info.dtype), None)
    if other is None:
        return None
    return (f"it serves {info.dtype} and engine {other.engine_id} serves {other.dtype}, and KV moves between "
            "engines only in one dtype; name one `engine_args.dtype` for every pool")


def engine_spec(cfg: TandemConfig, role: Role, engine_id: str, slot: EngineSlot, tier: TierSettings | None,
                lacks_half_precision: bool = False) -> EngineSpec:
    """Everything engine `engine_id` of pool `role` needs to start in `slot`;
    `lacks_half_precision`: some of the deployment's CPU nodes do (native_engine_args)."""
    pool = cfg.pools[role]
    engine_args = native_engine_args(cfg.engine_args_for(role), lacks_half_precision)
    if cfg.cpu_tier.enabled:
        # The tier connector handles one KV cache group (no hybrid KV cache manager).
        engine_args = {**engine_args, "disable_hybrid_kv_cache_manager": True}
    if pool.tensor_parallel_size > 1:
        # On GPUs one Ray worker per TP rank, in the replica's GPU bundles
        # (placement.placement_bundles); on CPU hosts local processes: inside a Ray actor vLLM
        # would otherwise pick its Ray executor, whose workers need device bundles.
        backend = "ray" if cfg.device == "cuda" else "mp"
        engine_args = {"distributed_executor_backend": backend, **engine_args}
    return EngineSpec(
        engine_id=engine_id,
        role=role,
        model_path=slot.model_path,
        served_name=cfg.model.name,
        engine_args=engine_args,
        tensor_parallel_size=pool.tensor_parallel_size,
        kv_transfer=kv_transfer_for(cfg, role, tier),
        cores=slot.pinned_to,
        slow_transfer_s=cfg.kv_transfer.slow_transfer_s,
        node_id=slot.node_id,
        stream_port=slot.stream_port,
    )
