"""The router: picks engines per request and runs the prefill -> decode protocol.

One request, disaggregated (DESIGN.md):
  1. prefill engine: the prompt with max_tokens=1 and kv_transfer_params={"do_remote_decode": True};
  2. its final chunk carries kv_transfer_params (engine id, block ids, host, port);
  3. decode engine: the same prompt and sampling with those params; its NixlConnector pulls
     the blocks and the decode engine streams every output token back.
If the prefill engine fails, the decode engine prefills the request itself (counted as a
fallback), so a sick prefill pool degrades throughput, not correctness.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import msgspec
import ray
from ray.exceptions import RayActorError

from actors.protocol import EngineChunk, EngineRequest, Role, SamplingOptions

logger = logging.getLogger("tandem.router")

Policy = Literal["round_robin", "least_outstanding"]


class EngineRef(msgspec.Struct, frozen=True):
    """An engine as the router sees it: an id, a role and the Ray actor handle."""

    engine_id: str
    role: Role
    handle: Any


class EnginePicker:
    """Chooses a replica within one pool and tracks requests in flight per replica."""

    def __init__(self, engines: Sequence[EngineRef], policy: Policy) -> None:
        if not engines:
            raise ValueError("a pool needs at least one engine")
        self.engines = list(engines)
        self.policy = policy
        self.outstanding: dict[str, int] = {e.engine_id: 0 for e in engines}
        self._rr = itertools.cycle(range(len(engines)))

    def pick(self) -> EngineRef:
        if self.policy == "round_robin":
            return self.engines[next(self._rr)]
        # Least outstanding; ties go round robin so equal replicas share the load.
        start = next(self._rr)
        order = self.engines[start:] + self.engines[:start]
        return min(order, key=lambda e: self.outstanding[e.engine_id])

    def acquire(self, engine: EngineRef) -> None:
        self.outstanding[engine.engine_id] += 1

    def release(self, engine: EngineRef) -> None:
        self.outstanding[engine.engine_id] -= 1


class RequestTrace(msgspec.Struct):
    """What happened to one request, for usage accounting and /metrics."""

    prefill_engine: str | None = None
    decode_engine: str | None = None
    # Prompt tokens the prefilling engine found in its own prefix cache.
    num_cached_tokens: int = 0
    # Set when the disaggregated path was abandoned: "prefill_failed", "no_kv_params".
    fallback: str | None = None
    t_arrival: float = 0.0
    t_prefill_done: float | None = None
    # When the request that streams the output left for its engine (decode or colocated).
    t_decode_sent: float | None = None
    t_first_token: float | None = None
    t_done: float | None = None

    def phases(self) -> dict[str, float]:
        """Seconds spent in each phase this request reached, in order (for /metrics and benchmarks).

        prefill: arrival to the prefill engine's answer (disaggregated only); route: to the
        decode (or colocated) request leaving; first_token: to its first token (KV pull and
        first decode step, or queue and prefill when colocated); decode: to the last token.
        """
        marks = (("prefill", self.t_prefill_done), ("route", self.t_decode_sent), ("first_token", self.t_first_token), ("decode", self.t_done))
        out, last = {}, self.t_arrival
        for name, t in marks:
            if t is not None:
                out[name], last = t - last, t
        return out


async def stream_engine(engine: EngineRef, req: EngineRequest) -> AsyncIterator[EngineChunk]:
    """Stream an engine actor's chunks; abort the request there if the consumer stops early.

    Ends at the finished chunk instead of waiting for Ray's end of stream: that wait is one
    more hop on every request, and a client leaving during it would lose a prefill's KV
    transfer params, leaving its blocks held until vLLM's lease expires.
    """
    finished = False
    try:
        async for ref in engine.handle.generate.remote(req):
            chunk: EngineChunk = await ref
            finished = chunk.finished
            yield chunk
            if finished:
                return
    finally:
        if not finished:
            try:
                await engine.handle.abort.remote(req.request_id)
            except RayActorError:
                pass  # the engine is gone; so is the request


class Router:
    """Routes requests over a prefill + decode pair of pools, or a colocated pool."""

    def __init__(self, engines: Sequence[EngineRef], policy: Policy, stream_batch_s: float = 0.0) -> None:
        """`stream_batch_s`: how long engines may hold streamed tokens to send several at once
        (EngineRequest.stream_batch_s); prefill requests produce one token and never wait."""
        self.stream_batch_s = stream_batch_s
        by_role: dict[str, list[EngineRef]] = {}
        for e in engines:
            by_role.setdefault(e.role, []).append(e)
        self.disaggregated = "prefill" in by_role
        if self.disaggregated and "decode" not in by_role:
            raise ValueError("a prefill pool needs a decode pool to hand its KV to")
        self.pools = {role: EnginePicker(es, policy) for role, es in by_role.items()}
        self.fallbacks: dict[str, int] = {}

    @property
    def engines(self) -> list[EngineRef]:
        return [e for p in self.pools.values() for e in p.engines]

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        trace: RequestTrace,
        *,
        prefill_engine: EngineRef | None = None,
        decode_engine: EngineRef | None = None,
    ) -> AsyncIterator[EngineChunk]:
        """Stream the request's output chunks; fills `trace` as it goes.

        `prefill_engine`/`decode_engine` pin the choice (handshake pre-warming uses them).
        """
        trace.t_arrival = trace.t_arrival or time.perf_counter()
        kv_params: dict[str, Any] | None = None
        pool_name = "decode" if self.disaggregated else "both"
        if self.disaggregated:
            kv_params = await self._prefill(request_id, prompt_token_ids, sampling, trace, prefill_engine)
        picker = self.pools[pool_name]
        engine = decode_engine or picker.pick()
        trace.decode_engine = engine.engine_id
        req = EngineRequest(
            f"{request_id}-d" if self.disaggregated else request_id, prompt_token_ids, sampling, kv_params, self.stream_batch_s
        )
        picker.acquire(engine)
        trace.t_decode_sent = time.perf_counter()
        try:
            async for chunk in stream_engine(engine, req):
                if trace.t_first_token is None and chunk.token_ids:
                    trace.t_first_token = time.perf_counter()
                if not self.disaggregated or trace.fallback:
                    trace.num_cached_tokens = chunk.num_cached_tokens
                yield chunk
        finally:
            picker.release(engine)
            trace.t_done = time.perf_counter()

    async def _prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        trace: RequestTrace,
        engine: EngineRef | None,
    ) -> dict[str, Any] | None:
        """Run step 1 of the protocol; None means the decode engine must prefill itself."""
        picker = self.pools["prefill"]
        engine = engine or picker.pick()
        trace.prefill_engine = engine.engine_id
        req = EngineRequest(
            f"{request_id}-p",
            prompt_token_ids,
            msgspec.structs.replace(sampling, max_tokens=1, min_tokens=0),
            {"do_remote_decode": True},
        )
        last: EngineChunk | None = None
        picker.acquire(engine)
        try:
            async for chunk in stream_engine(engine, req):
                last = chunk
        except (RayActorError, ray.exceptions.RayTaskError) as err:
            logger.warning(
                "prefill engine %s failed for request %s (%s); the decode engine will prefill it itself",
                engine.engine_id, request_id, err,
            )
            self._count_fallback(trace, "prefill_failed")
            return None
        finally:
            picker.release(engine)
            trace.t_prefill_done = time.perf_counter()
        if last is None or not last.kv_transfer_params:
            logger.warning("prefill engine %s returned no KV transfer params for %s; decode recomputes", engine.engine_id, request_id)
            self._count_fallback(trace, "no_kv_params")
            return None
        trace.num_cached_tokens = last.num_cached_tokens
        return last.kv_transfer_params

    def _count_fallback(self, trace: RequestTrace, reason: str) -> None:
        trace.fallback = reason
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
