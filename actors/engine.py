"""EngineActor: one vLLM AsyncLLM per Ray actor, in the role prefill, decode or both.

The actor is the only place that imports vLLM's engine. Its process environment (core
binding, NIXL side channel, KV cache size) is set by the deployer through the actor's
runtime_env, so the engine core that vLLM spawns inherits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial
from typing import Any, TypeVar

import msgspec
import ray

from actors.protocol import (
    TRANSFER_BUCKETS,
    EngineChunk,
    EngineInfo,
    EngineRequest,
    EngineStats,
    Role,
)

logger = logging.getLogger("tandem.engine")
T = TypeVar("T")


class EngineSpec(msgspec.Struct, frozen=True):
    """Everything an engine actor needs to start, decided by the deployer."""

    engine_id: str
    role: Role
    model_path: str
    served_name: str
    # AsyncEngineArgs fields, already merged (top level + pool overrides).
    engine_args: dict[str, Any]
    tensor_parallel_size: int = 1
    # vLLM kv_transfer_config dict, None for an engine without a KV connector.
    kv_transfer: dict[str, Any] | None = None
    # Cores the actor and every process vLLM spawns for it may run on; None: unbound.
    cores: list[int] | None = None
    # A KV transfer slower than this (seconds) is counted and logged as a WARNING.
    slow_transfer_s: float = 1.0


def _pin_process(cores: list[int]) -> None:
    """Confine every thread of this process, and so every process it spawns later, to `cores`.

    vLLM binds only its OpenMP compute threads; its scheduler process, this actor's event
    loop and NIXL would otherwise float onto other engines' cores and preempt their steps.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def _observe_transfers(stats: EngineStats, data: dict[str, Any], slow_s: float) -> None:
    """Fold one NixlKVConnectorStats payload (lists per interval) into cumulative stats;
    count and log every transfer slower than `slow_s` (TandemNixlConnector adds the
    request ids, vLLM's NixlConnector does not)."""
    t = stats.transfers
    durations = data.get("transfer_duration", [])
    sizes = data.get("bytes_transferred", [])
    request_ids = data.get("request_ids", [])
    for i, d in enumerate(durations):
        if d > slow_s:
            t.num_slow += 1
            logger.warning(
                "slow KV transfer on engine %s: request %s, %d bytes in %.3f s (threshold %.3f s)",
                stats.engine_id,
                request_ids[i] if i < len(request_ids) and request_ids[i] else "<unknown>",
                int(sizes[i]) if i < len(sizes) else -1, d, slow_s,
            )
    t.num_transfers += len(durations)
    t.bytes += int(sum(data.get("bytes_transferred", [])))
    t.num_failed += len(data.get("num_failed_transfers", [])) + len(data.get("num_failed_handshakes", []))
    for d in durations:
        t.seconds += d
        t.max_seconds = max(t.max_seconds, d)
        idx = next((i for i, b in enumerate(TRANSFER_BUCKETS) if d <= b), len(TRANSFER_BUCKETS))
        t.bucket_counts[idx] += 1


def _observe_connector_stats(stats: EngineStats, payload: dict[str, Any], slow_s: float = 1.0) -> None:
    """Dispatch a scheduler_stats.kv_connector_stats payload by its shape.

    NixlConnector alone sends its data dict; a MultiConnector sends {child name: stats}
    whose values are stats objects or {"data": ...} dicts; Tandem's connectors send
    {"counters": {name: {counter: value}}}; TandemMultiConnector sends per-child counters
    {"children": {name: {counter: value}}, "transfers": {name: nixl data}}
    (connectors.multi.StatsPayload), whose transfers feed EngineStats.transfers as if
    NixlConnector ran alone.
    """
    if "transfer_duration" in payload:
        _observe_transfers(stats, payload, slow_s)
        return
    if "counters" in payload or "children" in payload:
        for name, counters in payload.get("counters", payload.get("children", {})).items():
            mine = stats.connector_counters.setdefault(name, {})
            for key, value in counters.items():
                mine[key] = mine.get(key, 0) + value
        # TandemMultiConnector forwards its NIXL-shaped children's raw transfer records.
        for data in (payload.get("transfers") or {}).values():
            _observe_transfers(stats, data, slow_s)
        return
    for child in payload.values():
        data = getattr(child, "data", child)
        if isinstance(data, dict):
            _observe_connector_stats(stats, data.get("data", data) if "data" in data else data, slow_s)


async def batched(
    items: AsyncGenerator[T, None], interval_s: float, visible: Callable[[T], bool] = lambda _: True
) -> AsyncGenerator[list[T], None]:
    """Regroup a stream so at most one group leaves per `interval_s`. Items leave at once until
    the first `visible` one has left (a first token that decodes to no text yet, such as part
    of a UTF-8 character, shows a client nothing), and the end of the stream never waits.
    Closing the result closes `items`.

    Each streamed chunk costs CPU at every hop (Ray message, ingress, Serve's proxy, SSE
    event), which on small hosts the engine's own scheduler has to share; sending the tokens
    of several steps at once cuts that. The reader keeps draining vLLM's output meanwhile, so
    a request's last tokens leave as soon as they are decoded instead of at the next tick.
    """
    pending: list[T] = []
    arrived = asyncio.Event()

    async def read() -> None:
        try:
            async for item in items:
                pending.append(item)
                arrived.set()
        finally:
            arrived.set()

    reader = asyncio.create_task(read()) if interval_s > 0 else None
    try:
        if reader is None:
            async for item in items:
                yield [item]
            return
        loop = asyncio.get_running_loop()
        sent = -math.inf  # when the last group left, once something visible has
        while True:
            await arrived.wait()
            if (wait := sent + interval_s - loop.time()) > 0:
                # Returns early when the stream ends; a timeout leaves the reader running.
                await asyncio.wait([reader], timeout=wait)
            group = pending[:]
            pending.clear()
            arrived.clear()
            if group:
                yield group
                if sent > -math.inf or any(visible(item) for item in group):
                    sent = loop.time()
            if reader.done() and not pending:
                reader.result()  # re-raise the stream's error, if any
                return
    finally:
        if reader is not None and not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        # For vLLM's generator, closing it early aborts the request in the engine.
        await items.aclose()


def _has_text(out: Any) -> bool:
    """Whether a vLLM RequestOutput delta shows the client anything."""
    return bool(out.outputs[0].text)


@ray.remote
class EngineActor:
    """A vLLM engine behind Ray calls: generate (streaming), abort, health, stats."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.llm: Any = None
        self.stats = EngineStats(engine_id=spec.engine_id, role=spec.role)
        self._info: EngineInfo | None = None

    async def start(self) -> EngineInfo:
        """Build the engine (blocks until vLLM's engine core is up); returns what it became."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from actors.stats_logger import TandemStatLogger

        args = AsyncEngineArgs(
            model=self.spec.model_path,
            served_model_name=[self.spec.served_name],
            tensor_parallel_size=self.spec.tensor_parallel_size,
            kv_transfer_config=self.spec.kv_transfer,
            **self.spec.engine_args,
        )
        if self.spec.cores is not None:
            _pin_process(self.spec.cores)
        observe = partial(_observe_connector_stats, slow_s=self.spec.slow_transfer_s)
        factory = partial(TandemStatLogger, sink=self.stats, observe_connector=observe)
        # AsyncLLM's constructor waits for the engine core process; keep the loop free.
        self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[factory])
        vcfg = self.llm.vllm_config
        ctx = ray.get_runtime_context()
        side = None
        if self.spec.kv_transfer is not None:
            side = f"{os.environ.get('VLLM_NIXL_SIDE_CHANNEL_HOST')}:{os.environ.get('VLLM_NIXL_SIDE_CHANNEL_PORT')}"
        self._info = EngineInfo(
            engine_id=self.spec.engine_id,
            role=self.spec.role,
            node_id=ctx.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            max_model_len=vcfg.model_config.max_model_len,
            block_size=vcfg.cache_config.block_size,
            side_channel=side,
            cores=self.spec.cores,
            cpu_binding=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            niceness=os.getpriority(os.PRIO_PROCESS, 0),
        )
        logger.info("engine %s (%s) ready: %s", self.spec.engine_id, self.spec.role, self._info)
        return self._info

    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError(f"engine {self.spec.engine_id} has not started; call start() first")
        return self._info

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream the request's output as deltas; the last chunk has finished=True."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        s = req.sampling
        params = SamplingParams(
            **msgspec.structs.asdict(s) | {"stop": s.stop or None, "stop_token_ids": s.stop_token_ids or None},
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": req.kv_transfer_params} if req.kv_transfer_params else None,
        )
        finished = False
        outputs = self.llm.generate({"prompt_token_ids": req.prompt_token_ids}, params, req.request_id)
        try:
            async with contextlib.aclosing(batched(outputs, req.stream_batch_s, _has_text)) as batches:
                async for batch in batches:
                    out, comp = batch[-1], batch[-1].outputs[0]
                    # vLLM ends an aborted request with a last output that is finished with reason
                    # "abort"; count it as aborted, as a cancelled stream is.
                    finished = out.finished and comp.finish_reason != "abort"
                    yield EngineChunk(
                        text="".join(o.outputs[0].text for o in batch),
                        token_ids=[t for o in batch for t in o.outputs[0].token_ids],
                        finished=out.finished,
                        finish_reason=comp.finish_reason,
                        stop_reason=comp.stop_reason,
                        num_prompt_tokens=len(out.prompt_token_ids or req.prompt_token_ids),
                        num_cached_tokens=out.num_cached_tokens or 0,
                        kv_transfer_params=out.kv_transfer_params if out.finished else None,
                    )
        finally:
            if finished:
                self.stats.num_requests_finished += 1
            else:
                self.stats.num_requests_aborted += 1

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (a no-op if it already finished)."""
        await self.llm.abort(request_id)

    async def health(self) -> bool:
        """Raise if the engine core is dead; True otherwise."""
        await self.llm.check_health()
        return True

    def get_stats(self) -> EngineStats:
        return self.stats

    def shutdown(self) -> None:
        """Stop vLLM's engine core processes before the actor itself is killed."""
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
