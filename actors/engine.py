"""EngineActor: one vLLM AsyncLLM per Ray actor, in the role prefill, decode or both.

The actor is the only place that imports vLLM's engine. Its process environment (core
binding, NIXL side channel, KV cache size) is set by the deployer through the actor's
runtime_env, so the engine core that vLLM spawns inherits it.

The engine is built in the constructor, so when Ray restarts a dead actor (the pool manager
creates it with ``max_restarts``) the engine comes back by itself, in the same placement
group bundle, on the same node and cores; Ray kills the dead actor's children (vLLM's engine
core and workers) with it. Each start is a new *incarnation*, which becomes the engine's
KV-connector id: NIXL peers handshake with the new process instead of the dead one, and the
CPU tier can release what the dead one held.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import os
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterator
from functools import partial, reduce
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import psutil
import ray

from actors.affinity import lacks_half_precision, node_cores, pin_process
from actors.kv_events import KVEventFollower, hash_settings
from actors.kv_index import TIER_SKIP
from actors.load import LoadMeter
from actors.logs import last_error, setup_logging, stderr_size
from actors.resume import ResumedText
from actors.run_dir import make_run_dir, record_shared_memory, recording_shared_memory, remove
from actors.stream import Emit, StreamServer
from actors.protocol import (
    TRANSFER_BUCKETS,
    CacheUpdate,
    EngineInfo,
    EngineLoad,
    EngineRequest,
    EngineStats,
    Role,
    merge_deltas,
    parse_stats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

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
    # Cores the actor and every process vLLM spawns for it run on, apart from the OpenMP
    # compute threads (bound by VLLM_CPU_OMP_THREADS_BIND); None: unbound.
    cores: list[int] | None = None
    # A KV transfer slower than this (seconds) is counted and logged as a WARNING.
    slow_transfer_s: float = 1.0
    # The Ray node the deployer planned this engine for (its side channel host and cores
    # were derived from it); None: anywhere.
    node_id: str | None = None
    # The port of its token path (actors.stream) on that node; None: one the OS picks.
    stream_port: int | None = None


class EngineMovedError(RuntimeError):
    """The actor came back on another node than its slot was planned for (Ray rescheduled
    its placement group after a node died); the pool manager places it anew."""


# How long a prefill's answer (its kv_transfer_params) is remembered after it left, so that
# a router that gave up on the stream before receiving it can still have the KV released
# (vLLM's NIXL lease frees it after 30 s anyway).
HANDOFF_TTL_S = 120.0
# How long `abort` waits for the request's run to take vLLM's last output: a prefill that
# finished just before the abort has its answer there, not yet remembered.
ABORT_DRAIN_S = 1.0
# How many of the latest request ids an engine remembers having started, and having been
# told to abort before they arrived.
STARTED_MEMORY = 10_000
# A router's cache_updates call that saw a change (or timed out) waits this long more, so
# that the events of one busy stretch reach routers in a few calls rather than one per step.
CACHE_UPDATE_COALESCE_S = 0.01
# The prompt an engine computes once before it serves (EngineActor.warm_up), in tokens: a
# chat turn's size, capped by the engine's own limits.
WARM_UP_TOKENS = 512
# How long a CPU engine's vLLM engine core gets to exit on its own before it is killed
# (vLLM's default is 5 s). Its useful cleanup (the connectors' shutdown, the NIXL handshake
# thread) is over in under 2 s even on a slow 2-core host; what follows is a full garbage
# collection of a heap it is about to drop, which took the rest of the 5 s on every stop
# (docs/startup.md). GPU engines keep vLLM's own grace: a device's teardown may need it.
CPU_ENGINE_STOP_GRACE_S = 2.0


def emulates_half_precision(dtype: Any) -> bool:
    """Whether this host runs a model's `dtype` matmuls without native instructions
    (actors.affinity.lacks_half_precision: about 100x slower than float32)."""
    import torch

    return dtype in (torch.bfloat16, torch.float16) and lacks_half_precision()


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


def _observe_connector_stats(stats: EngineStats, payload: dict[str, Any], slow_s: float) -> None:
    """Fold a scheduler_stats.kv_connector_stats payload into the engine's stats. Tandem's
    engines send one of two: TandemMultiConnector's StatsPayload (per-child counters, plus its
    NIXL children's transfer records, which count as if NixlConnector ran alone), or
    TandemNixlConnector's own NIXL data dict when it runs alone."""
    if "children" not in payload:
        _observe_transfers(stats, payload, slow_s)
        return
    parsed = parse_stats(payload)
    for name, counters in parsed.children.items():
        mine = stats.connector_counters.setdefault(name, {})
        for key, value in msgspec.structs.asdict(counters).items():
            mine[key] = mine.get(key, 0) + value
    for data in parsed.transfers.values():
        _observe_transfers(stats, data, slow_s)


async def batched(
    items: AsyncGenerator[T, None], interval_s: float, visible: Callable[[T], bool] = lambda _: True
) -> AsyncGenerator[list[T], None]:
    """Regroup a stream so at most one group leaves per `interval_s`. Items leave at once until
    the first `visible` one has left (a first token that decodes to no text yet, such as part
    of a UTF-8 character, shows a client nothing), and the end of the stream never waits.
    Closing the result closes `items`.

    Each streamed chunk costs CPU at every hop (the token path, vLLM's serving layer in the
    ingress, the SSE event), which on small hosts the engines' cores have to give; sending the tokens
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
    return any(c.text for c in out.outputs)


def one_process_engine_config(args: AsyncEngineArgs) -> VllmConfig:
    """vLLM's config for `args`; a one-rank engine runs its model in the engine core, with
    its rendezvous file in its run directory (actors.executor).

    vLLM's CPU backend turns the one-process executor ("uni") into its multiprocessing one,
    because only a process started under the OpenMP environment is bound to its cores. That
    costs a third process per engine: another import of torch and vLLM at every start, a
    shared-memory queue and a hop between scheduler and forward pass at every step. Tandem
    starts the engine core itself under that environment (`omp_environment`), so the engine
    core can be the worker. On other platforms one rank gets the one-process executor anyway.
    """
    from actors.executor import RunDirExecutor

    one_rank = args.tensor_parallel_size == args.pipeline_parallel_size == args.data_parallel_size == 1
    if one_rank and args.distributed_executor_backend is None:
        # The class, not "uni": the CPU platform rewrites only the name.
        args.distributed_executor_backend = RunDirExecutor
    return args.create_engine_config()


@contextlib.contextmanager
def omp_environment(vcfg: VllmConfig) -> Iterator[None]:
    """vLLM's OpenMP binding of rank 0 in this process's environment while vLLM spawns the
    engine core, which inherits it; a no-op off CPU and for the multiprocessing executor
    (that sets it for each worker itself)."""
    from vllm.platforms import current_platform
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    backend = vcfg.parallel_config.distributed_executor_backend
    if not (current_platform.is_cpu() and isinstance(backend, type) and issubclass(backend, UniProcExecutor)):
        yield
        return
    # Spawning the engine core would start multiprocessing's resource tracker, which then
    # loaded OpenMP (vLLM preloads it) under the binding and sat on the compute cores.
    resource_tracker.ensure_running()
    with OMPProcessManager(vcfg).configure_omp_envs(rank=0, local_rank=0):
        yield


@ray.remote
class EngineActor:
    """A vLLM engine: requests and their outputs on the token path (actors.stream); abort,
    health, stats and the KV-cache long-poll as Ray calls."""

    def __init__(self, spec: EngineSpec) -> None:
        """Build the engine (blocks until vLLM's engine core is up). Ray queues calls to the
        actor meanwhile, so `info()` answers once the engine serves."""
        setup_logging()
        from vllm.config.kv_events import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.gc_utils import freeze_gc_heap
        from vllm.v1.engine.async_llm import AsyncLLM

        from actors.stats_logger import TandemStatLogger

        self.spec = spec
        self.incarnation = uuid.uuid4().hex[:8]
        self.stats = EngineStats(engine_id=spec.engine_id, role=spec.role)
        self.load = LoadMeter()
        self.requests_by_origin: Counter[str] = Counter()
        # request id -> (when it left, kv_transfer_params) of prefills whose answer was sent.
        self._handed_off: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        # request id -> set when its run on vLLM has ended (`_run`)
        self._streams: dict[str, asyncio.Event] = {}
        # Requests running here that `abort` was called for: each ends at its next output even
        # when vLLM did not know it yet when the abort came.
        self._aborting: set[str] = set()
        # The latest request ids this engine was given (`abort` tells a request that never
        # started here from one that ended), and those aborted before they arrived: the token
        # path and Ray's abort call are two channels, so an abort may overtake its request.
        self._started: OrderedDict[str, None] = OrderedDict()
        self._aborted_early: OrderedDict[str, None] = OrderedDict()
        ctx = ray.get_runtime_context()
        if spec.node_id is not None and ctx.get_node_id() != spec.node_id:
            raise EngineMovedError(
                f"engine {spec.engine_id} was planned for node {spec.node_id} but started on {ctx.get_node_id()}"
            )
        kv_transfer = self.spec.kv_transfer
        if kv_transfer is not None:
            kv_transfer = {**kv_transfer, "engine_id": f"{spec.engine_id}@{self.incarnation}"}
        args = AsyncEngineArgs(
            model=spec.model_path,
            served_model_name=[spec.served_name],
            tensor_parallel_size=spec.tensor_parallel_size,
            kv_transfer_config=kv_transfer,
            **spec.engine_args,
        )
        # vLLM's ipc sockets, its engine processes inheriting the setting, and the KV-cache
        # events it publishes for this incarnation (routers follow them through
        # `cache_updates`) live in a directory of this process's (actors.run_dir).
        self.run_dir = make_run_dir()
        os.environ["VLLM_RPC_BASE_PATH"] = str(self.run_dir)
        events_endpoint = f"ipc://{self.run_dir}/kv-events"
        self.kv_events = KVEventFollower(events_endpoint)
        args.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint)
        # vLLM binds only its OpenMP compute threads; its scheduler process, this actor's
        # event loop and NIXL would otherwise float onto other engines' cores and preempt
        # their steps. An unbound engine takes the whole node: Ray's worker it runs in may
        # have inherited a narrower mask (orchestrator.cluster.confine_own_ray).
        pin_process(os.getpid(), spec.cores if spec.cores is not None else node_cores())
        observe = partial(_observe_connector_stats, slow_s=spec.slow_transfer_s)
        factory = partial(TandemStatLogger, sink=self.stats, observe_connector=observe)
        vcfg = one_process_engine_config(args)
        logged = stderr_size()
        try:
            with omp_environment(vcfg), recording_shared_memory(self.run_dir):
                self.llm: Any = AsyncLLM.from_vllm_config(
                    vcfg, stat_loggers=[factory], enable_log_requests=args.enable_log_requests,
                    disable_log_stats=args.disable_log_stats)
        except Exception as err:
            # vLLM tells this process only that its engine core failed ("See root cause
            # above"); the cause is in the log the core shares with it.
            if (cause := last_error(logged)) is None:
                raise
            raise RuntimeError(f"vLLM's engine core did not start: {cause}") from err
        vcfg = self.llm.vllm_config
        children = [p.pid for p in psutil.Process().children(recursive=True)]
        # What vLLM leaves in /dev/shm when its processes are killed goes with the run dir.
        record_shared_memory(self.run_dir, children)
        hash_algo, hash_seed = hash_settings(spec.engine_args)
        # Routers send requests and read outputs over this socket (actors.stream), not Ray calls.
        self.stream = StreamServer(ray.util.get_node_ip_address(), spec.stream_port)
        self._info = EngineInfo(
            engine_id=spec.engine_id,
            role=spec.role,
            incarnation=self.incarnation,
            node_id=ctx.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            child_pids=children,
            max_model_len=vcfg.model_config.max_model_len,
            block_size=vcfg.cache_config.block_size,
            cores=spec.cores,
            cpu_binding=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            niceness=os.getpriority(os.PRIO_PROCESS, 0),
            hash_algo=hash_algo,
            hash_seed=hash_seed,
            num_blocks=vcfg.cache_config.num_gpu_blocks or 0,
            stream_address=self.stream.address,
            dtype=str(vcfg.model_config.dtype).removeprefix("torch."),
            emulated_dtype=vcfg.device_config.device_type == "cpu" and emulates_half_precision(vcfg.model_config.dtype),
        )
        # As vLLM's own server does after start-up: the objects made so far (torch, vLLM, Ray)
        # stay, and a full collection over them took ~0.3 s here, a stall of every stream.
        freeze_gc_heap()
        # Ray runs an async actor's constructor on the actor's event loop, which serves the
        # token path from here on.
        self.stream.start(self._run)
        logger.info("engine %s (%s) ready: %s", spec.engine_id, spec.role, self._info)

    def info(self) -> EngineInfo:
        return self._info

    async def warm_up(self) -> float:
        """Compute one prompt of a chat turn's size and a token after it, then forget them: the
        blocks (the prefix cache is reset, which routers see as a cleared cache) and the
        counts. vLLM warms up nothing for a CPU engine in eager mode, and there a fresh
        engine's first prompt took 20-30 ms longer than the next (docs/bench-results.md,
        "A fresh engine's first prompt"); the pool manager calls this before the engine serves
        anyone. The prompt stays out of the CPU tier (TIER_SKIP). Returns the seconds it took."""
        t0 = time.perf_counter()
        vcfg = self.llm.vllm_config
        n = min(WARM_UP_TOKENS, vcfg.model_config.max_model_len - 2, vcfg.scheduler_config.max_num_batched_tokens)
        vocab = vcfg.model_config.get_vocab_size()
        before = copy.deepcopy(self.stats)
        # Tokens no prompt is likely to start with; its blocks are dropped anyway.
        await self._run_alone([(i * 7919 + 104729) % vocab for i in range(n)], 2, "warm-up")
        if not await self.llm.reset_prefix_cache():
            logger.warning("engine %s kept its warm-up prompt's blocks: vLLM could not reset its prefix cache",
                           self.spec.engine_id)
        # vLLM publishes KV events (the reset's "all blocks cleared") from its next step: one
        # token with no block to store makes that step now, not at the first user's request.
        await self._run_alone([0], 1, "warm-up-cleared")
        # The stat logger filled self.stats in place as the requests ran; metrics count users'.
        for field in EngineStats.__struct_fields__:
            setattr(self.stats, field, getattr(before, field))
        return time.perf_counter() - t0

    async def _run_alone(self, prompt: list[int], max_tokens: int, name: str) -> None:
        """Run a prompt of the engine's own to its end, greedy, the CPU tier kept out of it."""
        from vllm.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": {TIER_SKIP: True}})
        async for _ in self.llm.generate({"type": "token", "prompt_token_ids": prompt}, params, f"{name}-{self.incarnation}"):
            pass

    def vllm_config(self) -> Any:
        """The engine's resolved VllmConfig, for the ingress's renderer (orchestrator.engine_client):
        it tokenizes and applies defaults exactly as this engine would."""
        return self.llm.vllm_config

    def _params(self, req: EngineRequest, resumed: ResumedText | None) -> Any:
        """vLLM's SamplingParams for `req`: streamed as deltas, with the KV hand-off's params."""
        from vllm.sampling_params import RequestOutputKind

        params = req.sampling.clone()
        params.output_kind = RequestOutputKind.DELTA
        if req.kv_transfer_params:
            params.extra_args = (params.extra_args or {}) | {"kv_transfer_params": req.kv_transfer_params}
        if resumed is not None:
            params.stop = []  # checked by ResumedText, over the whole output
        return params

    async def _run(self, req: EngineRequest, emit: Emit) -> None:
        """Run one request on vLLM to its last output, emitting its RequestOutputs to the router
        as deltas, without the prompt (the router has it); what vLLM raises goes to the router.

        A request ends early when its router is gone (the token path refuses the output) or
        `abort` was called for it; leaving vLLM's stream early aborts the request in vLLM."""
        rid = req.request_id
        if rid in self._aborted_early:
            # Its router gave up on it before it arrived; `abort` released what it held. It
            # counts as aborted here like one stopped while running: a client that hangs up
            # just as its decode request leaves is an abort on the decode engine either way.
            del self._aborted_early[rid]
            self.stats.num_requests_aborted += 1
            return
        ended = self._streams[rid] = asyncio.Event()
        self._started[rid] = None
        if len(self._started) > STARTED_MEMORY:
            self._started.popitem(last=False)
        resumed = None
        if req.resume_from is not None:
            resumed = ResumedText(
                self.llm.tokenizer, req.prompt_token_ids[: req.resume_from], req.prompt_token_ids[req.resume_from :], req.sampling
            )
        params = self._params(req, resumed)
        finished = prefilled = False
        num_prompt = len(req.prompt_token_ids)
        remaining = num_prompt + params.max_tokens * params.n
        self.load.add(1, remaining)
        self.requests_by_origin[req.origin] += 1
        self.kv_events.poke(req.origin, req.blocks)  # routers' view of the load, and of what its blocks are to traffic
        try:
            # Already rendered by the ingress: a typed token input takes vLLM's direct path (a
            # raw prompt would be rendered again, on the renderer's thread pool, a thread hop
            # on the TTFT path).
            prompt = req.prompt_fields | {"type": "token", "prompt_token_ids": req.prompt_token_ids}
            stream = self.llm.generate(prompt, params, req.request_id, **req.generate_kwargs)
            async with contextlib.aclosing(batched(stream, req.stream_batch_s, _has_text)) as batches:
                async for batch in batches:
                    out = reduce(merge_deltas, batch)
                    done = sum(len(c.token_ids) for c in out.outputs) + (0 if prefilled else num_prompt)
                    prefilled = True
                    self.load.add(0, -done)
                    remaining -= done
                    if resumed is not None:
                        comp = out.outputs[0]
                        comp.text, comp.token_ids, stop = resumed.feed(
                            list(comp.token_ids), out.finished, out.finished and comp.finish_reason == "stop"
                        )
                        if stop is not None:
                            out.finished, comp.finish_reason, comp.stop_reason = True, "stop", stop
                    # vLLM ends an aborted request with a last output that is finished with reason
                    # "abort"; count it as aborted, as a cancelled stream is.
                    finished = out.finished and all(c.finish_reason != "abort" for c in out.outputs)
                    if out.finished and out.kv_transfer_params:
                        self._remember_handoff(req.request_id, out.kv_transfer_params)
                    # The router has the prompt and puts it back: a long prompt's ids are not
                    # pickled into every streamed chunk.
                    out.prompt, out.prompt_token_ids = None, None
                    if not await emit(out) or out.finished or rid in self._aborting:
                        # Its router is gone, it was aborted, or a stop string was found here:
                        # closing vLLM's stream aborts vLLM's request if it still runs.
                        return
        finally:
            ended.set()
            self._aborting.discard(rid)
            if self._streams.get(rid) is ended:
                del self._streams[rid]
            self.load.add(-1, -remaining)
            self.requests_by_origin[req.origin] -= 1
            if not self.requests_by_origin[req.origin]:
                del self.requests_by_origin[req.origin]
            self.kv_events.poke(req.origin)
            if finished:
                self.stats.num_requests_finished += 1
            else:
                self.stats.num_requests_aborted += 1

    def _remember_handoff(self, request_id: str, kv_params: dict[str, Any]) -> None:
        now = time.monotonic()
        self._handed_off[request_id] = (now, kv_params)
        while self._handed_off and next(iter(self._handed_off.values()))[0] < now - HANDOFF_TTL_S:
            self._handed_off.popitem(last=False)

    async def abort(self, request_id: str, kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Stop a request and free its blocks (a no-op if it already finished). For a prefill
        that had already finished, returns the kv_transfer_params it answered with: its blocks
        are held for a decode engine that will never come, and only a decode engine can
        release them (`release_remote_kv`). A request that has not arrived yet (the abort, a Ray
        call, overtook it on the token path) will not run when it does; a decode among those
        (`kv_transfer_params`: the prefill's answer) releases the prefill's blocks now: no one
        else would."""
        if request_id not in self._started:
            self._aborted_early[request_id] = None
            if len(self._aborted_early) > STARTED_MEMORY:
                self._aborted_early.popitem(last=False)
            if kv_transfer_params and kv_transfer_params.get("do_remote_prefill"):
                await self.release_remote_kv(f"{request_id}-release", kv_transfer_params)
            return None
        if request_id in self._streams:
            self._aborting.add(request_id)
        if kv_transfer_params and kv_transfer_params.get("do_remote_decode"):
            await self._abort_prefill(request_id)
        else:
            await self.llm.abort(request_id)
        if (stream_ended := self._streams.get(request_id)) is not None:
            # After an abort vLLM ends the stream at once, with its last output: the prefill's
            # answer when it had finished in the engine core just before.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stream_ended.wait(), ABORT_DRAIN_S)
        handed_off = self._handed_off.pop(request_id, None)
        return handed_off[1] if handed_off is not None else None

    async def _abort_prefill(self, request_id: str) -> None:
        """Abort a prefill in vLLM without losing its answer. vLLM's abort forgets the request
        in its front end first, so the last output of a prefill that finished in the engine
        core just before (its kv_transfer_params: blocks held for a decode) is dropped when it
        arrives, and the blocks stay held until NIXL's lease ends. Aborting in the core first,
        then making a round trip to it, lets that output reach the request's stream before the
        front end forgets the request: the core answers a utility call after every output it
        produced before, on the same socket, and the front end hands outputs to their streams
        in that order."""
        core = self.llm.engine_core
        in_core = list(self.llm.output_processor.external_req_ids.get(request_id, ()))
        if in_core:
            await core.abort_requests_async(in_core)
            # A core that does not answer (dying) has no answer to hand over: abort all the same.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(core.call_utility_async("is_sleeping"), ABORT_DRAIN_S)
        await self.llm.abort(request_id)

    async def release_remote_kv(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        """Tell the prefill engine named in `kv_transfer_params` that this decode engine will
        not read those blocks, so it frees them now instead of at its lease's end (vLLM's own
        path for a decode request rejected before it was scheduled)."""
        await self.llm.notify_kv_transfer_request_rejected(request_id, kv_transfer_params)

    async def health(self) -> EngineLoad:
        """Raise if the engine core is dead; otherwise the engine's load (see LoadMeter)."""
        await self.llm.check_health()
        return self.load.report(self.stats.kv_cache_usage)

    async def cache_updates(self, incarnation: str, version: int, timeout_s: float, history_s: float = 0.0,
                            origin: str = "") -> CacheUpdate:
        """What changed in this engine's prefix cache since a router's `version` of
        `incarnation` (every key held, when the router had another incarnation or fell too far
        behind), with the load now and the blocks of the requests that arrived since (for a
        router that had another incarnation: of the last `history_s` seconds). Waits up to
        `timeout_s` for a change first (long-poll), a change of load by the requests of the
        router tagged `origin` (its own) left out."""
        follower = self.kv_events
        deltas = None
        if incarnation == self.incarnation:
            await follower.wait_changed(version, timeout_s, origin)
            await asyncio.sleep(CACHE_UPDATE_COALESCE_S)
            current, deltas = follower.changes_since(version)
            uses = follower.uses_since(version)
        else:
            # A router that starts following this incarnation: what traffic used here lately.
            uses = follower.uses_within(history_s)
        if deltas is None or any(d.cleared for d in deltas):
            current, held = follower.snapshot()
            full, stored, removed = True, held, []
        else:
            net: dict[int, bool] = {}
            for d in deltas:
                net.update(dict.fromkeys(d.stored, True))
                net.update(dict.fromkeys(d.removed, False))
            full = False
            stored = [k for k, held_now in net.items() if held_now]
            removed = [k for k, held_now in net.items() if not held_now]
        return CacheUpdate(self.incarnation, current, full, stored, removed,
                           self.load.num_requests, self.load.num_tokens, self.stats.kv_cache_usage,
                           dict(self.requests_by_origin), uses)

    async def watch(self) -> None:
        """Never returns: the pool manager keeps one call pending, which Ray fails as soon as
        this process dies (a death notice without polling)."""
        await asyncio.Event().wait()

    def get_stats(self) -> EngineStats:
        return self.stats

    def shutdown(self) -> None:
        """Stop vLLM's engine core processes before the actor itself is killed, and remove
        the sockets and shared memory they leave."""
        if self.llm is not None:
            from vllm.platforms import current_platform

            self.llm.shutdown(timeout=CPU_ENGINE_STOP_GRACE_S if current_platform.is_cpu() else None)
            self.llm = None
        self.kv_events.close()
        self.stream.close()
        remove(self.run_dir)
