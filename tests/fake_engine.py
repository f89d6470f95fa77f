"""A base for fake engines in router tests: the fake's `generate` is served on a real token path
(actors.stream's StreamServer on 127.0.0.1), in an event loop of its own thread as an engine
actor's would be in its own process, so routers reach fakes exactly as they reach engines."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

from actors.protocol import EngineRequest
from actors.stream import Emit, StreamServer

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def _engines_loop() -> asyncio.AbstractEventLoop:
    """The loop every fake engine serves from (started on first use, a daemon thread)."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="fake-engines", daemon=True).start()
        return _loop


class FakeEngineBase:
    """Subclasses define `generate(req)`, an async generator of vLLM RequestOutputs (run in the
    fake engines' loop), and may `die()` in it: the token path closes as a killed process's does."""

    def __init__(self, *, dead: bool = False) -> None:
        if dead:
            # Its process died before any request: nothing answers at its address. The port stays
            # bound (not listening, so a connect is refused) for the fake's lifetime: freed, the
            # OS could hand it to the next fake's server, and the router would reach that engine.
            self._grave = socket.socket()
            self._grave.bind(("127.0.0.1", 0))
            self.address = f"tcp://127.0.0.1:{self._grave.getsockname()[1]}"
            return
        loop = _engines_loop()

        async def start() -> StreamServer:
            server = StreamServer("127.0.0.1")
            server.start(self._handle)
            return server

        self.server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
        self.address = self.server.address

    async def _handle(self, req: EngineRequest, emit: Emit) -> None:
        async for out in self.generate(req):
            if not await emit(out):
                return

    def generate(self, req: EngineRequest) -> AsyncIterator[Any]:
        raise NotImplementedError

    async def die(self) -> None:
        """Close the token path (await in `generate`): every stream on it is lost. What was
        emitted before gets a moment to leave first, as a killed process's written bytes do
        (closing drops what the socket still queues)."""
        await asyncio.sleep(0.2)
        self.server.close()
