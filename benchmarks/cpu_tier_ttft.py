"""TTFT of a shared-prefix workload with the CPU KV tier hit, missed, and switched off, in one run.

Two colocated deployments side by side, two engines each (one core each on 2 cores), local
prefix caching off so the tier is the only cache: one with the tier, one without. For each
prompt, engine A of the first answers a sibling prompt with the same prefix; then its engine
B answers the prompt with the tier holding the prefix ("tier hit") and again after the tier
is flushed ("tier miss": a full recompute plus the tier's lookup and save), and engine B of
the second deployment answers it too ("tier off"). Miss and off alternate in order from
prompt to prompt and share a core binding, so host noise falls on both: hit vs miss is what
the tier saves, miss vs off what it costs when it cannot help.

    python -m benchmarks.cpu_tier_ttft [--prefix-blocks 6] [--prompts 16]

Prints a table and writes results/cpu_tier_ttft.json. About 4 minutes on 2 cores, most of
it engine start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import ray

from actors.protocol import EngineRequest
from actors.stream import stream
from orchestrator.config import parse_config
from orchestrator.deploy import Deployment
from orchestrator.tiny_model import prepare_tiny_model

BLOCK = 128  # vLLM's block size on CPU


class Figures(msgspec.Struct):
    label: str
    ttft_ms: list[float]
    tokens_loaded: float

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ttft_ms)


async def ttft_ms(handle: Any, request_id: str, tokens: list[int]) -> float:
    from vllm.sampling_params import SamplingParams

    first: float | None = None
    req = EngineRequest(request_id, tokens, SamplingParams(max_tokens=4, temperature=0.0))
    address = (await handle.info.remote()).stream_address
    t0 = time.perf_counter()
    async for out in stream(address, req):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter()
    assert first is not None
    return (first - t0) * 1000


def tokens(seed: int, n: int) -> list[int]:
    return [20 + (seed * 131 + i * 7) % 400 for i in range(n)]


def tier_loaded(handle: Any) -> float:
    counters = ray.get(handle.get_stats.remote()).connector_counters
    return counters.get("TandemCpuTierConnector", {}).get("tokens_loaded", 0)


def deployment(tier: bool) -> Deployment:
    """Two colocated engines (one core each on 2 cores), local prefix caching off."""
    return Deployment(parse_config({
        "colocated": {"replicas": 2},
        "cpu_tier": {"enabled": tier, "size_gib": 0.25},
        "engine_args": {"enable_prefix_caching": False, "max_model_len": 1024},  # the tiny model's limit
        "serve": {"app_name": "tier-on" if tier else "tier-off"},
    }))


def run(prefix_blocks: int, num_prompts: int) -> dict[str, Any]:
    prepare_tiny_model()
    hit, miss, off = Figures("tier hit", [], 0), Figures("tier miss", [], 0), Figures("tier off", [], 0)
    with_tier, without = deployment(tier=True), deployment(tier=False)
    try:
        with_tier.start()
        without.start()
        a, b = (e.handle for e in with_tier.engines)
        b_off = without.engines[1].handle

        def ask(figures: Figures, handle: Any, rid: str, prompt: list[int]) -> None:
            before = tier_loaded(handle)
            figures.ttft_ms.append(asyncio.run(ttft_ms(handle, rid, prompt)))
            figures.tokens_loaded += tier_loaded(handle) - before
            if handle is b:
                ray.get(with_tier.kv_index.clear.remote())  # the next ask starts cold

        for i in range(num_prompts):
            prefix = tokens(1000 + i, prefix_blocks * BLOCK)
            prompt = prefix + tokens(2, 20)
            asyncio.run(ttft_ms(a, f"a-{i}", prefix + tokens(1, 20)))  # puts the prefix in the tier
            ask(hit, b, f"b-hit-{i}", prompt)
            cold = [(miss, b, f"b-miss-{i}"), (off, b_off, f"b-off-{i}")]
            for figures, handle, rid in cold[:: 1 if i % 2 else -1]:
                ask(figures, handle, rid, prompt)
    finally:
        with_tier.stop()
        without.stop()
    return {
        "prompt_tokens": prefix_blocks * BLOCK + 20,
        "shared_prefix_tokens": prefix_blocks * BLOCK,
        "runs": [
            {"label": f.label, "ttft_ms": f.ttft_ms, "ttft_median_ms": f.median_ms, "tokens_loaded": f.tokens_loaded}
            for f in (off, miss, hit)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-blocks", type=int, default=6, help="shared prefix length in 128-token blocks (at most 7: max_model_len 1024)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("results/cpu_tier_ttft.json"))
    args = parser.parse_args()
    # address="local": always a fresh instance; with no address, ray.init joins any Ray
    # already running on this machine (another user's `ray start`, another test run).
    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        result = run(args.prefix_blocks, args.prompts)
    finally:
        ray.shutdown()
    print(f"shared prefix {result['shared_prefix_tokens']} of {result['prompt_tokens']} prompt tokens")
    print(f"{'':10} {'TTFT median ms':>15} {'tokens loaded':>14}")
    for r in result["runs"]:
        print(f"{r['label']:10} {r['ttft_median_ms']:15.1f} {r['tokens_loaded']:14.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
