"""The default 1P1D deployment, for real: Ray + two vLLM engines + NIXL + Ray Serve + openai.

One deployment and one colocated reference engine serve the whole module.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

from actors.protocol import EngineRequest
from orchestrator.config import parse_config
from orchestrator.deploy import Deployment
from orchestrator.job import Running, running
from orchestrator.protocol import EngineRef
from orchestrator.router import stream_engine
from actors.stream import EngineStreams, stream
from tests.conftest import free_port, together

pytestmark = pytest.mark.engines

MAX_MODEL_LEN = 1024
MODEL = "tandem-tiny"
TOKEN_PATH_PORT = free_port(8)


@contextmanager
def deployed(dep: Deployment) -> Iterator[list[EngineRef]]:
    engines = dep.start()
    try:
        yield engines
    finally:
        dep.stop()


@pytest.fixture(scope="module")
def servers(ray_local: None, tiny_model: object) -> Iterator[tuple[Running, EngineRef]]:
    """The 1P1D deployment and a single colocated engine with the same model and engine args
    (no KV connector, no Serve app), started side by side."""
    cfg = parse_config(
        {
            "engine_args": {"max_model_len": MAX_MODEL_LEN},
            # Serve's proxy in front: this module checks that path end to end (streaming,
            # cancellation by disconnect, bad input); the others run the default, the ingress
            # answering HTTP itself.
            "serve": {"port": free_port(), "http": "proxy", "token_path_base_port": TOKEN_PATH_PORT},
            "kv_transfer": {"side_channel_base_port": free_port(8)},
        }
    )
    reference = Deployment(parse_config({"engine_args": {"max_model_len": MAX_MODEL_LEN}, "colocated": {}, "serve": {"app_name": "reference"}}))
    with together(running(cfg, own_ray=False), deployed(reference)) as (up, (engine,)):
        yield up, engine


@pytest.fixture(scope="module")
def pd(servers: tuple[Running, EngineRef]) -> Running:
    return servers[0]


@pytest.fixture(scope="module")
def reference(servers: tuple[Running, EngineRef]) -> EngineRef:
    return servers[1]


@pytest.fixture(scope="module")
def client(pd: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd.url, api_key="unused", max_retries=0, timeout=120)


def metrics(pd: Running) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(pd.url.removesuffix("/v1") + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(m: dict, name: str, **labels: str) -> float:
    """Sum of a sample over every label set containing `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= ls)


def reference_tokens(engine: EngineRef, prompt: list[int], max_tokens: int) -> list[int]:
    async def run() -> list[int]:
        req = EngineRequest(f"ref-{random.random()}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return [t async for out in stream(engine.stream_address, req) for t in out.outputs[0].token_ids]

    return asyncio.run(run())


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]  # ids 0-2 are the special tokens; the vocab has ~500


# ---- the OpenAI API -----------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_health_reports_every_engine(pd: Running) -> None:
    r = httpx.get(pd.url.removesuffix("/v1") + "/health", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "status": "ok",
        "pools": {
            "prefill": {"healthy": 1, "replicas": {"prefill-0": "healthy"}},
            "decode": {"healthy": 1, "replicas": {"decode-0": "healthy"}},
        },
    }


def test_completion_with_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=7, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == len(r.choices[0].model_extra["prompt_token_ids"])
    assert len(r.choices[0].model_extra["token_ids"]) == 7
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="hello world data transfer", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens > 2  # the chat template's role markers count too


def test_streamed_chat_equals_non_streamed(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "tell me about ray"}], max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_responses_name_their_engines_behind_serves_proxy_streamed_or_not(client: openai.OpenAI) -> None:
    """The route headers leave with the first output, through Serve's proxy too; a list of
    prompts gets one value per prompt, in order."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "where did this run"}], max_tokens=4, temperature=0)
    with client.chat.completions.with_streaming_response.create(**kw, stream=True) as streamed:
        assert streamed.headers["x-tandem-engine"] == "decode-0"
        assert streamed.headers["x-tandem-prefill-engine"] == "prefill-0"
        assert streamed.headers["x-tandem-disaggregation"] == "decision=remote;reason=always"
        assert [c.choices[0].finish_reason for c in streamed.parse() if c.choices][-1] == "length"
    two = client.completions.with_raw_response.create(model=MODEL, prompt=["one", "two"], max_tokens=2)
    assert len(two.parse().choices) == 2
    assert two.headers["x-tandem-engine"] == "decode-0, decode-0"
    assert two.headers["x-tandem-prefill-engine"] == "prefill-0, prefill-0"
    # /v1/responses streams response.created before the request is routed: it waits for the route.
    with client.responses.with_streaming_response.create(model=MODEL, input="where", max_output_tokens=4, stream=True) as events:
        assert (events.headers["x-tandem-prefill-engine"], events.headers["x-tandem-engine"]) == ("prefill-0", "decode-0")
        kinds = [e.type for e in events.parse()]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds


def test_cached_tokens_reported_for_a_repeated_prompt(client: openai.OpenAI) -> None:
    prompt = random_prompt(random.Random(99), 300)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The prefill engine's prefix cache holds the prompt's full blocks (block size 128).
    assert cached == 256


# ---- criterion 3: token-identical to one colocated engine ------------------------------------


def test_disaggregated_greedy_output_matches_a_colocated_engine(client: openai.OpenAI, reference: EngineRef) -> None:
    rng = random.Random(1234)
    max_tokens = 16
    lengths = [3, 7, 15, 31, 64, 100]  # short
    lengths += [128, 129, 200, 256, 300, 385, 450, 513, 640]  # one to several KV blocks
    lengths += [800, 900, 1000, MAX_MODEL_LEN - max_tokens - 1, MAX_MODEL_LEN - max_tokens]  # near max_model_len
    assert len(lengths) >= 20
    for n in lengths:
        prompt = random_prompt(rng, n)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        got = r.choices[0].model_extra["token_ids"]
        assert got == reference_tokens(reference, prompt, max_tokens), f"prompt of {n} tokens diverged"


# ---- criterion 4: the KV really moved ---------------------------------------------------------


@pytest.mark.parametrize("n", [400, 256])  # 256: the prompt ends on a block boundary, the prefill's token starts a block
def test_decode_engine_loads_the_prompt_over_nixl(pd: Running, client: openai.OpenAI, n: int) -> None:
    prompt = random_prompt(random.Random(7 + n), n)  # apart: the decode engine caches what it pulled
    before = metrics(pd)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == n
    after = metrics(pd)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    # The client's first token was the prefill's (routing.first_token: prefill, the default):
    # the router timed no hand-off before it. The decode engine went on from the prompt plus
    # that token: it took every prompt token from the prefill engine's KV and computed the
    # token itself, as its first step.
    assert delta("tandem_request_phase_seconds_count", phase="first_token") == 1
    assert delta("tandem_request_phase_seconds_count", phase="route") == 0
    # Before the router, the ingress timed vLLM's serving layer parsing and tokenizing it.
    assert delta("tandem_request_phase_seconds_count", phase="ingress") == 1
    assert delta("tandem_request_phase_seconds_sum", phase="ingress") > 0
    loaded = delta("tandem_prompt_tokens_total", pool="decode", source="external_kv_transfer")
    recomputed = delta("tandem_prompt_tokens_total", pool="decode", source="local_compute")
    assert loaded == n, "the decode engine must take every prompt token from the prefill engine's KV"
    assert recomputed == 1
    assert delta("tandem_prompt_tokens_total", pool="prefill", source="local_compute") == n
    # 128-token blocks at 2 layers x K,V x 2 heads x 32 dims x 2 bytes = 32 KiB per block per layer.
    assert delta("tandem_kv_transfer_bytes_total", pool="decode") == -(-n // 128) * 2 * 32768
    assert delta("tandem_kv_transfers_total", pool="decode") == 1
    assert delta("tandem_kv_transfer_bytes_total", pool="prefill") == 0
    assert delta("tandem_fallbacks_total") == 0


# ---- criterion 5: bad input gets a 4xx (every shape is checked against vLLM's own server in
# tests/test_openai_parity.py) ------------------------------------------------------------------


def test_bad_input_is_an_openai_client_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_client_disconnect_aborts_decode(pd: Running, client: openai.OpenAI) -> None:
    before = metric(metrics(pd), "tandem_engine_requests_aborted_total", pool="decode")
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{pd.url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one event arrives, then the client hangs up
    deadline = time.time() + 60
    while metric(metrics(pd), "tandem_engine_requests_aborted_total", pool="decode") <= before:
        assert time.time() < deadline, "the decode engine never aborted the abandoned request"
        time.sleep(0.5)
    assert client.completions.create(model=MODEL, prompt="next", max_tokens=2, temperature=0).usage.completion_tokens >= 1


def test_a_client_leaving_does_not_stop_another_request_under_its_request_id(pd: Running) -> None:
    """Clients reuse X-Request-Id; each request runs apart on the engines, so one client
    hanging up stops only its own request."""
    before = metric(metrics(pd), "tandem_engine_requests_aborted_total", pool="decode")
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"X-Request-Id": "shared-id"}

    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", f"{pd.url}/completions", json=body, headers=headers) as leaves:
                assert leaves.status_code == 200
                async with http.stream("POST", f"{pd.url}/completions", json=body, headers=headers) as stays:
                    assert stays.status_code == 200
                    lines = stays.aiter_lines()
                    first = await anext(lines)
                    await anext(leaves.aiter_lines())
                    await leaves.aclose()  # the first client hangs up while both stream
                    return [first] + [line async for line in lines]

    events = [json.loads(line.removeprefix("data: ")) for line in asyncio.run(go()) if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 400  # the other request ran to its end
    deadline = time.time() + 60
    while (aborted := metric(metrics(pd), "tandem_engine_requests_aborted_total", pool="decode")) <= before:
        assert time.time() < deadline, "the decode engine never aborted the abandoned request"
        time.sleep(0.5)
    assert aborted == before + 1


def test_a_prompt_the_tier_does_not_hold_costs_the_engine_no_lookup(pd: Running, client: openai.OpenAI) -> None:
    """The router follows what the CPU tier holds (the index's feed) and tells the prefill
    engine; told the tier holds none of a prompt, the engine does not ask the index. Counted
    by the index on /metrics."""

    def tier(name: str) -> float:
        return metric(metrics(pd), f"tandem_cpu_tier_{name}")

    rng = random.Random(7)
    client.completions.create(model=MODEL, prompt=random_prompt(rng, 300), max_tokens=1)  # the router's view is live
    time.sleep(1.0)
    fresh = random_prompt(rng, 300)
    before, saved, hits = tier("lookups_total"), tier("saved_blocks_total"), tier("hit_blocks_total")
    client.completions.create(model=MODEL, prompt=fresh, max_tokens=2, temperature=0)
    assert tier("lookups_total") == before
    time.sleep(1.0)  # its blocks were saved; the router hears so from the feed
    assert tier("saved_blocks_total") >= saved + 2  # 300 tokens: two full blocks of 128
    client.completions.create(model=MODEL, prompt=fresh, max_tokens=2, temperature=0)
    assert tier("lookups_total") == before + 1  # now the tier holds it: the engine looks it up
    assert tier("hit_blocks_total") >= hits + 2 and tier("blocks") <= tier("capacity_blocks")


def test_engines_listen_on_the_configured_token_path_ports(pd: Running) -> None:
    ports = sorted(int(info.stream_address.rpartition(":")[2]) for info in pd.deployment.infos)
    assert ports == [TOKEN_PATH_PORT, TOKEN_PATH_PORT + 1]


def test_engine_abort_ends_the_stream_and_counts_as_aborted(reference: EngineRef) -> None:
    """An abort reaching vLLM before the stream is cancelled still counts as aborted."""
    import ray

    before = ray.get(reference.handle.get_stats.remote()).num_requests_aborted
    req = EngineRequest("abort-me", [1, 2, 3], SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))

    async def run() -> list:
        chunks = []
        async for out in stream(reference.stream_address, req):
            chunks.append(out)
            if len(chunks) == 1:
                await reference.handle.abort.remote(req.request_id)
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "abort"
    assert sum(len(c.outputs[0].token_ids) for c in chunks) < 900
    assert ray.get(reference.handle.get_stats.remote()).num_requests_aborted == before + 1


def stream_batched(engine: EngineRef, prompt: list[int], n: int, batch_s: float) -> tuple[list[RequestOutput], float]:
    """Stream `n` greedy tokens from `engine` with `stream_batch_s=batch_s`; the outputs and seconds taken."""

    async def run() -> tuple[list[RequestOutput], float]:
        sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        req = EngineRequest(f"batched-{random.random()}", prompt, sampling, stream_batch_s=batch_s)
        t0 = time.perf_counter()
        chunks = [c async for c in stream(engine.stream_address, req)]
        return chunks, time.perf_counter() - t0

    return asyncio.run(run())


def test_streamed_tokens_may_leave_in_batches_but_unchanged(reference: EngineRef) -> None:
    """With stream_batch_s the engine holds decoded tokens back and sends several per chunk."""
    prompt, n, batch_s = random_prompt(random.Random(5), 40), 64, 0.2
    chunks, elapsed = stream_batched(reference, prompt, n, batch_s)
    assert [t for c in chunks for t in c.outputs[0].token_ids] == reference_tokens(reference, prompt, n)
    # The first token must not wait for a batch. It may still share its chunk with the next
    # one: vLLM merges the outputs a late reader has not taken yet (on a busy host the engine
    # actor's loop can run after two steps), so the exact rule is tested on a synthetic stream
    # (test_stream_batching); here the first chunk only has to be smaller than a batch.
    sizes = [len(c.outputs[0].token_ids) for c in chunks]
    assert sizes[0] < max(sizes), f"the first chunk waited for a batch: {sizes}"
    # Chunks leave as they come until one shows text (the first token may be part of a
    # character); after it, each chunk but the last leaves at least batch_s after the one before.
    shown = next(i for i, c in enumerate(chunks) if c.outputs[0].text)
    assert len(chunks) - shown <= 2 + elapsed / batch_s, f"{len(chunks)} chunks in {elapsed:.2f} s"


def test_last_tokens_leave_when_decoded_not_at_the_next_batch_tick(reference: EngineRef) -> None:
    """A batch interval far longer than the whole decode: the first text leaves at once, every
    later token with the finish as soon as the request ends, not when the interval runs out."""
    prompt, n, batch_s = random_prompt(random.Random(6), 20), 24, 60.0
    chunks, elapsed = stream_batched(reference, prompt, n, batch_s)
    # Chunks leave as they come until one shows text (the first token may be part of a
    # character), then everything else in one chunk with the finish.
    shown = next(i for i, c in enumerate(chunks) if c.outputs[0].text)
    assert len(chunks) == shown + 2, [c.outputs[0].text for c in chunks]
    assert chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "length"
    assert [t for c in chunks for t in c.outputs[0].token_ids] == reference_tokens(reference, prompt, n)
    assert elapsed < batch_s, "the stream's end waited for the batch interval"


def test_a_router_reading_late_gets_the_engines_outputs_merged_and_unchanged(reference: EngineRef) -> None:
    """Per-step streaming read by a router that falls behind (its ingress busy): the outputs
    that waited reach it merged, as vLLM's collector merges them, with every token, logprob
    and character an undisturbed stream has, in order."""
    prompt, n = random_prompt(random.Random(8), 30), 48
    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)

    async def read(late: bool) -> list[RequestOutput]:
        req = EngineRequest(f"late-{random.random()}", prompt, sampling)
        chunks = []
        outputs = stream_engine(EngineStreams(), reference, req) if late else stream(reference.stream_address, req)
        async for out in outputs:
            chunks.append(out)
            if late:
                await asyncio.sleep(0.05)  # a decode step of the tiny model takes a few ms
        return chunks

    merged, each = asyncio.run(read(late=True)), asyncio.run(read(late=False))
    assert len(merged) < len(each) and max(len(c.outputs[0].token_ids) for c in merged) > 1
    def logprob_ids(chunks: list[RequestOutput]) -> list[list[int]]:
        """Each token's logprob entries by token id: which ones, in which order (not the floats)."""
        return [sorted(entry) for c in chunks for entry in c.outputs[0].logprobs]

    assert logprob_ids(merged) == logprob_ids(each) and len(logprob_ids(merged)) == n
    assert "".join(c.outputs[0].text for c in merged) == "".join(c.outputs[0].text for c in each)
    assert [t for c in merged for t in c.outputs[0].token_ids] == reference_tokens(reference, prompt, n)
    assert merged[-1].finished and merged[-1].outputs[0].finish_reason == "length"


def test_metrics_page_is_prometheus_text(pd: Running, client: openai.OpenAI) -> None:
    before = metrics(pd)
    client.completions.create(model=MODEL, prompt="counted", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    client.completions.create(model=MODEL, prompt="decoded", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    httpx.post(f"{pd.url}/completions", json={"model": MODEL}, timeout=60)
    m = metrics(pd)
    # vLLM's own decode timing, from the decode engine; the prefill engine makes one token a
    # request (the first, streamed to the client), the decode engine the rest.
    assert metric(m, "tandem_engine_decoded_requests_total", pool="decode") - metric(before, "tandem_engine_decoded_requests_total", pool="decode") == 2
    assert metric(m, "tandem_engine_tpot_seconds_total", pool="decode") > metric(before, "tandem_engine_tpot_seconds_total", pool="decode")
    assert metric(m, "tandem_engine_decoded_requests_total", pool="prefill") == 0
    assert metric(m, "tandem_requests_total", status="200") > 0
    assert metric(m, "tandem_requests_total", status="400") > 0
    assert metric(m, "tandem_time_to_first_token_seconds_count") > 0


def test_a_clients_request_id_names_the_response_and_a_bad_one_is_a_400(pd: Running) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    ok = httpx.post(f"{pd.url}/completions", json=body, headers={"X-Request-Id": "trace-42"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["id"] == "cmpl-trace-42"
    bad = httpx.post(f"{pd.url}/completions", json=body, headers={"X-Request-Id": "no spaces/or slashes"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
