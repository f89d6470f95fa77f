"""An engine process's end of the CPU tier index's channel: one ZMQ DEALER socket to the
index actor (``actors.kv_index.KVIndexActor``), used from the engine's own thread.

Why not Ray calls: reaching an actor made every vLLM engine process (the engine core and each
worker) a Ray driver, with Ray's core worker threads and its GCS connections running beside
the forward pass on the engine's cores, and every save paid a Ray submission (0.3-1.4 ms) and
round trip (mostly 1-2 ms) inside an engine step (docs/bench-results.md, "What the tier's
presence costs a colocated engine"). Here a call is one message each way on a socket the
engine owns, and the engine processes never join the cluster.

What Ray's call gave and is kept: an answer that never comes (the index died or restarted
with the call in flight) ends the call with `IndexCallError` after CALL_TIMEOUT_S; a call made
while the index is unreachable fails at once instead of queueing (``zmq.IMMEDIATE``), so
nothing stale reaches a restarted index; libzmq reconnects by itself once the index listens
again (it keeps its port across restarts).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Collection
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from actors.kv_index import IndexAnswer, IndexCall, IndexRequest
from actors.stream import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS

# A call unanswered this long has failed: its answer was lost with an index that died.
CALL_TIMEOUT_S = 10.0


class IndexCallError(RuntimeError):
    """A call to the index failed: unreachable, no answer in time, or an error in the index."""


class IndexRefused(IndexCallError, ValueError):
    """The index refused the request itself (its message says why): not worth a retry."""


class _Call:
    __slots__ = ("decoder", "sent")

    def __init__(self, decoder: msgspec.msgpack.Decoder, sent: float) -> None:
        self.decoder = decoder
        self.sent = sent


class IndexClient:
    """Calls to the index from one engine process. Not thread-safe: vLLM calls a connector
    role from one thread (the engine core's loop, or the worker's)."""

    def __init__(self, address: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.address = address
        self._clock = clock
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        # The token path's liveness settings: how an engine notices that the index's node
        # vanished without closing the connection.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        # Only to see when the connection opens (a call never waits for it, see wait_connected).
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._connected = False
        self._sock.connect(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._answer_decoder = msgspec.msgpack.Decoder(IndexAnswer)
        self._decoders: dict[Any, msgspec.msgpack.Decoder] = {}
        self._ids = itertools.count(1)
        self._pending: dict[int, _Call] = {}
        self._answers: dict[int, IndexAnswer | IndexCallError] = {}

    def wait_connected(self, timeout: float) -> bool:
        """Whether the connection to the index is open, waiting up to `timeout` seconds for it
        (at engine start it may still be opening; calls made before fail)."""
        deadline = self._clock() + timeout
        while True:
            while self._monitor.poll(0):
                event = parse_monitor_message(self._monitor.recv_multipart())["event"]
                self._connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            left = deadline - self._clock()
            if self._connected or left <= 0:
                return self._connected
            self._monitor.poll(max(1, math.ceil(left * 1000)))

    def call(self, request: IndexRequest) -> int:
        """Send `request`; its answer is taken with `result` once `wait` says it is in. Never
        blocks: when the index is unreachable the call is already answered with an error."""
        call_id = next(self._ids)
        if self._send(IndexCall(call_id, request)):
            answer_type = type(request).answer
            decoder = self._decoders.get(answer_type)
            if decoder is None:
                decoder = self._decoders[answer_type] = msgspec.msgpack.Decoder(answer_type)
            self._pending[call_id] = _Call(decoder, self._clock())
        else:
            self._answers[call_id] = IndexCallError(f"the CPU tier index at {self.address} is unreachable")
        return call_id

    def send(self, request: IndexRequest) -> bool:
        """Send `request` without wanting an answer; False: the index is unreachable (lost)."""
        return self._send(IndexCall(0, request))

    def _send(self, call: IndexCall) -> bool:
        try:
            self._sock.send(self._encoder.encode(call), zmq.NOBLOCK)
        except zmq.Again:  # no connection to the index right now
            return False
        return True

    def wait(self, call_ids: Collection[int], timeout: float) -> set[int]:
        """Which of `call_ids` are answered (or failed), waiting up to `timeout` seconds for
        all of them."""
        deadline = self._clock() + timeout
        while True:
            self._drain()
            done = {c for c in call_ids if c in self._answers}
            left = deadline - self._clock()
            if len(done) == len(call_ids) or left <= 0:
                return done
            self._sock.poll(max(1, math.ceil(left * 1000)))

    def result(self, call_id: int) -> Any:
        """The answer of an answered call (see `wait`), once; raises IndexCallError when the
        call failed, IndexRefused when the index refused the request."""
        answer = self._answers.pop(call_id)
        call = self._pending.pop(call_id, None)
        if isinstance(answer, IndexCallError):
            raise answer
        if answer.error is not None:
            raise IndexRefused(answer.error) if answer.invalid else IndexCallError(answer.error)
        assert call is not None
        return call.decoder.decode(answer.value)

    def forget(self, call_id: int) -> None:
        """The caller no longer wants this call's answer (dropped when it comes)."""
        self._pending.pop(call_id, None)
        self._answers.pop(call_id, None)

    def _drain(self) -> None:
        """Take every answer that has arrived, and fail calls unanswered for too long."""
        while True:
            try:
                payload = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            answer = self._answer_decoder.decode(payload)
            if answer.call_id in self._pending:
                self._answers[answer.call_id] = answer
        now = self._clock()
        for call_id, call in self._pending.items():
            if call_id not in self._answers and now - call.sent > CALL_TIMEOUT_S:
                self._answers[call_id] = IndexCallError(
                    f"the CPU tier index at {self.address} did not answer within {CALL_TIMEOUT_S:.0f} s")

    def close(self) -> None:
        if self._sock.closed:
            return
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()
