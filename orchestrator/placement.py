"""Where engines run and what each engine process is told about it.

Everything here is derived from Ray: the node a placement group put a replica on, that
node's IP, and the cores that node's processes may use. Nothing assumes localhost or a
single node.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, defaultdict
from typing import Any

import msgspec
import ray
from ray._common.constants import HEAD_NODE_RESOURCE_NAME
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.affinity import lacks_half_precision, node_cores
from actors.protocol import Role
from orchestrator.config import PoolConfig
from orchestrator.models import resolve_local

# A sliver of the resource only Ray's head node has: control-plane singletons (the pool
# manager, the CPU tier's index) run where Ray Serve runs its controller, on the one node a
# cluster does not lose to scaling down or a reclaimed spot instance. Elsewhere, losing
# their node would leave the pools unwatched and the tier's blocks unfindable.
ON_HEAD_NODE = {HEAD_NODE_RESOURCE_NAME: 0.001}


class NodeFacts(msgspec.Struct, frozen=True):
    node_id: str
    node_ip: str
    # Cores this node's processes may use (its CPU affinity mask).
    cores: list[int]
    # The model as vLLM opens it on this node (see orchestrator.models.resolve_local).
    model_path: str
    # Whether its CPU computes half precision without native instructions
    # (actors.affinity.lacks_half_precision).
    lacks_half_precision: bool = False


class EngineSlot(msgspec.Struct, frozen=True):
    """One engine's place: its node, its ports and the cores it binds to."""

    node_id: str
    node_ip: str
    model_path: str
    side_channel_port: int
    # VLLM_CPU_OMP_THREADS_BIND value ("0,1,2", or "0|1" for TP ranks); None: unbound.
    cpu_binding: str | None
    # The engine's own cores (its share of the node); None: unbound.
    cores: list[int] | None = None
    # The token path's port (actors.stream); None: the OS picks one.
    stream_port: int | None = None
    # Where the engine's processes run apart from its compute threads (the actor, vLLM's
    # engine core, NIXL); None: on `cores`. See `process_cores`.
    process_cores: list[int] | None = None

    @property
    def pinned_to(self) -> list[int] | None:
        """The cores the engine's whole process tree is confined to (its compute threads then
        bind to `cpu_binding` within or beside them)."""
        return self.process_cores or self.cores


class PortBases(msgspec.Struct, frozen=True):
    """The first port of each kind on a host: an engine that is the k-th on its host takes
    base + k of each, so engines sharing a host never collide."""

    side_channel: int
    # None: each engine's token path binds a port the OS picks.
    stream: int | None = None

    def slot_ports(self, k: int) -> tuple[int, int | None]:
        """(side-channel port, token-path port) of the k-th engine on a host."""
        return self.side_channel + k, None if self.stream is None else self.stream + k


@ray.remote(num_cpus=0)
def _probe(model_source: str) -> tuple[list[int], str, bool]:
    return node_cores(), resolve_local(model_source), lacks_half_precision()


async def node_facts(node_ids: set[str], model_source: str) -> dict[str, NodeFacts]:
    """Probe each node with a zero-CPU task pinned to it: usable cores, the model folder and
    whether its CPU computes half precision natively.
    (Awaited, so the pool manager's event loop keeps serving while a node prepares the model.)"""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    nids = sorted(node_ids)
    answers = await asyncio.gather(*(
        _probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(model_source)
        for nid in nids
    ))
    return {nid: NodeFacts(nid, ips[nid], cores, model_path, lacks) for nid, (cores, model_path, lacks) in zip(nids, answers)}


def _share(items: list[int], parts: int, i: int) -> list[int]:
    """Part i of `items` cut into `parts` contiguous, disjoint slices; shared when too few."""
    per = len(items) // parts
    return items[i * per : (i + 1) * per] if per else [items[i % len(items)]]


def engine_cores(cores: list[int], num_engines: int, index: int) -> list[int]:
    """The cores of engine `index` of `num_engines` sharing `cores`: disjoint contiguous
    slices while there are enough cores, shared round robin otherwise, whatever the roles
    and the disaggregation mode. Spread so, two prompts arriving together compute side by
    side, and a conditional deployment's remote prefills run where an always-disaggregating
    one's do; the decider sees a shared core through the prompts queued on the engines
    sharing it (`EngineRef.shares_cores`). Keeping a decode engine that prefills apart from
    the replicas (2026-12-04/05) crowded the replicas onto the other cores: on long chats,
    where most prompts go remote, conditional was then 1.09x always at TTFT p50; spread, it
    is level there and on short chats at p99 (docs/bench-results.md, "Conditional placed as
    always")."""
    return _share(cores, num_engines, index)


def omp_binding(mine: list[int], tp: int) -> str:
    """The VLLM_CPU_OMP_THREADS_BIND of an engine owning cores `mine`, with `tp` ranks.

    The last core is left out of OpenMP whenever every rank still gets one: it runs the
    engine's threads that are not OpenMP (vLLM's scheduler process, the actor's event loop,
    NIXL/UCX, Python threads), which would otherwise preempt a compute thread mid-step.
    Each rank gets a sub-slice; ranks are joined by "|".
    """
    usable = mine[:-1] if len(mine) > tp else mine
    return "|".join(",".join(map(str, _share(usable, tp, r))) for r in range(tp))


def binding_cores(binding: str) -> set[int]:
    """Every core a VLLM_CPU_OMP_THREADS_BIND value ("0,1|2,3") names."""
    return {int(c) for rank in binding.split("|") for c in rank.split(",") if c}


def control_cores(cores: list[int], engines: list[tuple[str, str | None]]) -> list[int] | None:
    """Where a host's processes other than engines (Ray's daemons, Serve's proxy and the
    ingress, the pool manager, the CPU tier) run, beside `engines` (role, OpenMP binding);
    None: anywhere on `cores`.

    Off every engine's compute cores where the engines leave some free (the spare cores
    `omp_binding` keeps for their own other threads); else on the prefill engines' compute
    cores, since a prefill engine computes in bursts while every streamed token waits on a
    decode step. A 1P1D deployment on a 2-core host thus runs all of them on the prefill
    engine's core: a client in another session of that host saw TTFT p50 at 18-25 ms against
    22-113 ms with them floating (docs/performance.md, "A client in another session of the
    same host"). None while some engine is unbound, or where every core streams tokens.
    """
    if not engines or any(binding is None for _, binding in engines):
        return None
    computing = set().union(*(binding_cores(b) for _, b in engines if b))
    streaming = set().union(*(binding_cores(b) for role, b in engines if b and role != "prefill"))
    for busy in (computing, streaming):
        if free := [c for c in cores if c not in busy]:
            return free
    return None


def process_cores(role: Role, mine: list[int], tp: int, prefill_cores: list[list[int]]) -> list[int] | None:
    """Where an engine runs its processes apart from its compute threads (None: on `mine`).

    An engine with a core to spare runs them there (`omp_binding` leaves it out of OpenMP).
    A decode engine whose every core computes runs them on its node's prefill engines'
    cores instead: its steps are on every streamed token's path, and its engine core's
    scheduling loop, the actor's vLLM front end and NIXL would otherwise preempt each step's
    forward pass, while a prefill engine computes in bursts. A plain vLLM server likewise
    runs its forward pass on a core of its own (docs/performance.md, "Where a decode
    engine's other threads run").
    """
    if role != "decode" or len(mine) > tp:
        return None
    theirs = sorted({c for cores in prefill_cores for c in cores} - set(mine))
    return theirs or None


def assign_slots(
    replica_nodes: list[str],
    roles: list[Role],
    tp_sizes: list[int],
    ports: PortBases,
    bind_cores: bool,
    facts: dict[str, NodeFacts],
) -> list[EngineSlot]:
    """Give every engine distinct ports on its host and its own cores.

    `replica_nodes[i]` is the node engine i (in `roles[i]`) was placed on. Ports are counted
    per node IP, not per Ray node, so several Ray nodes on one host (ray.cluster_utils.Cluster,
    or raylets sharing a machine) never hand out the same port twice. Cores are split among
    the engines of each Ray node, which is what its affinity mask covers.
    """
    per_node: dict[str, list[int]] = defaultdict(list)
    per_ip: dict[str, list[int]] = defaultdict(list)
    for i, nid in enumerate(replica_nodes):
        per_node[nid].append(i)
        per_ip[facts[nid].node_ip].append(i)
    shares: list[list[int] | None] = []
    for i, nid in enumerate(replica_nodes):
        shares.append(engine_cores(facts[nid].cores, len(per_node[nid]), per_node[nid].index(i)) if bind_cores else None)
    slots: list[EngineSlot] = []
    for i, nid in enumerate(replica_nodes):
        side, stream = ports.slot_ports(per_ip[facts[nid].node_ip].index(i))
        prefills = [shares[j] or [] for j in per_node[nid] if roles[j] == "prefill"]
        slots.append(_slot(facts[nid], side, stream, roles[i], tp_sizes[i], shares[i], prefills))
    return slots


def _slot(f: NodeFacts, side: int, stream: int | None, role: Role, tp: int, mine: list[int] | None,
          prefill_cores: list[list[int]]) -> EngineSlot:
    """An engine's slot on node `f` with cores `mine` (None: unbound), beside prefill engines
    holding `prefill_cores` there."""
    if mine is None:
        return EngineSlot(f.node_id, f.node_ip, f.model_path, side, None, None, stream)
    return EngineSlot(f.node_id, f.node_ip, f.model_path, side, omp_binding(mine, tp), mine, stream,
                      process_cores(role, mine, tp, prefill_cores))


class SlotAllocator:
    """Engine slots for a pool that changes size: side-channel ports stay unique per host and
    a new engine takes the cores its node's live engines use least.

    The first replicas are placed together (`place_all`: the node's cores split evenly, as
    `assign_slots` does); replicas added later (`place_one`, when a pool grows or a replica
    lands on another node) get a share of the node's cores as if the node had one engine
    more, taken from its least used cores, since live engines keep their binding.
    """

    def __init__(self, ports: PortBases, bind_cores: bool, model_source: str) -> None:
        self.ports = ports
        self.bind_cores = bind_cores
        self.model_source = model_source
        self._facts: dict[str, NodeFacts] = {}
        self._live: list[tuple[Role, EngineSlot]] = []

    async def place_all(self, replica_nodes: list[str], roles: list[Role], tp_sizes: list[int]) -> list[EngineSlot]:
        await self._probe(set(replica_nodes))
        slots = assign_slots(replica_nodes, roles, tp_sizes, self.ports, self.bind_cores, self._facts)
        self._live.extend(zip(roles, slots))
        return slots

    async def place_one(self, node_id: str, role: Role, tp: int) -> EngineSlot:
        await self._probe({node_id})
        f = self._facts[node_id]
        here = [(r, s) for r, s in self._live if s.node_id == node_id]
        used = {s.side_channel_port - self.ports.side_channel for _, s in self._live if s.node_ip == f.node_ip}
        side, stream = self.ports.slot_ports(next(k for k in itertools.count() if k not in used))
        mine = least_used_cores(f.cores, [s.cores or [] for _, s in here]) if self.bind_cores else None
        slot = _slot(f, side, stream, role, tp, mine, [s.cores or [] for r, s in here if r == "prefill"])
        self._live.append((role, slot))
        return slot

    def lacking_half_precision(self) -> list[str]:
        """The probed nodes whose CPUs compute half precision without native instructions."""
        return sorted(n for n, f in self._facts.items() if f.lacks_half_precision)

    def release(self, slot: EngineSlot) -> None:
        self._live = [(r, s) for r, s in self._live if s != slot]

    async def _probe(self, node_ids: set[str]) -> None:
        if new := node_ids - self._facts.keys():
            self._facts.update(await node_facts(new, self.model_source))


def least_used_cores(cores: list[int], live: list[list[int]]) -> list[int]:
    """The cores of one more engine on a node whose live engines hold `live`: an even share
    of the node (as if it had len(live) + 1 engines), the least used cores first, in order."""
    share = max(1, len(cores) // (len(live) + 1))
    use = Counter(c for held in live for c in held)
    return sorted(sorted(cores, key=lambda c: (use[c], c))[:share])


def placement_bundles(pool: PoolConfig, device: str) -> list[dict[str, float]]:
    """The placement-group bundles of one replica.

    One bundle holds the engine actor and, with tensor_parallel_size 1, its device. With TP
    on GPUs, vLLM's Ray executor starts one worker per bundle holding exactly one GPU in the
    actor's placement group (vllm/v1/executor/ray_utils.py), so the replica reserves a CPU
    bundle for the actor plus one {"GPU": 1} bundle per rank, packed on one node. On CPU
    hosts TP ranks are local processes (vLLM's multiprocessing executor) sharing the one
    bundle's cores.
    """
    head = {"CPU": pool.num_cpus, **pool.resources}
    if device == "cuda" and pool.tensor_parallel_size > 1:
        return [_nonzero(head)] + [{"GPU": 1.0} for _ in range(pool.tensor_parallel_size)]
    return [_nonzero({**head, "GPU": pool.num_gpus})]


def actor_resources(pool: PoolConfig, device: str) -> dict[str, Any]:
    """The engine actor's own resource request, inside bundle 0 of `placement_bundles`."""
    gpus = 0.0 if device == "cuda" and pool.tensor_parallel_size > 1 else pool.num_gpus
    return {"num_cpus": pool.num_cpus, "num_gpus": gpus, "resources": dict(pool.resources)}


def _nonzero(bundle: dict[str, float]) -> dict[str, float]:
    """Ray refuses empty bundles and zero amounts; a replica asking for nothing takes a sliver of a CPU."""
    return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
