"""TTFT of a shared-prefix workload with the CPU KV tier hit, missed, and switched off, in one run.

One colocated deployment of two engines with the tier (local prefix caching off, so the
tier is the only cache). For each prompt, engine A first answers a sibling prompt with the
same prefix; then engine B answers the prompt twice: once with the tier holding the prefix
("tier hit") and once after flushing the tier ("tier miss": a full recompute plus the
tier's lookup and save). A second deployment, the same but with the tier disabled, answers
the same prompts on its engine B ("tier off"). Same prompts and core binding throughout, so
hit vs miss is what the tier saves and miss vs off what it costs when it cannot help.

    python -m benchmarks.cpu_tier_ttft [--prefix-blocks 6] [--prompts 8]

Prints a table and writes results/cpu_tier_ttft.json. About 5 minutes on 2 cores, most of
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

from actors.protocol import EngineRequest, SamplingOptions
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
    t0 = time.perf_counter()
    first: float | None = None
    req = EngineRequest(request_id, tokens, SamplingOptions(max_tokens=4, temperature=0.0))
    async for ref in handle.generate.remote(req):
        chunk = await ref
        if first is None and chunk.token_ids:
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
    }))


def run(prefix_blocks: int, num_prompts: int) -> dict[str, Any]:
    prepare_tiny_model()
    prompts = [(tokens(1000 + i, prefix_blocks * BLOCK), tokens(1, 20), tokens(2, 20)) for i in range(num_prompts)]
    hit, miss, off = Figures("tier hit", [], 0), Figures("tier miss", [], 0), Figures("tier off", [], 0)
    d = deployment(tier=True)
    d.start()
    try:
        a, b = (e.handle for e in d.engines)
        for i, (prefix, sibling, own) in enumerate(prompts):
            asyncio.run(ttft_ms(a, f"a-{i}", prefix + sibling))
            for figures, rid in ((hit, f"b-hit-{i}"), (miss, f"b-miss-{i}")):
                before = tier_loaded(b)
                figures.ttft_ms.append(asyncio.run(ttft_ms(b, rid, prefix + own)))
                figures.tokens_loaded += tier_loaded(b) - before
                ray.get(d.kv_index.clear.remote())
    finally:
        d.stop()
    d = deployment(tier=False)
    d.start()
    try:
        b = d.engines[1].handle
        for i, (prefix, _, own) in enumerate(prompts):
            off.ttft_ms.append(asyncio.run(ttft_ms(b, f"b-off-{i}", prefix + own)))
    finally:
        d.stop()
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
    parser.add_argument("--prompts", type=int, default=8)
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
