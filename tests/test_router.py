"""The router against fake engines (pure logic) on a real token path: streaming, engine choice,
prefill retries and fallback, mid-stream migration, cancellation at every phase. The real
engines and real process deaths are exercised in tests/test_serving.py and tests/test_faults.py."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from actors.protocol import CacheUpdate, EngineRequest
from actors.stream import EngineStreams
from connectors.config import PREFILLED_TOKENS
from orchestrator.config import RoutingConfig
from orchestrator.protocol import EngineRef
from orchestrator.router import (
    EnginePicker,
    MigrationLimitError,
    NoEngineError,
    RequestTrace,
    Router,
    UnresumableError,
    stream_engine,
)
from tests.fake_engine import FakeEngineBase
from tests.outputs import output, tokens

REQ = EngineRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=2))
CHUNKS = [output("a", [5]), output("b", [6], finished=True, finish_reason="length")]


def _done(value: Any) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.remote = fn


class SilentEndEngine(FakeEngineBase):
    """An engine that streams CHUNKS and then never ends its stream, as one whose end frame is
    late; records aborts."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[str] = []
        self.abort = _Method(self._abort)

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        for chunk in CHUNKS:
            yield chunk
            await asyncio.sleep(0.2)  # apart: a router reading late would get them merged
        await asyncio.Event().wait()

    def _abort(self, request_id: str, kv_params: dict[str, Any] | None = None) -> asyncio.Future:
        self.aborted.append(request_id)
        return _done(None)

    def ref(self) -> EngineRef:
        return EngineRef("e", "decode", self, stream_address=self.address)


def test_the_stream_ends_at_the_finished_chunk_without_waiting_for_the_end_of_stream() -> None:
    engine = SilentEndEngine()

    async def collect() -> list[RequestOutput]:
        streams = EngineStreams()
        return [c async for c in stream_engine(streams, engine.ref(), REQ)]

    assert tokens(asyncio.run(asyncio.wait_for(collect(), timeout=10))) == tokens(CHUNKS)
    assert engine.aborted == []


def test_a_consumer_leaving_before_the_finished_chunk_aborts_the_request() -> None:
    engine = SilentEndEngine()

    async def leave_after_one() -> None:
        stream = stream_engine(EngineStreams(), engine.ref(), REQ)
        assert tokens([await anext(stream)]) == tokens(CHUNKS[:1])
        await stream.aclose()

    asyncio.run(leave_after_one())
    assert engine.aborted == ["r-1"]


class RecordingEngine(FakeEngineBase):
    """An engine that records each request and answers with one finished chunk (a prefill's
    carries kv_transfer_params, as vLLM's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[EngineRequest] = []
        self.abort = _Method(lambda request_id, kv_params=None: _done(None))

    def ref(self, engine_id: str, role: str) -> EngineRef:
        return EngineRef(engine_id, role, self, stream_address=self.address)  # type: ignore[arg-type]

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(req)
        params = {"remote_engine_id": "p"} if req.kv_transfer_params == {"do_remote_decode": True} else None
        yield output("x", [7], finished=True, finish_reason="length", kv_transfer_params=params)


def test_only_the_streaming_request_may_batch_tokens() -> None:
    prefill, decode = RecordingEngine(), RecordingEngine()
    router = Router([prefill.ref("p", "prefill"), decode.ref("d", "decode")],
                    RoutingConfig(policy="round_robin", first_token="decode"), stream_batch_s=0.02)

    async def run() -> list[RequestOutput]:
        return [c async for c in router.generate(EngineRequest("r-2", [1, 2, 3], SamplingParams(max_tokens=4)), RequestTrace())]

    assert [c.outputs[0].token_ids for c in asyncio.run(run())] == [[7]]
    (p,), (d,) = prefill.requests, decode.requests
    # The prefill answers with a single token: holding it back would only delay the decode.
    assert p.stream_batch_s == 0.0 and p.sampling.max_tokens == 1
    assert d.stream_batch_s == 0.02 and d.kv_transfer_params == {"remote_engine_id": "p"}


def test_the_prefill_computes_one_token_of_one_sequence_and_nothing_else() -> None:
    prefill, decode = RecordingEngine(), RecordingEngine()
    router = Router([prefill.ref("p", "prefill"), decode.ref("d", "decode")], RoutingConfig(policy="round_robin"))
    sampling = SamplingParams(max_tokens=9, temperature=0.7, seed=3, logprobs=2, n=1,
                              structured_outputs=StructuredOutputsParams(regex="[0-9]+"))

    async def run() -> None:
        async for _ in router.generate(EngineRequest("r-3", [1, 2, 3], sampling), RequestTrace()):
            pass

    asyncio.run(run())
    (p,), (d,) = prefill.requests, decode.requests
    assert (p.sampling.max_tokens, p.sampling.n, p.sampling.logprobs, p.sampling.structured_outputs) == (1, 1, None, None)
    assert d.sampling == sampling  # the decode runs the request as the client asked
    assert sampling.max_tokens == 9 and sampling.logprobs == 2  # the client's settings are not touched


def test_several_sequences_pull_the_kv_once_then_share_it() -> None:
    """vLLM's decode side would pull the prefill's blocks once per sequence, and the prefill
    side frees them after the first pull: the router pulls once, the sequences share it."""
    prefill, decode = RecordingEngine(), RecordingEngine()
    router = Router([prefill.ref("p", "prefill"), decode.ref("d", "decode")], RoutingConfig(policy="round_robin"))

    async def run() -> None:
        async for _ in router.generate(EngineRequest("r-4", [1, 2, 3], SamplingParams(max_tokens=5, n=3, temperature=1.0)), RequestTrace()):
            pass

    asyncio.run(run())
    assert len(prefill.requests) == 1
    pull, sequences = decode.requests
    assert pull.kv_transfer_params == {"remote_engine_id": "p"} and pull.sampling.n == 1 and pull.sampling.max_tokens == 1
    assert sequences.kv_transfer_params is None and sequences.sampling.n == 3


def test_a_request_that_needs_prompt_logprobs_is_prefilled_where_it_streams() -> None:
    prefill, decode = RecordingEngine(), RecordingEngine()
    router = Router([prefill.ref("p", "prefill"), decode.ref("d", "decode")], RoutingConfig(policy="round_robin"))

    async def run() -> None:
        async for _ in router.generate(EngineRequest("r-5", [1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=1)), RequestTrace()):
            pass

    asyncio.run(run())
    assert prefill.requests == [] and decode.requests[0].kv_transfer_params is None
    assert {k: v for k, v in router.stats.decisions.items() if v} == {"local:prompt_logprobs": 1}


# ---- failover and cancellation against fake engines ------------------------------------


class FakeEngine(FakeEngineBase):
    """An engine with a deterministic "model": after a prompt of n tokens the next token is
    1000 + n, so a request resumed from its prompt plus the tokens already streamed continues
    the same sequence. A prefill (do_remote_decode) answers with one chunk carrying
    kv_transfer_params naming this engine. It can be dead from the start, die after some
    output tokens (its token path closes, as a killed process's), hang, end a request with
    finish_reason "error", or reject input as vLLM does."""

    def __init__(self, name: str, *, dead: bool = False, die_after: int | None = None, hang: bool = False,
                 error_finish: bool = False, reject: bool = False, step_s: float = 0.0) -> None:
        super().__init__(dead=dead)
        self.name = name
        # Time between two outputs: with 0 a router that reads late gets them merged.
        self.step_s = step_s
        self.die_after, self.hang, self.error_finish, self.reject = die_after, hang, error_finish, reject
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.released: list[tuple[str, dict[str, Any]]] = []
        # What abort() answers: the kv_transfer_params of a prefill that had finished.
        self.abort_answer: dict[str, Any] | None = None
        self.abort = _Method(self._abort)
        self.release_remote_kv = _Method(self._release)
        self.cache_updates = _Method(self._cache_updates)

    def ref(self, role: str, incarnation: str = "i0") -> EngineRef:
        return EngineRef(self.name, role, self, incarnation, stream_address=self.address)  # type: ignore[arg-type]

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(req)
        if self.reject:
            raise ValueError("prompt too long")
        if self.hang:
            await asyncio.Event().wait()
        n = len(req.prompt_token_ids)
        if req.kv_transfer_params == {"do_remote_decode": True}:
            yield output("p", [1000 + n], finished=True, finish_reason="length",
                         kv_transfer_params={"remote_engine_id": self.name})
            return
        for i in range(req.sampling.max_tokens):
            if self.die_after is not None and i == self.die_after:
                await self.die()
                await asyncio.Event().wait()
            last = i == req.sampling.max_tokens - 1
            if last and self.error_finish:
                yield output("", [], finished=True, finish_reason="error")
                return
            yield output(f"t{1000 + n + i}", [1000 + n + i], finished=last, finish_reason="length" if last else None)
            await asyncio.sleep(self.step_s)

    def _abort(self, request_id: str, kv_params: dict[str, Any] | None = None) -> asyncio.Future:
        self.aborted.append(request_id)
        return _done(self.abort_answer)

    def _release(self, request_id: str, kv_params: dict[str, Any]) -> asyncio.Future:
        self.released.append((request_id, kv_params))
        return _done(None)

    async def _cache_updates(self, incarnation: str, version: int, timeout_s: float, history_s: float = 0.0,
                             origin: str = "") -> CacheUpdate:
        """An empty prefix cache, reported once and then at every long-poll's end (kv_aware's view)."""
        if version:
            await asyncio.sleep(timeout_s)
        return CacheUpdate("i0", 1, True, [], [], 0, 0, 0.0)


PROMPT = [1, 2, 3]
UNDISTURBED = [1003 + i for i in range(8)]


def leg(engine_side_id: str) -> str:
    """An engine-side request name without the router's random part ("r-1a2b3c4d-p" -> "r-p")."""
    return re.sub(r"-[0-9a-f]{8}(?=-|$)", "", engine_side_id, count=1)


def routed(engines: list[EngineRef], **routing: Any) -> tuple[Router, list[Any]]:
    reports: list[Any] = []
    return Router(engines, RoutingConfig(**routing), report_failure=reports.append), reports


def run(router: Router, max_tokens: int = 8, trace: RequestTrace | None = None) -> list[RequestOutput]:
    async def go() -> list[RequestOutput]:
        gen = router.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0)), trace or RequestTrace())
        return [c async for c in gen]

    return asyncio.run(asyncio.wait_for(go(), timeout=30))


def nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


def test_two_requests_under_one_client_id_are_apart_on_the_engines() -> None:
    """Clients reuse X-Request-Id; an engine aborts by name, so the router names each request
    anew: leaving one of two same-named requests must not abort the other."""
    p, d = FakeEngine("p"), FakeEngine("d", step_s=0.1)  # the first client leaves mid-stream
    router, _ = routed([p.ref("prefill"), d.ref("decode")])

    async def go() -> list[RequestOutput]:
        left = router.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=8)), RequestTrace())
        await anext(left)
        stays = [c async for c in router.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=8)), RequestTrace())]
        await left.aclose()  # the first client leaves after the second finished
        return stays

    outputs = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert tokens(outputs) == UNDISTURBED and {o.request_id for o in outputs} == {"r"}
    first, second = (r.request_id for r in d.requests)
    assert first != second and leg(first) == leg(second) == "r-d"
    assert d.aborted == [first]


def test_least_outstanding_never_picks_an_engine_whose_process_failed() -> None:
    a, b = FakeEngine("a").ref("decode"), FakeEngine("b").ref("decode")
    picker = EnginePicker([a, b], "least_outstanding")
    picker.acquire(b)
    picker.mark_failed(a)  # a dead engine has no requests in flight: it must still lose
    assert {picker.pick().engine_id for _ in range(4)} == {"b"}  # type: ignore[union-attr]


def test_a_new_incarnation_in_the_routing_table_ends_the_exclusion() -> None:
    a = FakeEngine("a")
    picker = EnginePicker([a.ref("decode", "i0")], "round_robin")
    picker.mark_failed(a.ref("decode", "i0"))
    assert picker.pick() is None
    picker.set_engines([a.ref("decode", "i1")])
    assert picker.pick() == a.ref("decode", "i1")


def test_a_failed_prefill_is_retried_on_another_prefill_replica() -> None:
    dead, live, d = FakeEngine("p0", dead=True), FakeEngine("p1"), FakeEngine("d")
    router, reports = routed([dead.ref("prefill"), live.ref("prefill"), d.ref("decode")], policy="round_robin")
    trace = RequestTrace()
    assert tokens(run(router, trace=trace)) == UNDISTURBED
    assert trace.fallback is None
    assert d.requests[0].kv_transfer_params == {"remote_engine_id": "p1", PREFILLED_TOKENS: len(PROMPT)}
    assert nonzero(router.stats.retries) == {"prefill_failed": 1}
    assert [r.engine.engine_id for r in reports] == ["p0"]
    assert router.pools["prefill"].pick().engine_id == "p1"  # type: ignore[union-attr]


def test_a_decode_engine_is_told_which_pulled_tokens_its_prefill_engine_saves_to_the_tier() -> None:
    """A prefill engine that saves to the CPU tier saves the prompt it computed; the decode
    engine pulling it hears so (TIER_SAVED), under either first-token protocol. From a prefill
    engine that does not save, nothing is said."""
    from actors.kv_index import TIER_SAVED

    for saves, first_token in ((True, "prefill"), (True, "decode"), (False, "prefill")):
        p, d = FakeEngine("p"), FakeEngine("d")
        prefill = msgspec.structs.replace(p.ref("prefill"), saves_tier=saves)
        router, _ = routed([prefill, d.ref("decode")], first_token=first_token)
        assert tokens(run(router)) == UNDISTURBED
        params = d.requests[0].kv_transfer_params
        assert params.get(TIER_SAVED) == (len(PROMPT) if saves else None), (saves, first_token, params)
        assert params["remote_engine_id"] == "p"


def test_a_prefill_past_its_timeout_is_aborted_and_retried_elsewhere() -> None:
    slow, fast, d = FakeEngine("p0", hang=True), FakeEngine("p1"), FakeEngine("d")
    router, reports = routed([slow.ref("prefill"), fast.ref("prefill"), d.ref("decode")], policy="round_robin",
                             prefill_timeout_s=0.2)
    trace = RequestTrace()
    assert tokens(run(router, trace=trace)) == UNDISTURBED
    assert [leg(a) for a in slow.aborted] == ["r-p"]
    assert d.requests[0].kv_transfer_params == {"remote_engine_id": "p1", PREFILLED_TOKENS: len(PROMPT)}
    assert nonzero(router.stats.retries) == {"prefill_timeout": 1}
    assert reports == []  # slow is not dead: it stays in routing
    # The route names the replica whose prefill was used, not the one abandoned.
    assert (trace.prefill_engine, trace.output_engine, trace.placement()) == ("p1", "d", "decision=remote;reason=always")


def test_with_no_prefill_replica_left_the_decode_engine_prefills_itself() -> None:
    p, d = FakeEngine("p0", dead=True), FakeEngine("d")
    router, _ = routed([p.ref("prefill"), d.ref("decode")])
    trace = RequestTrace()
    assert tokens(run(router, trace=trace)) == UNDISTURBED
    assert trace.fallback == "prefill_failed" and d.requests[0].kv_transfer_params is None
    assert nonzero(router.stats.fallbacks) == {"prefill_failed": 1}
    assert (trace.prefill_engine, trace.output_engine) == (None, "d")
    assert trace.placement() == "decision=remote;reason=always;fallback=prefill_failed"
    assert "served by d (remote: always), off the disaggregated path (prefill_failed)" in trace.describe(len(PROMPT), 8)


def test_an_input_the_engine_rejects_is_not_retried() -> None:
    p, d = FakeEngine("p0", reject=True), FakeEngine("d")
    router, reports = routed([p.ref("prefill"), FakeEngine("p1").ref("prefill"), d.ref("decode")])
    with pytest.raises(ValueError, match="prompt too long"):  # as vLLM raised it: the client's 400
        run(router)
    assert reports == [] and d.requests == []


def test_a_decode_engine_dying_mid_stream_hands_the_rest_to_another_decode_replica() -> None:
    p, d0, d1 = FakeEngine("p"), FakeEngine("d0", die_after=3), FakeEngine("d1")
    router, reports = routed([p.ref("prefill"), d0.ref("decode"), d1.ref("decode")], policy="round_robin")
    trace = RequestTrace()
    chunks = run(router, trace=trace)
    assert tokens(chunks) == UNDISTURBED  # no token repeated or lost
    assert chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "length"
    # The first token was the prefill's, three more d0's.
    resumed = d1.requests[0]
    assert resumed.prompt_token_ids == PROMPT + UNDISTURBED[:4] and resumed.resume_from == len(PROMPT)
    assert resumed.sampling.max_tokens == 4 and resumed.kv_transfer_params is None
    assert trace.migrations == 1 and router.stats.migrations == 1
    assert [r.engine.engine_id for r in reports] == ["d0"]
    line = trace.describe(len(PROMPT), 8)  # the request log names the engine it ended on
    assert (trace.prefill_engine, trace.output_engine) == ("p", "d1")
    assert line.startswith(f"request r: {len(PROMPT)} prompt tokens (0 cached), 8 generated; prefilled on p, streamed from d1 ")
    assert "moved to another engine 1x mid-stream" in line and re.search(r"; prefill [\d.]+ ms, first_token [\d.]+ ms", line), line


def test_with_no_decode_replica_left_a_prefill_engine_serves_the_rest() -> None:
    p, d = FakeEngine("p"), FakeEngine("d", die_after=2)
    router, _ = routed([p.ref("prefill"), d.ref("decode")])
    assert tokens(run(router)) == UNDISTURBED
    assert p.requests[-1].prompt_token_ids == PROMPT + UNDISTURBED[:3]  # the prefill's token, then d's two


def test_a_request_the_engine_ends_with_an_error_moves_instead_of_returning_it() -> None:
    p, d0, d1 = FakeEngine("p"), FakeEngine("d0", error_finish=True), FakeEngine("d1")
    router, reports = routed([p.ref("prefill"), d0.ref("decode"), d1.ref("decode")], policy="round_robin")
    chunks = run(router)
    assert tokens(chunks) == UNDISTURBED and chunks[-1].outputs[0].finish_reason == "length"
    assert all(c.outputs[0].finish_reason != "error" for c in chunks)
    assert [r.engine_down for r in reports] == [False]  # the engine may be fine: checked, not skipped


def test_a_structured_request_that_lost_its_engine_mid_stream_fails_instead_of_resuming() -> None:
    """The next engine would not have the grammar's state: a continuation could break it."""
    p, d0, d1 = FakeEngine("p"), FakeEngine("d0", die_after=3), FakeEngine("d1")
    router, _ = routed([p.ref("prefill"), d0.ref("decode"), d1.ref("decode")], policy="round_robin")
    sampling = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))

    async def go() -> list[RequestOutput]:
        return [c async for c in router.generate(EngineRequest("r", PROMPT, sampling), RequestTrace())]

    with pytest.raises(UnresumableError, match="structured output"):
        asyncio.run(go())
    assert d1.requests == [] and nonzero(router.stats.failed) == {"unresumable": 1}


def test_migrations_stop_at_the_limit_with_a_clear_error() -> None:
    engines = [FakeEngine("p").ref("prefill")] + [FakeEngine(f"d{i}", die_after=1).ref("decode") for i in range(3)]
    router, _ = routed(engines, max_migrations=1)
    with pytest.raises(MigrationLimitError, match="max_migrations is 1"):
        run(router)
    assert nonzero(router.stats.failed) == {"migration_limit": 1}


def test_no_engine_left_is_a_clear_error_not_a_hang() -> None:
    router, _ = routed([], )
    router.disaggregated = False
    router.pools = {"both": EnginePicker([], "least_outstanding")}
    with pytest.raises(NoEngineError, match="no healthy engine"):
        run(router)


def _consume_until(router: Router, stop_after: int) -> None:
    """Read `stop_after` chunks of a request, then leave (close the stream)."""
    async def go() -> None:
        gen = router.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=8, temperature=0.0)), RequestTrace())
        for _ in range(stop_after):
            await anext(gen)
        await gen.aclose()

    asyncio.run(asyncio.wait_for(go(), timeout=30))


def test_a_client_leaving_during_decode_aborts_the_decode_request() -> None:
    p, d = FakeEngine("p"), FakeEngine("d", step_s=0.1)
    router, _ = routed([p.ref("prefill"), d.ref("decode")])
    _consume_until(router, 2)
    assert [leg(a) for a in d.aborted] == ["r-d"] and nonzero(router.stats.aborts) == {"decode": 1} and router.stats.in_flight == 0


def test_a_client_leaving_during_prefill_aborts_it_and_releases_kv_it_already_held() -> None:
    p, d = FakeEngine("p", hang=True), FakeEngine("d")
    p.abort_answer = {"remote_engine_id": "p", "remote_block_ids": [[4]]}  # it had just finished
    router, _ = routed([p.ref("prefill"), d.ref("decode")])

    async def go() -> None:
        gen = router.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=8)), RequestTrace())
        task = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.05)
        task.cancel()  # the client's connection task is cancelled mid-prefill
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert [leg(a) for a in p.aborted] == ["r-p"]
    assert [(leg(r), params) for r, params in d.released] == [("r-p-release", p.abort_answer)]  # freed now, not at the lease's end
    assert d.requests == [] and nonzero(router.stats.aborts) == {"prefill": 1}


def test_a_client_leaving_before_the_first_token_aborts_the_decode_request_that_holds_the_pull() -> None:
    """The decode request leaves with the prefill's answer; aborting it is what frees the
    prefill's blocks (vLLM's decode side notifies the prefill side)."""
    p, d = FakeEngine("p"), FakeEngine("d", hang=True)
    router, _ = routed([p.ref("prefill"), d.ref("decode")], first_token="decode")

    async def go() -> None:
        gen = router.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=8)), RequestTrace())
        task = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert d.requests[0].kv_transfer_params == {"remote_engine_id": "p"} and [leg(a) for a in d.aborted] == ["r-d"]
    assert nonzero(router.stats.aborts) == {"handoff": 1} and router.stats.in_flight == 0


# ---- the prefill's first token, streamed (routing.first_token: prefill) -------------------


def test_the_prefills_token_reaches_the_client_before_the_decode_answers() -> None:
    """The decode request (prompt + the prefill's token, pulling the prompt's blocks) has left
    when the first token is handed on; the client has that token while the decode engine hangs."""
    p, d = FakeEngine("p"), FakeEngine("d", hang=True)
    router, _ = routed([p.ref("prefill"), d.ref("decode")])
    trace = RequestTrace()

    async def go() -> list[RequestOutput]:
        gen = router.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)), trace)
        first = await asyncio.wait_for(anext(gen), timeout=10)
        assert trace.t_decode_sent is not None  # sent before the token was handed on
        await asyncio.sleep(0.1)  # the fake engine's thread takes it
        await gen.aclose()
        return [first]

    (first,) = asyncio.run(go())
    assert tokens([first]) == UNDISTURBED[:1] and not first.finished and first.outputs[0].finish_reason is None
    assert first.prompt_token_ids == PROMPT and first.kv_transfer_params is None
    (pre,), (dec,) = p.requests, d.requests
    # The prefill samples as the client asked, one token; the decode continues after it.
    assert (pre.sampling.max_tokens, pre.sampling.logprobs, pre.sampling.temperature) == (1, 1, 0.0)
    assert dec.prompt_token_ids == PROMPT + UNDISTURBED[:1] and dec.resume_from == len(PROMPT)
    assert dec.kv_transfer_params == {"remote_engine_id": "p", PREFILLED_TOKENS: len(PROMPT)}
    assert dec.sampling.max_tokens == 7 and dec.sampling.logprobs == 1
    # Leaving after the first token aborts the decode, which frees the prefill's blocks.
    assert [leg(a) for a in d.aborted] == ["r-d"] and nonzero(router.stats.aborts) == {"decode": 1}
    assert trace.first_from_prefill and "route" not in trace.phases() and router.stats.in_flight == 0


def test_a_streamed_first_token_gives_the_same_output_and_the_decode_failing_still_migrates() -> None:
    p, d0, d1 = FakeEngine("p"), FakeEngine("d0", die_after=0), FakeEngine("d1")
    router, _ = routed([p.ref("prefill"), d0.ref("decode"), d1.ref("decode")], policy="round_robin")
    assert tokens(run(router)) == UNDISTURBED
    # d0 died before its first token: d1 goes on from the prompt plus the prefill's token.
    assert d1.requests[0].prompt_token_ids == PROMPT + UNDISTURBED[:1] and d1.requests[0].kv_transfer_params is None


def test_the_router_times_the_decode_engines_first_token_after_a_streamed_one() -> None:
    """The second token is where a handed-on request's decode leg shows (the TPOT budget)."""
    p, d = FakeEngine("p"), FakeEngine("d")
    router, _ = routed([p.ref("prefill"), d.ref("decode")])
    trace = RequestTrace()
    assert tokens(run(router, trace=trace)) == UNDISTURBED
    assert trace.first_from_prefill and trace.t_first_token < trace.t_second_token <= trace.t_done  # type: ignore[operator]
    assert list(trace.phases()) == ["prefill", "first_token", "second_token", "decode"]
    colocated, _ = routed([FakeEngine("c").ref("both")])
    alone = RequestTrace()
    run(colocated, trace=alone)
    assert alone.t_second_token is None and "second_token" not in alone.phases()


def test_a_one_token_request_is_served_by_its_prefill_engine_alone() -> None:
    p, d = FakeEngine("p"), FakeEngine("d")
    router, _ = routed([p.ref("prefill"), d.ref("decode")])
    chunks = run(router, max_tokens=1)
    assert tokens(chunks) == UNDISTURBED[:1] and chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "length"
    assert d.requests == [] and p.requests[0].kv_transfer_params is None  # no KV held for a decode


def test_a_first_token_that_stops_the_request_releases_the_prefills_blocks() -> None:
    class StoppingPrefill(FakeEngine):
        async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
            self.requests.append(req)
            yield output("", [2], finished=True, finish_reason="stop", kv_transfer_params={"remote_engine_id": self.name})

    p, d = StoppingPrefill("p"), FakeEngine("d")
    router, _ = routed([p.ref("prefill"), d.ref("decode")])
    chunks = run(router)
    assert tokens(chunks) == [2] and chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "stop"
    assert [r.prompt_token_ids for r in d.requests] == [] and [leg(r) for r, _ in d.released] == ["r-release"]


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=8, temperature=0.8, seed=7),
    SamplingParams(max_tokens=8, frequency_penalty=0.5),
    SamplingParams(max_tokens=8, presence_penalty=0.5),
    SamplingParams(max_tokens=8, bad_words=["t1005"]),
    SamplingParams(max_tokens=8, n=2),
    SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]+")),
])
def test_requests_whose_next_tokens_depend_on_where_the_first_was_sampled_keep_the_decodes(sampling: SamplingParams) -> None:
    prefill, decode = RecordingEngine(), RecordingEngine()
    router = Router([prefill.ref("p", "prefill"), decode.ref("d", "decode")], RoutingConfig(policy="round_robin"))

    async def go() -> None:
        async for _ in router.generate(EngineRequest("r-6", [1, 2, 3], sampling), RequestTrace()):
            pass

    asyncio.run(go())
    assert prefill.requests[0].sampling.logprobs is None and prefill.requests[0].sampling.n == 1
    assert decode.requests[-1].prompt_token_ids == [1, 2, 3] and decode.requests[-1].resume_from is None
