"""The load generator over real HTTP against a fake OpenAI-compatible streaming server.

The fake server answers `/v1/completions` with SSE chunks after known delays, so measured
TTFT and ITL can be checked against them (with bounds generous enough for a busy machine).
Special prompts make it fail: "FAIL" answers HTTP 500, "BREAK" sends an error chunk mid-stream,
"SLOW" stalls for seconds; "HELD" streams its first token with no text.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.loadgen import HostCpu, RunResult, arrival_times, cpu_times, host_cpu_between, run_load, run_sweep, scrape_metrics
from benchmarks.stats import SLO
from benchmarks.workloads import BenchRequest, Fixed, RandomWorkload
from tests.conftest import free_port

TTFT_S = 0.2
ITL_S = 0.05
HELD_S = 2.0  # "HELD": the wait for the second token, the first with text


class FakeServer:
    """Records what it received and counts finished requests, exposed as a Prometheus counter."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.finished = 0
        # (received, ended) perf_counter times of each request, in order of arrival.
        self.spans: list[list[float]] = []
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/metrics", self.metrics),
        ]
        self.app = Starlette(routes=routes)

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.spans.append([time.perf_counter(), 0.0])
        if body["prompt"] == "FAIL":
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        if body["prompt"] == "LINE_BREAKS":
            # Unicode line breaks JSON leaves unescaped, as UTF-8 servers (vLLM, Tandem) send them.
            chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a\u2028b", "c\x85d", "e\u2029")]
            events = [f"data: {json.dumps(c, ensure_ascii=False)}\r\n\r\n" for c in chunks] + ["data: [DONE]\r\n\r\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")
        if body["prompt"] == "OLD_BREAK":
            chunk = {"object": "error", "message": "old-style failure"}
            return StreamingResponse(iter([f"data: {json.dumps(chunk)}\n\n"]))
        return StreamingResponse(self._stream(body, self.spans[-1]), media_type="text/event-stream")

    async def _stream(self, body: dict, span: list[float]) -> AsyncIterator[str]:
        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        await asyncio.sleep(30 if body["prompt"] == "SLOW" else TTFT_S)
        held = body["prompt"] == "HELD"  # the first token's text is held back, as a byte-level
        for i in range(body["max_tokens"]):  # tokenizer does for a token ending inside a character
            if i:
                await asyncio.sleep(HELD_S if held and i == 1 else ITL_S)
            ids = {"token_ids": [900 + i]} if body.get("return_token_ids") else {}
            yield event({"choices": [{"index": 0, "text": "" if held and i == 0 else f" t{i}", **ids}]})
            if body["prompt"] == "BREAK":
                yield event({"error": {"message": "engine died", "code": 500}})
                return
        prompt = body["prompt"]
        usage = {
            "prompt_tokens": len(prompt) if isinstance(prompt, list) else len(prompt.split()),
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": 1},
        }
        self.finished += 1  # before the client can see the end, so a scrape after it counts it
        span[1] = time.perf_counter()
        yield event({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    async def metrics(self, request: Request) -> Response:
        text = (
            "# HELP tandem_fake_requests Finished requests.\n"
            "# TYPE tandem_fake_requests counter\n"
            f'tandem_fake_requests_total{{engine="a"}} {self.finished}\n'
            f'tandem_fake_requests_total{{engine="b"}} {self.finished}\n'
            "# HELP tandem_fake_slowest Slowest request, seconds.\n"
            "# TYPE tandem_fake_slowest gauge\n"
            'tandem_fake_slowest{engine="a"} 0.25\n'
            'tandem_fake_slowest{engine="b"} 1.5\n'
        )
        return PlainTextResponse(text)


@pytest.fixture
def server() -> Iterator[tuple[FakeServer, str]]:
    fake = FakeServer()
    port = free_port()
    config = uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    yield fake, f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(timeout=10)


def _requests(n: int, max_tokens: int = 5, prompt: str = "hello there") -> list[BenchRequest]:
    return [BenchRequest(f"{prompt} {i}", max_tokens) for i in range(n)]


def _run(base_url: str, requests: list[BenchRequest], **kwargs) -> RunResult:
    return asyncio.run(run_load(base_url, "fake", requests, progress=False, **kwargs))


def test_measured_ttft_and_itl_follow_the_servers_delays(server) -> None:
    _, url = server
    result = _run(url, _requests(3), concurrency=3)
    assert result.summary.num_completed == 3
    for r in result.requests:
        assert TTFT_S <= r.ttft < TTFT_S + 1.0
        assert len(r.itls) == 4 and all(gap < ITL_S + 1.0 for gap in r.itls)
        assert r.latency >= r.token_times[-1] >= TTFT_S + 4 * ITL_S
    # Medians, not every gap: a stalled client can read two chunks in one go.
    s = result.summary
    assert TTFT_S * 1000 <= s.ttft_ms.p50 < (TTFT_S + 1.0) * 1000
    assert ITL_S * 500 <= s.itl_ms.p50 < (ITL_S + 1.0) * 1000
    assert ITL_S * 500 <= s.tpot_ms.p50 < (ITL_S + 1.0) * 1000


def test_a_token_whose_text_is_held_back_is_timed_on_arrival_as_vllms_client_does(server) -> None:
    """The first chunk carries a token with no text yet: TTFT is its arrival, not the
    next chunk's, and it counts as an interval like any token."""
    _, url = server
    (r,) = _run(url, [BenchRequest("HELD", 3)]).requests
    assert r.error is None and len(r.token_times) == 3
    assert TTFT_S <= r.ttft < TTFT_S + 1.0 < HELD_S
    assert r.itls[0] >= HELD_S - 0.05


def test_usage_is_read_from_the_final_chunk(server) -> None:
    _, url = server
    (r,) = _run(url, _requests(1, max_tokens=4)).requests
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (3, 4, 1)


def test_requests_stream_with_usage_and_exact_lengths(server) -> None:
    fake, url = server
    _run(url, _requests(1), extra_body={"temperature": 0.0})
    (body,) = fake.bodies
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["temperature"] == 0.0 and body["model"] == "fake"


def test_warmup_requests_are_sent_first_and_excluded(server) -> None:
    fake, url = server
    requests = _requests(5)
    result = _run(url, requests, warmup=2, metric_names=["tandem_fake_requests_total"])
    received = [b["prompt"] for b in fake.bodies]
    assert sorted(received[:2]) == [r.prompt for r in requests[:2]]  # sent together, any order
    assert sorted(received[2:]) == [r.prompt for r in requests[2:]]
    assert result.summary.num_requests == 3 and len(result.requests) == 3
    # Two engines each count the 3 measured requests; warm-up finished before the first scrape.
    assert result.summary.server_metrics == {"tandem_fake_requests_total": 6.0}


def test_max_requests_bounds_what_is_sent(server) -> None:
    fake, url = server
    result = _run(url, _requests(10), max_requests=4)
    assert len(fake.bodies) == 4 and result.summary.num_requests == 4


def test_duration_bounds_what_is_sent(server) -> None:
    fake, url = server
    # Constant 10 req/s for 0.35 s sends at 0, 0.1, 0.2 and 0.3 s at most.
    result = _run(url, _requests(20), rate=10.0, arrival="constant", duration_s=0.35)
    assert 1 <= len(fake.bodies) <= 4
    assert result.summary.num_completed == len(fake.bodies)


def test_requests_leave_no_earlier_than_their_arrival_time(server) -> None:
    _, url = server
    result = _run(url, _requests(6), rate=20.0, arrival="poisson", seed=11)
    schedule = arrival_times(6, 20.0, "poisson", seed=11)
    for r, offset in zip(result.requests, schedule):
        assert r.start >= offset - 0.01


def test_concurrency_cap_limits_requests_in_flight(server) -> None:
    _, url = server
    result = _run(url, _requests(4), concurrency=1)
    spans = sorted((r.start, r.start + r.latency) for r in result.requests)
    assert all(end <= next_start + 1e-3 for (_, end), (next_start, _) in zip(spans, spans[1:]))


def test_an_http_error_is_counted_as_a_failure_with_its_text(server) -> None:
    _, url = server
    result = _run(url, [BenchRequest("FAIL", 5), *_requests(2)])
    s = result.summary
    assert (s.num_failed, s.num_completed) == (1, 2)
    ((text, count),) = s.errors.items()
    assert count == 1 and text.startswith("HTTP 500") and "injected failure" in text


def test_an_error_chunk_mid_stream_is_a_failure(server) -> None:
    _, url = server
    (r,) = _run(url, [BenchRequest("BREAK", 5)]).requests
    assert not r.ok and "engine died" in r.error


def test_events_split_at_lf_only_not_at_unicode_line_breaks_inside_json(server) -> None:
    _, url = server
    (r,) = _run(url, [BenchRequest("LINE_BREAKS", 3)]).requests
    assert r.ok, r.error
    assert len(r.token_times) == 3


def test_an_old_style_error_chunk_is_a_failure(server) -> None:
    _, url = server
    (r,) = _run(url, [BenchRequest("OLD_BREAK", 5)]).requests
    assert r.error == "stream error: old-style failure"


def test_a_stalled_request_times_out_as_a_failure(server) -> None:
    _, url = server
    (r,) = _run(url, [BenchRequest("SLOW", 5)], request_timeout_s=0.5).requests
    assert r.error == "timed out after 0.5 s"


def test_a_refused_connection_is_a_failure() -> None:
    result = _run(f"http://127.0.0.1:{free_port()}", _requests(1))
    assert result.summary.num_failed == 1
    assert "ConnectError" in result.requests[0].error


class CharTokenizer:
    """Token ids of text: one per character (its code point), after a BOS of 1 if asked."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_a_chats_turn_resends_the_servers_answer_as_token_ids_once_the_turn_before_ended(server) -> None:
    fake, url = server
    turns = [BenchRequest("ab", 3, chat=0), BenchRequest("x", 2, chat=1), BenchRequest("c", 2, chat=0)]
    result = _run(url, turns, tokenizer=CharTokenizer())  # all due at once: chat 0's second turn waits for its first
    assert result.summary.num_completed == 3
    first, other, second = fake.bodies
    assert first["prompt"] == [1, ord("a"), ord("b")] and first["return_token_ids"] is True
    assert other["prompt"] == [1, ord("x")]
    # The first turn's prompt, the answer the server streamed for it (900, 901, 902), then
    # the turn's own text, with no BOS in the middle.
    assert second["prompt"] == [1, ord("a"), ord("b"), 900, 901, 902, ord("c")]
    assert fake.spans[2][0] >= fake.spans[0][1] > 0
    assert result.requests[2].prompt_tokens == 7


def test_a_turn_waiting_for_the_one_before_leaves_its_slot_under_the_concurrency_cap_to_others(server) -> None:
    fake, url = server
    # Two slots, all due at once: chat 0's second turn waits for its first; chat 1's first
    # turn takes the slot it leaves instead of waiting for chat 0's first turn to end.
    turns = [BenchRequest("ab", 3, chat=0), BenchRequest("c", 2, chat=0), BenchRequest("x", 2, chat=1)]
    result = _run(url, turns, tokenizer=CharTokenizer(), concurrency=2)
    assert result.summary.num_completed == 3
    assert [b["prompt"][-1] for b in fake.bodies] == [ord("b"), ord("x"), ord("c")]
    assert fake.spans[1][0] < fake.spans[0][1]  # chat 1 was on the server while chat 0's first turn ran


def test_chats_of_server_answers_need_a_tokenizer(server) -> None:
    _, url = server
    with pytest.raises(ValueError, match="tokenizer"):
        asyncio.run(run_load(url, "fake", [BenchRequest("ab", 3, chat=0)], progress=False))


def test_host_cpu_is_the_busy_and_stolen_share_of_all_cpu_time(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    before = cpu_times(str(stat))
    assert before == [100, 0, 50, 800, 10, 0, 0, 40]
    # 1000 ticks later: 300 user, 100 system, 500 idle, 0 iowait, 100 steal.
    stat.write_text("cpu  400 0 150 1300 10 0 0 140 0 0\n")
    host = host_cpu_between(before, cpu_times(str(stat)))
    assert host == HostCpu(busy=pytest.approx(0.5), steal=pytest.approx(0.1))
    assert cpu_times(str(tmp_path / "missing")) is None
    assert host_cpu_between(None, before) is None
    assert host_cpu_between(before, before) is None  # no time passed


def test_a_run_records_how_busy_this_host_was(server) -> None:
    _, url = server
    host = _run(url, _requests(2), concurrency=2).host_cpu
    assert host is not None and 0.0 <= host.steal <= host.busy <= 1.0


def test_a_run_freezes_what_this_process_held_before_measuring(server) -> None:
    """A full garbage collection over a process holding vLLM, torch and Ray stalls the client
    for half a second; objects frozen before measuring are never scanned again."""
    _, url = server
    held = [[] for _ in range(10_000)]  # containers: what the collector tracks
    before = gc.get_freeze_count()
    _run(url, _requests(1))
    assert gc.get_freeze_count() >= before + len(held)


def test_constant_arrivals_are_evenly_spaced() -> None:
    assert arrival_times(4, 2.0, "constant", seed=0) == [0.0, 0.5, 1.0, 1.5]


def test_no_rate_sends_everything_at_once() -> None:
    assert arrival_times(3, None, "poisson", seed=0) == [0.0, 0.0, 0.0]


def test_poisson_arrivals_are_reproducible_from_the_seed() -> None:
    assert arrival_times(50, 4.0, "poisson", seed=1) == arrival_times(50, 4.0, "poisson", seed=1)
    assert arrival_times(50, 4.0, "poisson", seed=1) != arrival_times(50, 4.0, "poisson", seed=2)


def test_poisson_arrivals_average_the_requested_rate() -> None:
    times = arrival_times(20001, 4.0, "poisson", seed=0)
    assert times[-1] / 20000 == pytest.approx(0.25, rel=0.05)


def test_slo_figures_are_part_of_the_summary(server) -> None:
    _, url = server
    loose = SLO(ttft_ms=60_000, tpot_ms=60_000)
    summary = _run(url, [BenchRequest("FAIL", 5), *_requests(3)], slo=loose).summary
    assert summary.slo_attainment == pytest.approx(0.75)
    assert summary.goodput == pytest.approx(3 / summary.duration_s)


def test_a_sweep_runs_each_rate_with_fresh_prompts(server) -> None:
    fake, url = server
    workload = RandomWorkload(input_len=Fixed(4), output_len=Fixed(2))
    results = asyncio.run(
        run_sweep(url, "fake", workload, 2, rates=[50.0, 100.0], seed=3, progress=False)
    )
    assert [r.config.rate for r in results] == [50.0, 100.0]
    assert [r.config.seed for r in results] == [3, 4]
    assert all(r.config.workload == workload for r in results)
    prompts = [b["prompt"] for b in fake.bodies]
    assert len(prompts) == 4 and len(set(prompts)) == 4


def test_a_run_result_round_trips_through_json(server) -> None:
    _, url = server
    result = _run(url, _requests(2))
    assert msgspec.json.decode(msgspec.json.encode(result), type=RunResult) == result
    assert result.environment.cpu_count and result.environment.python


def test_scraping_sums_a_counter_over_its_labels(server) -> None:
    _, url = server
    values = asyncio.run(scrape_metrics(url, ["tandem_fake_requests_total", "tandem_absent"]))
    assert values == {"tandem_fake_requests_total": 0.0}


def test_a_label_selector_keeps_only_matching_label_sets(server) -> None:
    fake, url = server
    _run(url, _requests(2))
    names = ['tandem_fake_requests_total{engine="a"}', "tandem_fake_requests_total", 'tandem_fake_requests_total{engine="z"}']
    values = asyncio.run(scrape_metrics(url, names))
    assert values == {names[0]: fake.finished, names[1]: 2 * fake.finished}


def test_a_gauge_can_be_combined_by_max_instead_of_sum(server) -> None:
    _, url = server
    assert asyncio.run(scrape_metrics(url, ["tandem_fake_slowest"], combine=max)) == {"tandem_fake_slowest": 1.5}
    assert asyncio.run(scrape_metrics(url, ["tandem_fake_slowest"])) == {"tandem_fake_slowest": 1.75}
