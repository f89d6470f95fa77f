"""The token path (actors.stream) with real ZMQ sockets on 127.0.0.1 and a plain handler in
place of an engine: outputs in order, errors as the engine raised them, a lost engine failing
every open stream at once, a router that left noticed by the engine, and clients retired
with the routing table. The path under real engines is exercised by every engine test."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from vllm.exceptions import VLLMValidationError

from actors.protocol import EngineRequest
from actors.stream import EngineStreams, Emit, RemoteError, StreamClient, StreamLost, StreamServer
from tests.conftest import free_port


def req(rid: str, n: int = 3) -> EngineRequest:
    return EngineRequest(rid, list(range(n)), None)


async def count_up(r: EngineRequest, emit: Emit) -> None:
    """One output per prompt token: its index and the request id."""
    for i in range(len(r.prompt_token_ids)):
        await emit((r.request_id, i))


def run(test: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(test(), timeout=20))


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [x async for x in stream]


def test_outputs_arrive_in_order_and_concurrent_streams_do_not_mix() -> None:
    async def go() -> None:
        server = StreamServer("127.0.0.1")
        server.start(count_up)
        client = StreamClient(server.address)
        a, b = await asyncio.gather(collect(client.generate(req("a", 50))), collect(client.generate(req("b", 40))))
        assert a == [("a", i) for i in range(50)] and b == [("b", i) for i in range(40)]
        client.close()
        server.close()

    run(go)


def test_a_client_works_where_a_closed_sockets_monitor_endpoint_is_still_taken() -> None:
    """pyzmq names a socket's monitor endpoint after its fd number, which a new socket reuses;
    a closed client's monitor may still hold that name (CI saw "Address already in use" in a
    router test). Every such name a new socket could get is taken here first."""

    async def go() -> None:
        import zmq
        import zmq.asyncio

        server = StreamServer("127.0.0.1")
        server.start(count_up)
        squatter = zmq.asyncio.Context.instance().socket(zmq.PAIR)  # inproc names are per context
        for fd in range(4096):
            squatter.bind(f"inproc://monitor.s-{fd}")
        try:
            client = StreamClient(server.address)
            assert client._sock.FD < 4096, "the new socket's default monitor name was among those taken"
            assert await collect(client.generate(req("a", 3))) == [("a", i) for i in range(3)]
            client.close()
        finally:
            squatter.close(linger=0)
            server.close()

    run(go)


def test_outputs_that_waited_for_a_busy_consumer_leave_merged_none_lost_or_reordered() -> None:
    """With a merge (the router's: vLLM's delta merge), a consumer that lags gets what arrived
    meanwhile as one output, as vLLM's own output collector gives it, and one that keeps up
    gets every output as it comes; without a merge, every output."""
    def one_by_one(gap_s: float) -> Callable[[EngineRequest, Emit], Awaitable[None]]:
        async def handler(r: EngineRequest, emit: Emit) -> None:
            for i in range(len(r.prompt_token_ids)):
                await emit([i])
                await asyncio.sleep(gap_s)
        return handler

    async def read(stream: AsyncIterator[list[int]], pause_s: float) -> list[list[int]]:
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            await asyncio.sleep(pause_s)
        return chunks

    def merge(a: list[int], b: list[int]) -> list[int]:
        return a + b

    async def go() -> None:
        fast, slow = StreamServer("127.0.0.1"), StreamServer("127.0.0.1")
        fast.start(one_by_one(0.0))
        slow.start(one_by_one(0.2))
        to_fast, to_slow = StreamClient(fast.address), StreamClient(slow.address)
        lagging = await read(to_fast.generate(req("m", 50), merge), pause_s=0.3)
        assert sum(lagging, []) == list(range(50)) and len(lagging) < 50, lagging
        keeping_up = await read(to_slow.generate(req("k", 4), merge), pause_s=0.0)
        assert keeping_up == [[0], [1], [2], [3]]
        unmerged = await read(to_fast.generate(req("p", 5)), pause_s=0.3)
        assert unmerged == [[i] for i in range(5)]
        for c in (to_fast, to_slow, fast, slow):
            c.close()

    run(go)


def test_two_requests_with_the_same_id_stream_apart() -> None:
    """Clients choose request ids (X-Request-Id): two at once under one id must not share a stream."""
    async def go() -> None:
        server = StreamServer("127.0.0.1")
        server.start(count_up)
        client = StreamClient(server.address)
        a, b = await asyncio.gather(collect(client.generate(req("same", 30))), collect(client.generate(req("same", 20))))
        assert a == [("same", i) for i in range(30)] and b == [("same", i) for i in range(20)]
        client.close()
        server.close()

    run(go)


def test_an_exception_the_engine_raises_reaches_the_router_as_itself() -> None:
    async def reject(r: EngineRequest, emit: Emit) -> None:
        await emit("partial")
        raise VLLMValidationError("token id 99999 is out of vocabulary", parameter="prompt")

    async def go() -> None:
        server = StreamServer("127.0.0.1")
        server.start(reject)
        client = StreamClient(server.address)
        seen: list[Any] = []
        with pytest.raises(RemoteError) as info:
            async for out in client.generate(req("r")):
                seen.append(out)
        assert seen == ["partial"]
        assert isinstance(info.value.cause, VLLMValidationError) and info.value.cause.parameter == "prompt"
        client.close()
        server.close()

    run(go)


def test_a_dead_engine_fails_every_open_stream_and_later_ones_at_once() -> None:
    async def go() -> None:
        async def hang(r: EngineRequest, emit: Emit) -> None:
            await emit("first")
            await asyncio.Event().wait()

        server = StreamServer("127.0.0.1")
        server.start(hang)
        client = StreamClient(server.address)
        streams = [client.generate(req(f"r{i}")) for i in range(3)]
        assert [await anext(s) for s in streams] == ["first"] * 3
        server.close()  # as a killed process closes its sockets
        for s in streams:
            with pytest.raises(StreamLost, match="closed"):
                await anext(s)
        with pytest.raises(StreamLost):
            await anext(client.generate(req("later")))

    run(go)


def test_an_address_where_nothing_listens_is_a_lost_stream_not_a_hang() -> None:
    async def go() -> None:
        with socket.socket() as s:  # a port nothing listens on once this closes
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(StreamLost, match="did not accept"):
            await collect(StreamClient(f"tcp://127.0.0.1:{port}").generate(req("r")))

    run(go)


def test_the_engine_notices_a_router_that_left_at_its_next_output() -> None:
    async def go() -> None:
        sent: list[bool] = []
        second = asyncio.Event()
        done = asyncio.Event()

        async def slow(r: EngineRequest, emit: Emit) -> None:
            sent.append(await emit(1))
            await second.wait()
            sent.append(await emit(2))
            done.set()

        server = StreamServer("127.0.0.1")
        server.start(slow)
        client = StreamClient(server.address)
        stream = client.generate(req("r"))
        assert await anext(stream) == 1
        client.close()
        await asyncio.sleep(0.2)  # the engine's side of the connection closes
        second.set()
        await done.wait()
        assert sent == [True, False]
        server.close()

    run(go)


def test_a_retired_client_closes_once_its_last_stream_ends() -> None:
    async def go() -> None:
        release = asyncio.Event()

        async def waits(r: EngineRequest, emit: Emit) -> None:
            await emit("a")
            await release.wait()
            await emit("b")

        server = StreamServer("127.0.0.1")
        server.start(waits)
        client = StreamClient(server.address)
        stream = client.generate(req("r"))
        assert await anext(stream) == "a"
        client.retire()  # the engine left the routing table (draining): its stream goes on
        assert client.lost is None
        release.set()
        assert await collect(stream) == ["b"]
        assert client.lost is not None  # closed with its last stream
        server.close()

    run(go)


def test_the_registry_opens_a_new_client_for_an_engine_listed_again() -> None:
    async def go() -> None:
        server = StreamServer("127.0.0.1")
        server.start(count_up)
        streams = EngineStreams()
        assert await collect(streams.generate(server.address, req("r1", 2))) == [("r1", 0), ("r1", 1)]
        streams.keep([])  # retired, and closed at once: nothing is open on it
        assert await collect(streams.generate(server.address, req("r2", 2))) == [("r2", 0), ("r2", 1)]
        streams.close()
        server.close()

    run(go)


def test_an_engine_listens_on_the_configured_port_or_says_which_one_is_taken() -> None:
    """serve.token_path_base_port: firewalled clusters open known ports only."""

    async def go() -> None:
        port = free_port()
        server = StreamServer("127.0.0.1", port)
        server.start(count_up)
        assert server.address == f"tcp://127.0.0.1:{port}"
        client = StreamClient(server.address)
        assert await collect(client.generate(req("a", 2))) == [("a", 0), ("a", 1)]
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} .*serve.token_path_base_port"):
            StreamServer("127.0.0.1", port)
        client.close()
        server.close()

    run(go)
