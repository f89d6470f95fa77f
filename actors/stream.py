"""The token path: a request to an engine actor and its streamed outputs, over one ZMQ socket
per router and engine instead of Ray calls.

A Ray streaming call costs a Ray message to start and one per streamed item, each through
Ray's core worker threads on both sides; on a 2-core host whose engines busy-wait between
steps that was 2-3 ms each way per engine leg (docs/performance.md, "The token path off Ray"). vLLM's
own front end talks to its engine core over ZMQ for the same reason. Here the engine actor
binds a ROUTER socket on its node's IP (`StreamServer`), every router process keeps one DEALER
socket per engine incarnation (`StreamClient`, gathered in `EngineStreams`), and requests and
outputs are pickled as Ray would pickle them (vLLM's own SamplingParams and RequestOutput).
Control calls (abort, health, stats, the KV-cache long-poll) stay Ray calls.

Frames, client to engine: [REQUEST, tag, pickled EngineRequest]; engine to client: [OUTPUT,
tag, pickled RequestOutput] per streamed output, then [END, tag] or [ERROR, tag, pickled
exception]. The tag is the client's number for the stream, not the request id: two clients'
requests may share an id (vLLM's serving layer takes it from the X-Request-Id header).

What Ray's call gave for free is kept:
- a dead or unreachable engine fails every stream open on it at once (`StreamLost`): the kill
  closes the TCP connection and the client's socket monitor sees it; a node that vanishes
  without closing it stops answering libzmq's heartbeats; an address where nothing listens
  any more refuses the connection;
- a router that is gone is noticed by the engine at the request's next output (the send is
  refused: ROUTER_MANDATORY), and the request is aborted there;
- an exception the engine raised reaches the router as that exception (`RemoteError.cause`),
  so vLLM's input checks become the same 4xx as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import pickle
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger("tandem.stream")

REQUEST, OUTPUT, ERROR, END = b"G", b"O", b"E", b"D"
_LOST = b""  # not a wire frame: put in a stream's inbox when its connection is lost
_MONITOR_IDS = itertools.count()  # each client's connection-event endpoint (StreamClient)

# libzmq pings each connection this often and drops one that has not answered for this long:
# how a router learns that an engine's node vanished without closing its connections (the
# CPU tier's index channel uses the same, connectors/index_client.py).
HEARTBEAT_IVL_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 10_000
# A connection attempt that gets no answer for this long is given up (and retried by libzmq:
# the client takes the first failed attempt as the engine being gone).
CONNECT_TIMEOUT_MS = 5_000

# Sends the engine's next output to the router; False once the router is gone.
Emit = Callable[[Any], Awaitable[bool]]
# Runs one request on the engine, emitting its outputs; what it raises goes to the router.
Handler = Callable[[Any, Emit], Awaitable[None]]
# One output standing for two consecutive outputs of a stream, the earlier one first.
Merge = Callable[[Any, Any], Any]


class StreamLost(ConnectionError):
    """The connection to the engine closed or could not be opened: its process is gone or
    unreachable. Outputs of the stream may have been lost with it."""


class RemoteError(Exception):
    """The engine raised `cause` while serving the request."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Never drop or hold back an output: a stream with a gap is a wrong answer.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def _dump_error(err: BaseException) -> bytes:
    """The exception pickled, or (when it does not survive pickling) a RuntimeError with its text."""
    try:
        data = pickle.dumps(err, protocol=5)
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(err).__name__}: {err}"), protocol=5)


class StreamServer:
    """An engine actor's end of the token path: a ROUTER socket on `host` (the node's IP, as
    Ray reports it) at `port`, or one the OS picks; `address` is what routers connect to."""

    def __init__(self, host: str, port: int | None = None) -> None:
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        _configure(self._sock)
        # A send to a router that is no longer connected fails instead of vanishing.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bind_host = f"[{host}]" if ":" in host else host
        if port is None:
            port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        else:
            try:
                self._sock.bind(f"tcp://{bind_host}:{port}")
            except zmq.ZMQError as err:
                self._sock.close(linger=0)
                raise OSError(
                    f"the token path cannot listen on {host}:{port} ({err}); fix: free the port, or "
                    "move serve.token_path_base_port to a range no other process on the node uses"
                ) from None
        self.address = f"tcp://{bind_host}:{port}"
        self._reader: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()

    def start(self, handler: Handler) -> None:
        """Serve requests with `handler` from the running event loop (once; later calls do nothing)."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(handler))

    async def _read(self, handler: Handler) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 4 or frames[1] != REQUEST:
                logger.warning("token path: ignored a message that is not a request (%d frames) from a router", len(frames))
                continue
            peer, _, tag, payload = frames
            try:
                req = pickle.loads(payload)
            except Exception as err:  # a router of another version, say: it gets the reason
                await self._send_last(peer, tag, ERROR, _dump_error(err))
                continue
            task = asyncio.create_task(self._serve(peer, tag, req, handler))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, peer: bytes, tag: bytes, req: Any, handler: Handler) -> None:
        gone = False

        async def emit(out: Any) -> bool:
            nonlocal gone
            if not gone:
                try:
                    await self._sock.send_multipart([peer, OUTPUT, tag, pickle.dumps(out, protocol=5)])
                except zmq.ZMQError as err:
                    if err.errno != zmq.EHOSTUNREACH:
                        raise
                    gone = True
            return not gone

        try:
            await handler(req, emit)
        except Exception as err:
            if not gone:
                await self._send_last(peer, tag, ERROR, _dump_error(err))
        else:
            if not gone:
                await self._send_last(peer, tag, END, b"")

    async def _send_last(self, peer: bytes, tag: bytes, kind: bytes, payload: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the router left meanwhile: nobody to tell
            await self._sock.send_multipart([peer, kind, tag, payload])

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for task in list(self._serving):
            task.cancel()
        self._sock.close(linger=0)


class _Inbox:
    """One open stream's frames, in arrival order; the reader may look at what is waiting."""

    def __init__(self) -> None:
        self.frames: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._arrived = asyncio.Event()

    def put(self, kind: bytes, payload: bytes) -> None:
        self.frames.append((kind, payload))
        self._arrived.set()

    async def get(self) -> tuple[bytes, bytes]:
        while not self.frames:
            self._arrived.clear()
            await self._arrived.wait()
        return self.frames.popleft()


class StreamClient:
    """A router's end of the token path to one engine incarnation: one DEALER socket, the
    outputs of every request open on it told apart by a tag of its own. Made in the event loop that
    uses it. Once its connection is lost it stays lost (`lost` says why): a new incarnation
    of the engine has a new address, and so a new client."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.lost: str | None = None
        self._connected = False
        self._retired = False
        # Each open stream's frames, by its tag (the client's number for it).
        self._open: dict[bytes, _Inbox] = {}
        self._tags = itertools.count()
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        _configure(self._sock)
        self._sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        # An endpoint of its own: pyzmq's default name comes from the socket's fd number, which
        # a later socket reuses while the closed one's monitor may still hold that name
        # ("Address already in use" for a router reconnecting to a restarted engine).
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED,
            addr=f"inproc://tandem-token-path-monitor-{next(_MONITOR_IDS)}")
        self._sock.connect(address)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]

    async def generate(self, req: Any, merge: Merge | None = None) -> AsyncIterator[Any]:
        """Send `req` (an EngineRequest) and yield the engine's outputs until its end. Raises
        StreamLost when the connection is lost, RemoteError when the engine raised.

        With `merge`, the outputs that arrived while the consumer was busy leave as one, as
        vLLM's own output collector merges a slow consumer's deltas: a consumer that keeps up
        gets every output as it comes (one per engine step), one that lags (an ingress
        rendering many streams) catches up in fewer, larger chunks instead of falling behind."""
        if self.lost is not None:
            raise StreamLost(self.lost)
        tag = next(self._tags).to_bytes(8, "little")
        inbox = self._open[tag] = _Inbox()
        try:
            try:
                await self._sock.send_multipart([REQUEST, tag, pickle.dumps(req, protocol=5)])
            except zmq.ZMQError as err:  # the socket closed as the connection was lost
                raise StreamLost(self.lost or f"the request could not be sent to {self.address}: {err}") from None
            while True:
                kind, payload = await inbox.get()
                if kind == OUTPUT:
                    out = pickle.loads(payload)
                    while merge is not None and inbox.frames and inbox.frames[0][0] == OUTPUT:
                        out = merge(out, pickle.loads(inbox.frames.popleft()[1]))
                    yield out
                elif kind == END:
                    return
                elif kind == ERROR:
                    raise RemoteError(pickle.loads(payload))
                else:
                    raise StreamLost(self.lost)
        finally:
            del self._open[tag]
            if self._retired and not self._open:
                self.close()

    def retire(self) -> None:
        """The engine left routing: close once the streams open on it have ended."""
        self._retired = True
        if not self._open:
            self.close()

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) == 3 and (inbox := self._open.get(frames[1])) is not None:  # else a stream its router left
                inbox.put(frames[0], frames[2])

    async def _watch(self) -> None:
        """Turn the socket's connection events into `lost`: a closed connection, or a first
        connection attempt that failed (nothing listens at the address any more)."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                return self._lose(f"the connection to the engine at {self.address} closed")
            elif event == zmq.EVENT_CONNECT_RETRIED and not self._connected:
                return self._lose(f"the engine at {self.address} did not accept a connection")

    def _lose(self, why: str) -> None:
        """Fail every open stream with `why` and stop: nothing more will come on this socket."""
        self.lost = why
        for inbox in self._open.values():
            inbox.put(_LOST, b"")
        for task in self._tasks:
            if task is not asyncio.current_task() and not task.get_loop().is_closed():
                task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        # A socket whose event loop has ended can only be closed (tests run several loops).
        with contextlib.suppress(RuntimeError):
            self._monitor.close(linger=0)
        with contextlib.suppress(RuntimeError):
            self._sock.close(linger=0)

    def close(self) -> None:
        """Stop the client; streams still open on it see StreamLost."""
        if self.lost is None:
            self._lose(f"the token path to {self.address} was closed")


class EngineStreams:
    """A router process's token paths: one client per engine address, opened on first use,
    in the event loop of that use (a later loop starts over: a client's reader belongs to
    the loop it was made in)."""

    def __init__(self) -> None:
        self._clients: dict[str, StreamClient] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def generate(self, address: str, req: Any, merge: Merge | None = None) -> AsyncIterator[Any]:
        """Stream `req` from the engine at `address` (StreamClient.generate)."""
        if not address:
            raise StreamLost("the engine has no token-path address (an engine of an older Tandem?)")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self.close()
            self._loop = loop
        client = self._clients.get(address)
        if client is None or client.lost is not None:
            client = self._clients[address] = StreamClient(address)
        return client.generate(req, merge)

    def keep(self, addresses: Collection[str]) -> None:
        """Retire the clients of engines no longer listed (a draining engine's streams end first)."""
        for address in [a for a in self._clients if a not in addresses]:
            self._clients.pop(address).retire()

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


async def stream(address: str, req: Any) -> AsyncIterator[Any]:
    """One request's outputs from the engine at `address`, on a client of its own: for tools
    that send a request now and then (benchmarks, checks); routers keep `EngineStreams`."""
    client = StreamClient(address)
    try:
        async for out in client.generate(req):
            yield out
    finally:
        client.close()
