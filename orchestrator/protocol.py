"""Control-plane messages: what the pool manager tells routers, the ingress and operators.

Plain msgspec Structs with no behaviour, importable from every layer (the router, the Serve
ingress, the `tandem status` CLI) without pulling in Ray Serve or vLLM.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from actors.protocol import Role

# starting: placed, engine coming up for the first time; healthy: in routing; unhealthy:
# failed a health check or a call, out of routing, about to restart; restarting: its process
# is coming back (Ray restarts it in the same placement group); draining: out of routing
# because the pool shrinks, stopped once its requests are done.
ReplicaState = Literal["starting", "healthy", "unhealthy", "restarting", "draining"]
REPLICA_STATES: tuple[ReplicaState, ...] = ("starting", "healthy", "unhealthy", "restarting", "draining")


class EngineRef(msgspec.Struct, frozen=True):
    """An engine as a router sees it: an id, a role, the Ray actor handle (control calls), the
    token path's address (requests and outputs), and the incarnation (process start) they
    reached when the engine was last seen healthy."""

    engine_id: str
    role: Role
    handle: Any
    incarnation: str = ""
    # How the engine keys its prefix blocks (EngineInfo): what a cache-aware router needs to
    # compute, from a prompt's tokens, the keys the engine's KV events carry.
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str = "vllm-none-hash"  # vLLM's own default for sha256 without PYTHONHASHSEED
    node_id: str = ""
    # Whether the engine loads prefixes from the CPU tier (cpu_tier.load_into): only then does
    # the tier save it computation.
    loads_tier: bool = False
    # The engine's KV cache in blocks (0: unknown); what a router weighs evictions against.
    num_blocks: int = 0
    # Where the router sends requests and reads their outputs (EngineInfo.stream_address).
    stream_address: str = ""
    # Whether the engine saves what it computes to the CPU tier (cpu_tier.save_from): a
    # prefix it then evicts from its own cache can be loaded back rather than computed.
    saves_tier: bool = False
    # The host (its IP: Ray nodes of one host share its cores) and the cores its forward
    # passes run on (its OpenMP binding; empty: unbound, or not a CPU engine). Engines whose
    # cores overlap compute their prompts in turns, so each one's queue delays the others'.
    node_ip: str = ""
    compute_cores: tuple[int, ...] = ()
    # The cores its processes run on (the actor with vLLM's front end and the token path, the
    # engine core's loop): a decode engine with no core to spare runs them on its node's
    # prefill engines' cores (orchestrator.placement.process_cores); empty: unbound.
    process_cores: tuple[int, ...] = ()

    def shares_cores(self, other: EngineRef) -> bool:
        """Whether `other`, another engine, computes on some of this engine's cores."""
        return self._runs_on_my_cores(other, other.compute_cores)

    def steps_beside(self, decoder: EngineRef) -> bool:
        """Whether `decoder`'s decoding runs on some of this engine's compute cores: its
        forward passes, or its processes, which handle every token it streams."""
        return self._runs_on_my_cores(decoder, (*decoder.compute_cores, *decoder.process_cores))

    def _runs_on_my_cores(self, other: EngineRef, cores: tuple[int, ...]) -> bool:
        """Whether `cores` of `other`, another engine on this engine's host, meet its compute cores."""
        return (other.engine_id != self.engine_id and other.node_ip == self.node_ip
                and not set(self.compute_cores).isdisjoint(cores))


class RoutingTable(msgspec.Struct, frozen=True):
    """The engines requests may go to now (healthy replicas only); `version` grows with
    every change, so routers long-poll for the next one."""

    version: int
    engines: list[EngineRef]


class ReplicaStatus(msgspec.Struct, frozen=True):
    id: str
    state: ReplicaState
    # The node's IP and the pid of the actor process serving the replica (None while it
    # has no live process).
    node: str | None
    pid: int | None
    # Requests in flight on the engine at its last health check.
    outstanding: int
    # Times the replica's engine was restarted after a failure.
    restarts: int
    incarnation: str | None = None
    # The last failure, in words (None when it never failed).
    last_error: str | None = None
    # Health checks that went unanswered (each is confirmed by a second before a restart).
    missed_checks: int = 0
    # The live process's vLLM children (engine core, workers: what a profiler attaches to),
    # the cores its processes run on apart from its OpenMP compute threads (None: unbound)
    # and the cores those are bound to (vLLM's VLLM_CPU_OMP_THREADS_BIND); while it has no
    # live process, the cores it will get back.
    child_pids: list[int] = []
    cores: list[int] | None = None
    cpu_binding: str | None = None


class PoolStatus(msgspec.Struct, frozen=True):
    role: Literal["prefill", "decode", "colocated"]
    min_replicas: int
    max_replicas: int
    replicas: list[ReplicaStatus]

    @property
    def num_healthy(self) -> int:
        return sum(r.state == "healthy" for r in self.replicas)


class TierStatus(msgspec.Struct, frozen=True):
    """The CPU tier's fill: blocks held over slots, per store and in all."""

    blocks: int
    capacity: int
    pinned: int
    # Slots reserved for saves not yet written (none while no engine is saving).
    open_grants: int
    # store id -> [blocks held, capacity in slots]
    stores: dict[str, tuple[int, int]]
    # Counts since the index (re)started: lookups, the blocks they found, blocks saved, blocks
    # evicted for room, blocks lost with a store that died or restarted, and pins and slot
    # grants reclaimed by their lease because nobody released them (an engine died mid-way).
    lookups: int = 0
    hit_blocks: int = 0
    saved_blocks: int = 0
    evicted_blocks: int = 0
    forgotten_blocks: int = 0
    expired_pins: int = 0
    expired_grants: int = 0


class DeploymentStatus(msgspec.Struct, frozen=True):
    app: str
    pools: list[PoolStatus]
    # None when the tier is off, or its index did not answer.
    cpu_tier: TierStatus | None = None

    @property
    def health(self) -> Literal["ok", "degraded", "down"]:
        """down: some role has no healthy replica; degraded: every role has one, not every replica is."""
        if any(p.num_healthy == 0 for p in self.pools):
            return "down"
        if any(p.num_healthy < len(p.replicas) for p in self.pools):
            return "degraded"
        return "ok"


def pool_role(role: Role) -> Literal["prefill", "decode", "colocated"]:
    """The name operators see for an engine role ("both" engines form the colocated pool)."""
    return "colocated" if role == "both" else role
