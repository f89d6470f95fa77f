"""Ray Serve LLM's 1P1D, the peer Tandem is measured against, as the bench scenario `ray-serve-llm`.

What runs: `ray.serve.llm.build_pd_openai_app` with Ray Serve LLM's defaults (vLLM's
NixlConnector, Serve's proxy and OpenAI ingress, one prefill and one decode replica) on the
bench's model and engine args, in a Ray of its own that a subprocess starts (`python -m
benchmarks.ray_serve_llm`), so it neither joins Tandem's embedded Ray nor outlives the
scenario. Cores as Tandem's 1P1D gets them: each engine computes on its half of the host's
cores (VLLM_CPU_OMP_THREADS_BIND); everything else floats, as Ray Serve LLM leaves it.

Its session runs at the weight Tandem's own session gets in the bench (`cpu.session_nice`,
see orchestrator.cluster.session_priority). At the default weight, vLLM's NIXL progress
threads (one busy-polling thread per engine) left the benchmark client under 1% of a core on
a 2-core host: it took minutes to import, and a latency it measured would have been mostly
its own wait (most likely the 2-second TTFT in issue 20's table). Needs pyarrow (Tandem's `bench` extra), which Ray
Serve LLM imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.config import TandemConfig
from orchestrator.models import hub_env, resolve_local
from orchestrator.specs import local_engine_args

# Logical CPUs of its Ray: Ray Serve LLM reserves one per engine bundle, per replica and for
# its ingress; the cores they compute on are set by the OpenMP binding, not by these.
RAY_LOGICAL_CPUS = 16


def missing() -> str | None:
    """Why Ray Serve LLM cannot run in this environment, with the fix; None when it can."""
    if importlib.util.find_spec("pyarrow") is None:
        return "the ray-serve-llm scenario needs pyarrow, which Ray Serve LLM imports: pip install -e '.[bench]' (./dev does)"
    return None


def engine_cores(cores: list[int]) -> tuple[str, str]:
    """The OpenMP bindings of the prefill and the decode engine: each its half of `cores`
    (the first half to the prefill), as Tandem's placement splits one host for 1P1D."""
    if len(cores) < 2:
        raise ValueError(f"Ray Serve LLM's 1P1D needs two cores here, one per engine; this process may use {cores}")
    half = len(cores) // 2
    return ",".join(map(str, cores[:half])), ",".join(map(str, cores[half:]))


def pd_serving_args(cfg: TandemConfig, model_path: str, cores: list[int]) -> dict[str, Any]:
    """build_pd_openai_app's arguments for `cfg`'s model and engine args, one engine per role
    on its half of `cores`. Plain data, so it is written to the subprocess as JSON."""

    def llm_config(role: str, binding: str) -> dict[str, Any]:
        env = hub_env(cfg.model.source) | {"VLLM_CPU_OMP_THREADS_BIND": binding}
        if cfg.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu.kvcache_space_gib)
        config: dict[str, Any] = {
            "model_loading_config": {"model_id": cfg.model.name, "model_source": model_path},
            "deployment_config": {"num_replicas": 1},
            "engine_kwargs": {**local_engine_args(cfg, role),
                              "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}},
            "runtime_env": {"env_vars": env},
        }
        if cfg.device == "cpu":
            config["placement_group_config"] = {"bundles": [{"CPU": 1}]}
        return config

    prefill, decode = engine_cores(cores)
    return {"prefill_config": llm_config("prefill", prefill), "decode_config": llm_config("decode", decode)}


def server_command(cfg: TandemConfig, port: int, args_path: Path) -> list[str]:
    """The subprocess that serves Ray Serve LLM's 1P1D for `cfg` on 127.0.0.1:`port`; writes
    its build_pd_openai_app arguments (this process's cores split between the engines) to
    `args_path`."""
    args_path.write_text(json.dumps(pd_serving_args(cfg, str(resolve_local(cfg.model.source)), sorted(os.sched_getaffinity(0)))))
    return [sys.executable, "-m", "benchmarks.ray_serve_llm", "--args", str(args_path), "--port", str(port),
            "--session-nice", str(cfg.cpu.session_nice if cfg.device == "cpu" else 0)]


def _serve(args_path: Path, port: int, session_nice: int) -> None:
    """The subprocess: start a Ray of its own, deploy, and serve until SIGTERM."""
    import ray
    from ray import serve
    from ray.serve.llm import build_pd_openai_app

    from orchestrator.cluster import session_priority

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with session_priority(session_nice):
        # address="local": a stale /tmp/ray/ray_current_cluster must not make it join another Ray.
        ray.init(address="local", num_cpus=RAY_LOGICAL_CPUS, include_dashboard=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            t0 = time.perf_counter()
            serve.run(build_pd_openai_app(json.loads(args_path.read_text())), blocking=False)
            print(f"Ray Serve LLM 1P1D up in {time.perf_counter() - t0:.0f} s on 127.0.0.1:{port}", flush=True)
            signal.pause()
        finally:
            serve.shutdown()
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve Ray Serve LLM's 1P1D (the bench scenario ray-serve-llm) until SIGTERM.")
    p.add_argument("--args", required=True, type=Path, help="build_pd_openai_app's arguments, as JSON (pd_serving_args)")
    p.add_argument("--port", required=True, type=int)
    p.add_argument("--session-nice", type=int, default=0, help="this session's weight (orchestrator.cluster.session_priority)")
    a = p.parse_args(argv)
    _serve(a.args, a.port, a.session_nice)
    return 0


if __name__ == "__main__":
    sys.exit(main())
