"""The router: picks engines per request and runs the prefill -> decode protocol, with failover.

One request, disaggregated (DESIGN.md):
  1. prefill engine: the prompt with max_tokens=1 and kv_transfer_params={"do_remote_decode": True};
  2. its final output carries kv_transfer_params (engine id, block ids, host, port);
  3. decode engine: the same prompt and sampling with those params; its NixlConnector pulls
     the blocks and the decode engine streams every output token back.
With `routing.first_token: prefill` (the default) the prefill runs with the client's sampling
and its token goes to the client at once; the decode request (sent before that token is
handed on) is the prompt plus that token and pulls the prompt's blocks, so the KV move and
the decode's first step are no longer in the time to first token. Requests whose later
tokens would depend on which engine sampled the first (`_first_token_can_move`) keep step 3.

Failover, so that a dying engine costs time, never a request:
- a prefill that fails or times out is retried on another healthy prefill replica; when none
  is left, the decode engine prefills the request itself (a counted fallback);
- when the engine streaming the output fails, the request continues on another healthy engine
  (another decode replica, else any healthy engine, a prefill one included) from the prompt
  plus the tokens already sent, so the client's stream goes on unbroken; at most
  `routing.max_migrations` times, then a clear error;
- an engine whose call failed leaves this router's choices at once (until the pool manager
  lists a new incarnation of it) and is reported to the manager, which checks and restarts it.

Cancellation: a consumer that leaves at any phase has the request aborted on the engine that
holds it. The decode request goes out in the same step as the prefill's answer arrives, so a
prefill's KV blocks are never left waiting for a decode that will not come: aborting the
decode request frees them at once (vLLM's decode side tells the prefill side), and a prefill
that had already answered when its abort came is released through a decode engine
(`release_remote_kv`), not at the end of NIXL's 30-s lease.

Which engine of a pool serves a request is the policy's choice (`routing.policy`): round
robin, least outstanding, or kv_aware, which scores each replica on what its prefix cache
holds (vLLM's KV events, followed in orchestrator.cache_view), the CPU tier and load
(orchestrator.scoring). Whether a disaggregated request is prefilled remotely at all is
decided per request (`routing.disaggregation`, orchestrator.disaggregation): the decode engine
is chosen first, and prefills the request itself when little of the prompt is left to compute
there.

Which engines exist comes from the pool manager's routing table (`set_engines`); a router
built on a fixed list (benchmarks, handshake pre-warming) works the same without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import Any, Literal, get_args

import msgspec
from ray.exceptions import RayError

from actors.kv_index import TIER_HINT, TIER_SAVED
from actors.protocol import BlockUse, EngineRequest, Role, merge_deltas
from actors.stream import EngineStreams, RemoteError, StreamLost
from connectors.config import PREFILLED_TOKENS
from orchestrator.background import outlive
from orchestrator.cache_view import CacheView, PromptKeys
from orchestrator.config import Policy, RoutingConfig
from orchestrator.disaggregation import DECISIONS, Decision, Reason, decide, remote_ahead_tokens
from orchestrator.protocol import EngineRef
from orchestrator.scoring import EngineFacts, new_tokens, queue_tokens, rank, tier_tokens
from orchestrator.speed import PrefillSpeed

logger = logging.getLogger("tandem.router")

# Where a request was when its consumer left: before any engine, prefilling, waiting for its
# first output token (the decode engine pulling the KV), streaming its output.
Phase = Literal["queued", "prefill", "handoff", "decode"]

# An abort is a courtesy to a live engine; one that does not answer this fast is not waited on.
ABORT_TIMEOUT_S = 2.0
# How long a router skips an engine whose process failed a call if the pool manager never
# says otherwise (it normally drops the engine from routing within a couple of seconds).
EXCLUSION_TTL_S = 30.0


class EngineFailure(Exception):
    """The engine serving a request failed: its process died or is unreachable, its engine
    core is dead, or it ended the request with an error."""

    def __init__(self, engine: EngineRef, cause: str, *, engine_down: bool) -> None:
        super().__init__(f"engine {engine.engine_id} failed: {cause}")
        self.engine = engine
        self.cause = cause
        # False when only this request failed and the engine itself may be fine.
        self.engine_down = engine_down


class NoEngineError(RuntimeError):
    """No healthy engine is left to serve a request (the ingress answers 503)."""


class MigrationLimitError(RuntimeError):
    """A request's engines failed more often than routing.max_migrations allows."""


class UnresumableError(RuntimeError):
    """The engine streaming a request failed and the request cannot continue elsewhere."""


def _is_client_error(err: BaseException) -> bool:
    """vLLM's own input checks in the engine (its VLLMClientError, ValueError, TypeError) are
    the request's fault: no retry, no engine marked failed, the client gets a 4xx."""
    from vllm.exceptions import VLLMClientError

    return isinstance(err, (ValueError, TypeError, VLLMClientError))


async def stream_engine(
    streams: EngineStreams,
    engine: EngineRef,
    req: EngineRequest,
    on_held_kv: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> AsyncIterator[Any]:
    """Stream an engine's vLLM RequestOutputs over the token path; abort the request there if
    the consumer stops early.

    Raises EngineFailure when the engine fails (`engine_down` when its connection was lost);
    an input vLLM's checks in the engine rejected is raised as vLLM raised it. Ends at the
    finished output instead of waiting for the stream's end frame. An abort of a prefill that
    had already finished returns its kv_transfer_params, handed to `on_held_kv` to release
    the held blocks.
    """
    finished = False
    engine_gone = False
    try:
        try:
            async for out in streams.generate(engine.stream_address, req, merge_deltas):
                finished = out.finished
                yield out
                if finished:
                    return
        except StreamLost as err:
            engine_gone = True
            raise EngineFailure(engine, str(err), engine_down=True) from err
        except RemoteError as err:
            if _is_client_error(err.cause):
                raise err.cause from None
            raise EngineFailure(engine, str(err), engine_down=False) from err
        raise EngineFailure(engine, "its stream ended before the request finished", engine_down=False)
    finally:
        if not finished and not engine_gone:
            # Outside the request: a client that leaves cancels it, and with it what it awaits.
            await outlive(_abort(engine, req, on_held_kv))


async def _abort(engine: EngineRef, req: EngineRequest,
                 on_held_kv: Callable[[dict[str, Any]], Awaitable[None]] | None) -> None:
    """Abort `req` on `engine`; blocks the abort hands back (a prefill that had finished)
    go to `on_held_kv`."""
    held = None
    with contextlib.suppress(RayError, asyncio.TimeoutError):
        held = await asyncio.wait_for(engine.handle.abort.remote(req.request_id, req.kv_transfer_params), ABORT_TIMEOUT_S)
    if held and on_held_kv is not None:
        await on_held_kv(held)


class EnginePicker:
    """Chooses a healthy replica within one pool and tracks requests in flight per replica."""

    def __init__(self, engines: Sequence[EngineRef], policy: Policy) -> None:
        self.policy = policy
        self.engines: list[EngineRef] = []
        self.outstanding: dict[str, int] = {}
        # kv_aware's `work` queue of each replica, from this router's requests in flight there
        # (Router._claim: prompt tokens to compute, or on a decode replica the KV held).
        self.queued_tokens: dict[str, float] = {}
        # engine id -> (incarnation whose process failed, when); skipped until the routing table
        # drops that incarnation or lists another, or for EXCLUSION_TTL_S at most.
        self.failed: dict[str, tuple[str, float]] = {}
        self._rr = itertools.count()
        self.set_engines(engines)

    def set_engines(self, engines: Sequence[EngineRef]) -> None:
        self.engines = list(engines)
        for e in self.engines:
            self.outstanding.setdefault(e.engine_id, 0)
        listed = {e.engine_id: e.incarnation for e in self.engines}
        self.failed = {eid: f for eid, f in self.failed.items() if listed.get(eid) == f[0]}

    def healthy(self) -> list[EngineRef]:
        now = time.monotonic()
        self.failed = {eid: f for eid, f in self.failed.items() if now - f[1] < EXCLUSION_TTL_S}
        return [e for e in self.engines if self.failed.get(e.engine_id, (None,))[0] != e.incarnation]

    def candidates(self, exclude: Collection[str] = ()) -> list[EngineRef]:
        """The healthy engines not in `exclude`, starting at the next in round-robin order."""
        candidates = [e for e in self.healthy() if e.engine_id not in exclude]
        if not candidates:
            return []
        start = next(self._rr) % len(candidates)
        return candidates[start:] + candidates[:start]

    def pick(self, exclude: Collection[str] = ()) -> EngineRef | None:
        """A healthy engine not in `exclude` by round robin or least outstanding (kv_aware
        falls back to the latter), or None when there is none."""
        order = self.candidates(exclude)
        if not order:
            return None
        if self.policy == "round_robin":
            return order[0]
        # Least outstanding; ties go round robin so equal replicas share the load.
        return min(order, key=lambda e: self.outstanding.get(e.engine_id, 0))

    def mark_failed(self, engine: EngineRef) -> None:
        self.failed[engine.engine_id] = (engine.incarnation, time.monotonic())

    def acquire(self, engine: EngineRef, tokens: float = 0.0) -> None:
        """Count a request sent to `engine`, weighing `tokens` in its queue (Router._claim)."""
        eid = engine.engine_id
        self.outstanding[eid] = self.outstanding.get(eid, 0) + 1
        self.queued_tokens[eid] = self.queued_tokens.get(eid, 0.0) + tokens

    def release(self, engine: EngineRef, tokens: float = 0.0) -> None:
        """The request `acquire` counted (with the same `tokens`) has left `engine`."""
        eid = engine.engine_id
        self.outstanding[eid] -= 1
        self.queued_tokens[eid] = max(0.0, self.queued_tokens[eid] - tokens) if self.outstanding[eid] else 0.0


class RequestTrace(msgspec.Struct):
    """What happened to one request, for usage accounting, /metrics, its response headers
    and the request log."""

    # The client's request id (vLLM's, or its X-Request-Id), as Router.generate got it.
    request_id: str = ""
    # Prompt tokens the prefilling engine found in its own prefix cache.
    num_cached_tokens: int = 0
    # Disaggregated requests: prefilled on the prefill pool ("remote") or on the decode
    # engine ("local"), as routing.disaggregation decided.
    disaggregation: Decision | None = None
    # Set when the disaggregated path was abandoned: "prefill_failed", "prefill_timeout",
    # "no_kv_params", "no_prefill_engine" (the decode engine prefilled), "no_decode_engine"
    # (a prefill engine served the whole request).
    fallback: str | None = None
    # Times the request moved to another engine mid-stream.
    migrations: int = 0
    # Where it ran, for its response headers and the request log: the prefill engine whose
    # answer it used (a remote prefill), the engine streaming its output (the last one, after
    # migrations), and why routing.disaggregation chose remote or local.
    prefill_engine: str | None = None
    output_engine: str | None = None
    reason: Reason | None = None
    # kv_aware's score of each engine it chose among for this request (the higher won).
    scores: dict[str, float] = {}
    # The prompt tokens kv_aware expected the prefill replica it chose to compute before this
    # request's first token (its queue, and the request's own part); with the prefill's time,
    # what the router learns the replica's speed from (orchestrator.speed).
    prefill_tokens_ahead: float | None = None
    # The first token was the prefill engine's, streamed as it came (routing.first_token).
    first_from_prefill: bool = False
    # When the HTTP request reached the ingress (openai_app.RequestGate), before vLLM's
    # serving layer parsed, rendered and tokenized it; None off the HTTP path.
    t_received: float | None = None
    t_arrival: float = 0.0
    t_prefill_done: float | None = None
    # When the request that streams the output left for its engine (decode or colocated).
    t_decode_sent: float | None = None
    t_first_token: float | None = None
    # The decode engine's first token, when the first was the prefill's.
    t_second_token: float | None = None
    t_done: float | None = None

    def phases(self) -> dict[str, float]:
        """Seconds spent in each phase this request reached, in order (for /metrics and benchmarks).

        ingress (HTTP requests only): from reaching the ingress to reaching the router, vLLM's
        serving layer parsing, rendering and tokenizing it; prefill: arrival at the router to
        the prefill engine's answer (disaggregated only); route: to the decode (or colocated)
        request leaving; first_token: to its first token (KV pull and
        first decode step, or queue and prefill when colocated; when the prefill's token is
        streamed, handing it on, and no route: the decode request leaves after that);
        second_token (only then): to the decode engine's first token (the decode request's
        way in, the KV pull, its first step, the way back); decode: to the last token.
        Together, prefill, route and first_token are the router's time to first token.
        """
        route = None if self.first_from_prefill else self.t_decode_sent
        marks = (("prefill", self.t_prefill_done), ("route", route), ("first_token", self.t_first_token),
                 ("second_token", self.t_second_token), ("decode", self.t_done))
        out: dict[str, float] = {}
        if self.t_received is not None:
            out["ingress"] = self.t_arrival - self.t_received
        last = self.t_arrival
        for name, t in marks:
            if t is not None:
                out[name], last = t - last, t
        return out

    def placement(self) -> str | None:
        """The disaggregation decision as it turned out, e.g. `decision=remote;reason=long_uncached`,
        with `;fallback=prefill_timeout` when the disaggregated path was abandoned; None when
        there was none to make (a colocated engine, a pinned pair)."""
        parts = (("decision", self.disaggregation), ("reason", self.reason), ("fallback", self.fallback))
        return ";".join(f"{k}={v}" for k, v in parts if v) or None

    def describe(self, prompt_tokens: int, completion_tokens: int) -> str:
        """The request in one line of the request log (serve.log_requests)."""
        p, o = self.prefill_engine, self.output_engine
        if p and o:
            where = f"prefilled on {p}, streamed from {o}"
        elif o:
            where = f"served by {o}"
        else:
            where = f"answered by prefill engine {p}" if p else "served by no engine"
        if self.disaggregation:
            where += f" ({self.disaggregation}: {self.reason})"
        if self.fallback:
            where += f", off the disaggregated path ({self.fallback})"
        if self.migrations:
            where += f", moved to another engine {self.migrations}x mid-stream"
        if self.scores:
            ranked = sorted(self.scores.items(), key=lambda item: -item[1])
            where += " [scores " + ", ".join(f"{e} {s:.3f}" for e, s in ranked) + "]"
        times = ", ".join(f"{name} {1000 * s:.1f} ms" for name, s in self.phases().items())
        return (f"request {self.request_id}: {prompt_tokens} prompt tokens ({self.num_cached_tokens} cached), "
                f"{completion_tokens} generated; {where}; {times}")


def needs_cache_view(routing: RoutingConfig) -> bool:
    """Whether routing looks at the engines' prefix caches (else nothing follows them)."""
    return routing.policy == "kv_aware" or routing.disaggregation == "conditional"


def _zeros(*keys: str) -> dict[str, int]:
    return dict.fromkeys(keys, 0)


class RouterStats(msgspec.Struct):
    """The router's counters since it started, exported on /metrics. Every label value a
    counter can take starts at 0, so its series exist (and rates work) before the first event."""

    # Prefill attempts retried on another replica, by why the attempt ended.
    retries: dict[str, int] = msgspec.field(default_factory=lambda: _zeros("prefill_failed", "prefill_timeout"))
    # Requests that left the disaggregated path, by reason (see RequestTrace.fallback).
    fallbacks: dict[str, int] = msgspec.field(default_factory=lambda: _zeros(
        "prefill_failed", "prefill_timeout", "no_kv_params", "no_prefill_engine", "no_decode_engine"))
    # Requests moved to another engine mid-stream, and requests that failed with no engine
    # left or past the migration limit.
    migrations: int = 0
    failed: dict[str, int] = msgspec.field(default_factory=lambda: _zeros("no_engine", "migration_limit"))
    # Requests whose consumer left, by the phase they were in.
    aborts: dict[str, int] = msgspec.field(default_factory=lambda: _zeros(*get_args(Phase)))
    # Disaggregation decisions, keyed "decision:reason" (orchestrator.disaggregation).
    decisions: dict[str, int] = msgspec.field(default_factory=lambda: _zeros(*(f"{d}:{r}" for d, r in DECISIONS)))
    in_flight: int = 0
    # Each prefill replica's time per prompt token and fixed time per prefill as kv_aware
    # learned them (orchestrator.speed), once it answered routing.prefill_speed_samples prefills.
    prefill_seconds_per_token: dict[str, float] = {}
    prefill_fixed_seconds: dict[str, float] = {}
    # Under conditional disaggregation, of the prompts that extended none lately, the share
    # continued (CacheView.continuation_rate, over every first block); None until it decided
    # a request with a cache view.
    continuation_rate: float | None = None


class CoreNeighbours:
    """Which engines compute on each other's cores (EngineRef.shares_cores) and which decode
    engines step beside each engine (EngineRef.steps_beside), worked out once per routing
    table, so that a request costs the router a look-up per candidate rather than a
    comparison of every pair of engines (2.7 ms a call at 256 engines). Only engines bound
    to cores of one host can meet: unbound ones (GPU engines) are never compared."""

    def __init__(self, engines: Sequence[EngineRef]) -> None:
        by_host: dict[str, list[EngineRef]] = {}
        for e in engines:
            if e.compute_cores or e.process_cores:
                by_host.setdefault(e.node_ip, []).append(e)
        # engine id -> the other engines computing on its cores / the decode engines stepping
        # there / those of them whose forward passes run there (not only their processes).
        self.mates: dict[str, tuple[str, ...]] = {}
        self.decoders: dict[str, tuple[EngineRef, ...]] = {}
        self.computing_decoders: dict[str, tuple[EngineRef, ...]] = {}
        for host in by_host.values():
            for e in host:
                if mates := tuple(o.engine_id for o in host if e.shares_cores(o)):
                    self.mates[e.engine_id] = mates
                if decoders := tuple(d for d in host if d.role == "decode" and e.steps_beside(d)):
                    self.decoders[e.engine_id] = decoders
                if computing := tuple(d for d in decoders if e.shares_cores(d)):
                    self.computing_decoders[e.engine_id] = computing

    def queued_beside(self, engine_id: str, queued: dict[str, float]) -> float:
        """The prompt tokens `queued` on the engines computing on `engine_id`'s cores: they take
        turns with its own there, so they delay its next first token as its own queue does
        (three engines given two cores of a small host)."""
        return sum(queued.get(m, 0.0) for m in self.mates.get(engine_id, ()))


def _count(counter: dict[str, int], key: str) -> None:
    counter[key] = counter.get(key, 0) + 1


class Router:
    """Routes requests over a prefill + decode pair of pools, or a colocated pool."""

    def __init__(
        self,
        engines: Sequence[EngineRef],
        routing: RoutingConfig = RoutingConfig(),
        stream_batch_s: float = 0.0,
        *,
        disaggregated: bool | None = None,
        report_failure: Callable[[EngineFailure], None] | None = None,
        cache_view: CacheView | None = None,
    ) -> None:
        """`stream_batch_s`: how long engines may hold streamed tokens to send several at once
        (EngineRequest.stream_batch_s); prefill requests produce one token and never wait.
        `disaggregated`: whether the deployment has prefill and decode pools (default: whether
        `engines` has a prefill engine). `report_failure` hears of every engine whose call
        failed (the ingress tells the pool manager). `cache_view`: the engines' prefix caches
        (one is made, without the CPU tier, when the policy or disaggregation needs it)."""
        self.routing = routing
        self.stream_batch_s = stream_batch_s
        self.report_failure = report_failure
        # A view made here is this router's to close; a given one is its owner's.
        self._owns_cache = cache_view is None and needs_cache_view(routing)
        self.cache = CacheView() if self._owns_cache else cache_view
        self.disaggregated = any(e.role == "prefill" for e in engines) if disaggregated is None else disaggregated
        roles: tuple[Role, ...] = ("prefill", "decode") if self.disaggregated else ("both",)
        self.pools: dict[str, EnginePicker] = {role: EnginePicker([], routing.policy) for role in roles}
        self.stats = RouterStats()
        self.speed = PrefillSpeed(routing.prefill_speed_samples)
        # Decode engine id -> prompt tokens of this router's local prefills there that have
        # not produced their first token (conditional disaggregation's queue).
        self._local_queued: dict[str, float] = {}
        # Tags this router's engine requests (EngineRequest.origin): its cache view's tag,
        # which the blocks of its requests carry too.
        self.origin = self.cache.origin if self.cache is not None else uuid.uuid4().hex[:12]
        # The token path to each engine (requests out, outputs back).
        self.streams = EngineStreams()
        self.set_engines(engines)

    def set_engines(self, engines: Sequence[EngineRef]) -> None:
        """The engines requests may go to now (the pool manager's routing table)."""
        for role, picker in self.pools.items():
            picker.set_engines([e for e in engines if e.role == role])
        self._neighbours = CoreNeighbours(self.engines)
        self.speed.keep([e.engine_id for e in self.pools["prefill"].engines] if self.disaggregated else [])
        self._learned_lines()
        self.streams.keep({e.stream_address for e in engines})
        if self.cache is not None:
            self.cache.set_engines([e for p in self.pools.values() if self._follows(p) for e in p.engines])

    def _follows(self, picker: EnginePicker) -> bool:
        """Whether routing looks at this pool's prefix caches and load: conditional
        disaggregation asks what the decode engine holds and how busy the prefill pool is;
        kv_aware scores a pool only when it has a choice. Following an engine costs it a
        long-poll answer per KV event batch, on the cores it computes on, so the default
        1P1D follows none."""
        return self.routing.disaggregation == "conditional" or (
            self.routing.policy == "kv_aware" and len(picker.engines) > 1)

    async def close(self) -> None:
        """Close the token paths, and stop following the engines' caches if this router made
        its view (a router that served for a while only: the handshake pre-warm's, a bench's)."""
        self.streams.close()
        if self._owns_cache and self.cache is not None:
            await self.cache.close()

    @property
    def engines(self) -> list[EngineRef]:
        return [e for p in self.pools.values() for e in p.engines]

    def _engine_failed(self, failure: EngineFailure) -> None:
        """Skip a dead engine at once; tell the pool manager of any failure, to check it."""
        engine = failure.engine
        if failure.engine_down:
            self.pools[engine.role].mark_failed(engine)
        if self.report_failure is not None:
            self.report_failure(failure)

    def _output_pool(self) -> EnginePicker:
        return self.pools["decode" if self.disaggregated else "both"]

    async def _pick(self, picker: EnginePicker, prompt: PromptKeys | None, exclude: Collection[str] = (),
                    trace: RequestTrace | None = None) -> EngineRef | None:
        """The pool's engine for a request by the routing policy, or None when none is healthy;
        kv_aware's score of each candidate goes to `trace.scores`."""
        if self.routing.policy != "kv_aware" or prompt is None or self.cache is None:
            engine = picker.pick(exclude)
        else:
            candidates = picker.candidates(exclude)
            if len(candidates) <= 1:  # no choice: no scores, no tier lookup on the request's path
                return candidates[0] if candidates else None
            weights = self.routing.scorers
            tier = self.cache.tier_prefix(candidates[0], prompt) if weights.tier or weights.work else {}
            cached = [self.cache.cached_tokens(e, prompt) for e in candidates]
            # Room in tokens: engines of one pool may page their caches in blocks of other sizes.
            rooms = [None if (r := self.cache.room_blocks(e, prompt, c)) is None else r * e.block_size
                     for e, c in zip(candidates, cached)]
            roomiest = max((r for r in rooms if r is not None), default=0)
            facts = [self._facts(e, picker, prompt, tier, c, 0.0 if room is None else float(roomiest - room))
                     for e, c, room in zip(candidates, cached, rooms)]
            if candidates[0].role != "decode":  # a decode replica's queue is the KV it holds, not prompts
                facts, _ = self._on_shared_cores(candidates, facts)
            if candidates[0].role == "prefill" and (prices := self.speed.prices([e.engine_id for e in candidates])):
                facts = [msgspec.structs.replace(f, slowdown=prices[f.engine_id].slowdown,
                                                 delay_tokens=prices[f.engine_id].delay_tokens) for f in facts]
            best, scores = rank(facts, len(prompt.token_ids), self.routing)
            engine = next(e for e in candidates if best is not None and e.engine_id == best.engine_id)
            if trace is not None:
                trace.scores |= scores
                if best is not None and candidates[0].role == "prefill":
                    trace.prefill_tokens_ahead = queue_tokens(best, len(prompt.token_ids), self.routing)
        return engine

    def _on_shared_cores(self, candidates: Sequence[EngineRef], facts: Sequence[EngineFacts],
                         decode: EngineRef | None = None) -> tuple[list[EngineFacts], float]:
        """`facts` of the candidate prefill (or colocated) engines with what else computes on
        their cores: the prompts queued on those engines (`CoreNeighbours`; the candidates' own
        queues and the decode engines' local prefills) and the decode engines decoding there,
        their forward passes or their processes (`EngineFacts.decoding_neighbours`,
        `EngineRef.steps_beside`; the forward passes also in `EngineFacts.computing_neighbours`);
        and the prompts queued beside `decode` (0 without one). The prefill pick and the
        disaggregation decider count the same ones, so a remote prefill that the decider sent
        off because a replica with a core of its own would answer sooner goes to that replica,
        not to the one taking turns with the decode engine's local prefill or its decodes
        (docs/bench-results.md, runs 115-117 and 121-125)."""
        near = self._neighbours
        queued = self._local_queued | {e.engine_id: f.queued_tokens for e, f in zip(candidates, facts)}
        out = []
        for e, f in zip(candidates, facts):
            beside = near.queued_beside(e.engine_id, queued)
            decoding = {d.engine_id for d in near.decoders.get(e.engine_id, ()) if self._outstanding(d, self.pools["decode"])}
            computing = sum(1 for d in near.computing_decoders.get(e.engine_id, ()) if d.engine_id in decoding)
            out.append(msgspec.structs.replace(f, queued_tokens=f.queued_tokens + beside, decoding_neighbours=len(decoding),
                                               computing_neighbours=computing)
                       if beside or decoding else f)
        return out, near.queued_beside(decode.engine_id, queued) if decode is not None else 0.0

    def _claim(self, engine: EngineRef, prompt: PromptKeys | None) -> float:
        """The request goes to `engine`: returns its weight in the engine's queue for
        kv_aware's `work` (the prompt tokens a prefill or colocated engine will compute, the
        KV a decode engine will hold while it decodes; 0 without a cache view). From now the
        prompt's blocks count as held there until its events say so (after the estimate, and
        once the choice is final: the decision must see the cache as it is)."""
        if prompt is None or self.cache is None:
            return 0.0
        n = len(prompt.token_ids)
        if engine.role == "decode":
            work = float(n)
        else:
            cached = self.cache.cached_tokens(engine, prompt)
            loaded = self._loaded_tokens(engine, prompt, prompt.tier or {}, cached)
            work = new_tokens(n, cached, loaded, self.routing.kv_load_cost)
        self.cache.expect(engine, prompt)
        return work

    def _stored(self, engine: EngineRef, prompt: PromptKeys | None) -> None:
        """`engine` answered a request with this prompt: its blocks are in the engine's cache."""
        if prompt is not None and self.cache is not None:
            self.cache.stored(engine, prompt)

    def _outstanding(self, engine: EngineRef, picker: EnginePicker) -> int:
        """Requests in flight on `engine`: this router's own (exact, now) plus the other
        routers' as of the engine's last cache update. Taking the engine's whole count would
        count this router's requests that ended since that update as still running."""
        mine = picker.outstanding.get(engine.engine_id, 0)
        seen = self.cache.seen(engine.engine_id) if self.cache is not None else None
        if seen is None:
            return mine
        return mine + max(0, seen.num_requests - seen.requests_by_origin.get(self.origin, 0))

    @staticmethod
    def _tier_tokens(engine: EngineRef, tier: dict[str, int], cached: int) -> float:
        """The prompt tokens the CPU tier adds to `engine`'s `cached` ones, when the engine
        loads from the tier at all (a decode engine by default only when it may prefill)."""
        if not engine.loads_tier:
            return 0.0
        return tier_tokens(tier, engine.node_id, cached // engine.block_size, engine.block_size)

    def _loaded_tokens(self, engine: EngineRef, prompt: PromptKeys, tier: dict[str, int], cached: int) -> float:
        """Prompt tokens beyond `cached` that `engine` would load rather than compute: a
        decode engine the prefill's KV over NIXL, any other what the CPU tier holds."""
        if engine.role == "decode":
            return float(len(prompt.token_ids) - cached)
        return self._tier_tokens(engine, tier, cached)

    def _facts(self, engine: EngineRef, picker: EnginePicker, prompt: PromptKeys, tier: dict[str, int],
               cached: int, crowded_tokens: float = 0.0) -> EngineFacts:
        """What the router knows of `engine` for this request, which finds `cached` of its
        prompt tokens in the engine's prefix cache (CacheView.cached_tokens)."""
        assert self.cache is not None
        seen = self.cache.seen(engine.engine_id)
        outstanding = self._outstanding(engine, picker)
        mine = picker.outstanding.get(engine.engine_id, 0)
        return EngineFacts(
            engine.engine_id,
            outstanding,
            cached,
            self._loaded_tokens(engine, prompt, tier, cached),
            seen.kv_cache_usage if seen else 0.0,
            picker.queued_tokens.get(engine.engine_id, 0.0) + (outstanding - mine) * len(prompt.token_ids),
            self.cache.evicted_tokens(engine, prompt, cached),
            engine.saves_tier and engine.loads_tier,
            crowded_tokens,
        )

    async def _pick_output_engine(self, prompt: PromptKeys | None, exclude: set[str]) -> EngineRef | None:
        """An engine to stream a request's output: the output pool first, then (when the
        deployment is disaggregated and no decode replica is left) a prefill one."""
        engine = await self._pick(self._output_pool(), prompt, exclude)
        if engine is None and self.disaggregated:
            engine = await self._pick(self.pools["prefill"], prompt, exclude)
        return engine

    async def _decide(
        self, request: EngineRequest, prompt: PromptKeys | None, decode: EngineRef, trace: RequestTrace, forward: bool
    ) -> tuple[Decision, float]:
        """Prefill this request remotely or on `decode` (routing.disaggregation), counted; with
        what `decode` would compute itself, in computed-token units (a load from the CPU tier
        costing routing.kv_load_cost). `forward`: a remote prefill's token would be the
        client's first (routing.first_token)."""
        cached = 0
        loaded = at_risk = 0.0
        ahead: float | None = None
        picker = self.pools["prefill"]
        n = len(request.prompt_token_ids)
        queued = self._local_queued.get(decode.engine_id, 0.0)
        if prompt is not None and self.cache is not None and self.routing.disaggregation == "conditional":
            tier = self.cache.tier_prefix(decode, prompt)
            cached = self.cache.cached_tokens(decode, prompt)
            loaded = self._tier_tokens(decode, tier, cached)
            candidates = picker.candidates()
            facts = [self._facts(e, picker, prompt, tier, self.cache.cached_tokens(e, prompt)) for e in candidates]
            facts, beside = self._on_shared_cores(candidates, facts, decode)
            ahead = min((remote_ahead_tokens(f, n, self.routing) for f in facts), default=None)
            queued += beside
            at_risk = self._stranded_tokens(decode, prompt, candidates, facts)
            self.stats.continuation_rate = self.cache.continuation_rate()
        held_up = self._outstanding(decode, self._output_pool())
        decision, reason = decide(self.routing, n, cached, held_up,
                                  decode_loaded_tokens=loaded,
                                  decode_queued_tokens=queued,
                                  prefill_ahead_tokens=ahead,
                                  first_from_prefill=forward,
                                  prompt_logprobs=request.sampling.prompt_logprobs is not None,
                                  at_risk_tokens=at_risk)
        _count(self.stats.decisions, f"{decision}:{reason}")
        trace.disaggregation, trace.reason = decision, reason
        return decision, new_tokens(n, cached, loaded, self.routing.kv_load_cost)

    def _stranded_tokens(self, decode: EngineRef, prompt: PromptKeys, candidates: Sequence[EngineRef],
                         facts: Sequence[EngineFacts]) -> float:
        """What a local prefill on `decode` is expected to cost later (disaggregation.decide's
        `at_risk_tokens`): the prompt tokens it would leave there alone (no prefill replica
        holds them, nor loads them from the tier), at `evict_cost`, times the odds that a next
        turn reuses them: 1 for a conversation's turn (CacheView.continues), and for a prompt
        that extends none (a first turn, or a one-off prompt) how often such prompts with its
        first block were continued lately (CacheView.continuation_rate, 1 until it knows);
        when `decode` keeps no copy in the CPU tier and its cache has no more to spare beyond
        what traffic reuses there than the roomiest prefill replica's (CacheView.spare_tokens):
        the cache all traffic passes through evicts such a history first, as it does at a tie
        (engines alike, at start). 0 otherwise, or when a capacity is unknown."""
        assert self.cache is not None
        if (decode.saves_tier and decode.loads_tier) or not facts:
            return 0.0
        odds = 1.0 if self.cache.continues(decode, prompt) else self.cache.continuation_rate(decode, prompt)
        if not odds:
            return 0.0
        held = max(f.cached_tokens + f.loaded_tokens for f in facts)
        spare = self.cache.spare_tokens(decode, prompt)
        others = [self.cache.spare_tokens(e, prompt) for e in candidates]
        if spare is None or None in others or spare > max(t for t in others if t is not None):
            return 0.0
        return odds * self.routing.evict_cost * (len(prompt.token_ids) - held)

    def _queue_local(self, engine_id: str, tokens: float) -> None:
        """Count (tokens > 0) or uncount (< 0) a local prefill's tokens on a decode engine."""
        left = self._local_queued.get(engine_id, 0.0) + tokens
        if left > 1e-9:
            self._local_queued[engine_id] = left
        else:
            self._local_queued.pop(engine_id, None)

    async def generate(
        self,
        request: EngineRequest,
        trace: RequestTrace,
        *,
        prefill_engine: EngineRef | None = None,
        decode_engine: EngineRef | None = None,
    ) -> AsyncIterator[Any]:
        """Stream the request's vLLM RequestOutputs (deltas, under `request.request_id`, the
        prompt as the client sent it, the prefilling engine's cache hits); fills `trace`.

        `request` is the request as one engine would run it; the router derives the prefill
        and output requests from it. `prefill_engine`/`decode_engine` pin the choice, with no
        retry or migration (handshake pre-warming uses them to test one pair). Raises
        NoEngineError or MigrationLimitError when the request cannot be served, EngineFailure
        when a pinned engine fails.
        """
        trace.t_arrival = trace.t_arrival or time.perf_counter()
        client_id = trace.request_id = request.request_id
        # Engines know the request by a name of its own (clients may reuse an X-Request-Id,
        # and an engine aborts by name): the client's id plus 8 random characters, as vLLM does.
        request = msgspec.structs.replace(request, request_id=f"{client_id}-{uuid.uuid4().hex[:8]}")
        self.stats.in_flight += 1
        phase: Phase = "queued"
        kv_params: dict[str, Any] | None = None
        prompt = None
        if self.cache is not None and (prefill_engine is None or decode_engine is None):  # not pinned
            self.cache.sync()
            prompt = self.cache.prompt(request.prompt_token_ids)
        # A local prefill's (decode engine, prompt tokens it computes) until its first output.
        local: tuple[str, float] | None = None
        # The prefill's answer when its token goes to the client (routing.first_token).
        answer = None
        try:
            first = decode_engine
            if self.disaggregated:
                if first is None:
                    first = await self._pick(self._output_pool(), prompt, trace=trace)
                decision: Decision = "remote"
                uncached = 0.0
                forward = (prefill_engine is None and self.routing.first_token == "prefill"
                           and _first_token_can_move(request.sampling))
                if first is not None and prefill_engine is None:
                    decision, uncached = await self._decide(request, prompt, first, trace, forward)
                if first is None:
                    self._fall_back(trace, "no_decode_engine")
                elif decision == "remote":
                    phase = "prefill"
                    last = await self._prefill(request, trace, prefill_engine, prompt, forward)
                    kv_params = last.kv_transfer_params if last is not None else None
                    answer = last if forward else None
                else:
                    local = (first.engine_id, uncached)
                    self._queue_local(*local)
            phase = "handoff"
            if answer is not None:
                output = self._forward_first(request, trace, answer, first, prompt)
            else:
                output = self._stream_output(request, trace, kv_params, decode_engine, first, prompt)
            async with contextlib.aclosing(output):  # a consumer that leaves aborts it now, not at GC
                async for out in output:
                    phase = "decode"
                    if local is not None:
                        self._queue_local(local[0], -local[1])
                        local = None
                    out.request_id = client_id
                    yield out
            if phase == "handoff":  # nothing streamed: the request ended before its first output
                phase = "decode"
        except (GeneratorExit, asyncio.CancelledError):
            _count(self.stats.aborts, phase)
            raise
        except (NoEngineError, MigrationLimitError) as err:
            _count(self.stats.failed, "no_engine" if isinstance(err, NoEngineError) else "migration_limit")
            raise
        finally:
            if local is not None:
                self._queue_local(local[0], -local[1])
            self.stats.in_flight -= 1
            trace.t_done = time.perf_counter()

    # ---- prefill ----

    async def _prefill(
        self, request: EngineRequest, trace: RequestTrace, pinned: EngineRef | None, prompt: PromptKeys | None,
        forward: bool = False,
    ) -> Any:
        """Run step 1 of the protocol, retrying on other replicas: the prefill engine's answer
        (its kv_transfer_params; with `forward`, also the first token, sampled as the client
        asked); None means the decode engine must prefill itself (trace.fallback says why)."""
        picker = self.pools["prefill"]
        tried: set[str] = set()
        attempts = 1 if pinned is not None else 1 + self.routing.prefill_retries
        reason = "no_prefill_engine"
        try:
            for attempt in range(attempts):
                trace.prefill_tokens_ahead = None
                engine = pinned or await self._pick(picker, prompt, tried, trace)
                if engine is None:
                    break
                work = self._claim(engine, prompt)
                tried.add(engine.engine_id)
                picker.acquire(engine, work)
                sent = time.perf_counter()
                try:
                    last = await asyncio.wait_for(
                        self._prefill_once(engine, request, f"{request.request_id}-p{attempt or ''}", prompt, forward),
                        self.routing.prefill_timeout_s,
                    )
                    if last is not None:
                        if forward:
                            _raise_if_errored(engine, last, "prefill")
                        self._stored(engine, prompt)
                except asyncio.TimeoutError:
                    reason = "prefill_timeout"
                    logger.warning("prefill of %s on engine %s took over %.1f s; abandoned",
                                   request.request_id, engine.engine_id, self.routing.prefill_timeout_s)
                except EngineFailure as failure:
                    reason = "prefill_failed"
                    self._engine_failed(failure)
                    logger.warning("prefill of %s failed: %s", request.request_id, failure)
                else:
                    # A streamed first token that ends the request (a stop, or max_tokens 1,
                    # whose prefill holds no KV for a decode) is an answer too.
                    if last is not None and (last.kv_transfer_params or (forward and _ends_request(last, request.sampling))):
                        trace.num_cached_tokens = last.num_cached_tokens or 0
                        trace.prefill_engine = engine.engine_id
                        self._timed_prefill(engine, trace.prefill_tokens_ahead, time.perf_counter() - sent)
                        if engine.saves_tier and last.kv_transfer_params:
                            # The engine saves the prompt it computed: the decode engine that
                            # pulls it need not ask the tier about it again.
                            last.kv_transfer_params[TIER_SAVED] = len(request.prompt_token_ids)
                        return last
                    logger.warning("prefill engine %s returned no KV transfer params for %s; decode recomputes",
                                   engine.engine_id, request.request_id)
                    reason = "no_kv_params"
                    break
                finally:
                    picker.release(engine, work)
                if attempt + 1 < attempts:
                    _count(self.stats.retries, reason)
        finally:
            trace.t_prefill_done = time.perf_counter()
        self._fall_back(trace, reason)
        return None

    def _timed_prefill(self, engine: EngineRef, tokens_ahead: float | None, seconds: float) -> None:
        """A prefill on `engine` answered after `seconds`, kv_aware having expected
        `tokens_ahead` prompt tokens before its first (None: it did not choose the replica)."""
        if tokens_ahead is None or not self.speed.min_samples:
            return
        self.speed.observe(engine.engine_id, tokens_ahead, seconds)
        self._learned_lines()

    def _learned_lines(self) -> None:
        """The prefill replicas' learned lines into the stats (/metrics), and one log line
        whenever the set of replicas priced by them changes."""
        lines = self.speed.lines
        if lines.keys() != self.stats.prefill_seconds_per_token.keys():
            logger.info("kv_aware now prices prefill replicas by the speed learned from their prefills: %s",
                        ", ".join(f"{e} {1000 * line.fixed:.1f} ms + {1000 * line.per_token:.3f} ms a prompt token"
                                  for e, line in sorted(lines.items())) or "none")
        self.stats.prefill_seconds_per_token = {e: line.per_token for e, line in lines.items()}
        self.stats.prefill_fixed_seconds = {e: line.fixed for e, line in lines.items()}

    async def _prefill_once(self, engine: EngineRef, request: EngineRequest, request_id: str,
                            prompt: PromptKeys | None, forward: bool) -> Any:
        """The prefill engine's last output for `request` (its kv_transfer_params; with
        `forward`, its first token as the client asked for it, and no KV held for a decode
        when that token is all the client asked for)."""
        hand_off = {"do_remote_decode": True} if not forward or request.sampling.max_tokens > 1 else None
        req = msgspec.structs.replace(request, request_id=request_id, origin=self.origin,
                                      kv_transfer_params=self._tier_hint(engine, prompt, hand_off),
                                      blocks=self._blocks(engine, prompt))
        if not forward:
            return await _for_kv_only(self.streams, engine, req, self._held_kv_releaser(request_id))
        first = req.sampling.clone()
        first.max_tokens, first.min_tokens = 1, min(first.min_tokens, 1)
        return await _last_output(self.streams, engine, msgspec.structs.replace(req, sampling=first, stream_batch_s=0.0),
                                  self._held_kv_releaser(request_id))

    def _tier_hint(self, engine: EngineRef, prompt: PromptKeys | None,
                   kv_params: dict[str, Any] | None) -> dict[str, Any] | None:
        """`kv_params` plus, for an engine that loads from the CPU tier, how many of the
        prompt's blocks the tier holds as far as this router knows (TIER_HINT): an engine told
        none skips its lookup instead of holding the request for the index's answer."""
        if prompt is None or self.cache is None or not engine.loads_tier:
            return kv_params
        held = self.cache.tier_blocks(engine, prompt)
        return kv_params if held is None else {**(kv_params or {}), TIER_HINT: held}

    def _blocks(self, engine: EngineRef, prompt: PromptKeys | None) -> BlockUse | None:
        """The prompt's blocks as this router claimed them on `engine`, for the engine to pass
        on to every router following it (CacheView.block_use)."""
        return None if prompt is None or self.cache is None else self.cache.block_use(engine, prompt)

    def _held_kv_releaser(self, request_id: str) -> Callable[[dict[str, Any]], Awaitable[None]]:
        async def release(kv_params: dict[str, Any]) -> None:
            await self._release_held_kv(kv_params, f"{request_id}-release")

        return release

    def note_abort(self, phase: Phase) -> None:
        """Count a request whose client left before it reached the router (phase "queued")."""
        _count(self.stats.aborts, phase)

    async def _release_held_kv(self, kv_params: dict[str, Any], request_id: str) -> None:
        """Free a prefill's blocks held for a decode that will not come (its answer was lost to
        an abort or a timeout), through a decode engine: only the reading side can tell the
        prefill side it is done."""
        engine = self._output_pool().pick() if self.disaggregated else None
        if engine is None:
            return  # no decode engine: NIXL's lease frees the blocks
        await outlive(_release(engine, request_id, kv_params))

    def _fall_back(self, trace: RequestTrace, reason: str) -> None:
        trace.fallback = reason
        _count(self.stats.fallbacks, reason)

    # ---- output ----

    async def _forward_first(
        self, request: EngineRequest, trace: RequestTrace, answer: Any, first: EngineRef | None, prompt: PromptKeys | None
    ) -> AsyncIterator[Any]:
        """Stream the prefill's `answer` (the first token) and then the decode engine's output
        from the prompt plus that token. The decode request leaves before the token is handed
        on, so a consumer that leaves on it aborts the decode, which frees the prefill's blocks."""
        kv_params = answer.kv_transfer_params
        answer.kv_transfer_params = None
        trace.first_from_prefill = True
        comp = answer.outputs[0]
        generated = list(comp.token_ids)
        done = _ends_request(answer, request.sampling)
        output = None
        if not done:
            answer.finished, comp.finish_reason, comp.stop_reason = False, None, None
            output = self._stream_output(request, trace, {**kv_params, PREFILLED_TOKENS: len(request.prompt_token_ids)},
                                         None, first, prompt, generated)
        elif kv_params:  # the token ended it after all (a stop): nobody will pull the blocks
            await self._release_held_kv(kv_params, f"{request.request_id}-release")
        answer.prompt_token_ids = request.prompt_token_ids
        answer.prompt = request.prompt_fields.get("prompt")
        answer.num_cached_tokens = trace.num_cached_tokens
        if output is None:
            trace.t_first_token = time.perf_counter()
            yield answer
            return
        async with contextlib.aclosing(output):
            nxt = asyncio.ensure_future(anext(output))  # sends the decode request
            await asyncio.sleep(0)
            try:
                trace.t_first_token = time.perf_counter()
                yield answer
                with contextlib.suppress(StopAsyncIteration):
                    yield await nxt
            finally:
                if not nxt.done():
                    nxt.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await nxt
            async for out in output:
                yield out

    async def _stream_output(
        self,
        request: EngineRequest,
        trace: RequestTrace,
        kv_params: dict[str, Any] | None,
        pinned: EngineRef | None,
        first: EngineRef | None,
        prompt: PromptKeys | None,
        streamed: Sequence[int] = (),
    ) -> AsyncIterator[Any]:
        """Stream the output from a decode (or colocated) engine (`first` when already
        chosen), moving to another engine when it fails, from the prompt plus the tokens
        already streamed (`streamed`: those the client has from elsewhere, the prefill's)."""
        engine = pinned or first or await self._pick_output_engine(prompt, set())
        if engine is None:
            raise NoEngineError("no healthy engine is left to serve the request; retry once the pools have recovered")
        work = self._claim(engine, prompt)
        request_id, prompt_ids, sampling = request.request_id, request.prompt_token_ids, request.sampling
        generated: list[int] = list(streamed)
        streaming = False
        failed: set[str] = set()
        while True:
            if generated and sampling.max_tokens - len(generated) <= 0:
                yield _length_end(request)
                return
            suffix = f"-m{trace.migrations}" if trace.migrations else ("-d" if self.disaggregated else "")
            resumed = bool(generated)
            req = msgspec.structs.replace(
                request,
                request_id=f"{request_id}{suffix}",
                prompt_token_ids=prompt_ids + generated,
                sampling=_continuation(sampling, len(generated)),
                kv_transfer_params=self._tier_hint(engine, prompt, kv_params),
                stream_batch_s=self.stream_batch_s,
                resume_from=len(prompt_ids) if resumed else None,
                origin=self.origin,
                blocks=self._blocks(engine, prompt),
                # The text of a resumed prompt is not the client's prompt: vLLM works from the ids.
                prompt_fields={k: v for k, v in request.prompt_fields.items() if k != "prompt"} if resumed else request.prompt_fields,
            )
            if trace.t_decode_sent is None:
                trace.t_decode_sent = time.perf_counter()
            trace.output_engine = engine.engine_id
            serving, picker, serving_work = engine, self.pools[engine.role], work
            picker.acquire(serving, serving_work)
            try:
                if kv_params and sampling.n > 1:
                    # vLLM's decode side would pull the KV once per sequence, and the prefill
                    # side frees it after the first pull: pull once, the sequences share it.
                    await _for_kv_only(self.streams, engine, msgspec.structs.replace(req, request_id=f"{req.request_id}-pull"))
                    req = msgspec.structs.replace(req, kv_transfer_params=self._tier_hint(engine, prompt, None))
                async with contextlib.aclosing(stream_engine(self.streams, engine, req)) as outputs:
                    async for out in outputs:
                        _raise_if_errored(engine, out, "request")
                        # Only the first token of this leg is timed (the second of a request
                        # whose first came from the prefill): later outputs are not searched.
                        timing = trace.t_first_token is None or (trace.first_from_prefill and trace.t_second_token is None)
                        if timing and any(c.token_ids for c in out.outputs):
                            if trace.t_first_token is None:
                                trace.t_first_token = time.perf_counter()
                            else:
                                trace.t_second_token = time.perf_counter()
                        if not streaming:
                            self._stored(engine, prompt)
                            if not trace.migrations and (
                                not self.disaggregated or trace.fallback or trace.disaggregation == "local"
                            ):
                                trace.num_cached_tokens = out.num_cached_tokens or 0
                        streaming = True
                        if sampling.n == 1:
                            generated.extend(out.outputs[0].token_ids if out.outputs else ())
                        # Engines send no prompt (the client's, even when a resumed request's is longer).
                        out.prompt_token_ids = prompt_ids
                        out.prompt = request.prompt_fields.get("prompt")
                        out.num_cached_tokens = trace.num_cached_tokens
                        yield out
                return
            except EngineFailure as failure:
                if pinned is not None:
                    raise
                self._engine_failed(failure)
                failed.add(engine.engine_id)
                if streaming and (why := _unresumable(sampling)):
                    _count(self.stats.failed, "unresumable")
                    raise UnresumableError(
                        f"engine {engine.engine_id} failed while streaming request {request_id} ({failure}); "
                        f"a request with {why} cannot continue on another engine: retry it"
                    ) from failure
                if trace.migrations >= self.routing.max_migrations:
                    raise MigrationLimitError(
                        f"request {request_id} failed on {trace.migrations + 1} engines (last: {failure}); "
                        f"routing.max_migrations is {self.routing.max_migrations}"
                    ) from failure
                nxt = await self._pick_output_engine(prompt, failed)
                if nxt is None:
                    raise NoEngineError(
                        f"engine {engine.engine_id} failed while serving request {request_id} and no healthy "
                        "engine is left to continue it; retry once the pools have recovered"
                    ) from failure
                logger.warning("request %s: %s after %d tokens; continuing on engine %s",
                               request_id, failure, len(generated), nxt.engine_id)
                trace.migrations += 1
                self.stats.migrations += 1
                engine, kv_params = nxt, None
                work = self._claim(engine, prompt)
            finally:
                picker.release(serving, serving_work)


async def _release(engine: EngineRef, request_id: str, kv_params: dict[str, Any]) -> None:
    with contextlib.suppress(RayError, asyncio.TimeoutError):
        await asyncio.wait_for(engine.handle.release_remote_kv.remote(request_id, kv_params), ABORT_TIMEOUT_S)


def _continuation(sampling: Any, num_generated: int) -> Any:
    """The sampling settings for the rest of a request that already produced `num_generated` tokens."""
    if num_generated == 0:
        return sampling
    rest = sampling.clone()
    rest.max_tokens = sampling.max_tokens - num_generated
    rest.min_tokens = max(0, sampling.min_tokens - num_generated)
    return rest


async def _for_kv_only(streams: EngineStreams, engine: EngineRef, req: EngineRequest,
                       on_held_kv: Callable[[dict[str, Any]], Awaitable[None]] | None = None) -> Any:
    """Run `req` on `engine` for its KV alone (a prefill, a decode engine's pull): one
    sequence, one token, nothing computed that the output will not use; its last output."""
    one = req.sampling.clone()
    one.n, one.max_tokens, one.min_tokens = 1, 1, 0
    one.logprobs = one.prompt_logprobs = one.structured_outputs = None
    return await _last_output(streams, engine, msgspec.structs.replace(req, sampling=one, stream_batch_s=0.0), on_held_kv)


async def _last_output(streams: EngineStreams, engine: EngineRef, req: EngineRequest,
                       on_held_kv: Callable[[dict[str, Any]], Awaitable[None]] | None = None) -> Any:
    """Run `req` on `engine` to its end: its outputs merged into one (None if there were none)."""
    last = None
    async with contextlib.aclosing(stream_engine(streams, engine, req, on_held_kv)) as outputs:
        async for out in outputs:
            last = out if last is None else merge_deltas(last, out)
    return last


def _ends_request(answer: Any, sampling: Any) -> bool:
    """Whether a prefill's streamed first token is the request's last: a stop, or all the
    client asked for."""
    return answer.finished and (sampling.max_tokens <= 1 or any(c.finish_reason == "stop" for c in answer.outputs))


def _first_token_can_move(sampling: Any) -> bool:
    """Whether the token a prefill samples can be the request's first: not when the decode
    engine would go on differently than one engine would from there."""
    return not (
        _unresumable(sampling)
        # A seeded sampler's draws would start again on the decode engine.
        or (sampling.seed is not None and sampling.temperature > 0)
        # Output-token penalties would count the first token as the prompt's.
        or sampling.frequency_penalty or sampling.presence_penalty
        # A bad word starting at the first token would go unseen.
        or sampling.bad_words
        # The decode engine would compute prompt logprobs again, one token longer.
        or sampling.prompt_logprobs is not None
    )


def _raise_if_errored(engine: EngineRef, out: Any, what: str) -> None:
    """An output vLLM ended with finish_reason "error" (e.g. a failed KV load) is the engine's
    failure, retried or migrated like a dead engine's; the engine itself is still up."""
    if any(c.finish_reason == "error" for c in out.outputs):
        raise EngineFailure(engine, f"the engine ended the {what} with an error", engine_down=False)


def _unresumable(sampling: Any) -> str | None:
    """Why a request that streamed output cannot go on from its prompt plus that output on
    another engine: several sequences, or a grammar whose state the new engine would not have."""
    if sampling.n > 1:
        return f"n={sampling.n}"
    if sampling.structured_outputs is not None:
        return "structured output"
    return None


def _length_end(request: EngineRequest) -> Any:
    """The last output of a request whose engine failed after its last token but before it
    said so: the length limit is reached."""
    from vllm.outputs import CompletionOutput, RequestOutput

    end = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason="length")
    return RequestOutput(request.request_id, request.prompt_fields.get("prompt"), request.prompt_token_ids, None, [end], True)
