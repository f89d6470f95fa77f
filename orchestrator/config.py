"""Tandem's deployment config: msgspec Structs, loaded from YAML, TOML or JSON.

Parsing is strict (unknown fields are errors) and every error is re-worded as a
:class:`ConfigError` that names the offending field and says how to fix it. Checks that
need the outside world (does the model folder exist, are the connectors importable, are
the engine args real vLLM args) live in :mod:`orchestrator.preflight`.
"""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import msgspec
import yaml
from msgspec import Meta, Struct

from connectors.config import NixlConfig

BUILTIN_PREFIX = "builtin:"
BUILTIN_TINY = "builtin:tiny"
# The built-in models (orchestrator.tiny_model.SHAPES), served as "tandem-<name>".
BUILTIN_MODELS = ("tiny", "small", "medium")
# serve.stream_batch_ms's default where a streamed chunk costs more than a token's step is
# worth (CPU hosts, Serve's proxy), in seconds: Ray Serve LLM's stream_batching_interval_ms.
CHUNKED_STREAM_BATCH_S = 0.05

Port = Annotated[int, Meta(ge=1, le=65535)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]

# Engine arguments Tandem sets itself, with the config field to use instead.
RESERVED_ENGINE_ARGS: dict[str, str] = {
    "model": "model.source",
    "tokenizer": "model.source",
    "served_model_name": "model.served_name",
    "tensor_parallel_size": "<pool>.tensor_parallel_size",
    "kv_transfer_config": "kv_transfer",
}


class ConfigError(ValueError):
    """A config that cannot be deployed; the message names the field and the fix."""


class ModelConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # A local folder with config.json, a hub id (org/name), or a random Llama generated
    # locally on first use (no download): "builtin:tiny" for tests and demos,
    # "builtin:small" where a prefill must cost real time (routing benchmarks).
    source: str = BUILTIN_TINY
    # The name clients pass as "model"; defaults to the source (or "tandem-tiny").
    served_name: str | None = None

    @property
    def name(self) -> str:
        if self.served_name:
            return self.served_name
        if self.source.startswith(BUILTIN_PREFIX):
            return "tandem-" + self.source.removeprefix(BUILTIN_PREFIX)
        return self.source


class AutoscalingConfig(Struct, forbid_unknown_fields=True, frozen=True):
    """When a pool grows or shrinks between its min_replicas and max_replicas."""

    # The load signal, as each engine measures it (time-averaged over the health period):
    # requests in flight on the replica, or tokens still to compute for them (prompt tokens
    # not yet prefilled plus output tokens not yet generated).
    metric: Literal["outstanding_requests", "outstanding_tokens"] = "outstanding_requests"
    # The load one replica should carry; the pool wants ceil(total load / target) replicas.
    target_per_replica: Annotated[float, Meta(gt=0)] = 4.0
    # How long the pool must want more (fewer) replicas before one is added (drained).
    upscale_delay_s: NonNegativeFloat = 5.0
    downscale_delay_s: NonNegativeFloat = 60.0
    # A draining replica is stopped once idle, or after this long whatever it still serves.
    drain_timeout_s: Annotated[float, Meta(gt=0)] = 300.0


class PoolConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # Number of engine replicas the pool starts with.
    replicas: PositiveInt = 1
    # Bounds for autoscaling; both default to `replicas` (a fixed-size pool).
    min_replicas: PositiveInt | None = None
    max_replicas: PositiveInt | None = None
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    # Ray resources reserved per replica. With tensor_parallel_size > 1 on GPUs the
    # replica's placement group is one CPU bundle for the engine actor plus one 1-GPU
    # bundle per TP rank, the shape vLLM's Ray executor expects.
    num_cpus: NonNegativeFloat = 1.0
    num_gpus: NonNegativeFloat = 0.0
    resources: dict[str, float] = {}
    tensor_parallel_size: PositiveInt = 1
    # vLLM engine args for this pool only, applied over the top-level engine_args.
    engine_args: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not self.min_size <= self.replicas <= self.max_size:
            raise ValueError(
                f"replicas ({self.replicas}) must lie within min_replicas ({self.min_size}) and "
                f"max_replicas ({self.max_size})"
            )

    @property
    def min_size(self) -> int:
        return self.min_replicas if self.min_replicas is not None else self.replicas

    @property
    def max_size(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas

    @property
    def autoscaled(self) -> bool:
        return self.min_size < self.max_size


class KVTransferConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # A connector name known to connectors.registry (vLLM's or Tandem's), or a class
    # name in `module_path`. TandemNixlConnector is vLLM's NixlConnector with the NIXL
    # agent built from `nixl` below (vLLM's "NixlConnector" ignores those settings).
    connector: str = "TandemNixlConnector"
    # Import path of an out-of-tree connector module; wins over a registered name.
    module_path: str | None = None
    # Passed to the connector as kv_connector_extra_config.
    extra_config: dict[str, Any] = {}
    # Where NIXL registers the KV cache: "cpu" on CPU hosts, "cuda" on GPUs.
    buffer_device: Literal["cpu", "cuda"] = "cpu"
    # First NIXL side-channel port on each node; engines on one node get distinct ports.
    side_channel_base_port: Port = 5600
    # Run one request through every prefill->decode pair before reporting ready, so no
    # user request pays for the first NIXL handshake.
    prewarm_handshakes: bool = True
    # NIXL agent settings, used by TandemNixlConnector.
    nixl: NixlConfig = NixlConfig()
    # A KV transfer slower than this (seconds) is counted in tandem_kv_transfer_slow_total
    # and logged as a WARNING by the engine that received it.
    slow_transfer_s: Annotated[float, Meta(gt=0)] = 1.0


# How a router picks a replica within a pool (orchestrator.router, orchestrator.scoring).
Policy = Literal["round_robin", "least_outstanding", "kv_aware"]


class ScorerWeights(Struct, forbid_unknown_fields=True, frozen=True):
    """How much each of kv_aware's scorers counts (orchestrator.scoring); 0 turns one off.
    Every scorer gives an engine a score between 0 and 1 for one request."""

    # 1 / (1 + W / prompt tokens), W the prompt tokens the engine has to compute before this
    # request's first token: those queued on it, plus this prompt's beyond its prefix cache
    # (the CPU tier's counted at routing.kv_load_cost). Alone, it picks the least work.
    work: Annotated[float, Meta(ge=0)] = 1.0
    # Share of the prompt the engine holds in its own prefix cache (vLLM's KV events).
    prefix: Annotated[float, Meta(ge=0)] = 0.0
    # Share of the prompt beyond that in the CPU tier (blocks on other nodes count half).
    tier: Annotated[float, Meta(ge=0)] = 0.0
    # 1 / (1 + requests in flight on the engine, from every router).
    load: Annotated[float, Meta(ge=0)] = 0.0
    # Share of the engine's KV cache that is free.
    kv_free: Annotated[float, Meta(ge=0)] = 0.0


class RoutingConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # How the router picks a replica within a pool (healthy replicas only). kv_aware scores
    # each replica on what its prefix cache holds (vLLM's KV events), the CPU tier and load;
    # it beat round robin and least outstanding on every routing bench run since its `work`
    # scorer (docs/bench-results.md).
    policy: Policy = "kv_aware"
    scorers: ScorerWeights = ScorerWeights()
    # What loading one prompt token's KV (from the CPU tier, or over NIXL from a prefill
    # engine) costs, as a share of computing it (kv_aware's `work`). A copy over PCIe, the
    # network or from host memory is far cheaper than a prefill on either a GPU or a CPU.
    kv_load_cost: Annotated[float, Meta(ge=0, le=1)] = 0.1
    # What storing a prompt token's KV in a full prefix cache costs kv_aware's `work`, as a
    # share of computing one: it evicts another prefix's block (vLLM evicts the least recently
    # used), which that prefix's next request computes again. Without it a replica holding
    # only a shared system prompt drew every new chat and thrashed, while the others' caches
    # stayed empty; with it, prefixes spread once a cache is full, so the pool's caches hold
    # together what one cannot. An engine that saves to the CPU tier and loads from it counts
    # kv_load_cost instead (when lower): the evicted prefix's next request loads it back.
    evict_cost: Annotated[float, Meta(ge=0)] = 1.0
    # kv_aware leaves out replicas whose KV cache is at least this full, unless all are.
    max_kv_usage: Annotated[float, Meta(gt=0, le=1)] = 0.95
    # kv_aware: prefills each prefill replica must have answered a router before the line
    # it learned from them (orchestrator.speed: a fixed time per prefill plus a time per
    # prompt token) prices the replica against the others, in place of fixed factors for
    # the decode engines computing beside it (once two candidates have a line; one not timed
    # yet counts as the fastest). 0 (the default): never learned. For pools whose replicas
    # differ (GPUs of two generations, hosts of other loads); on the 2-core host's long
    # chats it matched the fixed factors (docs/bench-results.md, runs 164-167), e.g. 16.
    prefill_speed_samples: Annotated[int, Meta(ge=0)] = 0
    # Disaggregated deployments: whether a request is prefilled on the prefill pool
    # ("always"), on its decode engine ("never"), or per request ("conditional": on the
    # decode engine when little of the prompt is left to compute there, against what the
    # best prefill replica has queued before it).
    disaggregation: Literal["always", "never", "conditional"] = "always"
    # A remotely prefilled request's first token: "prefill" streams the token the prefill
    # engine sampled to the client at once, and the decode engine goes on from the prompt plus
    # that token (the KV move and the decode's first step leave the time to first token for
    # the gap before the second); "decode" has the decode engine sample it again after the
    # pull. Requests whose next tokens would depend on where the first was sampled (a seeded
    # sampler, frequency or presence penalties, bad words, a grammar, several sequences) take
    # "decode" either way, so every output is what one engine would give.
    first_token: Literal["prefill", "decode"] = "prefill"
    # conditional: prefill on the decode engine when the prompt tokens not already in its
    # prefix cache or the CPU tier (plus those of local prefills queued there), times the
    # requests that engine would hold up (those it runs, plus this one), are at most this
    # many plus what the best prefill replica would compute first beyond this request's
    # part there (its queue, and what it lacks of the prompt that the decode engine holds).
    local_prefill_max_tokens: Annotated[int, Meta(ge=0)] = 256
    # A prefill that has not answered after this long is abandoned and retried elsewhere.
    prefill_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # Other prefill replicas tried after a failed or timed-out prefill; when none is left
    # healthy, the decode engine prefills the request itself.
    prefill_retries: Annotated[int, Meta(ge=0)] = 2
    # Times one request may move to another engine after the engine streaming it failed
    # (it continues from the prompt plus the tokens already sent); past that, an error.
    max_migrations: Annotated[int, Meta(ge=0)] = 2


class HealthConfig(Struct, forbid_unknown_fields=True, frozen=True):
    """How the pool manager watches engine replicas (orchestrator.pools)."""

    # Every replica answers a cheap health call this often (it also reports its load).
    period_s: Annotated[float, Meta(gt=0)] = 1.0
    # A health call unanswered after this long counts as failed: the replica leaves routing
    # and is restarted. A dead process is noticed sooner, from Ray's own death notice.
    timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    # How long an engine may take to come up (start or restart) before it counts as failed.
    start_timeout_s: Annotated[float, Meta(gt=0)] = 900.0
    # Engine starts that may fail in a row (an error in vLLM's start-up, not a crash later)
    # before the replica is left down, with the error in the log and in `tandem status`.
    max_failed_starts: PositiveInt = 3


class ServeConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # Address the HTTP endpoint listens on, on every node that runs an ingress replica
    # ("direct") or a Serve proxy ("proxy").
    host: str = "127.0.0.1"
    port: Port = 8000
    # Who answers HTTP. "direct": each ingress replica itself, on host:port of its node (its
    # replicas on one node share the port): no Ray hop between client and ingress, and one
    # less for every streamed chunk (about 10 ms of TTFT on a 2-core host). "proxy": Ray
    # Serve's HTTP proxy on every node, which calls the replicas over Ray (what `serve run`
    # uses). All apps on one Ray cluster use one of the two.
    http: Literal["proxy", "direct"] = "direct"
    app_name: str = "tandem"
    route_prefix: str = "/"
    # Streamed tokens leave in chunks at most this many milliseconds apart; the first text
    # and a request's last tokens never wait. 0: each engine step's tokens leave as they
    # come, as vLLM's server streams them (an ingress that falls behind gets what waited as
    # one chunk, as vLLM's does, so chunks grow with load). Unset: 0 on GPU hosts with http
    # "direct"; 50 on CPU hosts, where every chunk's work (the engine actor's send, vLLM's
    # serving layer in the ingress) runs on the cores the engines compute on (per-token
    # streaming slowed a colocated engine's steps by 0.2-0.4 ms on 2 cores,
    # docs/performance.md), and behind Serve's proxy, where every chunk is one more Ray
    # message (50 is Ray Serve LLM's stream_batching_interval_ms).
    stream_batch_ms: Annotated[float, Meta(ge=0, le=1000)] | None = None
    # First port of the token path (requests and streamed outputs between routers and
    # engines, actors/stream.py) on each node; engines on one node take consecutive ports,
    # as with kv_transfer.side_channel_base_port. Unset: each engine listens on a port the OS
    # picks, fine where nodes reach each other on any port; set it where a firewall opens
    # only known ranges.
    token_path_base_port: Port | None = None
    # Ingress replicas (HTTP parsing, tokenization, routing); each has its own router, and
    # every router follows the engines' KV events itself, so they route alike.
    ingress_replicas: PositiveInt = 1
    # A request body larger than this is refused with 413 before it is read or parsed.
    max_request_bytes: PositiveInt = 4 * 1024 * 1024
    # Flags of `vllm serve`'s OpenAI front end, as on its command line: the ingress runs
    # vLLM's own serving layer with them, e.g. ["--enable-auto-tool-choice",
    # "--tool-call-parser", "hermes"], ["--chat-template", "tmpl.jinja"], ["--api-key", "k"].
    # Engine flags belong in engine_args (a reasoning parser too: the ingress takes it from
    # the engines' config).
    openai_args: list[str] = []
    # Every generative response names where it ran: X-Tandem-Engine (the engine that streamed
    # its output), X-Tandem-Prefill-Engine (the one that prefilled it remotely) and
    # X-Tandem-Disaggregation (remote or local, and why), one value per generation; the
    # headers leave with the first output, once the engines are chosen. False: none (the
    # engines' names stay inside the cluster).
    route_headers: bool = True
    # One INFO line per finished request in the ingress replica's log (logger
    # tandem.requests): its id, tokens, engines, disaggregation decision and phase times, as
    # vLLM's --enable-log-requests does for one engine.
    log_requests: bool = False


class CpuHostConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # KV cache per engine on CPU hosts, GiB (VLLM_CPU_KVCACHE_SPACE).
    kvcache_space_gib: PositiveInt = 1
    # Pin each engine's OpenMP threads to its own cores, split from the node's cores by
    # placement, and its other threads to a core it leaves out of OpenMP (a decode engine
    # with no core to spare: its node's prefill engines' cores). "off" leaves vLLM's own
    # binding (every engine on every core).
    bind_cores: Literal["auto", "off"] = "auto"
    # The nice value `tandem serve` gives its own session's scheduling group, on kernels that
    # group a session's processes (autogroup, sched_autogroup_enabled = 1): vLLM's CPU
    # workers spin for a second after every step, so a deployment's group would otherwise
    # hold every core it is given against any program started elsewhere on the host (a
    # client's requests waited up to 0.1-1.7 s behind them). 0 leaves it as any session.
    session_nice: Annotated[int, Meta(ge=0, le=19)] = 10


PoolRole = Literal["prefill", "decode", "both"]


class CpuTierConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # The cluster-wide CPU KV tier: an index actor plus one store actor per node that
    # hosts engines; engines save prompt KV blocks there and load shared prefixes back.
    # On by default: engines run TandemMultiConnector with [P/D connector, CPU tier]
    # (colocated: the tier alone). `enabled: false` gives the NIXL-only path, and is
    # required with `device: cuda` (the tier moves host-memory KV caches only, for now).
    enabled: bool = True
    # Host memory of each node's store pool, GiB (allocated up front).
    size_gib: Annotated[float, Meta(gt=0)] = 0.5
    # Pools whose engines write the KV blocks they compute to the tier, and pools whose
    # engines load held prefixes from it instead of computing them. Unset (null), both are
    # the pools that compute prompts: prefill and colocated engines, and decode engines too
    # when routing.disaggregation lets them prefill (conditional, never); decode engines
    # save in every mode when save_outputs is on. See TandemConfig.tier_pools.
    save_from: frozenset[PoolRole] | None = None
    load_into: frozenset[PoolRole] | None = None
    # Saving engines save the full blocks of the tokens they generate too, not only those of
    # the prompt. A chat's next turn resends the answer, whose KV only its decode engine
    # computed: with this the prefill engine loads the answer from the tier instead of
    # computing it again, where the client resends the tokens it got (token ids, or text that
    # tokenizes back to them). Off by default: on the long-chat bench with the server's
    # answers it cut the prompt tokens computed from 13% to 10% but not the TTFT, and the
    # decode engine's writes share its cores (docs/bench-results.md, run 67).
    save_outputs: bool = False
    # The port engines reach the tier's index on, on the head node (the index's channel).
    # Unset: one that is free when the deployment starts; a restarted index keeps it.
    index_port: Port | None = None
    # The tier's connector class and its module (a subclass of TandemCpuTierConnector
    # with another transfer path, or one that injects faults in tests).
    connector: str = "TandemCpuTierConnector"
    module_path: str = "connectors.offload"


class TandemConfig(Struct, forbid_unknown_fields=True, frozen=True):
    model: ModelConfig = ModelConfig()
    device: Literal["cpu", "cuda"] = "cpu"
    # vLLM engine args for every engine (AsyncEngineArgs field names).
    engine_args: dict[str, Any] = {}
    # Disaggregated pools. Leave both unset and set `colocated` for the baseline.
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    # Colocated baseline: engines that prefill and decode themselves (role "both").
    colocated: PoolConfig | None = None
    kv_transfer: KVTransferConfig = KVTransferConfig()
    routing: RoutingConfig = RoutingConfig()
    health: HealthConfig = HealthConfig()
    serve: ServeConfig = ServeConfig()
    cpu: CpuHostConfig = CpuHostConfig()
    cpu_tier: CpuTierConfig = CpuTierConfig()

    def __post_init__(self) -> None:
        if self.colocated is not None and (self.prefill is not None or self.decode is not None):
            raise ValueError(
                "`colocated` cannot be combined with `prefill`/`decode`: "
                "remove `colocated` for a disaggregated deployment, or the two pools for a colocated one"
            )
        if self.colocated is None and (self.prefill is None) != (self.decode is None):
            missing = "decode" if self.decode is None else "prefill"
            raise ValueError(f"a disaggregated deployment needs both pools: add a `{missing}` section")
        if self.device == "cuda" and self.cpu_tier.enabled:
            raise ValueError(
                "`cpu_tier.enabled` must be false with `device: cuda`: the CPU tier moves blocks of "
                "KV caches in host memory only (it registers them with NIXL as host memory); set "
                "`cpu_tier: {enabled: false}`"
            )
        self._check_port_ranges()
        for where, args in self._engine_arg_sets():
            for key in args:
                if key in RESERVED_ENGINE_ARGS:
                    raise ValueError(
                        f"`{where}.{key}` is set by Tandem: use `{RESERVED_ENGINE_ARGS[key]}` instead"
                    )

    def _check_port_ranges(self) -> None:
        """The ports engines take on a host (one of each kind per engine, as many engines as
        every pool's max_replicas) must not overlap each other or the HTTP port."""
        engines = sum(pool.max_size for pool in self.pools.values())
        spans = [("serve.port", self.serve.port, 1),
                 ("kv_transfer.side_channel_base_port", self.kv_transfer.side_channel_base_port, engines)]
        if self.serve.token_path_base_port is not None:
            spans.append(("serve.token_path_base_port", self.serve.token_path_base_port, engines))
        if self.cpu_tier.enabled and self.cpu_tier.index_port is not None:
            spans.append(("cpu_tier.index_port", self.cpu_tier.index_port, 1))
        for name, base, n in spans:
            if base + n - 1 > 65535:
                raise ValueError(f"`{name}` ({base}) leaves no room below 65536 for {n} engines' ports: lower it")
        def ports(base: int, n: int) -> str:
            return f"{base}" if n == 1 else f"{base}..{base + n - 1}, one port per engine"

        for (a, a_base, a_n), (b, b_base, b_n) in itertools.combinations(spans, 2):
            if a_base < b_base + b_n and b_base < a_base + a_n:
                raise ValueError(f"`{b}` ({ports(b_base, b_n)}) overlaps `{a}` ({ports(a_base, a_n)}): move one of them")

    def _engine_arg_sets(self) -> list[tuple[str, dict[str, Any]]]:
        sets = [("engine_args", self.engine_args)]
        for name, pool in self.pools.items():
            sets.append((f"{name}.engine_args", pool.engine_args))
        return sets

    @property
    def stream_batch_s(self) -> float:
        """The stream batching interval in effect, in seconds (see `serve.stream_batch_ms`)."""
        if self.serve.stream_batch_ms is not None:
            return self.serve.stream_batch_ms / 1000
        per_step = self.device == "cuda" and self.serve.http == "direct"
        return 0.0 if per_step else CHUNKED_STREAM_BATCH_S

    @property
    def disaggregated(self) -> bool:
        return self.colocated is None

    @property
    def pools(self) -> dict[str, PoolConfig]:
        """Pools by role: {"prefill", "decode"} or {"both"}."""
        if self.colocated is not None:
            return {"both": self.colocated}
        return {"prefill": self.prefill or PoolConfig(), "decode": self.decode or PoolConfig()}

    def prefilling_pools(self) -> frozenset[PoolRole]:
        """The pools whose engines compute prompts: decode engines too unless every request
        is disaggregated (`routing.disaggregation: always`)."""
        computing: frozenset[PoolRole] = frozenset({"prefill", "both"})
        return computing if self.routing.disaggregation == "always" else computing | {"decode"}

    def tier_pools(self) -> tuple[frozenset[PoolRole], frozenset[PoolRole]]:
        """The CPU tier's (save_from, load_into), defaults filled in. A decode engine that
        prefills locally and neither saves nor loads loses each prompt it computes to the
        rest of the cluster: a chat's next turn prefilled remotely computes its history
        again (2026-11-25: 29% of prompt tokens computed instead of 20%, TTFT p99 2x). With
        `save_outputs` a decode engine saves in every mode: the answers it generates are the
        part of a chat's next prompt that no prefill engine has computed. It writes only what
        the tier lacks (the index grants slots for new blocks only), and of a prompt pulled
        from a prefill engine that saves it, nothing: the router tells it so (TIER_SAVED)."""
        computing = self.prefilling_pools()
        tier = self.cpu_tier
        saving = computing | {"decode"} if tier.save_outputs else computing
        return (
            saving if tier.save_from is None else tier.save_from,
            computing if tier.load_into is None else tier.load_into,
        )

    def engine_args_for(self, role: str) -> dict[str, Any]:
        """Top-level engine args with the pool's overrides applied.

        On CPU hosts `enforce_eager` defaults to true: torch.compile's warm-up costs about
        45 s per engine on a small host, which start-up targets cannot afford; set it to
        false to trade start-up time for compiled kernels.
        """
        defaults: dict[str, Any] = {"enforce_eager": True} if self.device == "cpu" else {}
        return {**defaults, **self.engine_args, **self.pools[role].engine_args}


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"unknown field `(?P<field>[^`]+)`")


def _struct_at(path: str) -> type[Struct] | None:
    """The Struct type reached by a msgspec error path like `.prefill.engine_args`."""
    tp: Any = TandemConfig
    for part in filter(None, re.split(r"\.|\[\d+\]", path)):
        if not (isinstance(tp, type) and issubclass(tp, Struct)):
            return None
        hint = get_type_hints(tp, include_extras=True).get(part)
        if hint is None:
            return None
        args = [a for a in get_args(hint) if a is not type(None)] if get_origin(hint) else []
        tp = args[0] if args else hint
    return tp if isinstance(tp, type) and issubclass(tp, Struct) else None


def _choices_at(path: str) -> tuple[Any, ...]:
    """The values a Literal field at a msgspec error path may take (none if not a Literal)."""
    parent, _, name = path.rpartition(".")
    struct = _struct_at(parent)
    hint = get_type_hints(struct).get(name) if struct is not None else None
    return get_args(hint) if get_origin(hint) is Literal else ()


def _explain(err: msgspec.ValidationError, source: str) -> ConfigError:
    """Turn msgspec's message into one that names the field and the fix."""
    m = _AT.match(str(err))
    assert m is not None  # the pattern matches any string
    msg, path = m.group("msg"), (m.group("path") or "")
    field = path.lstrip(".") or "<top level>"
    fix = "see examples/ for valid configs"
    if unknown := _UNKNOWN.search(msg):
        struct = _struct_at(path)
        bad = unknown.group("field")
        field = f"{path.lstrip('.')}.{bad}".lstrip(".")
        if struct is not None:
            fix = f"remove it or use one of: {', '.join(struct.__struct_fields__)}"
    elif msg.startswith("Invalid enum value") and (choices := _choices_at(path)):
        fix = f"use one of: {', '.join(map(str, choices))}"
    elif msg == "Expected `str`, got `bool`":
        # YAML 1.1 reads an unquoted off/on/yes/no as a boolean.
        example = f", e.g. `{field.rpartition('.')[2]}: \"{choices[-1]}\"`" if (choices := _choices_at(path)) else ""
        fix = f"quote the value{example} (YAML reads unquoted off/on/yes/no as booleans)"
    elif msg.startswith("Expected"):
        fix = f"give `{field}` a value of the expected type"
    return ConfigError(f"{source}: invalid config field `{field}`: {msg}; fix: {fix}")


def parse_config(data: dict[str, Any] | None, source: str = "config") -> TandemConfig:
    """Build a TandemConfig from plain data (a dict from YAML/TOML/JSON, or None for defaults)."""
    try:
        return msgspec.convert(data or {}, TandemConfig)
    except msgspec.ValidationError as err:
        raise _explain(err, source) from None


def load_config(path: str | Path | None) -> TandemConfig:
    """Load a config file by extension (.yaml/.yml, .toml, .json); None gives the embedded default."""
    if path is None:
        return TandemConfig()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; fix: pass the path of a YAML, TOML or JSON file")
    text = p.read_text()
    try:
        match p.suffix.lower():
            case ".yaml" | ".yml":
                data = yaml.safe_load(text)
            case ".toml":
                data = tomllib.loads(text)
            case ".json":
                data = json.loads(text)
            case other:
                raise ConfigError(
                    f"config file {str(p)!r} has unknown extension {other!r}; fix: use .yaml, .yml, .toml or .json"
                )
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"config file {str(p)!r} is not valid {p.suffix[1:].upper()}: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level, not {type(data).__name__}")
    return parse_config(data, source=str(p))


def to_dict(cfg: TandemConfig) -> dict[str, Any]:
    """Plain-data form (for Serve deployment args, job logs and benchmark result files)."""
    return msgspec.to_builtins(cfg)
