"""The same load, sent straight to the engine actors: Tandem's router in this process, no HTTP.

Comparing a run through Tandem's OpenAI endpoint with this one, at the same rate and with the
same workload, measures what the front door costs: the Serve proxy, the ingress replica
(vLLM's parsing, tokenizing and SSE). The requests are tokenized by the
same tokenizer and turned into sampling settings by vLLM's own `CompletionRequest`, as the
ingress does, so engines see identical token ids and sampling settings; the schedule comes
from the load generator itself.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from tqdm.auto import tqdm

from benchmarks.loadgen import RunConfig, RunResult, arrival_times, environment, measure, metric_deltas, request_body, scrape_metrics
from benchmarks.server_cpu import CpuMeter
from benchmarks.stats import SLO, RequestResult, summarize
from benchmarks.workloads import BenchRequest, WorkloadSpec
from actors.protocol import EngineRequest
from orchestrator.router import RequestTrace, Router

DIRECT_URL = "ray://engine-actors"  # stands in for base_url in a direct run's RunConfig


class DirectSender:
    """A load-generator `Sender` whose requests go through a local Router instead of HTTP."""

    def __init__(self, router: Router, tokenizer: Any, config: RunConfig, progress: tqdm) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.config = config
        self.progress = progress
        self.traces: list[RequestTrace] = []  # of the requests that succeeded

    async def acquire(self) -> None:
        """No concurrency cap: direct runs mirror uncapped rate runs."""

    def release(self) -> None:
        pass

    async def send(self, request: BenchRequest, index: int, run_start: float) -> RequestResult:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        body = CompletionRequest(**request_body(self.config, request, {}))
        prompt_ids = self.tokenizer(request.prompt).input_ids
        engine_request = EngineRequest(f"direct-{uuid.uuid4().hex}", prompt_ids, body.to_sampling_params(request.max_tokens, {}))
        trace = RequestTrace()
        sent = time.perf_counter()
        token_times: list[float] = []
        num_out, error = 0, None

        async def consume() -> None:
            nonlocal num_out
            async for out in self.router.generate(engine_request, trace):
                if out.outputs[0].token_ids:  # the HTTP client times every chunk with a token, so do the same
                    token_times.append(time.perf_counter() - sent)
                num_out += len(out.outputs[0].token_ids)

        try:
            await asyncio.wait_for(consume(), self.config.request_timeout_s)
        except Exception as exc:  # one request's failure is a data point, as over HTTP
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.progress.update(1)
        if error is None and not token_times:
            error = "no token received"
        if error is None:
            self.traces.append(trace)
        return RequestResult(
            index=index,
            start=sent - run_start,
            latency=time.perf_counter() - sent,
            token_times=token_times,
            output_tokens=num_out,
            prompt_tokens=len(prompt_ids),
            cached_tokens=trace.num_cached_tokens,
            error=error,
            engine=trace.output_engine,
            prefill_engine=trace.prefill_engine,
            disaggregation=trace.placement(),
        )


async def run_direct(
    router: Router,
    model: str,
    requests: Sequence[BenchRequest],
    tokenizer: Any,
    *,
    rate: float | None,
    seed: int,
    label: str,
    metrics_url: str,
    metric_names: Collection[str] = (),
    duration_s: float | None = None,
    slo: SLO | None = None,
    request_timeout_s: float = 600.0,
    workload: WorkloadSpec | None = None,
    cpu_meter: CpuMeter | None = None,
) -> tuple[RunResult, list[RequestTrace]]:
    """One Poisson-arrival run through `router` (built in this process like the ingress's, from the
    same config); also returns the router's traces.

    `metrics_url` is the deployment's HTTP base, scraped before and after for engine-side
    counters (queue time, KV transfers), which the engines report whichever path fed them.
    `cpu_meter` reads the deployment's processes as over HTTP (the router here is not in them).
    """
    config = RunConfig(
        base_url=DIRECT_URL, model=model, label=label, rate=rate, concurrency=None, arrival="poisson", seed=seed,
        warmup=0, duration_s=duration_s, max_requests=None, ignore_eos=True, request_timeout_s=request_timeout_s, workload=workload,
    )
    env = environment()
    schedule = arrival_times(len(requests), rate, "poisson", seed)
    with tqdm(total=len(requests), desc=label, unit="req") as bar:
        sender = DirectSender(router, tokenizer, config, bar)
        before = await scrape_metrics(metrics_url, metric_names) if metric_names else {}
        try:
            results, elapsed, host_cpu, server_cpu = await measure(sender, requests, schedule, duration_s, cpu_meter)
        finally:
            await router.close()
        after = await scrape_metrics(metrics_url, metric_names) if metric_names else {}
    summary = summarize(results, elapsed, slo, metric_deltas(before, after))
    return RunResult(config=config, environment=env, summary=summary, requests=results, host_cpu=host_cpu, server_cpu=server_cpu), sender.traces
