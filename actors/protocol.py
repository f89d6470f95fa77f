"""Messages between the router and engine actors: typed msgspec Structs, no vLLM imports.

A request carries vLLM's own SamplingParams and comes back as vLLM's own RequestOutputs
(both opaque here, pickled on the token path, actors.stream); everything Tandem adds around them is typed here. Only
what a request needs crosses the process boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

Role = Literal["prefill", "decode", "both"]

# Transfer-time histogram buckets (seconds), shared by engines and /metrics.
TRANSFER_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def merge_deltas(earlier: Any, later: Any) -> Any:
    """Two consecutive streamed outputs of one engine request (vLLM RequestOutput deltas) as
    one, merged into `earlier` as vLLM's own output collector merges them for a consumer that
    lags: the engine's stream batching and a router reading late both use it."""
    earlier.add(later, aggregate=True)
    return earlier


class BlockUse(msgspec.Struct, frozen=True, array_like=True):
    """A request's prompt blocks as the router that sent it saw them: the block keys in order,
    the first `reused` of them used by an earlier request (on any engine). The engine echoes
    it to every router that follows it (CacheUpdate.uses), so each router learns what the
    others' requests use, as if it had sent them (orchestrator.cache_view); `origin`, the
    sender's EngineRequest.origin, tells a router its own."""

    keys: list[int]
    reused: int
    origin: str


class EchoedUse(msgspec.Struct, frozen=True, array_like=True):
    """A request's BlockUse as an engine passes it on to its routers (CacheUpdate.uses), with
    how many seconds before the answer the request arrived there (hosts' clocks differ; an
    age does not depend on them)."""

    age_s: float
    use: BlockUse


class EngineRequest(msgspec.Struct, frozen=True):
    """One request for one engine. The ingress renders OpenAI requests with vLLM's own serving
    layer, so the prompt arrives as token ids and the sampling settings as vLLM's
    `SamplingParams` (pickled whole, so every field vLLM accepts reaches the engine)."""

    request_id: str
    prompt_token_ids: list[int]
    # vLLM's SamplingParams. The engine streams deltas whatever its output_kind says; the
    # ingress's engine client shapes them for the serving layer.
    sampling: Any
    # vLLM's kv_transfer_params: {"do_remote_decode": True} for a prefill, the prefill's
    # answer for the matching decode, None for a colocated request.
    kv_transfer_params: dict[str, Any] | None = None
    # Streamed outputs leave at most once per this many seconds, each carrying every token
    # decoded since the last (actors.engine.batched); the first text and the end of the
    # request never wait. 0: an output per engine step.
    stream_batch_s: float = 0.0
    # Set when the request resumes one that another engine was streaming: prompt_token_ids
    # is the original prompt (its first `resume_from` ids) plus the output already streamed,
    # and the text continues from there (actors.resume).
    resume_from: int | None = None
    # Which router sent it (Router.origin): an engine's load report counts requests per
    # origin, so each router adds only the others' requests to its own exact count.
    origin: str = ""
    # The rest of vLLM's rendered prompt (its text, cache_salt) and the keyword arguments of
    # AsyncLLM.generate the serving layer passed (priority, reasoning_ended, ...).
    prompt_fields: dict[str, Any] = {}
    generate_kwargs: dict[str, Any] = {}
    # The prompt's blocks for the routers following this engine's cache (None: none does).
    blocks: BlockUse | None = None


class EngineInfo(msgspec.Struct, frozen=True):
    engine_id: str
    role: Role
    # Changes every time the engine's process starts (first start and every restart); it is
    # part of the engine's KV-connector id, so NIXL peers and the CPU tier tell them apart.
    incarnation: str
    node_id: str
    node_ip: str
    # The actor process that holds the engine; vLLM's engine core (and its workers, for
    # tensor parallelism) are its children (Ray reaps them when it dies).
    pid: int
    child_pids: list[int]
    max_model_len: int
    block_size: int
    # Cores the engine's processes run on apart from its OpenMP compute threads (None:
    # unbound), and the cores those are bound to (vLLM's VLLM_CPU_OMP_THREADS_BIND): within
    # them, or beside them for a decode engine with no core to spare
    # (orchestrator.placement.process_cores).
    cores: list[int] | None
    cpu_binding: str | None
    # The engine processes' scheduling niceness (Ray's workers default to 15).
    niceness: int = 0
    # How vLLM hashes this engine's prefix blocks (prefix_caching_hash_algo and the seed of
    # its hash chain), so routers compute the keys its KV events carry (actors.kv_events).
    hash_algo: str = "sha256"
    hash_seed: str = ""
    # The engine's KV cache in blocks (vLLM's num_gpu_blocks): how much its prefix cache can
    # hold before storing a block evicts another.
    num_blocks: int = 0
    # Where routers send requests and read outputs (actors.stream): tcp://<node ip>:<port>.
    stream_address: str = ""
    # The dtype vLLM serves the model in ("bfloat16", ...), and whether this CPU engine's
    # host computes it without native instructions (actors.engine.emulates_half_precision).
    dtype: str = ""
    emulated_dtype: bool = False


class EngineLoad(msgspec.Struct, frozen=True):
    """What an engine reports on each health check: its load now and since the last check."""

    # Requests in flight on this engine right now, and tokens still to compute for them
    # (prompt tokens not yet prefilled plus output tokens not yet generated).
    num_requests: int
    num_tokens: int
    # The same two, averaged over time since the previous report (the autoscaling signal).
    mean_requests: float
    mean_tokens: float
    # Fraction of the KV cache in use at the engine's last step.
    kv_cache_usage: float


class CacheUpdate(msgspec.Struct, frozen=True):
    """An engine's prefix cache and load for routers (EngineActor.cache_updates): the block
    keys stored and removed since the version the router had, or (`full`) every key held."""

    incarnation: str
    version: int
    full: bool
    stored: list[int]
    removed: list[int]
    # Requests in flight and tokens still to compute on the engine (from every router), and
    # the share of its KV cache in use.
    num_requests: int
    num_tokens: int
    kv_cache_usage: float
    # num_requests by EngineRequest.origin (origins with none left out).
    requests_by_origin: dict[str, int] = {}
    # The blocks of the requests that arrived since `version` (EngineRequest.blocks), in order;
    # for a router that had another incarnation (one that starts following the engine), those
    # of the last seconds it asked for (EngineActor.cache_updates' `history_s`).
    uses: list[EchoedUse] = []


class TransferStats(msgspec.Struct):
    """KV moved into this engine by its connector (worker side, summed over workers)."""

    num_transfers: int = 0
    num_failed: int = 0
    # Transfers slower than the engine's slow_transfer_s (each also logged as a WARNING).
    num_slow: int = 0
    bytes: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0
    # Cumulative-free counts per TRANSFER_BUCKETS bucket (+ one overflow bucket).
    bucket_counts: list[int] = msgspec.field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS) + 1))


class EngineStats(msgspec.Struct):
    engine_id: str
    role: Role
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_generation_tokens: int = 0
    # Prompt tokens by where their KV came from: "local_compute", "local_cache_hit",
    # "external_kv_transfer" (loaded through the KV connector instead of recomputed).
    prompt_tokens_by_source: dict[str, int] = {}
    transfers: TransferStats = msgspec.field(default_factory=TransferStats)
    # Engine-side phases summed over the requests vLLM reported finished (num_timed_requests):
    # "queue" (arrival to first scheduled) and "prefill" (scheduled to first token).
    num_timed_requests: int = 0
    phase_seconds: dict[str, float] = {}
    # vLLM's mean time per output token after the first, per request, summed over the
    # num_decoded_requests that generated two tokens or more. vLLM takes it from the engine
    # core's step timestamps, so it is the decode speed before any relay to the client.
    tpot_seconds: float = 0.0
    num_decoded_requests: int = 0
    # Raw per-connector counters reported by Tandem's connectors (name -> counter -> value).
    connector_counters: dict[str, dict[str, float]] = {}


# ---- what TandemMultiConnector reports in vLLM's scheduler stats (connectors.multi) ----


class ChildCounters(msgspec.Struct):
    """Counters of one child since the last stats report. Role that fills each field:

    scheduler: hits, tokens_loaded, load_failures, fallbacks, recomputes;
    worker: load_error_blocks; whichever role the child reports them from: bytes_loaded,
    bytes_saved, tokens_saved (vLLM's OffloadingConnector reports bytes from the scheduler,
    NixlConnector from the worker).
    """

    hits: int = 0  # requests whose external tokens this child was chosen to load
    tokens_loaded: int = 0  # tokens this child was chosen to load (as allocated by vLLM)
    tokens_saved: int = 0  # tokens the child reports saving ("tokens_saved" stats key)
    bytes_loaded: int = 0  # bytes the child reports loading
    bytes_saved: int = 0  # bytes the child reports saving
    load_failures: int = 0  # requests whose load from this child failed
    load_error_blocks: int = 0  # block ids this child reported with load errors
    fallbacks: int = 0  # re-queries after this child failed that another child served
    recomputes: int = 0  # re-queries after this child failed that no child could serve

    def is_zero(self) -> bool:
        return not any(msgspec.structs.astuple(self))

    def add(self, other: ChildCounters) -> None:
        for field in self.__struct_fields__:
            setattr(self, field, getattr(self, field) + getattr(other, field))


class StatsPayload(msgspec.Struct):
    """The documented shape of ``TandemMultiStats.data``: ``{"children": {name: counters}}``.

    A child's name is its ``kv_connector``, suffixed ``#<position>`` when the same name
    appears twice. Written by ``connectors.multi``; read (``parse_stats``) by the engine actor and
    stat loggers.
    """

    children: dict[str, ChildCounters] = {}
    # Raw transfer records of children whose stats have NixlKVConnectorStats' shape (lists
    # per key: transfer_duration, bytes_transferred, num_failed_transfers, ...), by child
    # name, so the engine still folds NIXL transfers into EngineStats.transfers (count,
    # bytes, seconds, max, histogram) when NixlConnector runs as a child.
    transfers: dict[str, dict[str, list[Any]]] = {}


def parse_stats(data: Mapping[str, Any]) -> StatsPayload:
    """Decode the dict that vLLM's SchedulerStats.kv_connector_stats carries for
    TandemMultiConnector."""
    return msgspec.convert(data, StatsPayload)
