"""`tandem bench`: colocated and disaggregated serving, side by side, in one run.

Every scenario gets the same workload on the same machine: deploy, a rate sweep over Tandem's
OpenAI endpoint (each point warmed up first), the same load straight to the engine actors
(what the HTTP path costs, phase by phase), /metrics deltas (KV bytes, transfer time,
fallbacks, external tokens), teardown. Each run also reads the CPU of the server's processes.
A plain vLLM server (`vllm-server`) after Tandem's colocated:1 is run once more beside a
ballast of the extra CPU Tandem's stack took, with the direct runs' prompts: what that CPU
alone costs an engine. Ray Serve LLM's 1P1D (`ray-serve-llm`, benchmarks/ray_serve_llm.py) is
the peer the disaggregated scenarios are set against. A NIXL microbenchmark of the model's KV block shapes then gives the
raw bandwidth that serving's KV rate is set against. `--target-url` runs the same workload
against any OpenAI-compatible server instead of deploying. The fault scenarios
(`fault:prefill`, `fault:decode`) are not swept: their 1P1D takes one load at the last rate
while an engine is SIGKILLed (benchmarks/faults.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import ray_serve_llm, vllm_bench
from benchmarks.ballast import ballast
from benchmarks.report import write_bench_report, write_vllm_client_report
from benchmarks.direct import run_direct
from benchmarks.faults import FaultPlan, FaultReport, run_fault
from benchmarks.loadgen import RunResult, run_load, run_sweep, scrape_metrics
from benchmarks.nixl_micro import KVGeometry, run_micro, standard_sizes
from benchmarks.phases import (
    KV_MAX,
    VLLM_SERVER_METRICS,
    Overhead,
    PathFigures,
    decode_share_from_metrics,
    decode_share_from_traces,
    metric_names,
    requests_with_first_token,
    router_phases_from_metrics,
    router_phases_from_traces,
    ttft_phases,
)
from benchmarks.protocol import BenchOptions, BenchReport, CpuMatched, ScenarioReport, round_label
from benchmarks.scenarios import DEFAULT_CLUSTER_SCENARIOS, DEFAULT_SCENARIOS, Scenario, Target, deployed, free_ports, parse_scenarios, round_order, shared_ray
from benchmarks.server_cpu import CpuMeter
from benchmarks.stats import SLO
from benchmarks.workloads import ConversationWorkload, Fixed, RandomWorkload, Uniform, load_tokenizer
from orchestrator.config import TandemConfig, load_config
from orchestrator.models import resolve_local
from orchestrator.router import RequestTrace, Router

logger = logging.getLogger("tandem.bench")

# Direct-path prompts come from another seed: resending the HTTP run's prompts would make
# them prefix-cache hits, and the comparison would measure the cache, not the path.
DIRECT_SEED_OFFSET = 1000
# The Tandem scenario a plain vLLM server is compared with, and so CPU-matched to.
REFERENCE_SCENARIO = "colocated:1"
# Less extra CPU than this is not worth a CPU-matched run.
MIN_BALLAST_CORES = 0.01


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `tandem bench` options (defaults from BenchOptions)."""
    d = BenchOptions()
    p.add_argument("--scenarios", default=d.scenarios, help=f"comma-separated: colocated[:N], <P>p<D>d[@<policy>[+conditional]][[<routing field>=<value>,...]], vllm-server, ray-serve-llm, fault:prefill, fault:decode (default {DEFAULT_SCENARIOS}; with --address {DEFAULT_CLUSTER_SCENARIOS})")
    p.add_argument("--client", choices=["tandem", "vllm"], default=d.client,
                   help="load generator: Tandem's own (all tables and plots) or vLLM's `vllm bench serve` on the random workload (default %(default)s)")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="deploy and measure every scenario this many times, in turn (every other round reversed), and report the median of each round's ratios "
                        "to the plain vLLM server (--client vllm) or to the first scenario listed (Tandem's load generator) (default %(default)s)")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates), help="offered request rates to sweep, req/s (default %(default)s)")
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="measured requests per rate (default %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up requests before each rate (default %(default)s)")
    p.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens (default %(default)s)")
    p.add_argument("--workload", choices=["random", "conversation"], default=d.workload,
                   help="random prompts, or multi-turn chats after a shared system prompt of --input-len tokens (default %(default)s)")
    p.add_argument("--turns", type=int, default=d.turns, help="conversation: turns per chat (default %(default)s)")
    p.add_argument("--replies", choices=["synthetic", "server"], default=d.replies,
                   help="conversation: the history's answers are synthetic text, or the server's own, resent as the "
                        "token ids it streamed, each turn sent once the one before has ended (default %(default)s)")
    p.add_argument("--chat-order", choices=["turns", "staggered"], default=d.chat_order,
                   help="conversation: every chat's first turn, then every second turn, ... (turns), or chats opening one "
                        "after another among the earlier ones' turns, chat c's turn t at step 2t + c (staggered; default %(default)s)")
    p.add_argument("--duration", type=float, default=d.duration_s, dest="duration_s", help="stop sending this many seconds into a run (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s, dest="request_timeout_s", help="seconds (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms, help="TTFT objective for goodput (default %(default)s)")
    p.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_ms, help="TPOT objective for goodput (default %(default)s)")
    p.add_argument("--config", help="base deployment config (model, engine args, connector); scenarios replace its pools")
    p.add_argument("--model", help="model folder or hub id (overrides the config's model.source)")
    p.add_argument("--no-cpu-tier", dest="cpu_tier", action="store_false", help="run every scenario without the CPU KV tier (overrides the config)")
    p.add_argument("--address", help="join this Ray cluster instead of starting an embedded one")
    p.add_argument("--target-url", help="benchmark this OpenAI-compatible server (e.g. http://127.0.0.1:8000) instead of deploying")
    p.add_argument("--target-model", help="model name to send with --target-url (default: the config's served name)")
    p.add_argument("--tokenizer", help="tokenizer folder or hub id for exact prompt lengths (default: the config's model)")
    p.add_argument("--out", dest="out_dir", help="output folder (default results/bench-<timestamp>)")
    p.add_argument("--no-overhead", dest="overhead", action="store_false", help="skip the direct-to-engine runs (and with them the CPU-matched vLLM server runs)")
    p.add_argument("--no-nixl-micro", dest="nixl_micro", action="store_false", help="skip the NIXL microbenchmark")
    p.add_argument("--fault-after", type=float, default=d.fault_after_s, dest="fault_after_s", help="fault scenarios: SIGKILL this many seconds into the load (default %(default)s)")
    p.add_argument("--fault-window", type=float, default=d.fault_window_s, dest="fault_window_s", help="fault scenarios: most seconds of load after the kill (default %(default)s)")
    p.add_argument("--fault-tail", type=float, default=d.fault_tail_s, dest="fault_tail_s", help="fault scenarios: seconds of load after the killed engine is healthy again (default %(default)s)")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    fields = {f: getattr(args, f) for f in BenchOptions.__struct_fields__ if f != "rates" and hasattr(args, f)}
    return BenchOptions(rates=tuple(float(r) for r in args.rates.split(",") if r.strip()), **fields)


def scenario_names(opts: BenchOptions) -> str:
    """The scenarios asked for, or the default for where the bench runs (one machine or a cluster)."""
    return opts.scenarios or (DEFAULT_CLUSTER_SCENARIOS if opts.address else DEFAULT_SCENARIOS)


def checked_scenarios(opts: BenchOptions) -> list[Scenario]:
    """The scenarios to run; ValueError for a bad name, for a fault scenario on a cluster
    (it SIGKILLs an engine's pid, which means something on this host only), or for rounds
    that do not apply."""
    if opts.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, not {opts.rounds}")
    if opts.rounds > 1 and opts.target_url:
        raise ValueError("--rounds deploys every scenario once per round; a --target-url server is measured once (leave out --rounds)")
    scenarios = parse_scenarios(scenario_names(opts))
    if opts.rounds > 1 and (faulty := [s.name for s in scenarios if s.fault]):
        raise ValueError(f"{', '.join(faulty)}: fault scenarios run once; leave them out of a bench with --rounds")
    if any(s.kind == "ray-serve-llm" for s in scenarios) and (why := ray_serve_llm.missing()):
        raise ValueError(why)
    if opts.chat_order != "turns" and opts.workload != "conversation":
        raise ValueError("--chat-order orders the turns of chats: it applies to --workload conversation")
    if opts.replies == "server" and (opts.workload != "conversation" or opts.client != "tandem" or opts.overhead
                                     or any(s.fault for s in scenarios)):
        raise ValueError("--replies server applies to --workload conversation with Tandem's own load generator over "
                         "HTTP: add --no-overhead (the direct runs send text) and leave out fault scenarios")
    if opts.address and (faulty := [s.name for s in scenarios if s.fault]):
        raise ValueError(f"{', '.join(faulty)}: fault scenarios SIGKILL engine processes on this host, so they run on the embedded Ray only, not with --address")
    return scenarios


def base_config(opts: BenchOptions) -> TandemConfig:
    """The config every scenario starts from: --config (or the embedded default), --model applied."""
    base = load_config(opts.config)
    if opts.model:
        base = msgspec.structs.replace(base, model=msgspec.structs.replace(base.model, source=opts.model, served_name=None))
    if not opts.cpu_tier:
        base = msgspec.structs.replace(base, cpu_tier=msgspec.structs.replace(base.cpu_tier, enabled=False))
    return base


class _Setup(msgspec.Struct, frozen=True):
    """What every scenario shares."""

    opts: BenchOptions
    base: TandemConfig
    workload: RandomWorkload | ConversationWorkload
    slo: SLO
    tokenizer: Any
    port: int  # where every scenario serves (Ray Serve keeps its first port)


def _sweep(setup: _Setup, base_url: str, model: str, label: str, names: list[str], cpu_meter: CpuMeter | None) -> list[RunResult]:
    o = setup.opts
    return asyncio.run(run_sweep(
        base_url, model, setup.workload, o.num_requests, rates=o.rates, tokenizer=setup.tokenizer, seed=o.seed, warmup=o.warmup,
        slo=setup.slo, label=label, duration_s=o.duration_s, request_timeout_s=o.request_timeout_s, metric_names=names, cpu_meter=cpu_meter,
    ))


def server_cpu_meter(target: Target, embedded: bool) -> CpuMeter | None:
    """What to read for the server's CPU: a vLLM server's process tree, or everything the
    embedded Ray runs (the bench process's descendants, the load generator excluded); None on
    a cluster, whose processes are not on this host."""
    if target.pid is not None:
        return CpuMeter([target.pid])
    return CpuMeter([os.getpid()], include_roots=False) if embedded else None


def run_cpu_matched(setup: _Setup, target: Target, meter: CpuMeter, runs: list[RunResult], reference: ScenarioReport) -> list[CpuMatched]:
    """Per rate: the vLLM server again, beside a ballast of the CPU Tandem's stack took beyond
    the vLLM server's own (outside vLLM's engine processes, Tandem's direct run against this run), fed
    the direct run's prompts on its schedule. The vLLM server has not seen those prompts."""
    o = setup.opts
    matched = []
    for k, (run, direct) in enumerate(zip(runs, reference.direct)):
        if run.server_cpu is None or direct.server_cpu is None or run.config.rate != direct.config.rate:
            continue
        extra = direct.server_cpu.other - run.server_cpu.other
        if extra < MIN_BALLAST_CORES:
            logger.info("rate %g: Tandem's stack took no more CPU than the vLLM server's (%+.3f core); no CPU-matched run", run.config.rate, extra)
            continue
        requests = setup.workload.sample(o.num_requests, o.seed + DIRECT_SEED_OFFSET + k, setup.tokenizer)
        with ballast(extra, seconds=o.duration_s + o.request_timeout_s + 60) as burner:
            result = asyncio.run(run_load(
                target.base_url, target.model, requests, rate=run.config.rate, seed=o.seed + k, duration_s=o.duration_s,
                slo=setup.slo, label=f"vllm-server + {extra:.2f} core", metric_names=VLLM_SERVER_METRICS,
                request_timeout_s=o.request_timeout_s, workload=setup.workload, cpu_meter=CpuMeter([*meter.roots, burner]),
            ))
        matched.append(CpuMatched(extra, result))
    return matched


def run_scenario(setup: _Setup, scenario: Scenario, log_dir: Path, reference: ScenarioReport | None = None,
                 round: int | None = None) -> tuple[ScenarioReport, KVGeometry | None]:
    """Deploy, sweep over HTTP, run the direct path, tear down; the KV geometry of Tandem engines.

    A vLLM server given the `reference` (colocated:1's report) also gets its CPU-matched runs.
    `round`: which of several rounds this is (None: the bench runs one).
    """
    o = setup.opts
    label = round_label(scenario.name, round)
    # A vLLM server exposes its engine-core timings under vllm: names; only those match there.
    names = metric_names() if scenario.is_tandem else list(VLLM_SERVER_METRICS)
    with deployed(scenario, setup.base, setup.port, log_dir) as target:
        logger.info("%s up in %.0f s at %s", scenario.name, target.startup_s, target.base_url)
        meter = server_cpu_meter(target, embedded=not o.address)
        runs = _sweep(setup, target.base_url, target.model, label, names if target.metrics else [], meter)
        if not scenario.is_tandem:
            matched = run_cpu_matched(setup, target, meter, runs, reference) if reference is not None and meter is not None else []
            return ScenarioReport(scenario, target.startup_s, runs, cpu_matched=matched, round=round), None
        infos = target.deployment.infos
        geometry = KVGeometry.from_model(resolve_local(setup.base.model.source), infos[0].block_size)
        direct: list[tuple[RunResult, list[RequestTrace]]] = []
        if o.overhead:
            for k, rate in enumerate(o.rates):
                # Seeds apart from the HTTP sweep's (seed + k) and from each other: no prefix-cache hits.
                requests = setup.workload.sample(o.num_requests, o.seed + DIRECT_SEED_OFFSET + k, setup.tokenizer)
                router = Router(target.deployment.routing_engines(), setup.base.routing, setup.base.stream_batch_s)
                direct.append(asyncio.run(run_direct(
                    router, target.model, requests, setup.tokenizer,
                    rate=rate, seed=o.seed + k, label=f"{label} direct", metrics_url=target.base_url, metric_names=names,
                    duration_s=o.duration_s, slo=setup.slo, request_timeout_s=o.request_timeout_s, workload=setup.workload, cpu_meter=meter,
                )))
        slowest = asyncio.run(scrape_metrics(target.base_url, [KV_MAX], combine=max)).get(KV_MAX)
    disaggregated = scenario.kind == "disaggregated"
    phases: dict[str, dict[str, float]] = {}
    overhead = []
    for k, run in enumerate(runs):
        s = run.summary
        http_phases = ttft_phases(router_phases_from_metrics(s.server_metrics), s.server_metrics, disaggregated,
                                  (s.ttft_ms.mean or 0.0) / 1000, requests_with_first_token(s.server_metrics),
                                  decode_share_from_metrics(s.server_metrics))
        if k == 0:
            phases[f"{label} HTTP"] = http_phases
        if k < len(direct):
            d, traces = direct[k]
            direct_phases = ttft_phases(router_phases_from_traces(traces), d.summary.server_metrics, disaggregated,
                                        num_requests=sum(t.t_first_token is not None for t in traces),
                                        decode_share=decode_share_from_traces(traces))
            if k == 0:
                phases[f"{label} direct"] = direct_phases
            overhead.append(Overhead(run.config.rate, PathFigures.of(run, http_phases), PathFigures.of(d, direct_phases)))
    phases_ms = {name: {p: 1000 * sec for p, sec in v.items()} for name, v in phases.items()}
    return ScenarioReport(scenario, target.startup_s, runs, [d for d, _ in direct], phases_ms, overhead, slowest or None, round=round), geometry


def run_fault_scenario(setup: _Setup, scenario: Scenario, log_dir: Path) -> FaultReport:
    """Deploy the scenario's 1P1D and kill its engine under one load at the sweep's last rate,
    with that point's seed: the same prompts and arrivals as its sweep point, extended."""
    o = setup.opts
    plan = FaultPlan(o.fault_after_s, o.fault_window_s, o.fault_tail_s)
    rate, seed = o.rates[-1], o.seed + len(o.rates) - 1
    requests = setup.workload.sample(o.warmup + plan.num_requests(rate), seed, setup.tokenizer)
    with deployed(scenario, setup.base, setup.port, log_dir) as target:
        logger.info("%s up in %.0f s at %s", scenario.name, target.startup_s, target.base_url)
        return run_fault(target, scenario, plan, requests, warmup=o.warmup, rate=rate, seed=seed, slo=setup.slo,
                         request_timeout_s=o.request_timeout_s, workload=setup.workload)


def workload_of(opts: BenchOptions) -> RandomWorkload | ConversationWorkload:
    if opts.workload == "conversation":
        # Each turn adds a user message of 32-96 tokens and a reply of --output-len.
        return ConversationWorkload(opts.turns, opts.input_len, Uniform(32, 96), Fixed(opts.output_len), opts.replies,
                                    opts.chat_order)
    return RandomWorkload(Fixed(opts.input_len), Fixed(opts.output_len))


def run_bench(opts: BenchOptions, out: Path) -> BenchReport:
    """Every scenario in turn (at most one deployed at a time), `rounds` times, then the NIXL
    microbenchmark. A plain vLLM server's CPU-matched runs need colocated:1 earlier in the
    same round."""
    t0 = time.perf_counter()
    opts = msgspec.structs.replace(opts, scenarios=scenario_names(opts))  # so that bench.json names what ran
    scenarios = checked_scenarios(opts)
    base = base_config(opts)
    tokenizer = load_tokenizer(opts.tokenizer or resolve_local(base.model.source))
    # On a cluster, Serve may already listen on the config's port; on this machine, any free one.
    port = base.serve.port if opts.address else free_ports(1)
    setup = _Setup(opts, base, workload_of(opts), SLO(opts.slo_ttft_ms, opts.slo_tpot_ms), tokenizer, port)
    command = _command()
    if opts.target_url:
        model = opts.target_model or base.model.name
        target = Scenario("target", "external")
        report = ScenarioReport(target, 0.0, _sweep(setup, opts.target_url.rstrip("/").removesuffix("/v1"), model, "target", [], None))
        return BenchReport(opts, command, [report], elapsed_s=time.perf_counter() - t0)
    reports, faults, geometry = [], [], None
    with shared_ray(base, scenarios, opts.address):
        for r, scenario in round_order(scenarios, opts.rounds):
            if scenario.fault:
                faults.append(run_fault_scenario(setup, scenario, out / "logs"))
                continue
            which = r if opts.rounds > 1 else None
            reference = next((x for x in reports if x.scenario.name == REFERENCE_SCENARIO and x.round == which), None) if scenario.kind == "vllm-server" else None
            report, found = run_scenario(setup, scenario, out / "logs", reference, which)
            reports.append(report)
            geometry = geometry or found
    micro = []
    if opts.nixl_micro and geometry is not None:
        micro = run_micro(geometry, standard_sizes(geometry, opts.input_len))
    return BenchReport(opts, command, reports, geometry, micro, time.perf_counter() - t0, faults)


def run_vllm_client(opts: BenchOptions, out: Path) -> int:
    """`tandem bench --client vllm`: the scenarios under vLLM's own benchmark client."""
    scenarios = checked_scenarios(opts)
    if opts.target_url or any(s.fault for s in scenarios):
        print("tandem bench: --client vllm deploys and measures scenarios; it takes no --target-url or fault "
              "scenario (run `vllm bench serve` against a running server yourself)", file=sys.stderr)
        return 2
    try:
        runs = vllm_bench.workload_runs(opts)
    except ValueError as err:
        print(f"tandem bench: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    results = vllm_bench.run(base_config(opts), scenarios, runs, out, opts.address, opts.rounds)
    print(write_vllm_client_report(results, out, _command(), scenarios))
    print(f"vLLM's result files and summary.md written to {out}/")
    return 0


def _command() -> str:
    """The command line this bench runs under, as the report names it."""
    return " ".join(["tandem", *sys.argv[1:]]) if Path(sys.argv[0]).name == "tandem" else " ".join(sys.argv)


def main(args: argparse.Namespace) -> int:
    """The body of `tandem bench`: run, write the report, print the summary."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress bars
    opts = options_from_args(args)
    try:
        checked_scenarios(opts)
    except ValueError as err:
        print(f"tandem bench: {err}", file=sys.stderr)
        return 2
    out = Path(opts.out_dir or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    if opts.client == "vllm":
        return run_vllm_client(opts, out)
    report = run_bench(opts, out)
    summary = write_bench_report(report, out)
    print(summary.read_text())
    print(f"report written to {out}/ (summary.md, results.md, bench.json, *.png, one JSON per run)")
    return 0
