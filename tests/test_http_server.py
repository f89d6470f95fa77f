"""The ingress's own HTTP server (`serve.http: direct`) and the request gate in front of
vLLM's routes, over real sockets and real HTTP; no engines."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from orchestrator.engine_client import REACHED_ROUTER
from orchestrator.http_server import DirectHTTP
from orchestrator.openai_app import RequestGate
from orchestrator.router import RequestTrace
from tests.conftest import free_port


def named_app(name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/who")
    async def who() -> PlainTextResponse:
        return PlainTextResponse(name)

    return app


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())


def test_replicas_on_one_node_share_the_port() -> None:
    """Two servers (as two ingress replicas on one node) bind one port; new connections reach both."""
    port = free_port()

    async def main() -> None:
        servers = [DirectHTTP(named_app(n), "127.0.0.1", port) for n in ("a", "b")]
        for s in servers:
            await s.start()
        seen: set[str] = set()
        for _ in range(64):  # a new connection each time: the kernel spreads them
            async with httpx.AsyncClient() as client:
                seen.add((await client.get(f"http://127.0.0.1:{port}/who")).text)
            if seen == {"a", "b"}:
                break
        for s in servers:
            await s.stop()
        assert seen == {"a", "b"}
        assert not any(s.alive for s in servers)
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as client:
                await client.get(f"http://127.0.0.1:{port}/who")

    run(main)


def test_a_port_held_by_another_program_is_a_clear_error() -> None:
    import socket

    with socket.socket() as other:  # bound without SO_REUSEPORT, as most servers do
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{port}.*serve.port"):
            DirectHTTP(named_app("a"), "127.0.0.1", port)


def test_a_stop_lets_a_request_in_flight_finish() -> None:
    port = free_port()
    release = asyncio.Event()
    app = FastAPI()

    @app.get("/slow")
    async def slow() -> PlainTextResponse:
        await release.wait()
        return PlainTextResponse("done")

    async def main() -> None:
        server = DirectHTTP(app, "127.0.0.1", port)
        await server.start()
        async with httpx.AsyncClient() as client:
            pending = asyncio.create_task(client.get(f"http://127.0.0.1:{port}/slow"))
            await asyncio.sleep(0.2)
            stopping = asyncio.create_task(server.stop())
            await asyncio.sleep(0.2)
            assert not stopping.done()  # waits for the request in flight
            release.set()
            assert (await pending).text == "done"
            await stopping

    run(main)


def test_the_gate_counts_a_client_that_left_before_routing() -> None:
    """Served directly, a client that leaves shows as a disconnect; the gate counts it as
    aborted while queued (not routed) and sends nothing for it."""
    port = free_port()
    counted: list[tuple[str, int]] = []
    left: list[int] = []
    entered = threading.Event()
    app = FastAPI()

    @app.post("/v1/completions")
    async def slow(request: Request) -> PlainTextResponse:
        await request.body()
        assert REACHED_ROUTER.get() is not None and not REACHED_ROUTER.get().routed  # type: ignore[union-attr]
        entered.set()
        # vLLM's handlers watch for the client leaving (with_cancellation), then return.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        return PlainTextResponse("for nobody")

    gated = RequestGate(app, 1024, lambda p, s: counted.append((p, s)), lambda: left.append(1), name_route=True)

    async def main() -> None:
        server = DirectHTTP(gated, "127.0.0.1", port)
        await server.start()
        async with httpx.AsyncClient() as client:
            call = asyncio.create_task(client.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{}"))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            call.cancel()  # the client leaves
            with pytest.raises(asyncio.CancelledError):
                await call
            for _ in range(200):
                if left:
                    break
                await asyncio.sleep(0.01)
            ok = await client.post(f"http://127.0.0.1:{port}/v1/completions", content=b"x" * 2048)
        await server.stop()
        assert left == [1]
        assert ok.status_code == 413 and counted == [("/v1/completions", 413)]

    run(main)


@pytest.mark.parametrize("name_route", [True, False])
def test_a_streamed_response_names_its_engines_once_they_are_chosen(name_route: bool) -> None:
    """A stream's headers leave before its body is produced, so the gate holds them until the
    first chunk (the first output: the engines are chosen by then) and adds the route of each
    generation the request made; serve.route_headers false leaves them out. The chunks still
    stream one by one."""
    port = free_port()
    app = FastAPI()
    second = asyncio.Event()

    @app.post("/v1/completions")
    async def generate() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            arrival = REACHED_ROUTER.get()
            assert arrival is not None
            yield b"created "  # as /v1/responses streams response.created before generating
            # As the engine client does when a generation starts, and the router once it has
            # chosen: one remote, one local.
            arrival.traces += [
                RequestTrace("a", disaggregation="remote", reason="long_uncached", prefill_engine="prefill-1", output_engine="decode-0"),
                RequestTrace("b", disaggregation="local", reason="short_uncached", output_engine="decode-0"),
            ]
            yield b"first "
            await second.wait()
            yield b"second"

        return StreamingResponse(chunks())

    gated = RequestGate(app, 1024, lambda p, s: None, lambda: None, name_route=name_route)

    async def main() -> None:
        server = DirectHTTP(gated, "127.0.0.1", port)
        await server.start()
        try:
            async with httpx.AsyncClient() as client, client.stream("POST", f"http://127.0.0.1:{port}/v1/completions") as r:
                body = r.aiter_bytes()
                early = await anext(body)
                while not early.endswith(b"first "):  # streamed before the second exists
                    early += await anext(body)
                second.set()
                assert early == b"created first " and [c async for c in body] == [b"second"]
                headers = dict(r.headers)
        finally:
            await server.stop()
        named = {k: v for k, v in headers.items() if k.startswith("x-tandem-")}
        if not name_route:
            assert named == {}
            return
        assert named == {
            "x-tandem-engine": "decode-0, decode-0",
            "x-tandem-prefill-engine": "prefill-1, none",
            "x-tandem-disaggregation": "decision=remote;reason=long_uncached, decision=local;reason=short_uncached",
        }

    run(main)


def test_a_response_with_no_generation_carries_no_route() -> None:
    """/health, /metrics, /tokenize and refusals made no generation: no route headers, and
    a refusal before any parsing is answered as before."""
    port = free_port()
    gated = RequestGate(named_app("a"), 1024, lambda p, s: None, lambda: None, name_route=True)

    async def main() -> None:
        server = DirectHTTP(gated, "127.0.0.1", port)
        await server.start()
        try:
            async with httpx.AsyncClient() as client:
                ok = await client.get(f"http://127.0.0.1:{port}/who")
                big = await client.post(f"http://127.0.0.1:{port}/who", content=b"x" * 2048)
        finally:
            await server.stop()
        assert ok.text == "a" and not any(k.startswith("x-tandem-") for k in ok.headers)
        assert big.status_code == 413 and not any(k.startswith("x-tandem-") for k in big.headers)

    run(main)
