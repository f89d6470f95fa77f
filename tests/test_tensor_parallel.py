"""A tensor-parallel replica on the CPU build: two TP ranks as local worker processes of one
engine, each bound to its own core (the GPU placement shape is checked in test_pool_logic.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import psutil
import pytest

from actors.protocol import EngineRequest
from actors.run_dir import SHM_ROOT
from orchestrator.config import parse_config
from orchestrator.deploy import Deployment
from actors.stream import stream
from tests.shm import vllm_shm

pytestmark = pytest.mark.engines


def test_a_tp2_replica_serves_with_one_worker_per_rank_on_its_own_core(ray_local: None, tiny_model: Any) -> None:
    cfg = parse_config({
        "colocated": {"tensor_parallel_size": 2, "num_cpus": 2},
        "cpu_tier": {"enabled": False},
        "engine_args": {"max_model_len": 512},
        "serve": {"app_name": "tp2"},
    })
    deployment = Deployment(cfg)
    before = vllm_shm()
    (engine,) = deployment.start()
    try:
        (info,) = deployment.infos

        async def generate() -> list[int]:
            from vllm.sampling_params import SamplingParams

            req = EngineRequest("tp2", [5, 77, 300, 12], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            return [t async for out in stream(engine.stream_address, req) for t in out.outputs[0].token_ids]

        assert len(asyncio.run(generate())) == 8
        workers = [psutil.Process(p) for p in info.child_pids if psutil.Process(p).name().startswith("VLLM::Worker_TP")]
        assert sorted(w.name() for w in workers) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
        # One OpenMP binding per rank, "|"-separated (placement.omp_binding).
        assert info.cpu_binding is not None and len(info.cpu_binding.split("|")) == 2
        # The ranks' queue and buffers in /dev/shm, which vLLM unlinks only on a clean exit.
        # The buffers come from vLLM's CPU SHM communicator, which its kernels for AVX2-only
        # hosts lack (device_communicators/cpu_communicator.py: ranks then use gloo).
        import importlib

        import torch

        importlib.import_module("vllm._custom_ops")  # loads torch.ops._C, the kernels the engine runs

        made = vllm_shm() - before
        assert any(n.startswith("psm_") for n in made), made
        assert any(n.startswith("vllm_dist_") for n in made) == hasattr(torch.ops._C, "init_shm_manager"), made
    finally:
        deployment.stop()
    left = vllm_shm() - before
    assert not left, f"the stopped engine left shared memory in {SHM_ROOT}: {sorted(left)}"
