"""The router's stream from an engine actor, against a fake actor handle (pure logic; the real
engines, Ray streaming included, are exercised in tests/test_serving.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from actors.protocol import EngineChunk, EngineRequest, SamplingOptions
from orchestrator.config import RoutingConfig
from orchestrator.protocol import EngineRef
from orchestrator.router import RequestTrace, Router, stream_engine

REQ = EngineRequest("r-1", [1, 2, 3], SamplingOptions(max_tokens=2))
CHUNKS = [EngineChunk("a", [5]), EngineChunk("b", [6], finished=True, finish_reason="length")]


def _done(value: Any) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.remote = fn


class SilentEndEngine:
    """An actor handle whose stream yields CHUNKS (as awaitable refs) and then never ends,
    as a Ray stream whose end-of-stream report is late; records aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.generate = _Method(self._generate)
        self.abort = _Method(self._abort)

    async def _generate(self, req: EngineRequest) -> AsyncIterator[Awaitable[EngineChunk]]:
        for chunk in CHUNKS:
            yield _done(chunk)
        await asyncio.Event().wait()

    def _abort(self, request_id: str) -> asyncio.Future:
        self.aborted.append(request_id)
        return _done(None)


def test_the_stream_ends_at_the_finished_chunk_without_waiting_for_ray_end_of_stream() -> None:
    handle = SilentEndEngine()

    async def collect() -> list[EngineChunk]:
        return [c async for c in stream_engine(EngineRef("e", "decode", handle), REQ)]

    assert asyncio.run(asyncio.wait_for(collect(), timeout=10)) == CHUNKS
    assert handle.aborted == []


def test_a_consumer_leaving_before_the_finished_chunk_aborts_the_request() -> None:
    handle = SilentEndEngine()

    async def leave_after_one() -> None:
        stream = stream_engine(EngineRef("e", "decode", handle), REQ)
        assert await anext(stream) == CHUNKS[0]
        await stream.aclose()

    asyncio.run(leave_after_one())
    assert handle.aborted == ["r-1"]


class RecordingEngine:
    """An actor handle that records each request and answers with one finished chunk (a
    prefill's carries kv_transfer_params, as vLLM's does)."""

    def __init__(self) -> None:
        self.requests: list[EngineRequest] = []
        self.generate = _Method(self._generate)
        self.abort = _Method(lambda request_id: _done(None))

    async def _generate(self, req: EngineRequest) -> AsyncIterator[Awaitable[EngineChunk]]:
        self.requests.append(req)
        params = {"remote_engine_id": "p"} if req.kv_transfer_params == {"do_remote_decode": True} else None
        yield _done(EngineChunk("x", [7], finished=True, finish_reason="length", kv_transfer_params=params))


def test_only_the_streaming_request_may_batch_tokens() -> None:
    prefill, decode = RecordingEngine(), RecordingEngine()
    router = Router([EngineRef("p", "prefill", prefill), EngineRef("d", "decode", decode)], RoutingConfig(policy="round_robin"), stream_batch_s=0.02)

    async def run() -> list[EngineChunk]:
        return [c async for c in router.generate("r-2", [1, 2, 3], SamplingOptions(max_tokens=4), RequestTrace())]

    assert [c.token_ids for c in asyncio.run(run())] == [[7]]
    (p,), (d,) = prefill.requests, decode.requests
    # The prefill answers with a single token: holding it back would only delay the decode.
    assert p.stream_batch_s == 0.0 and p.sampling.max_tokens == 1
    assert d.stream_batch_s == 0.02 and d.kv_transfer_params == {"remote_engine_id": "p"}
